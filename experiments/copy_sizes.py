"""The copy ceiling at the sizes the kernels move, timed the way the kernels are timed.

    python -m experiments.copy_sizes                      # on the GPU machine, seconds
    python -m experiments.copy_sizes --plot-only results/copy_sizes.csv

`kernel_bench` states a kernel's bandwidth as a fraction of one large device-to-device copy
(2 GiB of traffic, a single launch timed by events: `harness.measure_ceilings`). A
decode step moves far less: the two-precision non-flush step at batch 256 moves 204 MB, a
launch of about 50 us, so its grid's start and tail weigh more than a 500 us copy's. This
script asks how much of that a plain copy pays too: `torch.Tensor.copy_` of `bytes / 2` read
and `bytes / 2` written, timed exactly as `kernel_bench` times a kernel (CUDA-graph replay of
one copy per rotating buffer set, sets so that a replay touches at least 4x the L2, each
replay behind a GPU spin, the median over `--reps` replays; `harness.time_launches`),
at sizes spanning the benchmark's kernels (default: the two-precision non-flush step and the
FP32-checkpoint step at the headline point, batch 256, L = 16, cursor 8, and powers of two
around them). `frac_ceiling` is each size's GB/s over the large copy's of the same run. It is
a diagnostic: the benchmark's fractions stay those of the large copy.

Writes `--out` (tidy CSV: one row per size) with a `.meta.json` beside it, and a plot of GB/s
against bytes, the kernels' sizes marked, read from the CSV. On the H200 the grid's exact
1 GiB and 2 GiB copies ran at 0.65 of the ceiling in this form while 1000, 1050, 1536 and
2100 MiB ran at 1.0 (`--mib`): where power-of-two buffers fall, not their size.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.copy_sizes")

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments import _gpu_cli as cli
from experiments import harness
from experiments._common import OneLineParser
from experiments.cases import SHAPES, kernel_bytes

__all__ = ["default_sizes", "measure", "plot", "main"]

COLUMN_TYPES = {"run": "str", "label": "str", "bytes": "int", "sets": "int", "time_us": "float",
                "time_us_p10": "float", "time_us_p90": "float", "gbps": "float",
                "frac_ceiling": "float", "ceiling_gbps": "float", "timing": "str"}
COLUMNS = list(COLUMN_TYPES)


DEFAULT_MIB = (32, 64, 128, 256, 512, 1024, 2048)


def default_sizes(mib: tuple[int, ...] = DEFAULT_MIB) -> list[tuple[str, int]]:
    """(label, bytes read + written): the headline point's two non-flush steps, then `mib`
    (default: powers of two from 32 MiB to 2 GiB, the last the size of kernel_bench's
    ceiling)."""
    shape = SHAPES["nemotron3-super"]
    sizes = [(f"like {kernel} (batch 256, L = 16, cursor 8)",
              kernel_bytes(kernel, shape, 256, 8))
             for kernel in ("cute:nonflush:nvfp4", "cute:nonflush:fp32")]
    sizes += [(f"{m} MiB", m << 20) for m in mib]
    return sizes


def measure(sizes: list[tuple[str, int]], reps: int, run: str, log=print) -> pd.DataFrame:
    """One row per size: the per-copy time of graph replays over rotating sets (see the module
    docstring), against the large copy's ceiling measured first in the same process."""
    ceilings = harness.measure_ceilings()
    log(f"large copy {ceilings['copy_gbps']:,.0f} GB/s (read + write)")
    l2 = harness.l2_bytes()
    rows = []
    for label, nbytes in sizes:
        sets = harness.sets_for(nbytes, l2)
        words = nbytes // 2 // 4  # fp32 words in each source (and each destination)
        src = [torch.rand(words, device="cuda") for _ in range(sets)]
        dst = [torch.empty_like(t) for t in src]
        launches = [lambda d=d, s=s: d.copy_(s) for d, s in zip(dst, src, strict=True)]
        times, method = harness.time_launches(launches, None, reps)
        if not all(torch.equal(d, s) for d, s in zip(dst, src, strict=True)):
            raise RuntimeError(f"{label}: a timed copy's destination differs from its source")
        moved = 2 * words * 4
        p10, median, p90 = harness.quantiles(times)
        gbps = moved / median / 1e3
        rows.append(dict(run=run, label=label, bytes=moved, sets=sets, time_us=median,
                         time_us_p10=p10, time_us_p90=p90, gbps=gbps,
                         frac_ceiling=gbps / ceilings["copy_gbps"],
                         ceiling_gbps=ceilings["copy_gbps"], timing=method))
        log(f"{label:55s} {moved / 1e6:9.1f} MB  {median:8.2f} us  {gbps:7,.0f} GB/s  "
            f"{gbps / ceilings['copy_gbps']:.3f} of the large copy  ({sets} sets)")
        src = dst = launches = None  # freed before the next size's buffers
        torch.cuda.empty_cache()
    return pd.DataFrame(rows, columns=COLUMNS)


