"""How many passes a freshly built buffer set takes to reach a kernel's steady time, and what
brings the slow passes back: each replay of a kernel over its rotating sets timed on its own.

    python -m experiments.warm_transient                  # on the GPU machine, about a minute
    python -m experiments.warm_transient --plot-only results/warm_transient.csv

On the H200 a decode step over buffers that were just built runs about 6% slower for its
first 10-26 passes, then settles, with the SM clock at 1,980 MHz (P0) after each phase (the
`clocks_after` column); that is why
the harness replays each point `harness.WARM_REPLAYS` (32) times untimed before it times it
(with 3, a median falls in this transient). This script shows the transient replay by replay,
for each kernel in five phases, one after another on one case (`cases.build_case`, the sets
`harness.sets_for` gives):

- `fresh`: the case just built (new buffers, filled once);
- `same buffers, new graph`: the same case again, in a newly captured graph;
- `state rewritten`: after the state the step reads (the read copy, or the FP32 checkpoint) is
  copied onto itself (`copy_`, same bytes), as a flush would rewrite it;
- `other inputs rewritten`: after every other buffer but the cursors is copied onto itself;
- `fresh after 1 s idle`: a new case, then 1 s with the GPU idle before the first replay.

Each phase is `--replays` graph replays of one launch per set, each behind the harness's GPU
spin, none left out (`harness.time_launches` with no warm replays: its two untimed passes
before capture come first); `clocks_after` is nvidia-smi's SM and memory clock and P-state
right after the phase. The step is checked against the fp64 reference first.

Writes `--out` (tidy CSV: one row per kernel, phase and replay) with a `.meta.json` beside it,
and a plot of the time against the replay, read from the CSV.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.warm_transient")

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments import _gpu_cli as cli
from experiments import harness
from experiments._common import OneLineParser
from experiments.cases import KERNELS, SHAPES, build_case, check_kernel, kernel_bytes

__all__ = ["PHASES", "measure", "settled_after", "plot", "main"]

COLUMN_TYPES = {"run": "str", "kernel": "str", "shape": "str", "batch": "int", "window": "int",
                "cursor": "int", "sets": "int", "phase": "str", "replay": "int",
                "time_us": "float"}
OPTIONAL = {"clocks_after": "str"}
COLUMNS = [*COLUMN_TYPES, *OPTIONAL]
PHASES = ("fresh", "same buffers, new graph", "state rewritten", "other inputs rewritten",
          "fresh after 1 s idle")
DEFAULT_KERNELS = ("cute:nonflush:nvfp4", "cute:nonflush:fp32")
SLOW = 1.02  # a replay is slow if it takes 2% more than the phase's last half (its median)


def clocks(run=None) -> str:
    """GPU 0's SM clock, memory clock and performance state as nvidia-smi reports them now
    (e.g. '1980 MHz, 3201 MHz, P0'), or '' where it cannot be asked. ``run``: a
    subprocess.run stand-in (tests)."""
    import subprocess

    run = run or subprocess.run
    try:
        done = run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,pstate",
                    "--format=csv,noheader", "--id=0"], capture_output=True, text=True,
                   timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _rewrite(case, names) -> None:
    for name in names:
        base = case.bufs.bases[name]
        base.copy_(base.clone())
    torch.cuda.synchronize()


def measure(kernels: list[str], shape_name: str, batch: int, window: int, cursor: int,
            replays: int, run: str, log=print) -> pd.DataFrame:
    """One row per kernel, phase (`PHASES`) and replay."""
    harness.measure_ceilings()  # the card warmed, as kernel_bench does first
    shape = SHAPES[shape_name]
    l2 = harness.l2_bytes()
    rows = []
    for kernel in kernels:
        spec = KERNELS[kernel]
        sets = harness.sets_for(kernel_bytes(spec, shape, batch, cursor), l2)
        ratio = check_kernel(spec, shape, window, "cuda")
        if not ratio <= 1.0:
            raise RuntimeError(f"{kernel}: fails its reference check ({ratio:.3g}): not timed")
        args = (spec, shape, batch, window, cursor, sets, "cuda")
        case = build_case(*args)
        for phase in PHASES:
            state = [n for n in case.bufs.bases if n.startswith("lo")]
            if phase == "state rewritten":
                _rewrite(case, state)
            elif phase == "other inputs rewritten":
                _rewrite(case, [n for n in case.bufs.bases if n not in state and n != "cursors"])
            elif phase == "fresh after 1 s idle":
                case = None
                torch.cuda.empty_cache()
                case = build_case(*args)
                torch.cuda.synchronize()
                time.sleep(1.0)
            times, _ = harness.time_launches(case.launchers(), case.reset, replays,
                                             warm_replays=0)
            after = clocks()  # the clocks the slow replays ran at: still at full speed after
            rows += [dict(run=run, kernel=kernel, shape=shape_name, batch=batch, window=window,
                          cursor=cursor, sets=sets, phase=phase, replay=i + 1, time_us=t,
                          clocks_after=after)
                     for i, t in enumerate(times)]
            log(f"{kernel:22s} {phase:24s} first {times[0]:8.2f} us, median of the last half "
                f"{statistics.median(times[replays // 2:]):8.2f} us; then {after or 'clocks ?'}")
        case = None
        torch.cuda.empty_cache()
    return pd.DataFrame(rows, columns=COLUMNS)


def settled_after(times: list[float]) -> int:
    """Replays before the last slow one (more than `SLOW` x the median of the last half): the
    transient's length in passes; 0 if no replay is slow."""
    steady = statistics.median(times[len(times) // 2:])
    slow = [i for i, t in enumerate(times) if t > SLOW * steady]
    return slow[-1] + 1 if slow else 0


def _read(csv: str | Path) -> pd.DataFrame:
    df = cli.read_csv(csv, COLUMN_TYPES, "warm_transient", key=["run", "kernel", "phase", "replay"],
                      optional=OPTIONAL)
    if "clocks_after" not in df.columns:  # a CSV may lack them (nvidia-smi not asked)
        df["clocks_after"] = ""
    return df


def summarize(csv: str | Path) -> str:
    """A line a kernel and phase: the first replay, the settled median, and the slow passes."""
    df = _read(csv)
    lines = []
    for (run, kernel, phase), part in df.groupby(["run", "kernel", "phase"], sort=False):
        times = part.sort_values("replay")["time_us"].tolist()
        steady = statistics.median(times[len(times) // 2:])
        n = settled_after(times)
        after = part["clocks_after"].iloc[0]
        lines.append(f"{run}  {kernel:22s} {phase:24s} first {times[0]:8.2f} us  settled "
                     f"{steady:8.2f} us  slow (> {SLOW:.2f}x) through replay {n:3d}"
                     + (f", {statistics.median(times[:n]) / steady - 1:+.1%} there" if n else "")
                     + (f"  [after: {after}]" if after else ""))
    return "\n".join(lines)


def plot(csv: str | Path, png: str | Path) -> None:
    """Time against replay, a panel a kernel (relative to its settled time), a line a phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = _read(csv)
    panels = list(df.groupby(["run", "kernel"], sort=False))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, ((run, kernel), part) in zip(axes[0], panels, strict=True):
        for phase, rows in part.groupby("phase", sort=False):
            rows = rows.sort_values("replay")
            ax.plot(rows["replay"], rows["time_us"], ".-", ms=3, lw=1, label=phase)
        first = part.iloc[0]
        ax.set_title(f"{kernel}, {first['shape']}\nbatch {first['batch']}, L = "
                     f"{first['window']}, cursor {first['cursor']}, {first['sets']} sets"
                     + (f" [{run}]" if df["run"].nunique() > 1 else ""), fontsize=8)
        ax.axvline(harness.WARM_REPLAYS + 0.5, color="gray", ls=":", lw=1)
        ax.annotate(f"timed from here\n({harness.WARM_REPLAYS} warm replays)",
                    (harness.WARM_REPLAYS + 1, ax.get_ylim()[1]), va="top", fontsize=7)
        ax.set_xlabel("graph replay (one launch per set)")
        ax.set_ylabel("µs a launch")
        ax.grid(alpha=0.3)
    handles, labels = axes[0, -1].get_legend_handles_labels()
    axes[0, -1].legend(handles, labels, fontsize=7,
                       loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle("A new buffer set's first replays against its settled time, phase by phase",
                 fontsize=10)
    fig.tight_layout()
    harness.save_figure(fig, png)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.warm_transient", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS), metavar="K,K,...",
                   help="CuTe non-flush kernels of kernel_bench (default: "
                        f"{','.join(DEFAULT_KERNELS)})")
    cli.add_point_arguments(p)
    p.add_argument("--replays", type=int, default=48, help="replays a phase (default 48)")
    cli.add_output_arguments(p, "results/warm_transient.csv")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.plot_only:
        cli.resolve_out(parser, args, "warm_transient")
    png = args.plot or str(Path(args.plot_only or args.out).with_suffix(".png"))
    if args.plot_only:
        return cli.plot_only(parser, args.plot_only, png, summarize, plot)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    nonflush = [k for k, spec in KERNELS.items() if spec.impl == "cute"
                and spec.step == "nonflush"]
    bad = [k for k in kernels if k not in nonflush]
    if not kernels or bad or len(set(kernels)) < len(kernels):
        parser.error(f"--kernels: expected distinct names from {', '.join(nonflush)}, got "
                     f"{args.kernels!r}")
    cli.check_point(parser, args, replays=(args.replays, 8))
    cli.check_outputs(parser, args.out, png, "the CuTe kernels")
    start = time.time()
    df = measure(kernels, args.shape, args.batch, args.window, args.cursor, args.replays,
                 args.run_label)
    cli.save_run(df, args.out, png, "experiments.warm_transient", argv, time.time() - start,
                 dict(replays=args.replays, l2_multiple=harness.L2_MULTIPLE), summarize, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
