"""Output error under speculative decoding: T drafted tokens per verify, some accepted.

Every verify drafts ``T`` tokens per sequence; the cache computes their ``T`` outputs at once
and then commits the first ``c`` of them (``1 <= c <= T``: the first is the token already
chosen, the other ``T - 1`` are the speculation). The committed tokens' outputs are what the
model emits, so their error against an exact FP64 run of the same drafts and the same
acceptance is what this experiment records, against the committed length:

    rel_err_n = ||y_hat_n - y_n||_2 / ||y_n||_2     committed token n, norms over heads and d_v

Arms are error_growth's grammar (``every_step:FMT[:R]``, ``shared:FMT[:R]``,
``separate:HI[:R]:READ`` and the aliases; ``python -m experiments.error_growth --help``):

    shared, separate   ``lowprec.replay`` caches (``Mamba2Replay``, ``GDNReplay``,
                       ``KDAReplay``) with ``draft = T``: ``verify`` decides the flush before the
                       drafts run (``h + T > L``), folds the committed records into the
                       recurrence copy on a flush, and ``commit(c)`` moves the ring's cursor
    every_step         a conventional cache under speculation keeps the state after each draft
                       (rounded to the format, the SR counter the token's committed position)
                       and continues from the accepted one
    exact              the same drafts in FP64 with nothing rounded: the reference

Acceptance (``--acceptance``): a rate ``p`` (each of the ``T - 1`` speculative drafts is
accepted with probability ``p``, independently, and the verify commits up to the first
rejection; drawn from a numpy generator keyed by the seed, the same for every arm), or a
pattern ``c1-c2-...`` of committed counts repeated verify after verify. Inputs are drawn as
error_growth draws them (Gaussian v, k, q; decays uniform in the memory profile; GDN/KDA keys
and queries of unit norm, ``beta`` uniform), ``T`` tokens per verify, one
``torch.Generator`` per seed; the rejected drafts never reach the state.

The grid: one cell per (window, T, acceptance, arm), every memory profile and seed in the
cell's batch; ``cells(config)`` and ``run_cell(config, cell)`` as in error_growth, rows
written in cell order. CSV columns ``CSV_COLUMNS``; a ``.meta.json`` (command, commit, config,
the CSV's sha256); a PNG from the CSV alone: the mean error over blocks of L committed tokens
(median over seeds), one panel per (read format, L, T, acceptance) and memory profile.
Outputs go where error_growth's go (``--preset NAME`` alone: results/spec_error_NAME.*;
``--out PATH.csv``; otherwise runs/spec_error_<flags>/spec_error.*); atomic; ``--force`` to
replace foreign files; ``--replot`` checks the CSV as error_growth's ``--replot`` does.

    python -m experiments.spec_error --preset toy             # about a minute on a 2-core CPU
    python -m experiments.spec_error --preset toy --replot
    python -m experiments.spec_error --preset toy --draft 2,8 --acceptance 0.5,4-1-1
    python -m experiments.spec_error --preset gdn-toy     # Gated DeltaNet (kda-toy: KDA)
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.spec_error")

import argparse
import math
import re
import shlex
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments import error_growth_config as eg
from experiments._common import (
    FLOAT_6E,
    BadFile,
    Column,
    OneLineParser,
    Schema,
    check_against_meta,
    check_rows,
    file_problem,
    is_folder,
    meta_path,
    output_problem,
    read_meta,
    read_table,
    runs_folder,
    save_small_png,
    write_csv,
    write_meta,
)
from experiments.error_growth_backends import _cpu_threads
from experiments.error_growth_cli import _check_plot_path, _setting_words, _show
from experiments.error_growth_plot import _arm_legend, _arm_style, _memory_label
from experiments.error_growth_table import FLOAT_FORMAT
from lowprec import formats, philox
from lowprec.metrics import rel_err
from lowprec.policies import advance_state, round_state
from lowprec.replay import GDNReplay, KDAReplay, Mamba2Replay

__all__ = ["CSV_COLUMNS", "PRESETS", "SCHEMA", "Acceptance", "Cell", "Config", "cells",
           "main", "parse_acceptance", "plot", "read_csv", "run", "run_cell"]

SOURCE = "experiments.spec_error"
PROG = "python -m " + SOURCE
CSV_COLUMNS = ("recurrence", "arm", "hi_format", "hi_rounding", "lo_format", "lo_rounding",
               "draft", "acceptance", "memory", "window", "seed", "token", "rel_err")
KEYS = ("recurrence", "arm", "draft", "acceptance", "memory", "window", "seed", "token")
SCHEMA = Schema(
    (
        Column("recurrence", choices=eg.RECURRENCES),
        Column("arm", pattern=r"[a-z_]+(:[a-z0-9_]+)+"),
        Column("hi_format", choices=tuple(formats.names())),
        Column("hi_rounding", choices=eg.ROUNDINGS),
        Column("lo_format", choices=tuple(formats.names())),
        Column("lo_rounding", choices=eg.ROUNDINGS),
        Column("draft", int, minimum=1),
        Column("acceptance", pattern=r"p[0-9.]+|[0-9]+(-[0-9]+)*"),
        Column("memory", pattern=r"long|short|[0-9.e+-]+\.\.[0-9.e+-]+"),
        Column("window", int, minimum=1),
        Column("seed", int, minimum=0, maximum=philox.SEED_LIMIT - 1),
        Column("token", int, minimum=1),
        Column("rel_err", float, pattern=FLOAT_6E, minimum=0.0, nonfinite=True),
    ),
    keys=KEYS,
)
MAX_TOKENS = 1 << 16  # committed tokens per sequence; every verify is a Python-level step


@dataclass(frozen=True)
class Acceptance:
    """A rate (``rate``, pattern empty) or a pattern of committed counts per verify."""

    rate: float | None = None
    pattern: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """The CSV's spelling: ``p0.7`` or ``4-1-2``."""
        return f"p{self.rate:g}" if self.rate is not None else "-".join(map(str, self.pattern))


