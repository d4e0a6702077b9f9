"""Kernel benchmark on the GPU: each state format's decode time against the copy ceiling, against
FP32 and FP16 states, and against vLLM's and FlashInfer's kernels.

    python -m experiments.kernel_bench                       # full grid, on the GPU machine
    python -m experiments.kernel_bench --quick               # a small grid (smoke test),
                                                             # into results/kernel_bench_quick.csv
    python -m experiments.kernel_bench --merge a.csv b.csv --out merged.csv   # then plot
    python -m experiments.kernel_bench --plot-only results/kernel_bench.csv

**Kernels** (`--kernels`, names `impl:step:variant`; `--list-kernels` prints them all):

    cute:nonflush:<lo>        cute_kernels.replay_output, read copy lo in nvfp4, fp8_e4m3, fp16,
                              fp32 (fp32 = the single-copy FP32 ReplaySSM non-flush step)
    cute:flush:fp16sr+nvfp4   cute_kernels.replay_flush, recurrence copy fp16 SR, read copy nvfp4
    cute:flush:fp32           the same with hi fp32 and no read copy (single-copy FP32 ReplaySSM)
    cute:update:<fmt>         cute_kernels.state_update, the conventional every-token step, state
                              fp32, fp16 (RN) or fp16sr
    vllm:update:<fmt>         vLLM 0.33.0 Triton `selective_state_update`, fp32 / fp16 state
    vllm:nonflush|flush:<fmt> vLLM `selective_state_update_replayssm_output_only` (one checkpoint)
    flashinfer:update:<fmt>   FlashInfer 0.7.2.post1 `selective_state_update`
    flashinfer:nonflush|flush FlashInfer `checkpointing_ssu` (one checkpoint, ring of L + 1)
    emulation:nonflush:nvfp4  the Triton emulation (fp32 containers), optional

Peers are imported from `--peers-dir` (default `.peers/`, built by `scripts/peers/prepare.sh`);
a peer that cannot be imported is recorded with its reason, never silently dropped.

**Batches.** Uniform: every slot holds the same number of records, `cursor` (the records in the
ring before the step: our `cursors`, vLLM's `write_pos`, FlashInfer's `prev_num_accepted`).
Non-flush steps are timed at `cursor = L/2` and, for the window numbers, also at the ends of the
non-flush range; flush steps at the flush cursor (`L - 1`; FlashInfer `L`, its current token
stays in the ring). Inputs are random (never zeros): bf16 `x, B, C`, raw `dt` in bf16 for the
peers (their serving dtype; FlashInfer's `selective_state_update` takes fp32, as its D/dt_bias
dtype must equal dt's) and fp32 for the kit's kernels (`KIT_DT`), fp32 `A < 0, D, dt_bias`,
softplus on; no `z` gate (vLLM applies it after the kernel).

**Correctness first.** Each kernel is run once per (shape, window) on 3 slots at different
cursors against the `lowprec.mamba2` reference in fp64 (torch on the same device) before it is
timed; a kernel that fails is not timed (`status` says so). Pass: every output within
`2^-7 (|ref| + mag)` (`mag`: the reference on absolute values; this admits bf16 rounding of the
output and the peers' bf16 intermediates and rejects any wrong record, decay or scale), every
written state within the same bound (fp16/fp32 copies), the written read copy within its
format's rounding (nvfp4: a quarter of the block amax; fp8_e4m3: `2^-3 |S| + 2^-9`). The `check`
column is the largest error over its bound (pass: <= 1).

**Timing.** The card is warmed for ~1 s, then the same run measures the device-to-device copy
(bytes read + written) and a streaming read (Triton, each byte once). Each kernel is timed by
CUDA-graph replay of one launch per buffer set, `sets` sets rotating so that one replay touches
at least `l2_multiple` x the L2 (never fewer than 4 sets); counters the kernel advances are reset
between replays, outside the timed region. `time_us` is the median per-launch time over `reps`
replays after `--warm-replays` untimed ones (default 32: a freshly built buffer set runs
slower for its first 10-26 passes; before 2026-12-01 there were 3, and the median fell in that
transient; `WARM_REPLAYS`) (`p10`, `p90` beside it). Each timed region (a
replay, or a ceiling's copy or read) starts behind a GPU spin of `--lead-cycles` (default
200,000 cycles, about 100 us), so that its start event fires when the work is already queued:
the host's submission of the graph is not timed (before 2026-11-30 it was; `--lead-cycles 0`
times that way). A kernel that cannot be
captured is timed with events around eager launches (`timing = events`: host launch overhead
included).

**Bytes** follow `lowprec.traffic` (`state_bytes`, `record_bytes` in the kernel layout with bf16
activations) plus the current token's inputs and output, per slot:

    state:    each copy read, each copy written, in its format (scales included)
    records:  `cursor` records read from the ring, the records appended (1; vLLM's flush: 0)
    token:    x and y (nheads * headdim * 2 B each), dt (nheads * 2 B; 4 B for fp32 dt),
              B and C (ngroups * dstate * 2 B each)

Not counted: A, D, dt_bias (per head, shared by all slots), cursor/flush counters, and scratch
the kernel chooses to keep (vLLM's `bc_pre`, FlashInfer's two-kernel scratch).

**Per committed token** (rows `step = token`): a ReplaySSM window is `L - 1` non-flush steps and
one flush, `((L - 1) * mean_nonflush + flush) / L`, where `mean_nonflush` averages over the
non-flush cursors (`0..L-2`; FlashInfer `1..L-1`) the piecewise-linear interpolation of the
measured cursors (constant beyond the ends); a conventional step is one token. Bytes per token
are exact (summed over the window's cursors).

**Output.** A tidy CSV (one row per kernel x shape x batch x window x cursor, plus the token
rows; columns in `COLUMNS`), its `.meta.json` sidecar, three PNGs from `plot(csv)` (which reads
only the CSV) and a summary table of the issue's targets, printed last.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import itertools
import math
import os
import shlex
import statistics
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments._common import (
    OneLineParser,
    file_problem,
    folder_problem,
    is_file,
    is_folder,
    save_small_png,
)
from lowprec import models, traffic
from lowprec._checks import repeated

__all__ = [
    "BenchShape",
    "SHAPES",
    "KernelSpec",
    "KERNELS",
    "SCHEMES",
    "COLUMNS",
    "BenchConfig",
    "kernel_bytes",
    "token_bytes",
    "check_kernel",
    "run",
    "token_rows",
    "speedups",
    "summarize",
    "plot",
    "main",
]

REPO = Path(__file__).resolve().parent.parent
HEADLINE_BATCH = 256
HEADLINE_WINDOW = 16
ACT = torch.bfloat16
ACT_BYTES = 2
ACT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Raw dt of the kit's kernels: fp32, because cute_kernels.replay_output does not compile with
# a bf16 dt (nvvm.load.ext: unsupported FP type, seen 2026-11-29); the peers get the dtype they
# serve with (bf16; FlashInfer's selective_state_update fp32, see its adapter).
KIT_DT = torch.float32


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchShape:
    """One Mamba-2 layer's decode shape (per sequence): `nheads` states of `headdim x dstate`."""

    name: str
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    source: str

    @property
    def ssm(self) -> models.SSMLayerShape:
        return models.SSMLayerShape("mamba2", self.nheads, self.headdim, self.dstate, self.ngroups)


def _model_layer(name: str, source: str) -> BenchShape:
    """The Mamba-2 layer of the lowprec.models shape `name` (the numbers kept in one place)."""
    ssm = models.get(name).ssm
    return BenchShape(name, ssm.nheads, ssm.d_v, ssm.d_k, ssm.ngroups, source)


SHAPES = {
    shape.name: shape
    for shape in (
        _model_layer(
            "nemotron3-super",
            "Nemotron-3-Super Mamba-2 layer (lowprec.models): 128 heads, headdim 64, dstate 128, "
            "8 groups",
        ),
        _model_layer(
            "mamba2-2.7b",
            "state-spaces/mamba2-2.7b (lowprec.models): d_model 2560, expand 2, headdim 64 "
            "(80 heads), d_state 128, ngroups 1 (the Mamba2 layer defaults)",
        ),
    )
}


