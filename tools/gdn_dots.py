"""Time the Gated DeltaNet non-flush step with each form of its read-copy dot products (ffma,
mma), one after another on one GPU, and compare each with the first.

    python -m tools.gdn_dots --out-dir runs/gdn_dots -- --batches 1,256 --windows 16

For each form it runs `python -m experiments.kernel_bench --shapes qwen3-next-80b --kernels
cute:nonflush:nvfp4 --peers none --plot-dir none` (the arguments after -- added) in this
process with `cute_kernels.gdn_replay_output.DEFAULT_DOTS` set to it, writing
OUT_DIR/dots_NAME.csv, then prints `tools.compare_bench` of each against the first form's
CSV. kernel_bench checks every kernel against lowprec in fp64 before timing it. Each run
measures its own copy ceiling; compare the runs of one invocation only.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.gdn_dots")

import argparse
import sys
from pathlib import Path

BENCH_ARGS = ["--shapes", "qwen3-next-80b", "--kernels", "cute:nonflush:nvfp4",
              "--peers", "none", "--plot-dir", "none"]
DOTS = ("ffma", "mma")  # cute_kernels.gdn_replay_output.DOTS (not imported: --help stays
# fast and needs no CuTe DSL)


def dots_list(text: str) -> list[str]:
    """'mma,ffma' -> ['mma', 'ffma']: known forms, no repeats."""
    values = [v.strip() for v in text.split(",")]
    if not values or any(v not in DOTS for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct forms among {', '.join(DOTS)}, "
                                         f"got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    from tools._default_sweep import check_bench_args, parser_and_bench_args, sweep_default

    parser, own, extra = parser_and_bench_args(
        "python -m tools.gdn_dots", __doc__.split("\n\n")[0],
        sys.argv[1:] if argv is None else argv)
    parser.add_argument("--dots", type=dots_list, default=list(DOTS),
                        help="forms to time, comma-separated (default ffma,mma; the first is "
                             "the reference of the comparison)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/gdn_dots"),
                        help="folder for dots_NAME.csv (default runs/gdn_dots)")
    args = parser.parse_args(own)
    check_bench_args(parser, extra)

    from cute_kernels import gdn_replay_output

    return sweep_default(gdn_replay_output, "DEFAULT_DOTS", args.dots, BENCH_ARGS, args.out_dir,
                         lambda dots: f"dots_{dots}.csv", extra, lambda dots: f"{dots} dots")


if __name__ == "__main__":
    sys.exit(main())