def parse_acceptance(text: str) -> Acceptance:
    """``'0.7'`` (a rate in [0, 1]) or ``'4-1-2'`` (committed counts, each >= 1)."""
    if re.fullmatch(r"\d+(-\d+)+|[1-9]\d*", text) and ("-" in text or int(text) > 1):
        counts = tuple(int(p) for p in text.split("-"))
        if min(counts) < 1:
            raise ValueError(f"acceptance: expected committed counts >= 1, got {text!r}")
        return Acceptance(pattern=counts)
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance: expected a rate in [0, 1] or a pattern such as 4-1-2, "
                         f"got {text!r}")
    return Acceptance(rate=rate)


@dataclass(frozen=True)
class Cell:
    """One arm at one (window, T, acceptance), over every memory profile and seed."""

    index: int
    window: int
    draft: int
    acceptance: Acceptance
    arm: eg.ArmSpec


@dataclass(frozen=True)
class Config:
    """Everything a run depends on (``out``, ``plot`` do not change numbers)."""

    recurrence: str = "mamba2"
    dv: int = 8
    dk: int = 32
    heads: int = 1
    seeds: int = 4
    seed0: int = 0
    tokens: int = 1024
    window: tuple[int, ...] = (16,)
    draft: tuple[int, ...] = (4,)
    acceptance: tuple[Acceptance, ...] = (Acceptance(rate=0.7),)
    memory: tuple[eg.Memory, ...] = tuple(eg.Memory(n, *r)
                                          for n, r in eg.MEMORY_PROFILES.items())
    arms: tuple[eg.ArmSpec, ...] = ()
    out: str = "runs/spec_error_custom/spec_error.csv"
    plot: str | None = "runs/spec_error_custom/spec_error.png"

    def __post_init__(self):
        if self.recurrence not in eg.RECURRENCES:
            raise ValueError(f"recurrence: expected one of {list(eg.RECURRENCES)}, got "
                             f"{self.recurrence!r}")
        for name in ("dv", "dk", "heads", "seeds", "tokens"):
            eg._check_int(name, getattr(self, name), 1)
        eg._check_int("seed0", self.seed0, 0)
        if self.tokens > MAX_TOKENS:
            raise ValueError(f"tokens: expected at most {MAX_TOKENS}, got {self.tokens}")
        if self.seed0 + self.seeds > philox.SEED_LIMIT:
            raise ValueError(f"seed0: expected seed0 + seeds <= 2^64, got {self.seed0}")
        for name in ("window", "draft", "acceptance", "memory", "arms"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not values:
                raise ValueError(f"{name}: expected a non-empty tuple, got {values!r}")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: expected distinct values, got {list(values)}")
        for w in self.window:
            eg._check_int("window", w, 1)
        for t in self.draft:
            eg._check_int("draft", t, 1)
            if t > min(self.window):  # lowprec.replay's rule: a verify spans at most a window
                raise ValueError(f"draft: expected T <= every window L ({min(self.window)}), "
                                 f"got {t}")
        for acc in self.acceptance:
            if acc.pattern and max(acc.pattern) > min(self.draft):
                raise ValueError(f"acceptance: a pattern commits at most T = {min(self.draft)}"
                                 f" tokens a verify, got {acc.label}")
        for m in self.memory:
            eg._check_memory(m.low, m.high)
        for spec in self.arms:
            eg._check_arm(spec, self.dv, self.dk)


def cells(config: Config) -> list[Cell]:
    """One cell per (window, T, acceptance, arm), in that nesting: the CSV's row order."""
    grid = [(w, t, a, arm) for w in config.window for t in config.draft
            for a in config.acceptance for arm in config.arms]
    return [Cell(i, *values) for i, values in enumerate(grid)]


# --------------------------------------------------------------------------------------------
# the simulation


def _draw(gen: torch.Generator, c: Config, n: int):
    """``n`` tokens of one seed: ``(v, k, q, u, beta)``, ``[n, h, ...]``, as error_growth."""

    def draw(*shape, uniform=False):
        return (torch.rand if uniform else torch.randn)(*shape, generator=gen,
                                                        dtype=torch.float64)

    v, k, q = draw(n, c.heads, c.dv), draw(n, c.heads, c.dk), draw(n, c.heads, c.dk)
    u = draw(n, c.heads, *((c.dk,) if c.recurrence == "kda" else ()), uniform=True)
    if c.recurrence == "mamba2":
        return v, k, q, u, None
    beta = draw(n, c.heads, uniform=True)
    return (v, k / k.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True), u, beta)


