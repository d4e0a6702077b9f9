"""Error growth against decode length: how each precision policy's output error evolves.

The kit's main figure. A batch of sequences is decoded token by token twice from the same
inputs: once exactly (FP64, nothing rounded) and once under each precision policy of
`lowprec.policies` (one `Simulator` per arm, all advanced in the same step loop). At every
recorded step the error of the layer output of one sequence is

    rel_err_t = ||y_hat_t - y_t||_2 / ||y_t||_2        norms over heads and d_v

Arms (the CSV's ``arm``; ``format`` is the format being ablated):

    every_step       conventional: the state is stored in ``format`` every token
    shared           one checkpoint in ``format``, rounded once per window of L tokens,
                     read by the window's steps and by the next flush
    separate_exact   recurrence copy exact FP64, read copy in ``format`` (RN)
    separate_fp16sr  recurrence copy FP16 with SR, read copy in ``format`` (RN): the kit's
                     two-precision scheme (format nvfp4 by default)

``rounding`` is the rounding of ``format``: ``--rounding`` for every_step and shared, and
always ``rn`` for the separate arms (their read copy is RN by design; the FP16 recurrence copy
of separate_fp16sr is SR by definition of the arm). Windows are L tokens long; step ``t``
(counting from 1) is a flush step when ``t % L == 0``, and a flush step's output reads the
unrounded new state. So before the first flush the windowed arms are exact, and at every
flush step separate_exact is exact again: its error lives on the L - 1 other steps.

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

    reference   ``lowprec.policies.Simulator`` in FP64, every recurrence (the default)
    emulation   the Triton kernels of ``emulation/`` (fp32 containers holding values of the
                format; Mamba-2 only), on a GPU compiled, on a CPU under TRITON_INTERPRET=1
                (about 0.15 s per arm and step at the test size: tiny runs only)

The emulation runs the generic step through the Mamba-2 kernel arguments exactly
(``mamba2_kernel_inputs``): per head ``A = -1`` and the processed ``dt = -log(a)``
(``dt_softplus=False``, no ``dt_bias``), so ``exp(dt A) = a``; ``x = v / dt``, so ``dt x = v``;
``B = k`` and ``C = q`` with ``ngroups = nheads``; ``D`` and ``z`` absent; all fp32. Its slots
are the simulator's batch in the same order and the Philox seed is ``--seed0``, so SR draws
the same words as the reference. Arms: every_step is ``emulation.state_update`` with the
format and rounding, the output reading the stored state (as the reference defines the arm);
the other arms are ``emulation.replay_decode`` with window L: separate_fp16sr keeps hi FP16 SR
and lo the format RN; separate_exact keeps an fp32 recurrence copy (the kernels' exact
arm; the CSV name stays ``separate_exact``), so its flush steps carry an fp32 error (about
1e-7) instead of 0; shared keeps hi = lo = the format, which is the shared policy only for
element formats with RN (the kernels' read copy is always RN and the recurrence copy holds no
block scales). fp64 is not a kernel format. Otherwise the two backends differ by fp32
arithmetic only, which now and then flips an FP16 rounding (tests/test_error_growth.py
compares the two CSVs).

Outputs: a tidy CSV, one row per (arm, format, rounding, memory, window, seed, step), columns
exactly ``CSV_COLUMNS``, floats written ``%.6e`` so a rerun reproduces the file byte for byte;
a sidecar ``<csv stem>.meta.json`` (command, commit, seconds, versions, config); a PNG read
back from the CSV only (``plot``); a summary table printed to stdout (``summarize``).

    python -m experiments.error_growth --preset toy                    # ~10 s, 2-core CPU
    python -m experiments.error_growth --preset default               # ~5 min on a 2-core CPU
    python -m experiments.error_growth --preset default --replot       # redraw from the CSV
    python -m experiments.error_growth --preset default --replot --plot none --at 112,192
                                                  # the summary at the windows of other steps
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

import argparse
import math
import os
import shlex
import signal
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from experiments._common import OneLineParser, file_problem, is_folder, meta_path, write_meta
from lowprec import formats, philox
from lowprec._checks import check_float, check_ndim, check_shape
from lowprec.metrics import rel_err
from lowprec.policies import Simulator, make_policy

__all__ = [
    "ARMS",
    "BACKENDS",
    "CSV_COLUMNS",
    "MEMORY_PROFILES",
    "PRESETS",
    "ArmSpec",
    "Config",
    "Memory",
    "config_from_args",
    "main",
    "make_inputs",
    "mamba2_kernel_inputs",
    "parse_arms",
    "parse_memory",
    "plot",
    "recorded_steps",
    "run",
    "summarize",
    "window_means",
]

ARMS = ("every_step", "shared", "separate_exact", "separate_fp16sr")
SEPARATE_ARMS = ("separate_exact", "separate_fp16sr")
RECURRENCES = ("mamba2", "gdn", "kda")
BACKENDS = ("reference", "emulation")
ROUNDINGS = ("rn", "sr")
MEMORY_PROFILES = {"long": (0.9995, 0.99999), "short": (0.9, 0.95)}
CSV_COLUMNS = (
    "recurrence",
    "arm",
    "format",
    "rounding",
    "memory",
    "window",
    "seed",
    "step",
    "rel_err",
)
SUMMARY_STEPS = (64, 1024, 4096)
FLOAT_FORMAT = "%.6e"
# Inputs are drawn this many steps at a time; the chunk is part of the definition of a seed's
# input stream (changing it changes the numbers), so it is a constant, not an option.
INPUT_CHUNK = 256
# every_step uses the token counter as Philox's write counter, which has 20 bits.
MAX_STEPS = philox.FLUSH_LIMIT
STOPPED_STATUS = 130  # exit status of a run stopped by SIGINT or SIGTERM (its windows kept)
# The emulation's state update refuses a counter of 2^20 - 1 before its call, so one step less.
MAX_EMULATION_STEPS = philox.FLUSH_LIMIT - 1
# The emulation's recurrence copy (format, rounding) per windowed arm; shared: the arm's own.
EMULATION_HI_COPY = {"separate_exact": ("fp32", "rn"), "separate_fp16sr": ("fp16", "sr")}
EMULATION_ARMS_TEXT = (
    "the emulation backend runs every_step with any format but fp64 (rn or sr), "
    "separate_exact (its recurrence copy fp32) and separate_fp16sr with any read-copy format "
    "but fp64, and shared only with rn and an element format but fp64 (fp32, fp16, bf16, "
    "fp8_e4m3, fp8_e5m2)"
)


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class ArmSpec:
    """One simulated policy: arm, the format it ablates, and that format's rounding."""

    arm: str
    fmt: str
    rounding: str

    @property
    def label(self) -> str:
        if self.arm in SEPARATE_ARMS:
            return f"{self.arm}:{self.fmt}"
        return f"{self.arm}:{self.fmt}:{self.rounding}"


