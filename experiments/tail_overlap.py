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
(`kernel_bench.sets_for`, rounded up to an even count), graph replays behind a GPU spin after
`kernel_bench.WARM_REPLAYS` untimed ones (past the slow first passes over new buffers:
`experiments.warm_transient`), the median over `--reps`; the step is checked against the fp64
reference first, and the two forms' outputs of a non-flush step are compared bit for bit.

Writes `--out` (tidy CSV: one row per kernel and form) with a `.meta.json` beside it, and a
bar plot of the fraction of the large copy, read from the CSV.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments import _gpu_cli as cli
from experiments import kernel_bench as kb
from experiments._common import OneLineParser, save_small_png

__all__ = ["measure", "plot", "main"]

COLUMNS = ["run", "kernel", "knobs", "shape", "batch", "window", "cursor", "form", "streams",
           "bytes", "sets", "time_us", "time_us_p10", "time_us_p90", "gbps", "frac_copy",
           "copy_gbps", "timing"]
DEFAULT_KERNELS = ("cute:nonflush:nvfp4", "cute:nonflush:fp32")
L2_MULTIPLE = 4.0  # as kernel_bench's default


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    median = statistics.median(times)
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [median] * 9
    return q[0], median, q[-1]


def _outputs(case) -> list[torch.Tensor]:
    return [case.bufs.at(i)["out"].clone() for i in range(case.bufs.sets)]


def measure(kernels: list[tuple[str, dict]], shape_name: str, batch: int, window: int,
            cursor: int, reps: int, run: str, log=print) -> pd.DataFrame:
    """Rows for each (kernel, knobs): serial and two-stream timings, each checked against the
    fp64 reference first (`kernel_bench.check_kernel`); then the same two for a `copy_` of each
    distinct size the kernels move."""
    ceilings = kb.measure_ceilings()
    copy_gbps = ceilings["copy_gbps"]
    log(f"large copy {copy_gbps:,.0f} GB/s (read + write)")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    shape = kb.SHAPES[shape_name]
    rows = []
    copy_sizes = []  # (bytes, sets) of each kernel, for the copies timed after the kernels

    def add(kernel, knobs, form, streams, nbytes, sets, times, method):
        p10, median, p90 = _quantiles(times)
        gbps = nbytes / median / 1e3
        rows.append(dict(run=run, kernel=kernel, knobs=knobs, shape=shape_name, batch=batch,
                         window=window, cursor=cursor, form=form, streams=streams,
                         bytes=nbytes, sets=sets, time_us=median, time_us_p10=p10,
                         time_us_p90=p90, gbps=gbps, frac_copy=gbps / copy_gbps,
                         copy_gbps=copy_gbps, timing=method))
        log(f"{kernel:22s} {knobs or '-':16s} {form:10s} {median:8.2f} us  "
            f"{gbps:7,.0f} GB/s  {gbps / copy_gbps:.3f} of copy  ({sets} sets)")

    for kernel, knobs in kernels:
        spec = kb.KERNELS[kernel]
        nbytes = kb.kernel_bytes(spec, shape, batch, cursor)
        sets = kb.sets_for(nbytes, l2, L2_MULTIPLE)
        sets += sets % 2
        copy_sizes.append((nbytes, sets))
        label = ",".join(f"{k}={v}" for k, v in knobs.items())
        ratio = kb.check_kernel(spec, shape, window, "cuda", knobs=knobs or None)
        if not ratio <= 1.0:
            raise RuntimeError(f"{kernel} {label}: fails its reference check ({ratio:.3g})")
        case = kb.build_case(spec, shape, batch, window, cursor, sets, "cuda",
                             knobs=knobs or None)
        launches = [kb._launcher(case, i) for i in range(sets)]
        reset = case.reset or (lambda: None)
        reset()
        for launch in launches:
            launch()
        torch.cuda.synchronize()
        serial_out = _outputs(case)
        times_streams, method2 = kb.time_launches(launches, reset, reps, streams=2)
        # a non-flush step's output depends only on its inputs and the cursor reset restores;
        # a flush or an update rewrites the state it reads, so theirs change launch to launch
        same = all(torch.equal(a, b) for a, b in zip(serial_out, _outputs(case), strict=True))
        if spec.step == "nonflush" and not same:
            raise RuntimeError(f"{kernel} {label}: two-stream outputs differ from serial ones")
        times_serial, method1 = kb.time_launches(launches, reset, reps)
        add(kernel, label, "serial", 1, nbytes, sets, times_serial, method1)
        add(kernel, label, "2 streams", 2, nbytes, sets, times_streams, method2)
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
            times, method = kb.time_launches(copies, lambda: None, reps, streams=streams)
            if not all(torch.equal(d, s) for d, s in zip(dst, src, strict=True)):
                raise RuntimeError("a timed copy's destination differs from its source")
            add(f"copy of {nbytes / 1e6:.1f} MB", "", form, streams, 2 * words * 4, sets,
                times, method)
        src = dst = copies = None
        torch.cuda.empty_cache()
    return pd.DataFrame(rows, columns=COLUMNS)


