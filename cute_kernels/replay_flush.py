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
therefore only reads them; `mamba2_replay_flush` then launches a one-thread-per-slot kernel that
resets the cursors and advances the flush counters of the slots that flushed. The decision
input is a separate argument of the launch helper, so `mamba2_replay_decode` can hand it a
snapshot taken before the non-flush kernel advanced the other slots.
"""

from __future__ import annotations

import cutlass  # noqa: I001
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint8, Uint32
from cutlass.memory import SmemAllocator

from cute_kernels import _compile
from cute_kernels import cache as kv
from cute_kernels import numerics as nm
from cute_kernels.replay_flush_config import (
    CHUNK,
    E2M1_E4M3_MAX,
    E2M1_MAX,
    NVFP4_BLOCK,
    TUNING_FIELDS,
    FlushConfig,
    _tuned,
    check_flush_shape,
    decode_slot_ctas,
    default_elements_per_thread,
    default_fold,
    direct_fold_problem,
    flush_config,
    mma_fold_problem,
    resident_ctas_per_sm,
    thread_count,
)
from cute_kernels.replay_flush_fold import _direct_position, _fold_direct, _fold_mma

__all__ = [
    "FlushConfig", "mamba2_replay_flush", "flush_config", "launch_flush",
    "launch_advance_counters", "compile_flush", "compile_advance", "traffic_bytes",
    "default_elements_per_thread", "default_fold", "mma_fold_problem", "direct_fold_problem",
    "check_flush_shape", "decode_slot_ctas", "resident_ctas_per_sm", "thread_count",
    "TUNING_FIELDS",
]

CUTE_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}


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
            preferred_smem_carveout=-1,  # the driver's choice, named: compiles without a GPU
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
        # the table's entry first_slot (slot_table: the decode step given `flush_slots`); or
        # first_slot, first_slot + slot_ctas, ... (slot_loop: the decode step's fp32 flush
        # without a table), whose decisions come in with one load a thread before the loop
        # (the launch makes sure a CTA has at most `threads` slots). sDecision is only used by
        # slot_loop.
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
                g = h // cfg.heads_per_group
                hi_h = hi[s, h, None, None]  # (P, N):(N, 1)

                # 1. the recurrence copy, all loads in flight before the ring is staged
                acc = []
                hi_frags = []
                for i in cutlass.range_constexpr(pieces):
                    hi_frag = cute.make_rmem_tensor((W,), hi.element_type)
                    cute.autovec_copy(_chunk(hi_h, row0 + rows * i, col, W), hi_frag)
                    hi_frags.append(hi_frag)
                    if cutlass.const_expr(not direct):
                        acc.append(hi_frag.load().to(Float32))
                # C, D and z for the output, in flight with the state (each would wait out a
                # round trip after the barrier)
                piece_rows = [row0 + rows * i for i in range(pieces)]
                d_h, z_rows = _gate_inputs(cfg, s, h, piece_rows, D, z)
                c_frag = cute.make_rmem_tensor((W,), C.element_type)
                cute.autovec_copy(cute.local_tile(C[s, g, None], (W,), (col,)), c_frag)

                # 2. stage the ring in fp32 shared memory and append the current record
                # every load first (the ring's x and B chunks, warp 0's dt values), in flight
                # with the state's; then the shared-memory stores and warp 0's decay weights:
                # one round trip before the barrier
                x_frags, b_frags = _load_ring(cfg, tidx, s, h, g, x, ring_x, B, ring_B)
                dt_in = _load_decay_inputs(cfg, tidx % 32, s, h, ring_dt, dt, A, dt_bias)
                _store_ring(cfg, tidx, s, h, g, x_frags, b_frags, ring_x, ring_B, sX, sB)
                if tidx < 32:
                    _decay_weights(cfg, tidx, s, h, ring_dt, dt_in, sW)
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
                keys = nm.philox_keys(seed_lo, seed_hi, cfg.philox_rounds)
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
                    element0 = Uint32((h * P + p) * N) + Uint32(col * W)  # a multiple of W
                    _store_hi_chunk(cfg, hi_h, hi_bits, acc[i], p, col, Uint32(s), flush,
                                    element0, counter_hi, keys)
                    if cutlass.const_expr(cfg.lo_format not in ("none", "nvfp4")):
                        _store_lo_chunk(cfg, lo_h, acc[i], p, col)
                if cutlass.const_expr(nvfp4):
                    # the recurrence copy goes out before the barrier that the head's amax needs
                    global_scale = _head_global_scale(T, sRed)
                    if tidx == 0:
                        lo_global[s, h] = global_scale
                    for i in cutlass.range_constexpr(pieces):
                        p = row0 + rows * i
                        _store_nvfp4_chunk(W, lo_h, scales_h, acc[i], block_amax[i], p, col,
                                           global_scale)
                if k + 1 < slots_here:  # the next slot's staging reuses sX, sB, sW, sRed
                    cute.arch.sync_threads()


def _add(a, b):
    return a + b


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
def _load_decay_inputs(cfg: cutlass.Constexpr, lane, s, h, ring_dt, dt, A, dt_bias):
    """The decay weights' inputs, unconditionally (so that they can go out with the other
    loads): record ``lane``'s processed dt (index clamped; the record L-1 is this step's),
    this step's raw dt plus its bias, and A."""
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
        d_h = D[h]
    z_rows = [Float32(0.0) for _ in rows]
    if cutlass.const_expr(cfg.has_z):
        z_rows = [z[s, h, p].to(Float32) for p in rows]
    return d_h, z_rows


