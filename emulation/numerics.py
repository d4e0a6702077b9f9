"""Rounding, block scaling and random words in Triton registers, bit for bit equal to `lowprec`.

Every function here reproduces one rule of `lowprec/README.md` on fp32 registers, so that a
kernel storing `round_element(S)` or `quantize_tile(S)` stores exactly what
`lowprec.quantize.round_to` / `lowprec.quantize.quantize` return for the same fp32 input and
random words. Why each step is exact (also on the GPU, where Triton emits plain IEEE `mul.f32`,
`div.rn.f32` and `cvt.rmi` without flush-to-zero) is argued in `emulation/README.md`:

    element   a = min(|x|, max_finite);  e = max(binade(a), emin);  m = a * 2^(mbits - e)
              RN: q = round_half_even(m) * 2^(e - mbits)       SR: q = (floor(m) + up) * 2^(...)
              up = r < uint32(frac(m) * 2^k)   (k = sr_bits)    sign copied from x, NaN kept
    nvfp4     s_g = amax / 2688;  s_b = RN_e4m3(amax_b / (6 s_g));  code = ROUND(x / (s_b s_g))
    mxfp4     s_b = 2^clamp(binade(amax_b) - 2, -127, 127);      code = ROUND(x / s_b)
    ideal     s   = amax_b / max_finite (fp32, unrounded);        code = ROUND(x / s)

Formats are data: the kernels take a `FormatSpec` (a NamedTuple built from a `lowprec` Format
by `format_spec`) as one `tl.constexpr` argument and read its fields; the only branches are on
those fields (is there a block scale, is it a power of two, is there a second level).

Random draws: `random_words(seed, slot, flush, element, SR_BITS, ROUNDS)` is
`lowprec.philox.random_words(..., sr_bits=SR_BITS, philox_rounds=ROUNDS)` draw for draw: the
low k = SR_BITS bits of lane `element % n` of word `(element % E) // n` of
`tl.randint4x(seed, (slot << 44) | (flush << 24) | (element // E), ROUNDS)` (lanes of W = 32,
16, 16, 8 bits for k = 32, 16, 13, 8; n = 32 / W, E = 4 n). At the reference (32, 10) that
is word `element % 4` of counter `element // 4` (`tl.randint` forms the same four words and keeps
the first, so selecting one costs nothing extra). Both are compile-time constants of every
kernel that stores an SR copy, taken from the cache's `sr_bits` / `philox_rounds`.

Host wrappers `round_to`, `quantize` and `random_words_host` run these device functions over
whole tensors; the tests compare them with `lowprec` on every format and special value.

Triton reads TRITON_INTERPRET when a function is decorated, so on a machine without CUDA this
module switches the interpreter on before defining any kernel (Triton cannot compile for a CPU);
every module of `emulation/` imports this one first.
"""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
_TRITON_WAS_IMPORTED = "triton" in sys.modules

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from lowprec import formats, philox  # noqa: E402
from lowprec.quantize import Quantized  # noqa: E402
from lowprec.quantize import round_to as lowprec_round_to  # noqa: E402

# Triton's own library functions (tl.sum, tl.randint, ...) are decorated when triton is first
# imported; if that happened before TRITON_INTERPRET=1 was set, interpreted kernels cannot
# call them. Say so here rather than with an obscure error at the first launch.
if (
    os.environ.get("TRITON_INTERPRET") == "1"
    and _TRITON_WAS_IMPORTED
    and not isinstance(tl.randint, InterpretedFunction)
):
    raise ImportError(
        "emulation: triton was imported before TRITON_INTERPRET=1 was set; on a machine "
        "without CUDA set it before the first `import triton` (tests/conftest.py, or the "
        "environment)"
    )

__all__ = [
    "ElementSpec",
    "FormatSpec",
    "element_spec",
    "format_spec",
    "round_element",
    "quantize_tile",
    "quantize_tile_codes",
    "random_words",
    "round_to",
    "quantize",
    "random_words_host",
    "codes_of",
    "check_kernel_format",
]