def _drafts(gens, c: Config, n: int):
    """The next ``n`` tokens of every slot (memory-major): ``a, v, k, q, beta``, each
    ``[b, h, n, ...]``."""
    per_seed = [_draw(g, c, n) for g in gens]
    n_mem = len(c.memory)

    def slots(i):  # [seeds, n, h, ...] -> [memories * seeds, h, n, ...]
        t = torch.stack([p[i] for p in per_seed]).transpose(1, 2)
        return t.repeat(n_mem, *([1] * (t.dim() - 1)))

    v, k, q, u = (slots(i) for i in range(4))
    low = torch.tensor([m.low for m in c.memory], dtype=torch.float64).repeat_interleave(c.seeds)
    span = torch.tensor([m.high - m.low for m in c.memory],
                        dtype=torch.float64).repeat_interleave(c.seeds)
    shape = (-1,) + (1,) * (u.dim() - 1)
    a = low.view(shape) + span.view(shape) * u
    beta = slots(4) if c.recurrence != "mamba2" else None
    return a, v, k, q, beta


class _Snapshots:
    """A conventional cache under speculation (``fmt None``: exact): each draft's state is
    stored (rounded, the SR counter the token's committed position) and the commit keeps the
    accepted one."""

    def __init__(self, c: Config, batch: int, fmt=None, rounding="rn", seed=0):
        self.c, self.fmt, self.rounding, self.seed = c, fmt, rounding, seed
        self.state = torch.zeros(batch, c.heads, c.dv, c.dk, dtype=torch.float64)
        self.count = torch.zeros(batch, dtype=torch.int64)
        self.slots = torch.arange(batch)
        self.pending = []

    def verify(self, a, v, k, q, beta):
        state, ys, self.pending = self.state, [], []
        for i in range(v.shape[2]):
            state = advance_state(self.c.recurrence, state, a[:, :, i], v[:, :, i], k[:, :, i],
                             None if beta is None else beta[:, :, i])
            if self.fmt is not None:
                state = round_state(state, self.fmt, self.rounding, self.seed, self.slots,
                                    self.count + i)
            self.pending.append(state)
            ys.append((state @ q[:, :, i, :, None])[..., 0])
        return torch.stack(ys, dim=2)

    def commit(self, accepted: torch.Tensor):
        stacked = torch.stack(self.pending)  # [T, b, h, dv, dk]
        self.state = stacked[accepted - 1, self.slots]
        self.count = self.count + accepted


