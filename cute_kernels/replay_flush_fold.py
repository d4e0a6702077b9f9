"""The flush kernel's ring folds on the tensor cores (`cute_kernels.replay_flush`):
``sum_j (w_j x_j) B_j^T`` with ``w_j x_j`` split into three bf16 parts whose sum is exact, so
that every product is exact and only the tensor cores' sums round. `_fold_mma` makes each
warp's state rows (``fold="mma"``), `_fold_direct` the same products transposed, so that the
accumulators are the thread's own elements (``fold="direct"``)."""

from __future__ import annotations  # noqa: I001  (_compile must precede cutlass)

from cute_kernels import _compile  # noqa: F401  (sets the sm_90a target before cutlass)

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32

from cute_kernels import numerics as nm
from cute_kernels import tensor_core as tc


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
