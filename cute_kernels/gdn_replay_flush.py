"""Gated DeltaNet ReplaySSM flush kernel (CuTe DSL): fold the window into a new checkpoint and
store it twice, the recurrence copy (hi) with FP16 SR and the read copy (lo) with NVFP4 RN.

For every slot `s` whose step is a flush (`cursors[s] == window - 1`; other slots exit at once),
per head `h` (one CTA owns one (slot, head) state `S [dv, dk]`), in the order of
`lowprec.gdn._delta_update` (the emulation's `fold_ring` + `delta_step`):

    S       = hi (fp16 -> fp32, or fp32)
    for j = 0 .. L-1 (records 0 .. L-2 from the ring, record L-1 the call's inputs):
            S <- S exp(g_j);   u = beta_j (v_j - S k_j);   S <- S + u k_j^T        (fp32)
    y       = S q  (the unrounded new state)                                    -> out
    hi      <- fp16 SR of S, element e = (h dv + row) dk + col taking the random bits
               lowprec.philox.random_words(seed, s, flushes[s], shape, sr_bits=,
               philox_rounds=) gives it (at (32, 10): word e % 4 of the counter e // 4),
               or fp16 RN, or fp32 exact
    lo      <- NVFP4 RN of S: E4M3 block scale per 16 along dk, fp32 global scale per (slot,
               head) = amax(|S|) / 2688, E2M1 codes two a byte (low nibble = even column)
    ring    record L-1 (v, k, g, beta) at position L-1, as the emulation's append (never read
            again: the window restarts), so that the rings of both implementations agree

Every u is recomputed from the raw v and the recurrence copy: the cached u (read-copy based)
are not read. The flush kernel reads the counters and never writes them (every CTA of a slot
reads them); `gdn_replay_decode.launch_advance` resets them after it.

The threads first bring the whole window into shared memory (k, v exact in fp32, exp(g_j),
beta_j; one barrier) and the fold reads its records there: one round trip a head instead of a
record's loads inside every step of the fold's chain. A window over STAGED_WINDOW_BYTES (wide
keys and a long window) is folded with each record's loads in the chain instead, the same
arithmetic in the same order.

Thread ownership (one CTA per (slot, head); T = dv dk / 64 threads, 64 state elements a thread
in 16-element chunks, one NVFP4 block a chunk; drawn for the Qwen3-Next head, dv = dk = 128,
T = 256):

    state row p: 8 chunks of 16 columns (32 B of fp16 hi, 8 B of nvfp4 codes, 1 scale byte)
             chunk  0    1   ...  7
    p =  0        t0   t1  ...  t7          thread t owns chunk c = t % 8 (columns 16c ..
    p =  1        t8   t9  ...  t15         16c + 15) of rows p = t // 8 + 32 i, i = 0..3
     ...
    p = 31        t248 ...      t255
    p = 32        t0   t1  ...              (pass i = 1: the same threads, 32 rows down)

A row's lanes are consecutive (R = dk / 16 of them: 8, 16 or 32 a row for dk = 128, 256,
512), so the row sums of S k_j and S q are shuffle reductions over R lanes; a warp touches
32 / R whole rows per pass (1 KiB of fp16 hi, 256 B of codes for dk = 128). The head's amax
(the NVFP4 global scale) is a CTA reduction after the recurrence copy has been stored.

Bytes per flushing (slot, head) (`traffic_bytes`): hi read and written (2 dv dk each for
fp16), the ring's L-1 records read (v, k in the activation dtype, g and beta fp32), q, k, v
read, y written, the record appended, lo codes, scales and global written (dv dk / 2 + dv dk /
16 + 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass  # noqa: I001
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32
from cutlass.memory import SmemAllocator

from cute_kernels import _compile
from cute_kernels import gdn_cache as gc
from cute_kernels import numerics as nm
from cute_kernels.cache import check_sr_settings, fail
from lowprec import philox

__all__ = ["GDNConfig", "config_of", "compile_gdn_flush", "launch_gdn_flush",
           "traffic_bytes"]

CUTE_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
W = 16  # state elements a chunk: one NVFP4 block
E2M1_E4M3_MAX = 2688.0  # 448 * 6
E2M1_MAX = 6.0
# A thread holds 64 fp32 state elements; capping it at 128 registers lets two 256-thread CTAs
# share an SM (unbounded, ptxas took more and one did: docs/performance.md)
REGISTERS_PER_SM = 65536
REGISTER_FLOOR = 128
DECAY, BETA = 0, 1  # rows of the staged per-record scalars
STAGED_WINDOW_BYTES = 48 * 1024  # at most a CTA's shared memory without the opt-in


@dataclass(frozen=True)
class GDNConfig:
    """Static parameters of one compiled GDN kernel (the compile-cache key)."""

    nheads: int
    dv: int
    dk: int
    window: int
    hi_format: str  # 'fp16' | 'fp32' (the conventional baseline: 'fp32' | 'bf16')
    hi_rounding: str  # 'sr' | 'rn'
    lo_format: str  # 'nvfp4' | 'none'
    act: str  # 'bf16' | 'fp16' | 'fp32'
    has_debug: bool = False
    # SR of the fp16 recurrence copy: random bits an element and Philox rounds
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS

    def __post_init__(self):
        gc.check_head_shape(self.dv, self.dk)
        check_sr_settings(self.sr_bits, self.philox_rounds, self.hi_rounding, "hi_rounding")
        if self.act not in CUTE_DTYPES:
            fail("act", f"one of {list(CUTE_DTYPES)}", repr(self.act))
        if not 1 <= self.window <= gc.MAX_WINDOW:
            fail("window", f"in [1, {gc.MAX_WINDOW}]", self.window)

    @property
    def threads(self) -> int:
        return self.dv * self.dk // gc.ELEMENTS_PER_THREAD

    @property
    def lanes_per_row(self) -> int:
        return self.dk // W

    @property
    def rows_per_pass(self) -> int:
        return self.threads // self.lanes_per_row

    @property
    def passes(self) -> int:
        return self.dv // self.rows_per_pass


def config_of(cache, view: gc.GDNView, act: str, has_debug: bool = False) -> GDNConfig:
    return GDNConfig(nheads=view.nheads, dv=view.dv, dk=view.dk, window=cache.window,
                     hi_format=cache.hi_format, hi_rounding=cache.hi_rounding,
                     lo_format=cache.lo_format, act=act, has_debug=has_debug,
                     sr_bits=cache.sr_bits, philox_rounds=cache.philox_rounds)


# --------------------------------------------------------------------------------------------
# device helpers shared with gdn_replay_output.py and gdn_state_update.py


def add(a, b):
    return a + b


def chunk_of(t2d, row, col, width=W):
    """Columns col*width .. col*width + width - 1 of row `row` of a 2-d tensor."""
    return cute.local_tile(t2d[row, None], (width,), (col,))


@cute.jit
def load_vector_chunk(vec1d, col):
    """Elements 16 col .. 16 col + 15 of a 1-d tensor, as a 16-element fp32 vector."""
    frag = cute.make_rmem_tensor((W,), vec1d.element_type)
    cute.autovec_copy(cute.local_tile(vec1d, (W,), (col,)), frag)
    return frag.load().to(Float32)


@cute.jit
def stage_window(cfg: cutlass.Constexpr, tidx, s, h, ring_k, ring_v, ring_g, ring_beta, k, v,
                 g, beta, sK, sV, sScal):
    """The window's L records in shared memory, values exact in fp32: records 0 .. L-2 from
    the ring, L-1 the call's inputs; keys sK[j], values sV[j], exp(g_j) and beta_j."""
    P, N, L, T = cfg.dv, cfg.dk, cfg.window, cfg.threads
    for m in cutlass.range_constexpr(((L - 1) * N + T - 1) // T):
        e = tidx + T * m
        if e < (L - 1) * N:
            sK[e // N, e % N] = ring_k[s, h, e // N, e % N].to(Float32)
    for m in cutlass.range_constexpr(((L - 1) * P + T - 1) // T):
        e = tidx + T * m
        if e < (L - 1) * P:
            sV[e // P, e % P] = ring_v[s, h, e // P, e % P].to(Float32)
    for m in cutlass.range_constexpr((N + T - 1) // T):
        e = tidx + T * m
        if e < N:
            sK[L - 1, e] = k[s, h, e].to(Float32)
    for m in cutlass.range_constexpr((P + T - 1) // T):
        e = tidx + T * m
        if e < P:
            sV[L - 1, e] = v[s, h, e].to(Float32)
    if tidx < L - 1:
        sScal[DECAY, tidx] = cute.math.exp(ring_g[s, h, tidx])
        sScal[BETA, tidx] = ring_beta[s, h, tidx]
    if tidx == L - 1:
        sScal[DECAY, tidx] = cute.math.exp(g[s, h])
        sScal[BETA, tidx] = beta[s, h]


def delta_step(cfg, acc, k_vec, a, beta_j, v_j, rows):
    """One delta-rule update of a thread's chunks `acc` (lowprec.gdn._delta_update's order):
    S <- S a; u = beta (v - S k); S <- S + u k^T, `v_j` the record's values [dv]. Traced into
    the caller (a plain function: its loop unrolls)."""
    R = cfg.lanes_per_row
    for i in range(cfg.passes):
        acc[i] = acc[i] * a
        part = (acc[i] * k_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        total = cute.arch.warp_reduction(part, add, threads_in_group=R)
        u = beta_j * (v_j[rows[i]].to(Float32) - total)
        acc[i] = acc[i] + u * k_vec


@cute.jit
def row_outputs(cfg: cutlass.Constexpr, acc, q_vec, rows, col, out_h):
    """y_p = S_p . q for each of the thread's rows (a shuffle sum over the row's lanes), stored
    by the row's first lane."""
    R = cfg.lanes_per_row
    for i in cutlass.range_constexpr(cfg.passes):
        part = (acc[i] * q_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        total = cute.arch.warp_reduction(part, add, threads_in_group=R)
        if col == 0:
            out_h[rows[i]] = total.to(out_h.element_type)


@cute.jit
def store_hi_chunk(fmt: cutlass.Constexpr, rounding: cutlass.Constexpr, hi_h, values, p, col,
                   slot, flush, element0, counter_hi, keys, sr_bits: cutlass.Constexpr = 0):
    """The recurrence copy of one 16-element chunk (state elements element0 .. element0 + 15
    of the slot): fp16 SR with `sr_bits` random bits an element from Philox words of `keys`
    (nm.sr_fp16_piece), fp16 RN, bf16 RN, or fp32 (saturating)."""
    if cutlass.const_expr(fmt == "fp32"):
        frag = cute.make_rmem_tensor((W,), Float32)
        for e in cutlass.range_constexpr(W):
            frag[e] = nm.saturate_f32(values[e])
        cute.autovec_copy(frag, chunk_of(hi_h, p, col))
    elif cutlass.const_expr(fmt == "bf16"):
        frag = cute.make_rmem_tensor((W,), cutlass.BFloat16)
        frag.store(values.to(cutlass.BFloat16))
        cute.autovec_copy(frag, chunk_of(hi_h, p, col))
    else:
        bits = cute.make_tensor(cute.recast_ptr(hi_h.iterator, dtype=Uint32),
                                cute.make_layout((hi_h.shape[0], hi_h.shape[1] // 2),
                                                 stride=(hi_h.shape[1] // 2, 1)))
        frag = cute.make_rmem_tensor((W // 2,), Uint32)
        if cutlass.const_expr(rounding == "sr"):
            nm.sr_fp16_piece(frag, values, W, slot, flush, element0, counter_hi, keys, sr_bits)
        else:
            for e2 in cutlass.range_constexpr(W // 2):
                frag[e2] = nm.rn_fp16x2(values[2 * e2], values[2 * e2 + 1])
        cute.autovec_copy(frag, chunk_of(bits, p, col, W // 2))


@cute.jit
def chunk_amax(values):
    """max |S| over a chunk (0 for none; fmax ignores NaN)."""
    own = Float32(0.0)
    for e in cutlass.range_constexpr(W):
        own = cute.arch.fmax(own, cute.math.absf(values[e]))
    return own


@cute.jit
def store_nvfp4_block(codes_h, scales_h, values, amax_b, p, col, global_scale):
    """NVFP4 codes and scale byte of one 16-element block, in lowprec's order: den = 6 s_g;
    s_b = RN_e4m3(amax_b / den) (0 for a zero block); divisor = s_b s_g; code =
    RN_e2m1(x / divisor), all codes 0 where amax_b or divisor is 0. `codes_h` is the head's
    codes as uint32 words [dv, dk // 8]."""
    den = Float32(E2M1_MAX) * global_scale
    is_zero = amax_b == Float32(0.0)
    ratio = nm._sel(is_zero, Float32(0.0), nm.div_rn(amax_b, den))
    scale_byte = nm.rn_e4m3_byte(ratio)
    divisor = nm.e4m3_value(scale_byte) * global_scale
    zero_block = is_zero | (divisor == Float32(0.0))
    recip = nm.div_rn(Float32(1.0), divisor)
    words = cute.make_rmem_tensor((W // 8,), Uint32)
    exact = nm.e2m1_words(values, W, recip, words)
    if not exact:
        for w in cutlass.range_constexpr(W // 8):
            word = Uint32(0)
            for e in cutlass.range_constexpr(8):
                nibble = nm.rn_e2m1_nibble(nm.div_rn(values[8 * w + e], divisor))
                word = word | (nibble << Uint32(4 * e))
            words[w] = word
    for w in cutlass.range_constexpr(W // 8):
        words[w] = nm._sel(zero_block, Uint32(0), words[w])
    cute.autovec_copy(words, chunk_of(codes_h, p, col, W // 8))
    scales_h[p, col] = scale_byte.to(Uint8)


@cute.jit
def append_record(cfg: cutlass.Constexpr, tidx, pos, s, h, k, v, g, beta, ring_k, ring_v,
                  ring_g, ring_beta):
    """Record (v, k, g, beta) of (s, h) to ring position `pos` (u is the caller's)."""
    T = cfg.threads
    for m in cutlass.range_constexpr((cfg.dv + T - 1) // T):
        e = tidx + T * m
        if e < cfg.dv:
            ring_v[s, h, pos, e] = v[s, h, e]
    for m in cutlass.range_constexpr((cfg.dk + T - 1) // T):
        e = tidx + T * m
        if e < cfg.dk:
            ring_k[s, h, pos, e] = k[s, h, e]
    if tidx == 0:
        ring_g[s, h, pos] = g[s, h]
        ring_beta[s, h, pos] = beta[s, h]


# --------------------------------------------------------------------------------------------
# the flush kernel


class GDNFlush:
    def __init__(self, config: GDNConfig, staged_window: bool):
        self.cfg = config
        self.staged_window = staged_window

    @cute.jit
    def __call__(
        self,
        p_hi: cute.Pointer,
        p_lo: cute.Pointer,
        p_lo_scales: cute.Pointer,
        p_lo_global: cute.Pointer,
        p_ring_v: cute.Pointer,
        p_ring_k: cute.Pointer,
        p_ring_g: cute.Pointer,
        p_ring_beta: cute.Pointer,
        p_decision: cute.Pointer,
        p_flushes: cute.Pointer,
        p_q: cute.Pointer,
        p_k: cute.Pointer,
        p_v: cute.Pointer,
        p_g: cute.Pointer,
        p_beta: cute.Pointer,
        p_out: cute.Pointer,
        p_debug: cute.Pointer,
        batch: Int32,
        seed_lo: Uint32,
        seed_hi: Uint32,
        stream,
    ):
        cfg = self.cfg
        H, P, N, L = cfg.nheads, cfg.dv, cfg.dk, cfg.window
        state = cute.make_layout((batch, H, P, N), stride=(H * P * N, P * N, N, 1))
        hi = cute.make_tensor(p_hi, state)
        debug = cute.make_tensor(p_debug, state)
        codes = cute.make_tensor(p_lo, cute.make_layout(
            (batch, H, P, N // 8), stride=(H * P * N // 8, P * N // 8, N // 8, 1)))
        scales = cute.make_tensor(p_lo_scales, cute.make_layout(
            (batch, H, P, N // W), stride=(H * P * N // W, P * N // W, N // W, 1)))
        per_head = cute.make_layout((batch, H), stride=(H, 1))
        lo_global = cute.make_tensor(p_lo_global, per_head)
        ring_v = cute.make_tensor(p_ring_v, cute.make_layout(
            (batch, H, L, P), stride=(H * L * P, L * P, P, 1)))
        ring_k = cute.make_tensor(p_ring_k, cute.make_layout(
            (batch, H, L, N), stride=(H * L * N, L * N, N, 1)))
        ring_rows = cute.make_layout((batch, H, L), stride=(H * L, L, 1))
        ring_g = cute.make_tensor(p_ring_g, ring_rows)
        ring_beta = cute.make_tensor(p_ring_beta, ring_rows)
        decision = cute.make_tensor(p_decision, cute.make_layout(batch))
        flushes = cute.make_tensor(p_flushes, cute.make_layout(batch))
        keys_rows = cute.make_layout((batch, H, N), stride=(H * N, N, 1))
        q = cute.make_tensor(p_q, keys_rows)
        k = cute.make_tensor(p_k, keys_rows)
        value_rows = cute.make_layout((batch, H, P), stride=(H * P, P, 1))
        v = cute.make_tensor(p_v, value_rows)
        out = cute.make_tensor(p_out, value_rows)
        g = cute.make_tensor(p_g, per_head)
        beta = cute.make_tensor(p_beta, per_head)
        self.kernel(hi, codes, scales, lo_global, ring_v, ring_k, ring_g, ring_beta, decision,
                    flushes, q, k, v, g, beta, out, debug, seed_lo, seed_hi).launch(
            grid=[H, batch, 1], block=[cfg.threads, 1, 1], stream=stream,
            min_blocks_per_mp=min_ctas_per_sm(cfg), preferred_smem_carveout=-1)

    @cute.kernel
    def kernel(
        self,
        hi: cute.Tensor,
        codes: cute.Tensor,
        scales: cute.Tensor,
        lo_global: cute.Tensor,
        ring_v: cute.Tensor,
        ring_k: cute.Tensor,
        ring_g: cute.Tensor,
        ring_beta: cute.Tensor,
        decision: cute.Tensor,
        flushes: cute.Tensor,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        out: cute.Tensor,
        debug: cute.Tensor,
        seed_lo: Uint32,
        seed_hi: Uint32,
    ):
        cfg = self.cfg
        P, N, L, T = cfg.dv, cfg.dk, cfg.window, cfg.threads
        R, step = cfg.lanes_per_row, cfg.rows_per_pass
        tidx, _, _ = cute.arch.thread_idx()
        h, s, _ = cute.arch.block_idx()
        col = tidx % R
        row0 = tidx // R
        rows = [row0 + step * i for i in range(cfg.passes)]
        smem = SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout(32), 16)
        if cutlass.const_expr(self.staged_window):
            sK = smem.allocate_tensor(Float32, cute.make_layout((L, N), stride=(N, 1)), 16)
            sV = smem.allocate_tensor(Float32, cute.make_layout((L, P), stride=(P, 1)), 16)
            sScal = smem.allocate_tensor(Float32, cute.make_layout((2, L), stride=(L, 1)), 16)

        if decision[s] == L - 1:
            hi_h = hi[s, h, None, None]
            acc = []
            for i in cutlass.range_constexpr(cfg.passes):
                frag = cute.make_rmem_tensor((W,), hi.element_type)
                cute.autovec_copy(chunk_of(hi_h, rows[i], col), frag)
                acc.append(frag.load().to(Float32))

            # the window's records in order, every u from the raw v
            if cutlass.const_expr(self.staged_window):
                stage_window(cfg, tidx, s, h, ring_k, ring_v, ring_g, ring_beta, k, v, g,
                             beta, sK, sV, sScal)
                cute.arch.sync_threads()
            for j in cutlass.range_constexpr(L):
                if cutlass.const_expr(self.staged_window):
                    k_vec = load_vector_chunk(sK[j, None], col)
                    a = sScal[DECAY, j]
                    beta_j = sScal[BETA, j]
                    v_j = sV[j, None]
                elif cutlass.const_expr(j < L - 1):
                    k_vec = load_vector_chunk(ring_k[s, h, j, None], col)
                    a = cute.math.exp(ring_g[s, h, j])
                    beta_j = ring_beta[s, h, j]
                    v_j = ring_v[s, h, j, None]
                else:
                    k_vec = load_vector_chunk(k[s, h, None], col)
                    a = cute.math.exp(g[s, h])
                    beta_j = beta[s, h]
                    v_j = v[s, h, None]
                delta_step(cfg, acc, k_vec, a, beta_j, v_j, rows)

            row_outputs(cfg, acc, load_vector_chunk(q[s, h, None], col), rows, col,
                        out[s, h, None])

            # stores, one chunk at a time: the recurrence copy first, then (after the barrier
            # of the head's amax) nvfp4
            keys = nm.philox_keys(seed_lo, seed_hi, cfg.philox_rounds)
            flush = Uint32(flushes[s])
            _, counter_hi = nm.state_counter(Uint32(s), flush, Uint32(0))
            nvfp4 = cfg.lo_format == "nvfp4"
            block_amax = []
            if cutlass.const_expr(nvfp4):
                block_amax = [chunk_amax(acc[i]) for i in range(cfg.passes)]
                local = Float32(0.0)
                for i in cutlass.range_constexpr(cfg.passes):
                    local = cute.arch.fmax(local, block_amax[i])
                local = cute.arch.warp_reduction(local, cute.arch.fmax)
                if tidx % 32 == 0:
                    sRed[tidx // 32] = local
            debug_h = debug[s, h, None, None]
            for i in cutlass.range_constexpr(cfg.passes):
                p = rows[i]
                if cutlass.const_expr(cfg.has_debug):
                    d_frag = cute.make_rmem_tensor((W,), Float32)
                    d_frag.store(acc[i])
                    cute.autovec_copy(d_frag, chunk_of(debug_h, p, col))
                element0 = Uint32((h * P + p) * N) + Uint32(col * W)  # a multiple of 16
                store_hi_chunk(cfg.hi_format, cfg.hi_rounding, hi_h, acc[i], p, col,
                               Uint32(s), flush, element0, counter_hi, keys, cfg.sr_bits)
            if cutlass.const_expr(nvfp4):
                cute.arch.sync_threads()
                amax = sRed[0]
                for w in cutlass.range_constexpr(1, T // 32):
                    amax = cute.arch.fmax(amax, sRed[w])
                global_scale = nm.div_rn(amax, Float32(E2M1_E4M3_MAX))
                if tidx == 0:
                    lo_global[s, h] = global_scale
                codes_h = codes[s, h, None, None]
                scales_h = scales[s, h, None, None]
                for i in cutlass.range_constexpr(cfg.passes):
                    store_nvfp4_block(codes_h, scales_h, acc[i], block_amax[i], rows[i], col,
                                      global_scale)
            append_record(cfg, tidx, L - 1, s, h, k, v, g, beta, ring_k, ring_v, ring_g,
                          ring_beta)


def min_ctas_per_sm(cfg: GDNConfig) -> int:
    """CTAs an SM the register allocation must allow: as many as REGISTER_FLOOR registers a
    thread leave room for (2 at 256 threads), 0 (no bound) where that is one."""
    ctas = REGISTERS_PER_SM // (cfg.threads * REGISTER_FLOOR)
    return ctas if ctas > 1 else 0


def staged_window_bytes(cfg: GDNConfig) -> int:
    """Shared memory of the staged window: keys and values fp32, two scalars a record."""
    return 4 * cfg.window * (cfg.dk + cfg.dv + 2)


def compile_gdn_flush(cfg: GDNConfig, keep_ptx: bool = False, staged_window: bool = True):
    """The compiled flush kernel of `cfg` (cached), the window staged in shared memory where
    it takes at most STAGED_WINDOW_BYTES (``staged_window=False``: never, the larger windows'
    form, for the instruction counts and tests); `keep_ptx` keeps its PTX text."""
    staged_window = staged_window and staged_window_bytes(cfg) <= STAGED_WINDOW_BYTES

    def build():
        f = _compile.fake_ptr
        act = CUTE_DTYPES[cfg.act]
        hi_t = Float32 if cfg.hi_format == "fp32" else cutlass.Float16
        args = (f(hi_t), f(Uint32), f(Uint8), f(Float32),
                f(act), f(act), f(Float32), f(Float32), f(Int32), f(Int32),
                f(act), f(act), f(act), f(Float32), f(Float32), f(act), f(Float32),
                Int32(1), Uint32(0), Uint32(0), _compile.fake_stream())
        return cute.compile(GDNFlush(cfg, staged_window), *args,
                            options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("gdn_flush", cfg, staged_window, keep_ptx), build)


def optional_ptr(tensor, dtype):
    return _compile.fake_ptr(dtype) if tensor is None else _compile.gmem_ptr(tensor, dtype)


def launch_gdn_flush(cfg: GDNConfig, cache, decision, q, k, v, g, beta, out, debug_state):
    """Launch the flush kernel on torch's current stream (everything already validated):
    slots whose `decision` cursor is window - 1 flush, the others are left alone."""
    kernel = compile_gdn_flush(cfg)
    gp = _compile.gmem_ptr
    kernel(gp(cache.hi), optional_ptr(cache.lo, Uint32), optional_ptr(cache.lo_scales, Uint8),
           optional_ptr(cache.lo_global, Float32),
           gp(cache.ring_v), gp(cache.ring_k), gp(cache.ring_g), gp(cache.ring_beta),
           gp(decision), gp(cache.flushes), gp(q), gp(k), gp(v), gp(g), gp(beta), gp(out),
           optional_ptr(debug_state, Float32),
           Int32(cache.hi.shape[0]), Uint32(cache.seed & 0xFFFFFFFF), Uint32(cache.seed >> 32),
           _compile.current_stream())


def traffic_bytes(hi_format: str, lo_format: str, act: str, flushing_slots: int, nheads: int,
                  dv: int, dk: int, window: int) -> int:
    """Bytes one flush moves for `flushing_slots` slots, each read once and each write once:
    hi read and written; lo codes, scales and global written (nvfp4); the ring's window - 1
    records read (v, k in act, g and beta fp32); q, k, v read, y written; the record
    appended (v, k, g, beta)."""
    a = ACT_BYTES[act]
    hi_bytes = dv * dk * (4 if hi_format == "fp32" else 2)
    lo_bytes = dv * dk // 2 + dv * dk // W + 4 if lo_format == "nvfp4" else 0
    record = (dv + dk) * a + 8
    per_head = (2 * hi_bytes + lo_bytes + (window - 1) * record
                + (2 * dk + dv) * a + 8 + dv * a + record)
    return flushing_slots * nheads * per_head

