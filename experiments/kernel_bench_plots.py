"""The kernel benchmark's three figures, drawn from its CSV only (`plot(csv, outdir)`):

    <stem>_time.png      µs a launch against batch, one row of panels per group of kernels
                         (at most six series a panel), one column per layer shape
    <stem>_speedup.png   speedups against batch, one row per group of comparisons
    <stem>_formats.png   the non-flush step's GB/s per read-copy format against the copy
                         ceiling, then µs per committed token, one row per group of schemes

Colours are fixed within a row, so a series keeps its colour across the shapes; the kit's
kernels are solid lines, the peers' dashed; legends sit outside the data, right of each row.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from experiments.harness import save_figure

__all__ = ["KERNEL_FACETS", "SPEEDUP_FACETS", "SCHEME_FACETS", "plot"]

KERNEL_FACETS = (
    ("Non-flush step: the kit's read-copy formats",
     ("cute:nonflush:nvfp4", "cute:nonflush:fp8_e4m3", "cute:nonflush:fp16",
      "cute:nonflush:fp32", "emulation:nonflush:nvfp4")),
    ("Flush step: the kit's copies",
     ("cute:flush:fp16sr+nvfp4", "cute:flush:fp16sr+fp8_e4m3", "cute:flush:fp16sr+fp16",
      "cute:flush:fp32")),
    ("Conventional update: the kit's state formats",
     ("cute:update:fp32", "cute:update:fp16", "cute:update:fp16sr", "cute:update:bf16")),
    ("Non-flush step, one checkpoint: peers vs kit",
     ("cute:nonflush:fp32", "vllm:nonflush:fp32", "vllm:nonflush:fp16",
      "flashinfer:nonflush:fp32", "flashinfer:nonflush:fp16")),
    ("Flush step, one checkpoint: peers vs kit",
     ("cute:flush:fp32", "vllm:flush:fp32", "vllm:flush:fp16", "flashinfer:flush:fp32",
      "flashinfer:flush:fp16")),
    ("Conventional update: peers vs kit",
     ("cute:update:fp32", "vllm:update:fp32", "vllm:update:fp16", "flashinfer:update:fp32",
      "flashinfer:update:fp16")),
    ("Conventional update, 32- and 16-bit states: peers vs kit",
     ("cute:update:fp32", "cute:update:bf16", "vllm:update:fp32", "vllm:update:bf16",
      "fla:update:fp32", "fla:update:bf16")),
)

SPEEDUP_FACETS = (
    ("Goals at batch 256 (dotted lines)",
     ("non-flush: nvfp4 vs fp32 checkpoint", "token: two-precision vs FP32 ReplaySSM",
      "token: two-precision vs conventional fp32",
      "token: two-precision vs fastest peer, fp32 state",
      "token: two-precision vs fastest peer, bf16 state")),
    ("The kit's other formats",
     ("non-flush: fp8_e4m3 vs fp32 checkpoint", "non-flush: fp16 vs fp32 checkpoint",
      "token: two-precision vs conventional fp16",
      "token: two-precision vs conventional fp16 SR")),
    ("Against vLLM's kernels, a token",
     ("token: two-precision vs vLLM FP32 ReplaySSM", "token: two-precision vs vLLM fp32 update",
      "token: two-precision vs vLLM fp16 update",
      "token: cute conventional fp32 vs vLLM fp32 update")),
    ("Against FlashInfer's kernels, a token",
     ("token: two-precision vs FlashInfer FP32 ReplaySSM",
      "token: two-precision vs FlashInfer fp32 update",
      "token: two-precision vs FlashInfer fp16 update")),
    ("Against the peers' 32- and 16-bit states",
     ("token: two-precision vs FLA fp32 update", "token: two-precision vs FLA bf16 update",
      "token: two-precision vs vLLM bf16 update", "token: two-precision vs conventional bf16",
      "token: two-precision vs fastest peer")),
)

SCHEME_FACETS = (
    ("A token: the kit's replay schemes",
     ("two-precision", "two-precision-fp8", "two-precision-fp16", "fp32-replay",
      "emulation-two-precision")),
    ("A token: vs the kit's conventional updates",
     ("two-precision", "conventional-fp32", "conventional-fp16", "conventional-fp16sr")),
    ("A token: vs vLLM",
     ("two-precision", "vllm-replay-fp32", "vllm-replay-fp16", "vllm-conventional-fp32",
      "vllm-conventional-fp16")),
    ("A token: vs FlashInfer",
     ("two-precision", "flashinfer-replay-fp32", "flashinfer-replay-fp16",
      "flashinfer-conventional-fp32", "flashinfer-conventional-fp16")),
    ("A token: vs 32- and 16-bit states, the kit's and the peers'",
     ("two-precision", "conventional-bf16", "vllm-conventional-fp32", "vllm-conventional-bf16",
      "fla-conventional-fp32", "fla-conventional-bf16")),
)

_PANEL = (5.0, 2.9)  # inches a panel
PEERS = ("vllm", "flashinfer", "fla")  # series named so are the peers': dashed


def _primary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point: a kernel timed in several runs is drawn from the first run
    (by label) that timed it."""
    ok = frame[frame["status"] == "ok"].sort_values("run", kind="stable")
    return ok.drop_duplicates(["kernel", "scheme", "shape", "batch", "window", "cursor"])


