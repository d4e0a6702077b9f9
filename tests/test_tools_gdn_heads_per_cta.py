"""tools.gdn_heads_per_cta: each kernel_bench run times the GDN non-flush kernel at its own
heads a CTA, and the kernel's default comes back afterwards (CPU: kernel_bench and the
comparison are stand-ins that record what they were given)."""

from __future__ import annotations

import pytest

from cute_kernels import gdn_replay_output
from experiments import kernel_bench
from tools import compare_bench
from tools import gdn_heads_per_cta as tool


def test_each_run_sees_its_heads_a_cta_and_the_default_is_restored(monkeypatch, tmp_path):
    seen, compared = [], []

    def bench(argv):
        seen.append((gdn_replay_output.DEFAULT_HEADS_PER_CTA, argv))
        return 0

    monkeypatch.setattr(kernel_bench, "main", bench)
    monkeypatch.setattr(compare_bench, "main", lambda argv: compared.append(argv) or 0)
    before = gdn_replay_output.DEFAULT_HEADS_PER_CTA
    assert tool.main(["--heads", "3,1,8", "--out-dir", str(tmp_path), "--",
                      "--batches", "5,256", "--windows", "7"]) == 0
    assert [heads for heads, _ in seen] == [3, 1, 8]
    for heads, argv in seen:
        assert argv[argv.index("--out") + 1] == str(tmp_path / f"heads_{heads}.csv")
        assert argv[argv.index("--kernels") + 1] == "cute:nonflush:nvfp4"
        assert argv[-4:] == ["--batches", "5,256", "--windows", "7"]
    assert compared == [[str(tmp_path / "heads_3.csv"), str(tmp_path / f"heads_{h}.csv")]
                        for h in (1, 8)]
    assert gdn_replay_output.DEFAULT_HEADS_PER_CTA == before


def test_a_failing_run_stops_the_sweep_and_restores_the_default(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(kernel_bench, "main", lambda argv: calls.append(argv) or 2)
    before = gdn_replay_output.DEFAULT_HEADS_PER_CTA
    assert tool.main(["--heads", "2,4", "--out-dir", str(tmp_path)]) == 2
    assert len(calls) == 1
    assert gdn_replay_output.DEFAULT_HEADS_PER_CTA == before


@pytest.mark.parametrize("argv, message", [
    (["--heads", "0,2"], "expected distinct ints in [1, 16]"),
    (["--heads", "2,2"], "expected distinct ints in [1, 16]"),
    (["--heads", "a"], "expected comma-separated ints"),
    (["--", "--kernels", "x"], "--kernels is set by the tool"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