@cute.jit
def _gate(cfg: cutlass.Constexpr, y, x_p, d_h, z_p):
    if cutlass.const_expr(cfg.has_D):
        y = y + d_h * x_p
    if cutlass.const_expr(cfg.has_z):
        y = y * nm.silu(z_p)
    return y


@cute.jit
def _store_hi_chunk(
    cfg: cutlass.Constexpr, hi_h, hi_bits, values, p, col, slot, flush, element0, counter_hi,
    keys
):
    """The recurrence copy of one chunk (state elements element0 .. element0 + W - 1 of the
    slot): fp16 SR with cfg.sr_bits random bits an element in cfg.philox_rounds rounds (a
    counter serves 4, 8 or 16 consecutive elements, nm.sr_fp16_piece), fp16 RN, or fp32."""
    W = cfg.chunk
    if cutlass.const_expr(cfg.hi_format == "fp32"):
        frag = cute.make_rmem_tensor((W,), Float32)
        for v in cutlass.range_constexpr(W):
            frag[v] = nm.saturate_f32(values[v])
        cute.autovec_copy(frag, _chunk(hi_h, p, col, W))
    else:
        frag = cute.make_rmem_tensor((W // 2,), Uint32)
        if cutlass.const_expr(cfg.hi_rounding == "sr"):
            nm.sr_fp16_piece(frag, values, W, slot, flush, element0, counter_hi, keys,
                             cfg.sr_bits)
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
    max an element instead of two."""
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
                       global_scale):
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
    # the reciprocal is out of range); only then does this thread divide.
    recip = nm.div_rn(Float32(1.0), divisor)
    words = cute.make_rmem_tensor((W // 8,), Uint32)
    exact = nm.e2m1_words(values, W, recip, words)
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
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    s = bidx * 128 + tidx
    if s < batch:
        before = decision[s]
        if before == window - 1:
            cursors[s] = 0
            flushes[s] = flushes[s] + 1


@cute.jit
def _advance_host(
    p_decision: cute.Pointer,
    p_cursors: cute.Pointer,
    p_flushes: cute.Pointer,
    batch: Int32,
    window: cutlass.Constexpr,
    stream,
):
    decision = cute.make_tensor(p_decision, cute.make_layout(batch))
    cursors = cute.make_tensor(p_cursors, cute.make_layout(batch))
    flushes = cute.make_tensor(p_flushes, cute.make_layout(batch))
    _advance_kernel(decision, cursors, flushes, batch, window).launch(
        grid=[(batch + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream
    )


def compile_advance(window: int, keep_ptx: bool = False):
    """The counter kernel: slots whose decision cursor is window - 1 get cursor 0 and one more
    flush; the others are left alone."""

    def build():
        ptr = _compile.fake_ptr(Int32)
        return cute.compile(
            _advance_host,
            ptr,
            ptr,
            ptr,
            Int32(1),
            window,
            _compile.fake_stream(),
            options=_compile.compile_options(keep_ptx),
        )

    return _compile.compile_cached(("advance", window, keep_ptx), build)


def launch_advance_counters(decision, cursors, flushes, window: int):
    """Launch the counter kernel on torch's current stream (tensors already validated)."""
    kernel = compile_advance(window)
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


def launch_flush(cfg: FlushConfig, cache, decision, x, dt, A, B, C, D, z, dt_bias, out,
                 debug_state, slot_ctas: int | None = None, slot_table=None) -> None:
    """Launch the flush kernel on torch's current stream (arguments already checked). Counters
    are only read; ``decision`` holds the cursors the step decides by.

    `slot_ctas`: CTAs along the slot axis, each taking every `slot_ctas`-th slot (default: one
    CTA a slot and head; fewer needs `cfg.slot_loop`, see `decode_slot_ctas`). `slot_table`:
    with `cfg.slot_table`, an int32 tensor of the slots to flush, a CTA per entry and head
    (none launched for an empty table)."""
    batch = cache.hi.shape[0]
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
    seed = cache.seed
    kernel(
        _compile.gmem_ptr(cache.hi, f32 if cfg.hi_format == "fp32" else cutlass.Float16),
        _optional_ptr(cache.lo, f32 if cfg.lo_format == "fp32" else Uint32),
        _optional_ptr(cache.lo_scales, Uint8),
        _optional_ptr(cache.lo_global, f32),
        _compile.gmem_ptr(cache.ring_x),
        _compile.gmem_ptr(cache.ring_dt),
        _compile.gmem_ptr(cache.ring_B),
        _compile.gmem_ptr(decision),
        _compile.gmem_ptr(cache.flushes),
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


def _optional_ptr(tensor, dtype):
    return _compile.fake_ptr(dtype) if tensor is None else _compile.gmem_ptr(tensor, dtype)


# --------------------------------------------------------------------------------------------
# the public function


def mamba2_replay_flush(cache: kv.ReplayCache, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                        dt_softplus=True, out=None, debug_state=None, check_counters=False,
                        config=None):
    """Flush every slot whose step is a flush (``cursors[s] + 1 == window``; module doc);
    returns out [slots, nheads, headdim] (x's dtype; only rows of flushing slots written).

    ``cache``: a `cute_kernels.cache.ReplayCache`; token inputs as `mamba2_replay_output`.
    Writes hi, lo, the rings' last position, out and ``debug_state`` (fp32, state-shaped,
    optional: the unrounded new state); then resets the cursors and advances the flush
    counters of the slots that flushed. Counter values are checked only with
    ``check_counters=True`` (one host read: it synchronises): cursors in [0, window - 1],
    flushes in [0, 2^20 - 1) (the Philox flush field). Runs on torch's current stream.
    ``config``: None (the defaults), or `flush_config`'s result with its tuning fields
    (TUNING_FIELDS) changed.
    """
    view = kv.check_replay_cache(cache)
    kv.check_step(view, x, dt, A, B, C, D, z, dt_bias, out=out, debug_state=debug_state)
    cfg = _tuned(flush_config(cache, view, x, dt, D, z, dt_bias, dt_softplus=dt_softplus,
                              has_debug=debug_state is not None), config)
    kv.check_switch("check_counters", check_counters)
    if check_counters:
        kv.check_counter_values(cache.cursors, cache.flushes, cache.window)
    kv.require_cuda("cache.hi", cache.hi)
    if out is None:
        out = torch.empty_like(x)
    if view.slots == 0:  # no compile, and no grid with a zero dimension
        return out
    launch_flush(cfg, cache, cache.cursors, x, dt, A, B, C, D, z, dt_bias, out, debug_state)
    launch_advance_counters(cache.cursors, cache.cursors, cache.flushes, cache.window)
    return out


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
