"""tools.gdn_flush_fold: each kernel_bench run times the GDN flush in its own fold order, and
the kernel's default comes back afterwards (CPU: kernel_bench and the comparison are
stand-ins that record what they were given)."""

from __future__ import annotations

import pytest

from cute_kernels import gdn_replay_flush
from experiments import kernel_bench
from tools import compare_bench
from tools import gdn_flush_fold as tool


def test_the_tools_folds_are_the_kernels():
    assert tool.FOLDS == gdn_replay_flush.FOLDS


def test_each_run_sees_its_fold_and_the_default_is_restored(monkeypatch, tmp_path):
    seen, compared = [], []

    def bench(argv):
        seen.append((gdn_replay_flush.DEFAULT_FOLD, argv))
        return 0

    monkeypatch.setattr(kernel_bench, "main", bench)
    monkeypatch.setattr(compare_bench, "main", lambda argv: compared.append(argv) or 0)
    before = gdn_replay_flush.DEFAULT_FOLD
    assert tool.main(["--folds", "chunked,sequential", "--out-dir", str(tmp_path), "--",
                      "--batches", "3,256", "--windows", "9"]) == 0
    assert [fold for fold, _ in seen] == ["chunked", "sequential"]
    for fold, argv in seen:
        assert argv[argv.index("--out") + 1] == str(tmp_path / f"fold_{fold}.csv")
        assert argv[argv.index("--kernels") + 1] == "cute:flush:fp16sr+nvfp4,cute:flush:fp32"
        assert argv[-4:] == ["--batches", "3,256", "--windows", "9"]
    assert compared == [[str(tmp_path / "fold_chunked.csv"),
                         str(tmp_path / "fold_sequential.csv")]]
    assert gdn_replay_flush.DEFAULT_FOLD == before


def test_a_failing_run_stops_the_sweep_and_restores_the_default(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(kernel_bench, "main", lambda argv: calls.append(argv) or 3)
    before = gdn_replay_flush.DEFAULT_FOLD
    assert tool.main(["--out-dir", str(tmp_path)]) == 3
    assert len(calls) == 1
    assert gdn_replay_flush.DEFAULT_FOLD == before


@pytest.mark.parametrize("argv, message", [
    (["--folds", "chunk"], "expected distinct folds among sequential, chunked"),
    (["--folds", "chunked,chunked"], "expected distinct folds"),
    (["--", "--out", "x.csv"], "--out is set by the tool"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