class _Replay:
    """``lowprec.replay``'s cache of the recurrence behind the generic inputs."""

    def __init__(self, c: Config, batch: int, policy, draft: int):
        self.recurrence = c.recurrence
        if c.recurrence == "mamba2":
            A = -torch.ones(c.heads, dtype=torch.float64)
            self.cache = Mamba2Replay.create(batch, c.heads, c.dv, c.dk, A, ngroups=c.heads,
                                             dt_softplus=False, policy=policy, draft=draft)
        else:
            kind = GDNReplay if c.recurrence == "gdn" else KDAReplay
            self.cache = kind.create(batch, c.heads, c.dv, c.dk, policy=policy, draft=draft)

    def verify(self, a, v, k, q, beta):
        if self.recurrence == "mamba2":  # dt = -log a and A = -1: exp(dt A) = a, dt x = v
            dt = -torch.log(a)
            return self.cache.verify(v / dt[..., None], dt, k, q)
        return self.cache.verify(q, k, v, torch.log(a), beta)

    def commit(self, accepted: torch.Tensor):
        self.cache.commit(accepted)


def _cache(c: Config, cell: Cell, batch: int):
    arm = cell.arm
    if arm.scheme == "every_step":
        return _Snapshots(c, batch, arm.lo_format, arm.lo_rounding,
                          c.seed0 if arm.lo_rounding == "sr" else 0)
    return _Replay(c, batch, arm.policy(cell.window, c.seed0), cell.draft)


def _committed(acc: Acceptance, rngs, verify: int, draft: int, n_mem: int) -> torch.Tensor:
    """Committed counts ``[memories * seeds]`` of one verify: 1 + the accepted run of drafts
    (rate), or the pattern's entry; a seed's slots share it."""
    if acc.pattern:
        per_seed = [acc.pattern[verify % len(acc.pattern)]] * len(rngs)
    else:
        per_seed = []
        for rng in rngs:
            accepted = rng.random(draft - 1) < acc.rate
            per_seed.append(1 + int(np.argmin(np.append(accepted, False))))
    return torch.tensor(per_seed * n_mem, dtype=torch.int64)


