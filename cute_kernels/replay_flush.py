"""Mamba-2 ReplaySSM flush kernel (CuTe DSL): fold the ring into a new checkpoint and store it
twice, the recurrence copy (hi) with FP16 SR and the read copy (lo) with NVFP4 RN.

For every slot `s` whose step is a flush (`cursors[s] + 1 == window`; other slots exit at
once), per head `h` (one CTA owns one (slot, head) state, `headdim x dstate`):

    record      the current (x, dt, B) is appended at ring position window - 1
                (dt after dt_bias and softplus; B by the first head of each group)
    S_new       = g_{0:L-1} S_hi + sum_j g_{j+1:L-1} dt_j x_j B_j^T           (fp32)
    y           = S_new C + D x, times silu(z) if z is given                    (fp32 -> out)
    hi          <- fp16 SR of S_new with words lowprec.philox.random_words(seed, s, flushes[s])
                   (element e: word e % 4 of the counter e // 4)
                   (or fp16 RN, or fp32 exact)
    lo          <- RN of S_new in lo_format: nvfp4 (E2M1 codes two per byte, low nibble = even
                   index; E4M3 scale per 16 along dstate; fp32 scale per (slot, head) from the
                   amax of the whole state), fp8_e4m3, fp16, fp32 or none
    counters    cursors[s] = 0, flushes[s] += 1   (a second, tiny kernel; see below)

`lo_format='none'` with `hi_format='fp32'` is the single-copy FP32 ReplaySSM flush baseline.
`debug_state` (fp32, state-shaped) receives the unrounded S_new, so tests can check the stored
codes against `lowprec` applied to it, bit for bit.

Thread ownership with the direct fold (the default at dstate 128 with bf16 activations: 32
elements a thread, 16-element chunks): warp w holds rows 8w .. 8w + 7, lane (q, t) = (lane //
4, lane % 4) rows 8w + 2t + i (i = 0, 1), columns 16q .. 16q + 15 of each: a whole NVFP4
block a row, which is where the transposed mma's accumulators land (`_fold_direct`).

Thread ownership otherwise (one CTA per (slot, head); T threads, 64 state elements per
thread, 8-element chunks; drawn for the Nemotron-3-Super head, headdim 64 x dstate 128, T =
128; 16-element chunks put a whole block on a thread the same way):

    state row p, 16 chunks of 8 elements (16 B of fp16 hi, 4 B of nvfp4 codes)
             chunk  0    1    2   ...  15
    p =  0        t0   t1   t2  ...  t15        thread t owns chunk c = t % 16
    p =  1        t16  t17  t18 ...  t31        of rows p = t // 16 + 8 i, i = 0..7
     ...
    p =  7        t112 ...           t127
    p =  8        t0   t1   ...              (pass i = 1: the same threads, 8 rows down)

A warp touches 2 rows = 512 contiguous bytes of fp16 hi per pass: every hi access is one
128-bit load or store, coalesced across the warp (fp32 hi: two, 1 KiB per warp). An NVFP4
block (16 elements) is the chunk pair (t, t ^ 1): block amax takes one shuffle, each thread
writes its 4 code bytes (a 32-bit store, 128 B per warp) and the even thread the scale byte.
The head's amax is a CTA reduction before any code is written: all 64 values stay in
registers, and the recurrence copy is stored before that reduction's barrier.

Ring term: the CTA stages x_j (window x headdim, fp32) and the decay weights w_j = exp(A
(cum_{L-1} - cum_j)) dt_j (a warp scan over the window's dt) in shared memory, and B_j
(window x dstate): as bf16 rows for the tensor cores (`fold="mma"`: each warp computes its
own rows of sum_j (w_j x_j) B_j^T with mma.sync, w_j x_j split into three bf16 parts whose sum
is exact, and reads them back through its own rows of shared memory; `_fold_mma`), as bf16
rows with permuted columns for `fold="direct"` (the same products transposed, so that the
accumulators are the thread's elements; `_fold_direct`), or as fp32 rows for `fold="fma"`
(each thread window x 32 or 64 FFMAs). The defaults (`FlushConfig`): the direct fold where it
applies, else the mma fold for bf16 activations, else FFMAs. y: each row's partial dot
products meet in a shuffle reduction over its lanes.

Counters. Every CTA of a slot reads `cursors[s]` (is this a flush?) and `flushes[s]` (its
Philox words), so no CTA may change them while siblings may still read them. The flush kernel
therefore only reads them; `replay_flush` then launches a one-thread-per-slot kernel that
resets the cursors and advances the flush counters of the slots that flushed. The decision
input is a separate argument of the launch helper, so `replay_decode_step` can hand it a
snapshot taken before the non-flush kernel advanced the other slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass  # noqa: I001
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint8, Uint32
from cutlass.memory import SmemAllocator

from cute_kernels import _compile
from cute_kernels import numerics as nm
from cute_kernels import tensor_core as tc
from cute_kernels._compile import require_cuda
from lowprec.philox import ELEMENT_LIMIT, SLOT_LIMIT
from lowprec.replay import check_counter_ranges

__all__ = [
    "FlushConfig",
    "replay_flush",
    "launch_flush",
    "launch_advance_counters",
    "compile_flush",
    "traffic_bytes",
    "default_elements_per_thread",
    "default_fold",
    "mma_fold_problem",
    "direct_fold_problem",
]

HI_FORMATS = ("fp16", "fp32")
HI_ROUNDINGS = ("sr", "rn")
LO_FORMATS = ("nvfp4", "fp8_e4m3", "fp16", "fp32", "none")
ACT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CUTE_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}

CHUNK = 8  # state elements per thread access: 16 B of fp16, 32 B of fp32, 4 B of nvfp4 codes
# (FlushConfig.chunk: 16 gives a thread a whole NVFP4 block); the ring is staged in chunks of 8
CHUNKS = (8, 16)
ELEMENTS_PER_THREAD = 64  # registers held per thread for the head's amax (nvfp4); the layout
# that fits every accepted shape. replay_flush defaults to 32 for an fp16 recurrence copy where
# the shape allows it: measured on the H200 (2026-11-29, `python -m cute_kernels.bench_write`,
# fp16-SR + nvfp4, Nemotron layer, L = 16): batch 256 1,452.8 -> 1,098.9 us, batch 8
# 49.4 -> 43.4 us, batch 1 16.9 -> 9.4 us (256 threads at 79 registers: 24 warps resident per
# SM, not 16). The fp32 single copy is faster at 64: 847.9 us against 928.9 us at batch 256.
# Capping the 32 layout at 64 registers (FlushConfig.min_ctas_per_sm = 4, 3 spills) was
# slower: 1,113.1 against 1,093.9 us (results/gpu_first_timing/bench_write_4.csv). With the
# leaner NVFP4 encode (hardware E4M3 conversions) the default takes 1,035.0 us and the cap
# 1,026.7 (bench_write_6.csv): within 1%, so the cap stayed off; with the direct fold it is on
# (FlushConfig.min_ctas_per_sm).
NVFP4_BLOCK = 16
E2M1_E4M3_MAX = 2688.0  # 448 * 6
E2M1_MAX = 6.0


def default_elements_per_thread(headdim: int, dstate: int, hi_format: str = "fp16") -> int:
    """For an fp16 recurrence copy 32 where the head takes whole warps and at most 1024
    threads that way (the direct fold's layout where it applies), else 64. The fp32 copy
    takes 64 (the mma fold): in the benchmark (batch 256) it took 652.2 us there (run of
    caae136) and 769.5 with the direct fold at 32 (run of da68876), though bench_write had
    the direct fold ahead, 785.6 against 799.6 (bench_write_8c.csv)."""
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
    # 32 halves the registers a thread holds (twice the threads per CTA): more warps resident
    # per SM to hide the load-compute-store phases; replay_flush's default where it fits
    # (default_elements_per_thread; timings at ELEMENTS_PER_THREAD).
    elements_per_thread: int = ELEMENTS_PER_THREAD
    # resident CTAs per SM that ptxas must leave registers for (0: no cap; None: with the
    # direct fold 1024 // threads, which caps it at 64 registers (4 CTAs at 256 threads, 2 at
    # 512: uncapped that one asks for 87 and so runs 1 CTA an SM; measured at 256 only), else
    # 0). Measured (bench_write_8.csv, batch 256, fp16-SR + nvfp4): direct fold 812.5 -> 794.1
    # us with 4
    min_ctas_per_sm: int | None = None
    # a CTA loops over several slots (`decode_slot_ctas`), so that in a decode step where few
    # slots flush the others cost no CTA (a CTA a slot and head: the staggered step at batch
    # 256, L = 16, took 140 us against 114 for the same kernels on the flushing slots alone).
    # replay_decode_step uses it for fp32 hi without a table: measured on the H200 with every slot
    # flushing (scripts/flush_slot_loop_probe.py, batch 256), fp32 618 -> 579 us with one slot
    # a CTA, 637 at one wave; fp16-SR + nvfp4 740 -> 1,277 us even with one slot a CTA, its
    # SASS 58.9 -> 63.6 instructions an element at 32 a thread and 27 more spill accesses at
    # the 64-register cap (why it is that much slower is not known).
    slot_loop: bool = False
    # a CTA's slot comes from a table of the flushing slots that the caller fills (grid: heads
    # x table length), so that a decode step launches CTAs for those slots only
    # (replay_decode_step's `flush_slots`); a slot in the table that does not flush is skipped
    slot_table: bool = False
    # the shared-memory carveout asked of the driver, percent of the SM's unified L1/shared
    # storage (-1: the driver's choice); a tuning knob: with the tensor-core fold a CTA holds
    # about 44 KB of shared memory, and ncu found 3 CTAs an SM the limit of both registers
    # (73) and shared memory (results/ncu/ncu_stalls_cute_flush_fp16sr_nvfp4.txt.gz). Measured
    # (bench_write_occupancy_7.csv, batch 256, fp16-SR + nvfp4): default 986.3 us, carveout
    # 100 983.5, min_ctas_per_sm=4 (64 registers, 5 spill loads) 965.5, both 965.2; the cap
    # alone was 968.6 against 990.1 in an earlier call (bench_write_7.csv): about 2%; with the
    # direct fold (9 KB of shared memory) the cap is the default (min_ctas_per_sm)
    smem_carveout: int = -1
    # how the ring is folded into the state: "fma" (each thread L FFMAs per element, B_j and
    # x_j from fp32 shared memory), "mma" (tensor cores, `_fold_mma`, the result through
    # shared memory into each thread's chunks; bf16 activations and the shapes
    # `mma_fold_problem` accepts) or "direct" (tensor cores, transposed so that the
    # accumulators are the thread's own elements, `_fold_direct`; `direct_fold_problem`);
    # None: `default_fold`. H200, Nemotron layer, batch 256, L = 16 (`python -m
    # cute_kernels.bench_write`): fp16-SR + nvfp4 flush FFMA fold 1,041.9 -> mma 990.1 us
    # (bench_write_7.csv); mma 905.7 -> direct 812.5 us at 16-element chunks
    # (bench_write_8.csv); fp32 single copy FFMA 849.8 -> mma 800.5 us (bench_write_7.csv),
    # direct 849.7 at 32 elements a thread against mma 796.6 at 64 (bench_write_8.csv)
    fold: str | None = None
    # state elements a thread loads, folds and stores as one piece: 8 (16 B of fp16; an NVFP4
    # block is a lane pair's, its amax one shuffle) or 16 (a whole block a thread: the block's
    # scale, reciprocal and code word once per 16 elements); None: 16 with the direct fold,
    # and with the mma fold for an fp16 copy, where the head splits into 16s; else 8 (the
    # FFMA fold at 16 took 1,715.3 against 1,011.3 us, bench_write_8b.csv). fp16-SR + nvfp4,
    # mma fold: 955.4 -> 905.7 us (bench_write_8.csv; 66.4 -> 60.9 SASS instructions per
    # element)
    chunk: int | None = None
    # issue every load that the ring staging needs (this thread's x and B chunks, warp 0's
    # dt values) before any shared-memory store, so that a CTA waits out one round trip
    # before its barrier; False: the earlier order (x chunks loaded and stored, then B's,
    # then warp 0's dt loads), two to four round trips in turn. H200, batch 256, both with D
    # and z loaded with the state (bench_write_9.csv): fp16-SR + nvfp4 779.6 -> 768.0 us (the
    # flush is ALU-bound), fp32 single copy 669.9 -> 597.6 us (90% of copy)
    ring_loads_first: bool = True
    # NVFP4 codes two at a time (numerics.e2m1_pair_fast: elements e and e + 4 of a code
    # word converted to fp16 by one truncating cvt, clamped by one packed min, the code and
    # sign read off the bits) instead of one at a time (numerics.e2m1_quotient_fast: a magic
    # add, a multiply and a nearness test an element). Either way the stored codes are
    # lowprec's; the rare elements near a decision point take the division. fp16-SR + nvfp4
    # SASS instructions an element on the fast paths (`python -m
    # cute_kernels.instruction_count`): 55.3 -> 49.0 at 32 elements a thread, 46.7 -> 40.2 at
    # 64; the encode's share (fp16-RN + nvfp4 less fp16-RN alone) 23.8 -> 16.7 at 32
    e2m1_pairs: bool = True
    # timing only (the outputs are wrong): "loads" makes every value the flush would load
    # from global memory (the recurrence copy, the ring's x, B and dt records, this step's x,
    # dt, B, C and z, A, D and dt_bias) out of the thread index instead, and keeps everything
    # else: the staging in shared memory and its barrier, the fold, the output, every store.
    # What is left of the time is the flush without its loads' round trips (and its read
    # traffic): the bound of hiding them, e.g. by a CTA that walks a group's heads and loads
    # the next head's state during this head's work. The cursor and the flush counter are
    # still read (they decide whether the CTA flushes and which Philox words it takes).
    ablate: tuple = ()

    def __post_init__(self):
        # what replay_flush checks on its arguments, for configs built directly (compile_flush,
        # bench_write, instruction_count): an unknown format compiled another one's kernel
        for name, choices in (("hi_format", HI_FORMATS), ("hi_rounding", HI_ROUNDINGS),
                              ("lo_format", LO_FORMATS), ("act", tuple(CUTE_DTYPES)),
                              ("dt_dtype", tuple(CUTE_DTYPES))):
            check_choice(name, getattr(self, name), choices)
        if self.hi_format == "fp32" and self.hi_rounding != "rn":
            _compile.fail("hi_rounding", "'rn' for an fp32 recurrence copy (its store is exact)",
                          repr(self.hi_rounding))
        if not _is_int(self.window) or not 1 <= self.window <= 32:
            _compile.fail("window", "an int in [1, 32]", repr(self.window))
        if not _is_int(self.ring_len) or self.ring_len < self.window:
            _compile.fail("ring_len", f"an int >= window={self.window}", repr(self.ring_len))
        if not _is_int(self.ngroups) or self.ngroups < 1 or self.nheads % self.ngroups:
            _compile.fail("ngroups", f"a divisor of nheads={self.nheads}", repr(self.ngroups))
        if self.elements_per_thread not in (32, 64) or isinstance(self.elements_per_thread, bool):
            _compile.fail("elements_per_thread", "32 or 64", repr(self.elements_per_thread))
        if self.dstate not in (16, 32, 64, 128, 256):
            _compile.fail("dstate", "a power of two in [16, 256]", repr(self.dstate))
        problem = _layout_problem(self.headdim, self.dstate, self.elements_per_thread)
        if problem is not None:  # (reported as "chunk: expected 8 here ..., got 8")
            _compile.fail(f"headdim x dstate at {self.elements_per_thread} elements a thread",
                          problem[1], f"{self.headdim} x {self.dstate}")
        for name in ("has_D", "has_z", "has_dt_bias", "dt_softplus", "has_debug", "slot_loop",
                     "slot_table", "ring_loads_first"):
            if not isinstance(getattr(self, name), bool):
                _compile.fail(name, "a bool", repr(getattr(self, name)))
        if self.min_ctas_per_sm is not None and (not _is_int(self.min_ctas_per_sm)
                                                 or not 0 <= self.min_ctas_per_sm <= 32):
            _compile.fail("min_ctas_per_sm", "None or an int in [0, 32]",
                          repr(self.min_ctas_per_sm))
        if not _is_int(self.smem_carveout) or not -1 <= self.smem_carveout <= 100:
            _compile.fail("smem_carveout", "-1 (the driver's choice) or a percent in [0, 100]",
                          repr(self.smem_carveout))
        if self.fold is not None and self.fold not in FOLDS:
            _compile.fail("fold", f"one of {FOLDS}", repr(self.fold))
        if self.chunk is not None and self.chunk not in CHUNKS:
            _compile.fail("chunk", f"one of {CHUNKS}", repr(self.chunk))
        if self.chunk is None:  # 16 with the direct fold, or the mma fold and an fp16 copy
            fits = _layout_problem(self.headdim, self.dstate, self.elements_per_thread, 16)
            object.__setattr__(self, "chunk", 16 if fits is None else CHUNK)
            fold = self.fold or default_fold(self)
            if fold == "fma" or (fold == "mma" and self.hi_format != "fp16"):
                object.__setattr__(self, "chunk", CHUNK)
        if _layout_problem(self.headdim, self.dstate, self.elements_per_thread, self.chunk):
            _compile.fail("chunk", f"8 here (the {self.headdim} x {self.dstate} head does not "
                          f"split into {self.chunk}s a thread)", repr(self.chunk))
        if self.fold is None:
            object.__setattr__(self, "fold", default_fold(self))
        problem = {"mma": mma_fold_problem, "direct": direct_fold_problem}.get(self.fold)
        if problem is not None and problem(self) is not None:
            _compile.fail("fold", f"another fold here ({self.fold!r} needs {problem(self)})",
                          repr(self.fold))
        if self.min_ctas_per_sm is None:
            cap = max(1, 1024 // self.threads) if self.fold == "direct" else 0
            object.__setattr__(self, "min_ctas_per_sm", cap)
        if not isinstance(self.e2m1_pairs, bool):
            _compile.fail("e2m1_pairs", "a bool", repr(self.e2m1_pairs))
        if (not isinstance(self.ablate, tuple) or not set(self.ablate) <= set(FLUSH_ABLATIONS)
                or (self.ablate and not self.ring_loads_first)):
            _compile.fail("ablate", f"a tuple of {FLUSH_ABLATIONS} (with ring_loads_first)",
                          repr(self.ablate))
        if self.slot_loop and self.slot_table:
            _compile.fail("slot_table", "False with slot_loop (a CTA takes one table entry)",
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
FLUSH_ABLATIONS = ("loads",)  # FlushConfig.ablate: timing only


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


class ReplayFlush:
    """Host side (`__call__`: tensors from pointers, launch) and device side (`kernel`)."""

    def __init__(self, config: FlushConfig):
        self.cfg = config

    @cute.jit
    def __call__(
        self,
        p_hi: cute.Pointer,
        p_lo_codes: cute.Pointer,
        p_lo_scales: cute.Pointer,
        p_lo_global: cute.Pointer,
        p_ring_x: cute.Pointer,
        p_ring_dt: cute.Pointer,
        p_ring_B: cute.Pointer,
        p_decision: cute.Pointer,
        p_flushes: cute.Pointer,
        p_x: cute.Pointer,
        p_dt: cute.Pointer,
        p_A: cute.Pointer,
        p_B: cute.Pointer,
        p_C: cute.Pointer,
        p_D: cute.Pointer,
        p_z: cute.Pointer,
        p_dt_bias: cute.Pointer,
        p_out: cute.Pointer,
        p_debug: cute.Pointer,
        p_slot_table: cute.Pointer,
        batch: Int32,
        slot_ctas: Int32,
        seed_lo: Uint32,
        seed_hi: Uint32,
        stream,
    ):
        cfg = self.cfg
        H, P, N, G, L = cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups, cfg.ring_len
        state = (batch, H, P, N)
        hi = cute.make_tensor(p_hi, cute.make_layout(state, stride=(H * P * N, P * N, N, 1)))
        lo_codes = _lo_codes_tensor(cfg, p_lo_codes, batch)
        lo_scales = cute.make_tensor(
            p_lo_scales,
            cute.make_layout(
                (batch, H, P, N // NVFP4_BLOCK),
                stride=(H * P * N // NVFP4_BLOCK, P * N // NVFP4_BLOCK, N // NVFP4_BLOCK, 1),
            ),
        )
        lo_global = cute.make_tensor(p_lo_global, cute.make_layout((batch, H), stride=(H, 1)))
        ring_x = cute.make_tensor(
            p_ring_x, cute.make_layout((batch, H, L, P), stride=(H * L * P, L * P, P, 1))
        )
        ring_dt = cute.make_tensor(p_ring_dt, cute.make_layout((batch, H, L), stride=(H * L, L, 1)))
        ring_B = cute.make_tensor(
            p_ring_B, cute.make_layout((batch, G, L, N), stride=(G * L * N, L * N, N, 1))
        )
        decision = cute.make_tensor(p_decision, cute.make_layout(batch))
        flushes = cute.make_tensor(p_flushes, cute.make_layout(batch))
        x = cute.make_tensor(p_x, cute.make_layout((batch, H, P), stride=(H * P, P, 1)))
        dt = cute.make_tensor(p_dt, cute.make_layout((batch, H), stride=(H, 1)))
        A = cute.make_tensor(p_A, cute.make_layout(H))
        B = cute.make_tensor(p_B, cute.make_layout((batch, G, N), stride=(G * N, N, 1)))
        C = cute.make_tensor(p_C, cute.make_layout((batch, G, N), stride=(G * N, N, 1)))
        D = cute.make_tensor(p_D, cute.make_layout(H))
        z = cute.make_tensor(p_z, cute.make_layout((batch, H, P), stride=(H * P, P, 1)))
        dt_bias = cute.make_tensor(p_dt_bias, cute.make_layout(H))
        out = cute.make_tensor(p_out, cute.make_layout((batch, H, P), stride=(H * P, P, 1)))
        debug = cute.make_tensor(p_debug, cute.make_layout(state, stride=(H * P * N, P * N, N, 1)))
        slot_table = cute.make_tensor(p_slot_table, cute.make_layout(slot_ctas))
        self.kernel(
            hi,
            lo_codes,
            lo_scales,
            lo_global,
            ring_x,
            ring_dt,
            ring_B,
            decision,
            flushes,
            x,
            dt,
            A,
            B,
            C,
            D,
            z,
            dt_bias,
            out,
            debug,
            slot_table,
            batch,
            slot_ctas,
            seed_lo,
            seed_hi,
        ).launch(
            grid=[H, slot_ctas, 1],
            block=[cfg.threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=cfg.min_ctas_per_sm,
            # -1: the driver's default, named so that compiling needs no GPU
            preferred_smem_carveout=cfg.smem_carveout,
        )

    @cute.kernel
    def kernel(
        self,
        hi: cute.Tensor,
        lo_codes: cute.Tensor,
        lo_scales: cute.Tensor,
        lo_global: cute.Tensor,
        ring_x: cute.Tensor,
        ring_dt: cute.Tensor,
        ring_B: cute.Tensor,
        decision: cute.Tensor,
        flushes: cute.Tensor,
        x: cute.Tensor,
        dt: cute.Tensor,
        A: cute.Tensor,
        B: cute.Tensor,
        C: cute.Tensor,
        D: cute.Tensor,
        z: cute.Tensor,
        dt_bias: cute.Tensor,
        out: cute.Tensor,
        debug: cute.Tensor,
        slot_table: cute.Tensor,
        batch: Int32,
        slot_ctas: Int32,
        seed_lo: Uint32,
        seed_hi: Uint32,
    ):
        cfg = self.cfg
        P, N, L = cfg.headdim, cfg.dstate, cfg.window
        R, rows, passes, T = cfg.chunks_per_row, cfg.rows_per_pass, cfg.passes, cfg.threads
        W = cfg.chunk  # state elements a chunk
        tidx, _, _ = cute.arch.thread_idx()
        h, first_slot, _ = cute.arch.block_idx()
        g = h // cfg.heads_per_group
        direct = cfg.fold == "direct"
        pieces = cfg.pieces
        if cutlass.const_expr(direct):
            # lane (q, t) of warp w: rows 8w + 2t + i (i = 0, 1), columns 16q .. 16q + 15,
            # which is where the transposed fold's accumulators land (_fold_direct)
            col = (tidx % 32) // 4
            row0 = 8 * (tidx // 32) + 2 * (tidx % 4)
            rows = 1
        else:
            col = tidx % R  # this thread's chunk: state columns col*W .. col*W+W-1
            row0 = tidx // R  # its rows: row0 + rows*i

        smem = SmemAllocator()
        mma = cfg.fold == "mma"
        K = cfg.fold_k
        if cutlass.const_expr(direct):
            # bf16 B_j rows, k-major, columns in the order of the transposed fold's m index
            # (_direct_position); padded as below
            sB = smem.allocate_tensor(
                cutlass.BFloat16, cute.make_layout((K, N + 8), stride=(N + 8, 1)), 16
            )
        elif cutlass.const_expr(mma):
            # bf16 B_j rows (k-major for ldmatrix.trans; rows L..K-1 zero), padded by 16 bytes
            # a row so that the 8 rows of a tile fall in different banks; the warp-private
            # fp32 fold result, padded likewise for the fragments' 8-byte stores
            sB = smem.allocate_tensor(
                cutlass.BFloat16, cute.make_layout((K, N + 8), stride=(N + 8, 1)), 16
            )
            sD = smem.allocate_tensor(Float32, cute.make_layout((P, N + 8), stride=(N + 8, 1)), 16)
        else:
            sB = smem.allocate_tensor(Float32, cute.make_layout((L, N), stride=(N, 1)), 16)
        sX = smem.allocate_tensor(Float32, cute.make_layout((L, P), stride=(P, 1)), 16)
        sW = smem.allocate_tensor(Float32, cute.make_layout(64), 16)  # w_j; [L]: g_{0:L-1}
        sRed = smem.allocate_tensor(Float32, cute.make_layout(32), 16)
        # The CTA's slots: first_slot alone (replay_flush's launch, a CTA a slot and head);
        # the table's entry first_slot (slot_table: replay_decode_step given `flush_slots`);
        # or first_slot, first_slot + slot_ctas, ... (slot_loop: replay_decode_step's fp32
        # flush without a table), whose decisions come in with one load a thread before the
        # loop (the launch makes sure a CTA has at most `threads` slots). A CTA for every slot
        # and head made a decode step with no slot flushing take 85.1 us at batch 256 against
        # 62.5 with the table (results/README.md, "Staggered batches"). sDecision is only used
        # by slot_loop.
        sDecision = smem.allocate_tensor(Int32, cute.make_layout(T), 16)
        slots_here = Int32(1)
        if cutlass.const_expr(cfg.slot_loop):
            slots_here = (batch - first_slot + slot_ctas - 1) // slot_ctas
            if tidx < slots_here:
                sDecision[tidx] = decision[first_slot + slot_ctas * tidx]
            cute.arch.sync_threads()

        slot0 = first_slot
        if cutlass.const_expr(cfg.slot_table):
            slot0 = slot_table[first_slot]
        for k in cutlass.range(slots_here, unroll=1):
            s = slot0 + slot_ctas * k
            if (sDecision[k] if cutlass.const_expr(cfg.slot_loop) else decision[s]) == L - 1:
                flush = Uint32(flushes[s])
                hi_h = hi[s, h, None, None]  # (P, N):(N, 1)

                # 1. the recurrence copy, all loads in flight before the ring is staged
                acc = []
                hi_frags = []
                no_loads = "loads" in cfg.ablate
                for i in cutlass.range_constexpr(pieces):
                    hi_frag = cute.make_rmem_tensor((W,), hi.element_type)
                    if cutlass.const_expr(no_loads):  # timing only
                        _fill_from_index(hi_frag, tidx + 64 * i)
                    else:
                        cute.autovec_copy(_chunk(hi_h, row0 + rows * i, col, W), hi_frag)
                    hi_frags.append(hi_frag)
                    if cutlass.const_expr(not direct):
                        acc.append(hi_frag.load().to(Float32))
                # C, D and z for the output, in flight with the state (each would wait out a
                # round trip after the barrier)
                piece_rows = [row0 + rows * i for i in range(pieces)]
                d_h, z_rows = _gate_inputs(cfg, s, h, piece_rows, D, z)
                c_frag = cute.make_rmem_tensor((W,), C.element_type)
                if cutlass.const_expr(no_loads):
                    _fill_from_index(c_frag, col)
                else:
                    cute.autovec_copy(cute.local_tile(C[s, g, None], (W,), (col,)), c_frag)

                # 2. stage the ring in fp32 shared memory and append the current record
                if cutlass.const_expr(cfg.ring_loads_first):
                    # every load first (the ring's x and B chunks, warp 0's dt values), in flight
                    # with the state's; then the shared-memory stores and warp 0's decay weights:
                    # one round trip before the barrier instead of one for x, one for B and one
                    # or two for warp 0's dt chain
                    x_frags, b_frags = _load_ring(cfg, tidx, s, h, g, x, ring_x, B, ring_B)
                    dt_in = _load_decay_inputs(cfg, tidx % 32, s, h, ring_dt, dt, A, dt_bias)
                    _store_ring(cfg, tidx, s, h, g, x_frags, b_frags, ring_x, ring_B, sX, sB)
                    if tidx < 32:
                        _decay_weights(cfg, tidx, s, h, ring_dt, dt_in, sW)
                else:
                    _stage_ring_in_turn(cfg, tidx, s, h, g, x, ring_x, B, ring_B, sX, sB)
                    if tidx < 32:
                        _decay_weights(cfg, tidx, s, h, ring_dt,
                                       _load_decay_inputs(cfg, tidx, s, h, ring_dt, dt, A, dt_bias),
                                       sW)
                cute.arch.sync_threads()

                # 3. S_new = g S_hi + sum_j (w_j x_j) B_j^T, fp32
                decay = sW[L]
                if cutlass.const_expr(direct):
                    # the accumulators of the transposed fold are this thread's elements: no
                    # shared-memory round trip
                    acc_frags = [cute.make_rmem_tensor((W,), Float32) for _ in range(pieces)]
                    _fold_direct(cfg, tidx, sX, sW, sB, hi_frags, decay, acc_frags)
                    acc = [frag.load() for frag in acc_frags]
                elif cutlass.const_expr(mma):
                    # the warp's rows of sum_j (w_j x_j) B_j^T on the tensor cores, through its
                    # own rows of sD into each thread's chunks: no CTA barrier
                    _fold_mma(cfg, tidx, sX, sW, sB, sD)
                    cute.arch.sync_warp()
                    warp_rows = (tidx // 32) * cfg.rows_per_warp + (tidx % 32) // R
                    for i in cutlass.range_constexpr(passes):
                        d_frag = cute.make_rmem_tensor((W,), Float32)
                        cute.autovec_copy(
                            cute.local_tile(sD[warp_rows + (32 // R) * i, None], (W,), (col,)),
                            d_frag,
                        )
                        acc[i] = acc[i] * decay + d_frag.load()
                else:
                    for i in cutlass.range_constexpr(passes):
                        acc[i] = acc[i] * decay
                    for j in cutlass.range_constexpr(L):
                        sb_frag = cute.make_rmem_tensor((W,), Float32)
                        cute.autovec_copy(cute.local_tile(sB[j, None], (W,), (col,)), sb_frag)
                        b_vec = sb_frag.load()
                        w = sW[j]
                        for i in cutlass.range_constexpr(passes):
                            acc[i] = acc[i] + (sX[j, row0 + rows * i] * w) * b_vec

                # 4. y = S_new C + D x [* silu(z)]: a row's lanes meet in a shuffle reduction
                c_vec = c_frag.load().to(Float32)
                for i in cutlass.range_constexpr(pieces):
                    p = row0 + rows * i
                    part = (acc[i] * c_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    if cutlass.const_expr(direct):  # a row's 8 lanes: lane bits 2-4
                        total = part
                        for offset in (4, 8, 16):
                            total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
                    else:
                        total = cute.arch.warp_reduction(part, _add, threads_in_group=R)
                    if col == 0:
                        out[s, h, p] = _gate(cfg, total, sX[L - 1, p], d_h, z_rows[i]).to(
                            out.element_type
                        )

                # 5. stores, one chunk at a time so that each chunk's values die after its stores
                # (all chunks at once spilled: SR words and codes for 64 values do not fit); the
                # recurrence copy first, then (after the barrier of the head's amax) nvfp4
                keys = nm.philox_keys(seed_lo, seed_hi)
                _, counter_hi = nm.state_counter(Uint32(s), flush, Uint32(0))
                nvfp4 = cfg.lo_format == "nvfp4"
                block_amax = []  # per chunk max |S|: the head's amax and each block's scale
                if cutlass.const_expr(nvfp4):
                    block_amax = [_chunk_amax(acc[i], W) for i in range(pieces)]
                    _publish_warp_amax(block_amax, tidx, sRed)
                debug_h = debug[s, h, None, None]
                hi_bits = cute.make_tensor(
                    cute.recast_ptr(hi_h.iterator, dtype=Uint32),
                    cute.make_layout((P, N // 2), stride=(N // 2, 1)),
                )
                lo_h = lo_codes[s, h, None, None]
                scales_h = lo_scales[s, h, None, None]
                for i in cutlass.range_constexpr(pieces):
                    p = row0 + rows * i
                    if cutlass.const_expr(cfg.has_debug):
                        debug_frag = cute.make_rmem_tensor((W,), Float32)
                        debug_frag.store(acc[i])
                        cute.autovec_copy(debug_frag, _chunk(debug_h, p, col, W))
                    element0 = Uint32((h * P + p) * N) + Uint32(col * W)  # a multiple of 8
                    counter_lo0, _ = nm.state_counter(Uint32(s), flush, element0 >> Uint32(2))
                    _store_hi_chunk(cfg, hi_h, hi_bits, acc[i], p, col, counter_lo0, counter_hi,
                                    keys)
                    if cutlass.const_expr(cfg.lo_format not in ("none", "nvfp4")):
                        _store_lo_chunk(cfg, lo_h, acc[i], p, col)
                if cutlass.const_expr(nvfp4):
                    # the recurrence copy goes out before the barrier that the head's amax needs
                    # (bench_write_8.csv, direct fold: 812.5 -> 809.1 us, and 794.1 -> 788.1 with
                    # 4 CTAs an SM)
                    global_scale = _head_global_scale(T, sRed)
                    if tidx == 0:
                        lo_global[s, h] = global_scale
                    for i in cutlass.range_constexpr(pieces):
                        p = row0 + rows * i
                        _store_nvfp4_chunk(W, lo_h, scales_h, acc[i], block_amax[i], p, col,
                                           global_scale, cfg.e2m1_pairs)
                if k + 1 < slots_here:  # the next slot's staging reuses sX, sB, sW, sRed
                    cute.arch.sync_threads()


def _add(a, b):
    return a + b


def _weighted(cfg, sX, sW, warp, m, j):
    """A[m][j] of the mma fold: w_j x_j[state row of the warp's local row m], 0 past the
    window (j is clamped for the read)."""
    L, rpw = cfg.window, 32 // cfg.chunks_per_row  # rows a warp holds per pass
    row = warp * rpw + m % rpw + cfg.rows_per_pass * (m // rpw)
    jc = cutlass.min(j, L - 1)
    return nm._sel(j < L, sX[jc, row] * sW[jc], Float32(0.0))


@cute.jit
def _fold_mma(cfg: cutlass.Constexpr, tidx, sX, sW, sB, sD):
    """sD[rows of this warp] = sum_j (w_j x_j[row]) B_j^T, fp32, on the tensor cores.

    The warp's 8 or 16 rows (those its threads hold, local row m = pass * 32/R + lane // R)
    are the mma's m (rows 8-15 zero when there are 8), the window is k (padded to 16 with
    zero rows of B and zero weights), the state's columns are n. A = w_j x_j (fp32) is split
    into three bf16 parts whose sum is it exactly (`split_bf16x3`); B = B_j is bf16 already,
    so every product is exact and only the tensor cores' sums round. The smallest parts go
    first so that the accumulator is small while they are added. B fragments come from the
    k-major bf16 rows with ldmatrix.trans, two n-tiles a load."""
    N, K, RW = cfg.dstate, cfg.fold_k, cfg.rows_per_warp
    warp = tidx // 32
    lane = tidx % 32
    g = lane // 4
    t = lane % 4
    a_parts = []  # per k-step: three A operands (hi, mid, lo), four registers each
    for ks in cutlass.range_constexpr(K // 16):
        regs = []  # a0..a3: (row g | g + 8) x (k 2t, 2t+1 | 2t+8, 2t+9)
        for kh in cutlass.range_constexpr(2):
            for mh in cutlass.range_constexpr(2):
                j = 16 * ks + 8 * kh + 2 * t
                if cutlass.const_expr(mh == 1 and RW == 8):
                    regs.append([Uint32(0)] * 3)
                else:
                    m = g + 8 * mh
                    regs.append(tc.split_bf16x3(_weighted(cfg, sX, sW, warp, m, j),
                                                _weighted(cfg, sX, sW, warp, m, j + 1)))
        a_parts.append([[regs[r][p] for r in range(4)] for p in range(3)])

    # ldmatrix: lane l gives row l % 8 of tile l // 8; tiles (k 0-7 | 8-15) x (n-tile 0 | 1)
    q = lane // 8
    lane_row = (8 * (q % 2) + lane % 8) * (N + 8) + 8 * (q // 2)
    b_base = sB.iterator.toint() + 2 * lane_row
    d_base = sD.iterator.toint()
    for npair in cutlass.range_constexpr(N // 16):
        d = [[Float32(0.0)] * 4, [Float32(0.0)] * 4]
        for ks in cutlass.range_constexpr(K // 16):
            b = tc.ldmatrix_x4_trans(b_base + 2 * (16 * ks * (N + 8) + 16 * npair))
            for u in cutlass.range_constexpr(2):
                for part in (2, 1, 0):  # lo, mid, hi
                    d[u] = tc.mma_m16n8k16(a_parts[ks][part], [b[2 * u], b[2 * u + 1]], d[u],
                                           "bf16")
        for u in cutlass.range_constexpr(2):
            n = 16 * npair + 8 * u + 2 * t
            tc.st_shared_v2_f32(d_base + 4 * ((warp * RW + g) * (N + 8) + n), d[u][0], d[u][1])
            if cutlass.const_expr(RW == 16):
                tc.st_shared_v2_f32(d_base + 4 * ((warp * RW + g + 8) * (N + 8) + n), d[u][2],
                                    d[u][3])


def _direct_position(c):
    """Where state column c (dstate 128) sits in the direct fold's shared B rows: column
    16 q + 2 mt + e is m = q + 8 e of m-tile mt, so that lane group q's accumulators over the
    eight m-tiles are its columns 16 q .. 16 q + 15 in order. For c = 8 b + v (v < 8) it is
    the position of 8 b plus that of v, so a chunk's eight cost one computed base."""
    q = c // 16
    rem = c % 16
    return 16 * (rem // 2) + q + 8 * (rem % 2)


@cute.jit
def _fold_direct(cfg: cutlass.Constexpr, tidx, sX, sW, sB, hi_frags, decay, acc_frags):
    """acc_frags[i][v] = decay hi_frags[i][v] + sum_j (w_j x_j[row]) B_j[col] for this thread's
    elements (row 8w + 2t + i, column 16 q + v), the sum on the tensor cores, transposed: the
    mma's m is the state column (eight 16-column tiles, columns permuted by
    _direct_position), n the warp's 8 rows, k the window (padded to 16 with zero rows of B and
    zero weights). A = B_j^T comes from
    the k-major bf16 rows with ldmatrix.trans; B = w_j x_j, split into three bf16 parts whose
    sum is it exactly (`split_bf16x3`), smallest first, so every product is exact and only the
    tensor cores' sums round (as in `_fold_mma`). Each tile's four sums are added to the state
    as soon as they are made, so that at most one tile's are held."""
    N, K, L = cfg.dstate, cfg.fold_k, cfg.window
    warp = tidx // 32
    lane = tidx % 32
    q = lane // 4
    t = lane % 4
    row = 8 * warp + q  # the mma's n = q selects this state row for the B operand
    b_parts = []  # per k-step: three B operands (hi, mid, lo), two registers each
    for ks in cutlass.range_constexpr(K // 16):
        regs = []
        for kh in cutlass.range_constexpr(2):
            j = 16 * ks + 8 * kh + 2 * t
            regs.append(tc.split_bf16x3(_wx(sX, sW, L, row, j), _wx(sX, sW, L, row, j + 1)))
        b_parts.append([[regs[0][p], regs[1][p]] for p in range(3)])
    # ldmatrix: lane l gives row l % 8 of tile l // 8: tiles (m 0-7 | 8-15) x (k 0-7 | 8-15)
    tile = lane // 8
    lane_row = (8 * (tile // 2) + lane % 8) * (N + 8) + 8 * (tile % 2)
    b_base = sB.iterator.toint() + 2 * lane_row
    for mt in cutlass.range_constexpr(N // 16):
        d = [Float32(0.0)] * 4
        for ks in cutlass.range_constexpr(K // 16):
            a = tc.ldmatrix_x4_trans(b_base + 2 * (16 * ks * (N + 8) + 16 * mt))
            for part in (2, 1, 0):  # lo, mid, hi
                d = tc.mma_m16n8k16(a, b_parts[ks][part], d, "bf16")
        # d0, d1: m = q (column 16 q + 2 mt), n = 2t, 2t + 1; d2, d3: m = q + 8 (column + 1)
        for i, v, k in ((0, 2 * mt, 0), (1, 2 * mt, 1), (0, 2 * mt + 1, 2), (1, 2 * mt + 1, 3)):
            acc_frags[i][v] = Float32(hi_frags[i][v]) * decay + d[k]


def _wx(sX, sW, L, row, j):
    """w_j x_j[row], 0 past the window (j is clamped for the read)."""
    jc = cutlass.min(j, L - 1)
    return nm._sel(j < L, sX[jc, row] * sW[jc], Float32(0.0))


def _chunk(t2d, row, col, width=CHUNK):
    """The `width` consecutive elements of row `row` starting at column `col * width`."""
    return cute.local_tile(t2d[row, None], (width,), (col,))


def _lo_codes_tensor(cfg: FlushConfig, ptr, batch):
    """The read copy's code tensor, typed for this format's stores: nvfp4 codes as one 32-bit
    word per chunk (8 nibbles), fp8 as two words per chunk, fp16 as fp16 bits in 32-bit pairs,
    fp32 as itself."""
    H, P, N = cfg.nheads, cfg.headdim, cfg.dstate
    per_element = {"nvfp4": 8, "fp8_e4m3": 4, "fp16": 2, "fp32": 1, "none": 1}[cfg.lo_format]
    width = N // per_element
    return cute.make_tensor(
        ptr, cute.make_layout((batch, H, P, width), stride=(H * P * width, P * width, width, 1))
    )


@cute.jit
def _load_ring(cfg: cutlass.Constexpr, tidx, s, h, g, x, ring_x, B, ring_B):
    """This thread's chunks of the window's x rows (the ring's records, this step's x last)
    and of its B rows (the group's ring, this step's B last; with a tensor-core fold rows
    L..K-1 are zeros), in registers: the loads only, none waited on here."""
    L, P, T = cfg.window, cfg.headdim, cfg.threads
    RB = cfg.dstate // CHUNK
    x_frags = []
    for q in cutlass.range_constexpr((L * P // CHUNK + T - 1) // T):
        x_chunk = tidx + T * q
        xj = x_chunk // (P // CHUNK)
        xc = x_chunk % (P // CHUNK)
        x_frag = cute.make_rmem_tensor((CHUNK,), x.element_type)
        if cutlass.const_expr("loads" in cfg.ablate):  # timing only
            _fill_from_index(x_frag, x_chunk)
        else:
            if x_chunk < L * P // CHUNK:
                if xj == L - 1:
                    cute.autovec_copy(cute.local_tile(x[s, h, None], (CHUNK,), (xc,)), x_frag)
                else:
                    cute.autovec_copy(
                        cute.local_tile(ring_x[s, h, xj, None], (CHUNK,), (xc,)), x_frag)
        x_frags.append(x_frag)
    b_rows = cfg.fold_k if cfg.fold != "fma" else L
    b_frags = []
    for q in cutlass.range_constexpr((b_rows * RB + T - 1) // T):
        b_chunk = tidx + T * q
        bj = b_chunk // RB
        bc = b_chunk % RB
        b_frag = cute.make_rmem_tensor((CHUNK,), B.element_type)
        if cutlass.const_expr("loads" in cfg.ablate):  # timing only
            _fill_from_index(b_frag, b_chunk)
        else:
            if b_chunk < b_rows * RB:
                if bj == L - 1:
                    cute.autovec_copy(cute.local_tile(B[s, g, None], (CHUNK,), (bc,)), b_frag)
                else:
                    if bj < L:
                        cute.autovec_copy(
                            cute.local_tile(ring_B[s, g, bj, None], (CHUNK,), (bc,)), b_frag)
                    else:
                        b_frag.fill(0.0)
        b_frags.append(b_frag)
    return x_frags, b_frags


@cute.jit
def _store_ring(cfg: cutlass.Constexpr, tidx, s, h, g, x_frags, b_frags, ring_x, ring_B, sX, sB):
    """The loaded chunks into shared memory (x as fp32; B as bf16 in the tensor-core fold's
    order, or as fp32 for the FFMA fold), and this step's x and B appended to the ring (B by
    the group's first head)."""
    L, P, T = cfg.window, cfg.headdim, cfg.threads
    RB = cfg.dstate // CHUNK
    for q in cutlass.range_constexpr(len(x_frags)):
        x_chunk = tidx + T * q
        xj = x_chunk // (P // CHUNK)
        xc = x_chunk % (P // CHUNK)
        if x_chunk < L * P // CHUNK:
            if xj == L - 1:
                cute.autovec_copy(x_frags[q],
                                  cute.local_tile(ring_x[s, h, xj, None], (CHUNK,), (xc,)))
            x_staged = cute.make_rmem_tensor((CHUNK,), Float32)
            x_staged.store(x_frags[q].load().to(Float32))
            cute.autovec_copy(x_staged, cute.local_tile(sX[xj, None], (CHUNK,), (xc,)))
    b_rows = cfg.fold_k if cfg.fold != "fma" else L
    for q in cutlass.range_constexpr(len(b_frags)):
        b_chunk = tidx + T * q
        bj = b_chunk // RB
        bc = b_chunk % RB
        b_frag = b_frags[q]
        if b_chunk < b_rows * RB:
            if bj == L - 1:
                if h % cfg.heads_per_group == 0:
                    cute.autovec_copy(b_frag,
                                      cute.local_tile(ring_B[s, g, bj, None], (CHUNK,), (bc,)))
            _stage_b_chunk(cfg, b_frag, bj, bc, sB)


@cute.jit
def _stage_b_chunk(cfg: cutlass.Constexpr, b_frag, bj, bc, sB):
    """One 8-element chunk of B_j into the fold's shared-memory layout."""
    if cutlass.const_expr(cfg.fold == "direct"):
        base = _direct_position(bc * CHUNK)
        for v in cutlass.range_constexpr(CHUNK):
            sB[bj, base + _direct_position(v)] = b_frag[v]
    elif cutlass.const_expr(cfg.fold == "mma"):
        cute.autovec_copy(b_frag, cute.local_tile(sB[bj, None], (CHUNK,), (bc,)))
    else:
        b_staged = cute.make_rmem_tensor((CHUNK,), Float32)
        b_staged.store(b_frag.load().to(Float32))
        cute.autovec_copy(b_staged, cute.local_tile(sB[bj, None], (CHUNK,), (bc,)))


@cute.jit
def _stage_ring_in_turn(cfg: cutlass.Constexpr, tidx, s, h, g, x, ring_x, B, ring_B, sX, sB):
    """The earlier staging order (``ring_loads_first=False``): each x chunk loaded and
    stored, then each B chunk, so that a thread waits out one round trip for x and another
    for B."""
    L, P, T = cfg.window, cfg.headdim, cfg.threads
    RB = cfg.dstate // CHUNK
    for q in cutlass.range_constexpr((L * P // CHUNK + T - 1) // T):
        x_chunk = tidx + T * q
        if x_chunk < L * P // CHUNK:
            xj = x_chunk // (P // CHUNK)
            xc = x_chunk % (P // CHUNK)
            x_frag = cute.make_rmem_tensor((CHUNK,), x.element_type)
            x_slot = cute.local_tile(ring_x[s, h, xj, None], (CHUNK,), (xc,))
            if xj == L - 1:
                cute.autovec_copy(cute.local_tile(x[s, h, None], (CHUNK,), (xc,)), x_frag)
                cute.autovec_copy(x_frag, x_slot)
            else:
                cute.autovec_copy(x_slot, x_frag)
            x_staged = cute.make_rmem_tensor((CHUNK,), Float32)
            x_staged.store(x_frag.load().to(Float32))
            cute.autovec_copy(x_staged, cute.local_tile(sX[xj, None], (CHUNK,), (xc,)))
    tc_fold = cfg.fold != "fma"
    b_rows = cfg.fold_k if tc_fold else L  # tensor cores: rows L..K-1 zero-filled
    for q in cutlass.range_constexpr((b_rows * RB + T - 1) // T):
        b_chunk = tidx + T * q
        if b_chunk < b_rows * RB:
            bj = b_chunk // RB
            bc = b_chunk % RB
            b_frag = cute.make_rmem_tensor((CHUNK,), B.element_type)
            b_row = cutlass.min(bj, L - 1) if tc_fold else bj
            b_slot = cute.local_tile(ring_B[s, g, b_row, None], (CHUNK,), (bc,))
            if bj == L - 1:
                cute.autovec_copy(cute.local_tile(B[s, g, None], (CHUNK,), (bc,)), b_frag)
                if h % cfg.heads_per_group == 0:
                    cute.autovec_copy(b_frag, b_slot)
            elif cutlass.const_expr(tc_fold):
                if bj < L:
                    cute.autovec_copy(b_slot, b_frag)
                else:
                    b_frag.fill(0.0)
            else:
                cute.autovec_copy(b_slot, b_frag)
            _stage_b_chunk(cfg, b_frag, bj, bc, sB)


@cute.jit
def _load_decay_inputs(cfg: cutlass.Constexpr, lane, s, h, ring_dt, dt, A, dt_bias):
    """The decay weights' inputs, unconditionally (so that they can go out with the other
    loads): record ``lane``'s processed dt (index clamped; the record L-1 is this step's),
    this step's raw dt plus its bias, and A."""
    if cutlass.const_expr("loads" in cfg.ablate):  # timing only
        # dt in [0.27, 0.75] (and softplus of [-0.9, 1]) and A in [-0.24, -0.06]: the decay
        # stays above 0.04, so the states keep clear of fp16's subnormals, where the SR takes
        # its general path (a first form let A reach -1.9, and its flush took 661 us
        # against 636 with the loads)
        ring = Float32(0.5) + _index_value(lane) * Float32(0.25)
        return ring, _index_value(h), Float32(-0.15) + Float32(0.1) * _index_value(s)
    ring = ring_dt[s, h, cutlass.min(lane, max(cfg.window - 2, 0))]
    raw = dt[s, h].to(Float32)
    if cutlass.const_expr(cfg.has_dt_bias):
        raw = raw + dt_bias[h]
    return ring, raw, A[h]


@cute.jit
def _decay_weights(cfg: cutlass.Constexpr, lane, s, h, ring_dt, inputs, sW):
    """Warp 0: sW[j] = exp(A (cum_{L-1} - cum_j)) dt_j for j < L and sW[L] = exp(A cum_{L-1}),
    with cum the inclusive prefix sum of the window's dt (the current dt, processed, last);
    the processed dt is appended to the ring."""
    L = cfg.window
    ring, raw, a = inputs
    current = raw
    if cutlass.const_expr(cfg.dt_softplus):
        current = nm.softplus(current)
    dt_j = Float32(0.0)
    if lane < L - 1:
        dt_j = ring
    if lane == L - 1:
        dt_j = current
        ring_dt[s, h, L - 1] = dt_j
    cum = dt_j
    offset = 1
    while cutlass.const_expr(offset < L):
        other = cute.arch.shuffle_sync_up(cum, offset=offset)
        if lane >= offset:
            cum = cum + other
        offset *= 2
    total = cute.arch.shuffle_sync(cum, offset=L - 1)
    exponent = a * (total - cum)
    exponent = nm._sel(exponent > Float32(0.0), Float32(0.0), exponent)
    if lane < L:
        sW[lane] = cute.math.exp(exponent) * dt_j
    if lane == 0:
        sW[L] = cute.math.exp(a * total)


@cute.jit
def _gate_inputs(cfg: cutlass.Constexpr, s, h, rows, D, z):
    """D[h] and z at this thread's output rows, loaded with the state (after the fold they
    would cost the output a round trip)."""
    d_h = Float32(0.0)
    if cutlass.const_expr(cfg.has_D):
        d_h = _index_value(h) if cutlass.const_expr("loads" in cfg.ablate) else D[h]
    z_rows = [Float32(0.0) for _ in rows]
    if cutlass.const_expr(cfg.has_z):
        if cutlass.const_expr("loads" in cfg.ablate):
            z_rows = [_index_value(p) for p in rows]
        else:
            z_rows = [z[s, h, p].to(Float32) for p in rows]
    return d_h, z_rows


def _index_value(i):
    """A value made from an index, for the timing-only "loads" ablation: distinct per
    thread, known only at run time, within every format's range."""
    return Float32(Int32(i) % Int32(61)) * Float32(0.03125) - Float32(0.9)


@cute.jit
def _fill_from_index(frag, i):
    """A register fragment (16- or 32-bit elements) filled instead of loaded, timing only:
    each 32-bit word one XOR of a word made once from the index (about half an instruction
    an element, as the loads' unpacking would cost). 16-bit elements lie in [0.5, 1) as fp16
    and in [2^-15, 2^-7) as bf16, fp32 ones in [2^-15, 2^-7) too: finite, normal, away from
    the fast paths' edges."""
    words = cute.recast_tensor(frag, Uint32)
    base = Uint32(i) & Uint32(0x3FF)
    base = base | (base << Uint32(16)) | Uint32(0x38003800)
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = base ^ Uint32((0x00150009 * (w + 1)) & 0x03FF03FF)


@cute.jit
def _gate(cfg: cutlass.Constexpr, y, x_p, d_h, z_p):
    if cutlass.const_expr(cfg.has_D):
        y = y + d_h * x_p
    if cutlass.const_expr(cfg.has_z):
        y = y * nm.silu(z_p)
    return y


@cute.jit
def _store_hi_chunk(
    cfg: cutlass.Constexpr, hi_h, hi_bits, values, p, col, counter_lo0, counter_hi, keys
):
    """The recurrence copy of one chunk: fp16 SR (elements 4j .. 4j + 3 of the chunk take the
    four words of counter counter_lo0 + j; the counter field is the low 22 bits, so adding j is
    or-ing it in), fp16 RN, or fp32."""
    W = cfg.chunk
    if cutlass.const_expr(cfg.hi_format == "fp32"):
        frag = cute.make_rmem_tensor((W,), Float32)
        for v in cutlass.range_constexpr(W):
            frag[v] = nm.saturate_f32(values[v])
        cute.autovec_copy(frag, _chunk(hi_h, p, col, W))
    else:
        frag = cute.make_rmem_tensor((W // 2,), Uint32)
        if cutlass.const_expr(cfg.hi_rounding == "sr"):
            for first in cutlass.range_constexpr(0, W, 8):
                nm.sr_fp16_chunk(frag, values, counter_lo0, counter_hi, keys, first)
        else:
            for v2 in cutlass.range_constexpr(W // 2):
                frag[v2] = nm.rn_fp16x2(values[2 * v2], values[2 * v2 + 1])
        cute.autovec_copy(frag, _chunk(hi_bits, p, col, W // 2))


@cute.jit
def _chunk_amax(values, W: cutlass.Constexpr):
    """max |S| over one chunk's W values (0 for none; fmax ignores NaN)."""
    own = Float32(0.0)
    for v in cutlass.range_constexpr(W):
        own = cute.arch.fmax(own, cute.math.absf(values[v]))
    return own


@cute.jit
def _publish_warp_amax(block_amax, tidx, sRed):
    """The warp's amax(|S|) (thread, from its chunks' maxima, then warp maximum) to
    sRed[warp]. The chunks' maxima serve the block scales as well (_store_nvfp4_chunk): one
    max an element instead of two (fp16-SR + nvfp4 flush, 32 elements a thread: 59.9 -> 58.9
    SASS instructions per element; with the slot-placed E2M1 codes 773.5 -> 757.7 us on the
    H200 at batch 256, results/gpu_first_timing/bench_write_11_{old,new}.csv)."""
    local = Float32(0.0)
    for i in cutlass.range_constexpr(len(block_amax)):
        local = cute.arch.fmax(local, block_amax[i])
    local = cute.arch.warp_reduction(local, cute.arch.fmax)
    if tidx % 32 == 0:
        sRed[tidx // 32] = local


@cute.jit
def _head_global_scale(T: cutlass.Constexpr, sRed):
    """s_g = amax(|S|) / 2688 over the whole head: the CTA maximum of the warps' (after
    _publish_warp_amax)."""
    cute.arch.sync_threads()
    amax = sRed[0]
    for w in cutlass.range_constexpr(1, T // 32):
        amax = cute.arch.fmax(amax, sRed[w])
    return nm.div_rn(amax, Float32(E2M1_E4M3_MAX))


@cute.jit
def _store_nvfp4_chunk(W: cutlass.Constexpr, lo_h, scales_h, values, own, p, col,
                       global_scale, pairs: cutlass.Constexpr):
    """NVFP4 codes of one chunk (W = 8: half a block, the partner chunk is lane ^ 1; W = 16: a
    whole block; `own`: the chunk's max |S|, _chunk_amax), in lowprec's order: den = 6 s_g;
    s_b = RN_e4m3(amax_b / den) (0 for a zero block); divisor = s_b s_g; code =
    RN_e2m1(x / divisor), all codes 0 where amax_b or divisor is 0."""
    amax_b = own
    if cutlass.const_expr(W == 8):
        amax_b = cute.arch.fmax(own, cute.arch.shuffle_sync_bfly(own, offset=1))
    den = Float32(E2M1_MAX) * global_scale
    is_zero = amax_b == Float32(0.0)
    ratio = nm._sel(is_zero, Float32(0.0), nm.div_rn(amax_b, den))
    scale_byte = nm.rn_e4m3_byte(ratio)
    divisor = nm.e4m3_value(scale_byte) * global_scale
    zero_block = is_zero | (divisor == Float32(0.0))
    # x * RN(1/divisor) decides the code unless a quotient lies near a decision point (or
    # the reciprocal is out of range); only then does this thread divide. The fp16-RN +
    # nvfp4 flush went from 95.0 to 71.8 instructions per element with this, and from 43.0
    # to 35.9 with the codes two at a time (`pairs`; `python -m
    # cute_kernels.instruction_count`).
    recip = nm.div_rn(Float32(1.0), divisor)
    words = cute.make_rmem_tensor((W // 8,), Uint32)
    exact = _e2m1_words(values, W, recip, pairs, words)
    if not exact:
        for w in cutlass.range_constexpr(W // 8):
            word = Uint32(0)
            for v in cutlass.range_constexpr(8):
                nibble = nm.rn_e2m1_nibble(nm.div_rn(values[8 * w + v], divisor))
                word = word | (nibble << Uint32(4 * v))
            words[w] = word
    for w in cutlass.range_constexpr(W // 8):
        words[w] = nm._sel(zero_block, Uint32(0), words[w])
    if cutlass.const_expr(W == 8):
        lo_h[p, col] = words[0]
        if col % 2 == 0:
            scales_h[p, col // 2] = scale_byte.to(Uint8)
    else:
        cute.autovec_copy(words, _chunk(lo_h, p, col, W // 8))
        scales_h[p, col] = scale_byte.to(Uint8)


def _e2m1_words(values, W: int, recip, pairs: bool, words):
    """The E2M1 codes of values[0 .. W-1] / divisor (recip = RN(1/divisor)) into
    words[0 .. W/8 - 1], eight a word (low nibble first); returns whether every one is
    provably lowprec's (else the caller divides). ``pairs``: nibbles e and e + 4 of a word
    at once (numerics.e2m1_pair_fast), else one at a time (numerics.e2m1_quotient_fast).
    Traced into the caller (a plain function: its loops unroll)."""
    if pairs:
        recip14 = recip * Float32(nm.E2M1_PAIR_SCALE)  # exact: a power of two, both normal
        margin = None
        for w in range(W // 8):
            word = Uint32(0)
            for e in range(4):
                pair, margin_e = nm.e2m1_pair_fast(values[8 * w + e], values[8 * w + e + 4],
                                                   recip14, e)
                word = word | pair
                margin = margin_e if margin is None else nm.umin(margin, margin_e)
            words[w] = word
        return nm.recip14_usable(recip) & (margin >= Uint32(nm.E2M1_PAIR_MARGIN))
    exact = nm.recip_usable(recip)
    for w in range(W // 8):
        word = Uint32(0)
        for v in range(8):
            nibble, exact_v = nm.e2m1_quotient_fast(values[8 * w + v], recip, v)
            word = word | nibble
            exact = exact & exact_v
        words[w] = word
    return exact


@cute.jit
def _store_lo_chunk(cfg: cutlass.Constexpr, lo_h, values, p, col):
    """Element-only read copies of one chunk: fp32, fp16 bits or fp8_e4m3 bytes (RN,
    saturating)."""
    W = cfg.chunk
    if cutlass.const_expr(cfg.lo_format == "fp32"):
        frag = cute.make_rmem_tensor((W,), Float32)
        for v in cutlass.range_constexpr(W):
            frag[v] = nm.saturate_f32(values[v])
        cute.autovec_copy(frag, _chunk(lo_h, p, col, W))
    elif cutlass.const_expr(cfg.lo_format == "fp16"):
        frag = cute.make_rmem_tensor((W // 2,), Uint32)
        for v2 in cutlass.range_constexpr(W // 2):
            frag[v2] = nm.rn_fp16x2(values[2 * v2], values[2 * v2 + 1])
        cute.autovec_copy(frag, _chunk(lo_h, p, col, W // 2))
    else:
        frag = cute.make_rmem_tensor((W // 4,), Uint32)
        for v4 in cutlass.range_constexpr(W // 4):
            word = Uint32(0)
            for b in cutlass.range_constexpr(4):
                word = word | (nm.rn_e4m3_byte(values[4 * v4 + b]) << Uint32(8 * b))
            frag[v4] = word
        cute.autovec_copy(frag, _chunk(lo_h, p, col, W // 4))


# --------------------------------------------------------------------------------------------
# counters: one thread per slot, after the flush kernel


@cute.kernel
def _advance_kernel(
    decision: cute.Tensor,
    cursors: cute.Tensor,
    flushes: cute.Tensor,
    batch: Int32,
    window: cutlass.Constexpr,
    advance_others: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    s = bidx * 128 + tidx
    if s < batch:
        before = decision[s]
        if before == window - 1:
            cursors[s] = 0
            flushes[s] = flushes[s] + 1
        elif cutlass.const_expr(advance_others):
            cursors[s] = before + 1


@cute.jit
def _advance_host(
    p_decision: cute.Pointer,
    p_cursors: cute.Pointer,
    p_flushes: cute.Pointer,
    batch: Int32,
    window: cutlass.Constexpr,
    advance_others: cutlass.Constexpr,
    stream,
):
    decision = cute.make_tensor(p_decision, cute.make_layout(batch))
    cursors = cute.make_tensor(p_cursors, cute.make_layout(batch))
    flushes = cute.make_tensor(p_flushes, cute.make_layout(batch))
    _advance_kernel(decision, cursors, flushes, batch, window, advance_others).launch(
        grid=[(batch + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream
    )


def compile_advance(window: int, advance_others: bool, keep_ptx: bool = False):
    """The counter kernel: slots whose decision cursor is window - 1 get cursor 0 and one more
    flush; with `advance_others`, every other slot's cursor becomes decision + 1."""

    def build():
        ptr = _compile.fake_ptr(Int32)
        return cute.compile(
            _advance_host,
            ptr,
            ptr,
            ptr,
            Int32(1),
            window,
            advance_others,
            _compile.fake_stream(),
            options=_compile.compile_options(keep_ptx),
        )

    return _compile.compile_cached(("advance", window, advance_others, keep_ptx), build)


def launch_advance_counters(decision, cursors, flushes, window: int, advance_others: bool):
    """Launch the counter kernel on torch's current stream (tensors already validated)."""
    kernel = compile_advance(window, advance_others)
    kernel(
        _compile.gmem_ptr(decision),
        _compile.gmem_ptr(cursors),
        _compile.gmem_ptr(flushes),
        Int32(cursors.shape[0]),
        _compile.current_stream(),
    )


# --------------------------------------------------------------------------------------------
# compile and launch


def compile_flush(cfg: FlushConfig, keep_ptx: bool = False):
    """The compiled flush kernel of `cfg` (cached); `keep_ptx` keeps its PTX text."""

    def build():
        act = CUTE_DTYPES[cfg.act]
        hi_dtype = Float32 if cfg.hi_format == "fp32" else cutlass.Float16
        lo_dtype = Float32 if cfg.lo_format == "fp32" else Uint32
        f = _compile.fake_ptr
        args = (
            f(hi_dtype),
            f(lo_dtype),
            f(Uint8),
            f(Float32),
            f(act),
            f(Float32),
            f(act),
            f(Int32),
            f(Int32),
            f(act),
            f(CUTE_DTYPES[cfg.dt_dtype]),
            f(Float32),
            f(act),
            f(act),
            f(Float32),
            f(act),
            f(Float32),
            f(act),
            f(Float32),
            f(Int32),
            Int32(1),
            Int32(1),
            Uint32(0),
            Uint32(0),
            _compile.fake_stream(),
        )
        return cute.compile(ReplayFlush(cfg), *args, options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("flush", cfg, keep_ptx), build)


def launch_flush(
    cfg: FlushConfig,
    hi,
    lo,
    ring_x,
    ring_dt,
    ring_B,
    decision,
    flushes,
    x,
    dt,
    A,
    B,
    C,
    D,
    z,
    dt_bias,
    out,
    debug_state,
    seed: int,
    slot_ctas: int | None = None,
    slot_table=None,
) -> None:
    """Launch the flush kernel on torch's current stream (arguments already validated; `lo`
    normalised to a dict, absent optional tensors None). Counters are only read.

    `slot_ctas`: CTAs along the slot axis, each taking every `slot_ctas`-th slot (default: one
    CTA a slot and head; fewer needs `cfg.slot_loop`, see `decode_slot_ctas`). `slot_table`:
    with `cfg.slot_table`, an int32 tensor of the slots to flush, a CTA per entry and head
    (none launched for an empty table)."""
    batch = hi.shape[0]
    if cfg.slot_table:
        if slot_table is None or slot_ctas is not None:
            raise ValueError("slot_table: a kernel with slot_table takes the table, not slot_ctas")
        if slot_table.numel() == 0:
            return
        slot_ctas = slot_table.numel()
    elif slot_table is not None:
        raise ValueError("slot_table: needs FlushConfig.slot_table")
    kernel = compile_flush(cfg)
    slot_ctas = batch if slot_ctas is None else slot_ctas
    if not (cfg.slot_loop or cfg.slot_table) and slot_ctas != batch:
        raise ValueError("slot_ctas: a kernel without slot_loop takes one CTA a slot")
    if cfg.slot_loop and (not 0 < slot_ctas <= batch or -(-batch // slot_ctas) > cfg.threads):
        raise ValueError(f"slot_ctas: expected 1..{batch} with at most {cfg.threads} slots a "
                         f"CTA, got {slot_ctas}")
    f32 = Float32
    none = _compile.fake_ptr
    lo_codes = lo.get("codes")
    kernel(
        _compile.gmem_ptr(hi, f32 if cfg.hi_format == "fp32" else cutlass.Float16),
        none(Uint32)
        if lo_codes is None
        else _compile.gmem_ptr(lo_codes, f32 if cfg.lo_format == "fp32" else Uint32),
        _optional_ptr(lo.get("scales"), Uint8),
        _optional_ptr(lo.get("global_scale"), f32),
        _compile.gmem_ptr(ring_x),
        _compile.gmem_ptr(ring_dt),
        _compile.gmem_ptr(ring_B),
        _compile.gmem_ptr(decision),
        _compile.gmem_ptr(flushes),
        _compile.gmem_ptr(x),
        _compile.gmem_ptr(dt),
        _compile.gmem_ptr(A),
        _compile.gmem_ptr(B),
        _compile.gmem_ptr(C),
        _optional_ptr(D, f32),
        _optional_ptr(z, CUTE_DTYPES[cfg.act]),
        _optional_ptr(dt_bias, f32),
        _compile.gmem_ptr(out),
        _optional_ptr(debug_state, f32),
        _optional_ptr(slot_table, Int32),
        Int32(batch),
        Int32(slot_ctas),
        Uint32(seed & 0xFFFFFFFF),
        Uint32(seed >> 32),
        _compile.current_stream(),
    )


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


def _optional_ptr(tensor, dtype):
    return _compile.fake_ptr(dtype) if tensor is None else _compile.gmem_ptr(tensor, dtype)


# --------------------------------------------------------------------------------------------
# validation


def check_state_shape(name, t, elements_per_thread=ELEMENTS_PER_THREAD):
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        _compile.fail(name, "a 4-d tensor [slots, nheads, headdim, dstate]", shape)
    slots, nheads, headdim, dstate = t.shape
    if dstate not in (16, 32, 64, 128, 256):
        _compile.fail(f"{name}.shape[3] (dstate)", "a power of two in [16, 256]", dstate)
    problem = _layout_problem(headdim, dstate, elements_per_thread)
    if problem is not None and problem[0] == "headdim":
        _compile.fail(f"{name}.shape[2] (headdim)", problem[1], headdim)
    if problem is not None:
        threads = thread_count(headdim, dstate, elements_per_thread)
        _compile.fail(f"{name}.shape[2:] (headdim x dstate)", problem[1],
                      f"{headdim} x {dstate} ({threads} threads)")
    return slots, nheads, headdim, dstate


def check_mamba2_inputs(device, slots, nheads, headdim, dstate, x, dt, A, B, C, D, z, dt_bias, out):
    """Validate the token inputs (out may be None); returns (act name, dt name, ngroups)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in ACT_DTYPES:
        _compile.fail(
            "x",
            f"a tensor of dtype {' or '.join(map(str, ACT_DTYPES))}",
            getattr(x, "dtype", type(x).__name__),
        )
    act = x.dtype
    _compile.check_tensor("x", x, act, (slots, nheads, headdim), device)
    _compile.check_tensor("dt", dt, tuple(ACT_DTYPES), (slots, nheads), device)
    _compile.check_tensor("A", A, torch.float32, (nheads,), device)
    if not isinstance(B, torch.Tensor) or B.dim() != 3:
        _compile.fail(
            "B",
            "a 3-d tensor [slots, ngroups, dstate]",
            list(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__,
        )
    ngroups = B.shape[1]
    if ngroups < 1 or nheads % ngroups:
        _compile.fail("B.shape[1] (ngroups)", f"a divisor of nheads={nheads}", ngroups)
    _compile.check_tensor("B", B, act, (slots, ngroups, dstate), device)
    _compile.check_tensor("C", C, act, (slots, ngroups, dstate), device)
    if D is not None:
        _compile.check_tensor("D", D, torch.float32, (nheads,), device)
    if z is not None:
        _compile.check_tensor("z", z, act, (slots, nheads, headdim), device)
    if dt_bias is not None:
        _compile.check_tensor("dt_bias", dt_bias, torch.float32, (nheads,), device)
    if out is not None:
        _compile.check_tensor("out", out, act, (slots, nheads, headdim), device)
    return ACT_DTYPES[act], ACT_DTYPES[dt.dtype], ngroups


def check_counter_values(cursors, flushes, window: int) -> None:
    """Raise ValueError unless every cursor lies in [0, window - 1] and every flush counter in
    [0, 2^20 - 1) (lowprec.replay.check_counter_ranges and FLUSH_COUNTER_LIMIT, which the
    emulation's cache check shares). One host read of four numbers (a stream sync): opt-in
    (`check_counters=True`), for tests and debugging."""
    check_counter_ranges(cursors, flushes, 0, window - 1, f"window {window}")


def check_seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        _compile.fail("seed", "an int in [0, 2^64)", repr(seed))


def check_philox_fields(name, slots, slot_elements, draws_words=True):
    """The state's slots within the Philox counter's slot field (fewer than 2^20) and, where
    SR draws words, each slot's element indices within its element field (below 2^24,
    lowprec.philox.ELEMENT_LIMIT, whose emulation refuses more): past them the counter's
    fields overlap and elements silently share words."""
    if slots >= SLOT_LIMIT:
        _compile.fail(f"{name}.shape[0] (slots)", "fewer than 2^20 (Philox slot field)", slots)
    if draws_words and slot_elements > ELEMENT_LIMIT:
        _compile.fail(f"{name}.shape[1:] (nheads x headdim x dstate)",
                      "at most 2^24 elements a slot (Philox element field, with SR)",
                      slot_elements)


def check_choice(name, value, choices):
    if value not in choices:
        _compile.fail(name, f"one of {choices}", repr(value))


def normalise_lo(lo, lo_format, slots, nheads, headdim, dstate, device) -> dict:
    """The read copy as {'codes'[, 'scales', 'global_scale']}, validated against `lo_format`.

    Accepted (the same as replay_output): nvfp4 a dict with 'codes', 'scales' and
    'global_scale' (or 'global'); element formats a dict with 'values' or 'codes' (raw bits
    as lowprec.quantize.pack stores them are viewed as the storage dtype), or a bare tensor.
    """
    state = (slots, nheads, headdim, dstate)
    if lo_format == "none":
        if lo is not None:
            _compile.fail("lo", "None for lo_format='none'", type(lo).__name__)
        return {}
    if isinstance(lo, torch.Tensor) and lo_format != "nvfp4":
        lo = {"values": lo}
    if not isinstance(lo, dict):
        _compile.fail("lo", f"a dict of storage tensors for {lo_format}", type(lo).__name__)
    if lo_format == "nvfp4":
        g_key = "global" if "global" in lo else "global_scale"
        if set(lo) != {"codes", "scales", g_key}:
            _compile.fail("lo", "keys ['codes', 'global_scale', 'scales']", sorted(lo))
        codes, scales, global_scale = lo["codes"], lo["scales"], lo[g_key]
        _compile.check_tensor("lo['codes']", codes, torch.uint8, (*state[:3], dstate // 2), device)
        _compile.check_tensor(
            "lo['scales']", scales, torch.uint8, (*state[:3], dstate // NVFP4_BLOCK), device
        )
        _compile.check_tensor(f"lo[{g_key!r}]", global_scale, torch.float32, state[:2], device)
        return {"codes": codes, "scales": scales, "global_scale": global_scale}
    key = "values" if "values" in lo else "codes"
    if set(lo) != {key}:
        _compile.fail("lo", "a tensor or a dict with the key 'values' (or 'codes')", sorted(lo))
    raw = {"fp8_e4m3": torch.uint8, "fp16": torch.float16, "fp32": torch.float32}[lo_format]
    values = lo[key]
    if (
        isinstance(values, torch.Tensor)
        and values.dtype != raw
        and (values.element_size() == raw.itemsize and not values.dtype.is_floating_point)
    ):
        values = values.view(raw)  # raw bits, as lowprec.quantize.pack stores them
    _compile.check_tensor(f"lo[{key!r}]", values, raw, state, device)
    return {"codes": values}


# --------------------------------------------------------------------------------------------
# public function


def replay_flush(
    hi,
    lo,
    ring_x,
    ring_dt,
    ring_B,
    cursors,
    flushes,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    out=None,
    *,
    window=16,
    hi_format="fp16",
    hi_rounding="sr",
    lo_format="nvfp4",
    seed=0,
    debug_state=None,
    elements_per_thread=None,
    fold=None,
    chunk=None,
    e2m1_pairs=None,
    check_counters=False,
):
    """Flush every slot whose step is a flush (`cursors[s] + 1 == window`); see the module doc.

    hi: fp16 or fp32 `[slots, nheads, headdim, dstate]`. lo: the read copy in `lo_format`
    (nvfp4: dict codes uint8 [.., dstate/2], scales uint8 [.., dstate/16], global_scale fp32
    [slots, nheads]; fp8_e4m3: uint8 codes; fp16/fp32: a tensor of that dtype; none: None).
    ring_x [slots, nheads, Lcap, headdim], ring_dt fp32 [slots, nheads, Lcap], ring_B [slots,
    ngroups, Lcap, dstate] (Lcap >= window), cursors and flushes int32 [slots]; x, z [slots,
    nheads, headdim], dt [slots, nheads] (raw), B, C [slots, ngroups, dstate] in the act dtype
    (x's: bf16, fp16 or fp32); A, D, dt_bias fp32 [nheads]. Values of cursors and flushes are
    not checked unless `check_counters=True` (one host read: it synchronises, for tests and
    debugging; check_counter_values): cursors must lie in [0, window - 1] and flushes in
    [0, 2^20 - 1) (lowprec.replay.FLUSH_COUNTER_LIMIT), the Philox counter's flush field (at
    2^20 flushes slot s would reuse the words of flush 0 of slot s | 1: the field overflows
    into the slot's).

    Writes hi, lo, the rings' last position, out (only rows of flushing slots; allocated when
    None) and debug_state (fp32, state-shaped, optional); then resets the cursors and advances
    `flushes` of the slots that flushed. Returns out. Runs on torch's current stream.
    `elements_per_thread` (64, or 32 for twice the threads and about 80 registers each;
    default 32 for fp16 hi where the head shape allows it, `default_elements_per_thread`) and
    `fold` ("direct": the ring folded on the tensor cores, transposed so that its accumulators
    are the thread's own elements, the default where `direct_fold_problem` allows it; "mma":
    tensor cores, the default where only `mma_fold_problem` allows it; "fma" elsewhere;
    `default_fold`) and `chunk` (8 or 16 state elements a thread
    handles as one piece) and `e2m1_pairs` (NVFP4 codes two at a time; default True) are
    tuning knobs (FlushConfig).
    """
    cfg, lo = _prepare_flush(
        hi,
        lo,
        ring_x,
        ring_dt,
        ring_B,
        cursors,
        flushes,
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        dt_softplus,
        out,
        window,
        hi_format,
        hi_rounding,
        lo_format,
        seed,
        debug_state,
        elements_per_thread,
        fold,
        chunk,
        e2m1_pairs,
    )
    if not isinstance(check_counters, bool):  # as replay_decode_step's and state_update's
        _compile.fail("check_counters", "a bool", repr(check_counters))
    if check_counters:
        check_counter_values(cursors, flushes, window)
    require_cuda("hi", hi)
    if out is None:
        out = torch.empty_like(x)
    if hi.shape[0] == 0:  # as the other entries: no compile, and no grid with a zero dimension
        return out
    launch_flush(
        cfg,
        hi,
        lo,
        ring_x,
        ring_dt,
        ring_B,
        cursors,
        flushes,
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        out,
        debug_state,
        seed,
    )
    launch_advance_counters(cursors, cursors, flushes, window, advance_others=False)
    return out


def _prepare_flush(
    hi,
    lo,
    ring_x,
    ring_dt,
    ring_B,
    cursors,
    flushes,
    x,
    dt,
    A,
    B,
    C,
    D,
    z,
    dt_bias,
    dt_softplus,
    out,
    window,
    hi_format,
    hi_rounding,
    lo_format,
    seed,
    debug_state,
    elements_per_thread=None,
    fold=None,
    chunk=None,
    e2m1_pairs=None,
):
    """Validate a flush call; returns (FlushConfig, lo as a dict)."""
    if elements_per_thread is None and isinstance(hi, torch.Tensor) and hi.dim() == 4:
        elements_per_thread = default_elements_per_thread(hi.shape[2], hi.shape[3], hi_format)
    elif elements_per_thread is None:
        elements_per_thread = ELEMENTS_PER_THREAD  # check_state_shape reports the bad hi
    if elements_per_thread not in (32, 64):
        _compile.fail("elements_per_thread", "32 or 64", repr(elements_per_thread))
    check_choice("hi_format", hi_format, HI_FORMATS)
    check_choice("hi_rounding", hi_rounding, HI_ROUNDINGS)
    check_choice("lo_format", lo_format, LO_FORMATS)
    check_seed(seed)
    if not isinstance(dt_softplus, bool):
        _compile.fail("dt_softplus", "a bool", repr(dt_softplus))
    slots, nheads, headdim, dstate = check_state_shape("hi", hi, elements_per_thread)
    device = hi.device
    hi_dtype = torch.float16 if hi_format == "fp16" else torch.float32
    _compile.check_tensor("hi", hi, hi_dtype, hi.shape, device)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 32:
        _compile.fail("window", "an int in [1, 32]", repr(window))
    act, dt_name, ngroups = check_mamba2_inputs(
        device, slots, nheads, headdim, dstate, x, dt, A, B, C, D, z, dt_bias, out
    )
    if not isinstance(ring_x, torch.Tensor) or ring_x.dim() != 4:
        _compile.fail(
            "ring_x",
            "a 4-d tensor [slots, nheads, Lcap, headdim]",
            list(ring_x.shape) if isinstance(ring_x, torch.Tensor) else type(ring_x).__name__,
        )
    ring_len = ring_x.shape[2]
    if ring_len < window:
        _compile.fail("ring_x.shape[2] (Lcap)", f">= window={window}", ring_len)
    _compile.check_tensor("ring_x", ring_x, x.dtype, (slots, nheads, ring_len, headdim), device)
    _compile.check_tensor("ring_dt", ring_dt, torch.float32, (slots, nheads, ring_len), device)
    _compile.check_tensor("ring_B", ring_B, x.dtype, (slots, ngroups, ring_len, dstate), device)
    _compile.check_tensor("cursors", cursors, torch.int32, (slots,), device)
    _compile.check_tensor("flushes", flushes, torch.int32, (slots,), device)
    # the counter kernel resets one and advances the other: one buffer would do neither
    _compile.check_apart("flushes", flushes, cursors=cursors)
    if debug_state is not None:
        _compile.check_tensor("debug_state", debug_state, torch.float32, hi.shape, device)
    lo = normalise_lo(lo, lo_format, slots, nheads, headdim, dstate, device)
    read = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, hi=hi, ring_x=ring_x,
                ring_dt=ring_dt, ring_B=ring_B, cursors=cursors, flushes=flushes,
                **{f"lo[{key!r}]": value for key, value in lo.items()})
    _compile.check_apart("out", out, **read)
    _compile.check_apart("debug_state", debug_state, out=out, **read)
    check_philox_fields("hi", slots, nheads * headdim * dstate,
                        hi_format == "fp16" and hi_rounding == "sr")
    cfg = FlushConfig(
        nheads=nheads,
        headdim=headdim,
        dstate=dstate,
        ngroups=ngroups,
        window=window,
        ring_len=ring_len,
        act=act,
        dt_dtype=dt_name,
        hi_format=hi_format,
        hi_rounding=hi_rounding if hi_format == "fp16" else "rn",
        lo_format=lo_format,
        has_D=D is not None,
        has_z=z is not None,
        has_dt_bias=dt_bias is not None,
        dt_softplus=dt_softplus,
        has_debug=debug_state is not None,
        elements_per_thread=elements_per_thread,
        chunk=chunk,
        fold=fold,  # FlushConfig checks both and fills in the defaults
        e2m1_pairs=FlushConfig.e2m1_pairs if e2m1_pairs is None else e2m1_pairs,
    )
    return cfg, lo


def traffic_bytes(cfg: FlushConfig, flushing_slots: int, act_bytes: int = 2) -> int:
    """Bytes one flush launch must move for `flushing_slots` flushing slots, each read once
    and each write once: the recurrence copy read and written, the read copy written (scales
    included), the ring's window - 1 held records (x, dt per head; B per group), this token's
    x, z, dt, out and its appended record, and C per group (A, D, dt_bias and counters are
    noise). The debug copy is not counted."""
    P, N, L = cfg.headdim, cfg.dstate, cfg.window
    hi_bytes = P * N * (2 if cfg.hi_format == "fp16" else 4)
    lo_bytes = {
        "nvfp4": P * N // 2 + P * N // NVFP4_BLOCK + 4,
        "fp8_e4m3": P * N,
        "fp16": 2 * P * N,
        "fp32": 4 * P * N,
        "none": 0,
    }[cfg.lo_format]
    per_head = (
        2 * hi_bytes + lo_bytes + (L - 1) * (P * act_bytes + 4) + P * act_bytes * 4 + act_bytes + 4
    )  # x, z read; out, ring x written; dt
    per_group = (L - 1) * N * act_bytes + 3 * N * act_bytes  # ring B, B, C, B appended
    return flushing_slots * (cfg.nheads * per_head + cfg.ngroups * per_group)
