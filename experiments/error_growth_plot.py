"""The error-growth figure, drawn from the CSV of `experiments.error_growth` alone.

Log-log rel_err against step, one panel per (read format, window L, memory profile): the
window-mean error of each arm (median over seeds, band = min..max), one colour per SR setting
where the run has several; see `plot`.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from experiments._common import save_small_png
from experiments.error_growth_config import MEMORY_PROFILES, SOURCE
from experiments.error_growth_table import (
    DECADES,
    ONE_TWO_FIVE,
    log_subs,
    read_csv,
    window_means,
)
from lowprec import formats

# Colours per scheme, and per recurrence copy for separate; dashes for RN, solid for SR.
_SCHEME_COLOURS = {"every_step": "#d62728", "shared": "#ff7f0e"}
_HI_COLOURS = {"fp64": "#1f77b4", "fp32": "#9467bd", "fp16": "#2ca02c", "bf16": "#17becf",
               "fp8_e4m3": "#8c564b", "fp8_e5m2": "#e377c2"}


def _arm_style(hi_format: str, hi_rounding: str, scheme: str) -> tuple[str, str]:
    """(colour, line style) of an arm."""
    if scheme in _SCHEME_COLOURS:
        return _SCHEME_COLOURS[scheme], "--" if hi_rounding == "rn" else "-"
    colour = _HI_COLOURS.get(hi_format, "#7f7f7f")
    return colour, "-" if hi_rounding == "sr" or hi_format == "fp64" else "--"


def _arm_legend(scheme: str, hi_format: str, hi_rounding: str) -> str:
    """An arm as the legend names it (its read format is the panel's)."""
    if scheme == "every_step":
        return f"every step ({hi_rounding.upper()})"
    if scheme == "shared":
        return f"shared checkpoint ({hi_rounding.upper()})"
    if hi_format == "fp64":
        return "separate, exact recurrence copy"
    return f"separate, {hi_format} {hi_rounding.upper()} recurrence copy"


_SR_COLOURS = ("#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
               "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8")
def plot(csv_path: str | Path, png_path: str | Path) -> None:
    """Log-log rel_err against step, one panel per (read format, window L, memory profile),
    panels of a row sharing the y axis: the window-mean error (median over seeds, band =
    min..max over seeds) of each arm, and the format's unit roundoff u as a dotted line.
    Windows whose median is 0 (the windowed arms before their first flush) have no point on a
    log axis; an arm that is 0 at every step of a panel is not drawn there but named in a
    note in the panel, and a format whose error is 0 everywhere (fp64, or windowed arms that
    never flush) gets a linear axis with its curves on the zero line. Reads only
    ``csv_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    frame = read_csv(csv_path)
    means = window_means(frame)
    settings = list(dict.fromkeys(zip(frame["sr_bits"], frame["philox_rounds"], strict=True)))
    rows = list(dict.fromkeys(zip(frame["lo_format"], frame["window"], strict=True)))
    mems = list(dict.fromkeys(frame["memory"]))
    recurrence = frame["recurrence"].iloc[0]
    windows = sorted(frame["window"].unique())
    n_seeds = frame["seed"].nunique()
    # an SR setting lengthens every label: two columns, a row of legend height each
    n_cols = 3 if len(settings) == 1 else 2
    n_labels = frame.groupby(["arm", "sr_bits", "philox_rounds"]).ngroups
    legend_inches = 0.55 + (0 if n_cols == 3 else 0.17 * (math.ceil(n_labels / n_cols) - 1))
    height = 2.9 * len(rows) + 0.6 + legend_inches
    fig, axes = plt.subplots(
        len(rows),
        len(mems),
        figsize=(max(4.4 * len(mems), 7.0), height),  # one memory: wide enough for the title
        sharex=True,
        sharey="row",
        squeeze=False,
    )
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    steps = means["last_step"]
    x_span = (steps[steps > 0].min(), steps.max())  # the panels share x
    handles = {}
    for row, (fmt, window) in enumerate(rows):
        in_row = means[(means["lo_format"] == fmt) & (means["window"] == window)]
        # no positive error in the whole row (the panels share y): nothing for a log axis
        exact_row = not (in_row["median"] > 0).any()
        for col, mem in enumerate(mems):
            ax = axes[row][col]
            panel = in_row[in_row["memory"] == mem]
            zero = []  # arms at 0 on every step of a log panel: named, not drawn
            for (arm, hi, hi_r, bits, rounds), curve in panel.groupby(
                    ["arm", "hi_format", "hi_rounding", "sr_bits", "philox_rounds"], sort=False):
                scheme = arm.split(":")[0]
                colour, dash = _arm_style(hi, hi_r, scheme)
                label = _arm_legend(scheme, hi, hi_r)
                if len(settings) > 1 and "sr" in (hi_r,):  # one colour per SR setting
                    colour = _SR_COLOURS[settings.index((bits, rounds)) % len(_SR_COLOURS)]
                    label += f", SR {bits} bits, {rounds} rounds"
                if not exact_row:
                    curve = curve[curve["median"] > 0]
                    if curve.empty:
                        zero.append(label)
                        handles.setdefault(label, Line2D([], [], ls=dash, color=colour, lw=1.4))
                        continue
                curve = curve.sort_values("last_step")
                (line,) = ax.plot(
                    curve["last_step"],
                    curve["median"],
                    dash,
                    color=colour,
                    lw=1.4,
                    label=label,
                    marker="o" if len(curve) == 1 else None,  # one window: a dot, not a line
                    ms=3,
                )
                ax.fill_between(
                    curve["last_step"], curve["low"], curve["high"], color=colour, alpha=0.15, lw=0
                )
                handles.setdefault(label, line)
            if exact_row:
                ax.set_ylim(-1.0, 1.0)
                ax.set_yticks([0.0])
                ax.text(
                    0.5,
                    0.6,
                    "rel_err = 0 at every step: exact",
                    transform=ax.transAxes,
                    ha="center",
                    fontsize=8,
                )
            u = None if exact_row else _unit_roundoff(fmt)
            if u is not None:
                ax.axhline(u, color="k", ls=":", lw=0.8)
                ax.annotate(
                    f"$u = 2^{{{round(math.log2(u))}}}$",
                    (0.98, u),
                    xycoords=("axes fraction", "data"),
                    ha="right",
                    va="bottom",
                    fontsize=7,
                )
            ax.set_xscale("log")
            if x_span[1] < 10 * x_span[0]:  # within a decade: whole steps, linearly spaced
                if x_span[0] == x_span[1]:  # one window: room around its point
                    ax.set_xlim(x_span[0] / 2, x_span[1] * 2)
                ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
            else:
                ax.xaxis.set_major_locator(LogLocator(base=10, subs=log_subs(*x_span)))
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            if not exact_row:
                ax.set_yscale("log")
                low, high = ax.get_ylim()
                if high > 1e3:  # a diverging arm would squash the flat ones into one line
                    ax.set_ylim(low, 1e3)
                    ax.annotate("curves past 1e3 are cut (see the CSV)", (0.02, 0.97),
                                xycoords="axes fraction", va="top", fontsize=7, color="0.3")
                    high = 1e3
                # 1-2-5 labels over a few decades; past three decades they would overlap
                coarsest = ONE_TWO_FIVE if high / low <= 1e3 else DECADES
                ax.yaxis.set_major_locator(
                    LogLocator(base=10, subs=log_subs(low, high, coarsest)))
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", alpha=0.3)
            title = f"read copy {fmt}, L = {window} | memory {_memory_label(mem)}"
            if zero:
                title += "\n" + textwrap.fill(
                    "rel_err = 0 at every step, not drawn: " + ", ".join(zero), 60)
            ax.set_title(title, fontsize=8)
            if row == len(rows) - 1:
                ax.set_xlabel("decode step (end of window)", fontsize=8)
            if col == 0:
                ax.set_ylabel("rel_err, window mean", fontsize=8)
    names = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet", "kda": "KDA"}
    title = (f"{names.get(recurrence, recurrence)}: output error against decode length, "
             f"conventional vs checkpointed states (L = {', '.join(map(str, windows))}; median "
             f"over {n_seeds} seed{'s' if n_seeds != 1 else ''}, band = min..max; dotted: "
             f"unit roundoff u)")
    title = textwrap.fill(title, int(fig.get_figwidth() * 13))
    fig.suptitle(title, fontsize=9)
    fig.legend(
        handles.values(),
        handles.keys(),
        loc="lower center",
        ncol=min(len(handles), n_cols),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, legend_inches / height, 1, 1))  # it makes room for the title
    save_small_png(fig, png_path, dpi=110, source=SOURCE)
    plt.close(fig)


def _unit_roundoff(fmt_name: str) -> float | None:
    """2^-(mbits+1) of the format's element, if the format is known (None for fp64)."""
    if fmt_name not in formats.names() or fmt_name == "fp64":
        return None
    return 2.0 ** -(formats.get(fmt_name).element.mbits + 1)


def _memory_label(name: str) -> str:
    if name in MEMORY_PROFILES:
        low, high = MEMORY_PROFILES[name]
        return f"{name} (a in [{low:g}, {high:g}))"
    return f"a in [{name.replace('..', ', ')})"