def run_cell(config: Config, cell: Cell) -> pd.DataFrame:
    """The rows of one cell (memory, seed, token order), from its own inputs and acceptance
    draws: the same rows wherever and with whatever other cells it runs."""
    c = config
    n_mem, batch = len(c.memory), len(c.memory) * c.seeds
    gens = [torch.Generator().manual_seed(c.seed0 + s) for s in range(c.seeds)]
    rngs = [np.random.default_rng([c.seed0 + s, 1]) for s in range(c.seeds)]
    exact, arm = _Snapshots(c, batch), _cache(c, cell, batch)
    errors = torch.full((batch, c.tokens), float("nan"), dtype=torch.float64)
    done = torch.zeros(batch, dtype=torch.int64)
    verify = 0
    with torch.no_grad(), _cpu_threads(1):
        while int(done.min()) < c.tokens:
            drafts = _drafts(gens, c, cell.draft)
            y, y_hat = exact.verify(*drafts), arm.verify(*drafts)
            accepted = _committed(cell.acceptance, rngs, verify, cell.draft, n_mem)
            err = rel_err(y_hat, y, dims=(1, 3))  # [b, T]: one norm over heads and d_v
            for i in range(cell.draft):
                take = (i < accepted) & (done + i < c.tokens)
                rows = take.nonzero()[:, 0]
                errors[rows, (done + i)[rows]] = err[rows, i]
            exact.commit(accepted)
            arm.commit(accepted)
            done = done + accepted
            verify += 1
    return _to_frame(c, cell, errors)


def _to_frame(c: Config, cell: Cell, errors: torch.Tensor) -> pd.DataFrame:
    n_mem = len(c.memory)
    mem_idx = np.repeat(np.arange(n_mem), c.seeds * c.tokens)
    kind = np.int64 if c.seed0 + c.seeds <= 2**63 else np.uint64
    seed = np.tile(np.repeat(np.arange(c.seeds, dtype=kind), c.tokens), n_mem) + kind(c.seed0)
    arm = cell.arm
    frame = pd.DataFrame({
        "recurrence": c.recurrence, "arm": arm.label, "hi_format": arm.hi_format,
        "hi_rounding": arm.hi_rounding, "lo_format": arm.lo_format,
        "lo_rounding": arm.lo_rounding, "draft": cell.draft,
        "acceptance": cell.acceptance.label,
        "memory": np.array([m.name for m in c.memory], dtype=object)[mem_idx],
        "window": cell.window, "seed": seed,
        "token": np.tile(np.arange(1, c.tokens + 1), n_mem * c.seeds),
        "rel_err": errors.reshape(-1).numpy(),
    })
    return frame[list(CSV_COLUMNS)]


def run(config: Config, progress: bool = True, command: str | None = None) -> pd.DataFrame:
    """Run every cell in order, write the CSV to ``config.out`` and then its meta.json
    (``command``: the command line; from Python, a note saying so), each atomically."""
    start = time.perf_counter()
    grid = cells(config)
    frames = []
    for cell in grid:
        if progress:
            print(f"cell {cell.index + 1}/{len(grid)}: {cell.arm.label}, L {cell.window}, "
                  f"T {cell.draft}, acceptance {cell.acceptance.label}", file=sys.stderr)
        frames.append(run_cell(config, cell))
    frame = pd.concat(frames, ignore_index=True)
    write_csv(frame, config.out, float_format=FLOAT_FORMAT)
    c = config
    settings = {
        "recurrence": c.recurrence, "dv": c.dv, "dk": c.dk, "heads": c.heads,
        "seeds": c.seeds, "seed0": c.seed0, "tokens": c.tokens, "window": list(c.window),
        "draft": list(c.draft), "acceptance": [a.label for a in c.acceptance],
        "memory": [{"name": m.name, "low": m.low, "high": m.high} for m in c.memory],
        "arms": [a.label for a in c.arms], "cells": len(grid),
    }
    write_meta(c.out, command or f"{PROG} (run() called from Python)",
               time.perf_counter() - start, settings,
               extra={"experiment": SOURCE, "status": "complete"})
    return frame


