"""Time a kernel with a `heads_per_cta` knob at several heads a CTA, one after another on one
GPU, and compare each with the first value (one head a CTA, the default, unless given
otherwise).

    python -m tools.heads_per_cta --kernel gdn-nonflush --heads 1,2,4,8,16 \\
        --out-dir runs/gdn_heads -- --batches 1,256 --windows 16

For each value it runs `python -m experiments.kernel_bench` (the kernel's shape and kernels,
`--peers none --plot-dir none`, the arguments after -- added) in this process with the
kernel's module default set to it, writing OUT_DIR/heads_N.csv, then prints
`tools.compare_bench` of each against the first value's CSV. kernel_bench checks every
kernel against lowprec in fp64 before timing it. Each run measures its own copy ceiling;
compare the runs of one invocation only.

    gdn-nonflush   the Gated DeltaNet non-flush step (cute_kernels.gdn_replay_output.
                   DEFAULT_HEADS_PER_CTA), Qwen3-Next layer, NVFP4 read copy
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.heads_per_cta")

import argparse
import importlib
import sys
from pathlib import Path

# kernel -> (module holding DEFAULT_HEADS_PER_CTA, kernel_bench arguments)
KERNELS = {
    "gdn-nonflush": ("cute_kernels.gdn_replay_output",
                     ["--shapes", "qwen3-next-80b", "--kernels", "cute:nonflush:nvfp4"]),
}
COMMON = ["--peers", "none", "--plot-dir", "none"]


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
        "python -m tools.heads_per_cta", __doc__.split("\n\n")[0],
        sys.argv[1:] if argv is None else argv)
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="gdn-nonflush",
                        help="which kernel's knob (default gdn-nonflush)")
    parser.add_argument("--heads", type=heads_list, default=None,
                        help="heads a CTA to time, comma-separated (default 1,2,4,8,16; the "
                             "first is the reference of the comparison)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="folder for heads_N.csv (default runs/heads_per_cta_KERNEL)")
    args = parser.parse_args(own)
    check_bench_args(parser, extra)
    heads = args.heads or [1, 2, 4, 8, 16]
    out_dir = args.out_dir or Path(f"runs/heads_per_cta_{args.kernel}")

    module_name, bench_args = KERNELS[args.kernel]
    module = importlib.import_module(module_name)
    return sweep_default(module, "DEFAULT_HEADS_PER_CTA", heads, bench_args + COMMON, out_dir,
                         lambda n: f"heads_{n}.csv", extra, lambda n: f"{n} heads a CTA")


if __name__ == "__main__":
    sys.exit(main())