def plot(csv: str | Path, png: str | Path) -> None:
    """GB/s against bytes moved (log x), the large copy's ceiling as a line, the sizes of the
    headline point's kernels marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = _read(csv)
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for run, part in df.groupby("run", sort=False):
        grid = part[~part["label"].str.startswith("like ")].sort_values("bytes")
        ax.plot(grid["bytes"] / 1e6, grid["gbps"], "o-", label=f"copy, run {run}")
        for _, row in part[part["label"].str.startswith("like ")].iterrows():
            ax.plot(row["bytes"] / 1e6, row["gbps"], "s", color="black")
            ax.annotate("a copy of " + row["label"].removeprefix("like ").split(" (")[0]
                        + "'s bytes",
                        (row["bytes"] / 1e6, row["gbps"]), textcoords="offset points",
                        xytext=(4, -12), fontsize=7,
                        ha="right" if row["bytes"] > 500e6 else "left")  # inside the axes
        ax.axhline(part["ceiling_gbps"].iloc[0], color="gray", ls="--", lw=1,
                   label="large copy (kernel_bench's ceiling)")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved a copy (MB, read + written)")
    ax.set_ylabel("GB/s (read + written)")
    ax.set_title("Device-to-device copy, timed as the kernels are (graph replay, rotating sets)",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    harness.save_figure(fig, png)
    plt.close(fig)


def _read(csv: str | Path) -> pd.DataFrame:
    return cli.read_csv(csv, COLUMN_TYPES, "copy_sizes", key=["run", "label"])


def summarize(csv: str | Path) -> str:
    """One line a size: bytes, time, GB/s and the fraction of the run's large copy."""
    df = _read(csv)
    lines = []
    for _, row in df.iterrows():
        lines.append(f"{row['run']}  {row['label']:55s} {row['bytes'] / 1e6:9.1f} MB  "
                     f"{row['time_us']:8.2f} us  {row['gbps']:7,.0f} GB/s  "
                     f"{row['frac_ceiling']:.3f} of {row['ceiling_gbps']:,.0f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.copy_sizes", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--mib", default=",".join(map(str, DEFAULT_MIB)), metavar="M,M,...",
                   help="the grid's sizes, MiB read + written, after the two kernels' own "
                        f"(default {','.join(map(str, DEFAULT_MIB))}; each 1 to 16384)")
    p.add_argument("--reps", type=int, default=20, help="graph replays a size (default 20)")
    cli.add_output_arguments(p, "results/copy_sizes.csv")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: expected an int >= 1, got {args.reps}")
    try:
        mib = tuple(int(m) for m in args.mib.split(","))
    except ValueError:
        mib = ()
    if not mib or not all(1 <= m <= 16384 for m in mib) or len(set(mib)) < len(mib):
        parser.error(f"--mib: expected distinct integers in [1, 16384] separated by commas, "
                     f"got {args.mib!r}")
    if not args.plot_only:
        cli.resolve_out(parser, args, "copy_sizes")
    png = args.plot or str(Path(args.plot_only or args.out).with_suffix(".png"))
    if args.plot_only:
        return cli.plot_only(parser, args.plot_only, png, summarize, plot)
    cli.check_outputs(parser, args.out, png, "device-to-device copies")
    start = time.time()
    df = measure(default_sizes(mib), args.reps, args.run_label)
    cli.save_run(df, args.out, png, "experiments.copy_sizes", argv, time.time() - start,
                 dict(reps=args.reps, mib=list(mib), l2_multiple=harness.L2_MULTIPLE), summarize,
                 plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
