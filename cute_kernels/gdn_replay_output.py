"""Gated DeltaNet ReplaySSM non-flush kernel (CuTe DSL): one pass over the read copy yields both
S k and S q, the record's corrected value u and the output y; no state is formed or written.

For every slot `s` with `c = cursors[s] < window - 1` (records 0 .. c-1 in the ring, record c
the call's inputs; other slots exit at once), per head `h` (one CTA a (slot, head)), in the
order of operations of `lowprec.gdn._read` (the emulation's `replay_record`):

    cum_j   = g_0 + ... + g_j  (sequential fp32, records 0 .. c)
    w_j     = exp(cum_c - cum_j)            G_c = exp(cum_c)
    kk_j    = sum_d (k_j[d] w_j) k_c[d]     kq_j = sum_d (k_j[d] w_j) q[d]     (j <= c)
    u_c     = beta_c (v_c - [S_lo (G_c k_c) + sum_{j<c} u_j kk_j])
    y       = S_lo (G_c q) + sum_{j<c} u_j kq_j + u_c kq_c
    ring    u_c, v_c, k_c, g_c, beta_c at position c

S_lo is the read copy. NVFP4: each block's 16 codes enter exactly as E2M1 x 2^-6 in fp32 (a
nibble re-packed as the E4M3 byte of `2^-6 code`, two a hardware conversion to f16x2, f16 to
fp32), the products with `G_c k_c` and `G_c q` are summed over the block, and the block's sums
are multiplied by `(2^6 s_b) s_g` (one rounding): lowprec's values `(code s_b) s_g` carry
that rounding per element instead, so a term differs by at most 3 roundings from lowprec's,
and a row's sums here have 16 + log2(dk / 16) + c + 3 sequential roundings a term, far fewer
than the d_k + L the emulation's bound (`emulation.gdn_replay_decode`) allows. With lo_format
'none', the fp32 recurrence copy itself (the single-copy FP32 ReplaySSM baseline).

Thread ownership: the flush kernel's (`gdn_replay_flush`), dv dk / 64 threads, each the
16-column chunk `t % R` (R = dk / 16) of rows `t // R + (T / R) i`: its chunk of a row is one
NVFP4 block (8 code bytes, 1 scale byte: one 64-bit and one 8-bit load), or 64 B of fp32.
All of a thread's state loads, and its rows' ring u and v, are issued before the first use.
Its rows' two dot products meet in shuffle sums over the row's R lanes, each lane adding the
ring terms of records `t % R + R m` first (so the ring's u are spread over the row's lanes).
The per-record dots kk_j, kq_j are warp sums (warp w: records w, w + T/32, ...) staged in
shared memory.

Bytes per non-flush (slot, head) (`traffic_bytes`): the read copy (dv dk / 2 codes + dv dk / 16
scales + 4 global for nvfp4; 4 dv dk for fp32), the ring's c records (u fp32, k in the
activation dtype, g), q, k, v, g, beta read, y written, the record appended (u, v, k, g, beta).
"""

from __future__ import annotations

import dataclasses

import cutlass  # noqa: I001
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32, Uint32
from cutlass.memory import SmemAllocator

from cute_kernels import _compile, ptx
from cute_kernels import numerics as nm
from cute_kernels.gdn_replay_flush import (
    ACT_BYTES,
    CUTE_DTYPES,
    GDNConfig,
    W,
    add,
    append_record,
    chunk_of,
    load_vector_chunk,
    optional_ptr,
)

__all__ = ["compile_gdn_output", "launch_gdn_output", "traffic_bytes"]

E2M1_AS_E4M3 = 64.0  # the re-packed codes are E2M1 x 2^-6


def e2m1_as_e4m3(word):
    """The 8 E2M1 nibbles of `word` as E4M3 bytes of E2M1 x 2^-6, exactly: (even, odd), byte
    b of `even` from nibble 2b (element 2b), of `odd` from nibble 2b + 1. A nibble `s e1 e0 m`
    becomes the byte `s 0 0 e1 e0 m 0 0`: exponent field `e1 e0`, mantissa `m 0 0`, so
    2^(e-7) (1 + m/2) for e >= 1 and the subnormal 2^-6 m/2 for e = 0. Also runs on numpy
    uint32 arrays (the CPU tests check it against lowprec for every nibble)."""
    u = np.uint32 if isinstance(word, (np.ndarray, np.generic)) else Uint32
    even = ((word << u(4)) & u(0x80808080)) | ((word << u(2)) & u(0x1C1C1C1C))
    odd = (word & u(0x80808080)) | ((word >> u(2)) & u(0x1C1C1C1C))
    return even, odd


