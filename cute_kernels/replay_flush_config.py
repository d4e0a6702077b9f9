"""The flush kernel's configuration (`FlushConfig`, the compile-cache key of
`cute_kernels.replay_flush`) and the rules that fill in its defaults: elements a thread
(`default_elements_per_thread`), the fold (`default_fold`: the tensor-core folds where they
apply), the CTAs of a decode step's launch (`decode_slot_ctas`), and `flush_config`, which
applies them to a checked cache and a step's inputs. Nothing here needs CUDA or cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cute_kernels import cache as kv
from cute_kernels.cache import check_sr_settings
from lowprec import philox

__all__ = [
    "FlushConfig", "flush_config", "check_flush_shape", "default_elements_per_thread",
    "default_fold", "mma_fold_problem", "direct_fold_problem", "thread_count",
    "resident_ctas_per_sm", "decode_slot_ctas", "TUNING_FIELDS",
]

HI_FORMATS = ("fp16", "fp32")
HI_ROUNDINGS = ("sr", "rn")
LO_FORMATS = ("nvfp4", "fp8_e4m3", "fp16", "fp32", "none")
ACTS = ("bf16", "fp16", "fp32")  # activation and dt dtypes, by name

CHUNK = 8  # state elements per thread access: 16 B of fp16, 32 B of fp32, 4 B of nvfp4 codes
# (FlushConfig.chunk: 16 gives a thread a whole NVFP4 block); the ring is staged in chunks of 8
CHUNKS = (8, 16)
ELEMENTS_PER_THREAD = 64  # the layout that fits every accepted shape (the head's amax in
# registers); default_elements_per_thread picks 32 where it fits an fp16 copy
NVFP4_BLOCK = 16
E2M1_E4M3_MAX = 2688.0  # 448 * 6
E2M1_MAX = 6.0


def default_elements_per_thread(headdim: int, dstate: int, hi_format: str = "fp16") -> int:
    """For an fp16 recurrence copy 32 where the head takes whole warps and at most 1024
    threads that way (more warps resident: 1,452.8 -> 1,098.9 us at batch 256 on the H200),
    else 64. The fp32 copy takes 64 (the mma fold: 652.2 us against 769.5 with the direct
    fold at 32, batch 256; docs/performance.md)."""
    if hi_format == "fp32":
        return ELEMENTS_PER_THREAD
    fits = _layout_problem(headdim, dstate, 32) is None and headdim * dstate // 32 <= 1024
    return 32 if fits else ELEMENTS_PER_THREAD


def _layout_problem(headdim: int, dstate: int, elements_per_thread: int, chunk: int = CHUNK):
    """None if the head splits over `thread_count` threads as the kernel assumes, else
    (which dimensions, what they must be): every thread a whole number of chunks, whole
    warps (the shuffles assume them)."""
    threads = thread_count(headdim, dstate, elements_per_thread)
    if headdim % 8 or (headdim * (dstate // chunk)) % threads:
        return "headdim", f"a multiple of 8 and of {threads * chunk // dstate}"
    if threads % 32:
        return "headdim x dstate", (
            f"headdim * dstate / {elements_per_thread} threads, a multiple of 32 (or 32 at "
            f"most {32 * elements_per_thread} elements)"
        )
    return None


def thread_count(headdim: int, dstate: int, elements_per_thread: int = ELEMENTS_PER_THREAD) -> int:
    """Threads per CTA: `elements_per_thread` state elements each (64 by default), at least
    one warp, at most 1024."""
    return min(max(headdim * dstate // elements_per_thread, 32), 1024)


@dataclass(frozen=True)
class FlushConfig:
    """Static parameters of one compiled flush kernel (the compile-cache key)."""

    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    window: int
    ring_len: int  # positions in the ring buffers (window, or window + T for speculation)
    act: str  # dtype of x, B, C, z, ring_x, ring_B and out: 'bf16', 'fp16' or 'fp32'
    dt_dtype: str
    hi_format: str
    hi_rounding: str
    lo_format: str
    has_D: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    has_debug: bool
    # SR of the fp16 recurrence copy: random bits an element (32, 16, 13, 8) and Philox rounds
    # (1..10); the defaults (16, 7) unless hi_rounding is 'sr' (docs/design.md)
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS
    # 32 or 64: 32 halves the registers a thread holds, more warps resident per SM
    # (`default_elements_per_thread`)
    elements_per_thread: int = ELEMENTS_PER_THREAD
    # register cap as resident CTAs an SM (0: none; None: 1024 // threads with the direct
    # fold, i.e. 64 registers: 812.5 -> 794.1 us at batch 256; else 0)
    min_ctas_per_sm: int | None = None
    # a CTA loops over several slots (`decode_slot_ctas`), so that slots that do not flush
    # cost no CTA: the decode step's choice for fp32 hi without a table (618 -> 579 us with
    # every slot flushing; the fp16-SR + nvfp4 kernel compiles to 1.7x slower code with it)
    slot_loop: bool = False
    # a CTA's slot comes from the caller's table of flushing slots (the decode step's
    # `flush_slots`): CTAs for those slots only; a listed slot that does not flush is skipped
    slot_table: bool = False
    # how the ring is folded into the state: "fma" (L FFMAs an element), "mma" (tensor cores,
    # `_fold_mma`, through shared memory) or "direct" (tensor cores, transposed so that the
    # accumulators are the thread's own elements, `_fold_direct`); None: `default_fold`
    # (fp16-SR + nvfp4 at batch 256: fma 1,041.9, mma 990.1, direct 812.5 us)
    fold: str | None = None
    # state elements a thread handles as one piece: 8 (an NVFP4 block is a lane pair's) or 16
    # (a whole block a thread); None: 16 with the direct fold, and with the mma fold for an
    # fp16 copy (955.4 -> 905.7 us), else 8
    chunk: int | None = None

    def __post_init__(self):
        # for configs built directly (compile_flush's key): an unknown format would compile
        # another one's kernel
        for name, choices in (("hi_format", HI_FORMATS), ("hi_rounding", HI_ROUNDINGS),
                              ("lo_format", LO_FORMATS), ("act", ACTS),
                              ("dt_dtype", ACTS)):
            if getattr(self, name) not in choices:
                kv.fail(name, f"one of {choices}", repr(getattr(self, name)))
        if self.hi_format == "fp32" and self.hi_rounding != "rn":
            kv.fail("hi_rounding", "'rn' for an fp32 recurrence copy (its store is exact)",
                          repr(self.hi_rounding))
        sr = check_sr_settings(self.sr_bits, self.philox_rounds, self.hi_rounding, "hi_rounding")
        object.__setattr__(self, "sr_bits", sr[0])  # plain ints: one compile-cache key each
        object.__setattr__(self, "philox_rounds", sr[1])
        if not _is_int(self.window) or not 1 <= self.window <= 32:
            kv.fail("window", "an int in [1, 32]", repr(self.window))
        if not _is_int(self.ring_len) or self.ring_len < self.window:
            kv.fail("ring_len", f"an int >= window={self.window}", repr(self.ring_len))
        if not _is_int(self.ngroups) or self.ngroups < 1 or self.nheads % self.ngroups:
            kv.fail("ngroups", f"a divisor of nheads={self.nheads}", repr(self.ngroups))
        if self.elements_per_thread not in (32, 64) or isinstance(self.elements_per_thread, bool):
            kv.fail("elements_per_thread", "32 or 64", repr(self.elements_per_thread))
        if self.dstate not in (16, 32, 64, 128, 256):
            kv.fail("dstate", "a power of two in [16, 256]", repr(self.dstate))
        problem = _layout_problem(self.headdim, self.dstate, self.elements_per_thread)
        if problem is not None:  # (reported as "chunk: expected 8 here ..., got 8")
            kv.fail(f"headdim x dstate at {self.elements_per_thread} elements a thread",
                          problem[1], f"{self.headdim} x {self.dstate}")
        for name in ("has_D", "has_z", "has_dt_bias", "dt_softplus", "has_debug", "slot_loop",
                     "slot_table"):
            if not isinstance(getattr(self, name), bool):
                kv.fail(name, "a bool", repr(getattr(self, name)))
        if self.min_ctas_per_sm is not None and (not _is_int(self.min_ctas_per_sm)
                                                 or not 0 <= self.min_ctas_per_sm <= 32):
            kv.fail("min_ctas_per_sm", "None or an int in [0, 32]",
                          repr(self.min_ctas_per_sm))
        if self.fold is not None and self.fold not in FOLDS:
            kv.fail("fold", f"one of {FOLDS}", repr(self.fold))
        if self.chunk is not None and self.chunk not in CHUNKS:
            kv.fail("chunk", f"one of {CHUNKS}", repr(self.chunk))
        if self.chunk is None:  # 16 with the direct fold, or the mma fold and an fp16 copy
            fits = _layout_problem(self.headdim, self.dstate, self.elements_per_thread, 16)
            object.__setattr__(self, "chunk", 16 if fits is None else CHUNK)
            fold = self.fold or default_fold(self)
            if fold == "fma" or (fold == "mma" and self.hi_format != "fp16"):
                object.__setattr__(self, "chunk", CHUNK)
        if _layout_problem(self.headdim, self.dstate, self.elements_per_thread, self.chunk):
            kv.fail("chunk", f"8 here (the {self.headdim} x {self.dstate} head does not "
                          f"split into {self.chunk}s a thread)", repr(self.chunk))
        if self.fold is None:
            object.__setattr__(self, "fold", default_fold(self))
        problem = {"mma": mma_fold_problem, "direct": direct_fold_problem}.get(self.fold)
        if problem is not None and problem(self) is not None:
            kv.fail("fold", f"another fold here ({self.fold!r} needs {problem(self)})",
                          repr(self.fold))
        if self.min_ctas_per_sm is None:
            cap = max(1, 1024 // self.threads) if self.fold == "direct" else 0
            object.__setattr__(self, "min_ctas_per_sm", cap)
        if self.slot_loop and self.slot_table:
            kv.fail("slot_table", "False with slot_loop (a CTA takes one table entry)",
                          "True")

    @property
    def threads(self) -> int:
        return thread_count(self.headdim, self.dstate, self.elements_per_thread)

    @property
    def chunks_per_row(self) -> int:
        return self.dstate // self.chunk

    @property
    def rows_per_pass(self) -> int:
        return self.threads // self.chunks_per_row

    @property
    def passes(self) -> int:
        return self.headdim // self.rows_per_pass

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups

    @property
    def rows_per_warp(self) -> int:
        """State rows whose chunks one warp's threads hold (whole rows when a row's chunks
        fit in a warp)."""
        return 32 * self.headdim // self.threads

    @property
    def pieces(self) -> int:
        """Chunks a thread holds: one a pass, or two rows' (fold="direct")."""
        return 2 if self.fold == "direct" else self.passes

    @property
    def fold_k(self) -> int:
        """The window padded to the mma's k (16)."""
        return 16 * ((self.window + 15) // 16)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


FOLDS = ("fma", "mma", "direct")


def mma_fold_problem(cfg: FlushConfig):
    """None if the tensor-core fold applies to ``cfg``, else why not: bf16 activations (x_j
    and B_j are then exact mma operands), a row's chunks within one warp (dstate a power of
    two from 16 to 256), and 8 or 16 rows a warp (one mma m-tile)."""
    if cfg.act != "bf16":
        return "bf16 activations"
    R = cfg.chunks_per_row
    if cfg.dstate % 16 or 32 % R:
        return "dstate 16, 32, 64, 128 or 256"
    if cfg.rows_per_warp not in (8, 16):
        return "8 or 16 state rows a warp (headdim * 32 / threads)"
    return None


def direct_fold_problem(cfg: FlushConfig):
    """None if the transposed tensor-core fold applies (``fold="direct"``), else why not: bf16
    activations, dstate 128 (eight 16-column tiles, one a lane group), 16-element chunks and
    32 elements a thread (each warp 8 state rows, so headdim a multiple of 8, at most 256)."""
    if cfg.act != "bf16":
        return "bf16 activations"
    if cfg.dstate != 128:
        return "dstate 128"
    if cfg.chunk != 16 or cfg.elements_per_thread != 32:
        return "chunk=16 and elements_per_thread=32"
    if cfg.headdim % 8 or cfg.headdim > 256:
        return "headdim a multiple of 8, at most 256"
    return None


def default_fold(cfg: FlushConfig) -> str:
    """"direct" where it applies, else "mma" where it applies, else "fma"."""
    if direct_fold_problem(cfg) is None:
        return "direct"
    return "mma" if mma_fold_problem(cfg) is None else "fma"


def resident_ctas_per_sm(cfg: FlushConfig) -> int:
    """CTAs an SM holds: the register cap where there is one, else what 64 registers a thread
    would allow (an estimate: uncapped kernels ask for more)."""
    return cfg.min_ctas_per_sm or max(1, 1024 // cfg.threads)


def decode_slot_ctas(cfg: FlushConfig, batch: int, sm_count: int) -> int:
    """CTAs along the slot axis for a decode step's flush launch, where any number of slots
    (often none, in a staggered batch about one in `window`) flush: as many as fill one wave
    with the heads (`sm_count * min_ctas_per_sm` resident CTAs), so that a slot that does not
    flush costs a shared-memory read, not a CTA; never fewer than `threads` slots a CTA allows.
    A step where every slot flushes then runs in one wave of CTAs that loop over their slots
    (at batch 256 on the Nemotron layer 4 CTAs a head, 512 of 528 resident)."""
    per_wave = max(1, sm_count * resident_ctas_per_sm(cfg) // cfg.nheads)
    return max(min(batch, per_wave), -(-batch // cfg.threads))


TUNING_FIELDS = ("elements_per_thread", "fold", "chunk", "min_ctas_per_sm")


def check_flush_shape(view: kv.CacheView, elements_per_thread: int) -> None:
    """The flush kernel's limits on the head: dstate a power of two in [16, 256], and the
    head splitting into whole warps of whole chunks at ``elements_per_thread``."""
    P, N = view.headdim, view.dstate
    if N not in (16, 32, 64, 128, 256):
        kv.fail("cache.hi.shape[3] (dstate)", "a power of two in [16, 256]", N)
    problem = _layout_problem(P, N, elements_per_thread)
    if problem is not None and problem[0] == "headdim":
        kv.fail("cache.hi.shape[2] (headdim)", problem[1], P)
    if problem is not None:
        kv.fail("cache.hi.shape[2:] (headdim x dstate)", problem[1],
                f"{P} x {N} ({thread_count(P, N, elements_per_thread)} threads)")


def flush_config(cache: kv.ReplayCache, view: kv.CacheView, x, dt, D=None, z=None,
                 dt_bias=None, *, dt_softplus=True, has_debug=False) -> FlushConfig:
    """The flush kernel's configuration for a checked cache and step (defaults filled in:
    `default_elements_per_thread`, `default_fold`, the chunk and the register cap)."""
    kv.check_switch("dt_softplus", dt_softplus)
    ept = default_elements_per_thread(view.headdim, view.dstate, cache.hi_format)
    check_flush_shape(view, ept)
    return FlushConfig(
        nheads=view.nheads, headdim=view.headdim, dstate=view.dstate, ngroups=view.ngroups,
        window=cache.window, ring_len=view.ring_len, act=kv.ACT_DTYPES[x.dtype],
        dt_dtype=kv.ACT_DTYPES[dt.dtype], hi_format=cache.hi_format,
        hi_rounding=cache.hi_rounding, lo_format=cache.lo_format, has_D=D is not None,
        has_z=z is not None, has_dt_bias=dt_bias is not None, dt_softplus=dt_softplus,
        has_debug=has_debug, sr_bits=cache.sr_bits, philox_rounds=cache.philox_rounds,
        elements_per_thread=ept,
    )


def _tuned(cfg: FlushConfig, config) -> FlushConfig:
    """``config`` where it differs from ``cfg`` only in TUNING_FIELDS, else a ValueError."""
    if config is None:
        return cfg
    if not isinstance(config, FlushConfig):
        kv.fail("config", "None or a FlushConfig", type(config).__name__)
    for f in dataclasses.fields(FlushConfig):
        if f.name not in TUNING_FIELDS and getattr(config, f.name) != getattr(cfg, f.name):
            kv.fail(f"config.{f.name}", f"{getattr(cfg, f.name)!r} (these arguments')",
                    repr(getattr(config, f.name)))
    return config
