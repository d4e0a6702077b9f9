"""Error growth against decode length: how each precision policy's output error evolves.

The kit's main figure. A batch of sequences is decoded token by token twice from the same
inputs: once exactly (FP64, nothing rounded) and once under each precision policy of
`lowprec.policies` (one `Simulator` per arm, all advanced in the same step loop). At every
recorded step the error of the layer output of one sequence is

    rel_err_t = ||y_hat_t - y_t||_2 / ||y_t||_2        norms over heads and d_v

Arms (``--arms``; the grammar, with the CSV's ``arm`` column holding the canonical form):

    every_step:<format>[:<rounding>]      conventional: the state is stored in the format
                                          every token (rounding rn or sr)
    shared:<format>[:<rounding>]          one checkpoint in the format, rounded once per
                                          window of L tokens, read by the window's steps and by
                                          the next flush
    separate:<hi format>[:<rounding>]:<read format>
                                          two copies written at each flush: the recurrence
                                          copy in <hi format> with <rounding> (default rn),
                                          the read copy in <read format>, always RN; e.g.
                                          separate:fp16:sr:nvfp4, separate:bf16:sr:nvfp4,
                                          separate:fp8_e4m3:sr:nvfp4, separate:fp64:nvfp4
    separate_exact:<read format>          alias of separate:fp64:rn:<read format>
    separate_fp16sr:<read format>         alias of separate:fp16:sr:<read format>: the kit's
                                          two-precision scheme

A missing format expands over ``--formats`` and a missing rounding of every_step and shared
over ``--rounding``. The CSV spells each arm out: ``arm`` (canonical, ``separate:fp16:sr:nvfp4``),
``hi_format``/``hi_rounding`` (the recurrence copy; the stored state for every_step and shared)
and ``lo_format``/``lo_rounding`` (the copy the window's steps read; the same for every_step
and shared). Windows are L tokens long (``--window`` takes a list: one run, a ``window``
column); step ``t`` (counting from 1) is a flush step when ``t % L == 0``, and a flush step's
output reads the unrounded new state. So before the first flush the windowed arms are exact,
and at every flush step separate:fp64 is exact again: its error lives on the L - 1 other steps.

Inputs, per sequence (seed) and head, a fresh draw every step, seeded by a `torch.Generator`
per seed (so a seed's inputs do not depend on the other seeds or on ``--steps``):

    v ~ N(0, I_dv)   (Mamba-2's dt * x)     k ~ N(0, I_dk)  (B)     q ~ N(0, I_dk)  (C)
    a ~ U[lo, hi)    per head (Mamba-2, GDN) or per head and channel of d_k (KDA)
    beta ~ U[0, 1)   GDN and KDA only, whose k and q are scaled to unit norm (as those models
                     L2-normalise them, which keeps the delta rule a contraction)

``--memory`` names the decay range: ``long`` = [0.9995, 0.99999), ``short`` = [0.9, 0.95),
or ``LO,HI``. All memory profiles share the Gaussian draws and the uniform behind ``a``, so
their curves differ only by the decay. Memories and seeds form the simulator's batch
(slot = memory index * seeds + seed index); SR words are Philox words keyed by ``--seed0`` and
indexed by that slot, the write counter and the element (``lowprec/README.md``).

Recording. ``--log-grid 0`` records every step. ``--log-grid G`` records every step of about
G windows spaced geometrically over the run, plus the windows that hold steps 64, 1,024, 4,096
and the last step: whole windows, because the error of a windowed arm is a sawtooth over the
window (zero at separate_exact's flush steps, which all powers of two >= L are), and a step
sampled at one phase would misreport it. The plot and the summary therefore use the *window
mean* of rel_err (over the L steps of the window holding a step), median over seeds.

Backends (``--backend``; the exact run is the FP64 ``Simulator`` on ``--device`` for both, and
the CSV has the same rows and columns for both):

    reference   ``lowprec.policies.Simulator`` in FP64, every recurrence (the default); needs
                neither Triton nor CuTe DSL
    emulation   the Triton kernels of ``emulation/`` (fp32 containers holding values of the
                format; Mamba-2 only), on a GPU compiled, on a CPU under TRITON_INTERPRET=1
                (about 0.15 s per arm and step at the test size: tiny runs only); imported
                only for this backend

The emulation runs the generic step through the Mamba-2 kernel arguments exactly
(``mamba2_kernel_inputs``): per head ``A = -1`` and the processed ``dt = -log(a)``
(``dt_softplus=False``, no ``dt_bias``), so ``exp(dt A) = a``; ``x = v / dt``, so ``dt x = v``;
``B = k`` and ``C = q`` with ``ngroups = nheads``; ``D`` and ``z`` absent; all fp32. Its slots
are the simulator's batch in the same order and the Philox seed is ``--seed0``, so SR draws
the same words as the reference. Arms: every_step is ``emulation.state_update`` with the
format and rounding, the output reading the stored state (as the reference defines the arm);
the other arms are ``emulation.replay_decode`` with window L and the arm's recurrence and read
copies; a recurrence copy in fp64 (separate:fp64) is kept in fp32 (the kernels' exact copy),
so its flush steps carry an fp32 error (about 1e-7) instead of 0; shared keeps hi = lo = the
format, which is the shared policy only for element formats with RN (the kernels' read copy
is always RN and the recurrence copy holds no block scales). fp64 is not a kernel format.
Otherwise the two backends differ by fp32 arithmetic only, which at times flips an FP16
rounding (tests/test_error_growth.py compares the two CSVs).

The grid. A run is a list of independent cells (``cells(config)``), one per (window, arm) in
that order; ``run_cell(config, cell)`` returns the cell's rows (every memory profile and seed:
they are the simulator's batch, whose slot numbers key the SR words), computed from the
cell's own inputs and the exact outputs (``exact_outputs``, computed once per window and
process). ``run`` writes the cells' rows in cell order, so rows computed apart (another
process, another rank) and concatenated in that order give the same bytes.

Outputs: a tidy CSV, one row per (window, arm, memory, seed, step), columns exactly
``CSV_COLUMNS``, floats written ``%.6e`` so a rerun reproduces the file byte for byte; a
sidecar ``<csv stem>.meta.json`` (command, commit, seconds, versions, config, the CSV's row
count and sha256); a PNG read back from the CSV only (``plot``); a summary table printed to
stdout (``summarize``). Every file is written under a temporary name and renamed when
complete. Where they go:

    --preset NAME alone          results/error_growth_NAME.{csv,meta.json,png}: the preset's
                                 regenerate command, the only run that replaces committed files
    --out PATH.csv               PATH.csv, PATH.meta.json and PATH.png, whatever the current
                                 folder (--plot elsewhere or none)
    anything else                runs/error_growth_<preset or custom>_<flags>/error_growth.*
                                 (git-ignored), named by the flags given

A file at an output path that is not this experiment's own (another header, another meta,
another PNG) is not replaced without ``--force``. A run stopped by Ctrl-C or SIGTERM writes
the whole windows done to ``<stem>.partial.csv`` (and its meta), never to the final name,
and exits with status 130. ``--replot`` refuses, in one line naming the file and the line, a
CSV that differs from what its meta.json recorded, is cut short, has other columns, a value of
the wrong type, a negative error, a step off the recorded grid, or a row twice.

    python -m experiments.error_growth --preset toy                    # ~10 s, 2-core CPU
    python -m experiments.error_growth --preset default               # ~6 min on a 2-core CPU
    python -m experiments.error_growth --preset default --replot       # redraw from the CSV
    python -m experiments.error_growth --preset default --replot --plot none --at 112,192
                                                  # the summary at the windows of other steps
    python -m experiments.error_growth --preset toy --window 8,16,32 \
        --arms separate:bf16:sr:fp8_e4m3_row,separate:fp8_e4m3:sr:fp8_e4m3_row
                                                  # writes under runs/
    python -m experiments.error_growth --help
    python -m experiments.error_growth --backend emulation --device cuda --dv 64 --dk 128 \
        --heads 128 --seeds 2 --steps 131072 --log-grid 48 \
        --arms separate_fp16sr:nvfp4,every_step:fp16:rn --memory long \
        --out results/error_growth_emulation_gpu.csv --plot results/error_growth_emulation_gpu.png
                                                  # H200 (bash scripts/gpu_session.sh E)

The default preset (Nemotron-3-Super head shape, 2 heads x 2 seeds, 16,384 steps, 16 arms)
took 348 s on a 2-core CPU (its meta.json). Its every_step arms are RN: SR at every token
would draw one Philox word per state element per step (about 1.5 hours at this size); the toy
preset is where RN and SR of the conventional state are compared.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.error_growth")

import argparse
import dataclasses
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

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
    write_meta,
)
from experiments._common import write_csv as write_table
from experiments._interrupt import INTERRUPTED_STATUS
from experiments.sharding import HELP as SHARDING_HELP
from experiments.sharding import add_arguments as add_sharding_arguments
from lowprec import formats, philox
from lowprec._checks import check_float, check_ndim, check_shape
from lowprec.metrics import rel_err
from lowprec.policies import Policy, Simulator, make_policy

__all__ = [
    "ARMS",
    "BACKENDS",
    "CSV_COLUMNS",
    "MEMORY_PROFILES",
    "PRESETS",
    "SCHEMA",
    "ArmSpec",
    "Cell",
    "Config",
    "Memory",
    "cells",
    "config_from_args",
    "exact_outputs",
    "main",
    "make_inputs",
    "mamba2_kernel_inputs",
    "merge_cells",
    "parse_arm",
    "parse_arms",
    "parse_memory",
    "plot",
    "read_csv",
    "recorded_steps",
    "run",
    "run_cell",
    "summarize",
    "window_means",
]

SOURCE = "experiments.error_growth"
PROG = "python -m " + SOURCE
SCHEMES = ("every_step", "shared", "separate")
# alias -> (recurrence copy format, its rounding) of a separate arm
ALIASES = {"separate_exact": ("fp64", "rn"), "separate_fp16sr": ("fp16", "sr")}
ARMS = (*SCHEMES, *ALIASES)
RECURRENCES = ("mamba2", "gdn", "kda")
BACKENDS = ("reference", "emulation")
ROUNDINGS = ("rn", "sr")
MEMORY_PROFILES = {"long": (0.9995, 0.99999), "short": (0.9, 0.95)}
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
SUMMARY_STEPS = (64, 1024, 4096)
FLOAT_FORMAT = "%.6e"
# Inputs are drawn this many steps at a time; the chunk is part of the definition of a seed's
# input stream (changing it changes the numbers), so it is a constant, not an option.
INPUT_CHUNK = 256
# every_step uses the token counter as Philox's write counter, which has 20 bits.
MAX_STEPS = philox.FLUSH_LIMIT
STOPPED_STATUS = INTERRUPTED_STATUS  # a run stopped by SIGINT or SIGTERM (its windows kept)
# The emulation's state update refuses a counter of 2^20 - 1 before its call, so one step less.
MAX_EMULATION_STEPS = philox.FLUSH_LIMIT - 1
EMULATION_ARMS_TEXT = (
    "the emulation backend runs every_step with any format but fp64 (rn or sr), separate "
    "with any read-copy format but fp64 (a recurrence copy in fp64 is kept in fp32), and "
    "shared only with rn and an element format but fp64 (fp32, fp16, bf16, fp8_e4m3, fp8_e5m2)"
)


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class ArmSpec:
    """One simulated policy: its scheme, the recurrence copy (``hi``: the stored state for
    every_step and shared) and the read copy (``lo``), each a format and a rounding."""

    scheme: str
    lo_format: str
    lo_rounding: str
    hi_format: str
    hi_rounding: str

    @classmethod
    def single(cls, scheme: str, fmt: str, rounding: str) -> ArmSpec:
        """every_step or shared: one copy in ``fmt`` with ``rounding``."""
        return cls(scheme, fmt, rounding, fmt, rounding)

    @classmethod
    def separate(cls, hi_format: str, hi_rounding: str, lo_format: str) -> ArmSpec:
        return cls("separate", lo_format, "rn", hi_format, hi_rounding)

    @property
    def label(self) -> str:
        """The canonical arm: ``every_step:fp16:rn``, ``separate:fp16:sr:nvfp4``."""
        if self.scheme == "separate":
            return f"separate:{self.hi_format}:{self.hi_rounding}:{self.lo_format}"
        return f"{self.scheme}:{self.lo_format}:{self.lo_rounding}"

    @property
    def sr(self) -> bool:
        """Whether a copy of the arm draws SR words."""
        return "sr" in (self.lo_rounding, self.hi_rounding)

    def policy(self, window: int, seed: int, sr_bits: int = philox.DEFAULT_SR_BITS,
               philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS) -> Policy:
        """The `lowprec.policies.Policy` of the arm with windows of ``window`` tokens and SR
        words of ``sr_bits`` bits from ``philox_rounds``-round Philox (an arm without SR
        takes the defaults)."""
        if self.scheme == "separate":
            sr = self.hi_rounding == "sr"
            return Policy("separate", fmt=self.lo_format, rounding="rn",
                          hi_fmt=self.hi_format, hi_rounding=self.hi_rounding, window=window,
                          seed=seed if sr else 0,
                          sr_bits=sr_bits if sr else philox.DEFAULT_SR_BITS,
                          philox_rounds=philox_rounds if sr else philox.DEFAULT_PHILOX_ROUNDS)
        return make_policy(self.scheme, self.lo_format, self.lo_rounding, window=window,
                           seed=seed, sr_bits=sr_bits, philox_rounds=philox_rounds)


@dataclass(frozen=True)
class Memory:
    """A decay range ``[low, high)`` and its name in the CSV."""

    name: str
    low: float
    high: float


@dataclass(frozen=True)
class Cell:
    """One independent piece of a run: one arm at one window and one SR setting (an arm
    without SR has the defaults 32 bits, 10 rounds, which it does not use), over every memory
    profile and seed of the config (the simulator's batch). ``index`` is its place in
    ``cells(config)``, which is the order of its rows in the CSV."""

    index: int
    window: int
    arm: ArmSpec
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS

    @property
    def key(self) -> str:
        """Unique per cell of a run and stable across runs: the cell store's key."""
        return f"L{self.window}/{self.arm.label}/sr{self.sr_bits}x{self.philox_rounds}"


@dataclass(frozen=True)
class Config:
    """Everything a run depends on (``out``, ``plot`` and ``progress`` do not change numbers).
    ``window`` is one L or a tuple of them (stored as a tuple)."""

    recurrence: str = "mamba2"
    dv: int = 8
    dk: int = 32
    heads: int = 1
    seeds: int = 4
    seed0: int = 0
    steps: int = 4096
    window: tuple[int, ...] = (16,)
    memory: tuple[Memory, ...] = tuple(Memory(n, *r) for n, r in MEMORY_PROFILES.items())
    arms: tuple[ArmSpec, ...] = field(
        default_factory=lambda: parse_arms("every_step,shared,separate_exact,separate_fp16sr",
                                           "fp8_e4m3_row", "sr")
    )
    log_grid: int = 0
    out: str = "runs/error_growth_custom/error_growth.csv"
    plot: str | None = "runs/error_growth_custom/error_growth.png"
    progress: bool = True
    device: str = "cpu"
    threads: int = 1
    backend: str = "reference"
    sr_bits: tuple[int, ...] = (philox.DEFAULT_SR_BITS,)
    philox_rounds: tuple[int, ...] = (philox.DEFAULT_PHILOX_ROUNDS,)

    def __post_init__(self):
        if self.recurrence not in RECURRENCES:
            raise ValueError(
                f"recurrence: expected one of {list(RECURRENCES)}, got {self.recurrence!r}"
            )
        windows = (self.window,) if isinstance(self.window, int) else self.window
        if not isinstance(windows, tuple) or not windows:
            raise ValueError(f"window: expected an int or a non-empty tuple of ints, got "
                             f"{self.window!r}")
        for w in windows:
            _check_int("window", w, 1)
        if len(set(windows)) != len(windows):
            raise ValueError(f"window: expected distinct windows, got {list(windows)}")
        object.__setattr__(self, "window", windows)
        for name, check in (("sr_bits", philox.check_sr_bits),
                            ("philox_rounds", philox.check_philox_rounds)):
            values = getattr(self, name)
            values = (values,) if isinstance(values, int) else values
            if not isinstance(values, tuple) or not values:
                raise ValueError(f"{name}: expected an int or a non-empty tuple of ints, got "
                                 f"{getattr(self, name)!r}")
            values = tuple(check(v) for v in values)
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: expected distinct values, got {list(values)}")
            object.__setattr__(self, name, values)
        for name in ("dv", "dk", "heads", "seeds", "steps"):
            _check_int(name, getattr(self, name), 1)
        _check_int("seed0", self.seed0, 0)
        _check_int("log_grid", self.log_grid, 0)
        _check_int("threads", self.threads, 1)
        if self.steps > MAX_STEPS:
            raise ValueError(f"steps: expected at most {MAX_STEPS}, got {self.steps}")
        if self.heads * self.dv * self.dk > philox.ELEMENT_LIMIT:
            raise ValueError(
                f"heads * dv * dk: expected at most {philox.ELEMENT_LIMIT} state elements per "
                f"sequence, got {self.heads * self.dv * self.dk}"
            )
        if not self.memory:
            raise ValueError("memory: expected at least one decay range, got none")
        names = [m.name for m in self.memory]
        # by bounds: 'short' and '0.9,0.95' are one range under two names (it would run twice)
        if len({(m.low, m.high) for m in self.memory}) != len(names):
            raise ValueError(f"memory: expected distinct ranges, got {names}")
        for m in self.memory:
            _check_memory(m.low, m.high)
        if self.seed0 + self.seeds > philox.SEED_LIMIT:
            raise ValueError(f"seed0: expected seed0 + seeds <= 2^64, got {self.seed0}")
        if len(self.memory) * self.seeds > philox.SLOT_LIMIT:
            raise ValueError(
                f"seeds: expected memories * seeds <= {philox.SLOT_LIMIT} Philox slots, "
                f"got {len(self.memory) * self.seeds}"
            )
        if not self.arms:
            raise ValueError("arms: expected at least one arm, got none")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms: expected distinct arms, got {[a.label for a in self.arms]}")
        for spec in self.arms:
            _check_arm(spec, self.dv, self.dk)
        _check_device(self.device)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {self.backend!r}")
        if self.backend == "emulation":
            _check_emulation(self)
        _check_memory_use(self)


def memory_estimate(c: Config) -> tuple[int, int]:
    """(bytes on the run's device, bytes in host memory), roughly: four fp64 copies of the
    state for the arm of a cell and for the exact run, the exact outputs at the recorded steps
    (on the device), and the fp64 errors of every arm, sequence and recorded step (host)."""
    batch = len(c.memory) * c.seeds
    states = 2 * batch * c.heads * c.dv * c.dk * 8 * 4
    n_windows = math.ceil(c.steps / min(c.window))
    recorded = c.steps if c.log_grid == 0 else min(
        c.steps, (min(c.log_grid, n_windows) + len(SUMMARY_STEPS) + 1) * max(c.window))
    exact = recorded * batch * c.heads * c.dv * 8
    errors = len(c.arms) * len(c.window) * batch * recorded * 8 * 4  # and the frame's columns
    return (states + exact, errors) if c.device != "cpu" else (0, states + exact + errors)


def _check_memory_use(c: Config) -> None:
    """Refuse a run that cannot fit, before the progress bar starts (not an allocation failure
    or thrashing later): host memory here, and the GPU's for a cuda device."""
    device_bytes, host_bytes = memory_estimate(c)
    try:
        host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        host_total = None
    limits = [("host memory", host_bytes, host_total)]
    if c.device != "cpu" and torch.cuda.is_available():
        limits.append((f"{c.device} memory", device_bytes,
                       torch.cuda.get_device_properties(torch.device(c.device)).total_memory))
    for where, need, total in limits:
        if total and need > 0.8 * total:
            raise ValueError(
                f"size: this run needs about {need / 2**30:.1f} GiB of {where}, more than 80% "
                f"of the {total / 2**30:.1f} GiB here (fewer --seeds, --heads, arms or a "
                "smaller --dv/--dk or --log-grid)")


def _check_emulation(c: Config) -> None:
    """The limits of the emulation kernels, beyond those of the reference."""
    if (c.sr_bits, c.philox_rounds) != ((philox.DEFAULT_SR_BITS,),
                                        (philox.DEFAULT_PHILOX_ROUNDS,)):
        missing = _emulation_without_sr_settings()
        if missing:
            raise ValueError(f"sr_bits: the installed emulation's {missing} takes no sr_bits "
                             "and philox_rounds: the emulation backend runs 32 bits, 10 rounds "
                             "only (use --backend reference)")
    if c.steps > MAX_EMULATION_STEPS:
        raise ValueError(
            f"steps: expected at most {MAX_EMULATION_STEPS} with the emulation backend (Philox "
            f"token counter), got {c.steps}"
        )
    if len(c.memory) * c.seeds >= philox.SLOT_LIMIT:
        raise ValueError(
            f"seeds: expected memories * seeds < {philox.SLOT_LIMIT} slots with the emulation "
            f"backend, got {len(c.memory) * c.seeds}"
        )
    for spec in c.arms:
        supported = formats.get(spec.lo_format).element.bits <= 32
        if spec.scheme == "every_step" or spec.scheme == "shared":
            supported = supported and formats.get(spec.hi_format).element.bits <= 32
        if spec.scheme == "shared":
            fmt = formats.get(spec.lo_format)
            supported = supported and fmt.block is None and spec.lo_rounding == "rn"
        if not supported:
            raise ValueError(f"arms: {EMULATION_ARMS_TEXT}; got {spec.label}")


def _emulation_without_sr_settings() -> str | None:
    """The first emulation cache whose ``empty`` lacks ``sr_bits``/``philox_rounds``, or None."""
    import inspect

    from emulation.gdn_replay_decode import GDNReplayCache
    from emulation.replay_decode import ReplayCache
    from emulation.state_update import StateCache

    for cls in (ReplayCache, StateCache, GDNReplayCache):
        parameters = inspect.signature(cls.empty).parameters
        if not {"sr_bits", "philox_rounds"} <= set(parameters):
            return f"{cls.__name__}.empty"
    return None


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def _check_device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")


def _check_memory(low: float, high: float) -> None:
    if not (0.0 < low <= high < 1.0):
        raise ValueError(f"memory: expected 0 < LO <= HI < 1, got LO={low!r}, HI={high!r}")


def _check_arm(spec: ArmSpec, dv: int, dk: int) -> None:
    if spec.scheme not in SCHEMES:
        raise ValueError(f"arms: expected schemes among {list(SCHEMES)}, got {spec.scheme!r}")
    for name in ("lo_format", "hi_format"):
        if getattr(spec, name) not in formats.names():
            raise ValueError(f"arms: expected formats among {formats.names()}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")
    for name in ("lo_rounding", "hi_rounding"):
        if getattr(spec, name) not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")
    if spec.scheme == "separate" and spec.lo_rounding != "rn":
        raise ValueError(f"rounding: the read copy of a separate arm is always RN, got "
                         f"{spec.lo_rounding!r} in {spec.label}")
    if spec.scheme != "separate" and (spec.hi_format, spec.hi_rounding) != (
            spec.lo_format, spec.lo_rounding):
        raise ValueError(f"arms: {spec.scheme} keeps one copy, got hi {spec.hi_format} "
                         f"{spec.hi_rounding} and lo {spec.lo_format} {spec.lo_rounding}")
    if spec.scheme == "separate" and spec.hi_format == "fp64" and spec.hi_rounding != "rn":
        raise ValueError(f"rounding: a recurrence copy in fp64 is exact (nothing to round), "
                         f"got {spec.hi_rounding!r} in {spec.label}")
    for name in {spec.lo_format, spec.hi_format}:
        fmt = formats.get(name)
        if fmt.block is not None:
            fmt.block_length((dv, dk))  # raises ValueError naming the shape and the block


def parse_memory(text: str) -> Memory:
    """``'long'``, ``'short'`` or ``'LO,HI'`` (named ``'LO..HI'`` in the CSV, comma-free)."""
    if text in MEMORY_PROFILES:
        return Memory(text, *MEMORY_PROFILES[text])
    parts = text.split(",")
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"memory: expected 'long', 'short' or 'LO,HI' (two numbers), got {text!r}"
        ) from None
    _check_memory(low, high)
    return Memory(f"{low!r}..{high!r}", low, high)  # repr: exact (%g kept 6 digits)


