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

import sys

from tools._default_sweep import choices_main

BENCH_ARGS = ["--shapes", "qwen3-next-80b", "--kernels", "cute:nonflush:nvfp4",
              "--peers", "none", "--plot-dir", "none"]
DOTS = ("ffma", "mma")  # cute_kernels.gdn_replay_output.DOTS (not imported: --help stays
# fast and needs no CuTe DSL)

main = choices_main("python -m tools.gdn_dots", __doc__, "--dots", DOTS,
                    "cute_kernels.gdn_replay_output", "DEFAULT_DOTS", BENCH_ARGS, "dots")


if __name__ == "__main__":
    sys.exit(main())