@dataclass(frozen=True)
class Memory:
    """A decay range ``[low, high)`` and its name in the CSV."""

    name: str
    low: float
    high: float


@dataclass(frozen=True)
class Config:
    """Everything a run depends on (``out``, ``plot`` and ``progress`` do not change numbers)."""

    recurrence: str = "mamba2"
    dv: int = 8
    dk: int = 32
    heads: int = 1
    seeds: int = 4
    seed0: int = 0
    steps: int = 4096
    window: int = 16
    memory: tuple[Memory, ...] = tuple(Memory(n, *r) for n, r in MEMORY_PROFILES.items())
    arms: tuple[ArmSpec, ...] = field(
        default_factory=lambda: parse_arms(",".join(ARMS), "fp8_e4m3_row", "sr")
    )
    log_grid: int = 0
    out: str = "results/error_growth_custom.csv"
    plot: str | None = "results/error_growth_custom.png"
    progress: bool = True
    device: str = "cpu"
    threads: int = 1
    backend: str = "reference"

    def __post_init__(self):
        if self.recurrence not in RECURRENCES:
            raise ValueError(
                f"recurrence: expected one of {list(RECURRENCES)}, got {self.recurrence!r}"
            )
        for name in ("dv", "dk", "heads", "seeds", "steps", "window"):
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
        # by bounds: 'short' and '0.9,0.95' are one range under two names (it ran twice)
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
    state a simulated arm (the exact one included: its state, a recurrence and a read copy,
    a temporary), and the fp64 errors of every arm, sequence and recorded step (host)."""
    batch = len(c.memory) * c.seeds
    states = (len(c.arms) + 1) * batch * c.heads * c.dv * c.dk * 8 * 4
    n_windows = math.ceil(c.steps / c.window)
    recorded = c.steps if c.log_grid == 0 else min(
        c.steps, (min(c.log_grid, n_windows) + len(SUMMARY_STEPS) + 1) * c.window)
    errors = len(c.arms) * batch * recorded * 8
    return (states, errors) if c.device != "cpu" else (0, states + errors)


def _check_memory_use(c: Config) -> None:
    """Refuse a run that cannot fit (it used to fail in an allocation, or thrash, after the
    progress bar had started): host memory here, and the GPU's for a cuda device."""
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
    if c.recurrence != "mamba2":
        raise ValueError(
            f"backend: the emulation backend implements Mamba-2 only, got recurrence "
            f"{c.recurrence!r} (use --backend reference)"
        )
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
        fmt = formats.get(spec.fmt)
        supported = fmt.element.bits <= 32
        if spec.arm == "shared":
            supported = supported and fmt.block is None and spec.rounding == "rn"
        if not supported:
            raise ValueError(f"arms: {EMULATION_ARMS_TEXT}; got {spec.label}")


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
    if spec.arm not in ARMS:
        raise ValueError(f"arms: expected arms among {list(ARMS)}, got {spec.arm!r}")
    if spec.fmt not in formats.names():
        raise ValueError(f"formats: expected formats among {formats.names()}, got {spec.fmt!r}")
    if spec.rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got {spec.rounding!r}")
    if spec.arm in SEPARATE_ARMS and spec.rounding != "rn":
        raise ValueError(
            f"rounding: the read copy of {spec.arm} is always RN, got {spec.rounding!r} "
            f"in {spec.label}"
        )
    fmt = formats.get(spec.fmt)
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