def parse_arm(item: str, fmts: list[str], roundings: list[str]) -> list[ArmSpec]:
    """The arms of one ``--arms`` item (see the module docstring's grammar); a missing format
    expands over ``fmts``, a missing rounding of every_step or shared over ``roundings``.

    ``separate:fp16:sr:nvfp4`` -> one arm; ``separate:bf16:nvfp4`` -> the recurrence copy
    RN; ``separate:fp16:sr`` -> read copies over ``fmts``; ``separate_fp16sr:nvfp4`` ->
    ``separate:fp16:sr:nvfp4``."""
    parts = item.split(":")
    if not all(parts):
        raise ValueError(f"arms: expected items without empty fields, got {item!r}")
    scheme, rest = parts[0], parts[1:]
    if scheme not in ARMS:
        raise ValueError(f"arms: expected arms among {list(ARMS)}, got {scheme!r} in {item!r}")
    if scheme in ALIASES:
        if len(rest) > 2 or (len(rest) == 2 and rest[1] != "rn"):
            raise ValueError(f"arms: expected {scheme}[:READ_FORMAT] (its read copy is RN), "
                             f"got {item!r}")
        hi_format, hi_rounding = ALIASES[scheme]
        return [ArmSpec.separate(hi_format, hi_rounding, f) for f in (rest[:1] or fmts)]
    if scheme == "separate":
        if not rest or len(rest) > 3:
            raise ValueError("arms: expected separate:HI_FORMAT[:ROUNDING][:READ_FORMAT], got "
                             f"{item!r}")
        hi_format, rest = rest[0], rest[1:]
        hi_rounding = rest.pop(0) if rest and rest[0] in ROUNDINGS else "rn"
        if len(rest) > 1:
            raise ValueError(f"arms: expected separate:HI_FORMAT[:ROUNDING][:READ_FORMAT], got "
                             f"{item!r} ({rest[0]!r} is not a rounding)")
        return [ArmSpec.separate(hi_format, hi_rounding, f) for f in (rest or fmts)]
    if len(rest) > 2:
        raise ValueError(f"arms: expected {scheme}[:FORMAT[:ROUNDING]], got {item!r}")
    item_fmts = rest[:1] or fmts
    item_roundings = rest[1:2] or roundings
    return [ArmSpec.single(scheme, f, r) for f in item_fmts for r in item_roundings]


