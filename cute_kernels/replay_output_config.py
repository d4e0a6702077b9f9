"""The non-flush kernel's configuration and the rules that pick it (`default_config`).

`ReplayOutputConfig` is the compile-cache key of `cute_kernels.replay_output`: the problem
(formats, sizes, optional inputs), then the tuning knobs: warps a CTA, head splits (CTAs per
group and slot), where the read copy and the ring records wait (registers, shared-memory
stages, the bulk copy engine) and whether the prologue's loads go out before the cursor.
`default_config` picks each knob by grid from the problem, the batch and the SM count, and
`output_config` applies it to a cache and a step's inputs. Nothing here needs CUDA or
cutlass. The measurements behind each rule: docs/performance.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cute_kernels import _compile
from cute_kernels import cache as kv

__all__ = [
    "ReplayOutputConfig", "default_config", "default_warps", "default_head_splits",
    "default_ring_stage", "default_eager_loads", "default_stage", "cta_shared_bytes",
    "output_config", "read_copy", "check_output_shape", "DSTATE_MULTIPLE", "TUNING_FIELDS",
]

LO_FORMATS = ("nvfp4", "fp8_e4m3", "fp16", "fp32")
_ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Elements of one state row that one lane loads with one 16-byte access, per format. A quad
# of lanes covers 4 * E consecutive k of a row (one "chunk"); dstate must be a multiple.
_ELEMENTS_PER_LOAD = {"nvfp4": 32, "fp8_e4m3": 16, "fp16": 8, "fp32": 4}
_BYTES_PER_ELEMENT = {"nvfp4": 0.5, "fp8_e4m3": 1, "fp16": 2, "fp32": 4}
DSTATE_MULTIPLE = {"nvfp4": 128, "fp8_e4m3": 64, "fp16": 32, "fp32": 32}


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
    def quads(self) -> int:
        """Partial sums per state row that meet in shared memory: nvfp4 applies each block
        scale to the mma's per-block sums, which lane t of a quad holds for its own blocks."""
        return 4 if self.lo_format == "nvfp4" else 1

    @property
    def segment(self) -> int:
        """Lanes that hold one head's window in `_warp_decay_weights`: the window rounded up
        to a power of two (records j < window - 1 of the ring and this step's)."""
        return 1 << (self.window - 1).bit_length()

    @property
    def coef_row(self) -> int:
        """Floats of one head's row of ring coefficients in shared memory (16-byte rows)."""
        return 4 * ((self.segment + 3) // 4)

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
    pieces = [(4 * 32, 16), (4 * P * W * cfg.quads, 16),
              (4 * W * nh * cfg.coef_row, 16), (4 * W * nh, 16)]
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