# --------------------------------------------------------------------------------------------
# Kernels and schemes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    """One timed kernel. `reads`/`writes`: state copies in their storage formats; `first_cursor`:
    the smallest non-flush cursor of a steady window (FlashInfer keeps its flush token, so 1);
    the flush cursor is `window - 1 + first_cursor`; `ring_extra`: ring positions beyond the
    window; `max_window`: the largest window the kernel supports."""

    name: str
    step: str
    reads: tuple[str, ...]
    writes: tuple[str, ...] = ()
    records_written: int = 0
    dt_bytes: int = ACT_BYTES
    first_cursor: int = 0
    ring_extra: int = 0
    max_window: int = 32
    default: bool = True

    @property
    def impl(self) -> str:
        return self.name.split(":")[0]

    @property
    def variant(self) -> str:
        return self.name.split(":")[2]

    @property
    def replay(self) -> bool:
        return self.step in ("nonflush", "flush")

    def cursors(self, window: int) -> tuple[int, ...]:
        """Cursors timed: the flush cursor, or L/2 first (the headline), then the ends of the
        non-flush range (for the window interpolation)."""
        if self.step == "update":
            return (0,)
        if self.step == "flush":
            return (window - 1 + self.first_cursor,)
        lo, hi = self.first_cursor, window - 2 + self.first_cursor
        return tuple(dict.fromkeys((max(window // 2, lo), lo, hi)))


def _specs() -> dict[str, KernelSpec]:
    specs = []
    kit = dict(dt_bytes=KIT_DT.itemsize)
    for lo in ("nvfp4", "fp8_e4m3", "fp16", "fp32"):
        specs.append(KernelSpec(f"cute:nonflush:{lo}", "nonflush", (lo,), records_written=1,
                                **kit))
    specs += [
        KernelSpec("cute:flush:fp16sr+nvfp4", "flush", ("fp16",), ("fp16", "nvfp4"), 1, **kit),
        KernelSpec("cute:flush:fp32", "flush", ("fp32",), ("fp32",), 1, **kit),
        KernelSpec("cute:flush:fp16sr+fp8_e4m3", "flush", ("fp16",), ("fp16", "fp8_e4m3"), 1,
                   default=False, **kit),
        KernelSpec("cute:flush:fp16sr+fp16", "flush", ("fp16",), ("fp16", "fp16"), 1,
                   default=False, **kit),
        KernelSpec("cute:update:fp32", "update", ("fp32",), ("fp32",), **kit),
        KernelSpec("cute:update:fp16", "update", ("fp16",), ("fp16",), **kit),
        KernelSpec("cute:update:fp16sr", "update", ("fp16",), ("fp16",), **kit),
        KernelSpec("emulation:nonflush:nvfp4", "nonflush", ("fp32",), records_written=1,
                   dt_bytes=4, default=False),
    ]
    for fmt in ("fp32", "fp16"):
        main = fmt == "fp32"
        specs += [
            KernelSpec(f"vllm:update:{fmt}", "update", (fmt,), (fmt,)),
            KernelSpec(f"vllm:nonflush:{fmt}", "nonflush", (fmt,), records_written=1,
                       default=main),
            KernelSpec(f"vllm:flush:{fmt}", "flush", (fmt,), (fmt,), 0, default=main),
            KernelSpec(f"flashinfer:update:{fmt}", "update", (fmt,), (fmt,), dt_bytes=4),
            KernelSpec(f"flashinfer:nonflush:{fmt}", "nonflush", (fmt,), records_written=1,
                       first_cursor=1, ring_extra=1, max_window=16, default=main),
            KernelSpec(f"flashinfer:flush:{fmt}", "flush", (fmt,), (fmt,), 1, first_cursor=1,
                       ring_extra=1, max_window=16, default=main),
        ]
    return {spec.name: spec for spec in specs}


KERNELS = _specs()

# A scheme's cost per committed token: a window of (non-flush, flush) kernels, or one update.
SCHEMES = {
    "two-precision": ("cute:nonflush:nvfp4", "cute:flush:fp16sr+nvfp4"),
    "two-precision-fp8": ("cute:nonflush:fp8_e4m3", "cute:flush:fp16sr+fp8_e4m3"),
    "two-precision-fp16": ("cute:nonflush:fp16", "cute:flush:fp16sr+fp16"),
    "fp32-replay": ("cute:nonflush:fp32", "cute:flush:fp32"),
    "conventional-fp32": ("cute:update:fp32",),
    "conventional-fp16": ("cute:update:fp16",),
    "conventional-fp16sr": ("cute:update:fp16sr",),
    "emulation-two-precision": ("emulation:nonflush:nvfp4", "cute:flush:fp16sr+nvfp4"),
    "vllm-replay-fp32": ("vllm:nonflush:fp32", "vllm:flush:fp32"),
    "vllm-replay-fp16": ("vllm:nonflush:fp16", "vllm:flush:fp16"),
    "vllm-conventional-fp32": ("vllm:update:fp32",),
    "vllm-conventional-fp16": ("vllm:update:fp16",),
    "flashinfer-replay-fp32": ("flashinfer:nonflush:fp32", "flashinfer:flush:fp32"),
    "flashinfer-replay-fp16": ("flashinfer:nonflush:fp16", "flashinfer:flush:fp16"),
    "flashinfer-conventional-fp32": ("flashinfer:update:fp32",),
    "flashinfer-conventional-fp16": ("flashinfer:update:fp16",),
}

# (label, numerator kernel or scheme, denominator, target at the headline point or None).
# Kernel names compare non-flush steps at cursor L/2; scheme names compare cost per token.
COMPARISONS = (
    ("non-flush: nvfp4 vs fp32 checkpoint", "cute:nonflush:fp32", "cute:nonflush:nvfp4", 5.0),
    ("non-flush: fp8_e4m3 vs fp32 checkpoint", "cute:nonflush:fp32", "cute:nonflush:fp8_e4m3",
     None),
    ("non-flush: fp16 vs fp32 checkpoint", "cute:nonflush:fp32", "cute:nonflush:fp16", None),
    ("token: two-precision vs FP32 ReplaySSM", "fp32-replay", "two-precision", 4.0),
    ("token: two-precision vs conventional fp32", "conventional-fp32", "two-precision", 7.5),
    ("token: two-precision vs conventional fp16", "conventional-fp16", "two-precision", None),
    ("token: two-precision vs conventional fp16 SR", "conventional-fp16sr", "two-precision",
     None),
    ("token: two-precision vs vLLM fp32 update", "vllm-conventional-fp32", "two-precision", None),
    ("token: two-precision vs vLLM fp16 update", "vllm-conventional-fp16", "two-precision", None),
    ("token: two-precision vs vLLM FP32 ReplaySSM", "vllm-replay-fp32", "two-precision", None),
    ("token: two-precision vs FlashInfer fp32 update", "flashinfer-conventional-fp32",
     "two-precision", None),
    ("token: two-precision vs FlashInfer fp16 update", "flashinfer-conventional-fp16",
     "two-precision", None),
    ("token: two-precision vs FlashInfer FP32 ReplaySSM", "flashinfer-replay-fp32",
     "two-precision", None),
    ("token: cute conventional fp32 vs vLLM fp32 update", "vllm-conventional-fp32",
     "conventional-fp32", None),
)

COLUMNS = [
    "run", "kernel", "impl", "step", "scheme", "shape", "batch", "window", "cursor",
    "time_us", "time_us_p10", "time_us_p90", "bytes", "gbps", "frac_copy", "frac_read",
    "copy_gbps", "read_gbps", "check", "status", "sets", "timing", "note",
]


# --------------------------------------------------------------------------------------------
# Configuration and command line
# --------------------------------------------------------------------------------------------


# A spin of this many GPU cycles (about 100 us at the H200's 1.98 GHz) is queued before each
# timed region's start event, so that the GPU is still busy with it while the host submits the
# event and the work (a graph launch costs the host several microseconds): without it the
# start event fires at once on an idle stream and the host's submission is timed as well.
LEAD_CYCLES = 200_000

# Replays not timed before each point's `reps`. A freshly built buffer set runs slower for its
# first 10-26 passes, whatever the pause since it was written, with the clocks at 1,980 MHz
# throughout: on the H200 (2026-12-01, three machines, `python -m experiments.warm_transient`,
# results/warm_transient.csv and kernel_bench_runs/steady_26/) the two-precision non-flush step
# at the headline point took 5.6-6.1% longer for its first 18-26 replays over 4 new sets (about
# 59.8 against 56.1-56.5 us), the FP32-checkpoint step 6.4-6.6% longer for 10-18 (303 against
# 283 us); a new graph over the same buffers was fast at once. With 3 warm replays (the method
# before 2026-12-01, `--warm-replays 3`) the median fell in that transient; 32 put every timed
# replay past it, as the copy ceiling (1 s of copies first) always was (results/README.md,
# "Twenty-sixth session"). A point whose timed replays still drift is noted (`settling_note`).
WARM_REPLAYS = 32


@dataclass
class BenchConfig:
    """What to measure (`main` builds it from the command line)."""

    shapes: tuple[str, ...] = tuple(SHAPES)
    batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256, 512)
    windows: tuple[int, ...] = (8, 16, 32)
    kernels: tuple[str, ...] = tuple(name for name, spec in KERNELS.items()
                                     if spec.default and spec.impl == "cute")
    peers: tuple[str, ...] = ("vllm", "flashinfer")
    out: str = "results/kernel_bench.csv"
    plot_dir: str | None = "results"
    reps: int = 20
    l2_multiple: float = 4.0
    lead_cycles: int = LEAD_CYCLES  # GPU spin before each timed region (0: none)
    warm_replays: int = WARM_REPLAYS  # untimed replays before each point's reps
    budget_s: float | None = None
    peers_dir: str = ".peers"
    run_label: str = "A"
    quick: bool = False
    seed: int = 0
    device: str = "cuda"
    act: str = "bf16"
    # tuning knobs of the CuTe non-flush kernel (cute_kernels.replay_output's keyword
    # arguments, e.g. weights_at), for an A/B comparison in the benchmark's own conditions
    nonflush_knobs: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in self.shapes:
            if name not in SHAPES:
                raise ValueError(f"shapes: expected names in {list(SHAPES)}, got {name!r}")
        for name in self.kernels:
            if name not in KERNELS:
                raise ValueError(f"kernels: expected names in {list(KERNELS)}, got {name!r}")
        for peer in self.peers:
            if peer not in ("vllm", "flashinfer"):
                raise ValueError(f"peers: expected vllm, flashinfer or none, got {peer!r}")
        for name in ("shapes", "kernels", "peers", "batches", "windows"):
            values = list(getattr(self, name))
            twice = sorted(map(str, repeated(values)))
            if twice:  # each would be timed again: minutes of a 30-minute device budget
                raise ValueError(f"{name}: expected each once, got {', '.join(twice)} twice")
        for name, values in (("batches", self.batches), ("windows", self.windows)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                 for v in values):
                raise ValueError(f"{name}: expected positive integers, got {list(values)}")
        if any(w < 4 or w > 32 for w in self.windows):
            raise ValueError(f"windows: expected values in [4, 32], got {list(self.windows)}")
        if isinstance(self.lead_cycles, bool) or not isinstance(self.lead_cycles, int) or (
                self.lead_cycles < 0):
            raise ValueError(f"lead_cycles: expected an integer >= 0, got {self.lead_cycles!r}")
        if self.reps < 1:
            raise ValueError(f"reps: expected >= 1, got {self.reps}")
        if isinstance(self.warm_replays, bool) or not isinstance(self.warm_replays, int) or (
                self.warm_replays < 0):
            raise ValueError(f"warm_replays: expected an integer >= 0, got "
                             f"{self.warm_replays!r}")
        if self.budget_s is not None and not (math.isfinite(self.budget_s)
                                              and self.budget_s > 0):
            raise ValueError(f"budget_s: expected a finite number > 0, got {self.budget_s}")
        if self.act not in ACT_DTYPES:
            raise ValueError(f"act: expected one of {list(ACT_DTYPES)}, got {self.act!r}")
        allowed = {name for name in inspect.signature(
            _cute("replay_output").replay_output).parameters if not name.startswith("_")} - set(
            NONFLUSH_FIXED) if self.nonflush_knobs else set()
        for key in self.nonflush_knobs:
            if key not in allowed:
                raise ValueError(f"nonflush knob: expected one of {sorted(allowed)}, got {key!r}")

    def check_knob_values(self, kernels) -> None:
        """ValueError unless the non-flush knobs' values suit each CuTe non-flush kernel of
        ``kernels`` at every shape, window and batch (replay_output.check_options on meta
        tensors: no GPU needed), so that a bad value is refused before the run, not at each
        point's first build."""
        if not self.nonflush_knobs:
            return
        if not any(KERNELS[name].impl == "cute" and KERNELS[name].step == "nonflush"
                   for name in kernels):
            raise ValueError("nonflush knob: no CuTe non-flush kernel is asked for (--kernels "
                             f"{','.join(kernels) or 'none'}), so the knobs would apply to "
                             "nothing")
        check = _cute("replay_output").check_options
        for name in kernels:
            spec = KERNELS[name]
            if spec.impl != "cute" or spec.step != "nonflush":
                continue
            shapes = [SHAPES[shape] for shape in self.shapes]
            for shape, window, batch in itertools.product(shapes, self.windows, self.batches):
                dims = (batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups)
                try:
                    check(lo_format=spec.variant, window=window, shape=dims,
                          **self.nonflush_knobs)
                except ValueError as error:
                    raise ValueError(f"nonflush knob for {name} on {shape.name} at L = "
                                     f"{window}, batch {batch}: {error}") from None

    def all_kernels(self) -> tuple[str, ...]:
        """The kernels asked for, plus each peer's default kernels."""
        peers = [name for name, spec in KERNELS.items()
                 if spec.default and spec.impl in self.peers]
        return tuple(dict.fromkeys([*self.kernels, *peers]))


QUICK = dict(batches=(1, 256), windows=(16,), reps=5, l2_multiple=2.0)
QUICK_OUT = "results/kernel_bench_quick.csv"  # --quick's default --out (not the headline CSV)


class _ListError(argparse.ArgumentTypeError, ValueError):
    """A bad comma-separated list: argparse reports it after the flag's name, and
    config_from_args's callers catch it as a ValueError."""


def _names(text: str, name: str = "") -> tuple[str, ...]:
    """Comma-separated names; an empty item ("a,,b", a trailing comma) is an error, not
    dropped: it is usually a typo. ``name`` prefixes the message where argparse does not
    name the flag."""
    parts = tuple(p.strip() for p in text.split(","))
    if not all(parts):
        prefix = f"{name}: " if name else ""
        raise _ListError(f"{prefix}expected comma-separated names without empty items, got "
                         f"{text!r}")
    return parts