def parse_arms(arms: str, fmts: str, rounding: str) -> tuple[ArmSpec, ...]:
    """Arm specs from ``--arms``, ``--formats`` and ``--rounding`` (all comma-separated).
    ``every_step,shared`` with ``fmts='fp16,nvfp4'`` gives four arms. Duplicates (an alias and
    its canonical form included) are dropped, the first occurrence keeping its place."""
    default_fmts = _split("formats", fmts)
    default_roundings = _split("rounding", rounding)
    # checked when no arm uses them too (--formats fp7 beside --arms shared:fp16 is an error)
    for fmt in default_fmts:
        if fmt not in formats.names():
            raise ValueError(f"formats: expected formats among {formats.names()}, got {fmt!r}")
    for r in default_roundings:
        if r not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got {r!r}")
    specs: list[ArmSpec] = []
    for item in _split("arms", arms):
        for spec in parse_arm(item, default_fmts, default_roundings):
            _check_arm_names(spec)
            if spec not in specs:
                specs.append(spec)
    return tuple(specs)


def _check_arm_names(spec: ArmSpec) -> None:
    """Formats and roundings by name (the shape checks wait for the config)."""
    for name in ("lo_format", "hi_format"):
        if getattr(spec, name) not in formats.names():
            raise ValueError(f"formats: expected formats among {formats.names()}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")
    for name in ("lo_rounding", "hi_rounding"):
        if getattr(spec, name) not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got "
                             f"{getattr(spec, name)!r} in {spec.label}")


