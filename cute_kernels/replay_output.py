"""Mamba-2 ReplaySSM non-flush decode step (output only), reading the packed read copy.

Contract (`lowprec.mamba2.mamba2_replay_output` on the ring after the append; docs/design.md).
For every slot ``s`` whose step is not a flush (``h = cursors[s] + 1 < window``), and every
head:

    append the record at ring position cursors[s]:  ring_x <- x (bit copy), ring_dt <- dt_proc,
                                                    ring_B <- B (once per group)
    y = g_{0:h} (S_lo C) + sum_{j<h} g_{j+1:h} dt_j (B_j . C) x_j + D x   [* silu(z)]
    cursors[s] <- h

with ``dt_proc = softplus(dt + dt_bias)`` (or ``dt + dt_bias``), ``g_{i:h} = exp(A * sum_{l=i..h-1}
dt_l)``, ``S_lo`` the dequantised read copy, record ``h-1`` this step's own ``(x, dt_proc, B)``.
Flush slots (``cursors[s] + 1 == window``) are left entirely alone (outputs, ring and cursor):
the flush kernel (replay_flush.py) handles them. Accumulation is fp32; outputs differ from the
reference only by summation order. The cache layout is `cute_kernels.cache.ReplayCache`'s.

Thread ownership (docs/kernels.md draws it): one CTA per (group, slot, head split), ``warps``
warps, each warp owns ``heads_per_group / (warps * head_splits)`` heads, one at a time. The CTA
computes the group's ``h`` dot products ``B_j . C`` once (shared memory) and appends ``B``; each
warp works out the decay weights of all its heads at once (a segment of lanes per head,
`_warp_decay_weights`) and stores their ring coefficients in shared memory; per head it forms
``S_lo C`` into shared memory, and every lane finishes two output rows (ring term, D, gate).

Checkpoint term, fp8/fp16/nvfp4 (``decode='mma'``): the state is the A operand of
``mma.sync.m16n8k16`` (f16 in, fp32 accumulate); C (fp32) is split into f16 ``hi + lo`` placed
in B's columns 0 and 1, so ``D[:,0] + D[:,1] = S C`` to about 2^-22. Each quad of lanes owns
two state rows (``g`` and ``g+8`` of a 16-row stripe) and loads them 16 bytes per lane; the k
index of each A register matches the bytes a lane loaded, and B is laid out with the same
permutation. E2M1 nibbles are re-packed as E4M3 bytes (E2M1 * 2^-6, `_nvfp4_as_e4m3`), which
the hardware converts to f16 pairs; the tensor cores sum codes times C per 16-element block and
each lane multiplies its blocks' sums by their E4M3 scales in fp32 (`_nvfp4_term`). fp32
(``decode='simt'``): octets of lanes read one row with 128-bit loads, FFMA against C in
registers, then a 3-step butterfly.

Where the bytes wait (`ReplayOutputConfig`): the read copy in registers, or (``stage='bulk'``,
nvfp4 on large grids) in shared-memory stages that lane 0 fills with the bulk copy engine one
head ahead, ring records included; the ring records in registers or (``ring_stage='smem'``) in
cp.async stages; ``eager_loads`` issues the prologue's loads before the cursor arrives.

Cursor update without a second launch: every CTA of a slot reads ``cursors[s]`` (low 16 bits),
then adds 1 << 16 to it atomically after its heads; the CTA that sees ``ngroups * head_splits -
1`` earlier arrivals stores ``h``. Between launches the cursors are plain counts.

Measurements behind every default: docs/performance.md.
"""

from __future__ import annotations  # noqa: I001  (_compile must precede cutlass)

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from cute_kernels import _compile

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from cute_kernels import ptx
from cute_kernels import cache as kv
from cute_kernels.numerics import bits_f32, f32_bits, silu, softplus
from cute_kernels.tensor_core import mma_m16n8k16, pack_16x2

__all__ = [
    "ReplayOutputConfig", "ReplayOutput", "mamba2_replay_output", "compile_replay_output",
    "default_config", "default_warps", "default_head_splits", "default_ring_stage",
    "default_eager_loads", "default_stage", "cta_shared_bytes", "traffic_bytes",
]

LO_FORMATS = ("nvfp4", "fp8_e4m3", "fp16", "fp32")
_ACT_CUTE = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
_ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Elements of one state row that one lane loads with one 16-byte access, per format. A quad
# of lanes covers 4 * E consecutive k of a row (one "chunk"); dstate must be a multiple.
_ELEMENTS_PER_LOAD = {"nvfp4": 32, "fp8_e4m3": 16, "fp16": 8, "fp32": 4}
_BYTES_PER_ELEMENT = {"nvfp4": 0.5, "fp8_e4m3": 1, "fp16": 2, "fp32": 4}
DSTATE_MULTIPLE = {"nvfp4": 128, "fp8_e4m3": 64, "fp16": 32, "fp32": 32}

# nvfp4: nibbles are re-packed as E4M3 bytes (E2M1 * 2^-6 exactly, never subnormal in f16)
# and converted to f16 by the hardware; the tensor cores sum codes times C per block and the
# block scale multiplies those sums in fp32, so y = sum_blocks s_b (D0 + D1) * 2^6 * s_g.
_NVFP4_UNDO = 2.0**6


# --------------------------------------------------------------------------------------------
# Value conversions and warp reductions


def _f32x2_to_f16x2(lo, hi) -> Uint32:
    return pack_16x2(lo, hi, "f16")


def _f32x2_to_bf16x2(lo, hi) -> Uint32:
    return pack_16x2(lo, hi, "bf16")


def _words_to_f32(words: list, act: str) -> list:
    """Activation values packed in 32-bit words, as fp32 (element order preserved)."""
    out = []
    for w in words:
        if act == "bf16":
            out += [bits_f32(w << Uint32(16)), bits_f32(w & Uint32(0xFFFF0000))]
        elif act == "fp16":
            out += ptx.f16x2_to_f32x2(w)
        else:
            out.append(bits_f32(w))
    return out


def _f32_to_words(values: list, act: str) -> list:
    if act == "fp32":
        return [f32_bits(v) for v in values]
    pack = _f32x2_to_bf16x2 if act == "bf16" else _f32x2_to_f16x2
    return [pack(values[i], values[i + 1]) for i in range(0, len(values), 2)]


def _sel(cond, a, b):
    return type(a)(cutlass.select_(cond, a, b))


def _shfl(v, lane):
    return cute.arch.shuffle_sync(v, lane)


def _dot_warp(a: list, b: list) -> Float32:
    """sum_i a_i b_i over the whole warp (every lane gets the total)."""
    part = Float32(0.0)
    for e in range(len(a)):
        part = part + a[e] * b[e]
    for off in (16, 8, 4, 2, 1):
        part = part + cute.arch.shuffle_sync_bfly(part, off)
    return part


def _ring_records(act, js, coefs, record, acc0, acc1):
    """``acc0, acc1`` plus ``coefs[j]`` times ring record j's two values, j in ``js`` in turn."""
    for j in js:
        xr = _words_to_f32(record(j), act)
        acc0 = acc0 + coefs[j] * xr[0]
        acc1 = acc1 + coefs[j] * xr[1]
    return acc0, acc1


def _output_finish(act, acc0, acc1, c_last, d_h, xv, z_words):
    """This step's ``(c_last + D) x`` added to a head's output rows, then the gate."""
    acc0 = acc0 + c_last * xv[0] + d_h * xv[0]
    acc1 = acc1 + c_last * xv[1] + d_h * xv[1]
    if z_words is not None:
        zv = _words_to_f32(z_words, act)
        acc0 = acc0 * silu(zv[0])
        acc1 = acc1 * silu(zv[1])
    return acc0, acc1


def _nvfp4_as_e4m3(word):
    """The 8 E2M1 nibbles of ``word`` re-packed as E4M3 bytes of E2M1 * 2^-6, exactly:
    (even, odd), byte b of ``even`` from nibble 2b, of ``odd`` from nibble 2b + 1.

    A nibble ``s e1 e0 m`` becomes the byte ``s 0 0 e1 e0 m 0 0``: exponent field ``e1 e0``
    and mantissa ``m 0 0`` give ``2^(e-7) (1 + m/2)`` = E2M1 * 2^-6 for e >= 1, and the
    subnormal ``2^-6 m/2`` for e = 0. Odd nibbles already have their sign at bit 7 of their
    byte, so they take a shift and two logic ops, even ones two shifts and two logic ops:
    7 integer instructions per 8 elements. Also runs on numpy uint32 arrays (the CPU tests
    check it exhaustively).
    """
    u = np.uint32 if isinstance(word, (np.ndarray, np.generic)) else Uint32
    odd = (word & u(0x80808080)) | ((word >> u(2)) & u(0x1C1C1C1C))
    even = ((word << u(4)) & u(0x80808080)) | ((word << u(2)) & u(0x1C1C1C1C))
    return even, odd


# --------------------------------------------------------------------------------------------
# Configuration


