"""Time the Gated DeltaNet flush kernel in each fold order (sequential, chunked), one after
another on one GPU, and compare each with the first.

    python -m tools.gdn_flush_fold --out-dir runs/gdn_flush_fold -- --batches 1,256 --windows 16

For each fold it runs `python -m experiments.kernel_bench --shapes qwen3-next-80b --kernels
cute:flush:fp16sr+nvfp4,cute:flush:fp32 --peers none --plot-dir none` (the arguments after --
added) in this process with `cute_kernels.gdn_replay_flush.DEFAULT_FOLD` set to it, writing
OUT_DIR/fold_NAME.csv, then prints `tools.compare_bench` of each against the first fold's
CSV. kernel_bench checks every kernel against lowprec in fp64 before timing it. Each run
measures its own copy ceiling; compare the runs of one invocation only.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.gdn_flush_fold")

import argparse
import sys
from pathlib import Path

BENCH_ARGS = ["--shapes", "qwen3-next-80b", "--kernels",
              "cute:flush:fp16sr+nvfp4,cute:flush:fp32", "--peers", "none", "--plot-dir", "none"]
FOLDS = ("sequential", "chunked")  # cute_kernels.gdn_replay_flush.FOLDS (not imported: --help
# stays fast and needs no CuTe DSL)


def folds_list(text: str) -> list[str]:
    """'chunked,sequential' -> ['chunked', 'sequential']: known folds, no repeats."""
    values = [v.strip() for v in text.split(",")]
    if not values or any(v not in FOLDS for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct folds among {', '.join(FOLDS)}, "
                                         f"got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    from tools._default_sweep import check_bench_args, parser_and_bench_args, sweep_default

    parser, own, extra = parser_and_bench_args(
        "python -m tools.gdn_flush_fold", __doc__.split("\n\n")[0],
        sys.argv[1:] if argv is None else argv)
    parser.add_argument("--folds", type=folds_list, default=list(FOLDS),
                        help="fold orders to time, comma-separated (default sequential,chunked; "
                             "the first is the reference of the comparison)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/gdn_flush_fold"),
                        help="folder for fold_NAME.csv (default runs/gdn_flush_fold)")
    args = parser.parse_args(own)
    check_bench_args(parser, extra)

    from cute_kernels import gdn_replay_flush

    return sweep_default(gdn_replay_flush, "DEFAULT_FOLD", args.folds, BENCH_ARGS, args.out_dir,
                         lambda fold: f"fold_{fold}.csv", extra, lambda fold: f"{fold} fold")


if __name__ == "__main__":
    sys.exit(main())