def read_csv(path: str | Path) -> pd.DataFrame:
    """A CSV written by ``run``, checked against ``SCHEMA``, its tokens (1..--tokens, each
    once per series) and the sha256 its meta.json recorded; ``BadFile`` otherwise."""
    path = Path(path)
    meta = read_meta(meta_path(path))
    if not meta["command"].startswith(PROG):
        raise BadFile(f"{meta_path(path)}: not a meta.json of {SOURCE}")
    frame = read_table(path, SCHEMA)
    try:
        tokens = int(meta["config"]["tokens"])
    except (KeyError, TypeError, ValueError):
        raise BadFile(f"{meta_path(path)}: no tokens in its config") from None
    check_rows(path, frame["token"] > tokens, f"token: expected at most the run's {tokens}",
               frame["token"])
    for label in frame["arm"].unique():
        try:
            (spec,) = eg.parse_arm(label, [], [])
        except ValueError:
            spec = None
        rows = frame["arm"] == label
        if spec is None or spec.label != label:
            check_rows(path, rows, "arm: expected a canonical arm", frame["arm"])
        for name in ("hi_format", "hi_rounding", "lo_format", "lo_rounding"):
            check_rows(path, rows & (frame[name] != getattr(spec, name)),
                       f"{name}: expected {getattr(spec, name)!r} for the arm {label}",
                       frame[name])
    check_against_meta(path, meta)
    return frame


# --------------------------------------------------------------------------------------------
# plot, from the CSV alone

PANEL = ["lo_format", "window", "draft", "acceptance"]