def _fold_words(obj) -> Uint32:
    """Every 32-bit value in ``obj`` (nested lists, tuples and dicts of Uint32 and Float32;
    anything else skipped) XORed together."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        acc = Uint32(0)
        for item in obj:
            acc = acc ^ _fold_words(item)
        return acc
    if isinstance(obj, Float32):
        return f32_bits(obj)
    if isinstance(obj, Uint32):
        return obj
    return Uint32(0)


# --------------------------------------------------------------------------------------------
# Configuration

STAGES = ("registers", "bulk")
RING_STAGES = ("registers", "smem")
BULK_STAGES = 2  # shared-memory stages a warp with stage="bulk": one head ahead
RING_STAGE_LIMIT = 32 * 1024  # bytes of shared memory for a CTA's ring stages (ring_stage)
BULK_STAGE_LIMIT = 96 * 1024  # bytes of shared memory for a CTA's bulk stages (stage="bulk")
TUNING_FIELDS = ("warps", "head_splits", "stage", "ring_stage", "eager_loads")


@dataclass(frozen=True)
class ReplayOutputConfig:
    """Static parameters of one compiled kernel (the compile-cache key): the problem, then
    the tuning knobs (`default_config` picks them by grid; docs/performance.md has the
    measurements)."""

    lo_format: str
    act: str  # bf16 | fp16 | fp32: x, z, B, C, ring_x, ring_B, out
    dt_dtype: str  # bf16 | fp16 | fp32: raw dt
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    ring_capacity: int
    window: int
    has_D: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    # warps a CTA (`default_warps`): 4 for the tensor-core formats, 8 for fp16/fp32
    warps: int
    # CTAs per (group, slot), each taking heads_per_group / head_splits heads: small batches
    # leave SMs idle otherwise (`default_head_splits`)
    head_splits: int = 1
    # "bulk" (nvfp4): lane 0 sends each head's read copy and ring records to the bulk copy
    # engine one head ahead; with the eager loads and the ring dots after the first decode
    # (late_dots). 0.96x at Nemotron L = 16, batch 512; slower on small grids (`default_stage`)
    stage: str = "registers"
    # "smem": a head's ring records through two cp.async stages a warp; up to 32% faster at
    # L = 32 where a warp walks several heads (`default_ring_stage`)
    ring_stage: str = "registers"
    # the prologue's and the first head's loads issued before the cursor arrives: one round
    # trip less where the grid fits one wave (`default_eager_loads`)
    eager_loads: bool = False

    def __post_init__(self):
        if self.lo_format not in LO_FORMATS:
            kv.fail("lo_format", f"one of {list(LO_FORMATS)}", repr(self.lo_format))
        for name in ("warps", "head_splits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                kv.fail(name, "a positive integer", repr(value))
        if self.heads_per_group % (self.warps * self.head_splits):
            kv.fail("warps * head_splits", f"a divisor of nheads / ngroups = "
                          f"{self.heads_per_group}", self.warps * self.head_splits)
        if self.stage not in STAGES or (self.stage == "bulk" and (
                self.lo_format != "nvfp4" or self.ring_stage != "smem" or not self.eager_loads)):
            kv.fail("stage", f"one of {list(STAGES)} ('bulk': nvfp4, ring_stage 'smem', "
                          "eager_loads)", repr(self.stage))
        if self.ring_stage not in RING_STAGES or (self.ring_stage == "smem" and not (
                self.window >= 3 and self.ring_stage_fits)):
            kv.fail("ring_stage", f"one of {list(RING_STAGES)} ('smem': window >= 3 and "
                          "its stages within the shared-memory limit)", repr(self.ring_stage))
        if not isinstance(self.eager_loads, bool):
            kv.fail("eager_loads", "a bool", repr(self.eager_loads))

    @property
    def ring_stage_bytes(self) -> int:
        """One head's ring records j <= window - 3 (the ones a non-flush step can read) in
        shared memory: a multiple of 16 bytes."""
        return (self.window - 2) * self.headdim * _ACT_BYTES[self.act]

    @property
    def ring_stage_fits(self) -> bool:
        """Whether two ring stages a warp stay within RING_STAGE_LIMIT (stage="bulk": whether
        the bulk stages with the records in them stay within BULK_STAGE_LIMIT)."""
        if self.stage == "bulk":
            return self.warps * BULK_STAGES * self.bulk_stride(True) <= BULK_STAGE_LIMIT
        return self.warps * 2 * self.ring_stage_bytes <= RING_STAGE_LIMIT

    @property
    def read_copy_bytes(self) -> int:
        """One head's nvfp4 read copy: the codes, then the block scales (as staged)."""
        return self.headdim * self.dstate // 2 + self.headdim * self.dstate // 16

    def bulk_stride(self, ring_in_stage: bool = True) -> int:
        """Bytes of one bulk stage: the read copy, then (``ring_in_stage``) the ring records
        j <= window - 3, rounded up to 128 bytes."""
        size = self.read_copy_bytes + (self.ring_stage_bytes if ring_in_stage else 0)
        return -(-size // 128) * 128

    @property
    def late_dots(self) -> bool:
        """The group's B . C products and their CTA barrier after the warps' first checkpoint
        terms (with the bulk stage: 1-2% faster there, slower elsewhere)."""
        return self.stage == "bulk"

    @property
    def weights_placement(self) -> str:
        """Where a warp works out its heads' decay weights: beside its first checkpoint term
        for nvfp4 (ptxas interleaves the chains), before it for the other formats."""
        return "with_decode" if self.lo_format == "nvfp4" else "before_decode"

    @property
    def min_ctas(self) -> int:
        """Resident CTAs per SM ptxas must leave registers for: 16 warps' worth (128 registers)
        for the tensor-core formats (nvfp4 takes 134 otherwise and drops to 3 CTAs), no cap
        for the SIMT fp32 decode (79 registers)."""
        return max(1, 16 // self.warps) if self.decode == "mma" else 0

    @property
    def state_upfront(self) -> bool:
        """Whether a head's whole read copy is loaded before any of it is used: nvfp4 and fp8
        (8 or 16 registers of state per lane and stripe); fp16 and fp32 heads are 2-8x larger
        and are left to the compiler's schedule, which keeps registers low."""
        return self.lo_format in ("nvfp4", "fp8_e4m3")

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups

    @property
    def decode(self) -> str:
        return "simt" if self.lo_format == "fp32" else "mma"


def default_warps(heads_per_group: int, lo_format: str = "nvfp4") -> int:
    """Warps per CTA: 4 for the tensor-core formats (128 registers a thread, so smaller CTAs
    resident out of step), 8 for fp16 and fp32 (fp32's SIMT decode wants them); fewer where the
    group's head count is not a multiple. H200, batch 256: nvfp4 4 warps 77.0 us, 8 warps 84.4;
    fp32 4 warps 369.0, 8 warps 309.1 (docs/performance.md)."""
    preferred = 8 if lo_format in ("fp16", "fp32") else 4
    for w in (preferred, 4, 2, 1):
        if w <= preferred and heads_per_group % w == 0:
            return w
    return 1


# Heads one warp walks at most: the kernel is unrolled over a warp's heads, and 20 of them
# took 129.0 us where 10 took 81.2 (Mamba-2 2.7B, batch 512): the code outgrows the I-cache.
MAX_HEADS_PER_WARP = 10

# The smallest window at which the ring records are staged: at L = 8 (6 records a head) the
# staging's copies and waits cost more than its loads save (up to 2.3% slower).
RING_STAGE_MIN_WINDOW = 16


def default_ring_stage(cfg: ReplayOutputConfig) -> str:
    """"smem" for nvfp4 where each warp walks two heads or more (the next head's records then
    load while this one is computed), the window is RING_STAGE_MIN_WINDOW or more and the
    stages fit (`ReplayOutputConfig.ring_stage_fits`); otherwise "registers"."""
    heads_per_warp = cfg.heads_per_group // (cfg.warps * cfg.head_splits)
    pays = cfg.lo_format == "nvfp4" and heads_per_warp >= 2 and cfg.window >= RING_STAGE_MIN_WINDOW
    return "smem" if pays and cfg.window >= 3 and cfg.ring_stage_fits else "registers"


EAGER_FORMATS = ("nvfp4", "fp32")  # measured faster with eager_loads on one-wave grids
# With the ring records through registers, the eager loads only where a warp walks at most
# this many heads: at 10 (Mamba-2 2.7B, L = 8, batch 256) they took 45.4 us against 32.8.
EAGER_MAX_HEADS_REGISTERS_RING = 2


def default_eager_loads(cfg: ReplayOutputConfig, batch: int, sm_count: int) -> bool:
    """Whether the prologue's and the first head's loads go out before the cursor arrives:
    for the formats of EAGER_FORMATS with the registers stage, where the grid of ``batch *
    ngroups * head_splits`` CTAs fits in one wave of resident CTAs (``sm_count * 16 /
    warps``), and, with the ring records through registers, where a warp walks at most
    EAGER_MAX_HEADS_REGISTERS_RING heads (``cfg``'s ring_stage as it will run)."""
    allowed = cfg.lo_format in EAGER_FORMATS and cfg.stage == "registers"
    heads_per_warp = cfg.heads_per_group // (cfg.warps * cfg.head_splits)
    few_heads = cfg.ring_stage == "smem" or heads_per_warp <= EAGER_MAX_HEADS_REGISTERS_RING
    resident = sm_count * max(1, 16 // cfg.warps)
    return allowed and few_heads and batch * cfg.ngroups * cfg.head_splits <= resident


SM_SHARED_BYTES = 228 * 1024  # an H100 / H200 SM's shared memory
CTA_RESERVED_BYTES = 1024  # of it kept by the driver per resident CTA
# The bulk stage where BULK_MIN_CTAS CTAs of it fit an SM (the default kernel's registers cap
# an SM at 4) and the grid is BULK_MIN_WAVES waves or more: on fewer, one wave's start sets
# the time and the lanes' own loads bring the first bytes sooner than the copy engine.
BULK_MIN_CTAS = 4
BULK_MIN_WAVES = 3


def cta_shared_bytes(cfg: ReplayOutputConfig) -> int:
    """Shared memory of one CTA of ``cfg``'s kernel, allocation by allocation as the kernel
    makes them (each at its alignment): 19,648 bytes for the registers stage at the Nemotron
    layer, L = 16, as ncu reads it."""
    W, P, nh = cfg.warps, cfg.headdim, cfg.heads_per_group // (cfg.head_splits * cfg.warps)
    body = ReplayOutput(cfg)
    pieces = [(4 * 32, 16), (4 * P * W * body.quads, 16),
              (4 * W * nh * body.coef_row, 16), (4 * W * nh, 16)]
    if cfg.stage == "bulk":
        pieces.append((W * BULK_STAGES * cfg.bulk_stride(), 128))
        pieces.append((8 * W * BULK_STAGES, 8))  # the stages' barriers
        pieces.append((8 * W * BULK_STAGES, 8))  # the first heads' ring barriers
    elif cfg.ring_stage == "smem":
        pieces.append((W * 2 * cfg.ring_stage_bytes, 16))
    offset = 0
    for size, align in pieces:
        offset = -(-offset // align) * align + size
    return offset


def default_stage(cfg: ReplayOutputConfig, batch: int, sm_count: int) -> str:
    """"bulk" for nvfp4 where BULK_MIN_CTAS CTAs of it fit an SM's shared memory and the grid
    of ``batch * ngroups * head_splits`` CTAs is at least BULK_MIN_WAVES waves of ``sm_count *
    16 / warps`` resident ones; otherwise "registers"."""
    if cfg.lo_format != "nvfp4":
        return "registers"
    bulk = dataclasses.replace(cfg, stage="registers", ring_stage="registers")
    bulk = _with(bulk, stage="bulk", eager_loads=True)
    bulk = _with(bulk, ring_stage=default_ring_stage(bulk))
    if bulk.ring_stage != "smem":
        return "registers"
    fits = BULK_MIN_CTAS * (cta_shared_bytes(bulk) + CTA_RESERVED_BYTES) <= SM_SHARED_BYTES
    resident = sm_count * max(1, 16 // cfg.warps)
    waves = batch * cfg.ngroups * cfg.head_splits / resident
    return "bulk" if fits and waves >= BULK_MIN_WAVES else "registers"


def _with(cfg: ReplayOutputConfig, **changes) -> ReplayOutputConfig:
    """``cfg`` with ``changes``, unchecked: a step of working out the defaults, where the
    knobs are set one at a time."""
    new = object.__new__(ReplayOutputConfig)
    for f in dataclasses.fields(ReplayOutputConfig):
        object.__setattr__(new, f.name, changes.get(f.name, getattr(cfg, f.name)))
    return new


def default_head_splits(batch: int, ngroups: int, heads_per_group: int, warps: int,
                        sm_count: int, lo_format: str = "nvfp4") -> int:
    """CTAs per (group, slot): a divisor ``s`` of ``heads_per_group / warps`` (every warp
    then takes ``k = heads_per_group / (warps s)`` heads).

    Tensor-core formats: the ``s`` with the least ``waves * (k + 1)``, where ``waves`` is the
    grid of ``batch * ngroups * s`` CTAs over the resident ones (``sm_count * 16 / warps`` at
    128 registers) rounded up, and ``k + 1`` a CTA's heads a warp plus its prologue (about a
    head's worth: the group's B.C products); ``k <= MAX_HEADS_PER_WARP``, ties to the smaller
    ``s``. fp32 (SIMT decode): one head per warp at every batch. The model picks the fastest
    split, or one within 3%, at every point of two sweeps on the H200 (docs/performance.md):
    small grids are latency-bound, so splitting pays until the grid fills the GPU."""
    per_warp = heads_per_group // warps
    if lo_format == "fp32":
        return per_warp
    resident = sm_count * max(1, 16 // warps)
    best, best_cost = per_warp, None
    for splits in range(1, per_warp + 1):
        heads = per_warp // splits
        if per_warp % splits or heads > MAX_HEADS_PER_WARP:
            continue
        waves = -(-batch * ngroups * splits // resident)
        cost = waves * (heads + 1)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def default_config(problem: dict, batch: int, sm_count: int) -> ReplayOutputConfig:
    """The kernel's configuration for ``problem`` (ReplayOutputConfig's problem fields, by
    name) on a grid of ``batch`` slots and ``sm_count`` SMs: warps, head splits, then the
    stage, the ring stage and the eager loads by the rules above."""
    H, G = problem["nheads"], problem["ngroups"]
    fmt = problem["lo_format"]
    warps = default_warps(H // G, fmt)
    splits = default_head_splits(batch, G, H // G, warps, sm_count, fmt)
    cfg = ReplayOutputConfig(**problem, warps=warps, head_splits=splits)
    if default_stage(cfg, batch, sm_count) == "bulk":
        return ReplayOutputConfig(**problem, warps=warps, head_splits=splits, stage="bulk",
                                  ring_stage="smem", eager_loads=True)
    cfg = dataclasses.replace(cfg, ring_stage=default_ring_stage(cfg))
    return dataclasses.replace(cfg, eager_loads=default_eager_loads(cfg, batch, sm_count))


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    """The SMs of ``device`` (an H200's for a device that is not a GPU: meta tensors)."""
    if device.type != "cuda":
        return _compile.H200_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# --------------------------------------------------------------------------------------------
# Kernel


class ReplayOutput:
    """Host side (launch) and device body of the non-flush step for one configuration."""

    def __init__(self, cfg: ReplayOutputConfig):
        self.cfg = cfg
        self.E = _ELEMENTS_PER_LOAD[cfg.lo_format]
        # nvfp4 applies each block scale to the mma's per-block sums, which lane t of a quad
        # holds for its own blocks: four partial sums per row meet in shared memory
        self.quads = 4 if cfg.lo_format == "nvfp4" else 1

    @cute.jit
    def __call__(
        self,
        lo0: cute.Pointer,
        lo1: cute.Pointer,
        lo2: cute.Pointer,
        ring_x: cute.Pointer,
        ring_dt: cute.Pointer,
        ring_B: cute.Pointer,
        cursors: cute.Pointer,
        x: cute.Pointer,
        dt: cute.Pointer,
        A: cute.Pointer,
        B: cute.Pointer,
        C: cute.Pointer,
        D: cute.Pointer,
        z: cute.Pointer,
        dt_bias: cute.Pointer,
        out: cute.Pointer,
        batch: Int32,
        stream,
    ):
        self.kernel(
            lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A, B, C, D, z, dt_bias, out
        ).launch(
            grid=[self.cfg.ngroups * self.cfg.head_splits, batch, 1],
            block=[32 * self.cfg.warps, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.cfg.min_ctas,
            preferred_smem_carveout=-1,  # the driver's choice, named: compiles without a GPU
            use_pdl=False,
        )

    @cute.kernel
    def kernel(
        self,
        lo0: cute.Pointer,
        lo1: cute.Pointer,
        lo2: cute.Pointer,
        ring_x: cute.Pointer,
        ring_dt: cute.Pointer,
        ring_B: cute.Pointer,
        cursors: cute.Pointer,
        x: cute.Pointer,
        dt: cute.Pointer,
        A: cute.Pointer,
        B: cute.Pointer,
        C: cute.Pointer,
        D: cute.Pointer,
        z: cute.Pointer,
        dt_bias: cute.Pointer,
        out: cute.Pointer,
    ):
        cfg = self.cfg
        H, P, N, G, Lc, L = (
            cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups, cfg.ring_capacity, cfg.window
        )
        HPG, W, act = cfg.heads_per_group, cfg.warps, cfg.act
        SPL = cfg.head_splits
        HPS = HPG // SPL  # heads of this CTA
        ab = _ACT_BYTES[act]
        tid, _, _ = cute.arch.thread_idx()
        blk, s, _ = cute.arch.block_idx()
        grp = blk // SPL
        part = blk % SPL
        warp = tid // 32
        lane = tid % 32

        smem = SmemAllocator()
        bc_smem = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
        Q = self.quads  # partial sums per row (nvfp4: one per lane of a quad)
        ys_smem = smem.allocate_tensor(Float32, cute.make_layout((P, W, Q)), byte_alignment=16)
        # per warp and head: its ring coefficients g_{j+1:h} dt_j (B_j . C), one row of
        # self.coef_row floats (16-byte aligned for the epilogue's vector reads), and its
        # checkpoint factor g_{0:h}
        nh = HPS // W  # heads of a warp
        coef_smem = smem.allocate_tensor(
            Float32, cute.make_layout((W, nh, self.coef_row),
                                      stride=(nh * self.coef_row, self.coef_row, 1)),
            byte_alignment=16)
        ck_smem = smem.allocate_tensor(Float32, cute.make_layout((W, nh)), byte_alignment=16)
        bulk = cfg.stage == "bulk"
        NS = BULK_STAGES
        stride = cfg.bulk_stride()
        stage_base = Int32(0)
        bar_base = Int32(0)
        if cutlass.const_expr(bulk):
            st_smem = smem.allocate_tensor(
                Uint32, cute.make_layout(W * NS * stride // 4), byte_alignment=128
            )
            stage_base = st_smem.iterator.toint() + warp * (NS * stride)
            bar_smem = smem.allocate_tensor(Int64, cute.make_layout(W * NS), byte_alignment=8)
            bar_base = bar_smem.iterator.toint() + warp * (NS * 8)
        ring_bar_base = Int32(0)
        if cutlass.const_expr(bulk):
            # the first NS heads' ring records land on barriers of their own, so that a
            # head's decode waits only for its read copy and its epilogue for its records
            ring_bar_smem = smem.allocate_tensor(Int64, cute.make_layout(W * NS),
                                                 byte_alignment=8)
            ring_bar_base = ring_bar_smem.iterator.toint() + warp * (NS * 8)
        ring_staged = cfg.ring_stage == "smem"
        ring_cp = ring_staged and not bulk  # cp.async ring stages
        ring_base = Int32(0)
        RB = cfg.ring_stage_bytes
        if cutlass.const_expr(ring_cp):
            rs_smem = smem.allocate_tensor(Uint32, cute.make_layout(W * 2 * RB // 4),
                                           byte_alignment=16)
            ring_base = rs_smem.iterator.toint() + warp * (2 * RB)

        if cutlass.const_expr(bulk):
            # the first NS heads' read copies go to the copy engine before the cursor is read
            # (they do not depend on it); the ring records follow once the cursor is known,
            # on the stage's ring barrier
            if lane == 0:
                for k in cutlass.range_constexpr(NS):
                    ptx.mbar_init(bar_base + 8 * k)
                    ptx.mbar_init(ring_bar_base + 8 * k)
                ptx.mbar_init_fence()
                for k in cutlass.range_constexpr(min(NS, HPS // W)):
                    sh_k = Int64(s) * H + (grp * HPG + part * HPS + warp + W * k)
                    self._bulk_read_copy(lo0.toint(), lo1.toint(), sh_k,
                                         stage_base + k * stride, bar_base + 8 * k)
        raw_cursor = cute.arch.load((cursors + s).llvm_ptr, Int32)
        # eager_loads: the prologue's and the first head's loads go out with the cursor's
        eager = self._eager_loads(ptrs=(lo0, lo1, lo2, ring_x, ring_dt, x, dt, A, D, z, dt_bias),
                                  ring_B=ring_B, B=B, C=C, s=s, grp=grp, part=part, warp=warp,
                                  lane=lane) if cfg.eager_loads else {}
        cursor = Int32(raw_cursor) & 0xFFFF
        h = cursor + 1
        if cutlass.const_expr(cfg.eager_loads):
            if h >= L:
                # A flush slot's CTA folds every eager word into a shared-memory word it never
                # reads: with a use on both sides of the cursor's test, ptxas keeps the loads
                # ahead of it (it otherwise sinks them past the early exit, volatile ones too,
                # and they wait for the cursor after all). Such a CTA reads its slot's read
                # copy while a flush kernel on another stream may be rewriting it; the words
                # are dropped, so the race is harmless
                bc_smem[0] = bits_f32(_fold_words(eager))
                if cutlass.const_expr(bulk):
                    if lane == 0:  # no copy may still be writing this CTA's shared memory
                        for k in cutlass.range_constexpr(min(NS, HPS // W)):  # when it exits
                            ptx.mbar_wait(bar_base + 8 * k, 0)
        if h < L:
            s64 = Int64(s)
            sg = s64 * G + grp  # (slot, group) row of B, C, ring_B
            heads = [grp * HPG + part * HPS + warp + W * hh for hh in range(HPS // W)]
            ptrs = (lo0, lo1, lo2, ring_x, ring_dt, x, dt, A, D, z, dt_bias)
            # the decay weights of all of this warp's heads at once, a segment of lanes per
            # head: the loads here, in flight with the prologue's; the weights and their
            # products with B . C after the prologue's barrier
            decay_inputs = self._loaded(eager, "decay", lambda: _warp_decay_loads(
                cfg, self.segment, ptrs, heads[0], nh, s64, lane))
            loads = self._loaded(eager, "heads", lambda: [
                self._issue_head(ptrs, s64 * H + heads[k], heads[k], cursor, lane)
                for k in range(min(1, nh))])
            if cutlass.const_expr(bulk):
                # the records past the cursor are never copied (the same cursor for every
                # head of the slot) but are read with coefficient 0: zeros, not stale bits
                self._zero_ring_tails(stage_base, stride, NS, cursor, lane)
                if lane == 0:  # the first NS heads' records; their read copies are on the way
                    for k in cutlass.range_constexpr(min(NS, nh)):
                        self._bulk_ring(ring_x.toint(), s64 * H + heads[k],
                                        stage_base + k * stride, ring_bar_base + 8 * k,
                                        cursor)
                cute.arch.sync_warp()  # every lane waits on barriers lane 0 initialised
            if cutlass.const_expr(ring_cp):  # the first two heads' ring records
                for k in cutlass.range_constexpr(min(2, nh)):
                    self._stage_ring(ring_x.toint(), s64 * H + heads[k], ring_base + k * RB,
                                     cursor, lane)

            # ---- the group's dot products B_j . C, j < h (j = h-1: this step's B) ----------
            nb = N // 32  # consecutive elements of B and C per lane
            vb = nb * ab // 4
            c_vals = _words_to_f32(self._loaded(eager, "C", lambda: ptx.load_words(
                C.toint() + (sg * N + lane * nb) * ab, vb)), act)
            n_jj = (L - 1 + W - 1) // W  # ring records per warp
            # every load of the prologue goes out before any is used: one round trip (the
            # ring rows past the cursor are predicated off, no traffic)
            rb_words = self._loaded(eager, "ring_B", lambda: [
                self._ld_row_if(ring_B.toint() + ((sg * Lc + warp + W * jj) * N
                                                  + lane * nb) * ab, vb,
                                warp + W * jj < cursor)
                for jj in range(n_jj)])
            early = {"B": self._loaded(eager, "B", lambda: ptx.load_words(
                B.toint() + (sg * N + lane * nb) * ab, vb))}
            ck = self._loaded(eager, "ck", lambda: self._checkpoint_setup(C.toint(), sg, lane))
            if cutlass.const_expr(not cfg.late_dots):
                _ring_dots(cfg, rb_words, c_vals, cursor, warp, bc_smem)
                if warp == 0:
                    # this step's record: B . C, and B appended once per (slot, group)
                    _step_dot(cfg, early["B"], c_vals, cursor, part, bc_smem,
                              ring_B.toint() + ((sg * Lc + cursor) * N + lane * nb) * ab)
                cute.arch.sync_threads()
            # the weights after the barrier, beside the first checkpoint term for nvfp4
            with_decode = cfg.weights_placement == "with_decode"
            if cutlass.const_expr(not with_decode):
                weights = _warp_decay_weights(cfg, self.segment, ptrs, decay_inputs, cursor,
                                              lane)
                _store_warp_coefs(self.segment, weights, nh, warp, lane, cursor, bc_smem,
                                  coef_smem, ck_smem)
                cute.arch.sync_warp()
            # every thread of this CTA has read the cursor; the last CTA of the slot stores h
            # after this CTA's heads, so that no warp waits for the atomic
            arrivals = Int32(0)
            if tid == 0:
                arrivals = cute.arch.atomic_add((cursors + s).llvm_ptr, Int32(1 << 16))

            for hh in cutlass.range_constexpr(nh):
                head = heads[hh]
                sh = s64 * H + head  # (slot, head) row of every per-head tensor
                if cutlass.const_expr(bulk and hh + 1 < nh):  # one head ahead
                    loads.append(
                        self._issue_head(ptrs, s64 * H + heads[hh + 1], heads[hh + 1],
                                         cursor, lane)
                    )
                if cutlass.const_expr(not bulk and hh >= len(loads)):
                    loads.append(self._issue_head(ptrs, sh, head, cursor, lane))
                ld = loads[hh]
                stage = stage_base + (hh % NS) * stride if bulk else None
                if cutlass.const_expr(bulk):  # this head's bytes landed (use hh // NS of
                    ptx.mbar_wait(bar_base + 8 * (hh % NS), (hh // NS) % 2)  # its stage)
                    ld["state"] = self._staged_state(stage, lane)

                # ---- checkpoint term S_lo C -> ys_smem[:, warp] ----------------------------
                rows, writer = self._checkpoint_term(ck, ld["state"], lane)
                if writer:
                    for i in cutlass.range_constexpr(len(rows)):
                        ys_smem[rows[i][0], warp, (lane % 4) % Q] = rows[i][1]
                if cutlass.const_expr(cfg.late_dots and hh == 0):
                    # the group's B . C products now, and the barrier that publishes them
                    # before any warp reads them for its coefficients
                    _ring_dots(cfg, rb_words, c_vals, cursor, warp, bc_smem)
                    if warp == 0:
                        _step_dot(cfg, early["B"], c_vals, cursor, part, bc_smem,
                                  ring_B.toint() + ((sg * Lc + cursor) * N + lane * nb) * ab)
                    cute.arch.sync_threads()
                if cutlass.const_expr(with_decode and hh == 0):
                    # every head's coefficients, read after the warp barrier below
                    weights = _warp_decay_weights(cfg, self.segment, ptrs, decay_inputs,
                                                  cursor, lane)
                    _store_warp_coefs(self.segment, weights, nh, warp, lane, cursor, bc_smem,
                                      coef_smem, ck_smem)
                if cutlass.const_expr(ring_cp):  # this head's ring records landed
                    ptx.cp_async_wait(1 if hh + 1 < nh else 0)
                cute.arch.sync_warp()
                if cutlass.const_expr(bulk and hh < NS):
                    ptx.mbar_wait(ring_bar_base + 8 * hh, 0)  # this head's records

                # ---- epilogue: rows v, v+1 on each lane -----------------------------------
                # this head's ring coefficients and checkpoint factor
                row = coef_smem.iterator.toint() + 4 * self.coef_row * (warp * nh + hh)
                coefs = []
                for i in cutlass.range_constexpr((L - 2 + 3) // 4):
                    coefs += [bits_f32(w) for w in ptx.lds_v4(row + 16 * i)]
                c_last = coef_smem[warp, hh, cursor]  # this step's own record
                ck_scale = ck_smem[warp, hh] * ld["factor"]
                for r in cutlass.range_constexpr((P + 63) // 64):
                    v_raw = 64 * r + 2 * lane
                    v = cutlass.min(v_raw, P - 2)  # clamped: every lane joins the shuffles
                    xw = ld["x"][r]
                    xv = _words_to_f32(xw, act)
                    ys0, ys1 = ys_smem[v, warp, 0], ys_smem[v + 1, warp, 0]
                    for q in cutlass.range_constexpr(1, Q):
                        ys0 = ys0 + ys_smem[v, warp, q]
                        ys1 = ys1 + ys_smem[v + 1, warp, q]

                    def record(j, r=r, v=v, ld=ld, hh=hh, head_stage=stage):
                        # records j >= cursor were not loaded (zeros; eager_loads: loaded
                        # and zeroed here) and have coef 0; record L - 2 is never before
                        # the cursor (cursor <= L - 2 on a non-flush step)
                        if cutlass.const_expr(bulk):
                            words = ptx.lds_words(head_stage + cfg.read_copy_bytes
                                                  + (j * P + v) * ab, ab // 2)
                        elif cutlass.const_expr(ring_staged):
                            words = ptx.lds_words(ring_base + (hh % 2) * RB
                                                  + (j * P + v) * ab, ab // 2)
                        else:
                            words = ld["ring"][r][j]
                        if cutlass.const_expr(cfg.eager_loads and not ring_staged):
                            words = [_sel(j < cursor, w, Uint32(0)) for w in words]
                        return words

                    zw = ld["z"][r] if cfg.has_z else None
                    acc0, acc1 = ck_scale * ys0, ck_scale * ys1
                    acc0, acc1 = _ring_records(act, range(L - 2), coefs, record, acc0, acc1)
                    acc0, acc1 = _output_finish(act, acc0, acc1, c_last, ld["D"], xv, zw)
                    if v_raw < P:
                        out_words = _f32_to_words([acc0, acc1], act)
                        ptx.store_words(out.toint() + (sh * P + v) * ab, out_words)
                        ptx.store_words(ring_x.toint() + ((sh * Lc + cursor) * P + v) * ab, xw)
                cute.arch.sync_warp()
                if cutlass.const_expr(bulk and hh + NS < nh):
                    if lane == 0:  # every lane has read this stage: head hh + NS goes in
                        self._bulk_head(ptrs, s64 * H + heads[hh + NS], stage,
                                        bar_base + 8 * (hh % NS), cursor)
                if cutlass.const_expr(ring_cp and hh + 2 < nh):
                    # every lane has read this head's stage: the head after next goes into it
                    hn = hh + 2
                    self._stage_ring(ring_x.toint(), s64 * H + heads[hn],
                                     ring_base + (hn % 2) * RB, cursor, lane)
            if tid == 0:
                if (arrivals >> 16) == G * SPL - 1:
                    cute.arch.store((cursors + s).llvm_ptr, h)

    # ---- loads of one head -----------------------------------------------------------------

    def _eager_loads(self, ptrs, ring_B, B, C, s, grp, part, warp, lane) -> dict:
        """eager_loads: the loads that the prologue and a warp's first head need, issued
        while the cursor is still on its way: the first head (read copy, x, D; every ring
        record too unless they are staged), every ring B row (whatever the cursor, so none is
        predicated on it; those past it are zeroed or skipped where used), this step's B, C in
        both layouts and the decay weights' inputs. One dependent round trip instead of two;
        the unneeded rows cost bytes, which pays where the grid is latency-bound."""
        cfg = self.cfg
        H, N, G, Lc, L, W = (cfg.nheads, cfg.dstate, cfg.ngroups, cfg.ring_capacity,
                             cfg.window, cfg.warps)
        HPG, HPS, act = cfg.heads_per_group, cfg.heads_per_group // cfg.head_splits, cfg.act
        ab = _ACT_BYTES[act]
        s64 = Int64(s)
        sg = s64 * G + grp
        heads = [grp * HPG + part * HPS + warp + W * hh for hh in range(HPS // W)]
        nh = HPS // W
        nb = N // 32
        vb = nb * ab // 4
        n_jj = (L - 1 + W - 1) // W
        return {
            "heads": [self._issue_head(ptrs, s64 * H + heads[k], heads[k], None, lane)
                      for k in range(min(1, nh))],
            "ring_B": [ptx.load_words(ring_B.toint() + ((sg * Lc + warp + W * jj) * N
                                                        + lane * nb) * ab, vb)
                       for jj in range(n_jj)],
            "B": ptx.load_words(B.toint() + (sg * N + lane * nb) * ab, vb),
            "C": ptx.load_words(C.toint() + (sg * N + lane * nb) * ab, vb),
            "ck": self._checkpoint_setup(C.toint(), sg, lane),
            "decay": _warp_decay_loads(cfg, self.segment, ptrs, heads[0], nh, s64, lane),
        }

    @staticmethod
    def _loaded(early: dict, key: str, load):
        """``early[key]`` if the words were loaded ahead, else ``load()`` now. (A dict, not a
        name bound on one branch only: the DSL refuses a variable whose type differs between
        the paths of a dynamic ``if``.)"""
        return early[key] if key in early else load()

    @staticmethod
    def _ld_row_if(addr, n: int, pred) -> list:
        """``n`` consecutive words at ``addr`` (aligned to 4n bytes) if ``pred``, else
        zeros: pairs of predicated 8-byte loads (one 4-byte load for n = 1)."""
        if n == 1:
            return ptx.ld_words_if(addr, 1, pred)
        words = []
        for i in range(0, n, 2):
            words += ptx.ld_words_if(addr + 4 * i, 2, pred)
        return words

    @property
    def segment(self) -> int:
        """Lanes that hold one head's window in `_warp_decay_weights`: the window rounded up to a
        power of two (records j < window - 1 of the ring and this step's)."""
        return 1 << (self.cfg.window - 1).bit_length()

    @property
    def coef_row(self) -> int:
        """Floats of one head's row of ring coefficients in shared memory (16-byte rows)."""
        return 4 * ((self.segment + 3) // 4)

    def _issue_head(self, ptrs, sh, head, cursor, lane) -> dict:
        """Every global load one head needs, issued together (none depends on another):
        the read copy (registers stage), the ring records before the cursor (predicated:
        records past it cost no traffic; ``cursor`` None: every record, for the eager loads),
        D, x, z (dt and A: `_warp_decay_loads`)."""
        cfg = self.cfg
        lo0, lo1, lo2, ring_x, _, x, _, _, D, z, _ = ptrs
        P, Lc, L, act = cfg.headdim, cfg.ring_capacity, cfg.window, cfg.act
        ab = _ACT_BYTES[act]
        ld = {"state": None}
        if cfg.stage == "registers":
            ld["state"] = self._issue_state(lo0.toint(), lo1.toint(), sh, lane)
        ld["factor"] = Float32(1.0)
        if cfg.lo_format == "nvfp4":
            s_g = Float32(cute.arch.load((lo2 + sh).llvm_ptr, Float32))
            ld["factor"] = s_g * Float32(_NVFP4_UNDO)
        ld["D"] = Float32(0.0)
        if cfg.has_D:
            ld["D"] = Float32(cute.arch.load((D + head).llvm_ptr, Float32))
        ld["x"], ld["z"], ld["ring"] = [], [], []
        for r in range((P + 63) // 64):
            v = cutlass.min(64 * r + 2 * lane, P - 2)
            ld["x"].append(ptx.load_words(x.toint() + (sh * P + v) * ab, ab // 2))
            if cfg.has_z:
                ld["z"].append(ptx.load_words(z.toint() + (sh * P + v) * ab, ab // 2))
            if cfg.ring_stage == "smem":  # read from the warp's ring stage in the epilogue
                continue
            if cursor is None:  # eager_loads: every record, zeroed past the cursor when used
                ld["ring"].append([ptx.load_words(ring_x.toint() + ((sh * Lc + j) * P + v)
                                                  * ab, ab // 2) for j in range(L - 2)])
                continue
            ld["ring"].append([
                ptx.ld_words_if(ring_x.toint() + ((sh * Lc + j) * P + v) * ab, ab // 2,
                                j < cursor)
                for j in range(L - 2)
            ])
        return ld

    # ---- checkpoint term, per format -------------------------------------------------------

    def _checkpoint_setup(self, c_addr, sg, lane):
        """Per-warp registers that depend only on (slot, group): C in the B-fragment layout
        (mma) or the lane's slice of C (simt)."""
        cfg = self.cfg
        N, act = cfg.dstate, cfg.act
        ab = _ACT_BYTES[act]
        row = c_addr + sg * N * ab
        if cfg.decode == "simt":
            # lane l8 = lane % 8 owns k = 4*l8 + 32*m, m < N/32
            l8 = lane % 8
            vals = []
            for m in range(N // 32):
                vals += _words_to_f32(ptx.load_words(row + (32 * m + 4 * l8) * ab, ab), act)
            return vals
        return self._c_fragments(lambda off, n: ptx.load_words(row + off, n), lane)

    def _c_fragments(self, load, lane):
        """C in the mma's B-fragment layout, its words read by ``load(byte offset in C's row,
        words)`` (global memory)."""
        cfg, E = self.cfg, self.E
        N, act = cfg.dstate, cfg.act
        ab = _ACT_BYTES[act]
        # mma: lane (g, t) holds column g of B; g = 0 -> f16(C), g = 1 -> f16(C - f16(C)).
        # nvfp4: columns 2t' and 2t'+1 hold C's hi and lo on lane t''s k only (zero on the
        # other lanes' k), so D[r, 2t] + D[r, 2t+1] is row r's sum over lane t's block alone.
        g = lane // 4
        t = lane % 4
        hi_col, lo_col = (2 * t, 2 * t + 1) if self.quads == 4 else (0, 1)
        frags = []
        for c in range(N // (4 * E)):
            cv = _words_to_f32(load((4 * E * c + E * t) * ab, E * ab // 4), act)
            for j in range(E // 4):
                kap = self._kappa(j)
                pair = []
                for q in range(2):
                    c0, c1 = cv[kap[2 * q]], cv[kap[2 * q + 1]]
                    hi = _f32x2_to_f16x2(c0, c1)
                    h0, h1 = ptx.f16x2_to_f32x2(hi)
                    lo = _f32x2_to_f16x2(c0 - h0, c1 - h1)
                    pair.append(_sel(g == hi_col, hi, _sel(g == lo_col, lo, Uint32(0))))
                frags.append(pair)
        return frags

    def _kappa(self, j: int) -> tuple:
        """k offsets (within a lane's E loaded elements) of A-fragment slots (2t, 2t+1, 2t+8,
        2t+9) of mma j: they must be the elements that the lane's registers hold."""
        if self.cfg.lo_format == "nvfp4":
            # word j//2; bytes 0-1 (j even) or 2-3 (j odd) of its even and odd re-packs:
            # nibbles (0, 2), (1, 3) or (4, 6), (5, 7)
            base = 8 * (j // 2) + 4 * (j % 2)
            return (base, base + 2, base + 1, base + 3)
        return (4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3)

    def _issue_state(self, lo0, lo1, sh, lane) -> list:
        """The lane's share of one head's read copy (byte addresses ``lo0`` codes/values,
        ``lo1`` nvfp4 scales): 16-byte loads, issued before any is used (or, for formats
        without ``state_upfront``, a thunk the compute step calls)."""
        if not self.cfg.state_upfront:
            return lambda: self._issue_state_now(lo0, lo1, sh, lane)
        return self._issue_state_now(lo0, lo1, sh, lane)

    def _bulk_head(self, ptrs, sh, stage, bar, cursor) -> None:
        """stage="bulk", lane 0: one head's codes, block scales and ring records j < cursor
        (each contiguous in global memory) into the stage at shared address ``stage``,
        completing on the stage's barrier ``bar``."""
        cfg = self.cfg
        lo0, lo1, _, ring_x = ptrs[:4]
        ring = cursor * (cfg.headdim * _ACT_BYTES[cfg.act])
        self._bulk_read_copy(lo0.toint(), lo1.toint(), sh, stage, bar, ring)
        self._bulk_records(ring_x.toint(), sh, stage, bar, ring)

    def _bulk_read_copy(self, lo0, lo1, sh, stage, bar, more=0) -> None:
        """Lane 0: one head's codes and block scales into its stage, completing on ``bar``,
        which expects ``more`` bytes besides (the ring records `_bulk_head` sends with them);
        for the first heads, before the cursor is known."""
        P, N = self.cfg.headdim, self.cfg.dstate
        codes, scales = P * N // 2, P * N // 16
        ptx.mbar_expect(bar, more + self.cfg.read_copy_bytes)
        ptx.bulk_copy(stage, lo0 + sh * codes, codes, bar)
        ptx.bulk_copy(stage + codes, lo1 + sh * scales, scales, bar)

    def _bulk_records(self, ring_x, sh, stage, bar, nbytes) -> None:
        """Lane 0: the first ``nbytes`` of a head's ring records into its stage, behind the
        read copy, completing on ``bar``."""
        cfg = self.cfg
        P, Lc, ab = cfg.headdim, cfg.ring_capacity, _ACT_BYTES[cfg.act]
        ptx.bulk_copy(stage + cfg.read_copy_bytes, ring_x + sh * (Lc * P * ab), nbytes, bar)

    def _bulk_ring(self, ring_x, sh, stage, bar, cursor) -> None:
        """The ring records j < cursor of a head whose read copy `_bulk_read_copy` sent, once
        the cursor is known, completing on ``bar`` (the stage's ring barrier)."""
        ring = cursor * (self.cfg.headdim * _ACT_BYTES[self.cfg.act])
        ptx.mbar_expect(bar, ring)
        self._bulk_records(ring_x, sh, stage, bar, ring)

    def _zero_ring_tails(self, stage_base, stride, stages, cursor, lane) -> None:
        """Zeros in every bulk stage's ring records j >= cursor (16 bytes a lane and store)."""
        cfg = self.cfg
        pieces, per_record = cfg.ring_stage_bytes // 16, cfg.headdim * _ACT_BYTES[cfg.act] // 16
        for k in range(stages):
            for i in range((pieces + 31) // 32):
                piece = lane + 32 * i
                tail = _sel(piece >= cursor * per_record, Int32(1), Int32(0))
                if (i + 1) * 32 > pieces:  # lanes past the end store nothing
                    tail = _sel(piece < pieces, tail, Int32(0))
                ptx.sts_zero16_if(stage_base + k * stride + cfg.read_copy_bytes + piece * 16, tail)

    def _stage_ring(self, ring_x, sh, stage, cursor, lane) -> None:
        """cp.async one head's ring records j <= window - 3 (contiguous in global memory)
        into a warp's ring stage at shared address ``stage``, 16 bytes per lane and copy,
        records past the cursor zero-filled (no traffic); one group."""
        cfg = self.cfg
        P, Lc, ab = cfg.headdim, cfg.ring_capacity, _ACT_BYTES[cfg.act]
        pieces, per_record = cfg.ring_stage_bytes // 16, P * ab // 16
        for i in range((pieces + 31) // 32):
            piece = lane + 32 * i
            if (i + 1) * 32 > pieces:  # lanes past the end copy the last piece again (the
                piece = cutlass.min(piece, pieces - 1)  # same bytes: a harmless race)
            j = piece // per_record
            ptx.cp_async_16_zfill(stage + piece * 16, ring_x + (sh * Lc * P * ab + piece * 16),
                               _sel(j < cursor, Int32(16), Int32(0)))
        ptx.cp_async_commit()

    def _staged_state(self, stage, lane):
        """The lane's share of a staged head, in `_issue_state_now`'s layout, read from
        shared memory one 16-row stripe at a time (indexing issues the reads)."""
        P, N, E = self.cfg.headdim, self.cfg.dstate, self.E
        g, t = lane // 4, lane % 4
        row_bytes, sc_row, codes = N // 2, N // 16, P * N // 2

        class Stripes:
            def __getitem__(self, q):
                r1 = 16 * q + g
                chunks = []
                for c in range(N // (4 * E)):
                    a1 = ptx.lds_v4(stage + r1 * row_bytes + 64 * c + 16 * t)
                    a2 = ptx.lds_v4(stage + (r1 + 8) * row_bytes + 64 * c + 16 * t)
                    sc = (ptx.lds_u16(stage + codes + r1 * sc_row + 8 * c + 2 * t),
                          ptx.lds_u16(stage + codes + (r1 + 8) * sc_row + 8 * c + 2 * t))
                    chunks.append((a1, a2, sc))
                return chunks

        return Stripes()

    def _issue_state_now(self, lo0, lo1, sh, lane) -> list:
        cfg, E = self.cfg, self.E
        P, N = cfg.headdim, cfg.dstate
        fmt = cfg.lo_format
        if cfg.decode == "simt":
            # octet o = lane // 8 owns row 4p + o of pass p; lane l8 = lane % 8 the k in
            # [32m + 4 l8, 32m + 4 l8 + 4): each access is 16 bytes, each octet 128
            o, l8 = lane // 8, lane % 8
            return [
                [ptx.load_words(lo0 + ((sh * P + 4 * p + o) * N + 32 * m + 4 * l8) * 4, 4, True)
                 for m in range(N // 32)]
                for p in range(P // 4)
            ]
        g, t = lane // 4, lane % 4
        row_bytes = int(N * _BYTES_PER_ELEMENT[fmt])
        stripes = []
        for q in range(P // 16):
            r1 = 16 * q + g
            chunks = []
            for c in range(N // (4 * E)):
                a1 = ptx.load_words(lo0 + (sh * P + r1) * row_bytes + 64 * c + 16 * t, 4, True)
                a2 = ptx.load_words(lo0 + (sh * P + r1 + 8) * row_bytes + 64 * c + 16 * t, 4,
                                    True)
                sc = None
                if fmt == "nvfp4":
                    sc_row = N // 16
                    sc = (ptx.ld_u16(lo1 + (sh * P + r1) * sc_row + 8 * c + 2 * t),
                          ptx.ld_u16(lo1 + (sh * P + r1 + 8) * sc_row + 8 * c + 2 * t))
                chunks.append((a1, a2, sc))
            stripes.append(chunks)
        return stripes

    def _checkpoint_term(self, ck, state, lane):
        """The raw S_lo C sums of one head from its loaded ``state``: ``(rows, writer)``,
        (row, value) pairs held by the lanes with ``writer`` set (they still need the
        head's factor: nvfp4 2^7 s_g, others 1)."""
        cfg = self.cfg
        P, N = cfg.headdim, cfg.dstate
        fmt = cfg.lo_format
        if callable(state):
            state = state()
        rows = []
        if cfg.decode == "simt":
            o, l8 = lane // 8, lane % 8
            for p in range(P // 4):
                acc = Float32(0.0)
                for m in range(N // 32):
                    for e in range(4):
                        acc = acc + bits_f32(state[p][m][e]) * ck[4 * m + e]
                for off in (4, 2, 1):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, off)
                rows.append((4 * p + o, acc))
            return rows, l8 == 0

        g, t = lane // 4, lane % 4
        if fmt == "nvfp4":
            return self._nvfp4_term(ck, state, g, t), True
        for q in range(P // 16):
            r1 = 16 * q + g
            acc = [Float32(0.0)] * 4
            for c, (a1, a2, _) in enumerate(state[q]):
                if fmt == "fp8_e4m3":
                    for j in range(4):
                        a = [
                            ptx.e4m3x2_to_f16x2(a1[j]),
                            ptx.e4m3x2_to_f16x2(a2[j]),
                            ptx.e4m3x2_to_f16x2(a1[j], 1),
                            ptx.e4m3x2_to_f16x2(a2[j], 1),
                        ]
                        acc = mma_m16n8k16(a, ck[c * 4 + j], acc)
                else:  # fp16: the loaded words are the A registers
                    for j in range(2):
                        a = [a1[2 * j], a2[2 * j], a1[2 * j + 1], a2[2 * j + 1]]
                        acc = mma_m16n8k16(a, ck[c * 2 + j], acc)
            rows += [(r1, acc[0] + acc[1]), (r1 + 8, acc[2] + acc[3])]
        return rows, t == 0

    def _nvfp4_term(self, ck, state, g, t):
        """nvfp4: per 16-row stripe and chunk, the mmas of words 0-1 (block 2t of the lane's
        chunk) and of words 2-3 (block 2t + 1) accumulate apart, so that D's columns 2t, 2t+1
        hold each row's unscaled sums over this lane's two blocks; the lane multiplies them
        by its own block scales in fp32. Each lane's partial sums of rows g and g + 8 go to
        shared memory (the epilogue adds the quad's four). No f16 multiply per element."""
        P = self.cfg.headdim
        rows = []
        for q in range(P // 16):
            part = [Float32(0.0), Float32(0.0)]  # rows g, g + 8 of the stripe
            for c, (a1, a2, sc_raw) in enumerate(state[q]):
                acc = [[Float32(0.0)] * 4, [Float32(0.0)] * 4]  # blocks 2t, 2t + 1
                for i in range(4):  # word i: elements 8i..8i+7, block 2t + i // 2
                    ev1, od1 = _nvfp4_as_e4m3(a1[i])
                    ev2, od2 = _nvfp4_as_e4m3(a2[i])
                    for half in range(2):  # mma j = 2i + half (see _kappa)
                        a = [
                            ptx.e4m3x2_to_f16x2(ev1, half),
                            ptx.e4m3x2_to_f16x2(ev2, half),
                            ptx.e4m3x2_to_f16x2(od1, half),
                            ptx.e4m3x2_to_f16x2(od2, half),
                        ]
                        acc[i // 2] = mma_m16n8k16(a, ck[c * 8 + 2 * i + half], acc[i // 2])
                for r, sv in enumerate(sc_raw):  # scales of blocks 2t, 2t + 1, rows g, g + 8
                    s_even, s_odd = ptx.f16x2_to_f32x2(ptx.e4m3x2_to_f16x2(sv))  # exact
                    part[r] = (part[r] + s_even * (acc[0][2 * r] + acc[0][2 * r + 1])
                               + s_odd * (acc[1][2 * r] + acc[1][2 * r + 1]))
            rows += [(16 * q + g, part[0]), (16 * q + g + 8, part[1])]
        return rows



@cute.jit
def _ring_dots(cfg: cutlass.Constexpr, rb_words, c_vals, cursor, warp, bc_smem):
    """The prologue's B_j . C for the ring records j = warp + warps * jj < cursor (this
    warp's share) into ``bc_smem``."""
    W, L, act = cfg.warps, cfg.window, cfg.act
    for jj in cutlass.range_constexpr((L - 1 + W - 1) // W):
        j = warp + W * jj
        if j < cursor:
            bc_smem[j] = _dot_warp(_words_to_f32(rb_words[jj], act), c_vals)


@cute.jit
def _step_dot(cfg: cutlass.Constexpr, b_words, c_vals, cursor, part, bc_smem, row):
    """Warp 0: this step's record's B . C into ``bc_smem[cursor]``, and its B appended (the
    lane's words at byte address ``row``) by one CTA of the group (``part`` 0)."""
    bc_smem[cursor] = _dot_warp(_words_to_f32(b_words, cfg.act), c_vals)
    if part == 0:
        ptx.store_words(row, b_words)


def _decay_passes(S: int, nh: int) -> int:
    """Passes of a warp's decay weights over its nh heads, ``32 // S`` heads a pass."""
    return -(-nh // (32 // S))


def _decay_pass_head(W: int, S: int, first_head, nh: int, lane, q: int):
    """(k_raw, head) of pass q (head k's records on lanes ``k S .. k S + S - 1``): the lane's
    head index in the warp (``>= nh`` on a pass's spare lanes) and the head it loads for
    (clamped to the warp's last; heads ``first_head + W k``). One indexing for
    `_warp_decay_loads` and the timing-only `_prologue_constants`; a pass at a time, so that
    each pass's loads follow its indices as before (the register-stage step's SASS moved
    when the indices all came first)."""
    k_raw = q * (32 // S) + lane // S
    return k_raw, first_head + W * cutlass.min(k_raw, nh - 1)


@cute.jit
def _warp_decay_loads(cfg: cutlass.Constexpr, S: cutlass.Constexpr, ptrs, first_head,
                      nh: cutlass.Constexpr, s64, lane):
    """The loads of `_warp_decay_weights`, per pass of a warp's heads: (lane's head is real,
    its (slot, head) row, ring dt of record j = lane % S (index clamped), this step's raw dt
    plus bias, A)."""
    _, _, _, _, ring_dt, _, dt, A, _, _, dt_bias = ptrs
    H, Lc, W = cfg.nheads, cfg.ring_capacity, cfg.warps
    j = lane % S
    passes = []
    for q in cutlass.range_constexpr(_decay_passes(S, nh)):
        k_raw, head = _decay_pass_head(W, S, first_head, nh, lane, q)
        sh = s64 * H + head
        ring = Float32(cute.arch.load((ring_dt + sh * Lc + cutlass.min(j, Lc - 1)).llvm_ptr,
                                      Float32))
        if cutlass.const_expr(cfg.dt_dtype == "bf16"):
            # nvvm's scalar load has no 16-bit float form; bf16 is the top half of an fp32,
            # so load the 16 bits and shift them into place (exact).
            bits = Uint32(cute.arch.load((dt + sh).llvm_ptr, cutlass.Uint16))
            raw = bits_f32(bits << Uint32(16))
        elif cutlass.const_expr(cfg.dt_dtype == "fp16"):
            bits16 = cute.arch.load((dt + sh).llvm_ptr, cutlass.Uint16)
            raw = Float32(bits16.bitcast(cutlass.Float16))
        else:
            raw = Float32(cute.arch.load((dt + sh).llvm_ptr, _ACT_CUTE[cfg.dt_dtype]))
        if cutlass.const_expr(cfg.has_dt_bias):
            raw = raw + Float32(cute.arch.load((dt_bias + head).llvm_ptr, Float32))
        a_h = Float32(cute.arch.load((A + head).llvm_ptr, Float32))
        passes.append((k_raw < nh, sh, ring, raw, a_h))
    return passes


@cute.jit
def _warp_decay_weights(cfg: cutlass.Constexpr, S: cutlass.Constexpr, ptrs, passes, cursor,
                        lane):
    """The decay weights of all of a warp's heads from `_warp_decay_loads` (heads
    ``first_head + warps k``), ``32 // S`` heads a pass, record j of the pass's head k on
    lane ``k S + j`` (S: the window rounded up to a power of two): per pass ``(valid, w,
    ck)`` with ``w = g_{j+1:h} dt_j`` for j < h (0 after) and ``ck = g_{0:h}``; this step's
    processed dt is appended to the ring here (lane j = cursor).

    A pass does 2 heads (window 16) or 4 (window 8): these chains (the dt loads, softplus,
    the suffix-sum shuffles, two exps) are about 100 SASS instructions a lane each. The
    suffix sums run over the segment, whose lanes past the cursor hold zeros, so every value
    is that of one head over the whole warp, bit for bit."""
    ring_dt = ptrs[4]
    Lc = cfg.ring_capacity
    j = lane % S
    h = cursor + 1
    out = []
    for q in cutlass.range_constexpr(len(passes)):
        valid, sh, ring, raw, a_h = passes[q]
        dt_cur = raw
        if cutlass.const_expr(cfg.dt_softplus):
            dt_cur = softplus(dt_cur)
        dt_j = _sel(j < cursor, ring, Float32(0.0))
        dt_j = _sel(j == cursor, dt_cur, dt_j)
        if valid:
            if j == cursor:  # this step's dt, appended
                cute.arch.store((ring_dt + sh * Lc + cursor).llvm_ptr, dt_cur)
        incl = dt_j  # suffix sums over the segment: incl[j] = sum_{l >= j} dt_l
        for i in cutlass.range_constexpr(S.bit_length() - 1):
            nxt = cute.arch.shuffle_sync_down(incl, 1 << i)
            incl = _sel(j + (1 << i) < S, incl + nxt, incl)
        excl = _sel(j < S - 1, cute.arch.shuffle_sync_down(incl, 1), Float32(0.0))
        total = _shfl(incl, lane - j)
        decay = cute.math.exp(cutlass.min(a_h * excl, Float32(0.0)))
        w = _sel(j < h, decay * dt_j, Float32(0.0))
        out.append((valid, w, cute.math.exp(a_h * total)))
    return out


@cute.jit
def _store_warp_coefs(S: cutlass.Constexpr, weights, nh: cutlass.Constexpr, warp, lane, cursor,
                      bc_smem, coef_smem, ck_smem):
    """After the prologue's barrier (B . C in ``bc_smem`` for records j <= cursor; the
    entries past it were never written): each of a warp's heads' ring coefficients ``w_j
    (B_j . C)`` (0 past the cursor) and its checkpoint factor into the warp's rows (row-major:
    a head's coefficients contiguous)."""
    per = 32 // S
    j = lane % S
    for q in cutlass.range_constexpr(len(weights)):
        valid, w, ck = weights[q]
        k = cutlass.min(q * per + lane // S, nh - 1)
        if valid:
            coef_smem[warp, k, j] = _sel(j <= cursor, w * bc_smem[j], Float32(0.0))
            if j == 0:
                ck_smem[warp, k] = ck
# --------------------------------------------------------------------------------------------
# Compile cache and public function


def _pointer_types(cfg: ReplayOutputConfig) -> list:
    act = _ACT_CUTE[cfg.act]
    lo = {
        "nvfp4": (cutlass.Uint8, cutlass.Uint8, Float32),
        "fp8_e4m3": (cutlass.Uint8, cutlass.Uint8, Float32),
        "fp16": (cutlass.Float16, cutlass.Uint8, Float32),
        "fp32": (Float32, cutlass.Uint8, Float32),
    }[cfg.lo_format]
    return [
        *lo, act, Float32, act, Int32, act, _ACT_CUTE[cfg.dt_dtype], Float32, act, act,
        Float32, act, Float32, act,
    ]


def compile_replay_output(cfg: ReplayOutputConfig, keep_ptx: bool = False):
    """The compiled kernel for ``cfg`` (cached); compiles for sm_90a without a GPU."""

    def build():
        ptrs = [_compile.fake_ptr(t) for t in _pointer_types(cfg)]
        return cute.compile(
            ReplayOutput(cfg),
            *ptrs,
            Int32(1),
            _compile.fake_stream(),
            options=_compile.compile_options(keep_ptx),
        )

    return _compile.compile_cached(("replay_output", cfg, keep_ptx), build)


def read_copy(cache: kv.ReplayCache) -> tuple:
    """The copy a non-flush step reads and its format: lo, or hi where lo_format is 'none'."""
    if cache.lo_format == "none":
        return cache.hi_format, (cache.hi, None, None)
    return cache.lo_format, (cache.lo, cache.lo_scales, cache.lo_global)


def check_output_shape(view: kv.CacheView, read_format: str, window: int) -> None:
    """The non-flush kernel's limits: window in [2, min(Lcap, 32)], headdim a multiple of 16,
    dstate a multiple of DSTATE_MULTIPLE of the read copy's format."""
    if not 2 <= window <= min(view.ring_len, 32):
        kv.fail("cache.window", f"an int in [2, min(ring capacity {view.ring_len}, 32)] for a "
                "non-flush step", window)
    if view.headdim % 16:
        kv.fail("cache.hi.shape[2] (headdim)", "a multiple of 16", view.headdim)
    if view.dstate % DSTATE_MULTIPLE[read_format]:
        kv.fail("cache.hi.shape[3] (dstate)", f"a multiple of {DSTATE_MULTIPLE[read_format]} "
                f"for {read_format}", view.dstate)


def output_config(cache: kv.ReplayCache, x, dt, D=None, z=None, dt_bias=None, *,
                  dt_softplus=True, sm_count=None) -> ReplayOutputConfig:
    """The configuration `mamba2_replay_output` runs for these arguments (validated as far as
    the configuration needs): `default_config` for ``sm_count`` SMs (default: the cache's
    GPU's, an H200's elsewhere)."""
    view = kv.check_replay_cache(cache)
    fmt, _ = read_copy(cache)
    return _config(view, fmt, cache.window, x, dt, D, z, dt_bias, dt_softplus,
                   sm_count or _sm_count(view.device))


def _config(view, fmt, window, x, dt, D, z, dt_bias, dt_softplus, sm_count):
    check_output_shape(view, fmt, window)
    kv.check_switch("dt_softplus", dt_softplus)
    problem = dict(lo_format=fmt, act=kv.ACT_DTYPES[x.dtype], dt_dtype=kv.ACT_DTYPES[dt.dtype],
                   nheads=view.nheads, headdim=view.headdim, dstate=view.dstate,
                   ngroups=view.ngroups, ring_capacity=view.ring_len, window=window,
                   has_D=D is not None, has_z=z is not None, has_dt_bias=dt_bias is not None,
                   dt_softplus=dt_softplus)
    return default_config(problem, view.slots, sm_count)


def _tuned(cfg: ReplayOutputConfig, config) -> ReplayOutputConfig:
    """``config`` where it differs from ``cfg`` only in TUNING_FIELDS, else a ValueError."""
    if config is None:
        return cfg
    if not isinstance(config, ReplayOutputConfig):
        kv.fail("config", "None or a ReplayOutputConfig", type(config).__name__)
    for f in dataclasses.fields(ReplayOutputConfig):
        if f.name not in TUNING_FIELDS and getattr(config, f.name) != getattr(cfg, f.name):
            kv.fail(f"config.{f.name}", f"{getattr(cfg, f.name)!r} (these arguments')",
                    repr(getattr(config, f.name)))
    return config


def launch_replay_output(cfg: ReplayOutputConfig, cache: kv.ReplayCache, x, dt, A, B, C, D, z,
                         dt_bias, out) -> None:
    """Launch the kernel of ``cfg`` on torch's current stream (arguments already checked)."""
    _, (lo0, lo1, lo2) = read_copy(cache)
    tensors = [
        lo0,
        lo1 if lo1 is not None else lo0,
        lo2 if lo2 is not None else A,
        cache.ring_x, cache.ring_dt, cache.ring_B, cache.cursors, x, dt, A, B, C,
        D if D is not None else A,
        z if z is not None else x,
        dt_bias if dt_bias is not None else A,
        out,
    ]  # a tensor stands in (never read) for each optional one left out
    ptrs = [_compile.gmem_ptr(t, ty) for t, ty in zip(tensors, _pointer_types(cfg), strict=True)]
    compile_replay_output(cfg)(*ptrs, Int32(x.shape[0]), _compile.current_stream())


def mamba2_replay_output(cache: kv.ReplayCache, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                         dt_softplus=True, out=None, config=None):
    """One non-flush decode step for every slot whose ``cursors[s] + 1 < window``; returns
    ``out`` [slots, nheads, headdim] (x's dtype; rows of flush slots are not written).

    ``cache``: a `cute_kernels.cache.ReplayCache` (lo_format 'none' reads hi). Token inputs
    as `emulation.replay_decode.mamba2_replay_decode`: x, z [slots, nheads, headdim] and B, C
    [slots, ngroups, dstate] in the ring's activation dtype, dt [slots, nheads] (raw; bf16,
    fp16 or fp32), A, D, dt_bias fp32 [nheads]. Limits: window >= 2, headdim a multiple of
    16, dstate a multiple of 128 (nvfp4), 64 (fp8_e4m3) or 32 (fp16, fp32). Launches on
    torch's current stream and does not synchronise (graph-capturable); cursor values must
    lie in [0, window - 1]. ``config``: None (`default_config` for this grid), or
    `output_config`'s result with its tuning fields (TUNING_FIELDS) changed.
    """
    view = kv.check_replay_cache(cache)
    kv.check_step(view, x, dt, A, B, C, D, z, dt_bias, out=out)
    fmt, _ = read_copy(cache)
    cfg = _tuned(_config(view, fmt, cache.window, x, dt, D, z, dt_bias, dt_softplus,
                         _sm_count(view.device)), config)
    kv.require_cuda("cache.hi", cache.hi)
    if out is None:
        out = torch.empty_like(x)
    if view.slots == 0:
        return out
    launch_replay_output(cfg, cache, x, dt, A, B, C, D, z, dt_bias, out)
    return out


def traffic_bytes(
    lo_format, batch, nheads, headdim, dstate, ngroups, h, act_bytes=2, has_z=False
) -> int:
    """Bytes one call must move, each read once and each write once, when every slot holds
    ``h`` records after the append: the state read in its format (block and second-level
    scales included), the ring reads of the ``h - 1`` older records (x and dt per head, B per
    group), this step's x, dt (fp32), z, B and C, the output, the record append (x, dt per
    head; B per group) and the cursor read and write. A, D and dt_bias (per head, shared by
    every slot) are left out."""
    state = headdim * dstate * _BYTES_PER_ELEMENT[lo_format]
    if lo_format == "nvfp4":
        state += headdim * dstate // 16 + 4
    row = headdim * act_bytes
    per_head = state + (h - 1) * (row + 4) + row * (3 + has_z) + 4 + 4
    per_group = (h - 1) * dstate * act_bytes + 3 * dstate * act_bytes
    return int(batch * (nheads * per_head + ngroups * per_group + 8))

