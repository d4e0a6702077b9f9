"""The error-growth CSV: its schema, writer and checked reader, and the tables printed from it.

``write_csv``/``read_csv`` write and read back (checked against ``SCHEMA`` and the meta.json)
the tidy CSV of `experiments.error_growth`; ``window_means``, ``summarize``, ``growth_table``
and ``sr_table`` read only its rows, so the summary can be redrawn without a run.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from experiments._common import (
    FLOAT_6E,
    BadFile,
    Column,
    Schema,
    check_against_meta,
    check_rows,
    meta_path,
    read_meta,
    read_table,
)
from experiments._common import write_csv as write_table
from experiments.error_growth_config import (
    PROG,
    RECURRENCES,
    ROUNDINGS,
    SOURCE,
    SUMMARY_STEPS,
    parse_arm,
    recorded_steps,
)
from lowprec import formats, philox

CSV_COLUMNS = (
    "recurrence",
    "arm",
    "hi_format",
    "hi_rounding",
    "lo_format",
    "lo_rounding",
    "sr_bits",
    "philox_rounds",
    "memory",
    "window",
    "seed",
    "step",
    "rel_err",
)
KEYS = ("recurrence", "arm", "sr_bits", "philox_rounds", "memory", "window", "seed", "step")
SCHEMA = Schema(
    (
        Column("recurrence", choices=RECURRENCES),
        Column("arm", pattern=r"[a-z_]+(:[a-z0-9_]+)+"),
        Column("hi_format", choices=tuple(formats.names())),
        Column("hi_rounding", choices=ROUNDINGS),
        Column("lo_format", choices=tuple(formats.names())),
        Column("lo_rounding", choices=ROUNDINGS),
        Column("sr_bits", int, minimum=min(philox.SR_BITS), maximum=max(philox.SR_BITS)),
        Column("philox_rounds", int, minimum=min(philox.PHILOX_ROUNDS),
               maximum=max(philox.PHILOX_ROUNDS)),
        Column("memory", pattern=r"long|short|[0-9.e+-]+\.\.[0-9.e+-]+"),
        Column("window", int, minimum=1),
        Column("seed", int, minimum=0, maximum=philox.SEED_LIMIT - 1),
        Column("step", int, minimum=1, maximum=philox.FLUSH_LIMIT),
        # NaN and inf are results (a format that overflows), a negative error is not
        Column("rel_err", float, pattern=FLOAT_6E + "|inf", minimum=0.0, nonfinite=True),
    ),
    keys=KEYS,
)
FLOAT_FORMAT = "%.6e"


def write_csv(frame: pd.DataFrame, path: str | Path) -> None:
    """The tidy CSV, atomically: floats as ``%.6e``, NaN as ``nan``, ``\\n`` line ends."""
    write_table(frame, path, float_format=FLOAT_FORMAT)


def read_csv(path: str | Path) -> pd.DataFrame:
    """A complete CSV written by ``run``, checked against ``SCHEMA`` and its meta.json: the
    run finished, every step is on the run's recorded grid, every arm's columns spell its
    label, the bytes are those the meta.json recorded. ``BadFile`` (a ValueError) otherwise,
    one line naming the file and the line."""
    path = Path(path)
    meta = read_meta(meta_path(path))
    if not meta["command"].startswith(PROG):
        raise BadFile(f"{meta_path(path)}: not a meta.json of {SOURCE} (command "
                      f"{meta['command'][:60]!r})")
    if meta.get("status", "complete") != "complete":
        raise BadFile(f"{path}: a stopped run ({meta.get('status')}): rerun its command")
    frame = read_table(path, SCHEMA)
    config = meta.get("config", {})
    try:
        steps, log_grid = int(config["steps"]), int(config["log_grid"])
        windows = [int(w) for w in config["window"]]
    except (KeyError, TypeError, ValueError):
        raise BadFile(f"{meta_path(path)}: no steps, log_grid and window in its config") from None
    check_rows(path, ~frame["window"].isin(windows), f"window: expected one of {windows} "
               "(the run's)", frame["window"])
    check_rows(path, frame["step"] > steps, f"step: expected at most the run's {steps} steps",
               frame["step"])
    for w in windows:
        grid = recorded_steps(steps, w, log_grid)
        check_rows(path, (frame["window"] == w) & ~frame["step"].isin(grid),
                   f"step: not on the run's recorded grid (--steps {steps}, --window {w}, "
                   f"--log-grid {log_grid})", frame["step"])
    for label in frame["arm"].unique():
        try:
            (spec,) = parse_arm(label, [], [])
        except ValueError:
            spec = None
        rows = frame["arm"] == label
        if spec is None or spec.label != label:
            check_rows(path, rows, "arm: expected a canonical arm (every_step:FORMAT:ROUNDING, "
                       "shared:FORMAT:ROUNDING or separate:HI:ROUNDING:READ)", frame["arm"])
        for name in ("hi_format", "hi_rounding", "lo_format", "lo_rounding"):
            check_rows(path, rows & (frame[name] != getattr(spec, name)),
                       f"{name}: expected {getattr(spec, name)!r} for the arm {label}",
                       frame[name])
    check_against_meta(path, meta)
    return frame




SERIES = ["recurrence", "arm", "hi_format", "hi_rounding", "lo_format", "lo_rounding",
          "sr_bits", "philox_rounds", "memory", "window"]


def window_means(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean rel_err over each recorded window of each series and seed, then the median and
    range over seeds; a partial last window (steps not a multiple of L) is left out where a
    whole window exists. Columns: SERIES, ``window_index`` (from 0), ``last_step`` (the
    window's last recorded step), ``median``, ``low``, ``high``, ``seeds``."""
    frame = frame.assign(window_index=(frame["step"] - 1) // frame["window"])
    per_seed = frame.groupby([*SERIES, "window_index", "seed"], sort=False).agg(
        rel_err=("rel_err", "mean"), last_step=("step", "max"), n=("step", "size")
    )
    # a run whose steps are not a multiple of L ends in a partial window, whose mean leaves
    # out the flush and the window's late steps (45% above the whole windows' in one
    # separate:fp64 run): dropped, unless no window is whole
    whole = per_seed["n"] == per_seed.index.get_level_values("window")
    if whole.any():
        per_seed = per_seed[whole]
    grouped = per_seed.groupby(level=[*SERIES, "window_index"], sort=False)
    return grouped.agg(
        last_step=("last_step", "max"),
        median=("rel_err", "median"),
        low=("rel_err", "min"),
        high=("rel_err", "max"),
        seeds=("rel_err", "size"),
    ).reset_index()


def summarize(frame: pd.DataFrame, at: list[int] | None = None) -> pd.DataFrame:
    """Window-mean rel_err (median over seeds) of the windows holding steps 64, 1,024, 4,096
    and the last step of the last whole window (or, with `at`, those holding these steps;
    NaN where the CSV did not record that window): one row per (arm, memory), one column per
    step. ``frame`` holds one window L (``summaries`` splits a run over several)."""
    if frame["window"].nunique() != 1:
        raise ValueError(f"frame: expected rows of one window, got windows "
                         f"{sorted(frame['window'].unique())} (use summaries)")
    means = window_means(frame)
    last = int(means["last_step"].max())  # the last window kept (a partial one is not)
    window = int(frame["window"].iloc[0])
    columns = {}
    marks = [s for s in SUMMARY_STEPS if (s - 1) // window < (last - 1) // window] + [last]
    for t in marks if at is None else at:  # a mark in the last window would repeat its column
        name = f"t={t}" + (" (last)" if t == last and at is None else "")
        held = means[means["window_index"] == (t - 1) // window]
        columns[name] = held.set_index(SERIES)["median"]
    table = pd.DataFrame(columns)
    order = frame.drop_duplicates(SERIES).set_index(SERIES).index
    dropped = ["recurrence", "hi_format", "hi_rounding", "lo_format", "lo_rounding", "window"]
    if len(frame[["sr_bits", "philox_rounds"]].drop_duplicates()) == 1:
        dropped += ["sr_bits", "philox_rounds"]
    return table.reindex(order).droplevel(dropped)


def summaries(frame: pd.DataFrame, at: list[int] | None = None) -> str:
    """The printed summary: one table per window L of the run, the growth table, and with
    several SR settings the SR table (`sr_table`)."""
    parts = [format_summary(summarize(rows, at), int(w))
             for w, rows in frame.groupby("window", sort=False)]
    parts.append(format_growth(growth_table(frame)))
    if frame[["sr_bits", "philox_rounds"]].drop_duplicates().shape[0] > 1:
        table = sr_table(frame)
        if len(table):  # only arms run at 32/10 as well have a ratio to it
            parts.append(format_sr_table(table))
    return "\n\n".join(parts)


def growth_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per series (recurrence, arm, SR setting, memory, window): the window-mean rel_err
    (median over seeds) of the first recorded window after the first flush (``early``, at
    step ``early_step``, its last step), of the last whole window (``last``, at
    ``last_step``), and ``growth = last / early``: flat is about 1."""
    means = window_means(frame)
    rows = []
    for key, series in means.groupby(SERIES, sort=False):
        series = series.sort_values("window_index")
        after = series[series["window_index"] >= 1]
        early = after.iloc[0] if len(after) else series.iloc[0]
        last = series.iloc[-1]
        rows.append({**dict(zip(SERIES, key, strict=True)),
                     "early_step": int(early["last_step"]), "early": early["median"],
                     "last_step": int(last["last_step"]), "last": last["median"],
                     "growth": last["median"] / early["median"] if early["median"] > 0
                     else float("nan")})
    return pd.DataFrame(rows)


def format_growth(table: pd.DataFrame) -> str:
    shown = table.drop(columns=["hi_format", "hi_rounding", "lo_format", "lo_rounding"])
    if set(zip(shown["sr_bits"], shown["philox_rounds"], strict=True)) == {(
            philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)}:
        shown = shown.drop(columns=["sr_bits", "philox_rounds"])
    head = ("growth: window-mean rel_err (median over seeds) after one flush (early) and at the "
            "last whole window (last); growth = last / early (flat: about 1)")
    return head + "\n" + shown.to_string(index=False, float_format=lambda x: f"{x:.3g}")


def student_t_quantile(p: float, dof: int) -> float:
    """The p-quantile (p in (0.5, 1)) of Student's t with `dof` degrees of freedom: its density
    integrated by Simpson's rule from 0 (the CDF at 0 is 1/2), the quantile by bisection (to
    about 1e-6; what an interval over a handful of seeds needs, with no scipy)."""
    if not 0.5 < p < 1 or dof < 1:
        raise ValueError(f"student_t_quantile: expected p in (0.5, 1) and dof >= 1, got {p}, {dof}")
    log_norm = (math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)
                - 0.5 * math.log(dof * math.pi))

    def cdf(t: float) -> float:
        x = np.linspace(0.0, t, 4001)
        pdf = np.exp(log_norm - (dof + 1) / 2 * np.log1p(x * x / dof))
        h = t / 4000
        return 0.5 + h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())

    low, high = 0.0, 1.0
    while cdf(high) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def sr_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Each SR setting against 32 bits, 10 rounds, per (arm, memory, window). A seed's inputs
    are the same under every setting, so the comparison is paired: per seed common to both,
    the log of the ratio of its mean rel_err over the last octave of recorded steps
    (steps > last / 2); ``ratio`` = exp(mean log ratio), with a 95% Student t interval
    (``low``, ``high``; n - 1 degrees of freedom for n seeds: a bootstrap of a handful of
    seeds runs narrow). ``departs`` is True where the interval excludes 1; with fewer than
    two common seeds there is no interval (``low``, ``high`` NaN, ``departs`` None)."""
    keys = ["recurrence", "arm", "memory", "window"]
    last = frame["step"].max()
    tail = frame[frame["step"] > last / 2]
    per_seed = tail.groupby([*keys, "sr_bits", "philox_rounds", "seed"], sort=False)[
        "rel_err"].mean()
    rows = []
    for key, group in per_seed.groupby(level=keys, sort=False):
        group = group.droplevel(keys)
        try:
            base = group.loc[(philox.REFERENCE_SR_BITS, philox.REFERENCE_PHILOX_ROUNDS)]
        except KeyError:
            continue
        for (bits, rounds), values in group.groupby(level=["sr_bits", "philox_rounds"],
                                                    sort=False):
            values = values.droplevel(["sr_bits", "philox_rounds"])
            common = values.index.intersection(base.index)
            logs = np.log(values.loc[common].to_numpy() / base.loc[common].to_numpy())
            ratio = float(np.exp(logs.mean())) if len(logs) else float("nan")
            if len(logs) < 2:  # one seed has no spread
                low = high = float("nan")
                departs = None
            else:
                half = (student_t_quantile(0.975, len(logs) - 1) * logs.std(ddof=1)
                        / math.sqrt(len(logs)))
                low, high = math.exp(logs.mean() - half), math.exp(logs.mean() + half)
                departs = not low <= 1.0 <= high
            rows.append({**dict(zip(keys, key, strict=True)), "sr_bits": bits,
                         "philox_rounds": rounds, "seeds": len(common), "ratio": ratio,
                         "low": low, "high": high, "departs": departs})
    return pd.DataFrame(rows)


def format_sr_table(table: pd.DataFrame) -> str:
    head = ("SR settings against 32 bits, 10 rounds: mean rel_err over the last octave of "
            "recorded steps, ratio to 32/10 (geometric mean over seeds of the paired "
            "ratios) with a 95% Student t interval (none with one seed)")
    return head + "\n" + table.drop(columns=["recurrence"]).to_string(
        index=False, float_format=lambda x: f"{x:.3f}")


def format_summary(table: pd.DataFrame, window: int) -> str:
    head = (
        f"rel_err = ||y_hat - y|| / ||y||: mean over the {window}-step window holding step t, "
        "median over seeds"
    )
    return head + "\n" + table.to_string(float_format=lambda x: f"{x:.2e}", na_rep="-")


DECADES, ONE_TWO_FIVE, EVERY_MANTISSA = (1.0,), (1.0, 2.0, 5.0), tuple(map(float, range(1, 10)))


def log_subs(low: float, high: float, coarsest: tuple[float, ...] = DECADES) -> tuple[float, ...]:
    """Mantissas of a log axis's labelled ticks over [low, high]: the first of `coarsest`,
    1-2-5 and every integer mantissa that leaves at least two labelled ticks inside the range
    (within a decade matplotlib places 1-2-5 ticks linearly: 15, 20, ..., 40). Decades alone
    left a run of 48 steps (windows ending at 16 to 48) with no label on its step axis."""
    from matplotlib.ticker import LogLocator

    for subs in (coarsest, ONE_TWO_FIVE, EVERY_MANTISSA):
        ticks = LogLocator(base=10, subs=subs).tick_values(low, high)
        if sum(low <= t <= high for t in ticks) >= 2:
            return subs
    return EVERY_MANTISSA