def plot(csv_path: str | Path, png_path: str | Path) -> None:
    """Mean rel_err over blocks of L committed tokens (median over seeds, band min..max)
    against the committed length, log-log; one panel per (read format, L, T, acceptance)
    and memory profile, one curve per arm; blocks whose error is FP64 roundoff (the
    checkpointed arms before their first flush) are not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    frame = read_csv(csv_path)
    frame = frame.assign(block=(frame["token"] - 1) // frame["window"])
    series = ["arm", "hi_format", "hi_rounding", *PANEL, "memory"]
    per_seed = frame.groupby([*series, "block", "seed"], sort=False).agg(
        rel_err=("rel_err", "mean"), last=("token", "max"))
    means = per_seed.groupby(level=[*series, "block"], sort=False).agg(
        last=("last", "max"), median=("rel_err", "median"), low=("rel_err", "min"),
        high=("rel_err", "max")).reset_index()
    rows = list(dict.fromkeys(map(tuple, frame[PANEL].drop_duplicates().to_numpy())))
    mems = list(dict.fromkeys(frame["memory"]))
    height = 2.9 * len(rows) + 1.2
    fig, axes = plt.subplots(len(rows), len(mems), figsize=(max(4.6 * len(mems), 7.0), height),
                             sharex=True, sharey="row", squeeze=False)
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    handles = {}
    for r, key in enumerate(rows):
        fmt, window, draft, acc = key
        for col, mem in enumerate(mems):
            ax = axes[r][col]
            sel = (means[PANEL] == pd.Series(dict(zip(PANEL, key, strict=True)))).all(axis=1)
            panel = means[sel & (means["memory"] == mem)]
            for (arm, hi, hi_r), curve in panel.groupby(["arm", "hi_format", "hi_rounding"],
                                                         sort=False):
                scheme = arm.split(":")[0]
                colour, dash = _arm_style(hi, hi_r, scheme)
                label = _arm_legend(scheme, hi, hi_r)
                # below 1e-12 is FP64 roundoff: an arm exact there (before its first flush)
                curve = curve[curve["median"] > 1e-12].sort_values("last")
                if curve.empty:
                    continue
                (line,) = ax.plot(curve["last"], curve["median"], dash, color=colour, lw=1.4)
                ax.fill_between(curve["last"], curve["low"], curve["high"], color=colour,
                                alpha=0.15, lw=0)
                handles.setdefault(label, line)
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(plain)
                axis.set_minor_formatter(NullFormatter())
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", alpha=0.3)
            accepted = (f"acceptance {acc[1:]}" if acc.startswith("p")
                        else f"committed {acc.replace('-', ', ')}")
            ax.set_title(f"read copy {fmt}, L = {window}, T = {draft}, {accepted}\n"
                         f"memory {_memory_label(mem)}", fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("committed tokens (end of block of L)", fontsize=8)
            if col == 0:
                ax.set_ylabel("rel_err, mean over L tokens", fontsize=8)
    names = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet", "kda": "KDA"}
    recurrence = frame["recurrence"].iloc[0]
    title = textwrap.fill(
        f"{names.get(recurrence, recurrence)} under speculative decoding: output error of the "
        f"committed tokens against length, conventional vs checkpointed states (median over "
        f"{frame['seed'].nunique()} seeds, band = min..max)", int(fig.get_figwidth() * 13))
    fig.suptitle(title, fontsize=9)
    fig.legend(handles.values(), handles.keys(), loc="lower center",
               ncol=min(len(handles), 3), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.55 / height, 1, 1))
    save_small_png(fig, png_path, dpi=150, source=SOURCE)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# command line

BASE_DEFAULTS = {
    "recurrence": "mamba2", "dv": 8, "dk": 32, "heads": 1, "seeds": 4, "seed0": 0,
    "tokens": 1024, "window": "16", "draft": "4", "acceptance": "0.7",
    "memory": ["long", "short"], "arms": "every_step,shared,separate_exact,separate_fp16sr",
    "formats": "fp8_e4m3_row", "rounding": "sr",
}
PRESETS = {
    "toy": {
        "recurrence": "mamba2", "dv": 8, "dk": 32, "heads": 1, "seeds": 4, "tokens": 1024,
        "window": "16", "draft": "4", "acceptance": "0.5,0.9", "memory": ["long"],
        "arms": "every_step:fp8_e4m3_row:rn,shared:fp8_e4m3_row:sr,separate_exact,"
        "separate_fp16sr",
        "formats": "fp8_e4m3_row", "rounding": "sr",
    },
}
for _recurrence in ("gdn", "kda"):  # the delta rule at a small head, a CPU minute each
    PRESETS[f"{_recurrence}-toy"] = {
        "recurrence": _recurrence, "dv": 16, "dk": 32, "heads": 1, "seeds": 4, "tokens": 1024,
        "window": "16", "draft": "4", "acceptance": "0.5,0.9", "memory": ["long", "short"],
        "arms": "every_step:fp16:rn,shared:nvfp4:rn,separate_exact:nvfp4,"
        "separate_fp16sr:nvfp4",
        "formats": "nvfp4", "rounding": "rn",
    }
_HELP = {
    "recurrence": "mamba2, gdn or kda",
    "dv": "rows of the state per head", "dk": "columns of the state per head",
    "heads": "heads per sequence", "seeds": "sequences with independent inputs",
    "seed0": "first seed (inputs, acceptance draws, SR words)",
    "tokens": f"committed tokens per sequence, 1 .. {MAX_TOKENS}",
    "window": "L, or a comma-separated list", "draft": "T: tokens per verify, or a list; T <= L",
    "acceptance": "comma-separated: a rate in [0, 1] (each speculative draft accepted with it "
    "until the first rejection) or a pattern of committed counts c1-c2-... (each in [1, T])",
    "memory": "decay ranges: long, short or LO,HI", "arms": "as error_growth's --arms",
    "formats": "formats of arms given without one", "rounding": "roundings of every_step and "
    "shared arms given without one",
}
OUTPUT_RULE = """where outputs go (paths relative to the current folder):
  --preset NAME alone   results/spec_error_NAME.{csv,meta.json,png}: its regenerate command
  --out PATH.csv        PATH.csv, PATH.meta.json and PATH.png (--plot: elsewhere or none)
  anything else         runs/spec_error_<preset or custom>_<flags given>/spec_error.*
  a file there that is not this experiment's output is replaced only with --force"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG, description="Output error of the committed tokens under speculative "
        "decoding, per precision policy (see the module docstring).", epilog=OUTPUT_RULE,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="start from a preset; alone, it regenerates results/")
    ints = {"dv", "dk", "heads", "seeds", "seed0", "tokens"}
    for name, text in _HELP.items():
        kwargs = {"type": int if name in ints else str, "default": None}
        if name == "recurrence":
            kwargs["choices"] = eg.RECURRENCES
        if name == "memory":
            kwargs["nargs"] = "+"
        parser.add_argument("--" + name, help=f"{text} (default: {_show(BASE_DEFAULTS[name])})",
                            **kwargs)
    parser.add_argument("--out", default=None, help="CSV path; meta.json and PNG beside it")
    parser.add_argument("--plot", default=None, help="PNG path or 'none'")
    parser.add_argument("--force", action="store_true",
                        help="replace output files that are not this experiment's own")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from --out's CSV")
    parser.add_argument("--no-progress", action="store_true", help="no line per cell")
    return parser