def _ints(text: str) -> tuple[int, ...]:
    parts = tuple(p.strip() for p in text.split(","))
    try:
        return tuple(int(p) for p in parts)
    except ValueError as error:
        raise _ListError(f"expected comma-separated integers, got {text!r}") from error


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.kernel_bench",
                description="Time the kit's CuTe decode kernels and the peers' on the GPU "
                "(see the module docstring); writes a CSV, its .meta.json, PNGs and a summary.")
    defaults = BenchConfig()
    p.add_argument("--shapes", type=_names, default=None,
                   help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--batches", type=_ints, default=None,
                   help="comma-separated batch sizes (default: "
                   f"{','.join(map(str, defaults.batches))})")
    p.add_argument("--windows", type=_ints, default=None,
                   help="comma-separated windows L (default: "
                   f"{','.join(map(str, defaults.windows))})")
    p.add_argument("--kernels", default="default",
                   help="comma-separated kernel names, 'default' (the CuTe kernels), 'all' "
                   "(see --list-kernels) or 'none' (the peers' alone); the peers' kernels come "
                   "with --peers")
    p.add_argument("--peers", default="vllm,flashinfer",
                   help="peers whose default kernels are added: vllm, flashinfer, or none "
                   "(default: %(default)s)")
    p.add_argument("--peers-dir", default=defaults.peers_dir,
                   help="folder built by scripts/peers/prepare.sh (default: .peers)")
    p.add_argument("--out", default=None,
                   help=f"CSV path (default: {defaults.out}; with --quick {QUICK_OUT}, so "
                   "that a smoke test leaves the committed results alone; --merge needs it)")
    p.add_argument("--plot-dir", default=defaults.plot_dir,
                   help="folder for the PNGs, or 'none' (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="small grid: batches 1,256, L = 16, 5 replays (explicit flags win)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop timing after this many seconds; the rest is recorded as skipped")
    p.add_argument("--reps", type=int, default=None, help="graph replays per point (default 20)")
    p.add_argument("--lead-cycles", type=int, default=None,
                   help=f"GPU cycles of spin queued before each timed region, so the host's "
                   f"submission of the work is not timed (default {LEAD_CYCLES:,}; 0: none, "
                   f"the method before 2026-11-30)")
    p.add_argument("--warm-replays", type=int, default=None,
                   help=f"untimed graph replays before each point's timed ones (default "
                   f"{WARM_REPLAYS}: a new buffer set runs slower for its first 10-26 passes; 3: "
                   f"the method before 2026-12-01)")
    p.add_argument("--run-label", default=defaults.run_label,
                   help="label of this run in the CSV's run column (default: %(default)s)")
    sources = p.add_mutually_exclusive_group()
    sources.add_argument("--merge", nargs="+", metavar="CSV",
                         help="merge these CSVs (each once) into --out (no GPU needed), "
                         "recompute the token rows")
    sources.add_argument("--plot-only", metavar="CSV", help="only plot and summarise this CSV")
    p.add_argument("--list-kernels", action="store_true", help="print the kernel names and exit")
    p.add_argument("--nonflush-knob", action="append", default=[], metavar="KEY=VALUE",
                   help="a tuning knob of the CuTe non-flush kernel (replay_output's keyword "
                   "arguments; repeatable), e.g. weights_at=before_decode: an A/B comparison "
                   "in the benchmark's conditions (give it its own --run-label and --out); "
                   "its value is checked, before the GPU is used, for every CuTe non-flush "
                   "kernel asked for (pick them with --kernels)")
    p.add_argument("--profile", metavar="KERNEL",
                   help="for ncu --profile-from-start off: launch KERNEL once per set at the "
                   "first shape, batch and window given, between cudaProfilerStart/Stop")
    return p


def config_from_args(args: argparse.Namespace, argv: list[str]) -> BenchConfig:
    """The configuration the flags ask for; raises ValueError on a bad value."""
    values = {}
    if args.quick:
        values.update(QUICK)
        values["shapes"] = ((args.shapes or BenchConfig.shapes)[0],)
    for name in ("shapes", "batches", "windows"):  # given flags win over --quick's grid
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.reps is not None:
        values["reps"] = args.reps
    if args.lead_cycles is not None:
        values["lead_cycles"] = args.lead_cycles
    if args.warm_replays is not None:
        values["warm_replays"] = args.warm_replays
    if args.kernels == "default":
        kernels = BenchConfig.kernels
    elif args.kernels.strip() == "none":  # the peers' kernels alone (no CuTe DSL at hand)
        kernels = ()
    elif args.kernels == "all":
        kernels = tuple(name for name in KERNELS if KERNELS[name].impl in ("cute", "emulation"))
    else:
        kernels = _names(args.kernels, "kernels")
    peers = () if args.peers.strip() == "none" else _names(args.peers, "peers")
    if args.kernels == "all":
        peers_kernels = tuple(name for name in KERNELS if KERNELS[name].impl in peers)
        kernels = kernels + peers_kernels
    plot_dir = None if args.plot_dir == "none" else args.plot_dir
    knobs = {}
    for item in args.nonflush_knob:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"nonflush knob: expected KEY=VALUE, got {item!r}")
        if key.strip() in knobs:
            raise ValueError(f"nonflush knob: {key.strip()!r} given twice")
        knobs[key.strip()] = _knob_value(text.strip())
    if not kernels and not peers:
        raise ValueError("kernels: 'none' with --peers none leaves nothing to time")
    out = args.out or (QUICK_OUT if args.quick else BenchConfig.out)
    return BenchConfig(kernels=tuple(kernels), peers=tuple(peers), out=out,
                       plot_dir=plot_dir, budget_s=args.budget_s, peers_dir=args.peers_dir,
                       run_label=args.run_label, quick=args.quick, nonflush_knobs=knobs,
                       **values)


# replay_output's arguments that the benchmark itself sets (not knobs)
NONFLUSH_FIXED = ("lo", "ring_x", "ring_dt", "ring_B", "cursors", "x", "dt", "A", "B", "C",
                  "D", "z", "dt_bias", "dt_softplus", "out", "window", "lo_format")


def _knob_value(text: str):
    """A knob's value from the command line: an int, true/false/none (any case), or the
    string (replay_output refuses a string where it wants a bool)."""
    words = {"true": True, "false": False, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    try:
        return int(text)
    except ValueError:
        return text


# --------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------


def token_bytes(shape: BenchShape, dt_bytes: int = ACT_BYTES) -> int:
    """One slot's current-token traffic: x and y, dt per head, B and C per group."""
    return (2 * shape.nheads * shape.headdim * ACT_BYTES + shape.nheads * dt_bytes
            + 2 * shape.ngroups * shape.dstate * ACT_BYTES)


def kernel_bytes(spec: KernelSpec | str, shape: BenchShape, batch: int, cursor: int) -> int:
    """Bytes one call must move for `batch` slots at `cursor` (module docstring, **Bytes**)."""
    spec = KERNELS[spec] if isinstance(spec, str) else spec
    ssm = shape.ssm
    per_slot = sum(traffic.state_bytes(ssm, fmt) for fmt in spec.reads + spec.writes)
    if spec.replay:
        record = traffic.record_bytes(ssm, "kernel", "bf16")
        per_slot += record * (cursor + spec.records_written)
    return batch * (per_slot + token_bytes(shape, spec.dt_bytes))


# --------------------------------------------------------------------------------------------
# Buffers: every tensor a kernel touches, one copy per rotating set
# --------------------------------------------------------------------------------------------

_ALIGN = 256  # bytes between sets' slices (the CuTe kernels need 16-byte-aligned tensors)


class Buffers:
    """Per-set tensors of one kernel configuration. `field(name)` is the list over sets; each
    field lives in one allocation whose rows are 256-byte aligned, so one op fills or resets it
    for every set."""

    def __init__(self, sets: int, device, generator: torch.Generator, act=ACT):
        self.sets = sets
        self.device = device
        self.gen = generator
        self.act = act
        self.bases: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        self.nbytes = 0

    def add(self, name, shape, dtype, fill, *args) -> list[torch.Tensor]:
        numel = math.prod(shape)
        item = torch.empty((), dtype=dtype).element_size()
        row = -(-numel * item // _ALIGN) * _ALIGN // item
        base = torch.empty(self.sets, row, dtype=dtype, device=self.device)
        _fill(base, fill, self.gen, *args)
        self.bases[name] = base
        self.views[name] = [base[i, :numel].view(shape) for i in range(self.sets)]
        self.nbytes += numel * item
        return self.views[name]

    def __getitem__(self, name) -> list[torch.Tensor]:
        return self.views[name]

    def at(self, i: int) -> dict[str, torch.Tensor]:
        return {name: views[i] for name, views in self.views.items()}


def _fill(t: torch.Tensor, kind: str, gen: torch.Generator, *args) -> None:
    """Random contents by kind (never zeros where values are read)."""
    if kind == "randn":
        scale = args[0] if args else 1.0
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device) * scale)
    elif kind == "dt_raw":
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device) - 1.0)
    elif kind == "dt_proc":
        t.copy_(torch.rand(t.shape, generator=gen, device=t.device) * 0.5 + 0.01)
    elif kind == "bytes":
        low, high = args
        t.copy_(torch.randint(low, high, t.shape, generator=gen, device=t.device))
    elif kind == "e4m3":
        values = torch.randn(t.shape, generator=gen, device=t.device)
        t.copy_(values.to(torch.float8_e4m3fn).view(torch.uint8))
    elif kind == "const":
        t.fill_(args[0])
    elif kind == "empty":
        pass
    else:
        raise ValueError(f"fill: expected a known kind, got {kind!r}")


@dataclass
class Case:
    """A kernel's buffers and how to launch it on set `i`. `cursor` is one value (timing) or a
    list per slot (the check). `reset()` restores counters the kernel advances."""

    spec: KernelSpec
    shape: BenchShape
    batch: int
    window: int
    bufs: Buffers
    params: dict
    launch: object
    reset: object = None


def _params(shape: BenchShape, device, gen: torch.Generator) -> dict:
    H = shape.nheads
    return dict(
        A=-(torch.rand(H, generator=gen, device=device) + 0.5),
        D=torch.randn(H, generator=gen, device=device),
        dt_bias=torch.randn(H, generator=gen, device=device) * 0.1,
    )


def _token_buffers(b: Buffers, shape: BenchShape, batch: int, dt_dtype=None) -> None:
    S, H, P, N, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    b.add("x", (S, H, P), b.act, "randn")
    b.add("dt", (S, H), dt_dtype or b.act, "dt_raw")
    b.add("B", (S, G, N), b.act, "randn")
    b.add("C", (S, G, N), b.act, "randn")
    b.add("out", (S, H, P), b.act, "empty")


def _ring_buffers(b: Buffers, shape: BenchShape, batch: int, length: int) -> None:
    S, H, P, N, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    b.add("ring_x", (S, H, length, P), b.act, "randn")
    b.add("ring_dt", (S, H, length), torch.float32, "dt_proc")
    b.add("ring_B", (S, G, length, N), b.act, "randn")


def _counter(b: Buffers, name: str, batch: int, value) -> None:
    """An int32 counter per slot: one value for all, or one per slot."""
    views = b.add(name, (batch,), torch.int32, "const", 0)
    if isinstance(value, int):
        b.bases[name].fill_(value)
    else:
        for view in views:
            view.copy_(torch.tensor(value, dtype=torch.int32))


