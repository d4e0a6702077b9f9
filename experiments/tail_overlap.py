"""What a decode step loses to its grid's start and tail: each kernel timed as `kernel_bench`
times it, one launch after another, and again with consecutive launches on two streams.

    python -m experiments.tail_overlap                    # on the GPU machine, about a minute
    python -m experiments.tail_overlap --plot-only results/tail_overlap.csv

A kernel launched after another on one stream starts only when the last CTA of the one before
has finished, so a launch's time includes its grid's ramp at the start and its tail, where
fewer and fewer CTAs are resident. With consecutive launches alternating between two streams
(captured in one CUDA graph, a fork at its start and a join at its end), the next launch's CTAs
take the SMs' free places while the previous launch drains, so the per-launch time is closer
to what the grid costs in its steady state. The difference, serial less overlapped, bounds
what a step could gain from a shorter start and tail (smaller CTAs at the end of its grid, or
a step that overlaps with the kernel after it); the overlapped time is the step's throughput
with those costs hidden. A plain `copy_` of each kernel's bytes is timed the same two ways, as
a control. Both forms time the same launches over the same rotating buffer sets
(`harness.sets_for`, rounded up to an even count), graph replays behind a GPU spin after
`harness.WARM_REPLAYS` untimed ones (past the slow first passes over new buffers:
`experiments.warm_transient`), the median over `--reps`; the step is checked against the fp64
reference first (`cases.check_kernel`; a failed check is not timed), and the two forms'
outputs of a non-flush step are compared bit for bit.

Writes `--out` (tidy CSV: one row per kernel and form) with a `.meta.json` beside it, and a
bar plot of the fraction of the large copy, read from the CSV.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.tail_overlap")

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments import _gpu_cli as cli
from experiments import harness
from experiments._common import OneLineParser
from experiments.cases import KERNELS, SHAPES, build_case, check_kernel, kernel_bytes

__all__ = ["measure", "plot", "main"]

COLUMN_TYPES = {"run": "str", "kernel": "str", "shape": "str", "batch": "int", "window": "int",
                "cursor": "int", "form": "str", "streams": "int", "bytes": "int", "sets": "int",
                "time_us": "float", "time_us_p10": "float", "time_us_p90": "float",
                "gbps": "float", "frac_copy": "float", "copy_gbps": "float", "timing": "str"}
COLUMNS = list(COLUMN_TYPES)
# a kernel's configuration besides its name, in CSVs of kernels with tuning knobs
OPTIONAL = {"knobs": "str"}
DEFAULT_KERNELS = ("cute:nonflush:nvfp4", "cute:nonflush:fp32")
CUTE = tuple(name for name in KERNELS if name.startswith("cute:"))


def _outputs(case) -> list[torch.Tensor]:
    return [case.bufs.at(i)["out"].clone() for i in range(case.bufs.sets)]


def measure(kernels: list[str], shape_name: str, batch: int, window: int, cursor: int,
            reps: int, run: str, log=print) -> pd.DataFrame:
    """Rows for each kernel: serial and two-stream timings, each kernel checked against the
    fp64 reference first; then the same two for a `copy_` of each distinct size the kernels
    move."""
    ceilings = harness.measure_ceilings()
    copy_gbps = ceilings["copy_gbps"]
    log(f"large copy {copy_gbps:,.0f} GB/s (read + write)")
    l2 = harness.l2_bytes()
    shape = SHAPES[shape_name]
    rows = []
    copy_sizes = []  # (bytes, sets) of each kernel, for the copies timed after the kernels

    def add(kernel, form, streams, nbytes, sets, times, method):
        p10, median, p90 = harness.quantiles(times)
        gbps = nbytes / median / 1e3
        rows.append(dict(run=run, kernel=kernel, shape=shape_name, batch=batch, window=window,
                         cursor=cursor, form=form, streams=streams, bytes=nbytes, sets=sets,
                         time_us=median, time_us_p10=p10, time_us_p90=p90, gbps=gbps,
                         frac_copy=gbps / copy_gbps, copy_gbps=copy_gbps, timing=method))
        log(f"{kernel:28s} {form:10s} {median:8.2f} us  {gbps:7,.0f} GB/s  "
            f"{gbps / copy_gbps:.3f} of copy  ({sets} sets)")

    for kernel in kernels:
        spec = KERNELS[kernel]
        nbytes = kernel_bytes(spec, shape, batch, cursor)
        sets = harness.sets_for(nbytes, l2)
        sets += sets % 2
        copy_sizes.append((nbytes, sets))
        ratio = check_kernel(spec, shape, window, "cuda")
        if not ratio <= 1.0:
            raise RuntimeError(f"{kernel}: fails its reference check ({ratio:.3g}): not timed")
        case = build_case(spec, shape, batch, window, cursor, sets, "cuda")
        launches = case.launchers()
        reset = case.reset or (lambda: None)
        reset()
        for launch in launches:
            launch()
        torch.cuda.synchronize()
        serial_out = _outputs(case)
        times_streams, method2 = harness.time_launches(launches, reset, reps, streams=2)
        # a non-flush step's output depends only on its inputs and the cursor reset restores;
        # a flush or an update rewrites the state it reads, so theirs change launch to launch
        same = all(torch.equal(a, b) for a, b in zip(serial_out, _outputs(case), strict=True))
        if spec.step == "nonflush" and not same:
            raise RuntimeError(f"{kernel}: two-stream outputs differ from serial ones")
        times_serial, method1 = harness.time_launches(launches, reset, reps)
        add(kernel, "serial", 1, nbytes, sets, times_serial, method1)
        add(kernel, "2 streams", 2, nbytes, sets, times_streams, method2)
        case = launches = serial_out = None
        torch.cuda.empty_cache()

    for nbytes, sets in dict.fromkeys(copy_sizes):
        words = nbytes // 2 // 4
        src = [torch.rand(words, device="cuda") for _ in range(sets)]
        dst = [torch.empty_like(t) for t in src]
        copies = [lambda d=d, s=s: d.copy_(s) for d, s in zip(dst, src, strict=True)]
        for form, streams in (("serial", 1), ("2 streams", 2)):
            for d in dst:
                d.zero_()
            times, method = harness.time_launches(copies, None, reps, streams=streams)
            if not all(torch.equal(d, s) for d, s in zip(dst, src, strict=True)):
                raise RuntimeError("a timed copy's destination differs from its source")
            add(f"copy of {nbytes / 1e6:.1f} MB", form, streams, 2 * words * 4, sets, times,
                method)
        src = dst = copies = None
        torch.cuda.empty_cache()
    return pd.DataFrame(rows, columns=COLUMNS)


def _read(csv: str | Path) -> pd.DataFrame:
    """The CSV checked; `name` is the kernel with its knobs where the CSV has them."""
    df = cli.read_csv(csv, COLUMN_TYPES, "tail_overlap",
                      key=["run", "kernel", *(["knobs"] if "knobs" in _header(csv) else []),
                           "form"], optional=OPTIONAL)
    knobs = df["knobs"] if "knobs" in df.columns else pd.Series("", index=df.index)
    return df.assign(name=df["kernel"] + knobs.map(lambda k: f" {k}" if k else ""))


def _header(csv) -> list[str]:
    with open(csv, errors="replace") as f:
        return f.readline().strip().split(",")


def plot(csv: str | Path, png: str | Path) -> None:
    """Fraction of the large copy, serial against two streams, a pair of bars a kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = _read(csv)
    names = list(dict.fromkeys(df["name"]))
    fig, ax = plt.subplots(figsize=(7.0, 1.4 + 0.45 * len(names) * df["run"].nunique()))
    y = 0.0
    ticks, labels = [], []
    for run, part in df.groupby("run", sort=False):
        for name in names:
            rows = part[part["name"] == name]
            if rows.empty:
                continue
            for offset, (form, color) in enumerate((("serial", "tab:blue"),
                                                    ("2 streams", "tab:orange"))):
                row = rows[rows["form"] == form]
                if not row.empty:
                    value = float(row["frac_copy"].iloc[0])
                    ax.barh(y + 0.35 * offset, value, height=0.33, color=color,
                            label=form if not ticks else None)
                    ax.text(value + 0.005, y + 0.35 * offset,
                            f"{value:.3f} ({float(row['time_us'].iloc[0]):.1f} µs)",
                            va="center", fontsize=7)
            ticks.append(y + 0.17)
            labels.append(f"{name} [{run}]" if df["run"].nunique() > 1 else name)
            y += 1.0
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2)
    ax.axvline(0.85, color="gray", ls=":", lw=1, label="0.85 of copy")
    ax.set_xlabel("fraction of the large copy's GB/s (bytes by the traffic model)")
    first = df.iloc[0]
    ax.set_title(f"Serial launches vs consecutive launches on two streams: fraction of copy\n"
                 f"{first['shape']}, batch {first['batch']}, L = {first['window']}, "
                 f"cursor {first['cursor']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.tight_layout()
    harness.save_figure(fig, png)
    plt.close(fig)


def summarize(csv: str | Path) -> str:
    """One line a kernel and form, then each kernel's serial time less its two-stream time."""
    df = _read(csv)
    lines = []
    for _, row in df.iterrows():
        lines.append(f"{row['run']}  {row['name']:40s} {row['form']:10s} "
                     f"{row['time_us']:8.2f} us  {row['gbps']:7,.0f} GB/s  "
                     f"{row['frac_copy']:.3f} of copy")
    for (run, name), part in df.groupby(["run", "name"], sort=False):
        forms = dict(zip(part["form"], part["time_us"], strict=True))
        if "serial" in forms and "2 streams" in forms:
            lost = forms["serial"] - forms["2 streams"]
            lines.append(f"{run}  {name}: serial - two streams = {lost:.2f} us "
                         f"({lost / forms['serial']:.1%} of the serial launch)")
    return "\n".join(lines)


def _kernels(text: str) -> list[str]:
    """'K,K,...' -> distinct CuTe kernel names of the benchmark."""
    names = [k.strip() for k in text.split(",")]
    bad = [k for k in names if k not in CUTE]
    if bad or len(set(names)) < len(names):
        raise ValueError(f"expected distinct names from {', '.join(CUTE)}, got {text!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.tail_overlap", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS), metavar="K,K,...",
                   help=f"CuTe kernels of kernel_bench (default: {','.join(DEFAULT_KERNELS)})")
    cli.add_point_arguments(p)
    p.add_argument("--reps", type=int, default=20, help="graph replays a form (default 20)")
    cli.add_output_arguments(p, "results/tail_overlap.csv")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.plot_only:
        cli.resolve_out(parser, args, "tail_overlap")
    png = args.plot or str(Path(args.plot_only or args.out).with_suffix(".png"))
    if args.plot_only:
        return cli.plot_only(parser, args.plot_only, png, summarize, plot)
    cli.check_point(parser, args, reps=(args.reps, 1))
    try:
        kernels = _kernels(args.kernels)
    except ValueError as error:
        parser.error(f"--kernels: {error}")
    cli.check_outputs(parser, args.out, png, "the CuTe kernels")
    start = time.time()
    df = measure(kernels, args.shape, args.batch, args.window, args.cursor, args.reps,
                 args.run_label)
    cli.save_run(df, args.out, png, "experiments.tail_overlap", argv, time.time() - start,
                 dict(reps=args.reps, l2_multiple=harness.L2_MULTIPLE), summarize, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
