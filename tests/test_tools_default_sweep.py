"""tools.heads_per_cta: each kernel_bench run times its kernel with the module default set to
one value, the default comes back afterwards (also when a run fails), and each run is compared
with the first (CPU: kernel_bench and the comparison are stand-ins that record what they were
given)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cute_kernels import gdn_replay_output
from experiments import kernel_bench
from tools import compare_bench, heads_per_cta


@dataclass(frozen=True)
class Tool:
    main: object
    module: object
    attr: str
    option: str
    values: tuple  # the values given (odd order: the first is the reference)
    csv: str  # the CSV name of a value
    kernels: str


TOOLS = {
    "heads_per_cta": Tool(heads_per_cta.main, gdn_replay_output, "DEFAULT_HEADS_PER_CTA",
                          "--heads", (3, 1, 8), "heads_{}.csv", "cute:nonflush:nvfp4"),
}


@pytest.mark.parametrize("name", TOOLS)
def test_each_run_sees_its_value_and_the_default_is_restored(name, monkeypatch, tmp_path):
    t = TOOLS[name]
    seen, compared = [], []

    def bench(argv):
        seen.append((getattr(t.module, t.attr), argv))
        return 0

    monkeypatch.setattr(kernel_bench, "main", bench)
    monkeypatch.setattr(compare_bench, "main", lambda argv: compared.append(argv) or 0)
    before = getattr(t.module, t.attr)
    assert t.main([t.option, ",".join(map(str, t.values)), "--out-dir", str(tmp_path), "--",
                   "--batches", "5,256", "--windows", "7"]) == 0
    assert [value for value, _ in seen] == list(t.values)
    for value, argv in seen:
        assert argv[argv.index("--out") + 1] == str(tmp_path / t.csv.format(value))
        assert argv[argv.index("--kernels") + 1] == t.kernels
        assert argv[-4:] == ["--batches", "5,256", "--windows", "7"]
    first = str(tmp_path / t.csv.format(t.values[0]))
    assert compared == [[first, str(tmp_path / t.csv.format(v))] for v in t.values[1:]]
    assert getattr(t.module, t.attr) == before


@pytest.mark.parametrize("name", TOOLS)
def test_a_failing_run_stops_the_sweep_and_restores_the_default(name, monkeypatch, tmp_path):
    t = TOOLS[name]
    calls = []
    monkeypatch.setattr(kernel_bench, "main", lambda argv: calls.append(argv) or 2)
    before = getattr(t.module, t.attr)
    assert t.main([t.option, ",".join(map(str, t.values)), "--out-dir", str(tmp_path)]) == 2
    assert len(calls) == 1
    assert getattr(t.module, t.attr) == before


@pytest.mark.parametrize("name, argv, message", [
    ("heads_per_cta", ["--heads", "0,2"], "expected distinct ints in [1, 16]"),
    ("heads_per_cta", ["--heads", "2,2"], "expected distinct ints in [1, 16]"),
    ("heads_per_cta", ["--heads", "a"], "expected comma-separated ints"),
    ("heads_per_cta", ["--", "--kernels", "x"], "--kernels is set by the tool"),
    ("heads_per_cta", ["--kernel", "mamba3-flush"], "argument --kernel: invalid choice"),
])
def test_bad_arguments_are_named(name, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        TOOLS[name].main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
