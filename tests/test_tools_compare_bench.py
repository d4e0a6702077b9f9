"""tools.compare_bench pairs two kernel_bench CSVs point by point and refuses what is not one."""

import pandas as pd
import pytest

from tools import compare_bench

COLUMNS = ("run", "kernel", "step", "batch", "window", "cursor", "time_us", "frac_copy",
           "copy_gbps", "status")


def _csv(path, rows):
    pd.DataFrame(rows, columns=COLUMNS).to_csv(path, index=False)
    return path


def test_the_ratio_is_new_over_old_for_points_in_both_and_the_rest_is_named(tmp_path):
    """Old 50 µs, new 55 µs at batch 256: ratio 1.100; a point timed in one run only is listed,
    a token row and a skipped point are not compared."""
    old = _csv(tmp_path / "old.csv", [
        ("A", "cute:nonflush:nvfp4", "nonflush", 256, 16, 8, 50.0, 0.85, 4259.0, "ok"),
        ("A", "cute:flush:fp32", "flush", 7, 16, 15, 9.0, 0.3, 4259.0, "ok"),
        ("A", "two-precision", "token", 256, 16, "", 90.0, float("nan"), 4259.0, "ok"),
    ])
    new = _csv(tmp_path / "new.csv", [
        ("A", "cute:nonflush:nvfp4", "nonflush", 256, 16, 8, 55.0, 0.77, 4101.0, "ok"),
        ("A", "cute:update:fp32", "update", 3, 16, 0, 5.0, 0.5, 4101.0, "skipped"),
    ])
    lines = compare_bench.table(compare_bench.timed_points(old), compare_bench.timed_points(new))
    body = [line for line in lines[1:] if line.startswith("cute:")]
    assert len(body) == 1 and body[0].split()[:7] == [
        "cute:nonflush:nvfp4", "256", "16", "8", "50.00", "55.00", "1.100"]
    assert "old copy ceiling GB/s: 4259" in lines and "new copy ceiling GB/s: 4101" in lines
    assert lines[-1] == "timed in one run only: cute:flush:fp32 batch 7 L 16 cursor 15"


@pytest.mark.parametrize("rows, message", [
    ([("A", "k", "flush", 1, 16, 15, 9.0, 0.3, 1.0, "ok")] * 2, "appears twice"),
])
def test_a_repeated_point_is_refused_with_the_file_named(tmp_path, rows, message):
    path = _csv(tmp_path / "twice.csv", rows)
    with pytest.raises(SystemExit, match=message) as caught:
        compare_bench.timed_points(path)
    assert str(path) in str(caught.value)


def test_a_csv_of_another_experiment_is_named_as_such(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("step,rel_err\n1,0.5\n")
    with pytest.raises(SystemExit, match="not a kernel_bench CSV"):
        compare_bench.timed_points(path)