def _split(name: str, text: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not all(items):
        raise ValueError(
            f"{name}: expected a comma-separated list without empty items, got {text!r}"
        )
    return items


# --------------------------------------------------------------------------------------------
# presets and the command line

# Values as the command line would give them; explicit flags override a preset's.
BASE_DEFAULTS = {
    "recurrence": "mamba2",
    "dv": 8,
    "dk": 32,
    "heads": 1,
    "seeds": 4,
    "seed0": 0,
    "steps": 4096,
    "window": "16",
    "memory": ["long", "short"],
    "arms": "every_step,shared,separate_exact,separate_fp16sr",
    "formats": "fp8_e4m3_row",
    "rounding": "sr",
    "log_grid": 0,
    "device": "cpu",
    "threads": 1,
    "backend": "reference",
    "sr_bits": "32",
    "philox_rounds": "10",
}

PRESETS = {
    "toy": {
        "recurrence": "mamba2",
        "dv": 8,
        "dk": 32,
        "heads": 1,
        "seeds": 8,
        "steps": 4096,
        "window": "16",
        "memory": ["long", "short"],
        "arms": "every_step:fp8_e4m3_row:rn,every_step:fp8_e4m3_row:sr,shared,separate_exact",
        "formats": "fp8_e4m3_row",
        "rounding": "sr",
        "log_grid": 3,  # the windows holding steps 16, 64, 256, 1024, 4096: a 0.5 MB CSV
    },
    "default": {
        "recurrence": "mamba2",
        "dv": 64,
        "dk": 128,
        # 2 heads x 2 seeds keeps the 16,384 steps within a few minutes on a 2-core CPU: the
        # every-token arms quantise every state at every step, and SR there would need 2.6e10
        # Philox words (about 1.5 h measured), so the conventional arm is RN here (as serving
        # stacks store FP16 states) and the toy preset is where RN and SR are compared.
        "heads": 2,
        "seeds": 2,
        "steps": 16384,
        "window": "16",
        "memory": ["long", "short"],
        "arms": "every_step:fp16:rn,every_step:fp8_e4m3:rn,every_step:nvfp4:rn,"
        "every_step:mxfp4:rn,shared,separate_exact,separate_fp16sr",
        "formats": "fp16,fp8_e4m3,nvfp4,mxfp4",
        "rounding": "sr",
        "log_grid": 12,
    },
    # the SR ablation: the recurrence copy and a conventional SR state at each setting
    "sr-toy": {
        "recurrence": "mamba2",
        "dv": 8,
        "dk": 32,
        "heads": 1,
        "seeds": 8,
        "steps": 4096,
        "window": "16",
        "memory": ["long", "short"],
        "arms": "separate:fp16:sr:nvfp4,every_step:fp16:sr",
        "formats": "nvfp4",
        "rounding": "sr",
        # the windows holding steps 16, 64, 1024 and 4096; 8 bits (13 and 16 lie between) and
        # 7 and 4 rounds: six settings keep the CSV near 1 MB
        "log_grid": 1,
        "sr_bits": "32,8",
        "philox_rounds": "10,7,4",
    },
}
# GDN and KDA at a head of their models (INPUTS_TEXT says how the inputs are drawn)
_DELTA_ARMS = ("every_step:fp16:rn,every_step:bf16:rn,every_step:nvfp4:rn,shared:nvfp4:rn,"
               "shared:fp16:rn,separate_exact:nvfp4,separate_fp16sr:nvfp4")
# at the layer's shape through the emulation on a GPU: the arms the claim needs (each arm and
# the exact run cost about 1 ms a step on an H100, bound by the host: 2^15 steps keep the three
# layers, run as concurrent processes, near 6 minutes; scripts/gpu.sh error-growth)
_GPU_ARMS = "separate_fp16sr:nvfp4,every_step:bf16:rn,shared:fp16:rn"
for _name, _recurrence in (("gdn", "gdn"), ("kda", "kda")):
    PRESETS[_name] = {  # Qwen3-Next's GDN head, Kimi Linear's KDA head: d_k = d_v = 128
        "recurrence": _recurrence, "dv": 128, "dk": 128, "heads": 1, "seeds": 2,
        "steps": 8192, "window": "16", "memory": ["long", "short"], "arms": _DELTA_ARMS,
        "formats": "nvfp4", "rounding": "rn", "log_grid": 10,
    }
    PRESETS[f"{_name}-tiny"] = {  # the emulation interpreted on a CPU, in seconds
        "recurrence": _recurrence, "dv": 8, "dk": 16, "heads": 1, "seeds": 1, "steps": 48,
        "window": "8", "memory": ["long", "short"],
        "arms": "separate_fp16sr:nvfp4,every_step:fp16:rn,shared:fp16:rn", "formats": "nvfp4",
        "rounding": "rn", "log_grid": 0, "backend": "emulation",
    }
    PRESETS[f"{_name}-gpu"] = {  # the whole layer: 32 heads of 128 x 128 (both models)
        "recurrence": _recurrence, "dv": 128, "dk": 128, "heads": 32, "seeds": 1,
        "steps": 32768, "window": "16", "memory": ["long", "short"], "arms": _GPU_ARMS,
        "formats": "nvfp4", "rounding": "rn", "log_grid": 20, "backend": "emulation",
        "device": "cuda",
    }
PRESETS["emulation-gpu"] = {  # the Nemotron-3-Super Mamba-2 layer: 128 heads of 64 x 128
    **PRESETS["gdn-gpu"], "recurrence": "mamba2", "dv": 64, "dk": 128, "heads": 128,
}

INPUTS_TEXT = """inputs (a fresh draw every step, per sequence and head; --memory sets the decay):
  v ~ N(0, I)   k, q ~ N(0, I) (Mamba-2's B and C)   a ~ U[LO, HI) per head (KDA: per head
  and channel of d_k) from --memory: long = [0.9995, 0.99999) (time constants 2,000 to 100,000
  tokens), short = [0.9, 0.95) (10 to 20 tokens), as the log-decays g = log a of trained
  layers span both; GDN and KDA as Qwen3-Next and Kimi Linear draw theirs: k and q
  L2-normalised per head, beta = sigmoid(N(0, 1)) (the models' beta is a sigmoid of a
  projection)"""

_HELP = {
    "recurrence": "state recurrence: mamba2 (S = a S + v k^T), gdn (delta rule), kda (delta rule, "
    "per-channel decay)",
    "dv": "rows of the state per head (d_v, Mamba-2's headdim)",
    "dk": "columns of the state per head (d_k, Mamba-2's dstate); a multiple of the block "
    "formats' block (16 for nvfp4, 32 for mxfp4)",
    "heads": "heads per sequence; rel_err is one norm over all heads and d_v",
    "seeds": "number of sequences with independent inputs: seeds seed0 .. seed0+seeds-1",
    "seed0": "first input seed; also the Philox key of the SR words (all 64 bits); the inputs "
    "depend on a seed modulo 2^32 only (torch's CPU generator): --seed0 2^32 draws the inputs "
    "of --seed0 0",
    "steps": f"decode steps (tokens), 1 .. {MAX_STEPS}",
    "window": "L: tokens per window, or a comma-separated list of them (one run, a window "
    "column); step t is a flush step when t %% L == 0",
    "memory": "one or more decay ranges, a ~ U[LO, HI): long (0.9995,0.99999), "
    "short (0.9,0.95) or LO,HI with 0 < LO <= HI < 1; e.g. --memory long 0.99,0.999",
    "arms": "comma-separated arms: every_step[:FORMAT[:ROUNDING]], shared[:FORMAT[:ROUNDING]], "
    "separate:HI_FORMAT[:ROUNDING][:READ_FORMAT] (the recurrence copy in HI_FORMAT with "
    "ROUNDING, default rn; the read copy RN), and the aliases separate_exact[:READ_FORMAT] "
    "(= separate:fp64:rn:READ_FORMAT) and separate_fp16sr[:READ_FORMAT] (= "
    "separate:fp16:sr:READ_FORMAT); a missing FORMAT or READ_FORMAT expands over --formats, a "
    "missing ROUNDING of every_step and shared over --rounding",
    "formats": "comma-separated formats for arms given without one: " + ", ".join(formats.names()),
    "rounding": "comma-separated roundings (rn, sr) of every_step and shared arms given without "
    "one; e.g. rn,sr runs both",
    "log_grid": "0 records every step; G > 0 records whole windows at ~G geometrically spaced "
    "places plus those holding steps 64, 1024, 4096 and the last",
    "device": "torch device of the simulation: cpu or cuda[:N] (the last bits of the fp64 "
    "sums, hence the CSV's bytes, depend on the device)",
    "threads": "torch CPU threads during the run (restored after); one is fastest for these "
    "small per-step operations and keeps the sums' order fixed",
    "backend": "reference (lowprec.policies in FP64) or emulation (the Triton kernels of "
    "emulation/ with fp32 containers); both run every recurrence; the emulation needs CUDA for "
    "real sizes and runs interpreted on a CPU",
    "sr_bits": "random bits per element of the SR copies, or a comma-separated list of them "
    f"({', '.join(map(str, philox.SR_BITS))}); one cell per setting of each arm with an SR "
    "copy, a CSV column sr_bits (an arm without SR runs once, at the default)",
    "philox_rounds": "rounds of the Philox generator behind the SR words (1-10), or a "
    "comma-separated list; with --sr-bits, every pair of values; a CSV column philox_rounds",
}


def build_parser() -> argparse.ArgumentParser:
    epilog = "\n\n".join([OUTPUT_RULE, SHARDING_HELP, INPUTS_TEXT, ""]) + (
        "presets (explicit flags override them):\n") + "\n".join(
        f"  {name}: " + " ".join(f"--{k.replace('_', '-')} {_show(v)}" for k, v in values.items())
        for name, values in PRESETS.items()
    )
    parser = OneLineParser(
        prog="python -m experiments.error_growth",
        description="Output error against decode length for each precision policy of the SSM "
        "state (see the module docstring). Writes a CSV, its .meta.json, a PNG, and prints a "
        "summary table.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="start from a preset; the preset alone (no setting flag) writes "
        "results/error_growth_<preset>.*, its regenerate command",
    )
    kinds = {
        "dv": int,
        "dk": int,
        "heads": int,
        "seeds": int,
        "seed0": int,
        "steps": int,
        "log_grid": int,
        "threads": int,
    }
    for name, text in _HELP.items():
        flag = "--" + name.replace("_", "-")
        kwargs = {"type": kinds.get(name, str), "default": None}
        if name == "recurrence":
            kwargs["choices"] = RECURRENCES
        if name == "backend":
            kwargs["choices"] = BACKENDS
        if name == "memory":
            kwargs["nargs"] = "+"
        parser.add_argument(flag, help=f"{text} (default: {_show(BASE_DEFAULTS[name])})", **kwargs)
    parser.add_argument(
        "--out",
        default=None,
        help="CSV path; its <stem>.meta.json and (unless --plot says otherwise) <stem>.png go "
        "beside it, whatever the current folder (default: see 'where outputs go' below)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG path, or 'none' for no plot (default: the CSV path with .png)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace output files that are not this experiment's own (another CSV header, "
        "meta.json or PNG); without it such a file is an error",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="do not simulate: read --out and redraw the plot and the summary from it (the "
        "CSV holds its run's settings: --steps, --arms and the like are refused)",
    )
    parser.add_argument(
        "--at",
        metavar="STEPS",
        default=None,
        help="comma-separated steps: the summary's columns are the windows holding these "
        "steps instead of 64, 1024, 4096 and the last (with --replot, read from the CSV; "
        "'-' where the log grid did not record the window)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_sharding_arguments(parser)
    return parser


def _parse_windows(text: str) -> list[int]:
    """--window's list: positive integers, each once."""
    windows = []
    for part in _split("window", text):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"window: expected integers >= 1, got {part!r}")
        if int(part) in windows:
            raise ValueError(f"window: {part} given twice")
        windows.append(int(part))
    return windows


def _parse_list(name: str, text) -> list[int]:
    """--sr-bits' and --philox-rounds' lists: integers, each once (range checks: Config)."""
    if isinstance(text, int):
        return [text]
    values = []
    for part in _split(name, str(text)):
        if not part.isdigit():
            raise ValueError(f"{name}: expected integers, got {part!r}")
        if int(part) in values:
            raise ValueError(f"{name}: {part} given twice")
        values.append(int(part))
    return values


def parse_steps(text: str) -> list[int]:
    """--at's steps: positive integers, each once, in the order given."""
    steps = []
    for part in _split("at", text):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"at: expected steps >= 1, got {part!r}")
        if int(part) in steps:
            raise ValueError(f"at: step {part} given twice")
        steps.append(int(part))
    return steps