def parse_arms(arms: str, fmts: str, rounding: str) -> tuple[ArmSpec, ...]:
    """Arm specs from ``--arms``, ``--formats`` and ``--rounding`` (all comma-separated).

    An item of ``arms`` is ``ARM[:FORMAT[:ROUNDING]]``; a missing FORMAT expands over ``fmts``
    and a missing ROUNDING over ``rounding`` (every_step, shared) or to ``rn`` (separate arms,
    whose read copy is RN). ``every_step,shared`` with ``fmts='fp16,nvfp4'`` gives four arms.
    Duplicates are dropped, the first occurrence keeping its place.
    """
    default_fmts = _split("formats", fmts)
    default_roundings = _split("rounding", rounding)
    # checked when no arm uses them too (--formats fp7 beside --arms shared:fp16 passed)
    for fmt in default_fmts:
        if fmt not in formats.names():
            raise ValueError(f"formats: expected formats among {formats.names()}, got {fmt!r}")
    for r in default_roundings:
        if r not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {list(ROUNDINGS)}, got {r!r}")
    specs: list[ArmSpec] = []
    for item in _split("arms", arms):
        parts = item.split(":")
        if len(parts) > 3 or not all(parts):
            raise ValueError(f"arms: expected items ARM[:FORMAT[:ROUNDING]], got {item!r}")
        arm = parts[0]
        if arm not in ARMS:
            raise ValueError(f"arms: expected arms among {list(ARMS)}, got {arm!r}")
        item_fmts = [parts[1]] if len(parts) > 1 else default_fmts
        if len(parts) > 2:
            item_roundings = [parts[2]]
        elif arm in SEPARATE_ARMS:
            item_roundings = ["rn"]
        else:
            item_roundings = default_roundings
        for fmt in item_fmts:
            for r in item_roundings:
                spec = ArmSpec(arm, fmt, r)
                if spec not in specs:
                    specs.append(spec)
    return tuple(specs)


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
    "window": 16,
    "memory": ["long", "short"],
    "arms": ",".join(ARMS),
    "formats": "fp8_e4m3_row",
    "rounding": "sr",
    "log_grid": 0,
    "device": "cpu",
    "threads": 1,
    "backend": "reference",
}

