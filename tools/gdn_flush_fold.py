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

import sys

from tools._default_sweep import choices_main

BENCH_ARGS = ["--shapes", "qwen3-next-80b", "--kernels",
              "cute:flush:fp16sr+nvfp4,cute:flush:fp32", "--peers", "none", "--plot-dir", "none"]
FOLDS = ("sequential", "chunked")  # cute_kernels.gdn_replay_flush.FOLDS (not imported: --help
# stays fast and needs no CuTe DSL)

main = choices_main("python -m tools.gdn_flush_fold", __doc__, "--folds", FOLDS,
                    "cute_kernels.gdn_replay_flush", "DEFAULT_FOLD", BENCH_ARGS, "fold")


if __name__ == "__main__":
    sys.exit(main())