def _batch_ticks(ax, batches) -> None:
    """The measured batch sizes as plain tick labels on a log axis (not 10^0, 10^1, ...)."""
    import matplotlib.ticker

    values = sorted({int(b) for b in batches}) or [1]
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(values))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    octaves = [math.log2(v) for v in values]
    span = max(octaves[-1] - octaves[0], 1.0)
    inches = ax.get_position().width * ax.figure.get_figwidth()
    gaps = [b - a for a, b in zip(octaves[:-1], octaves[1:], strict=True)]
    if any(gap / span * inches < 0.5 for gap in gaps):
        ax.tick_params(axis="x", labelrotation=90)  # labels closer than about 4 characters


def _tight_below_title(fig) -> None:
    """tight_layout with a third of an inch kept free at the top for the figure's title (plain
    tight_layout lets the first row's titles run into it)."""
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))


def _plain_log_y(ax) -> None:
    import matplotlib.ticker

    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _rows(facets, present: set) -> list[tuple[str, tuple]]:
    """The facets that have a series in `present`, each with only those series; the series in
    no facet follow, six a row."""
    rows = [(title, tuple(n for n in names if n in present)) for title, names in facets]
    rows = [(title, names) for title, names in rows if names]
    placed = {n for _, names in rows for n in names}
    rest = sorted(present - placed)
    rows += [("Other", tuple(rest[i:i + 6])) for i in range(0, len(rest), 6)]
    return rows


def _figure(nrows: int, ncols: int):
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(_PANEL[0] * ncols, _PANEL[1] * nrows),
                        squeeze=False)


def _legend_right(ax, handles, labels) -> None:
    if handles:
        ax.legend(handles, labels, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=7,
                  frameon=False)


def _draw_rows(axes, rows, shapes, select, value, ylabel="",
               title=lambda facet, shape: facet, decorate=None) -> None:
    """One row of panels per (facet, series): column c draws `select(shape)`'s rows of each
    series (`value` against batch), coloured by its place in the facet."""
    import matplotlib.pyplot as plt

    colours = plt.cm.tab10.colors
    for r, (facet, names) in enumerate(rows):
        handles, labels = [], []
        for c, shape in enumerate(shapes):
            ax = axes[r, c]
            sel = select(shape)
            for i, name in enumerate(names):
                part = sel[sel["series"] == name].sort_values("batch")
                if not len(part):
                    continue
                line = ax.plot(part["batch"], part[value], marker="o", ms=3, lw=1.2,
                               color=colours[i % 10],
                               ls="--" if name.startswith(PEERS) else "-")[0]
                if name not in labels:
                    handles.append(line)
                    labels.append(name)
            if decorate:
                decorate(ax, facet, sel, names)
            ax.set_title(title(facet, shape), fontsize=9)
            ax.set(xscale="log", xlabel="batch", ylabel=ylabel)
            ax.grid(True, which="major", lw=0.3, alpha=0.5)
        _legend_right(axes[r, -1], handles, labels)