PRESETS = {
    "toy": {
        "recurrence": "mamba2",
        "dv": 8,
        "dk": 32,
        "heads": 1,
        "seeds": 8,
        "steps": 4096,
        "window": 16,
        "memory": ["long", "short"],
        "arms": "every_step:fp8_e4m3_row:rn,every_step:fp8_e4m3_row:sr,shared,separate_exact",
        "formats": "fp8_e4m3_row",
        "rounding": "sr",
        "log_grid": 16,  # 16 windows: the CSV stays under 1 MiB (22 gave 21 windows, 1.3 MB)
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
        "window": 16,
        "memory": ["long", "short"],
        "arms": "every_step:fp16:rn,every_step:fp8_e4m3:rn,every_step:nvfp4:rn,"
        "every_step:mxfp4:rn,shared,separate_exact,separate_fp16sr",
        "formats": "fp16,fp8_e4m3,nvfp4,mxfp4",
        "rounding": "sr",
        "log_grid": 12,
    },
}

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
    "window": "L: tokens per window; step t is a flush step when t %% L == 0",
    "memory": "one or more decay ranges, a ~ U[LO, HI): long (0.9995,0.99999), "
    "short (0.9,0.95) or LO,HI with 0 < LO <= HI < 1; e.g. --memory long 0.99,0.999",
    "arms": "comma-separated ARM[:FORMAT[:ROUNDING]], ARM in every_step, shared, "
    "separate_exact, separate_fp16sr; a missing FORMAT expands over --formats, a missing "
    "ROUNDING over --rounding (separate arms: always rn)",
    "formats": "comma-separated formats for arms given without one: " + ", ".join(formats.names()),
    "rounding": "comma-separated roundings (rn, sr) of every_step and shared arms given without "
    "one; e.g. rn,sr runs both",
    "log_grid": "0 records every step; G > 0 records whole windows at ~G geometrically spaced "
    "places plus those holding steps 64, 1024, 4096 and the last",
    "device": "torch device of the simulation: cpu or cuda[:N] (the last bits of the fp64 "
    "sums, hence the CSV's bytes, depend on the device)",
    "threads": "torch CPU threads during the run (restored after); one is fastest for these "
    "small per-step operations and keeps the sums' order fixed",
    "backend": "reference (lowprec.policies in FP64, every recurrence) or emulation (the Triton "
    "kernels of emulation/ with fp32 containers; Mamba-2 only; needs CUDA for real sizes, "
    "runs interpreted on a CPU)",
}


def build_parser() -> argparse.ArgumentParser:
    epilog = "presets (explicit flags override them):\n" + "\n".join(
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
        help="start from a preset; output paths default to results/error_growth_<preset>.*",
    )
    kinds = {
        "dv": int,
        "dk": int,
        "heads": int,
        "seeds": int,
        "seed0": int,
        "steps": int,
        "window": int,
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
        help="CSV path (default: results/error_growth_<preset or custom>.csv); the sidecar "
        "<stem>.meta.json is written beside it",
    )
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG path, or 'none' for no plot (default: the CSV path with .png)",
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
    return parser


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