def _nvfp4_codes(frag, words):
    """The 16 E2M1 values x 2^-6 of one block into `frag` (fp32, exact): codes re-packed as
    E4M3 (e2m1_as_e4m3), two a `cvt.rn.f16x2.e4m3x2`, f16 -> fp32."""
    for w in range(W // 8):
        for first, packed in enumerate(e2m1_as_e4m3(words[w])):
            for half in range(2):
                a, b = ptx.f16x2_to_f32x2(ptx.e4m3x2_to_f16x2(packed, half))
                e = 8 * w + 4 * half + first  # bytes 2 half, 2 half + 1: elements e, e + 2
                frag[e] = a
                frag[e + 2] = b


def _block_scale(scale_byte, global_scale):
    """(2^6 s_b) s_g: the factor of a block's partial sums of E2M1 x 2^-6 (2^6 s_b exact)."""
    return (nm.e4m3_value(Uint32(scale_byte)) * Float32(E2M1_AS_E4M3)) * global_scale


class GDNOutput:
    def __init__(self, config: GDNConfig):
        self.cfg = config

    @cute.jit
    def __call__(
        self,
        p_hi: cute.Pointer,
        p_lo: cute.Pointer,
        p_lo_scales: cute.Pointer,
        p_lo_global: cute.Pointer,
        p_ring_u: cute.Pointer,
        p_ring_v: cute.Pointer,
        p_ring_k: cute.Pointer,
        p_ring_g: cute.Pointer,
        p_ring_beta: cute.Pointer,
        p_cursors: cute.Pointer,
        p_q: cute.Pointer,
        p_k: cute.Pointer,
        p_v: cute.Pointer,
        p_g: cute.Pointer,
        p_beta: cute.Pointer,
        p_out: cute.Pointer,
        batch: Int32,
        stream,
    ):
        cfg = self.cfg
        H, P, N, L = cfg.nheads, cfg.dv, cfg.dk, cfg.window
        hi = cute.make_tensor(p_hi, cute.make_layout((batch, H, P, N),
                                                     stride=(H * P * N, P * N, N, 1)))
        codes = cute.make_tensor(p_lo, cute.make_layout(
            (batch, H, P, N // 8), stride=(H * P * N // 8, P * N // 8, N // 8, 1)))
        scales = cute.make_tensor(p_lo_scales, cute.make_layout(
            (batch, H, P, N // W), stride=(H * P * N // W, P * N // W, N // W, 1)))
        per_head = cute.make_layout((batch, H), stride=(H, 1))
        lo_global = cute.make_tensor(p_lo_global, per_head)
        value_ring = cute.make_layout((batch, H, L, P), stride=(H * L * P, L * P, P, 1))
        ring_u = cute.make_tensor(p_ring_u, value_ring)
        ring_v = cute.make_tensor(p_ring_v, value_ring)
        ring_k = cute.make_tensor(p_ring_k, cute.make_layout(
            (batch, H, L, N), stride=(H * L * N, L * N, N, 1)))
        ring_rows = cute.make_layout((batch, H, L), stride=(H * L, L, 1))
        ring_g = cute.make_tensor(p_ring_g, ring_rows)
        ring_beta = cute.make_tensor(p_ring_beta, ring_rows)
        cursors = cute.make_tensor(p_cursors, cute.make_layout(batch))
        keys_rows = cute.make_layout((batch, H, N), stride=(H * N, N, 1))
        q = cute.make_tensor(p_q, keys_rows)
        k = cute.make_tensor(p_k, keys_rows)
        value_rows = cute.make_layout((batch, H, P), stride=(H * P, P, 1))
        v = cute.make_tensor(p_v, value_rows)
        out = cute.make_tensor(p_out, value_rows)
        g = cute.make_tensor(p_g, per_head)
        beta = cute.make_tensor(p_beta, per_head)
        self.kernel(hi, codes, scales, lo_global, ring_u, ring_v, ring_k, ring_g, ring_beta,
                    cursors, q, k, v, g, beta, out).launch(
            grid=[H, batch, 1], block=[cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        hi: cute.Tensor,
        codes: cute.Tensor,
        scales: cute.Tensor,
        lo_global: cute.Tensor,
        ring_u: cute.Tensor,
        ring_v: cute.Tensor,
        ring_k: cute.Tensor,
        ring_g: cute.Tensor,
        ring_beta: cute.Tensor,
        cursors: cute.Tensor,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        out: cute.Tensor,
    ):
        cfg = self.cfg
        N, L, T = cfg.dk, cfg.window, cfg.threads
        R, step = cfg.lanes_per_row, cfg.rows_per_pass
        nvfp4 = cfg.lo_format == "nvfp4"
        tidx, _, _ = cute.arch.thread_idx()
        h, s, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        col = tidx % R
        row0 = tidx // R
        rows = [row0 + step * i for i in range(cfg.passes)]
        smem = SmemAllocator()
        sW = smem.allocate_tensor(Float32, cute.make_layout(33), 16)  # w_j; [32]: G_c
        sKK = smem.allocate_tensor(Float32, cute.make_layout(32), 16)  # kk_j
        sKQ = smem.allocate_tensor(Float32, cute.make_layout(32), 16)  # kq_j

        c = cursors[s]
        if (c >= 0) & (c < L - 1):
            # the read copy first: every state load in flight before the ring's arithmetic
            word_frags = []
            scale_bytes = []
            if cutlass.const_expr(nvfp4):
                codes_h = codes[s, h, None, None]
                for i in cutlass.range_constexpr(cfg.passes):
                    frag = cute.make_rmem_tensor((W // 8,), Uint32)
                    cute.autovec_copy(chunk_of(codes_h, rows[i], col, W // 8), frag)
                    word_frags.append(frag)
                    scale_bytes.append(scales[s, h, rows[i], col])
                global_scale = lo_global[s, h]
            else:
                hi_h = hi[s, h, None, None]
                for i in cutlass.range_constexpr(cfg.passes):
                    frag = cute.make_rmem_tensor((W,), Float32)
                    cute.autovec_copy(chunk_of(hi_h, rows[i], col), frag)
                    word_frags.append(frag)
            # the ring's u of records col + R m and the rows' v: loaded before the barriers
            ring_terms = (L - 1 + R - 1) // R
            held = []
            u_ring = []
            v_rows = []
            for i in cutlass.range_constexpr(cfg.passes):
                v_rows.append(v[s, h, rows[i]].to(Float32))
                for m in cutlass.range_constexpr(ring_terms):
                    j = col + R * m
                    if cutlass.const_expr(i == 0):
                        held.append(j < c)
                    u_ring.append(ring_u[s, h, nm._sel(held[m], j, Int32(0)), rows[i]])

            # cumulative log-decays by warp 0: lane t < L cum_t -> w_t; G_c to sW[32]
            if warp == 0:
                g_c = g[s, h]
                cum_c = Float32(0.0)
                cum_t = Float32(0.0)
                for i in cutlass.range_constexpr(L):
                    g_i = nm._sel(Int32(i) < c, ring_g[s, h, i],
                                  nm._sel(Int32(i) == c, g_c, Float32(0.0)))
                    cum_c = cum_c + g_i
                    cum_t = cum_t + nm._sel(Int32(i) <= lane, g_i, Float32(0.0))
                if lane < L:
                    sW[lane] = cute.math.exp(cum_c - cum_t)
                if lane == 0:
                    sW[32] = cute.math.exp(cum_c)
            cute.arch.sync_threads()
            decay_c = sW[32]

            # kk_j, kq_j: warp w takes records w, w + T/32, ...; a lane dk / 32 columns
            E = N // 32
            k_lane = []
            q_lane = []
            for e in cutlass.range_constexpr(E):
                k_lane.append(k[s, h, lane * E + e].to(Float32))
                q_lane.append(q[s, h, lane * E + e].to(Float32))
            for m in cutlass.range_constexpr((L + T // 32 - 1) // (T // 32)):
                j = warp + (T // 32) * m
                if j <= c:
                    j_ring = nm._sel(j < L, j, Int32(0))
                    w_j = sW[j]
                    kk = Float32(0.0)
                    kq = Float32(0.0)
                    for e in cutlass.range_constexpr(E):
                        k_je = nm._sel(j < c, ring_k[s, h, j_ring, lane * E + e].to(Float32),
                                       k_lane[e])
                        kw = k_je * w_j
                        kk = kk + kw * k_lane[e]
                        kq = kq + kw * q_lane[e]
                    kk = cute.arch.warp_reduction(kk, add)
                    kq = cute.arch.warp_reduction(kq, add)
                    if lane == 0:
                        sKK[j] = kk
                        sKQ[j] = kq
            cute.arch.sync_threads()

            # one pass over the read copy, two products, plus the ring's terms
            k_vec = load_vector_chunk(k[s, h, None], col) * decay_c
            q_vec = load_vector_chunk(q[s, h, None], col) * decay_c
            beta_c = beta[s, h]
            kq_c = sKQ[c]
            for i in cutlass.range_constexpr(cfg.passes):
                p = rows[i]
                if cutlass.const_expr(nvfp4):
                    vals = cute.make_rmem_tensor((W,), Float32)
                    _nvfp4_codes(vals, word_frags[i])
                    values = vals.load()
                else:
                    values = word_frags[i].load()
                part_k = (values * k_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                part_q = (values * q_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                if cutlass.const_expr(nvfp4):
                    scale = _block_scale(scale_bytes[i], global_scale)
                    part_k = part_k * scale
                    part_q = part_q * scale
                for m in cutlass.range_constexpr(ring_terms):
                    j_ring = nm._sel(held[m], col + R * m, Int32(0))
                    u_j = u_ring[i * ring_terms + m]
                    part_k = part_k + nm._sel(held[m], u_j * sKK[j_ring], Float32(0.0))
                    part_q = part_q + nm._sel(held[m], u_j * sKQ[j_ring], Float32(0.0))
                total_k = cute.arch.warp_reduction(part_k, add, threads_in_group=R)
                total_q = cute.arch.warp_reduction(part_q, add, threads_in_group=R)
                u = beta_c * (v_rows[i] - total_k)
                if col == 0:
                    ring_u[s, h, c, p] = u
                    out[s, h, p] = (total_q + u * kq_c).to(out.element_type)
            append_record(cfg, tidx, c, s, h, k, v, g, beta, ring_k, ring_v, ring_g, ring_beta)


def compile_gdn_output(cfg: GDNConfig, keep_ptx: bool = False):
    """The compiled non-flush kernel of `cfg` (cached); `keep_ptx` keeps its PTX text."""

    def build():
        f = _compile.fake_ptr
        act = CUTE_DTYPES[cfg.act]
        hi_t = Float32 if cfg.hi_format == "fp32" else cutlass.Float16
        args = (f(hi_t), f(Uint32), f(cutlass.Uint8), f(Float32),
                f(Float32), f(act), f(act), f(Float32), f(Float32), f(Int32),
                f(act), f(act), f(act), f(Float32), f(Float32), f(act),
                Int32(1), _compile.fake_stream())
        return cute.compile(GDNOutput(cfg), *args, options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("gdn_output", cfg, keep_ptx), build)


def launch_gdn_output(cfg: GDNConfig, cache, q, k, v, g, beta, out):
    """Launch the non-flush kernel on torch's current stream (everything already validated):
    slots whose cursor is below window - 1 advance their output and record, the others are
    left alone. Reads the cursors, never writes them."""
    # the read path does not depend on the store's rounding or the debug output: one kernel
    kernel = compile_gdn_output(dataclasses.replace(cfg, hi_rounding="rn", has_debug=False))
    gp = _compile.gmem_ptr
    kernel(gp(cache.hi), optional_ptr(cache.lo, Uint32),
           optional_ptr(cache.lo_scales, cutlass.Uint8), optional_ptr(cache.lo_global, Float32),
           gp(cache.ring_u), gp(cache.ring_v), gp(cache.ring_k), gp(cache.ring_g),
           gp(cache.ring_beta), gp(cache.cursors), gp(q), gp(k), gp(v), gp(g), gp(beta),
           gp(out), Int32(cache.hi.shape[0]), _compile.current_stream())


def traffic_bytes(lo_format: str, act: str, slots: int, nheads: int, dv: int, dk: int,
                  records: int) -> int:
    """Bytes one non-flush step moves for `slots` slots holding `records` ring records each
    (the cursor c), each read once and each write once: the read copy; the ring's u (fp32),
    k (act) and g; q, k, v, g, beta read; y written; the record (u, v, k, g, beta)
    appended."""
    a = ACT_BYTES[act]
    copy = dv * dk // 2 + dv * dk // W + 4 if lo_format == "nvfp4" else 4 * dv * dk
    ring = records * (4 * dv + a * dk + 4)
    inputs = (2 * dk + dv) * a + 8
    record = 4 * dv + (dv + dk) * a + 8
    return slots * nheads * (copy + ring + inputs + dv * a + record)
