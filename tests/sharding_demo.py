"""A tiny sweep for tests/test_sharding.py: cell ``c<i>`` draws ``--rows`` random rows from
the seed ``--seed0 + i`` (an int, a float with an occasional NaN, a text column), so its rows
depend on the cell and the arguments only. ``--sort`` orders them by ``group`` (draws from
0-2, so the sort interleaves the cells) and ``j``.

Test switches in the environment: ``SHARDING_DEMO_EXIT=c<i>`` ends the process at once
(``os._exit(3)``, as a killed rank) when that cell starts; ``SHARDING_DEMO_RAISE=c<i>`` raises
a ValueError in that cell; ``SHARDING_DEMO_RANK_ARGUMENT=1`` puts the rank into the arguments
(which the engine refuses: the ranks must agree on them).

    python -m torch.distributed.run --nproc-per-node 2 tests/sharding_demo.py --out x.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pandas as pd

from experiments.sharding import HELP, SweepStopped, add_arguments, run_sweep


def cells(n: int) -> list[int]:
    return list(range(n))


def run_cell(args: argparse.Namespace, cell: int) -> pd.DataFrame:
    if os.environ.get("SHARDING_DEMO_EXIT") == f"c{cell}":
        os._exit(3)
    if os.environ.get("SHARDING_DEMO_RAISE") == f"c{cell}":
        raise ValueError(f"demo failure in c{cell}")
    gen = np.random.default_rng(args.seed0 + cell)
    value = gen.standard_normal(args.rows) * args.scale
    value[gen.random(args.rows) < 0.1] = np.nan
    return pd.DataFrame({
        "cell": f"c{cell}",
        "group": gen.integers(0, 3, args.rows),
        "j": np.arange(args.rows),
        "value": value,
        "label": gen.choice(["a", "bb", "1e3"], args.rows),
    })


def write_csv(frame: pd.DataFrame, path) -> None:
    frame.to_csv(path, index=False, float_format="%.6e", na_rep="nan", lineterminator="\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, epilog=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cells", type=int, default=7)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--seed0", type=int, default=11)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--cost", action="store_true", help="longest-first, cost = cell index")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arguments = {k: v for k, v in vars(args).items() if k not in ("out", "keep_cells", "cost")}
    if os.environ.get("SHARDING_DEMO_RANK_ARGUMENT"):
        arguments["rank"] = os.environ.get("RANK")
    try:
        run_sweep(cells(args.cells), lambda c: run_cell(args, c), out=args.out,
                  arguments=arguments, key=lambda c: f"c{c}", sort_by=["group", "j"],
                  cost=(lambda c: float(c)) if args.cost else None, write_csv=write_csv,
                  meta={"command": " ".join(["tests/sharding_demo.py", *sys.argv[1:]])},
                  keep_cells=args.keep_cells, progress=0.0)
    except SweepStopped as stop:
        return stop.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