def config_from_args(args: argparse.Namespace) -> Config:
    """Base defaults, then the preset's values, then the flags given; raises ValueError."""
    given = [k for k, v in vars(args).items() if k in BASE_DEFAULTS and v is not None]
    if args.replot and given:  # the CSV holds its run: --steps 100 drew all 4,096, silently
        raise ValueError(f"--replot: --{given[0].replace('_', '-')} sets up a run; a replot "
                         "draws the CSV as it was run (--out, --plot, --at and --preset only)")
    values = dict(BASE_DEFAULTS)
    if args.preset:
        values.update(PRESETS[args.preset])
    values.update({k: v for k, v in vars(args).items() if k in BASE_DEFAULTS and v is not None})
    for name in ("out", "plot"):  # an unset shell variable: not the default path, silently
        if getattr(args, name) is not None and not getattr(args, name).strip():
            raise ValueError(f"--{name}: expected a path, got {getattr(args, name)!r}")
    out = args.out or f"results/error_growth_{args.preset or 'custom'}.csv"
    plot_path = args.plot or str(Path(out).with_suffix(".png"))
    if is_folder(out):
        raise ValueError(f"out: expected a CSV path, got the folder {out!r}")
    if plot_path.lower() != "none":
        _check_plot_path(plot_path)
        if Path(plot_path).resolve() in (Path(out).resolve(), meta_path(out).resolve()):
            raise ValueError(f"plot: {plot_path!r} is the CSV's own path (or its .meta.json): "
                             "give --out a .csv path or --plot another file")
    # writable outputs, checked before the run (a bad path was a traceback after it)
    if not args.replot and (problem := file_problem(out)):
        raise ValueError(f"--out: cannot write {out}: {problem}")
    if plot_path.lower() != "none" and (problem := file_problem(plot_path)):
        raise ValueError(f"--plot: cannot write {plot_path}: {problem}")
    return Config(
        recurrence=values["recurrence"],
        dv=values["dv"],
        dk=values["dk"],
        heads=values["heads"],
        seeds=values["seeds"],
        seed0=values["seed0"],
        steps=values["steps"],
        window=values["window"],
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
    beta = draw(INPUT_CHUNK, c.heads, uniform=True)
    k = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True)
    q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    return v, k, q, u, beta


def make_inputs(config: Config, steps: int) -> list[tuple]:
    """The first ``steps`` inputs ``(a, v, k, q, beta)`` of ``run(config)``, for tests."""
    stream = _Inputs(config)
    return [stream.next() for _ in range(steps)]


def run(config: Config) -> pd.DataFrame:
    """Simulate every arm of ``config``, write the CSV to ``config.out`` and return it."""
    c = config
    batch = len(c.memory) * c.seeds
    steps_kept = recorded_steps(c.steps, c.window, c.log_grid)
    keep = np.zeros(c.steps + 1, dtype=bool)
    keep[steps_kept] = True
    emulated = c.backend == "emulation"

    def simulator(arm, fmt, rounding):
        policy = make_policy(arm, fmt, rounding, window=c.window, seed=c.seed0)
        return Simulator(c.recurrence, policy, batch, c.heads, c.dv, c.dk, dtype=torch.float64)

    def arm_step(spec):
        if emulated:
            return _emulation_step(c, spec, batch)
        return simulator(spec.arm, spec.fmt, spec.rounding).step

    column = 0
    bar = tqdm(
        total=c.steps,
        desc=f"error_growth {c.recurrence} {c.backend} ({len(c.arms)} arms x {batch} seqs)",
        unit="step",
        file=sys.stderr,
        disable=not c.progress,
        mininterval=0.5,
    )
    # lowprec's factory calls (zeros, arange) follow the default device; the device context
    # intercepts every torch call (measured: half of a GPU run's host time), so it is entered
    # only for a GPU.
    on_device = torch.device(c.device) if c.device != "cpu" else nullcontext()
    stop = _StopRequest()
    with bar, torch.no_grad(), on_device, _cpu_threads(c.threads):
        exact = simulator("exact", "fp64", "rn")
        arm_steps = [arm_step(spec) for spec in c.arms]
        errors = torch.full(
            (len(arm_steps), batch, len(steps_kept)), float("nan"), dtype=torch.float64
        )
        inputs = _Inputs(c)
        done = 0
        for t in range(1, c.steps + 1):
            if stop.requested:
                break
            a, v, k, q, beta = inputs.next()
            y = exact.step(a, v, k, q, beta)
            # the reference arms take the generic inputs, the emulation's the kernel arguments
            arm_inputs = mamba2_kernel_inputs(a, v, k, q) if emulated else (a, v, k, q, beta)
            for i, step in enumerate(arm_steps):
                y_hat = step(*arm_inputs)
                if keep[t]:
                    errors[i, :, column] = rel_err(y_hat, y)
            column += int(keep[t])
            done = t
            bar.update()
        inputs.close()
    stop.restore()
    if done < c.steps:  # stopped by SIGTERM/SIGINT: keep the windows that were completed
        whole = steps_kept <= done - done % c.window
        steps_kept, errors = steps_kept[whole], errors[:, :, : int(whole.sum())]
    frame = _to_frame(c, steps_kept, errors.cpu())
    frame.attrs["steps_done"] = done
    write_csv(frame, c.out)
    return frame