def _lo_buffers(b: Buffers, shape: BenchShape, batch: int, fmt: str, prefix: str = "lo") -> None:
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    if fmt == "nvfp4":
        b.add(f"{prefix}.codes", (S, H, P, N // 2), torch.uint8, "bytes", 0, 256)
        # E4M3 scale bytes 0x20..0x3f: 2^-3 .. 1.875, positive and finite
        b.add(f"{prefix}.scales", (S, H, P, N // 16), torch.uint8, "bytes", 0x20, 0x40)
        b.add(f"{prefix}.global_scale", (S, H), torch.float32, "dt_proc")
    elif fmt == "fp8_e4m3":
        b.add(f"{prefix}.codes", (S, H, P, N), torch.uint8, "e4m3")
    else:
        dtype = torch.float16 if fmt == "fp16" else torch.float32
        b.add(f"{prefix}.values", (S, H, P, N), dtype, "randn")


def _lo_dict(t: dict, prefix: str = "lo") -> dict | None:
    lo = {k.split(".", 1)[1]: v for k, v in t.items() if k.startswith(prefix + ".")}
    return lo or None


def _state_dtype(fmt: str) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16}[fmt]


# --------------------------------------------------------------------------------------------
# Kernel adapters (each builds its inputs in the kernel's own layout and returns a Case)
# --------------------------------------------------------------------------------------------


class Unavailable(RuntimeError):
    """A kernel that cannot run here; the message is the recorded reason."""


def _cute(module: str):
    import importlib

    try:
        return importlib.import_module(f"cute_kernels.{module}")
    except Exception as error:  # the CuTe kernels may be absent or fail to import: record why
        raise Unavailable(f"cute_kernels.{module}: {type(error).__name__}: {error}") from error


def _build_cute(spec, shape, batch, window, cursor, b: Buffers, params, knobs=None) -> Case:
    S = batch
    _token_buffers(b, shape, batch, dt_dtype=KIT_DT)
    if spec.step == "update":
        su = _cute("state_update")
        fmt = spec.variant
        dtype = torch.float16 if fmt.startswith("fp16") else torch.float32
        b.add("state", (S, shape.nheads, shape.headdim, shape.dstate), dtype, "randn")
        rounding = "sr" if fmt == "fp16sr" else "rn"
        if rounding == "sr":
            _counter(b, "counters", batch, 0)

        def launch(t):
            su.state_update(t["state"], t["x"], t["dt"], params["A"], t["B"], t["C"],
                            params["D"], None, params["dt_bias"], True, t["out"],
                            rounding=rounding, seed=12345, counters=t.get("counters"))

        return Case(spec, shape, batch, window, b, params, launch)

    _ring_buffers(b, shape, batch, window)
    _counter(b, "cursors", batch, cursor)
    if spec.step == "nonflush":
        ro = _cute("replay_output")
        lo_format = spec.variant
        _lo_buffers(b, shape, batch, lo_format)

        def launch(t):
            ro.replay_output(_lo_dict(t), t["ring_x"], t["ring_dt"], t["ring_B"], t["cursors"],
                             t["x"], t["dt"], params["A"], t["B"], t["C"], params["D"], None,
                             params["dt_bias"], True, t["out"], window=window,
                             lo_format=lo_format, **(knobs or {}))
    else:
        rf = _cute("replay_flush")
        hi, lo_format = ("fp32", "none") if spec.variant == "fp32" else ("fp16", spec.writes[1])
        b.add("hi", (S, shape.nheads, shape.headdim, shape.dstate), _state_dtype(hi), "randn")
        if lo_format != "none":
            _lo_buffers(b, shape, batch, lo_format)
        _counter(b, "flushes", batch, 0)

        def launch(t):
            rf.replay_flush(t["hi"], _lo_dict(t), t["ring_x"], t["ring_dt"], t["ring_B"],
                            t["cursors"], t["flushes"], t["x"], t["dt"], params["A"], t["B"],
                            t["C"], params["D"], None, params["dt_bias"], True, t["out"],
                            window=window, hi_format=hi,
                            hi_rounding="sr" if hi == "fp16" else "rn", lo_format=lo_format,
                            seed=12345)

    start = b.bases["cursors"].clone()
    return Case(spec, shape, batch, window, b, params, launch,
                reset=lambda: b.bases["cursors"].copy_(start))


def _build_emulation(spec, shape, batch, window, cursor, b: Buffers, params) -> Case:
    try:
        from emulation.replay_decode import ReplayCache, mamba2_replay_decode
    except Exception as error:
        raise Unavailable(f"emulation.replay_decode: {type(error).__name__}: {error}") from error
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    _token_buffers(b, shape, batch, dt_dtype=torch.float32)
    _ring_buffers(b, shape, batch, window)
    _counter(b, "cursors", batch, cursor)
    _counter(b, "flushes", batch, 0)
    b.add("lo.values", (S, H, P, N), torch.float32, "randn")
    b.add("lo_scales", (S, H, P, N // 16), torch.float32, "dt_proc")
    b.add("lo_global", (S, H), torch.float32, "dt_proc")
    b.add("hi", (S, H, P, N), torch.float16, "randn")

    def launch(t):
        cache = ReplayCache(
            hi=t["hi"], lo=t["lo.values"], lo_scales=t["lo_scales"], lo_global=t["lo_global"],
            ring_x=t["ring_x"], ring_dt=t["ring_dt"], ring_B=t["ring_B"],
            cursors=t["cursors"], flushes=t["flushes"], hi_format="fp16", hi_rounding="sr",
            lo_format="nvfp4", window=window, draft=0, seed=12345,
        )
        mamba2_replay_decode(cache, t["x"], t["dt"], params["A"], t["B"], t["C"], params["D"],
                             None, params["dt_bias"], dt_softplus=True, out=t["out"])

    start = b.bases["cursors"].clone()
    return Case(spec, shape, batch, window, b, params, launch,
                reset=lambda: b.bases["cursors"].copy_(start))


_PEER_MODULES: dict[str, object] = {}


def _import_vllm(peers_dir: Path):
    """vLLM's Mamba decode kernels (from `<peers_dir>/vllm/site` when present)."""
    if "vllm" in _PEER_MODULES:
        return _PEER_MODULES["vllm"]
    site = Path(peers_dir) / "vllm" / "site"
    if site.is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))
    try:
        from vllm.model_executor.layers.mamba.ops import mamba_ssm
        from vllm.model_executor.layers.mamba.ops import (
            selective_state_update_replayssm_output_only as replay,
        )
    except Exception as error:
        reason = f"vllm kernels not importable ({type(error).__name__}: {error})"
        if not site.is_dir():
            reason += f"; {site} is missing: run scripts/peers/prepare.sh vllm"
        _PEER_MODULES["vllm"] = Unavailable(reason)
    else:
        _PEER_MODULES["vllm"] = (mamba_ssm.selective_state_update,
                                 replay.selective_state_update_replayssm_output_only)
    return _PEER_MODULES["vllm"]


FLASHINFER_UNPACK = Path(os.environ.get("LOWPREC_PEERS_TMP", "/tmp/lowprec-peers")) / "flashinfer"


def _import_flashinfer(peers_dir: Path):
    """FlashInfer's Mamba entry points; unpacks `<peers_dir>/flashinfer/flashinfer-peer.tar.xz`
    to /tmp (once) when flashinfer is not importable as installed."""
    if "flashinfer" in _PEER_MODULES:
        return _PEER_MODULES["flashinfer"]
    archive = Path(peers_dir) / "flashinfer" / "flashinfer-peer.tar.xz"
    site = FLASHINFER_UNPACK / "site"
    try:
        if archive.is_file() and not (site / "flashinfer").is_dir():
            FLASHINFER_UNPACK.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archive) as tar:
                tar.extractall(FLASHINFER_UNPACK, filter="data")
        if (site / "flashinfer").is_dir():
            if str(site) not in sys.path:
                sys.path.insert(0, str(site))
            os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(FLASHINFER_UNPACK / "ws"))
        if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
            # an older torch: tvm-ffi would JIT-build its DLPack addon at import (minutes of
            # device time); its fallback converts tensors in Python, on torch's current stream
            os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
        # The prebuilt modules were linked on a machine without a driver, against a stub
        # libcuda with no symbols, so they do not name libcuda as a dependency; their driver
        # calls (cuTensorMapEncodeTiled) resolve only if the driver library is already loaded
        # globally. Seen on the H200 on 2026-11-29: "symbol lookup error ... undefined symbol:
        # cuTensorMapEncodeTiled" without this (results/kernel_bench_runs/call_B_first_try.log).
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        from flashinfer.mamba.checkpointing_ssu import (
            allocate_checkpointing_ssu_scratch,
            checkpointing_ssu,
        )
        from flashinfer.mamba.selective_state_update import selective_state_update
    except Exception as error:
        reason = f"flashinfer not importable ({type(error).__name__}: {error})"
        if not archive.is_file():
            reason += f"; {archive} is missing: run scripts/peers/prepare.sh flashinfer"
        _PEER_MODULES["flashinfer"] = Unavailable(reason)
    else:
        _PEER_MODULES["flashinfer"] = (selective_state_update, checkpointing_ssu,
                                       allocate_checkpointing_ssu_scratch)
    return _PEER_MODULES["flashinfer"]


def _peer(name: str, peers_dir: Path):
    loaded = (_import_vllm if name == "vllm" else _import_flashinfer)(peers_dir)
    if isinstance(loaded, Unavailable):
        raise loaded
    return loaded


def _tied(params: dict, shape: BenchShape) -> dict:
    """A, D, dt_bias broadcast per head with stride 0, the layout both peers take
    (`A [nheads, headdim, dstate]`, `D, dt_bias [nheads, headdim]`)."""
    P, N = shape.headdim, shape.dstate
    return dict(
        A=params["A"][:, None, None].expand(-1, P, N),
        D=params["D"][:, None].expand(-1, P),
        dt_bias=params["dt_bias"][:, None].expand(-1, P),
    )


def _peer_vllm_build(spec, shape, batch, window, cursor, b: Buffers, params, peers_dir) -> Case:
    """vLLM: `selective_state_update(state, x, dt, A, B, C, D, dt_bias, z, dt_softplus, out=)`
    with dt `[b, h, p]` stride 0 over p; the ReplaySSM output-only kernel with its ring
    (`x_cache [b, h, L, p]`, `dt_cache [b, h, L]` processed dt, `B_cache [b, g, L, n]`),
    `write_pos` = records before the step, `is_flush`, `bc_pre` fp32 scratch `[b, g, L]`."""
    ssu, replay_output_only = _peer("vllm", peers_dir)
    S, H, P, N, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    fmt = spec.variant
    _token_buffers(b, shape, batch)
    b.add("state", (S, H, P, N), _state_dtype(fmt), "randn")
    tied = _tied(params, shape)
    if spec.step == "update":

        def launch(t):
            ssu(t["state"], t["x"], t["dt"][..., None].expand(-1, -1, P), tied["A"], t["B"],
                t["C"], tied["D"], tied["dt_bias"], None, True, out=t["out"])

        return Case(spec, shape, batch, window, b, params, launch)

    _ring_buffers(b, shape, batch, window)
    _counter(b, "cursors", batch, cursor)
    b.add("is_flush", (S,), torch.bool, "const", spec.step == "flush")
    b.add("bc_pre", (S, G, window), torch.float32, "empty")

    def launch(t):
        replay_output_only(
            t["state"], t["x"], t["dt"][..., None].expand(-1, -1, P), tied["A"], t["B"], t["C"],
            tied["D"], tied["dt_bias"], None, True, x_cache=t["ring_x"], dt_cache=t["ring_dt"],
            B_cache=t["ring_B"], bc_pre=t["bc_pre"], write_pos=t["cursors"],
            is_flush=t["is_flush"], max_cache_len=window, out=t["out"],
        )

    return Case(spec, shape, batch, window, b, params, launch)


def _peer_flashinfer_build(spec, shape, batch, window, cursor, b: Buffers, params,
                           peers_dir) -> Case:
    """FlashInfer: `selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
    out=)` (dt fp32 `[b, h, p]` stride 0 over p: its D/dt_bias dtype must equal dt's);
    `checkpointing_ssu(state, x_cache, B_cache, dt_cache, ring_start, prev_num_accepted, x, dt,
    A, B, C, out, D, z, dt_bias, dt_softplus, ...)` with T = 1 token per step (`x [b, 1, h, p]`),
    a ring of L + 1 rows (its window is the ring length minus T), ring_start 0, the host-owned
    `prev_num_accepted` = records before the step, and the two-kernel scratch allocated as its
    docstring asks (algorithm 'auto': FlashInfer's own choice)."""
    ssu, checkpointing_ssu, scratch = _peer("flashinfer", peers_dir)
    _flashinfer_prebuild_failure(spec, shape, window, peers_dir)
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    fmt = spec.variant
    tied = _tied(params, shape)
    b.add("state", (S, H, P, N), _state_dtype(fmt), "randn")
    if spec.step == "update":
        _token_buffers(b, shape, batch, dt_dtype=torch.float32)

        def launch(t):
            ssu(t["state"], t["x"], t["dt"][..., None].expand(-1, -1, P), tied["A"], t["B"],
                t["C"], tied["D"], None, tied["dt_bias"], True, out=t["out"])

        return Case(spec, shape, batch, window, b, params, launch)

    if window > spec.max_window:
        raise Unavailable(f"checkpointing_ssu supports at most {spec.max_window} cached tokens, "
                          f"window {window} asked")
    _token_buffers(b, shape, batch)
    _ring_buffers(b, shape, batch, window + spec.ring_extra)
    _counter(b, "ring_start", batch, 0)
    _counter(b, "cursors", batch, cursor)
    scratch_sets = [scratch(S, H, 1, window, b.act, b.device) for _ in range(b.sets)]

    def launch(t):
        cb_scaled, cum_adt, cb_old = scratch_sets[t["set"]]
        checkpointing_ssu(
            t["state"], t["ring_x"], t["ring_B"], t["ring_dt"], t["ring_start"], t["cursors"],
            t["x"][:, None], t["dt"][:, None, :, None].expand(-1, 1, -1, P), tied["A"],
            t["B"][:, None], t["C"][:, None], t["out"][:, None], tied["D"], None,
            tied["dt_bias"], True, cb_scaled=cb_scaled, cumAdt_vec=cum_adt, cb_old=cb_old,
        )

    return Case(spec, shape, batch, window, b, params, launch)


def _flashinfer_prebuild_failure(spec: KernelSpec, shape: BenchShape, window: int,
                                 peers_dir: Path) -> None:
    """Raise `Unavailable` when scripts/peers/prepare.sh could not compile the FlashInfer module
    this kernel needs (its report is `<peers_dir>/flashinfer/prebuild-report.tsv`): the same
    build on the GPU machine would fail too, after minutes of device time."""
    report = Path(peers_dir) / "flashinfer" / "prebuild-report.tsv"
    if not report.is_file():
        return
    from flashinfer.jit.mamba.checkpointing_ssu import get_checkpointing_ssu_uri
    from flashinfer.jit.mamba.selective_state_update import get_selective_state_update_uri

    state = _state_dtype(spec.variant)
    f32, i32 = torch.float32, torch.int32
    if spec.step == "update":
        uri = get_selective_state_update_uri(state, ACT, f32, f32, i32, None, shape.headdim,
                                             shape.dstate, 1, i32, torch.int64, 0) + "_sm90"
    else:
        uri = get_checkpointing_ssu_uri(state, ACT, ACT, f32, f32, i32, None, shape.headdim,
                                        shape.dstate, 1, window, shape.nheads // shape.ngroups,
                                        shape.ngroups, 0, False)
    for line in report.read_text().splitlines():
        name, _, status = line.partition("\t")
        if name == uri and status.startswith("failed"):
            raise Unavailable(f"FlashInfer module {uri} did not compile for sm_90a ({status})")


def build_case(spec: KernelSpec, shape: BenchShape, batch: int, window: int, cursor,
               sets: int, device, seed: int = 0, peers_dir: Path = Path(".peers"),
               act: torch.dtype = ACT, knobs: dict | None = None) -> Case:
    """The buffers of `sets` independent inputs for one kernel (activations `x, B, C, y` and the
    rings in `act`), and its launcher; `knobs`: the CuTe non-flush kernel's tuning knobs."""
    if window > spec.max_window:
        raise Unavailable(f"{spec.name} supports windows up to {spec.max_window}, got {window}")
    gen = torch.Generator(device=device).manual_seed(seed)
    bufs = Buffers(sets, device, gen, act)
    params = _params(shape, device, gen)
    if spec.impl == "cute":
        return _build_cute(spec, shape, batch, window, cursor, bufs, params, knobs)
    if spec.impl == "emulation":
        return _build_emulation(spec, shape, batch, window, cursor, bufs, params)
    if spec.impl == "vllm":
        return _peer_vllm_build(spec, shape, batch, window, cursor, bufs, params, peers_dir)
    return _peer_flashinfer_build(spec, shape, batch, window, cursor, bufs, params, peers_dir)


def _launcher(case: Case, i: int):
    t = case.bufs.at(i)
    t["set"] = i
    return lambda: case.launch(t)


# --------------------------------------------------------------------------------------------
# Reference check
# --------------------------------------------------------------------------------------------

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(lo: dict, fmt: str) -> torch.Tensor:
    """The read copy's values in fp64 (cache layout of DESIGN.md)."""
    if fmt == "nvfp4":
        codes = lo["codes"].long()
        lut = torch.tensor(_E2M1, dtype=torch.float64, device=codes.device)
        values = torch.stack((lut[codes & 15], lut[codes >> 4]), dim=-1).flatten(-2)
        scales = lo["scales"].view(torch.float8_e4m3fn).double()
        values = values.unflatten(-1, (-1, 16)) * scales[..., None]
        return values.flatten(-2) * lo["global_scale"].double()[..., None, None]
    if fmt == "fp8_e4m3":
        return lo["codes"].view(torch.float8_e4m3fn).double()
    return lo["values"].double()


def _ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    ratio = (err / bound).nan_to_num(nan=math.inf)
    return float(ratio.max()) if ratio.numel() else 0.0


def _output_ratio(y: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> float:
    return _ratio((y.double() - ref).abs(), 2.0**-7 * (ref.abs() + mag) + 1e-30)


def _lo_ratio(lo: dict, fmt: str, ref: torch.Tensor) -> float:
    got = dequantize(lo, fmt)
    err = (got - ref).abs()
    if fmt == "nvfp4":
        amax = ref.abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
        bound = (0.25 * amax).expand(*amax.shape[:-1], 16).flatten(-2) + 1e-30
    elif fmt == "fp8_e4m3":
        bound = 2.0**-3 * ref.abs() + 2.0**-9
    else:
        bound = 2.0**-7 * ref.abs() + 2.0**-14
    return _ratio(err, bound)


def check_kernel(spec: KernelSpec | str, shape: BenchShape, window: int, device,
                 peers_dir: Path = Path(".peers"), seed: int = 7, act: torch.dtype = ACT,
                 knobs: dict | None = None) -> float:
    """Run `spec` once on 3 slots at different cursors and return the largest error over its
    bound (module docstring, **Correctness first**); raises `Unavailable` if it cannot run."""
    from lowprec.mamba2 import (
        mamba2_process_dt,
        mamba2_replay_flush,
        mamba2_replay_output,
        mamba2_step,
    )

    spec = KERNELS[spec] if isinstance(spec, str) else spec
    if spec.step == "nonflush":
        lo_c, hi_c = spec.first_cursor, window - 2 + spec.first_cursor
        cursors = [lo_c, (lo_c + hi_c) // 2, hi_c]
    else:
        cursors = [spec.cursors(window)[0]] * 3
    case = build_case(spec, shape, 3, window, cursors, 1, device, seed, peers_dir, act, knobs)
    t = case.bufs.at(0)
    before = {k: v.clone() for k, v in t.items()}
    t["out"].fill_(float("nan"))
    _launcher(case, 0)()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

    f64 = {k: v.double() for k, v in before.items() if v.is_floating_point()}
    A, D, bias = (case.params[k].double() for k in ("A", "D", "dt_bias"))
    x, C = f64["x"], f64["C"]
    dt = mamba2_process_dt(f64["dt"], bias)
    if spec.step == "update":
        state = f64["state"]
        y, new = mamba2_step(state, x, f64["dt"], A, f64["B"], C, D, None, bias)
        mag, new_mag = mamba2_step(state.abs(), x.abs(), f64["dt"], A, f64["B"].abs(), C.abs(),
                                   D.abs(), None, bias)
        ratios = [_output_ratio(t["out"], y, mag),
                  _output_ratio(t["state"], new, new_mag)]
        return max(ratios)

    count = torch.tensor(cursors, device=x.device)
    rows = torch.arange(3, device=x.device)
    ring_x, ring_dt, ring_B = f64["ring_x"].clone(), f64["ring_dt"].clone(), f64["ring_B"].clone()
    ring_x[rows, :, count] = x
    ring_dt[rows, :, count] = dt
    ring_B[rows, :, count] = f64["B"]
    if spec.step == "nonflush":
        if spec.impl in ("cute", "emulation"):
            fmt = "fp32" if spec.impl == "emulation" else spec.variant
            state = dequantize(_lo_dict(before), fmt)
        else:
            state = f64["state"]
    else:
        state = f64["hi"] if "hi" in f64 else f64["state"]
    args = (ring_x, ring_dt, ring_B, count + 1, C, x, A, D)
    y = mamba2_replay_output(state, *args)
    mag = mamba2_replay_output(state.abs(), ring_x.abs(), ring_dt, ring_B.abs(), count + 1,
                               C.abs(), x.abs(), A, D.abs())
    ratios = [_output_ratio(t["out"], y, mag)]
    if spec.step == "flush":
        # FlashInfer folds only the records held before the step (its token stays in the ring)
        folded = count + (0 if spec.impl == "flashinfer" else 1)
        new = mamba2_replay_flush(state, ring_x, ring_dt, ring_B, folded, A)
        new_mag = mamba2_replay_flush(state.abs(), ring_x.abs(), ring_dt, ring_B.abs(), folded, A)
        written = t["hi"] if "hi" in t else t["state"]
        ratios.append(_output_ratio(written, new, new_mag))
        if len(spec.writes) > 1:
            ratios.append(_lo_ratio(_lo_dict(t), spec.writes[1], new))
    return max(ratios)


# --------------------------------------------------------------------------------------------
# Timing and ceilings
# --------------------------------------------------------------------------------------------


def _event_time_ms(fn, lead_cycles: int = LEAD_CYCLES) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if lead_cycles:
        torch.cuda._sleep(lead_cycles)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure_ceilings(nbytes: int = 2**30, warm_s: float = 1.0, reps: int = 20,
                     lead_cycles: int = LEAD_CYCLES) -> dict:
    """Warm the card for `warm_s`, then (copy GB/s counting bytes read + written, streaming-read
    GB/s) on `nbytes` buffers, each timed region behind a `lead_cycles` spin."""
    src = torch.rand(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    deadline = time.perf_counter() + warm_s
    while time.perf_counter() < deadline:
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()
    copy_ms = statistics.median(_event_time_ms(lambda: dst.copy_(src), lead_cycles)
                                for _ in range(reps))
    note = ""
    try:
        from experiments._stream_read import stream_read

        props = torch.cuda.get_device_properties(0)
        partial = torch.empty(props.multi_processor_count * 8, device="cuda")
        stream_read(src, partial)
        read_ms = statistics.median(
            _event_time_ms(lambda: stream_read(src, partial), lead_cycles) for _ in range(reps))
    except Exception as error:  # Triton missing or failing: fall back to a torch reduction
        note = f"streaming read by torch.sum ({type(error).__name__})"
        read_ms = statistics.median(_event_time_ms(lambda: src.sum(), lead_cycles)
                                    for _ in range(reps))
    return dict(copy_gbps=2 * nbytes / copy_ms / 1e6, read_gbps=nbytes / read_ms / 1e6,
                note=note)


def time_case(case: Case, reps: int, lead_cycles: int = LEAD_CYCLES,
              warm_replays: int = WARM_REPLAYS) -> tuple[list[float], str]:
    """Per-launch microseconds of `reps` replays of one launch per set (each replay behind a
    `lead_cycles` spin, after `warm_replays` untimed ones), and the method."""
    launches = [_launcher(case, i) for i in range(case.bufs.sets)]
    return time_launches(launches, case.reset or (lambda: None), reps, lead_cycles, warm_replays)


def time_launches(launches: list, reset, reps: int, lead_cycles: int = LEAD_CYCLES,
                  warm_replays: int = WARM_REPLAYS, streams: int = 1) -> tuple[list[float], str]:
    """Per-launch microseconds of `reps` replays of `launches` (one per rotating buffer set),
    captured in one CUDA graph (eager launches where capture fails), `reset()` before each
    replay outside the timed region, `warm_replays` replays first untimed; and the method.
    With `streams` > 1, launch i goes on side stream i % `streams`: the side streams fork from
    the current stream and join it again, inside the timed region, so consecutive launches may
    overlap (`experiments.tail_overlap`)."""
    side = [torch.cuda.Stream() for _ in range(streams)] if streams > 1 else []

    def eager():
        main = torch.cuda.current_stream() if side else None
        for stream in side:
            stream.wait_stream(main)
        for i, launch in enumerate(launches):
            if side:
                with torch.cuda.stream(side[i % streams]):
                    launch()
            else:
                launch()
        for stream in side:
            main.wait_stream(stream)

    reset()
    eager()
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        reset()
        with torch.cuda.stream(stream):
            eager()
        torch.cuda.current_stream().wait_stream(stream)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        run_once, method = graph.replay, "graph"
    except Exception:  # not capturable (a host sync in the launcher): time eager launches
        torch.cuda.synchronize()
        run_once, method = eager, "events"
    times = []
    for rep in range(reps + warm_replays):
        reset()
        elapsed = _event_time_ms(run_once, lead_cycles) * 1e3 / len(launches)
        if rep >= warm_replays:
            times.append(elapsed)
    return times, method


SETTLING = 1.02  # the timed replays' first half this much slower than their second: flagged


def settling_note(times: list[float]) -> str:
    """A note for the CSV if the timed replays were still settling (their first half's median
    more than `SETTLING` x the second half's: the warm-up was too short on this machine; the
    longest transient seen was 26 replays, `experiments.warm_transient`), else ''."""
    half = len(times) // 2
    if half < 2:
        return ""
    early, late = statistics.median(times[:half]), statistics.median(times[half:])
    if early > SETTLING * late:
        return f"still settling: the first {half} timed replays {early / late - 1:.1%} slower"
    return ""


def sets_for(call_bytes: int, l2_bytes: int, multiple: float, max_sets: int = 1024) -> int:
    """Buffer sets so that one rotation of calls (each moving `call_bytes`) touches at least
    `multiple` x the L2; 4 at least, so a replay never times a single launch."""
    return int(min(max(4, math.ceil(multiple * l2_bytes / max(call_bytes, 1))), max_sets))


# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------


REDUCED_BATCHES = (256, 1, 32, 512)


def plan(config: BenchConfig) -> list[tuple]:
    """The points to measure, most important first: (tier, kernel, shape, window, batch,
    cursor). Tier 0 is the headline (first shape, L = 16, batch 256); 1 the first shape's other
    batches at L = 16; 2 the other shapes at L = 16 and 3 the other windows, both at the batches
    of `REDUCED_BATCHES`; 4 the rest of the grid. Within a tier the headline cursors come before
    the ones only the window numbers use, batch 256 and batch 1 (a target is set there) first."""
    headline_window = HEADLINE_WINDOW if HEADLINE_WINDOW in config.windows else config.windows[0]
    batch_order = sorted(config.batches, key=lambda b: (b != HEADLINE_BATCH, b != 1, -b))
    points = []
    for s_idx, shape in enumerate(config.shapes):
        for window in config.windows:
            for b_idx, batch in enumerate(batch_order):
                if s_idx == 0 and window == headline_window:
                    tier = 0 if batch == HEADLINE_BATCH else 1
                elif batch in REDUCED_BATCHES:
                    tier = 2 if window == headline_window else 3
                else:
                    tier = 4
                for kernel in config.all_kernels():
                    for c_idx, cursor in enumerate(KERNELS[kernel].cursors(window)):
                        key = (tier, min(c_idx, 1), s_idx, window != headline_window, window,
                               b_idx)
                        points.append((key, (tier, kernel, shape, window, batch, cursor)))
    points.sort(key=lambda p: p[0])
    return [p[1] for p in points]


def _row(config, spec, shape, batch, window, cursor, ceilings, **values) -> dict:
    row = dict(run=config.run_label, kernel=spec.name, impl=spec.impl, step=spec.step,
               scheme="", shape=shape, batch=batch, window=window, cursor=cursor,
               time_us=math.nan, time_us_p10=math.nan, time_us_p90=math.nan,
               bytes=kernel_bytes(spec, SHAPES[shape], batch, cursor), gbps=math.nan,
               frac_copy=math.nan, frac_read=math.nan, copy_gbps=ceilings["copy_gbps"],
               read_gbps=ceilings["read_gbps"], check=math.nan, status="ok", sets=0,
               timing="", note="")
    row.update(values)
    if row["time_us"] == row["time_us"]:
        row["gbps"] = row["bytes"] / row["time_us"] / 1e3
        row["frac_copy"] = row["gbps"] / row["copy_gbps"]
        row["frac_read"] = row["gbps"] / row["read_gbps"]
    return row


def _reason(error: BaseException, with_type: bool = True) -> str:
    """An exception as one short line (CSV cells and logs)."""
    text = " ".join(str(error).split())
    text = f"{type(error).__name__}: {text}" if with_type else text
    return text if len(text) <= 300 else text[:297] + "..."


def run(config: BenchConfig, log=print) -> pd.DataFrame:
    """Measure every planned point (correctness-checked first), write the tidy CSV to
    `config.out` and return it, token rows included. The rows so far are also written there
    every ~10 s, so a call killed at its time limit still leaves its measurements."""
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("kernel_bench: needs a CUDA GPU (torch.cuda.is_available() is False); "
                           "on a CPU machine use --plot-only or --merge")
    start = time.perf_counter()
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(lead_cycles=config.lead_cycles)
    log(f"copy {ceilings['copy_gbps']:,.0f} GB/s (read + write), streaming read "
        f"{ceilings['read_gbps']:,.0f} GB/s {ceilings['note']}")
    l2 = (torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda"
          else 50 * 2**20)
    checks: dict[tuple, tuple[float, str]] = {}
    rows = []
    peers_dir = Path(config.peers_dir)
    saved = time.perf_counter()
    for tier, kernel, shape_name, window, batch, cursor in plan(config):
        if time.perf_counter() - saved > 10.0:
            pd.DataFrame(rows, columns=COLUMNS).to_csv(out, index=False)
            saved = time.perf_counter()
        spec, shape = KERNELS[kernel], SHAPES[shape_name]
        point = (config, spec, shape_name, batch, window, cursor, ceilings)
        if config.budget_s is not None and time.perf_counter() - start > config.budget_s:
            rows.append(_row(*point, status=f"skipped: budget {config.budget_s:.0f} s spent",
                             note=f"tier {tier}"))
            continue
        key = (kernel, shape_name, window)
        if key not in checks:
            try:
                ratio = check_kernel(spec, shape, window, device, peers_dir, seed=config.seed,
                                     act=ACT_DTYPES[config.act], knobs=config.nonflush_knobs)
                checks[key] = (ratio, "ok" if ratio <= 1.0 else "check failed: not timed")
            except Unavailable as error:
                checks[key] = (math.nan, f"unavailable: {_reason(error, False)}")
            except Exception as error:  # a kernel that raises is reported, the run goes on
                checks[key] = (math.nan, f"error: {_reason(error)}")
            ratio, status = checks[key]
            log(f"check {kernel:28s} {shape_name:16s} L={window:<3d} {ratio:8.3g}  {status}")
        ratio, status = checks[key]
        if status != "ok":
            rows.append(_row(*point, check=ratio, status=status))
            continue
        try:
            sets = sets_for(kernel_bytes(spec, shape, batch, cursor), l2, config.l2_multiple)
            case = build_case(spec, shape, batch, window, cursor, sets, device, config.seed,
                              peers_dir, ACT_DTYPES[config.act], config.nonflush_knobs)
            times, method = time_case(case, config.reps, config.lead_cycles,
                                      config.warm_replays)
            del case
        except Exception as error:  # out of memory, a launch failure: record and go on
            rows.append(_row(*point, check=ratio, status=f"error: {_reason(error)}"))
            torch.cuda.empty_cache()
            continue
        q = np.quantile(times, [0.1, 0.5, 0.9])
        row = _row(*point, time_us=float(q[1]), time_us_p10=float(q[0]),
                   time_us_p90=float(q[2]), check=ratio, sets=sets, timing=method,
                   note=settling_note(times))
        rows.append(row)
        log(f"{kernel:28s} {shape_name:16s} L={window:<3d} b={batch:<4d} c={cursor:<3d} "
            f"{row['time_us']:10.2f} us {row['gbps']:8.0f} GB/s {row['frac_copy']:6.1%}")
        torch.cuda.empty_cache()
    frame = pd.DataFrame(rows, columns=COLUMNS)
    config.extra["ceilings_start"] = ceilings
    try:  # the copy ceiling again, to see whether the card's state moved during the run
        config.extra["ceilings_end"] = measure_ceilings(warm_s=0.0,
                                                         lead_cycles=config.lead_cycles)
    except Exception as error:  # a sticky CUDA error from a kernel: keep what was measured
        config.extra["ceilings_end"] = {"error": _reason(error)}
    config.extra["seconds"] = round(time.perf_counter() - start, 1)
    frame = with_token_rows(frame)
    frame.to_csv(out, index=False)
    return frame


# --------------------------------------------------------------------------------------------
# Derived rows: cost per committed token, speedups
# --------------------------------------------------------------------------------------------


def _mean_interpolated(cursors, times, lo: int, hi: int) -> float:
    """Mean over the integer cursors lo..hi of the piecewise-linear interpolation of `times`
    measured at `cursors` (constant beyond the measured ends)."""
    order = np.argsort(cursors)
    xs, ys = np.asarray(cursors)[order], np.asarray(times)[order]
    return float(np.mean(np.interp(np.arange(lo, hi + 1), xs, ys)))


def token_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One `step = token` row per scheme x run x shape x batch x window whose kernels were all
    timed (module docstring, **Per committed token**)."""
    measured = frame[(frame["step"] != "token") & (frame["status"] == "ok")]
    rows = []
    for scheme, kernels in SCHEMES.items():
        parts = measured[measured["kernel"].isin(kernels)]
        for (run_label, shape, batch, window), group in parts.groupby(
                ["run", "shape", "batch", "window"]):
            if set(group["kernel"]) != set(kernels):
                continue
            shape_obj = SHAPES[shape]
            spec0 = KERNELS[kernels[0]]
            if spec0.step == "update":
                r = group.iloc[0]
                times = (r["time_us"], r["time_us_p10"], r["time_us_p90"])
                total_bytes, note = float(r["bytes"]), "one update per token"
            else:
                nonflush, flush = (group[group["kernel"] == k] for k in kernels)
                lo, hi = spec0.first_cursor, window - 2 + spec0.first_cursor
                means = [_mean_interpolated(nonflush["cursor"], nonflush[col], lo, hi)
                         for col in ("time_us", "time_us_p10", "time_us_p90")]
                f = flush.iloc[0]
                times = tuple(((window - 1) * m + f[col]) / window for m, col in
                              zip(means, ("time_us", "time_us_p10", "time_us_p90"), strict=True))
                total_bytes = (sum(kernel_bytes(kernels[0], shape_obj, batch, c)
                                   for c in range(lo, hi + 1))
                               + kernel_bytes(kernels[1], shape_obj, batch, int(f["cursor"])))
                total_bytes /= window
                note = f"non-flush cursors timed: {sorted(nonflush['cursor'].astype(int))}"
            first = group.iloc[0]
            gbps = total_bytes / times[0] / 1e3
            rows.append(dict(
                run=run_label, kernel=f"{spec0.impl}:token:{scheme}", impl=spec0.impl,
                step="token", scheme=scheme, shape=shape, batch=batch, window=window, cursor=-1,
                time_us=times[0], time_us_p10=times[1], time_us_p90=times[2], bytes=total_bytes,
                gbps=gbps, frac_copy=gbps / first["copy_gbps"], frac_read=gbps / first["read_gbps"],
                copy_gbps=first["copy_gbps"], read_gbps=first["read_gbps"],
                check=group["check"].max(), status="ok", sets=int(group["sets"].min()),
                timing=",".join(sorted(set(group["timing"]))), note=note,
            ))
    return pd.DataFrame(rows, columns=COLUMNS)


def with_token_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` without its token rows, then the token rows recomputed from it."""
    base = frame[frame["step"] != "token"]
    tokens = token_rows(base)
    return pd.concat([base, tokens], ignore_index=True) if len(tokens) else base.reset_index(
        drop=True)


def _headline_time(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    """Per (run, shape, batch, window): the time of a scheme's token row, or of a kernel at its
    headline cursor (L/2 for non-flush steps)."""
    ok = frame[frame["status"] == "ok"]
    if name in SCHEMES:
        sel = ok[(ok["step"] == "token") & (ok["scheme"] == name)]
    else:
        sel = ok[ok["kernel"] == name]
        spec = KERNELS[name]
        headline = sel["window"].map(lambda w: spec.cursors(int(w))[0])
        sel = sel[sel["cursor"] == headline]
    return sel[["run", "shape", "batch", "window", "time_us"]]


def speedups(frame: pd.DataFrame) -> pd.DataFrame:
    """Every comparison of `COMPARISONS` at every (shape, batch, window) where both sides were
    timed; a pair from two runs (two machines' calls) is marked `same_run = False`."""
    keys = ["shape", "batch", "window"]
    rows = []
    for label, numerator, denominator, target in COMPARISONS:
        num, den = _headline_time(frame, numerator), _headline_time(frame, denominator)
        if num.empty or den.empty:
            continue
        merged = num.merge(den, on=keys, suffixes=("_num", "_den"))
        for _, r in merged.iterrows():
            rows.append(dict(comparison=label, numerator=numerator, denominator=denominator,
                             shape=r["shape"], batch=int(r["batch"]), window=int(r["window"]),
                             speedup=r["time_us_num"] / r["time_us_den"],
                             same_run=r["run_num"] == r["run_den"], run_num=r["run_num"],
                             run_den=r["run_den"], target=target))
    frame = pd.DataFrame(rows, columns=["comparison", "numerator", "denominator", "shape",
                                        "batch", "window", "speedup", "same_run", "run_num",
                                        "run_den", "target"])
    # one value per comparison and point: a same-run pair if there is one, then the first
    # run by label (as `_primary` draws kernels), whatever order the CSVs were merged in
    frame = frame.sort_values(["same_run", "run_num", "run_den"], ascending=[False, True, True],
                              kind="stable")
    return frame.drop_duplicates(["comparison", "shape", "batch", "window"]).sort_values(
        ["comparison", "shape", "window", "batch"]).reset_index(drop=True)


def summarize(frame: pd.DataFrame, shape: str = "nemotron3-super", batch: int = HEADLINE_BATCH,
              window: int = HEADLINE_WINDOW) -> pd.DataFrame:
    """The issue's targets at the headline point: (target, achieved, goal, met, run). Where
    several runs timed a point, the value comes from the first run by label (a same-run pair
    first, for a ratio), as the plots draw it; `run` names it ("A", or "A/B" for a pair of
    two runs)."""
    ok = frame[frame["status"] == "ok"]
    rows = []
    nf = ok[(ok["kernel"] == "cute:nonflush:nvfp4") & (ok["shape"] == shape)
            & (ok["batch"] == batch) & (ok["window"] == window)
            & (ok["cursor"] == KERNELS["cute:nonflush:nvfp4"].cursors(window)[0])]
    nf = nf.sort_values("run", kind="stable")
    frac = float(nf["frac_copy"].iloc[0]) if len(nf) else math.nan
    rows.append(("two-precision non-flush, fraction of copy bandwidth", frac, 0.85,
                 nf["run"].iloc[0] if len(nf) else ""))
    sp = speedups(frame)
    point = sp[(sp["shape"] == shape) & (sp["window"] == window)]

    def pick(sel):
        if not len(sel):
            return math.nan, ""
        r = sel.iloc[0]
        run = r["run_num"] if r["run_num"] == r["run_den"] else f"{r['run_num']}/{r['run_den']}"
        return float(r["speedup"]), run

    for label, _, _, target in COMPARISONS:
        if target is None:
            continue
        sel = point[(point["comparison"] == label) & (point["batch"] == batch)]
        speedup, run = pick(sel)
        rows.append((f"{label} (batch {batch})", speedup, target, run))
    sel = point[(point["comparison"] == "token: two-precision vs conventional fp32")
                & (point["batch"] == 1)]
    speedup, run = pick(sel)
    rows.append(("token: two-precision vs conventional fp32 (batch 1)", speedup, 1.0, run))
    out = pd.DataFrame(rows, columns=["target", "achieved", "goal", "run"])
    out["met"] = out["achieved"] >= out["goal"]
    return out[["target", "achieved", "goal", "met", "run"]]


def format_summary(frame: pd.DataFrame, shape: str = "nemotron3-super") -> str:
    """The summary printed last: targets, then cost per token of every scheme at L = 16."""
    lines = [f"targets ({shape}, batch {HEADLINE_BATCH}, L = {HEADLINE_WINDOW}):"]
    for _, r in summarize(frame, shape).iterrows():
        verdict = "n/a" if r["achieved"] != r["achieved"] else ("met" if r["met"] else "MISSED")
        run = f"  (run {r['run']})" if r["run"] else ""
        lines.append(f"  {r['target']:<62s} {r['achieved']:8.3f}  goal {r['goal']:<5g} "
                     f"{verdict}{run}")
    tokens = frame[(frame["step"] == "token") & (frame["shape"] == shape)
                   & (frame["window"] == HEADLINE_WINDOW)]
    if len(tokens):
        table = tokens.pivot_table(index="scheme", columns="batch", values="time_us",
                                   aggfunc="min")
        lines.append(f"us per committed token ({shape}, L = {HEADLINE_WINDOW}):")
        lines.append(table.to_string(float_format=lambda v: f"{v:.2f}"))
    skipped = frame["status"].str.startswith("skipped")
    if skipped.any():
        lines.append(f"  {int(skipped.sum())} points skipped by the time budget "
                     f"({', '.join(sorted(set(frame.loc[skipped, 'note'])))})")
    problems = frame[(frame["status"] != "ok") & ~skipped].drop_duplicates(["kernel", "status"])
    for _, r in problems.iterrows():
        lines.append(f"  not timed: {r['kernel']}: {r['status'][:160]}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Plots (from the CSV only)
# --------------------------------------------------------------------------------------------


_TEXT_COLUMNS = ("run", "kernel", "impl", "step", "scheme", "shape", "status", "timing", "note")


def read_csv(path: str | Path) -> pd.DataFrame:
    """A CSV written by `run` / `--merge` (text columns stay text, empty cells empty)."""
    frame = pd.read_csv(path, dtype={c: str for c in _TEXT_COLUMNS}, keep_default_na=False,
                        na_values={c: ["nan", "NaN", ""] for c in COLUMNS
                                   if c not in _TEXT_COLUMNS})
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"csv: expected the columns {COLUMNS}, missing {missing}")
    return frame


def _primary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point: a kernel timed in several runs (anchors timed again in a
    second call) is drawn from the first run that timed it."""
    ok = frame[frame["status"] == "ok"].sort_values("run", kind="stable")
    return ok.drop_duplicates(["kernel", "scheme", "shape", "batch", "window", "cursor"])


def _batch_ticks(ax, batches) -> None:
    """The measured batch sizes as plain tick labels on a log axis (not 10^0, 10^1, ...)."""
    import matplotlib.ticker

    values = sorted({int(b) for b in batches}) or [1]
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(values))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def plot(csv: str | Path, outdir: str | Path) -> list[Path]:
    """Three PNGs from the CSV at `csv` into `outdir`: time and fraction of the copy bandwidth
    against batch, speedups against batch, and the per-format / per-scheme curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    frame = with_token_rows(read_csv(csv))
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = Path(Path(csv).name.removesuffix(".gz")).stem
    ok = _primary(frame)
    shapes = list(dict.fromkeys(ok["shape"])) or list(dict.fromkeys(frame["shape"]))
    window = HEADLINE_WINDOW if (ok["window"] == HEADLINE_WINDOW).any() else (
        int(ok["window"].min()) if len(ok) else HEADLINE_WINDOW)
    paths = []

    def headline(sel):
        keep = [KERNELS[k].cursors(int(w))[0] == c if k in KERNELS else True
                for k, w, c in zip(sel["kernel"], sel["window"], sel["cursor"], strict=True)]
        return sel[keep]

    fig, axes = plt.subplots(2, max(len(shapes), 1), figsize=(7 * max(len(shapes), 1), 9),
                             squeeze=False)
    for ax in axes.flat:  # 15 or so kernels: 20 colours, so no two share one
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for col, shape in enumerate(shapes):
        sel = headline(ok[(ok["shape"] == shape) & (ok["window"] == window)
                          & (ok["step"] != "token")])
        for kernel, g in sel.groupby("kernel"):
            g = g.sort_values("batch")
            style = "-" if kernel.startswith("cute") else "--"
            axes[0, col].plot(g["batch"], g["time_us"], style, marker="o", ms=3, label=kernel)
            axes[1, col].plot(g["batch"], g["frac_copy"], style, marker="o", ms=3, label=kernel)
        axes[0, col].set(xscale="log", yscale="log", xlabel="batch", ylabel="median time (us)",
                         title=f"{shape}, L = {window} (non-flush at cursor L/2)")
        axes[1, col].set(xscale="log", xlabel="batch", ylabel="fraction of copy bandwidth")
        axes[1, col].axhline(0.85, color="gray", lw=0.8, ls=":")
        axes[0, col].legend(fontsize=6, ncol=2)
    for ax in axes.flat:
        _batch_ticks(ax, ok["batch"])
    fig.tight_layout()
    paths.append(outdir / f"{stem}_time.png")
    save_small_png(fig, paths[-1])
    plt.close(fig)

    sp = speedups(frame)
    targeted = {label for label, _, _, target in COMPARISONS if target is not None}
    fig, axes = plt.subplots(2, max(len(shapes), 1), figsize=(7.5 * max(len(shapes), 1), 12),
                             squeeze=False, gridspec_kw={"height_ratios": [1, 1.35]})
    for col, shape in enumerate(shapes):
        sel = sp[(sp["shape"] == shape) & (sp["window"] == window)]
        for row, keep in enumerate((True, False)):
            ax = axes[row, col]
            # the targets on top (tab10, each with its dotted goal), everything else
            # below (tab20: no two comparisons share a colour)
            ax.set_prop_cycle(color=plt.cm.tab10.colors if keep else plt.cm.tab20.colors)
            part = sel[sel["comparison"].isin(targeted) == keep]
            for label, g in part.groupby("comparison", sort=False):
                g = g.sort_values("batch")
                line = ax.plot(g["batch"], g["speedup"], marker="o", ms=3, label=label)[0]
                target = g["target"].dropna()
                if len(target):
                    ax.axhline(float(target.iloc[0]), color=line.get_color(), lw=0.9, ls=":")
            ax.axhline(1.0, color="black", lw=0.6)
            ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="speedup (x)")
            ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(
                [0.125, 0.25, 0.5, 1, 2, 4, 8, 16]))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(True, which="major", lw=0.3, alpha=0.5)
            ax.set_title(f"{shape}, L = {window}: " + (
                "the issue's targets (dotted: goal at batch 256)" if keep
                else "the other comparisons"), fontsize=10)
            if len(part) and keep:
                ax.legend(fontsize=7, loc="upper left", framealpha=0.85)
            elif len(part):  # a dozen entries: below the axes, clear of the lines
                ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    for ax in axes.flat:
        _batch_ticks(ax, ok["batch"])
    fig.tight_layout()
    paths.append(outdir / f"{stem}_speedup.png")
    save_small_png(fig, paths[-1])
    plt.close(fig)

    fig, axes = plt.subplots(2, max(len(shapes), 1), figsize=(7 * max(len(shapes), 1), 9),
                             squeeze=False)
    for col, shape in enumerate(shapes):
        sel = headline(ok[(ok["shape"] == shape) & (ok["window"] == window)
                          & ok["kernel"].str.startswith("cute:nonflush")])
        for kernel, g in sel.groupby("kernel"):
            g = g.sort_values("batch")
            axes[0, col].plot(g["batch"], g["gbps"], marker="o", ms=3,
                              label=kernel.split(":")[-1])
        if len(sel):
            axes[0, col].axhline(float(sel["copy_gbps"].max()), color="gray", lw=0.8, ls=":",
                                 label="copy")
        axes[0, col].set(xscale="log", xlabel="batch", ylabel="GB/s",
                         title=f"{shape}, L = {window}: non-flush step per read-copy format")
        axes[0, col].legend(fontsize=7)
        tokens = ok[(ok["shape"] == shape) & (ok["window"] == window) & (ok["step"] == "token")]
        axes[1, col].set_prop_cycle(color=plt.cm.tab20.colors)  # a dozen schemes
        for scheme, g in tokens.groupby("scheme"):
            g = g.sort_values("batch")
            axes[1, col].plot(g["batch"], g["time_us"], marker="o", ms=3, label=scheme)
        axes[1, col].set(xscale="log", yscale="log", xlabel="batch",
                         ylabel="us per committed token", title="cost per token by scheme")
        if len(tokens):
            axes[1, col].legend(fontsize=6, ncol=2)
    for ax in axes.flat:
        _batch_ticks(ax, ok["batch"])
    fig.tight_layout()
    paths.append(outdir / f"{stem}_formats.png")
    save_small_png(fig, paths[-1])
    plt.close(fig)
    return paths


# --------------------------------------------------------------------------------------------
# Entry points: profile, main
# --------------------------------------------------------------------------------------------


def profile(config: BenchConfig, kernel: str) -> int:
    """Launch `kernel` at the first shape, batch and window of `config` (headline cursor) on 4
    sets, warmed, with the CUDA profiler on only around one launch per set: the ncu reading of
    where its time goes (`ncu --profile-from-start off --clock-control none ...`)."""
    if not torch.cuda.is_available():
        print("kernel_bench: --profile needs a CUDA GPU", file=sys.stderr)
        return 2
    spec, shape = KERNELS[kernel], SHAPES[config.shapes[0]]
    window = config.windows[0]
    case = build_case(spec, shape, config.batches[0], window, spec.cursors(window)[0], 4,
                      torch.device("cuda"), config.seed, Path(config.peers_dir),
                      ACT_DTYPES[config.act], config.nonflush_knobs)
    launches = [_launcher(case, i) for i in range(case.bufs.sets)]
    reset = case.reset or (lambda: None)
    for _ in range(3):
        reset()
        for launch in launches:
            launch()
    reset()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    knobs = "".join(f", {k}={v}" for k, v in config.nonflush_knobs.items())
    print(f"profiled {kernel} at {shape.name}, batch {config.batches[0]}, L = {window}{knobs}",
          file=sys.stderr)
    return 0


def _versions() -> dict:
    versions = {"torch": torch.__version__}
    for name in ("triton", "cutlass", "pandas"):
        try:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "unknown")
        except Exception as error:  # a missing package is a fact worth recording
            versions[name] = f"absent ({type(error).__name__})"
    try:
        from importlib.metadata import version

        versions["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except Exception:
        versions["nvidia-cutlass-dsl"] = "unknown (not installed as a distribution)"
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name(0)
        versions["cuda"] = torch.version.cuda
        versions["gpu_identity"] = gpu_identity()
    return versions


GPU_IDENTITY_FIELDS = ("uuid", "serial", "pci.bus_id", "vbios_version", "driver_version",
                       "clocks.max.sm", "clocks.max.memory", "power.limit", "ecc.mode.current")


def gpu_identity(run=None) -> dict:
    """Which physical GPU ran (nvidia-smi's fields of GPU 0, GPU_IDENTITY_FIELDS), for the meta
    files: the H200 machines lent in one session (at least three) timed the same non-flush
    step at 55.9-59.4 us (batch 256, cursor 8) with equal clocks and copy ceilings within
    0.7% (results/README.md, "Nineteenth session"), so a number is only comparable with the
    machine it came from.
    ``run``: a subprocess.run stand-in (tests). Never raises: a failure is recorded."""
    import subprocess

    run = run or subprocess.run
    query = ["nvidia-smi", f"--query-gpu={','.join(GPU_IDENTITY_FIELDS)}",
             "--format=csv,noheader", "--id=0"]
    try:
        done = run(query, capture_output=True, text=True, timeout=20)
    except Exception as error:  # no nvidia-smi, or it hung
        return {"error": f"{type(error).__name__}: {error}"}
    values = [v.strip() for v in (done.stdout or "").strip().split(",")]
    if done.returncode != 0 or len(values) != len(GPU_IDENTITY_FIELDS):
        return {"error": f"nvidia-smi exit {done.returncode}: {(done.stderr or done.stdout)[:200]}"}
    return dict(zip(GPU_IDENTITY_FIELDS, values, strict=True))


def _finish(frame: pd.DataFrame, out: Path, plot_dir: str | None) -> None:
    if plot_dir:
        for path in plot(out, plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    print(format_summary(frame))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_kernels:
        for name, spec in KERNELS.items():
            print(f"{name:30s} {'default' if spec.default else 'optional'}")
        return 0
    try:
        config = config_from_args(args, argv)
    except ValueError as error:
        parser.error(str(error))
    out = Path(config.out)
    if is_folder(out):
        parser.error(f"--out: expected a CSV path, got the folder {out}")
    if config.plot_dir is not None and is_file(config.plot_dir):
        parser.error(f"--plot-dir: expected a folder or 'none', got the file {config.plot_dir}")
    if args.profile:
        if args.profile not in KERNELS:
            parser.error(f"--profile: expected a kernel name of --list-kernels, got "
                         f"{args.profile!r}")
        try:
            config.check_knob_values([args.profile])
        except ValueError as error:
            parser.error(str(error))
        return profile(config, args.profile)
    if args.merge:
        seen = {}  # a CSV given twice would have every row of it counted twice
        for path in args.merge:
            if Path(path).resolve() in seen:
                parser.error(f"--merge: the CSV {path} is given twice (also as "
                             f"{seen[Path(path).resolve()]})")
            seen[Path(path).resolve()] = path
        if args.out is None:  # the default would replace the committed headline CSV
            parser.error(f"--merge: name the merged CSV with --out (e.g. --out "
                         f"{BenchConfig.out} to replace the committed one)")
    if not args.plot_only:  # --merge and a run write --out
        problem = file_problem(out)
        if problem:
            parser.error(f"--out: cannot write {out}: {problem}")
    if config.plot_dir is not None and (problem := folder_problem(config.plot_dir)):
        parser.error(f"--plot-dir: {problem}")
    if args.plot_only or args.merge:
        sources = [args.plot_only] if args.plot_only else args.merge
        try:
            frames = [read_csv(path) for path in sources]
        except (OSError, ValueError) as error:
            parser.error(f"cannot read the CSVs: {error}")
        labels = {}  # the run column keeps merged runs apart: one label, one file
        for path, part in zip(sources, frames, strict=True):
            for label in part["run"].dropna().unique():
                if label in labels:
                    parser.error(f"--merge: run label {label!r} is in both {labels[label]} and "
                                 f"{path} (relabel one run's rows)")
                labels[label] = path
        frame = with_token_rows(pd.concat(frames, ignore_index=True))
        try:  # os.access (the checks above) says yes to root for paths it cannot write
            if args.merge:
                out.parent.mkdir(parents=True, exist_ok=True)
                frame.to_csv(out, index=False)
                print(f"wrote {out} ({len(frame)} rows)", file=sys.stderr)
            _finish(frame, out if args.merge else Path(args.plot_only), config.plot_dir)
        except OSError as error:
            parser.error(f"cannot write the results: {error}")
        return 0
    try:
        config.check_knob_values(config.kernels)
    except ValueError as error:
        parser.error(str(error))
    try:
        frame = run(config, log=lambda text: print(text, file=sys.stderr, flush=True))
    except RuntimeError as error:
        print(str(error), file=sys.stderr)
        return 2
    except OSError as error:  # the CSV is written as the run goes
        parser.error(f"cannot write the results: {error}")
    from experiments._common import write_meta

    settings = {k: v for k, v in asdict(replace(config, extra={})).items()}
    settings.update(config.extra)
    settings["versions"] = _versions()
    command = " ".join(["python -m experiments.kernel_bench", *map(shlex.quote, argv)])
    try:
        write_meta(out, command, config.extra.get("seconds", 0.0), settings, device="cuda")
        print(f"wrote {out} ({len(frame)} rows)", file=sys.stderr)
        _finish(frame, out, config.plot_dir)
    except OSError as error:
        parser.error(f"cannot write the results: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