def plot(csv: str | Path, outdir: str | Path) -> list[Path]:
    """The three PNGs of the CSV at `csv` into `outdir` (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from experiments.kernel_bench import (
        HEADLINE_WINDOW,
        KERNELS,
        read_csv,
        speedups,
        with_token_rows,
    )

    frame = with_token_rows(read_csv(csv))
    outdir = Path(outdir)
    stem = Path(Path(csv).name.removesuffix(".gz")).stem
    ok = _primary(frame)
    shapes = list(dict.fromkeys(ok["shape"])) or list(dict.fromkeys(frame["shape"])) or ["-"]
    window = HEADLINE_WINDOW if (ok["window"] == HEADLINE_WINDOW).any() else (
        int(ok["window"].min()) if len(ok) else HEADLINE_WINDOW)
    at_window = ok[ok["window"] == window]
    headline = pd.Series([KERNELS[k].cursors(window)[0] == c if k in KERNELS else True
                          for k, c in zip(at_window["kernel"], at_window["cursor"], strict=True)],
                         index=at_window.index, dtype=bool)
    kernels = at_window[headline & (at_window["step"] != "token")].assign(
        series=lambda f: f["kernel"])
    tokens = at_window[at_window["step"] == "token"].assign(series=lambda f: f["scheme"])
    batches = ok["batch"] if len(ok) else [1]
    paths = []

    def where(sel):
        return lambda shape: sel[sel["shape"] == shape]

    def named(facet, shape):
        return f"{facet}\n{shape}, L = {window}"

    # time per launch
    rows = _rows(KERNEL_FACETS, set(kernels["series"]))
    fig, axes = _figure(max(len(rows), 1), len(shapes))
    _draw_rows(axes, rows, shapes, where(kernels), "time_us", ylabel="µs a launch",
               title=named)
    for ax in axes.flat:
        ax.set_yscale("log")
        _plain_log_y(ax)
        _batch_ticks(ax, batches)
    fig.suptitle(f"Decode kernels' median time a launch against batch (L = {window}; solid: "
                 "the kit, dashed: peers)", fontsize=10)
    _tight_below_title(fig)
    paths.append(save_figure(fig, outdir / f"{stem}_time.png"))
    plt.close(fig)

    # speedups
    sp = speedups(frame)
    sp = sp[sp["window"] == window].assign(series=lambda f: f["comparison"])
    rows = _rows(SPEEDUP_FACETS, set(sp["series"]))

    def goals(ax, facet, sel, names):
        colours = plt.cm.tab10.colors
        for i, name in enumerate(names):
            goal = sel.loc[sel["series"] == name, "target"].dropna()
            if len(goal):
                ax.axhline(float(goal.iloc[0]), color=colours[i % 10], lw=0.9, ls=":")
        ax.axhline(1.0, color="black", lw=0.6)

    fig, axes = _figure(max(len(rows), 1), len(shapes))
    _draw_rows(axes, rows, shapes, where(sp), "speedup",
               ylabel="speedup (x)", title=named, decorate=goals)
    for ax in axes.flat:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(
            [0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32]))
        _plain_log_y(ax)
        _batch_ticks(ax, batches)
    fig.suptitle(f"Speedups: the slower kernel's time over the faster's (L = {window}; "
                 "non-flush steps at cursor L/2, tokens over a window)", fontsize=10)
    _tight_below_title(fig)
    paths.append(save_figure(fig, outdir / f"{stem}_speedup.png"))
    plt.close(fig)

    # the read copy's bandwidth, then the cost a token
    nonflush = kernels[kernels["kernel"].str.startswith("cute:nonflush")]
    rows = [("Non-flush step: GB/s by read-copy format",
             tuple(n for n in KERNEL_FACETS[0][1] if n in set(nonflush["series"])))]
    rows += [row for row in _rows(SCHEME_FACETS, set(tokens["series"]))
             if len(row[1]) > 1]  # a panel of two-precision alone compares nothing

    def copy_line(ax, facet, sel, names):
        if facet.startswith("Non-flush") and len(sel):
            ax.axhline(float(sel["copy_gbps"].max()), color="gray", lw=0.9, ls=":")

    fig, axes = _figure(len(rows), len(shapes))
    _draw_rows(axes[:1], rows[:1], shapes, where(nonflush), "gbps", ylabel="GB/s",
               title=named, decorate=copy_line)
    _draw_rows(axes[1:], rows[1:], shapes, where(tokens), "time_us",
               ylabel="µs a committed token", title=named)
    for ax in axes[1:].flat:
        ax.set_yscale("log")
        _plain_log_y(ax)
    for ax in axes.flat:
        _batch_ticks(ax, batches)
    fig.suptitle(f"The non-flush step's bandwidth (dotted: the copy ceiling), and the cost of "
                 f"a committed token by scheme (L = {window})", fontsize=10)
    _tight_below_title(fig)
    paths.append(save_figure(fig, outdir / f"{stem}_formats.png"))
    plt.close(fig)
    return paths