class _StopRequest:
    """SIGTERM or SIGINT during run(): finish the current step, then write what was done (a
    `timeout` on a long GPU run still leaves a CSV). Outside the main thread: not installed."""

    def __init__(self):
        self.requested = False
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


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


def _emulation_step(c: Config, spec: ArmSpec, batch: int):
    """A function ``(x, dt, A, B, C) -> y_hat`` that advances one arm's emulation cache by one
    token: every_step on a ``StateCache`` (the output reads the stored state), the windowed
    arms on a ``ReplayCache`` whose recurrence copy is ``EMULATION_HI_COPY`` (shared: the
    format itself) and read copy the format (RN). Slot b of the cache is slot b of the
    reference's batch and the seed is ``seed0``, so SR uses the same Philox words."""
    # Imported here: emulation.numerics switches Triton's interpreter on without CUDA, which
    # the reference backend has no need of.
    from emulation.replay_decode import ReplayCache, mamba2_replay_decode
    from emulation.state_update import StateCache, mamba2_state_update

    shape = (batch, c.heads, c.dv, c.dk)
    # Every slot advances in lockstep and _check_emulation bounds the steps, so the counters
    # stay in range: on a GPU the per-call range check (a stream sync that stops the host from
    # running ahead) is skipped; on the CPU it costs nothing and stays.
    check = c.device == "cpu"
    if spec.arm == "every_step":
        cache = StateCache.empty(
            *shape, format=spec.fmt, rounding=spec.rounding, seed=c.seed0, device=c.device
        )

        def step(x, dt, A, B, C):
            return mamba2_state_update(
                cache, x, dt, A, B, C, dt_softplus=False, output_from="stored",
                check_counters=check,
            )

        return step
    hi_format, hi_rounding = EMULATION_HI_COPY.get(spec.arm, (spec.fmt, spec.rounding))
    cache = ReplayCache.empty(
        *shape,
        ngroups=c.heads,
        window=c.window,
        hi_format=hi_format,
        hi_rounding=hi_rounding,
        lo_format=spec.fmt,
        seed=c.seed0,
        act_dtype=torch.float32,
        device=c.device,
    )

    def step(x, dt, A, B, C):
        return mamba2_replay_decode(cache, x, dt, A, B, C, dt_softplus=False, check_counters=check)

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


def _to_frame(c: Config, steps_kept: np.ndarray, errors: torch.Tensor) -> pd.DataFrame:
    """Rows ordered by arm, memory, seed, step (``errors [arm, memory * seed, step]``)."""
    n_arms, n_mem, n_steps = len(c.arms), len(c.memory), len(steps_kept)
    per_arm = n_mem * c.seeds * n_steps
    arm_idx = np.repeat(np.arange(n_arms), per_arm)
    mem_idx = np.tile(np.repeat(np.arange(n_mem), c.seeds * n_steps), n_arms)
    # seeds reach 2^64 - 1 (Philox keys): past int64, uint64 (it overflowed after the run)
    kind = np.int64 if c.seed0 + c.seeds <= 2**63 else np.uint64
    seed = np.tile(np.repeat(np.arange(c.seeds, dtype=kind), n_steps), n_arms * n_mem)
    seed += kind(c.seed0)
    frame = pd.DataFrame(
        {
            "recurrence": c.recurrence,
            "arm": np.array([s.arm for s in c.arms])[arm_idx],
            "format": np.array([s.fmt for s in c.arms])[arm_idx],
            "rounding": np.array([s.rounding for s in c.arms])[arm_idx],
            "memory": np.array([m.name for m in c.memory])[mem_idx],
            "window": c.window,
            "seed": seed,
            "step": np.tile(steps_kept, n_arms * n_mem * c.seeds),
            "rel_err": errors.reshape(-1).numpy(),
        }
    )
    return frame[list(CSV_COLUMNS)]


