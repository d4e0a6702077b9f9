"""Time the Gated DeltaNet non-flush kernel at several heads a CTA, one after another on one
GPU, and compare each with one head a CTA (the default).

    python -m tools.gdn_heads_per_cta --heads 1,2,4,8,16 --out-dir runs/gdn_heads \\
        -- --batches 1,256 --windows 16

For each value it runs `python -m experiments.kernel_bench --shapes qwen3-next-80b --kernels
cute:nonflush:nvfp4 --peers none --plot-dir none` (the arguments after -- added) in this
process with `cute_kernels.gdn_replay_output.DEFAULT_HEADS_PER_CTA` set to it, writing
OUT_DIR/heads_N.csv, then prints `tools.compare_bench` of each against the first value's CSV.
Each run measures its own copy ceiling; compare the runs of one invocation only.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.gdn_heads_per_cta")

import argparse
import sys
from pathlib import Path

BENCH_ARGS = ["--shapes", "qwen3-next-80b", "--kernels", "cute:nonflush:nvfp4",
              "--peers", "none", "--plot-dir", "none"]


def heads_list(text: str) -> list[int]:
    """'1,2,8' -> [1, 2, 8]: each in [1, 16], no repeats."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(not 1 <= v <= 16 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct ints in [1, 16], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    from tools._default_sweep import check_bench_args, parser_and_bench_args, sweep_default

    parser, own, extra = parser_and_bench_args(
        "python -m tools.gdn_heads_per_cta", __doc__.split("\n\n")[0],
        sys.argv[1:] if argv is None else argv)
    parser.add_argument("--heads", type=heads_list, default=[1, 2, 4, 8, 16],
                        help="heads a CTA to time, comma-separated (default 1,2,4,8,16; the "
                             "first is the reference of the comparison)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/gdn_heads_per_cta"),
                        help="folder for heads_N.csv (default runs/gdn_heads_per_cta)")
    args = parser.parse_args(own)
    check_bench_args(parser, extra)

    from cute_kernels import gdn_replay_output

    return sweep_default(gdn_replay_output, "DEFAULT_HEADS_PER_CTA", args.heads, BENCH_ARGS,
                         args.out_dir, lambda heads: f"heads_{heads}.csv", extra,
                         lambda heads: f"{heads} heads a CTA")

if __name__ == "__main__":
    sys.exit(main())