def _show(value) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def _check_plot_path(path: str) -> None:
    """The plot's path must name a file of a type matplotlib writes (checked before the run,
    not after it)."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if is_folder(path):
        raise ValueError(f"plot: expected an image path or 'none', got the folder {path!r}")
    if Path(path).suffix.lower().lstrip(".") not in kinds:
        raise ValueError(
            f"plot: expected a path ending in .png (or another of {', '.join(sorted(kinds))}) "
            f"or 'none', got {path!r}"
        )


OUTPUT_RULE = """where outputs go (paths relative to the current folder):
  --preset NAME alone   results/error_growth_NAME.{csv,meta.json,png}: the preset's
                        regenerate command, the only run that replaces committed results
  --out PATH.csv        PATH.csv, PATH.meta.json and PATH.png (--plot: elsewhere or none)
  anything else         runs/error_growth_<preset or custom>_<flags given>/error_growth.*
                        (git-ignored); the output line says where
  a file there that is not this experiment's output is replaced only with --force; a run
  stopped by Ctrl-C or SIGTERM writes <stem>.partial.csv and exits with status 130"""


def default_out(args: argparse.Namespace, argv_settings: list[str]) -> str:
    """The CSV path of a run without --out: results/ for a preset alone, else a runs/ folder
    named by the preset and the setting flags given (``argv_settings``, as typed)."""
    if args.preset and not argv_settings:
        return f"results/error_growth_{args.preset.replace('-', '_')}.csv"
    folder = runs_folder("error_growth", [args.preset or "custom", *argv_settings])
    return str(folder / "error_growth.csv")


def _setting_words(argv: list[str]) -> list[str]:
    """The setting flags of ``argv`` and their values as words (``--window 8,16`` ->
    ``window-8,16``), the preset and output flags left out."""
    skip = {"--preset", "--out", "--plot", "--at"}
    flags = {"--replot", "--force", "--no-progress", "--keep-cells"}
    words, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, _, value = arg.partition("=")
        if name in flags:
            i += 1
            continue
        values = [value] if value else []
        i += 1
        while not value and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if name not in skip and name.startswith("--"):
            words.append(name[2:] + "-" + "+".join(values))
    return words


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> Config:
    """Base defaults, then the preset's values, then the flags given; raises ValueError.
    ``argv`` (the command line as typed) names the runs/ folder of a custom run."""
    given = [k for k, v in vars(args).items() if k in BASE_DEFAULTS and v is not None]
    if args.replot and given:  # the CSV holds its run: --steps 100 would draw all 4,096
        raise ValueError(f"--replot: --{given[0].replace('_', '-')} sets up a run; a replot "
                         "draws the CSV as it was run (--out, --plot, --at and --preset only)")
    values = dict(BASE_DEFAULTS)
    if args.preset:
        values.update(PRESETS[args.preset])
    values.update({k: v for k, v in vars(args).items() if k in BASE_DEFAULTS and v is not None})
    for name in ("out", "plot"):  # an unset shell variable: not the default path, silently
        if getattr(args, name) is not None and not getattr(args, name).strip():
            raise ValueError(f"--{name}: expected a path, got {getattr(args, name)!r}")
    if argv is None:  # from Python: the settings given, in a fixed order
        argv = [w for k in given for w in (f"--{k.replace('_', '-')}", _show(vars(args)[k]))]
    out = args.out or default_out(args, _setting_words(argv) if given else [])
    plot_path = args.plot or str(Path(out).with_suffix(".png"))
    if is_folder(out):
        raise ValueError(f"out: expected a CSV path, got the folder {out!r}")
    if plot_path.lower() != "none":
        _check_plot_path(plot_path)
        if Path(plot_path).resolve() in (Path(out).resolve(), meta_path(out).resolve()):
            raise ValueError(f"plot: {plot_path!r} is the CSV's own path (or its .meta.json): "
                             "give --out a .csv path or --plot another file")
    if Path(out).suffix.lower() != ".csv":
        raise ValueError(f"out: expected a path ending in .csv, got {out!r}")
    # writable outputs, checked before the run (a bad path would be a traceback after it)
    if not args.replot and (problem := file_problem(out)):
        raise ValueError(f"--out: cannot write {out}: {problem}")
    if plot_path.lower() != "none" and (problem := file_problem(plot_path)):
        raise ValueError(f"--plot: cannot write {plot_path}: {problem}")
    if not args.force:
        written = [] if args.replot else [(out, SCHEMA.header), (str(meta_path(out)), None)]
        if plot_path.lower() != "none":
            written.append((plot_path, None))
        for path, header in written:
            if problem := output_problem(path, SOURCE, header):
                raise ValueError(f"--out: {problem}")
    windows = values["window"]
    if isinstance(windows, str):
        windows = tuple(_parse_windows(windows))
    sr_bits = tuple(_parse_list("sr_bits", values["sr_bits"]))
    philox_rounds = tuple(_parse_list("philox_rounds", values["philox_rounds"]))
    return Config(
        sr_bits=sr_bits,
        philox_rounds=philox_rounds,
        recurrence=values["recurrence"],
        dv=values["dv"],
        dk=values["dk"],
        heads=values["heads"],
        seeds=values["seeds"],
        seed0=values["seed0"],
        steps=values["steps"],
        window=windows,
        memory=tuple(parse_memory(m) for m in values["memory"]),
        arms=parse_arms(values["arms"], values["formats"], values["rounding"]),
        log_grid=values["log_grid"],
        out=out,
        plot=None if plot_path.lower() == "none" else plot_path,
        progress=not args.no_progress,
        device=values["device"],
        threads=values["threads"],
        backend=values["backend"],
    )


# --------------------------------------------------------------------------------------------
# the simulation


def recorded_steps(steps: int, window: int, log_grid: int) -> np.ndarray:
    """Sorted steps (from 1) whose rel_err is recorded: all of them for ``log_grid = 0``,
    else every step of the windows at ``log_grid`` geometrically spaced window indices over
    the run and of the windows holding steps 64, 1,024, 4,096 and the last step."""
    if log_grid == 0:
        return np.arange(1, steps + 1)
    n_windows = math.ceil(steps / window)
    points = min(log_grid, n_windows)  # more points than windows would repeat them
    grid = np.unique(np.rint(np.geomspace(1, n_windows, points))).astype(int).tolist()
    marks = [t for t in SUMMARY_STEPS if t <= steps] + [steps]
    chosen = sorted(set(grid) | {math.ceil(t / window) for t in marks})
    picked = [np.arange((w - 1) * window + 1, min(w * window, steps) + 1) for w in chosen]
    return np.concatenate(picked)


class _Inputs:
    """The input stream of every (memory, seed) slot, drawn INPUT_CHUNK steps at a time.

    Per seed and chunk the draws are, in this order: v [C, H, dv], k [C, H, dk],
    q [C, H, dk], the uniform behind the decay [C, H] (KDA: [C, H, dk]), and for GDN and KDA
    beta [C, H]. The slots of one seed share these draws across memory profiles.
    """

    def __init__(self, config: Config, prefetch: bool | None = None):
        self.config = config
        self.generators = [
            torch.Generator().manual_seed(config.seed0 + s) for s in range(config.seeds)
        ]
        lows = torch.tensor([m.low for m in config.memory], dtype=torch.float64, device="cpu")
        highs = torch.tensor([m.high for m in config.memory], dtype=torch.float64, device="cpu")
        self.low, self.span = lows, highs - lows
        self.chunk: list[torch.Tensor] = []
        self.position = INPUT_CHUNK
        # On a GPU the CPU draws (2.5 ms a step at the real layer shape on a 2-core machine)
        # would stall the loop: one worker thread draws the next chunk while the GPU steps.
        # The draws and their order are the same, so the inputs are the same.
        prefetch = config.device != "cpu" if prefetch is None else prefetch
        self.pool = ThreadPoolExecutor(max_workers=1) if prefetch else None
        self.pending = self.pool.submit(self._draw) if self.pool else None

    def _draw(self) -> list:
        c = self.config
        per_seed = [_draw_seed(gen, c) for gen in self.generators]
        n_mem = len(c.memory)

        def slots(i):  # [C, seeds, ...] -> [C, memories * seeds, ...], memory-major slots
            t = torch.stack([p[i] for p in per_seed], dim=1)
            return t.repeat(1, n_mem, *([1] * (t.dim() - 2))).contiguous()

        v, k, q, u = (slots(i) for i in range(4))
        per_slot = (1, n_mem * c.seeds) + (1,) * (u.dim() - 2)  # broadcast over [C, B, ...]
        low = self.low.repeat_interleave(c.seeds).view(per_slot)
        span = self.span.repeat_interleave(c.seeds).view(per_slot)
        a = low + span * u
        beta = slots(4) if c.recurrence != "mamba2" else None
        return [None if x is None else x.to(c.device) for x in (v, k, q, a, beta)]

    def next(self):
        """``(a, v, k, q, beta)`` of the next step, batch = memories * seeds."""
        if self.position == INPUT_CHUNK:
            if self.pool is None:
                self.chunk = self._draw()
            else:
                self.chunk = self.pending.result()
                self.pending = self.pool.submit(self._draw)
            self.position = 0
        p = self.position
        self.position += 1
        v, k, q, a, beta = self.chunk
        return a[p], v[p], k[p], q[p], None if beta is None else beta[p]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _draw_seed(gen: torch.Generator, c: Config) -> tuple:
    """One seed's next INPUT_CHUNK steps, ``(v, k, q, u, beta)``, in _Inputs' draw order."""

    def draw(*shape, uniform=False):
        sample = torch.rand if uniform else torch.randn
        return sample(*shape, generator=gen, dtype=torch.float64, device="cpu")

    v = draw(INPUT_CHUNK, c.heads, c.dv)
    k = draw(INPUT_CHUNK, c.heads, c.dk)
    q = draw(INPUT_CHUNK, c.heads, c.dk)
    u = draw(INPUT_CHUNK, c.heads, *((c.dk,) if c.recurrence == "kda" else ()), uniform=True)
    if c.recurrence == "mamba2":
        return v, k, q, u, None
    beta = torch.sigmoid(draw(INPUT_CHUNK, c.heads))
    k = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True)
    q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    return v, k, q, u, beta


def make_inputs(config: Config, steps: int) -> list[tuple]:
    """The first ``steps`` inputs ``(a, v, k, q, beta)`` of ``run(config)``, for tests."""
    stream = _Inputs(config)
    return [stream.next() for _ in range(steps)]


def sr_settings(config: Config) -> list[tuple[int, int]]:
    """The (sr_bits, philox_rounds) settings of the run: every bits value with every rounds
    value, bits outer."""
    return [(b, r) for b in config.sr_bits for r in config.philox_rounds]


def cells(config: Config) -> list[Cell]:
    """The run's independent cells, windows outer, then arms in the config's order, then the
    SR settings (``sr_settings``) of an arm with an SR copy (an arm without one: one cell, at
    the defaults): the order of the CSV's rows."""
    default = [(philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)]
    grid = [(w, arm, bits, rounds) for w in config.window for arm in config.arms
            for bits, rounds in (sr_settings(config) if arm.sr else default)]
    return [Cell(i, *item) for i, item in enumerate(grid)]