def write_csv(frame: pd.DataFrame, path: str | Path) -> None:
    """The tidy CSV, floats as ``%.6e`` and NaN as ``nan``, ``\\n`` line ends."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, float_format=FLOAT_FORMAT, na_rep="nan", lineterminator="\n")


def read_csv(path: str | Path) -> pd.DataFrame:
    """A CSV written by ``run``, checked for the exact column list."""
    frame = pd.read_csv(path, keep_default_na=False, na_values=["nan"])
    if tuple(frame.columns) != CSV_COLUMNS:
        raise ValueError(f"{path}: expected columns {list(CSV_COLUMNS)}, got {list(frame.columns)}")
    if frame.empty:
        raise ValueError(f"{path}: no rows")
    for column in ("window", "seed", "step", "rel_err"):
        if not pd.api.types.is_numeric_dtype(frame[column]):
            raise ValueError(f"{path}: expected numbers in the column {column!r}")
    for column in ("recurrence", "window"):  # the plot and summary describe one run
        if frame[column].nunique() > 1:
            raise ValueError(f"{path}: expected one {column} (one run), got "
                             f"{sorted(frame[column].astype(str).unique())}")
    return frame


# --------------------------------------------------------------------------------------------
# summary and plot, from the CSV's rows only

SERIES = ["recurrence", "arm", "format", "rounding", "memory", "window"]


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
    # separate_exact run): dropped, unless no window is whole
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
    NaN where the CSV did not record that window): one row per series, one column per
    step."""
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
    return table.reindex(order).droplevel(["recurrence", "window"])


def format_summary(table: pd.DataFrame, window: int) -> str:
    head = (
        f"rel_err = ||y_hat - y|| / ||y||: mean over the {window}-step window holding step t, "
        "median over seeds"
    )
    return head + "\n" + table.to_string(float_format=lambda x: f"{x:.2e}", na_rep="-")


