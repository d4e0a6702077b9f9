"""tools.compare_bench pairs two kernel_bench CSVs point by point and refuses what is not one."""

import shutil
from pathlib import Path

import pandas as pd
import pytest

from tools import compare_bench

RUNS = Path(__file__).resolve().parent.parent / "results" / "kernel_bench_same_kernels"
OLD, NEW = RUNS / "tuned_4ec928a.csv", RUNS / "product_346311a.csv"


def _copy(source: Path, target: Path, edit=None) -> Path:
    """A copy of a committed kernel_bench CSV (without its meta.json), edited as a frame."""
    if edit is None:
        shutil.copy(source, target)
        return target
    frame = pd.read_csv(source, dtype=str, keep_default_na=False)
    edit(frame).to_csv(target, index=False, lineterminator="\n")
    return target


def test_the_ratio_is_new_over_old_and_points_of_one_run_are_named(tmp_path):
    """Every point timed in both runs gets one row whose ratio is new / old (the non-flush
    NVFP4 step at batch 256, cursor 8: 73.90 / 73.79 = 1.001); a point dropped from the new
    run is listed as timed in one run only."""
    def drop_flush(frame):
        return frame[~((frame.kernel == "cute:flush:fp32") & (frame.batch == "1"))]

    old = compare_bench.timed_points(_copy(OLD, tmp_path / "old.csv"))
    new = compare_bench.timed_points(_copy(NEW, tmp_path / "new.csv", drop_flush))
    lines = compare_bench.table(old, new)
    rows = {tuple(line.split()[:4]): line.split() for line in lines[1:]
            if line.startswith("cute:")}
    assert len(rows) == len(old) - 1 == len(new)
    step = rows[("cute:nonflush:nvfp4", "256", "16", "8")]
    assert float(step[6]) == pytest.approx(float(step[5]) / float(step[4]), abs=1e-3)
    assert lines[-1] == "timed in one run only: cute:flush:fp32 batch 1 L 16 cursor 15"
    assert "old copy ceiling GB/s: 3024" in lines


def test_a_repeated_point_is_refused_with_the_file_named(tmp_path):
    path = _copy(OLD, tmp_path / "twice.csv", lambda f: pd.concat([f, f.iloc[[0]]]))
    with pytest.raises(SystemExit) as caught:
        compare_bench.timed_points(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_csv_of_another_experiment_is_refused_in_one_line(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("step,rel_err\n1,0.5\n")
    with pytest.raises(SystemExit, match="other.csv") as caught:
        compare_bench.timed_points(path)
    assert "\n" not in str(caught.value)