def config_from_args(args: argparse.Namespace, argv: list[str]) -> Config:
    given = [k for k, v in vars(args).items() if k in BASE_DEFAULTS and v is not None]
    if args.replot and given:
        raise ValueError(f"--replot: --{given[0]} sets up a run; a replot draws the CSV as it "
                         "was run")
    values = {**BASE_DEFAULTS, **(PRESETS[args.preset] if args.preset else {}),
              **{k: vars(args)[k] for k in given}}
    for name in ("out", "plot"):
        if getattr(args, name) is not None and not getattr(args, name).strip():
            raise ValueError(f"--{name}: expected a path, got {getattr(args, name)!r}")
    if args.out:
        out = args.out
    elif args.preset and not given:
        out = f"results/spec_error_{args.preset}.csv"
    else:
        words = _setting_words(argv)
        out = str(runs_folder("spec_error", [args.preset or "custom", *words]) / "spec_error.csv")
    if is_folder(out) or Path(out).suffix.lower() != ".csv":
        raise ValueError(f"out: expected a path ending in .csv, got {out!r}")
    plot_path = args.plot or str(Path(out).with_suffix(".png"))
    if plot_path.lower() != "none":
        _check_plot_path(plot_path)
    for path in [p for p in (out if not args.replot else None, plot_path) if p
                 and p.lower() != "none"]:
        if problem := file_problem(path):
            raise ValueError(f"--out: cannot write {path}: {problem}")
    if not args.force:
        written = [] if args.replot else [(out, SCHEMA.header), (str(meta_path(out)), None)]
        written += [(plot_path, None)] if plot_path.lower() != "none" else []
        for path, header in written:
            if problem := output_problem(path, SOURCE, header):
                raise ValueError(f"--out: {problem}")

    def ints(name):
        return tuple(_positive(name, x) for x in eg._split(name, values[name]))

    return Config(
        recurrence=values["recurrence"], dv=values["dv"], dk=values["dk"],
        heads=values["heads"], seeds=values["seeds"], seed0=values["seed0"],
        tokens=values["tokens"], window=ints("window"), draft=ints("draft"),
        acceptance=tuple(parse_acceptance(x) for x in eg._split("acceptance",
                                                                values["acceptance"])),
        memory=tuple(eg.parse_memory(m) for m in values["memory"]),
        arms=eg.parse_arms(values["arms"], values["formats"], values["rounding"]),
        out=out, plot=None if plot_path.lower() == "none" else plot_path,
    )


def _positive(name: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name}: expected integers >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, argv)
    except ValueError as error:
        parser.error(str(error))
    if args.replot:
        try:
            read_csv(config.out)
        except (OSError, ValueError) as error:
            parser.error(f"--replot: {error}")
    else:
        start = time.perf_counter()
        try:
            frame = run(config, not args.no_progress, " ".join([PROG, *map(shlex.quote, argv)]))
        except OSError as error:
            parser.error(f"cannot write {config.out}: {error}")
        print(f"wrote {config.out} and its .meta.json ({len(frame)} rows) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    if config.plot:
        try:
            plot(config.out, config.plot)
        except OSError as error:
            parser.error(f"cannot write {config.plot}: {error}")
        print(f"wrote {config.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