FP32_MAX = float(torch.finfo(torch.float32).max)
E8M0_EMIN = -127  # OCP MX: E8M0 holds 2^-127 .. 2^127
E8M0_EMAX = 127
INF = tl.constexpr(float("inf"))


# --------------------------------------------------------------------------------------------
# formats as kernel data


class ElementSpec(NamedTuple):
    """The fields of one element format the kernels read (all compile-time constants)."""

    mbits: int
    emin: int
    emax: int
    max_finite: float
    identity: bool  # the grid holds every fp32 value: rounding only saturates +-inf


class FormatSpec(NamedTuple):
    """A `lowprec` Format as kernel data.

    block: 0 (elements only), a block length, or -1 (`formats.ROW`: one scale per row).
    scale: the block scale's element format (None without blocks). pow2_scale: the scale is
    the MX power of two `2^clamp(binade(amax_b) - element.emax, scale.emin, scale.emax)`
    instead of a rounded ratio. two_level: nvfp4's fp32 scale per state.
    """

    element: ElementSpec
    block: int
    scale: ElementSpec | None
    pow2_scale: bool
    two_level: bool


def element_spec(element: formats.ElementFormat) -> ElementSpec:
    identity = element.mbits >= 23 and element.emin <= -126 and element.max_finite >= FP32_MAX
    return ElementSpec(
        element.mbits, element.emin, element.emax, min(element.max_finite, FP32_MAX), identity
    )


_E8M0 = ElementSpec(0, E8M0_EMIN, E8M0_EMAX, math.ldexp(1.0, E8M0_EMAX), False)
_SCALE_SPECS = {
    None: None,
    "e4m3": element_spec(formats.E4M3),
    "e8m0": _E8M0,
    "fp32": element_spec(formats.FP32),
}


def format_spec(fmt) -> FormatSpec:
    """The kernel data of a `lowprec` format (a Format or its name)."""
    fmt = formats.get(fmt)
    return FormatSpec(
        element=element_spec(fmt.element),
        block=0 if fmt.block is None else fmt.block,
        scale=_SCALE_SPECS[fmt.scale],
        pow2_scale=fmt.scale == "e8m0",
        two_level=fmt.two_level,
    )


def check_kernel_format(name: str, fmt, dstate: int | None = None):
    """The `lowprec` Format called `fmt`, if the fp32 kernels can store it; else ValueError."""
    try:
        fmt = formats.get(fmt)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if fmt.element.bits > 32:
        raise ValueError(
            f"{name}: expected a format of at most 32-bit elements (fp32 is the kernels' exact "
            f"arm), got {fmt.name!r}"
        )
    if dstate is not None and fmt.block not in (None, formats.ROW) and dstate % fmt.block:
        raise ValueError(
            f"{name}: format {fmt.name!r} needs dstate divisible by {fmt.block}, got {dstate}"
        )
    return fmt


# --------------------------------------------------------------------------------------------
# device functions


@triton.jit
def pow2_any(k):
    """2^k as fp32 for integer k in [-149, 127], subnormals included, built from its bits."""
    normal = ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True)
    subnormal = (1 << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, subnormal)


