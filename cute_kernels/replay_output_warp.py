"""Warp-level pieces of the non-flush kernel (`cute_kernels.replay_output`): value
conversions between activation words and fp32, warp dot products, the ring terms and the
gate of a head's output rows, the E2M1 -> E4M3 re-packing, and the decay weights of a warp's
heads (one segment of lanes a head: `_warp_decay_loads`, `_warp_decay_weights`,
`_store_warp_coefs`)."""

from __future__ import annotations  # noqa: I001  (_compile must precede cutlass)


from cute_kernels import _compile  # noqa: F401  (sets the sm_90a target before cutlass)

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32

from cute_kernels import ptx
from cute_kernels.numerics import bits_f32, f32_bits, silu, softplus
from cute_kernels.tensor_core import pack_16x2

_ACT_CUTE = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}



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
# Decay weights and ring dot products


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
    (clamped to the warp's last; heads ``first_head + W k``). Used by
    `_warp_decay_loads` a pass at a time, so that
    each pass's loads follow its indices (the register-stage step's SASS moves when the
    indices all come first)."""
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
