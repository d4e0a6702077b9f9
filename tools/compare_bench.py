"""Compare two kernel_bench CSVs point by point: the same kernels timed by two trees (or two
machines) back to back on one machine, e.g. a kernel change against the code before it.

    python -m tools.compare_bench OLD.csv NEW.csv

Prints one row per (kernel, batch, window, cursor) timed in both: each run's median time (µs),
the ratio new / old, and each run's fraction of its own copy ceiling; then both copy ceilings
and the points timed in one run only. Token rows and points that were not timed are skipped.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.compare_bench")

import argparse
import math
import sys
from pathlib import Path

KEY = ("kernel", "batch", "window", "cursor")


def _cursor(value) -> str:
    """A cursor as text: '8' whether pandas read the column as int or float (token rows leave
    it empty, which makes the column float)."""
    try:
        return str(int(float(value)))
    except (TypeError, ValueError):
        return ""


def timed_points(path: Path) -> dict[tuple, tuple[float, float, float]]:
    """{(kernel, batch, window, cursor): (time_us, frac_copy, copy_gbps)} of a kernel_bench CSV."""
    from experiments import kernel_bench

    if not path.is_file():
        raise SystemExit(f"compare_bench: {path}: no such file")
    try:
        frame = kernel_bench.read_csv(path)
    except ValueError as error:
        raise SystemExit(f"compare_bench: {error}") from None
    points = {}
    for row in frame.itertuples(index=False):
        if row.step == "token" or row.status != "ok" or not math.isfinite(row.time_us):
            continue
        key = (row.kernel, int(row.batch), int(row.window), _cursor(row.cursor))
        if key in points:
            raise SystemExit(f"compare_bench: {path}: point {key} appears twice")
        points[key] = (float(row.time_us), float(row.frac_copy), float(row.copy_gbps))
    return points


def table(old: dict, new: dict) -> list[str]:
    """The comparison's lines (header first)."""
    lines = [f"{'kernel':28s} {'batch':>5s} {'L':>3s} {'cursor':>6s} {'old µs':>9s} "
             f"{'new µs':>9s} {'new/old':>8s} {'old frac':>8s} {'new frac':>8s}"]
    for key in sorted(set(old) & set(new)):
        (t_old, f_old, _), (t_new, f_new, _) = old[key], new[key]
        lines.append(f"{key[0]:28s} {key[1]:5d} {key[2]:3d} {key[3]:>6s} {t_old:9.2f} "
                     f"{t_new:9.2f} {t_new / t_old:8.3f} {f_old:8.3f} {f_new:8.3f}")
    for name, points in (("old", old), ("new", new)):
        ceilings = sorted({round(v[2]) for v in points.values()})
        lines.append(f"{name} copy ceiling GB/s: {', '.join(map(str, ceilings)) or 'none'}")
    only = sorted(set(old) ^ set(new))
    if only:
        lines.append("timed in one run only: " + "; ".join(
            f"{k[0]} batch {k[1]} L {k[2]} cursor {k[3]}" for k in only))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compare_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="kernel_bench CSV of the reference run")
    parser.add_argument("new", type=Path, help="kernel_bench CSV of the run to compare")
    args = parser.parse_args(argv)
    print("\n".join(table(timed_points(args.old), timed_points(args.new))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
