"""What the benchmark times: layer shapes, kernel specs, the bytes each kernel must move, the
buffers of the kit's kernels in their own layouts, and the fp64 check run before any timing.

**Shapes** are one recurrent layer each, and the shape decides the recurrence: a Mamba-2 shape
(`nemotron3-super`, `mamba2-2.7b`) builds the Mamba-2 kernels, a Gated DeltaNet shape
(`qwen3-next-80b`) the GDN kernels of the same name (`experiments.gdn_cases`). A kernel a
recurrence does not have is refused by name (`KernelSpec.check_shape`).

**Kernels** (names `impl:step:variant`; M: Mamba-2, G: Gated DeltaNet):

    cute:nonflush:<lo>        M: cute_kernels.replay_output, read copy lo in nvfp4, fp8_e4m3,
                              fp16, fp32 (fp32 = the single-copy FP32 ReplaySSM non-flush step);
                              G: gdn_replay_output, lo nvfp4 or fp32 (single copy)
    cute:flush:fp16sr+<lo>    M: replay_flush, recurrence copy fp16 SR, read copy lo;
                              G: gdn_replay_flush, fp16 SR + nvfp4
    cute:flush:fp32           M and G: hi fp32 and no read copy (single-copy FP32 ReplaySSM)
    cute:update:<fmt>         the conventional every-token step: M state_update, state fp32,
                              fp16 (RN) or fp16sr; G gdn_state_update, state fp32 or bf16
    cute:flush:fp16sr<k>r<R>+nvfp4, cute:update:fp16sr<k>r<R>
                              M: the same SR kernels with k random bits an element and R
                              Philox rounds (docs/design.md; `fp16sr` alone is the default,
                              k = 16, R = 7):
                              every k in (32, 16, 13, 8) with R in (10, 7, 4) (`SR_SETTINGS`),
                              e.g. cute:flush:fp16sr32r10+nvfp4; `sr_setting(variant)` parses
                              them. Schemes `two-precision-sr<k>r<R>` and
                              `conventional-fp16sr<k>r<R>` price a token with them
    emulation:nonflush:nvfp4  M: the Triton emulation (fp32 containers), optional
    vllm:..., flashinfer:...  the peers' kernels (`experiments.peers`)
    fla:...

Every kernel is timed in its default configuration: the cases build a `ReplayCache` (or a
`StateCache`, or their GDN twins) and call the public function, nothing else.

**Bytes** of a Mamba-2 kernel (Gated DeltaNet: `experiments.gdn_cases`) follow
`lowprec.traffic` (`state_bytes`, `record_bytes` in the kernel layout with bf16 activations)
plus the current token's inputs and output, per slot:

    state:    each copy read, each copy written, in its format (scales included)
    records:  `cursor` records read from the ring, the records appended (1; vLLM's flush: 0)
    token:    x and y (nheads * headdim * 2 B each), dt (nheads * 2 B; 4 B for fp32 dt),
              B and C (ngroups * dstate * 2 B each)

Not counted: A, D, dt_bias (per head, shared by all slots), cursor/flush counters, and scratch
the kernel chooses to keep (vLLM's `bc_pre`, FlashInfer's two-kernel scratch).

**Check** (`check_kernel`): each Mamba-2 kernel runs once on 3 slots at different cursors
against the `lowprec.mamba2` reference in fp64 (Gated DeltaNet: `lowprec.gdn`, with its own
bound, `experiments.gdn_cases`). Pass: every output within `2^-7 (|ref| + mag)` (`mag`: the
reference on absolute values; this admits bf16 rounding of the output and the peers' bf16
intermediates and rejects any wrong record, decay or scale), every written state within the
same bound (fp16/fp32 copies), the written read copy within its format's rounding (nvfp4: a
quarter of the block amax; fp8_e4m3: `2^-3 |S| + 2^-9`). The value is the largest error over
its bound (pass: <= 1).
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.harness import Buffers
from lowprec import models, philox, traffic

__all__ = [
    "BenchShape",
    "SHAPES",
    "KernelSpec",
    "KERNELS",
    "SCHEMES",
    "ACT",
    "ACT_DTYPES",
    "KIT_DT",
    "SR_SETTINGS",
    "sr_setting",
    "sr_variant",
    "Case",
    "Unavailable",
    "RECURRENCES",
    "PEER_IMPLS",
    "kernel_bytes",
    "token_bytes",
    "build_case",
    "check_kernel",
    "check_cursors",
    "dequantize",
    "bound_ratio",
    "lo_ratio",
]

ACT = torch.bfloat16
ACT_BYTES = 2
ACT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Raw dt of the kit's kernels: fp32 (cute_kernels.replay_output does not compile with a bf16
# dt: nvvm.load.ext has no bf16 form); the peers get the dtype they serve with.
KIT_DT = torch.float32
SEED = 12345  # the Philox seed of the SR kernels' caches
# SR settings (random bits an element, Philox rounds) timed besides the default (16, 7)
SR_SETTINGS = tuple((bits, rounds) for bits in (32, 16, 13, 8) for rounds in (10, 7, 4)
                    if (bits, rounds) != (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS))


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


RECURRENCES = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet"}


@dataclass(frozen=True)
class BenchShape:
    """One recurrent layer's decode shape (per sequence): `nheads` states of `headdim x dstate`.
    Mamba-2: heads of headdim x dstate, B and C shared by `ngroups`. Gated DeltaNet (`kind`
    'gdn'): value heads of d_v x d_k (headdim = d_v, dstate = d_k), q and k shared by the
    `ngroups` key heads."""

    name: str
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    source: str
    kind: str = "mamba2"

    def __post_init__(self):
        if self.kind not in RECURRENCES:
            raise ValueError(f"kind: expected one of {list(RECURRENCES)}, got {self.kind!r}")

    @property
    def ssm(self) -> models.SSMLayerShape:
        return models.SSMLayerShape(self.kind, self.nheads, self.headdim, self.dstate,
                                    self.ngroups)


def _model_layer(name: str, source: str) -> BenchShape:
    ssm = models.get(name).ssm
    return BenchShape(name, ssm.nheads, ssm.d_v, ssm.d_k, ssm.ngroups, source, ssm.kind)


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
        _model_layer(
            "qwen3-next-80b",
            "Qwen3-Next-80B-A3B Gated DeltaNet layer (lowprec.models): 32 value heads of "
            "d_v = d_k = 128, 16 key heads",
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
    window; `max_window`: the largest window the kernel supports; `default`: timed unless
    the kernels are named; `recurrences`: the shape kinds the kernel has a form for."""

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
    recurrences: tuple[str, ...] = ("mamba2",)

    @property
    def impl(self) -> str:
        return self.name.split(":")[0]

    @property
    def variant(self) -> str:
        return self.name.split(":")[2]

    @property
    def replay(self) -> bool:
        return self.step in ("nonflush", "flush")

    def check_shape(self, shape: BenchShape) -> None:
        """ValueError unless this kernel has a form for `shape`'s recurrence."""
        if shape.kind not in self.recurrences:
            has = " and ".join(RECURRENCES[r] for r in self.recurrences)
            others = [n for n, s in KERNELS.items() if shape.kind in s.recurrences]
            raise ValueError(
                f"kernel: {self.name} has no {RECURRENCES[shape.kind]} form (shape "
                f"{shape.name}; it is a {has} kernel); the {RECURRENCES[shape.kind]} kernels "
                f"are {', '.join(others)}")

    def cursors(self, window: int) -> tuple[int, ...]:
        """Cursors timed: the flush cursor, or L/2 first (the headline), then the ends of the
        non-flush range (for the window interpolation)."""
        if self.step == "update":
            return (0,)
        if self.step == "flush":
            return (window - 1 + self.first_cursor,)
        lo, hi = self.first_cursor, window - 2 + self.first_cursor
        return tuple(dict.fromkeys((max(window // 2, lo), lo, hi)))


DEFAULT_SR = (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)


def sr_variant(sr: tuple[int, int]) -> str:
    """The fp16 SR state's variant name: 'fp16sr' for the default setting (16, 7), else
    'fp16sr<k>r<R>' (32/10: 'fp16sr32r10')."""
    return "fp16sr" if tuple(sr) == DEFAULT_SR else f"fp16sr{sr[0]}r{sr[1]}"


def sr_setting(variant: str) -> tuple[int, int]:
    """(sr_bits, philox_rounds) of a CuTe kernel's variant ('fp16sr32r10+nvfp4' -> (32, 10);
    'fp16sr', 'fp16sr+nvfp4' and every variant without SR -> the default (16, 7))."""
    match = re.fullmatch(r"fp16sr(?:(\d+)r(\d+))?", variant.split("+")[0])
    if match is None or match[1] is None:
        return DEFAULT_SR
    return int(match[1]), int(match[2])


def _specs() -> dict[str, KernelSpec]:
    kit = dict(dt_bytes=KIT_DT.itemsize)
    both = dict(recurrences=("mamba2", "gdn"), **kit)
    gdn = ("gdn",)
    specs = [KernelSpec(f"cute:nonflush:{lo}", "nonflush", (lo,), records_written=1,
                        **(both if lo in ("nvfp4", "fp32") else kit))
             for lo in ("nvfp4", "fp8_e4m3", "fp16", "fp32")]
    specs += [
        KernelSpec("cute:flush:fp16sr+nvfp4", "flush", ("fp16",), ("fp16", "nvfp4"), 1, **both),
        KernelSpec("cute:flush:fp32", "flush", ("fp32",), ("fp32",), 1, **both),
        KernelSpec("cute:flush:fp16sr+fp8_e4m3", "flush", ("fp16",), ("fp16", "fp8_e4m3"), 1,
                   default=False, **kit),
        KernelSpec("cute:flush:fp16sr+fp16", "flush", ("fp16",), ("fp16", "fp16"), 1,
                   default=False, **kit),
        KernelSpec("cute:update:fp32", "update", ("fp32",), ("fp32",), **both),
        KernelSpec("cute:update:fp16", "update", ("fp16",), ("fp16",), **kit),
        KernelSpec("cute:update:fp16sr", "update", ("fp16",), ("fp16",), **kit),
        KernelSpec("cute:update:bf16", "update", ("bf16",), ("bf16",), recurrences=gdn),
        KernelSpec("emulation:nonflush:nvfp4", "nonflush", ("fp32",), records_written=1,
                   dt_bytes=4, default=False),
    ]
    for sr in SR_SETTINGS:
        specs += [
            KernelSpec(f"cute:flush:{sr_variant(sr)}+nvfp4", "flush", ("fp16",),
                       ("fp16", "nvfp4"), 1, default=False, **kit),
            KernelSpec(f"cute:update:{sr_variant(sr)}", "update", ("fp16",), ("fp16",),
                       default=False, **kit),
        ]
    for fmt in ("fp32", "fp16"):
        main = fmt == "fp32"
        specs += [
            KernelSpec(f"vllm:update:{fmt}", "update", (fmt,), (fmt,),
                       recurrences=("mamba2", "gdn") if main else ("mamba2",)),
            KernelSpec(f"vllm:nonflush:{fmt}", "nonflush", (fmt,), records_written=1,
                       default=main),
            KernelSpec(f"vllm:flush:{fmt}", "flush", (fmt,), (fmt,), 0, default=main),
            KernelSpec(f"flashinfer:update:{fmt}", "update", (fmt,), (fmt,), dt_bytes=4),
            KernelSpec(f"flashinfer:nonflush:{fmt}", "nonflush", (fmt,), records_written=1,
                       first_cursor=1, ring_extra=1, max_window=16, default=main),
            KernelSpec(f"flashinfer:flush:{fmt}", "flush", (fmt,), (fmt,), 1, first_cursor=1,
                       ring_extra=1, max_window=16, default=main),
        ]
    specs += [
        KernelSpec("vllm:update:bf16", "update", ("bf16",), ("bf16",), recurrences=gdn),
        KernelSpec("fla:update:fp32", "update", ("fp32",), ("fp32",), recurrences=gdn),
        # FLA's public function returns its final state in fp32 whatever the initial state's
        # dtype: a bf16 state is read in bf16 and written in fp32
        KernelSpec("fla:update:bf16", "update", ("bf16",), ("fp32",), recurrences=gdn),
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
    "conventional-bf16": ("cute:update:bf16",),
    "emulation-two-precision": ("emulation:nonflush:nvfp4", "cute:flush:fp16sr+nvfp4"),
    "vllm-replay-fp32": ("vllm:nonflush:fp32", "vllm:flush:fp32"),
    "vllm-replay-fp16": ("vllm:nonflush:fp16", "vllm:flush:fp16"),
    "vllm-conventional-fp32": ("vllm:update:fp32",),
    "vllm-conventional-fp16": ("vllm:update:fp16",),
    "vllm-conventional-bf16": ("vllm:update:bf16",),
    "flashinfer-replay-fp32": ("flashinfer:nonflush:fp32", "flashinfer:flush:fp32"),
    "flashinfer-replay-fp16": ("flashinfer:nonflush:fp16", "flashinfer:flush:fp16"),
    "flashinfer-conventional-fp32": ("flashinfer:update:fp32",),
    "flashinfer-conventional-fp16": ("flashinfer:update:fp16",),
    "fla-conventional-fp32": ("fla:update:fp32",),
    "fla-conventional-bf16": ("fla:update:bf16",),
}
PEER_IMPLS = ("vllm", "flashinfer", "fla")
for _sr in SR_SETTINGS:
    SCHEMES[f"two-precision-sr{_sr[0]}r{_sr[1]}"] = ("cute:nonflush:nvfp4",
                                                     f"cute:flush:{sr_variant(_sr)}+nvfp4")
    SCHEMES[f"conventional-{sr_variant(_sr)}"] = (f"cute:update:{sr_variant(_sr)}",)


# --------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------


def token_bytes(shape: BenchShape, dt_bytes: int = ACT_BYTES) -> int:
    """One slot's current-token traffic: x and y, dt per head, B and C per group."""
    return (2 * shape.nheads * shape.headdim * ACT_BYTES + shape.nheads * dt_bytes
            + 2 * shape.ngroups * shape.dstate * ACT_BYTES)


def kernel_bytes(spec: KernelSpec | str, shape: BenchShape, batch: int, cursor: int) -> int:
    """Bytes one call must move for `batch` slots at `cursor` (module docstring, **Bytes**;
    Gated DeltaNet: `gdn_cases.kernel_bytes`)."""
    spec = KERNELS[spec] if isinstance(spec, str) else spec
    spec.check_shape(shape)
    if shape.kind == "gdn":
        from experiments import gdn_cases

        return gdn_cases.kernel_bytes(spec, shape, batch, cursor)
    ssm = shape.ssm
    per_slot = sum(traffic.state_bytes(ssm, fmt) for fmt in spec.reads + spec.writes)
    if spec.replay:
        record = traffic.record_bytes(ssm, "kernel", "bf16")
        per_slot += record * (cursor + spec.records_written)
    return batch * (per_slot + token_bytes(shape, spec.dt_bytes))


# --------------------------------------------------------------------------------------------
# Cases: a kernel's buffers over rotating sets and its launcher
# --------------------------------------------------------------------------------------------


class Unavailable(RuntimeError):
    """A kernel that cannot run here; the message is the recorded reason."""


@dataclass
class Case:
    """A kernel's buffers and how to launch it on set `i` (`launch(t)` with `t` set i's
    tensors and `t["set"] = i`; a launch may put what it returns into `t`). `reset()` restores
    the counters the kernel advances. A Gated DeltaNet update also says how to read its own
    layout in `lowprec.gdn`'s (`gdn_cases.check_kernel`): `reference(t)` the step's inputs in
    fp64, (state [slots, nheads, dv, dk], q, k, v, g, beta), from set tensors `t` before the
    launch; `written(t)` what the launch wrote, (y [slots, nheads, dv], new state)."""

    spec: KernelSpec | None
    shape: BenchShape
    batch: int
    window: int
    bufs: Buffers
    params: dict
    launch: object
    reset: object = None
    reference: object = None
    written: object = None

    def launcher(self, i: int):
        """A no-argument function that launches on set `i` (capturable in a CUDA graph)."""
        t = self.bufs.at(i)
        t["set"] = i
        return lambda: self.launch(t)

    def launchers(self) -> list:
        return [self.launcher(i) for i in range(self.bufs.sets)]


def params(shape: BenchShape, device, gen: torch.Generator) -> dict:
    """Mamba-2: A < 0, D and dt_bias per head (fp32). Gated DeltaNet: A_log and dt_bias per
    value head (fp32; vLLM's decode gate is g = -exp(A_log) softplus(a + dt_bias))."""
    H = shape.nheads
    if shape.kind == "gdn":
        return dict(A_log=torch.log(torch.rand(H, generator=gen, device=device) + 0.5),
                    dt_bias=torch.randn(H, generator=gen, device=device) * 0.1)
    return dict(
        A=-(torch.rand(H, generator=gen, device=device) + 0.5),
        D=torch.randn(H, generator=gen, device=device),
        dt_bias=torch.randn(H, generator=gen, device=device) * 0.1,
    )


def token_buffers(b: Buffers, shape: BenchShape, batch: int, dt_dtype=None) -> None:
    """x, raw dt, B, C and the output y of the current token."""
    S, H, P, N, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    b.add("x", (S, H, P), b.act, "randn")
    b.add("dt", (S, H), dt_dtype or b.act, "dt_raw")
    b.add("B", (S, G, N), b.act, "randn")
    b.add("C", (S, G, N), b.act, "randn")
    b.add("out", (S, H, P), b.act, "empty")


def ring_buffers(b: Buffers, shape: BenchShape, batch: int, length: int) -> None:
    """The record ring of `length` positions: x and B in the activation dtype, processed dt."""
    S, H, P, N, G = batch, shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    b.add("ring_x", (S, H, length, P), b.act, "randn")
    b.add("ring_dt", (S, H, length), torch.float32, "dt_proc")
    b.add("ring_B", (S, G, length, N), b.act, "randn")


def counter(b: Buffers, name: str, batch: int, value) -> None:
    """An int32 counter per slot: one value for all, or one per slot."""
    views = b.add(name, (batch,), torch.int32, "const", 0)
    if isinstance(value, int):
        b.bases[name].fill_(value)
    else:
        for view in views:
            view.copy_(torch.tensor(value, dtype=torch.int32))


def state_dtype(fmt: str) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[fmt]


def lo_buffers(b: Buffers, shape: BenchShape, batch: int, fmt: str, prefix: str = "") -> None:
    """The read copy in the cache layout: nvfp4 `lo` uint8 codes [.., dstate/2] (low nibble
    the even k), `lo_scales` uint8 E4M3 [.., dstate/16], `lo_global` fp32 [slots, nheads];
    fp8_e4m3 `lo` uint8 codes; fp16/fp32 `lo` in that dtype."""
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    if fmt == "nvfp4":
        b.add(prefix + "lo", (S, H, P, N // 2), torch.uint8, "bytes", 0, 256)
        # E4M3 scale bytes 0x20..0x3f: 2^-3 .. 1.875, positive and finite
        b.add(prefix + "lo_scales", (S, H, P, N // 16), torch.uint8, "bytes", 0x20, 0x40)
        b.add(prefix + "lo_global", (S, H), torch.float32, "dt_proc")
    elif fmt == "fp8_e4m3":
        b.add(prefix + "lo", (S, H, P, N), torch.uint8, "e4m3")
    else:
        b.add(prefix + "lo", (S, H, P, N), state_dtype(fmt), "randn")


def replay_cache(cls, t: dict, *, hi_format: str, hi_rounding: str, lo_format: str,
                 window: int, prefix: str = "", **extra):
    """A `ReplayCache` (of `cute_kernels.cache` or `emulation.replay_decode`) over one set's
    tensors named as its fields (with `prefix`)."""
    return cls(
        hi=t[prefix + "hi"], lo=t.get(prefix + "lo"), lo_scales=t.get(prefix + "lo_scales"),
        lo_global=t.get(prefix + "lo_global"), ring_x=t[prefix + "ring_x"],
        ring_dt=t[prefix + "ring_dt"], ring_B=t[prefix + "ring_B"],
        cursors=t[prefix + "cursors"], flushes=t[prefix + "flushes"], hi_format=hi_format,
        hi_rounding=hi_rounding, lo_format=lo_format, window=window, seed=SEED, **extra,
    )


def cute(module: str):
    """`cute_kernels.<module>`, or `Unavailable` with the reason it cannot be imported."""
    try:
        return importlib.import_module(f"cute_kernels.{module}")
    except Exception as error:  # the CuTe kernels may be absent or fail to import: record why
        raise Unavailable(f"cute_kernels.{module}: {type(error).__name__}: {error}") from error


def replay_formats(spec: KernelSpec) -> tuple[str, str, str]:
    """(hi_format, hi_rounding, lo_format) of a CuTe replay kernel's cache."""
    if spec.step == "flush":
        return ("fp32", "rn", "none") if spec.variant == "fp32" else ("fp16", "sr", spec.writes[1])
    return "fp16", "sr", spec.variant  # the non-flush step reads lo only


def _build_cute(spec, shape, batch, window, cursor, b: Buffers, p) -> Case:
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    token_buffers(b, shape, batch, dt_dtype=KIT_DT)
    common = dict(dt_softplus=True)
    if spec.step == "update":
        su, cache_mod = cute("state_update"), cute("cache")
        fmt = spec.variant
        rounding = "sr" if fmt.startswith("fp16sr") else "rn"
        sr_bits, rounds = sr_setting(fmt)
        b.add("state", (S, H, P, N), torch.float16 if fmt.startswith("fp16") else torch.float32,
              "randn")
        counter(b, "tokens", batch, 0)
        caches = [cache_mod.StateCache(state=t["state"], scales=None, global_scale=None,
                                       tokens=t["tokens"], format=fmt[:4], rounding=rounding,
                                       seed=SEED, sr_bits=sr_bits, philox_rounds=rounds)
                  for t in (b.at(i) for i in range(b.sets))]

        def launch(t):
            su.mamba2_state_update(caches[t["set"]], t["x"], t["dt"], p["A"], t["B"], t["C"],
                                   p["D"], None, p["dt_bias"], out=t["out"], **common)

        return Case(spec, shape, batch, window, b, p, launch)

    cache_mod = cute("cache")
    hi_format, hi_rounding, lo_format = replay_formats(spec)
    # the non-flush step never touches hi: left unfilled
    b.add("hi", (S, H, P, N), state_dtype(hi_format),
          "randn" if spec.step == "flush" else "empty")
    if lo_format != "none":
        lo_buffers(b, shape, batch, lo_format)
    ring_buffers(b, shape, batch, window)
    counter(b, "cursors", batch, cursor)
    counter(b, "flushes", batch, 0)
    sr_bits, rounds = sr_setting(spec.variant) if spec.step == "flush" else DEFAULT_SR
    caches = [replay_cache(cache_mod.ReplayCache, b.at(i), hi_format=hi_format,
                           hi_rounding=hi_rounding, lo_format=lo_format, window=window,
                           sr_bits=sr_bits, philox_rounds=rounds)
              for i in range(b.sets)]
    if spec.step == "nonflush":
        fn = cute("replay_output").mamba2_replay_output
    else:
        fn = cute("replay_flush").mamba2_replay_flush

    def launch(t):
        fn(caches[t["set"]], t["x"], t["dt"], p["A"], t["B"], t["C"], p["D"], None,
           p["dt_bias"], out=t["out"], **common)

    start = b.bases["cursors"].clone()
    return Case(spec, shape, batch, window, b, p, launch,
                reset=lambda: b.bases["cursors"].copy_(start))


def _build_emulation(spec, shape, batch, window, cursor, b: Buffers, p) -> Case:
    try:
        from emulation.replay_decode import ReplayCache, mamba2_replay_decode
    except Exception as error:
        raise Unavailable(f"emulation.replay_decode: {type(error).__name__}: {error}") from error
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    token_buffers(b, shape, batch, dt_dtype=torch.float32)
    ring_buffers(b, shape, batch, window)
    counter(b, "cursors", batch, cursor)
    counter(b, "flushes", batch, 0)
    b.add("lo", (S, H, P, N), torch.float32, "randn")  # fp32 containers of the values
    b.add("lo_scales", (S, H, P, N // 16), torch.float32, "dt_proc")
    b.add("lo_global", (S, H), torch.float32, "dt_proc")
    b.add("hi", (S, H, P, N), torch.float16, "randn")
    caches = [replay_cache(ReplayCache, b.at(i), hi_format="fp16", hi_rounding="sr",
                           lo_format="nvfp4", window=window, draft=0) for i in range(b.sets)]

    def launch(t):
        mamba2_replay_decode(caches[t["set"]], t["x"], t["dt"], p["A"], t["B"], t["C"], p["D"],
                             None, p["dt_bias"], dt_softplus=True, out=t["out"])

    start = b.bases["cursors"].clone()
    return Case(spec, shape, batch, window, b, p, launch,
                reset=lambda: b.bases["cursors"].copy_(start))


def build_case(spec: KernelSpec | str, shape: BenchShape, batch: int, window: int, cursor,
               sets: int, device, seed: int = 0, peers_dir: Path = Path(".peers"),
               act: torch.dtype = ACT) -> Case:
    """The buffers of `sets` independent inputs for one kernel (activations `x, B, C, y` and the
    rings in `act`) and its launcher; `cursor` is one value, or one per slot (the check)."""
    spec = KERNELS[spec] if isinstance(spec, str) else spec
    spec.check_shape(shape)
    if window > spec.max_window:
        raise Unavailable(f"{spec.name} supports windows up to {spec.max_window}, got {window}")
    gen = torch.Generator(device=device).manual_seed(seed)
    bufs = Buffers(sets, device, gen, act)
    p = params(shape, device, gen)
    if shape.kind == "gdn" and spec.impl == "cute":
        from experiments import gdn_cases

        return gdn_cases.build_cute(spec, shape, batch, window, cursor, bufs, p)
    if spec.impl == "cute":
        return _build_cute(spec, shape, batch, window, cursor, bufs, p)
    if spec.impl == "emulation":
        return _build_emulation(spec, shape, batch, window, cursor, bufs, p)
    from experiments import peers

    return peers.build(spec, shape, batch, window, cursor, bufs, p, peers_dir)


# --------------------------------------------------------------------------------------------
# Reference check
# --------------------------------------------------------------------------------------------

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(t: dict, fmt: str) -> torch.Tensor:
    """The read copy (`t["lo"]`, with `lo_scales`, `lo_global` for nvfp4) in fp64."""
    if fmt == "nvfp4":
        codes = t["lo"].long()
        lut = torch.tensor(_E2M1, dtype=torch.float64, device=codes.device)
        values = torch.stack((lut[codes & 15], lut[codes >> 4]), dim=-1).flatten(-2)
        scales = t["lo_scales"].view(torch.float8_e4m3fn).double()
        values = values.unflatten(-1, (-1, 16)) * scales[..., None]
        return values.flatten(-2) * t["lo_global"].double()[..., None, None]
    if fmt == "fp8_e4m3":
        return t["lo"].view(torch.float8_e4m3fn).double()
    return t["lo"].double()


def bound_ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest error over its bound (NaN counts as infinitely over)."""
    ratio = (err / bound).nan_to_num(nan=math.inf)
    return float(ratio.max()) if ratio.numel() else 0.0


def _output_ratio(y: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> float:
    return bound_ratio((y.double() - ref).abs(), 2.0**-7 * (ref.abs() + mag) + 1e-30)


def lo_ratio(t: dict, fmt: str, ref: torch.Tensor) -> float:
    """The written read copy against `ref`, over its format's rounding bound."""
    err = (dequantize(t, fmt) - ref).abs()
    if fmt == "nvfp4":
        amax = ref.abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
        bound = (0.25 * amax).expand(*amax.shape[:-1], 16).flatten(-2) + 1e-30
    elif fmt == "fp8_e4m3":
        bound = 2.0**-3 * ref.abs() + 2.0**-9
    else:
        bound = 2.0**-7 * ref.abs() + 2.0**-14
    return bound_ratio(err, bound)


def check_cursors(spec: KernelSpec, window: int) -> list[int]:
    """The 3 slots' cursors of a check: the ends and the middle of the non-flush range, or the
    flush cursor thrice."""
    if spec.step == "nonflush":
        lo_c, hi_c = spec.first_cursor, window - 2 + spec.first_cursor
        return [lo_c, (lo_c + hi_c) // 2, hi_c]
    return [spec.cursors(window)[0]] * 3


def check_kernel(spec: KernelSpec | str, shape: BenchShape, window: int, device,
                 peers_dir: Path = Path(".peers"), seed: int = 7, act: torch.dtype = ACT) -> float:
    """Run `spec` once on 3 slots at different cursors and return the largest error over its
    bound (module docstring, **Check**); raises `Unavailable` if it cannot run."""
    spec = KERNELS[spec] if isinstance(spec, str) else spec
    spec.check_shape(shape)
    if shape.kind == "gdn":
        from experiments import gdn_cases

        return gdn_cases.check_kernel(spec, shape, window, device, peers_dir, seed, act)
    from lowprec.mamba2 import (
        mamba2_process_dt,
        mamba2_replay_flush,
        mamba2_replay_output,
        mamba2_step,
    )

    cursors = check_cursors(spec, window)
    case = build_case(spec, shape, 3, window, cursors, 1, device, seed, peers_dir, act)
    t = case.bufs.at(0)
    before = {k: v.clone() for k, v in t.items()}
    t["out"].fill_(float("nan"))
    case.launcher(0)()
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
        return max(_output_ratio(t["out"], y, mag), _output_ratio(t["state"], new, new_mag))

    count = torch.tensor(cursors, device=x.device)
    rows = torch.arange(3, device=x.device)
    ring_x, ring_dt, ring_B = f64["ring_x"].clone(), f64["ring_dt"].clone(), f64["ring_B"].clone()
    ring_x[rows, :, count] = x
    ring_dt[rows, :, count] = dt
    ring_B[rows, :, count] = f64["B"]
    if spec.step == "nonflush":
        if spec.impl in ("cute", "emulation"):
            state = dequantize(before, "fp32" if spec.impl == "emulation" else spec.variant)
        else:
            state = f64["state"]
    else:
        state = f64["hi"] if "hi" in f64 else f64["state"]
    y = mamba2_replay_output(state, ring_x, ring_dt, ring_B, count + 1, C, x, A, D)
    mag = mamba2_replay_output(state.abs(), ring_x.abs(), ring_dt, ring_B.abs(), count + 1,
                               C.abs(), x.abs(), A, D.abs())
    ratios = [_output_ratio(t["out"], y, mag)]
    if spec.step == "flush":
        # FlashInfer folds only the records held before the step (its token stays in the ring)
        folded = count + (0 if spec.impl == "flashinfer" else 1)
        new = mamba2_replay_flush(state, ring_x, ring_dt, ring_B, folded, A)
        new_mag = mamba2_replay_flush(state.abs(), ring_x.abs(), ring_dt, ring_B.abs(), folded, A)
        ratios.append(_output_ratio(t["hi"] if "hi" in t else t["state"], new, new_mag))
        if len(spec.writes) > 1:
            ratios.append(lo_ratio(t, spec.writes[1], new))
    return max(ratios)