_EXACT_CACHE: dict = {}


def exact_outputs(config: Config, window: int, bar=None) -> tuple[np.ndarray, torch.Tensor]:
    """``(steps_kept, y)``: the recorded steps of ``window`` and the exact FP64 outputs there,
    ``y [len(steps_kept), memories * seeds, heads, dv]`` on the run's device. Computed once
    per (config, window) and process."""
    c = config
    key = (c.recurrence, c.dv, c.dk, c.heads, c.seeds, c.seed0, c.steps, c.memory, c.log_grid,
           c.device, window)
    if key in _EXACT_CACHE:
        return _EXACT_CACHE[key]
    batch = len(c.memory) * c.seeds
    steps_kept = recorded_steps(c.steps, window, c.log_grid)
    keep = np.zeros(c.steps + 1, dtype=bool)
    keep[steps_kept] = True
    ys = []
    with _on_device(c), _cpu_threads(c.threads), torch.no_grad():
        exact = Simulator(c.recurrence, make_policy("exact", "fp64", window=window), batch,
                          c.heads, c.dv, c.dk, dtype=torch.float64)
        inputs = _Inputs(c)
        try:
            for t in range(1, c.steps + 1):
                y = exact.step(*inputs.next())
                if keep[t]:
                    ys.append(y)
                if bar is not None:
                    bar.update()
        finally:
            inputs.close()
    result = (steps_kept, torch.stack(ys))
    _EXACT_CACHE.clear()  # one entry: a sweep over windows needs one at a time
    _EXACT_CACHE[key] = result
    return result