# Colours per arm (and rounding); the separate arms read an RN copy, so one colour each.
_STYLE = {
    ("every_step", "rn"): ("#d62728", "--"),
    ("every_step", "sr"): ("#d62728", "-"),
    ("shared", "rn"): ("#ff7f0e", "--"),
    ("shared", "sr"): ("#ff7f0e", "-"),
    ("separate_exact", "rn"): ("#1f77b4", "-"),
    ("separate_fp16sr", "rn"): ("#2ca02c", "-"),
}


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
    """Log-log rel_err against step, one panel per (format, memory profile), panels of a
    format sharing the y axis: the window-mean error (median over seeds, band = min..max over
    seeds) of each arm, and the format's unit roundoff u as a dotted line. Windows whose
    median is 0 (the windowed arms before their first flush) have no point on a log axis; an
    arm that is 0 at every step of a panel is not drawn there but named in a note in the
    panel, and a format whose error is 0 everywhere (fp64, or windowed arms that never flush)
    gets a linear axis with its curves on the zero line. Reads only ``csv_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    frame = read_csv(csv_path)
    means = window_means(frame)
    fmts = list(dict.fromkeys(frame["format"]))
    mems = list(dict.fromkeys(frame["memory"]))
    recurrence = frame["recurrence"].iloc[0]
    window = int(frame["window"].iloc[0])
    n_seeds = frame["seed"].nunique()
    legend_inches = 0.45
    height = 2.9 * len(fmts) + 0.5 + legend_inches
    fig, axes = plt.subplots(
        len(fmts),
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
    for row, fmt in enumerate(fmts):
        in_row = means[means["format"] == fmt]
        # no positive error in the whole row (the panels share y): nothing for a log axis
        exact_row = not (in_row["median"] > 0).any()
        for col, mem in enumerate(mems):
            ax = axes[row][col]
            panel = in_row[in_row["memory"] == mem]
            zero = []  # arms at 0 on every step of a log panel: named, not drawn
            for (arm, rounding), curve in panel.groupby(["arm", "rounding"], sort=False):
                colour, dash = _STYLE.get((arm, rounding), ("#7f7f7f", ":"))
                label = arm if arm in SEPARATE_ARMS else f"{arm} ({rounding.upper()})"
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
                # 1-2-5 labels over a few decades; past three decades they would overlap
                low, high = ax.get_ylim()
                coarsest = ONE_TWO_FIVE if high / low <= 1e3 else DECADES
                ax.yaxis.set_major_locator(
                    LogLocator(base=10, subs=log_subs(low, high, coarsest)))
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", alpha=0.3)
            title = f"{fmt} | memory {_memory_label(mem)}"
            if zero:
                title += "\n" + textwrap.fill(
                    "rel_err = 0 at every step, not drawn: " + ", ".join(zero), 60)
            ax.set_title(title, fontsize=8)
            if row == len(fmts) - 1:
                ax.set_xlabel("step (end of window)", fontsize=8)
            if col == 0:
                ax.set_ylabel("rel_err, window mean", fontsize=8)
    fig.suptitle(
        f"{recurrence}: output error against decode length (L = {window}; median over "
        f"{n_seeds} seeds, band = min..max over seeds)",
        fontsize=9,
    )
    fig.legend(
        handles.values(),
        handles.keys(),
        loc="lower center",
        ncol=min(len(handles), 6),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, legend_inches / height, 1, 1 - 0.3 / height))
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=80)
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


# --------------------------------------------------------------------------------------------
# entry point


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        at = None if args.at is None else parse_steps(args.at)
    except ValueError as error:
        parser.error(str(error))
    if at is not None and not args.replot and max(at) > config.steps:
        parser.error(f"--at: step {max(at)} is past --steps {config.steps}")
    if args.replot:
        try:
            frame = read_csv(config.out)
        except (OSError, ValueError) as error:
            parser.error(f"--replot: cannot read {config.out}: {error}")
    else:
        if config.window > config.steps:
            print(f"note: --window {config.window} is longer than --steps {config.steps}: no "
                  "flush happens (the windowed arms never round a checkpoint) and the plot and "
                  "summary average over one partial window", file=sys.stderr)
        elif config.steps % config.window:
            whole = config.steps - config.steps % config.window
            print(f"note: --steps {config.steps} is not a multiple of --window "
                  f"{config.window}: the CSV keeps steps {whole + 1}-{config.steps}, but the "
                  f"plot and summary end at step {whole}, the last whole window", file=sys.stderr)
        start = time.perf_counter()
        try:
            frame = run(config)
        except OSError as error:  # the CSV is written at the end of the run
            parser.error(f"cannot write {config.out}: {error}")
        seconds = time.perf_counter() - start
        settings = asdict(config)
        del settings["out"], settings["plot"], settings["progress"]
        stopped = frame.attrs["steps_done"] < config.steps
        if stopped:
            settings["stopped_after_step"] = frame.attrs["steps_done"]
            print(f"stopped after step {frame.attrs['steps_done']} of {config.steps}: the CSV "
                  "holds the whole windows done", file=sys.stderr)
        command = " ".join(["python -m experiments.error_growth", *map(shlex.quote, argv)])
        try:
            write_meta(config.out, command, seconds, settings, device=config.device)
        except OSError as error:
            parser.error(f"cannot write the .meta.json of {config.out}: {error}")
        print(f"wrote {config.out} ({len(frame)} rows) in {seconds:.1f} s", file=sys.stderr)
        if frame.empty:  # stopped before the first window ended
            return STOPPED_STATUS
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
    print(format_summary(summarize(frame, at), int(frame["window"].iloc[0])))
    # a stopped run is not a finished one, for a script that chains the next step on success
    return STOPPED_STATUS if not args.replot and stopped else 0


if __name__ == "__main__":
    sys.exit(main())