def plot(csv: str | Path, png: str | Path) -> None:
    """Fraction of the large copy, serial against two streams, a pair of bars a kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = _read(csv)
    names = list(dict.fromkeys(
        (row["kernel"] + (f" {row['knobs']}" if isinstance(row["knobs"], str) and row["knobs"]
                          else "")) for _, row in df.iterrows()))
    fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.45 * len(names) * df["run"].nunique()))
    y = 0.0
    ticks, labels = [], []
    for run, part in df.groupby("run", sort=False):
        for name in names:
            rows = part[(part["kernel"] + part["knobs"].fillna("").map(
                lambda k: f" {k}" if k else "")) == name]
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
                            f"{value:.3f} ({float(row['time_us'].iloc[0]):.1f} us)",
                            va="center", fontsize=7)
            ticks.append(y + 0.17)
            labels.append(f"{name} [{run}]" if df["run"].nunique() > 1 else name)
            y += 1.0
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15)
    ax.axvline(0.85, color="gray", ls=":", lw=1, label="0.85 (the non-flush target)")
    ax.set_xlabel("fraction of the large copy's GB/s (bytes by the traffic model)")
    first = df.iloc[0]
    ax.set_title(f"One launch after another vs consecutive launches on two streams\n"
                 f"{first['shape']}, batch {first['batch']}, L = {first['window']}, "
                 f"cursor {first['cursor']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.tight_layout()
    save_small_png(fig, png)
    plt.close(fig)


def _read(csv: str | Path) -> pd.DataFrame:
    return cli.read_csv(csv, COLUMNS, "tail_overlap", keep_default_na=False, na_values=[""])


def summarize(csv: str | Path) -> str:
    """One line a kernel and form, then each kernel's serial time less its two-stream time."""
    df = _read(csv)
    lines = []
    for _, row in df.iterrows():
        knobs = row["knobs"] if isinstance(row["knobs"], str) else ""
        lines.append(f"{row['run']}  {row['kernel']:22s} {knobs or '-':16s} {row['form']:10s} "
                     f"{row['time_us']:8.2f} us  {row['gbps']:7,.0f} GB/s  "
                     f"{row['frac_copy']:.3f} of copy")
    keys = ["run", "kernel", "knobs"]
    for key, part in df.fillna({"knobs": ""}).groupby(keys, sort=False):
        forms = dict(zip(part["form"], part["time_us"], strict=True))
        if "serial" in forms and "2 streams" in forms:
            lost = forms["serial"] - forms["2 streams"]
            lines.append(f"{key[0]}  {key[1]} {key[2] or ''}: serial - two streams = "
                         f"{lost:.2f} us ({lost / forms['serial']:.1%} of the serial launch)")
    return "\n".join(lines)


def _case(text: str) -> tuple[str, dict]:
    """'KERNEL [KEY=VALUE ...]' -> (kernel, knobs)."""
    kernel, *items = text.split()
    if kernel not in kb.KERNELS or not kernel.startswith("cute:"):
        raise ValueError(f"expected a CuTe kernel of kernel_bench "
                         f"({', '.join(k for k in kb.KERNELS if k.startswith('cute:'))}), "
                         f"got {kernel!r}")
    knobs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE after the kernel, got {item!r}")
        if key in knobs:
            raise ValueError(f"knob {key!r} given twice")
        knobs[key] = kb._knob_value(value)
    if knobs and kb.KERNELS[kernel].step != "nonflush":
        raise ValueError(f"knobs apply to the CuTe non-flush kernels only, not {kernel}")
    return kernel, knobs


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.tail_overlap", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_KERNELS),
                   metavar="'KERNEL [KEY=VALUE ...]'",
                   help="kernels of kernel_bench, each with the CuTe non-flush kernel's knobs "
                        "if any, e.g. 'cute:nonflush:nvfp4 head_splits=2' (default: "
                        f"{' '.join(DEFAULT_KERNELS)})")
    cli.add_point_arguments(p)
    p.add_argument("--reps", type=int, default=20, help="graph replays a form (default 20)")
    cli.add_output_arguments(p, "results/tail_overlap.csv")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    png = args.plot or str(Path(args.plot_only or args.out).with_suffix(".png"))
    if args.plot_only:
        return cli.plot_only(parser, args.plot_only, png, summarize, plot)
    cli.check_point(parser, args, reps=(args.reps, 1))
    try:
        cases = [_case(text) for text in args.cases]
    except ValueError as error:
        parser.error(f"--cases: {error}")
    cli.check_outputs(parser, args.out, png, "the CuTe kernels")
    start = time.time()
    df = measure(cases, args.shape, args.batch, args.window, args.cursor, args.reps,
                 args.run_label)
    cli.save_run(df, args.out, png, "experiments.tail_overlap", argv, time.time() - start,
                 dict(reps=args.reps, l2_multiple=L2_MULTIPLE), summarize, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