def run_cell(config: Config, cell: Cell, bar=None,
             on_stop: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """The rows of one cell (``CSV_COLUMNS``; memory, seed, step order), from the cell's own
    input stream and the exact outputs: the same rows wherever and with whatever other cells
    it runs. A cell returns only complete rows: Ctrl-C or SIGTERM (a KeyboardInterrupt) in
    its step loop is raised again, after ``on_stop`` was given the whole windows done (a
    frame whose ``attrs['steps_done']`` says how far it got)."""
    c = config
    batch = len(c.memory) * c.seeds
    steps_kept, y_exact = exact_outputs(c, cell.window, bar=bar)
    keep = np.zeros(c.steps + 1, dtype=bool)
    keep[steps_kept] = True
    errors = torch.full((batch, len(steps_kept)), float("nan"), dtype=torch.float64)
    column, done = 0, 0
    with _on_device(c), _cpu_threads(c.threads), torch.no_grad():
        if c.backend == "emulation":
            step = _emulation_step(c, cell, batch)
        else:
            policy = cell.arm.policy(cell.window, c.seed0, cell.sr_bits, cell.philox_rounds)
            step = Simulator(c.recurrence, policy, batch, c.heads, c.dv, c.dk,
                             dtype=torch.float64).step
        inputs = _Inputs(c)
        try:
            for t in range(1, min(c.steps, int(steps_kept[-1])) + 1):
                y_hat = step(*inputs.next())
                if keep[t]:
                    errors[:, column] = rel_err(y_hat, y_exact[column]).cpu()
                    column += 1
                done = t
                if bar is not None:
                    bar.update()
        except KeyboardInterrupt:
            if on_stop is not None:  # the whole windows done
                whole = steps_kept <= done - done % cell.window
                frame = _to_frame(c, cell, steps_kept[whole], errors[:, : int(whole.sum())])
                frame.attrs["steps_done"] = done
                on_stop(frame)
            raise
        finally:
            inputs.close()
    return _to_frame(c, cell, steps_kept, errors)


def merge_cells(config: Config, frames: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """The run's rows from the frames of its cells (``{cell.index: run_cell(...)}``, computed
    anywhere): concatenated in cell order, so the CSV is the same bytes as one process's."""
    order = [cell.index for cell in cells(config) if cell.index in frames]
    if not order:
        return pd.DataFrame(columns=list(CSV_COLUMNS))
    return pd.concat([frames[i] for i in order], ignore_index=True)


def sweep_arguments(config: Config) -> dict:
    """What determines the rows, for the cell store's fingerprint: the config without its
    output paths and without the device's number (``cuda:LOCAL_RANK`` differs per rank)."""
    settings = config_settings(config)
    settings["device"] = torch.device(config.device).type
    return settings


def run(config: Config, command: str | None = None, *, keep_cells: bool = False
        ) -> pd.DataFrame:
    """Run every cell of ``config`` through `experiments.sharding.run_sweep` (in this process,
    or split over the ranks under ``torchrun``), write the CSV to ``config.out`` and then its
    meta.json (``command`` the command line; from Python, a note saying so), and return the
    rows on the writing rank (None elsewhere). A rerun with the same ``out`` and config skips
    the cells finished before (kept in ``<out>.cells/`` until the CSV is written, or for good
    with ``keep_cells``). A plain process stopped by Ctrl-C or SIGTERM writes the finished
    cells and the whole windows of the cell in flight to ``partial_path(config.out)``.
    ``attrs`` of the frame: ``complete``, ``cells_done``, ``written``, ``status``."""
    from experiments.sharding import (
        SweepStopped,
        _CellStore,
        cell_store_path,
        fingerprint,
        ranks_from_env,
        run_sweep,
    )

    c = config
    start = time.perf_counter()
    grid = cells(c)
    ranks = ranks_from_env()
    batch = len(c.memory) * c.seeds
    command = command or f"{PROG} (run() called from Python)"
    bar = tqdm(
        total=c.steps * (len(grid) + len(c.window)),
        desc=f"error_growth {c.recurrence} {c.backend} ({len(grid)} cells x {batch} seqs)",
        unit="step",
        file=sys.stderr,
        disable=not c.progress or ranks.launched,  # under torchrun: the engine's lines
        mininterval=0.5,
    )
    in_flight: dict[int, pd.DataFrame] = {}
    arguments = sweep_arguments(c)

    def one_cell(cell: Cell) -> pd.DataFrame:
        return run_cell(c, cell, bar=bar,
                        on_stop=lambda frame: in_flight.__setitem__(cell.index, frame))

    def meta(out: Path, seconds: float, record: dict) -> None:
        write_meta(out, command, seconds, config_settings(c), device=c.device,
                   extra={"experiment": SOURCE, "status": "complete", "sharding": record})

    try:
        with bar:
            sweep = run_sweep(grid, one_cell, out=c.out, arguments=arguments,
                              key=lambda cell: cell.key, write_csv=write_csv, write_meta=meta,
                              keep_cells=keep_cells, progress=10.0 if c.progress else None)
    except SweepStopped as stopped:
        if ranks.launched or stopped.code != STOPPED_STATUS:
            raise
        finished = _CellStore(cell_store_path(c.out), lambda line: None).load_done(
            [cell.key for cell in grid], fingerprint(arguments))
        frames = {i: rows for i, (rows, _) in finished.items()}
        for index, frame in in_flight.items():
            if len(frame):
                frames[index] = frame
        frame = merge_cells(c, frames)
        written = partial_path(c.out)
        write_csv(frame, written)
        status = (f"stopped after {len(finished)} of {len(grid)} cells (kept in "
                  f"{cell_store_path(c.out)}: the same command resumes)")
        if in_flight:
            status += f" and step {max(f.attrs['steps_done'] for f in in_flight.values())} of " \
                      "the next"
        write_meta(written, command, time.perf_counter() - start, config_settings(c),
                   device=c.device, extra={"experiment": SOURCE, "status": status})
        frame.attrs.update(complete=False, cells_done=len(finished), written=str(written),
                           status=status)
        return frame
    if not sweep.is_writer:
        return None
    frame = sweep.frame
    frame.attrs.update(complete=True, cells_done=len(grid), written=str(c.out),
                       status="complete", sharding=sweep.record)
    return frame


def partial_path(out: str | Path) -> Path:
    """Where a stopped run's rows go: ``x.csv`` -> ``x.partial.csv``."""
    out = Path(out)
    return out.with_name(out.stem + ".partial.csv")


@contextmanager
def _on_device(c: Config):
    """lowprec's factory calls (zeros, arange) follow the default device; the device context
    intercepts every torch call (half of a GPU run's host time), so it is entered only for a
    GPU."""
    with torch.device(c.device) if c.device != "cpu" else nullcontext():
        yield


def mamba2_kernel_inputs(a, v, k, q, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    """``(x, dt, A, B, C)`` of the Mamba-2 kernels for the generic step S_t = a S_{t-1} + v k^T,
    y = S q (``a [b, h]``, ``v [b, h, dv]``, ``k, q [b, h, dk]``), in ``dtype``:

        dt = -log(a)   the processed dt: call with dt_softplus=False and no dt_bias
        A  = -1        per head, so that exp(dt A) = a
        x  = v / dt    with the rounded dt, so that dt x = v up to one rounding of x
        B  = k, C = q  ngroups = nheads: each head its own B and C

    In fp32, exp(dt A) and dt x are a and v to a few units of 2^-24 (relative).
    """
    check_float("a", a)
    check_ndim("a", a, 2, "[b, h]")
    b, h = a.shape
    for name, t in (("v", v), ("k", k), ("q", q)):
        check_float(name, t)
        check_ndim(name, t, 3, f"[{b}, {h}, d]")
        check_shape(name, t, (b, h, t.shape[-1]))
    check_shape("q", q, k.shape)
    dt = (-torch.log(a)).to(dtype)
    x = (v / dt.to(v.dtype)[..., None]).to(dtype)
    A = torch.full((a.shape[-1],), -1.0, dtype=dtype, device=a.device)
    return x, dt, A, k.to(dtype), q.to(dtype)


def _emulation_step(c: Config, cell: Cell, batch: int):
    """A function ``(a, v, k, q, beta) -> y_hat`` (the generic inputs) that advances one
    cell's emulation cache by one token: every_step on a ``StateCache`` (the output reads the
    stored state), the windowed arms on a ``ReplayCache`` (Mamba-2) or ``GDNReplayCache``
    (GDN, KDA: per-channel decay) with the arm's recurrence copy (fp64 kept in fp32) and read
    copy (RN). Slot b of the cache is slot b of the reference's batch and the seed is
    ``seed0``, so SR uses the same Philox words; the cell's SR setting is passed to the cache
    only where it differs from 32 bits, 10 rounds."""
    # Imported here: the reference backend needs neither Triton nor the emulation (and
    # emulation.numerics switches Triton's interpreter on without CUDA).
    from emulation.gdn_replay_decode import GDNReplayCache, gdn_generic_step, kda_generic_step
    from emulation.replay_decode import ReplayCache, mamba2_replay_decode
    from emulation.state_update import StateCache, mamba2_state_update

    spec, window = cell.arm, cell.window
    shape = (batch, c.heads, c.dv, c.dk)
    sr = {}
    if spec.sr and (cell.sr_bits, cell.philox_rounds) != (philox.DEFAULT_SR_BITS,
                                                          philox.DEFAULT_PHILOX_ROUNDS):
        sr = {"sr_bits": cell.sr_bits, "philox_rounds": cell.philox_rounds}
    # Every slot advances in lockstep and _check_emulation bounds the steps, so the counters
    # stay in range: on a GPU the per-call range check (a stream sync that stops the host from
    # running ahead) is skipped; on the CPU it costs nothing and stays.
    check = c.device == "cpu"
    hi_format = "fp32" if spec.hi_format == "fp64" else spec.hi_format
    if spec.scheme == "every_step":
        cache = StateCache.empty(*shape, format=spec.lo_format, rounding=spec.lo_rounding,
                                 seed=c.seed0, device=c.device, **sr)
    elif c.recurrence == "mamba2":
        cache = ReplayCache.empty(*shape, ngroups=c.heads, window=window, hi_format=hi_format,
                                  hi_rounding=spec.hi_rounding, lo_format=spec.lo_format,
                                  seed=c.seed0, act_dtype=torch.float32, device=c.device, **sr)
    else:
        cache = GDNReplayCache.empty(*shape, per_channel=c.recurrence == "kda", window=window,
                                     hi_format=hi_format, hi_rounding=spec.hi_rounding,
                                     lo_format=spec.lo_format, seed=c.seed0,
                                     act_dtype=torch.float32, device=c.device, **sr)
    if c.recurrence != "mamba2":
        generic = kda_generic_step if c.recurrence == "kda" else gdn_generic_step

        def step(a, v, k, q, beta):
            return generic(cache, a, v, k, q, beta, check_counters=check)

        return step
    if spec.scheme == "every_step":

        def step(a, v, k, q, beta):
            return mamba2_state_update(cache, *mamba2_kernel_inputs(a, v, k, q),
                                       dt_softplus=False, output_from="stored",
                                       check_counters=check)

        return step

    def step(a, v, k, q, beta):
        return mamba2_replay_decode(cache, *mamba2_kernel_inputs(a, v, k, q), dt_softplus=False,
                                    check_counters=check)

    return step


@contextmanager
def _cpu_threads(n: int):
    """Run with ``n`` torch CPU threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _to_frame(c: Config, cell: Cell, steps_kept: np.ndarray, errors: torch.Tensor
              ) -> pd.DataFrame:
    """A cell's rows ordered by memory, seed, step (``errors [memory * seed, step]``)."""
    n_mem, n_steps = len(c.memory), len(steps_kept)
    mem_idx = np.repeat(np.arange(n_mem), c.seeds * n_steps)
    # seeds reach 2^64 - 1 (Philox keys): past int64, uint64
    kind = np.int64 if c.seed0 + c.seeds <= 2**63 else np.uint64
    seed = np.tile(np.repeat(np.arange(c.seeds, dtype=kind), n_steps), n_mem)
    seed += kind(c.seed0)
    arm = cell.arm
    frame = pd.DataFrame(
        {
            "recurrence": c.recurrence,
            "arm": arm.label,
            "hi_format": arm.hi_format,
            "hi_rounding": arm.hi_rounding,
            "lo_format": arm.lo_format,
            "lo_rounding": arm.lo_rounding,
            "sr_bits": cell.sr_bits,
            "philox_rounds": cell.philox_rounds,
            "memory": np.array([m.name for m in c.memory], dtype=object)[mem_idx],
            "window": cell.window,
            "seed": seed,
            "step": np.tile(steps_kept, n_mem * c.seeds),
            "rel_err": errors.reshape(-1).numpy(),
        }
    )
    return frame[list(CSV_COLUMNS)]


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


# --------------------------------------------------------------------------------------------
# summary and plot, from the CSV's rows only

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
        parts.append(format_sr_table(sr_table(frame)))
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


def sr_table(frame: pd.DataFrame, draws: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Each SR setting against 32 bits, 10 rounds, per (arm, memory, window): ``ratio`` =
    mean over seeds of the per-seed mean rel_err over the last octave of recorded steps
    (steps > last / 2) divided by the same for 32/10, with a 95% bootstrap interval
    (``low``, ``high``: seeds resampled with replacement, each setting on its own,
    ``draws`` times). ``departs`` is True where the interval excludes 1."""
    gen = np.random.default_rng(seed)
    keys = ["recurrence", "arm", "memory", "window"]
    last = frame["step"].max()
    tail = frame[frame["step"] > last / 2]
    per_seed = tail.groupby([*keys, "sr_bits", "philox_rounds", "seed"], sort=False)[
        "rel_err"].mean()
    rows = []
    for key, group in per_seed.groupby(level=keys, sort=False):
        group = group.droplevel(keys)
        try:
            base = group.loc[(philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)].to_numpy()
        except KeyError:
            continue
        for (bits, rounds), values in group.groupby(level=["sr_bits", "philox_rounds"],
                                                    sort=False):
            values = values.to_numpy()
            ratio = values.mean() / base.mean()
            boot = (gen.choice(values, (draws, len(values))).mean(1)
                    / gen.choice(base, (draws, len(base))).mean(1))
            low, high = np.quantile(boot, [0.025, 0.975])
            rows.append({**dict(zip(keys, key, strict=True)), "sr_bits": bits,
                         "philox_rounds": rounds, "seeds": len(values), "ratio": ratio,
                         "low": low, "high": high, "departs": not low <= 1.0 <= high})
    return pd.DataFrame(rows)


def format_sr_table(table: pd.DataFrame) -> str:
    head = ("SR settings against 32 bits, 10 rounds: mean rel_err over the last octave of "
            "recorded steps, ratio to 32/10 with a 95% bootstrap interval over seeds")
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



def plot(csv_path: str | Path, png_path: str | Path) -> None:
    """The figure of ``csv_path`` at ``png_path`` (`experiments.error_growth_plot.plot`),
    from the CSV alone."""
    from experiments.error_growth_plot import plot as draw

    draw(csv_path, png_path)



# --------------------------------------------------------------------------------------------
# entry point


def config_settings(config: Config) -> dict:
    """The config as its meta.json records it (``read_csv`` reads steps, window and log_grid
    back): arms by their canonical labels, memory profiles with their bounds."""
    c = config
    return {
        "recurrence": c.recurrence, "dv": c.dv, "dk": c.dk, "heads": c.heads,
        "seeds": c.seeds, "seed0": c.seed0, "steps": c.steps, "window": list(c.window),
        "memory": [{"name": m.name, "low": m.low, "high": m.high} for m in c.memory],
        "arms": [a.label for a in c.arms], "log_grid": c.log_grid, "device": c.device,
        "threads": c.threads, "backend": c.backend, "sr_bits": list(c.sr_bits),
        "philox_rounds": list(c.philox_rounds), "cells": len(cells(c)),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, argv)
        at = None if args.at is None else parse_steps(args.at)
    except ValueError as error:
        parser.error(str(error))
    if at is not None and not args.replot and max(at) > config.steps:
        parser.error(f"--at: step {max(at)} is past --steps {config.steps}")
    if args.replot:
        try:
            frame = read_csv(config.out)
        except (OSError, ValueError) as error:
            parser.error(f"--replot: {error}")
    else:
        from experiments.sharding import SweepStopped, is_main_rank, local_device

        # under torchrun each rank on its own GPU (the CSV records the device's kind only)
        config = dataclasses.replace(config, device=local_device(config.device))
        for window in config.window if is_main_rank() else ():
            if window > config.steps:
                print(f"note: --window {window} is longer than --steps {config.steps}: no "
                      "flush happens (the windowed arms never round a checkpoint) and the plot "
                      "and summary average over one partial window", file=sys.stderr)
            elif config.steps % window:
                whole = config.steps - config.steps % window
                print(f"note: --steps {config.steps} is not a multiple of --window {window}: "
                      f"the CSV keeps steps {whole + 1}-{config.steps}, but the plot and "
                      f"summary end at step {whole}, the last whole window", file=sys.stderr)
        start = time.perf_counter()
        try:
            frame = run(config, " ".join([PROG, *map(shlex.quote, argv)]),
                        keep_cells=args.keep_cells)
        except OSError as error:  # the CSV is written at the end of the run
            parser.error(f"cannot write {config.out}: {error}")
        except SweepStopped as stopped:  # a cell failed, or a rank under torchrun stopped
            return stopped.code
        if frame is None:  # a rank other than 0: rank 0 writes, plots and summarises
            return 0
        seconds = time.perf_counter() - start
        stopped = not frame.attrs["complete"]
        written, status = frame.attrs["written"], frame.attrs["status"]
        if stopped:
            print(f"{PROG}: {status}: wrote the whole windows done to {written} "
                  f"({len(frame)} rows); {config.out} is unchanged", file=sys.stderr)
            return STOPPED_STATUS
        for stale in (partial_path(config.out), meta_path(partial_path(config.out))):
            if stale.is_file() and not output_problem(stale, SOURCE, SCHEMA.header):
                stale.unlink()  # a finished run supersedes its stopped attempt
        print(f"wrote {config.out} and its .meta.json ({len(frame)} rows) in {seconds:.1f} s",
              file=sys.stderr)
    last = int(window_means(frame)["last_step"].max())
    if at is not None and (past := [t for t in at if t > last]):  # before the plot is drawn
        parser.error(f"--at: step {past[0]} is past the last whole window of {config.out} "
                     f"(step {last})")
    if config.plot:
        try:
            plot(config.out, config.plot)
        except OSError as error:
            parser.error(f"cannot write {config.plot}: {error}")
        print(f"wrote {config.plot}", file=sys.stderr)
    print(summaries(frame, at))
    return 0


if __name__ == "__main__":
    sys.exit(main())