@triton.jit
def scale_pow2(x, k):
    """x * 2^k for integer |k| <= 252, as two products by normal powers of two 2^(k/2).

    Each product is exact while its result is representable; splitting k in halves keeps the
    intermediate inside the normal range for every (x, k) the rounding below produces.
    """
    k_lo = k >> 1
    k_hi = k - k_lo
    x = x * ((k_lo + 127) << 23).to(tl.float32, bitcast=True)
    return x * ((k_hi + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def binade(a):
    """floor(log2 a) for a normal fp32 a >= 0 from its exponent bits; -127 for 0 and subnormals.

    Every caller clamps the result to an emin >= -126 (or -127 + emax for MX), where the
    subnormal binades all clamp to the same value, so reading the field is enough.
    """
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def sr_threshold(frac, SR_BITS: tl.constexpr):
    """floor(frac * 2^SR_BITS) as uint32 for frac in [0, 1): the top SR_BITS bits of the
    fraction (the product is exact, a power-of-two scaling; the cast truncates)."""
    if SR_BITS == 32:
        scaled = frac * 4294967296.0  # <= 2^32 - 256: exact in uint32
    elif SR_BITS == 16:
        scaled = frac * 65536.0
    elif SR_BITS == 13:
        scaled = frac * 8192.0
    else:
        scaled = frac * 256.0
    return scaled.to(tl.uint32)


@triton.jit
def round_element(x, r, E: tl.constexpr, USE_SR: tl.constexpr, SR_BITS: tl.constexpr = 32):
    """Round fp32 `x` onto element format `E`'s grid, saturating; `r` uint32 draws in
    [0, 2^SR_BITS) for SR.

    RN ties to even; SR rounds away from zero iff r < floor(frac(m) * 2^SR_BITS). -0 stays -0,
    NaN stays NaN (the input's bits), +-inf saturates to +-max_finite.
    """
    if E.identity:
        q = tl.where(tl.abs(x) > E.max_finite, tl.where(x < 0, -E.max_finite, E.max_finite), x)
    else:
        a = tl.abs(x)
        # Saturate first: everything above max_finite rounds to it (max_finite is on the grid
        # and rounding is monotone), and inf/NaN never enter the arithmetic below.
        a = tl.where(a <= E.max_finite, a, E.max_finite)
        k = E.mbits - tl.maximum(binade(a), E.emin)  # m = a * 2^k counts ulps
        m = scale_pow2(a, k)
        fl = tl.floor(m)
        frac = m - fl  # exact: fl and m share a binade or fl is 0
        if USE_SR:
            up = r < sr_threshold(frac, SR_BITS)
        else:
            odd = (fl.to(tl.int32) & 1) == 1
            up = (frac > 0.5) | ((frac == 0.5) & odd)
        q = scale_pow2(fl + up.to(tl.float32), -k)
        q = tl.minimum(q, E.max_finite)
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000
        q = (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        q = tl.where(x == x, q, x)
    return q


@triton.jit
def quantize_tile(
    b_x, b_r, F: tl.constexpr, USE_SR: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    SR_BITS: tl.constexpr = 32,
):
    """Quantise one state tile `b_x [BV, BK]` (padding must be 0) in format `F`.

    Returns `(b_q [BV, BK], b_scale [BV, BK // block], s_g)`: the dequantised values
    `(code * s_b) * s_g`, the block scales `s_b` and the second-level scale (1.0 where the
    format has none; `b_scale` is a [BV, 1] dummy of ones for element-only formats). `b_r`:
    uint32 draws [BV, BK] in [0, 2^SR_BITS) for SR (element rounding only; scales are always
    RN).
    """
    b_q, _, b_scale, s_g = quantize_tile_codes(b_x, b_r, F, USE_SR, BV, BK, SR_BITS)
    return b_q, b_scale, s_g


@triton.jit
def quantize_tile_codes(
    b_x, b_r, F: tl.constexpr, USE_SR: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    SR_BITS: tl.constexpr = 32,
):
    """`quantize_tile` that also returns the element codes: `(b_q, b_code [BV, BK], b_scale,
    s_g)` (`b_code` is `b_q` for element-only formats)."""
    # Nested format data must be bound to constexpr names before it is passed on.
    ELEM: tl.constexpr = F.element
    SCALE: tl.constexpr = F.scale
    if F.block == 0:
        b_q = round_element(b_x, b_r, ELEM, USE_SR, SR_BITS)
        b_code = b_q
        b_scale = tl.full([BV, 1], 1.0, tl.float32)
        s_g = tl.full([], 1.0, tl.float32)
    else:
        BLOCK: tl.constexpr = BK if F.block == -1 else F.block
        NB: tl.constexpr = BK // BLOCK
        b_xb = tl.reshape(b_x, [BV, NB, BLOCK])
        b_amax = tl.max(tl.abs(b_xb), axis=2)  # [BV, NB]
        if F.two_level:
            s_g = tl.math.div_rn(
                tl.max(tl.max(b_amax, axis=1), axis=0), F.scale.max_finite * F.element.max_finite
            )
            den = F.element.max_finite * s_g
            ratio = tl.math.div_rn(b_amax, tl.where(den == 0, 1.0, den))
            ratio = tl.where(den == 0, INF, ratio)  # amax_b / 0 = inf, as lowprec computes it
            ratio = tl.where(b_amax == 0, 0.0, ratio)
            b_scale = round_element(ratio, ratio, SCALE, False)
            b_div = b_scale * s_g
        elif F.pow2_scale:
            exponent = tl.minimum(
                tl.maximum(binade(b_amax) - F.element.emax, F.scale.emin), F.scale.emax
            )
            exponent = tl.where(b_amax == 0, F.scale.emin, exponent)
            b_scale = pow2_any(exponent)
            b_div = b_scale
            s_g = tl.full([], 1.0, tl.float32)
        else:
            b_scale = tl.math.div_rn(b_amax, tl.full([BV, NB], F.element.max_finite, tl.float32))
            b_div = b_scale
            s_g = tl.full([], 1.0, tl.float32)
        b_zero = (b_amax == 0) | (b_div == 0)  # [BV, NB]: codes +0
        b_safe = tl.where(b_zero, 1.0, b_div)
        b_rb = tl.reshape(b_r, [BV, NB, BLOCK])
        b_code = round_element(
            tl.math.div_rn(b_xb, b_safe[:, :, None]), b_rb, ELEM, USE_SR, SR_BITS
        )
        b_code = tl.where(b_zero[:, :, None], 0.0, b_code)
        b_qb = b_code * b_scale[:, :, None]
        if F.two_level:
            b_qb = b_qb * s_g
        b_q = tl.reshape(b_qb, [BV, BK])
        b_code = tl.reshape(b_code, [BV, BK])
    return b_q, b_code, b_scale, s_g


@triton.jit
def random_words(seed, slot, flush, element, SR_BITS: tl.constexpr = 32,
                 ROUNDS: tl.constexpr = 10):
    """uint32 SR draws in [0, 2^SR_BITS) of state elements (`lowprec.philox` module doc): the
    low SR_BITS bits of lane `element % n` of word `(element % E) // n` of
    `tl.randint4x(seed, (slot << 44) | (flush << 24) | (element // E), ROUNDS)`, with lanes of
    W = 32, 16, 16, 8 bits for SR_BITS = 32, 16, 13, 8, n = 32 / W and E = 4 n."""
    if SR_BITS == 32:
        r = _lane_draws(seed, slot, flush, element, 0, ROUNDS)
    elif SR_BITS == 8:
        r = _lane_draws(seed, slot, flush, element, 2, ROUNDS)
    else:
        r = _lane_draws(seed, slot, flush, element, 1, ROUNDS)
    if SR_BITS == 13:
        r = r & 0x1FFF  # the low 13 bits of a 16-bit lane
    return r


@triton.jit
def _lane_draws(seed, slot, flush, element, LOG_LANES: tl.constexpr, ROUNDS: tl.constexpr):
    """Lane `element % 2^LOG_LANES` (of 32 >> LOG_LANES bits) of word
    `(element >> LOG_LANES) % 4` of the counter `element >> (LOG_LANES + 2)`, as uint32."""
    # tl.cast, not .to: Triton passes an int argument equal to 1 as a constant, not a tensor.
    e = tl.cast(element, tl.int64)
    offset = (
        (tl.cast(slot, tl.int64) << 44) | (tl.cast(flush, tl.int64) << 24)
        | (e >> (LOG_LANES + 2))
    )
    w0, w1, w2, w3 = tl.randint4x(seed, offset, ROUNDS)
    which = (e >> LOG_LANES) & 3
    w = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
    if LOG_LANES > 0:
        WIDTH: tl.constexpr = 32 >> LOG_LANES
        shift = ((e & ((1 << LOG_LANES) - 1)) * WIDTH).to(tl.uint32)
        w = (w >> shift) & ((1 << WIDTH) - 1)
    return w


# --------------------------------------------------------------------------------------------
# host wrappers (kernels over whole tensors, for tests and for callers without a cache)

ROUND_BLOCK = 1024


@triton.jit
def _round_to_kernel(
    p_x, p_r, p_q, n, E: tl.constexpr, USE_SR: tl.constexpr, SR_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    o_x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    b_x = tl.load(p_x + o_x, mask=m_x, other=0.0)
    b_r = tl.load(p_r + o_x, mask=m_x, other=0).to(tl.uint32) if USE_SR else o_x
    tl.store(p_q + o_x, round_element(b_x, b_r, E, USE_SR, SR_BITS), mask=m_x)


@triton.jit
def _quantize_kernel(
    p_x, p_r, p_q, p_code, p_scale, p_global, dv, dk, n_blocks,
    F: tl.constexpr, USE_SR: tl.constexpr, SR_BITS: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr,
):
    i_s = tl.program_id(0).to(tl.int64)  # one state [dv, dk] per program
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_vk = (o_v[:, None] < dv) & (o_k[None, :] < dk)
    o_vk = i_s * dv * dk + o_v[:, None] * dk + o_k[None, :]  # [BV, BK]
    b_x = tl.load(p_x + o_vk, mask=m_vk, other=0.0)
    b_r = tl.load(p_r + o_vk, mask=m_vk, other=0).to(tl.uint32) if USE_SR else o_vk
    b_q, b_code, b_scale, s_g = quantize_tile_codes(b_x, b_r, F, USE_SR, BV, BK, SR_BITS)
    tl.store(p_q + o_vk, b_q, mask=m_vk)
    tl.store(p_code + o_vk, b_code, mask=m_vk)
    if F.block != 0:
        NB: tl.constexpr = BK // (BK if F.block == -1 else F.block)
        o_b = tl.arange(0, NB)
        m_b = (o_v[:, None] < dv) & (o_b[None, :] < n_blocks)
        tl.store(p_scale + i_s * dv * n_blocks + o_v[:, None] * n_blocks + o_b[None, :],
                 b_scale, mask=m_b)
    if F.two_level:
        tl.store(p_global + i_s, s_g)


@triton.jit
def _random_words_kernel(
    p_w, seed, slot, flush, n, SR_BITS: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr
):
    o_e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b_w = random_words(seed, slot, flush, o_e, SR_BITS, ROUNDS)
    tl.store(p_w + o_e, b_w.to(tl.int64), mask=o_e < n)


def _draws(sr_bits: int) -> str:
    """What `rand` holds, for messages: 'uint32 words' or '16-bit draws (sr_bits=16)'."""
    return "uint32 words" if sr_bits == 32 else f"{sr_bits}-bit draws (sr_bits={sr_bits})"


def _check_words(rand, rounding: str, x: torch.Tensor, sr_bits: int) -> None:
    if rounding not in ("rn", "sr"):
        raise ValueError(f"rounding: expected 'rn' or 'sr', got {rounding!r}")
    if rounding == "rn":
        if rand is not None:
            raise ValueError("rand: expected None for rounding='rn', got a tensor")
        return
    if not isinstance(rand, torch.Tensor) or rand.dtype != torch.int64:
        got = rand.dtype if isinstance(rand, torch.Tensor) else type(rand).__name__
        raise ValueError(f"rand: expected an int64 tensor of {_draws(sr_bits)}, got {got}")
    if rand.shape != x.shape or rand.device != x.device:
        raise ValueError(
            f"rand: expected shape {list(x.shape)} on {x.device}, got {list(rand.shape)} on "
            f"{rand.device}"
        )
    # the kernels read draws as uint32 (wrapping), so a draw outside [0, 2^sr_bits) would
    # round with some other draw where lowprec refuses it: refuse it here too
    if rand.numel() and (int(rand.min()) < 0 or int(rand.max()) >= 1 << sr_bits):
        raise ValueError(
            f"rand: expected {_draws(sr_bits)} in [0, 2^{sr_bits}), got range "
            f"[{int(rand.min())}, {int(rand.max())}]"
        )


def _check_sr_bits(sr_bits, rounding: str) -> int:
    """`sr_bits` checked as lowprec checks it: in `SR_BITS`, and the default for RN."""
    sr_bits = philox.check_sr_bits(sr_bits)
    if rounding != "sr" and sr_bits != philox.DEFAULT_SR_BITS:
        raise ValueError(f"sr_bits: expected the default {philox.DEFAULT_SR_BITS} for "
                         f"rounding={rounding!r} (only SR draws bits), got {sr_bits}")
    return sr_bits


def _check_fp32(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a float32 tensor, got {got}")
    if x.device.type == "meta":  # no data for a kernel to read
        raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")


def round_to(x: torch.Tensor, element, rounding: str = "rn", rand=None, *,
             sr_bits: int = philox.DEFAULT_SR_BITS) -> torch.Tensor:
    """`lowprec.quantize.round_to` in a Triton kernel: fp32 `x`, an ElementFormat (or name);
    for SR `rand` holds int64 draws in [0, 2^sr_bits), x's shape."""
    _check_fp32("x", x)
    if isinstance(element, str):
        element = formats.ELEMENTS.get(element, element)
    if not isinstance(element, formats.ElementFormat) or element.bits > 32:
        names = [n for n, e in formats.ELEMENTS.items() if e.bits <= 32]
        raise ValueError(f"element: expected an ElementFormat of <= 32 bits or one of {names}, "
                         f"got {element!r}")
    _check_words(rand, rounding, x, _check_sr_bits(sr_bits, rounding))
    x = x.contiguous()
    q = torch.empty_like(x)
    n = x.numel()
    if n:
        words = rand.contiguous() if rounding == "sr" else x
        _round_to_kernel[(triton.cdiv(n, ROUND_BLOCK),)](
            x, words, q, n, E=element_spec(element), USE_SR=rounding == "sr", SR_BITS=sr_bits,
            BLOCK=ROUND_BLOCK,
        )
    return q


def quantize(x: torch.Tensor, fmt, rounding: str = "rn", rand=None, *,
             sr_bits: int = philox.DEFAULT_SR_BITS) -> Quantized:
    """`lowprec.quantize.quantize` in a Triton kernel for a state-shaped fp32 `x [..., dv, dk]`
    (SR: `rand` int64 draws in [0, 2^sr_bits), x's shape).

    Returns a `Quantized` whose `elements` are the code values the kernel rounded (its
    `b_code`, stored beside the dequantised values; for element-only formats the values).
    """
    _check_fp32("x", x)
    if x.dim() < 2:
        raise ValueError(f"x: expected shape [..., dv, dk], got {list(x.shape)}")
    fmt = check_kernel_format("fmt", fmt, x.shape[-1])
    if fmt.two_level and x.shape[-2] == 0:
        # no rows: no amax to take s_g from, and no kernel runs to write it (lowprec refuses)
        raise ValueError(f"x: expected dv >= 1 for {fmt.name!r} (its per-state scale), got "
                         f"shape {list(x.shape)}")
    _check_words(rand, rounding, x, _check_sr_bits(sr_bits, rounding))
    dv, dk = x.shape[-2:]
    lead = x.shape[:-2]
    n_states = math.prod(lead)
    x = x.contiguous()
    q = torch.empty_like(x)
    # the codes as the kernel rounded them: codes_of(q, ...) cannot recover them where the
    # container (code * s_b) * s_g lost bits below fp32's normal range (tiny nvfp4 states)
    codes = torch.empty_like(x)
    n_blocks = 1 if fmt.block is None else dk // fmt.block_length(x.shape)
    scales = torch.empty(*lead, dv, n_blocks, dtype=torch.float32, device=x.device)
    global_scale = torch.empty(lead, dtype=torch.float32, device=x.device)
    if x.numel():
        words = rand.contiguous() if rounding == "sr" else x
        _quantize_kernel[(n_states,)](
            x, words, q, codes, scales, global_scale, dv, dk, n_blocks,
            F=format_spec(fmt), USE_SR=rounding == "sr", SR_BITS=sr_bits,
            BV=triton.next_power_of_2(dv), BK=triton.next_power_of_2(dk),
        )
    if fmt.block is None:
        return Quantized(fmt, q)
    return Quantized(fmt, codes, scales, global_scale if fmt.two_level else None)


def codes_of(values: torch.Tensor, fmt, scales: torch.Tensor, global_scale=None) -> torch.Tensor:
    """Element codes of a block format's dequantised fp32 container `(code * s_b) * s_g`.

    `code * s_b` is exact, so dividing the container back by the scales in fp64 gives the code
    to within one fp32 rounding (relative 2^-24), far inside half a step of the element grid,
    and RN onto that grid returns the code exactly; zero scales give code +0. (Not for values
    that fell below fp32's normal range in the product with s_g, which needs a state amax
    below about 2^-110.)
    """
    fmt = check_kernel_format("fmt", fmt)
    if fmt.block is None:
        raise ValueError(f"fmt: expected a block format (an element format's container holds "
                         f"its codes), got {fmt.name!r}")
    # a missing (or extra) s_g or scales of another shape divide by the wrong numbers and give
    # codes silently, so the layout is checked as the kernels write it
    _check_fp32("values", values)
    if values.dim() < 2:
        raise ValueError(f"values: expected shape [..., dv, dk], got {list(values.shape)}")
    shape = values.shape
    n_blocks = shape[-1] // fmt.block_length(shape)
    _check_fp32("scales", scales)
    if tuple(scales.shape) != (*shape[:-1], n_blocks):
        raise ValueError(f"scales: expected shape {[*shape[:-1], n_blocks]}, got "
                         f"{list(scales.shape)}")
    if fmt.two_level:
        _check_fp32("global_scale", global_scale)
        if tuple(global_scale.shape) != tuple(shape[:-2]):
            raise ValueError(f"global_scale: expected shape {list(shape[:-2])}, got "
                             f"{list(global_scale.shape)}")
    elif global_scale is not None:
        raise ValueError(f"global_scale: expected None for {fmt.name!r}, got a tensor")
    # lowprec runs on the CPU
    v = values.cpu().double().reshape(*shape[:-1], n_blocks, shape[-1] // n_blocks)
    divisor = scales.cpu().double()[..., None]
    if global_scale is not None:
        divisor = divisor * global_scale.cpu().double()[..., None, None, None]
    zero = divisor == 0
    codes = torch.where(zero, 0.0, v / torch.where(zero, 1.0, divisor))
    return lowprec_round_to(codes, fmt.element).reshape(shape).float().to(values.device)


def random_words_host(seed: int, slot: int, flush: int, numel: int, device="cpu", *,
                      sr_bits: int = philox.DEFAULT_SR_BITS,
                      philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS) -> torch.Tensor:
    """`lowprec.philox.random_words(seed, slot, flush, [numel], sr_bits=sr_bits,
    philox_rounds=philox_rounds)` from the Triton generator: int64 draws in [0, 2^sr_bits)."""
    sr_bits = philox.check_sr_bits(sr_bits)
    philox_rounds = philox.check_philox_rounds(philox_rounds)
    # the ranges lowprec.philox refuses outside: past them the offset's fields overlap or wrap
    # (slot 2^20 gives slot 0's words) and Triton reads a negative seed as another one
    for name, value, high in (("seed", seed, 64), ("slot", slot, 20), ("flush", flush, 20),
                              ("numel", numel, None)):
        limit = (1 << 24) + 1 if high is None else 1 << high
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            bound = "[0, 2^24]" if high is None else f"[0, 2^{high})"
            raise ValueError(f"{name}: expected an int in {bound}, got {value!r}")
    if torch.device(device).type == "meta":
        raise ValueError("device: expected a device with memory, got meta (no words to write)")
    words = torch.empty(numel, dtype=torch.int64, device=device)
    if numel:
        _random_words_kernel[(triton.cdiv(numel, ROUND_BLOCK),)](
            words, seed, slot, flush, numel, SR_BITS=sr_bits, ROUNDS=philox_rounds,
            BLOCK=ROUND_BLOCK,
        )
    return words
