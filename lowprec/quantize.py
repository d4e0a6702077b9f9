"""Rounding, block scaling and packing: the definition every kernel reproduces bit for bit.

Element rounding (`round_to`) follows docs/design.md ("Element formats") literally:

    e   = max(floor(log2 |x|), emin)      # from frexp: exact, no log2 rounding
    ulp = 2^(e - mbits)                   # built from its bits: exact
    m   = |x| / ulp                       # exact: division by a power of two
    RN: q = sign(x) * min(round_half_even(m) * ulp, max_finite)
    SR: q = sign(x) * min((floor(m) + (r < floor((m - floor(m)) * 2^k))) * ulp, max_finite)

with `k = sr_bits` (32 by default) and `r` the element's k-bit draw in [0, 2^k). So x rounds
away from zero with probability `floor(frac 2^k) / 2^k`, `frac = m - floor(m)`, and
`E[q] - x = -sign(x) * (frac - floor(frac 2^k) / 2^k) * ulp` below max_finite: a bias toward
zero of less than 2^-k ulp, none where frac has no bits below its top k (docs/design.md,
"Stochastic rounding: random bits and Philox rounds").

computed in x's own dtype (fp32 or fp64), as a kernel computes it in fp32 registers (fp16 and
bf16 inputs are widened to fp32 first, exactly; see "Dtypes" below). Every
step is exact: with `x = mant * 2^ex` (frexp), `m = |mant| * 2^(mbits + 1 - shift)` where
`shift = max(emin + 1 - ex, 0)` is the subnormal shift, a product by a power of two that stays
in the normal range (the shift is capped where `m` is already far below 2^-32 and rounds to 0
either way); `floor`, `m - floor(m)` and the scaling by 2^k are exact; `steps * ulp` is an
integer of at most `mbits + 2` bits times a power of two no smaller than the format's smallest
subnormal, exact unless it overflows, which only happens past `max_finite`. So fp32 and fp64
evaluations of the same fp32 input agree bit for bit (tested). `±inf` saturates to
`±max_finite`, NaN stays NaN, `-0` stays `-0`. A format whose grid contains every value of the
input dtype (fp64 always, fp32 for fp32 input) is the identity except that `±inf` saturates
(fp32 input to the fp64 format keeps `±inf`: fp64's maximum overflows fp32).

Block formats (`quantize` with a `Format` that has a scale) take `x` "state shaped",
`[..., d_v, d_k]`, with blocks along the last dim. Their scale arithmetic and the element
division are single IEEE fp32 operations on `x.float()` in README's order, also when `x` is
fp64 (a block format is lossy far beyond the fp64 -> fp32 conversion, and the kernels work in
fp32; a finite fp64 value past FLT_MAX saturates to +-FLT_MAX, as RN to fp32 does, where a
plain cast would give inf). Element rounding of `x / scale` is RN or SR; scales are always RN.

    nvfp4   s_g = amax(S) / 2688;  den = 6 * s_g;  s_b = RN_e4m3(amax_b / den);
            scale = s_b * s_g;  code = ROUND_e2m1(x / scale);  x' = (code * s_b) * s_g
    mxfp4   s_b = 2^clamp(floor(log2 amax_b) - 2, -127, 127);  code = ROUND_e2m1(x / s_b)
    ideal   s = amax_b / max_finite(element) (fp32, unrounded);  code = ROUND(x / s)

Zero blocks: a block whose amax is 0 or whose scale is 0 (an all-zero state, `s_b` underflowing
E4M3, or `s_b * s_g` underflowing fp32) stores codes +0, whatever the signs of its zeros.
nvfp4 zero blocks store the scale computed above: 0 (byte 0x00) where amax_b is 0 or `s_b`
underflows E4M3; where the state's amax is so small (below 2688 * 2^-150) that `s_g` underflows
to 0, `amax_b / 0 = inf` saturates `s_b` to 448 (byte 0x7E); where only `s_b * s_g` underflows,
`s_b` keeps its byte. The emulation and the CuTe flush store the same bytes (tests named
`*divisor_underflows*`). mxfp4 zero blocks store 2^-127 (byte
0x00); ideal-scale zero blocks store 0. Non-finite inputs to a block format are outside the
contract: a NaN reaches nvfp4's scales through `amax` (its state's `s_g` and block scales), but
not mxfp4's (`frexp(NaN)` has exponent 0, so the block's scale is 2^-3 and the NaN stays in
its element, which `pack` then refuses).

`Quantized.elements` are the element values (e.g. E2M1 values) in `x`'s dtype, and
`dequantize` returns `result_dtype(fmt, x.dtype)` (x's dtype for fp32, fp64); `scales` are
the block scale values in fp32, shape `[..., d_v, n_blocks]` (`[..., d_v, 1]` for a row
format); `global_scale` is nvfp4's `s_g`, fp32 `[...]` = `x.shape[:-2]`.

Packed storage (`pack`/`unpack`, exact inverses):

    element-only formats  {'codes': raw bits, uint8 (fp8), uint16 (fp16, bf16), uint32, uint64}
    nvfp4                 {'codes': uint8 [..., d_k/2], 'scales': uint8 E4M3 bits [..., d_k/16],
                           'global_scale': fp32 [...]}
    mxfp4                 {'codes': uint8 [..., d_k/2], 'scales': uint8 E8M0 bits [..., d_k/32]}
    fp8_e4m3_row          {'codes': uint8 [..., d_k], 'scales': fp32 [..., 1]}
    fp4_e2m1_b16          {'codes': uint8 [..., d_k/2], 'scales': fp32 [..., d_k/16]}
    fp4_e2m1_b32          {'codes': uint8 [..., d_k/2], 'scales': fp32 [..., d_k/32]}

Four-bit codes go two per byte, low nibble = even index; a nibble is `s e1 e0 m`.

`unpack` and `dequantize` read storage a caller may have corrupted: they refuse (ValueError
naming the field) NaN or negative scales (E4M3 bytes with the sign bit or 0x7F, E8M0 byte 255,
fp32 scales below 0 or non-finite), a negative or non-finite nvfp4 global scale, and scales of
the wrong shape. A batch with no elements (`[0, ...]`) packs, unpacks and quantises to empty
tensors.

Dtypes. Inputs are fp16, bf16, fp32 or fp64 tensors on any device with data (a meta tensor is
refused at the entry). `result_dtype(fmt, dtype)` is the dtype `round_to`, `fake_quantize` and
`dequantize` return: the input dtype for fp32 and fp64; for fp16 and bf16 the input dtype when
every value of the format is exact in it (an element format whose grid it holds: fp8_e4m3 and
fp8_e5m2 in both, fp16 in fp16, bf16 in bf16), otherwise fp32 (block formats, whose scaled
values are fp32 products; fp16 into bf16 and back; fp32 and fp64). So no result is ever
rounded a second time by a cast. `Quantized.elements` of a block format keep x's dtype (E2M1 and
E4M3 values are exact in all four).

Random draws. SR takes either `rand` (int64 draws in [0, 2^sr_bits), x's shape: 16-bit draws
at the default, uint32 words at sr_bits=32) or `seed`, from which the draws are taken as the
kernels take them
(`lowprec.philox.random_words(seed, slot, flush, state, sr_bits=, philox_rounds=)`): x is
`batch + state`, where `batch` is the shape of `slot` and `flush` broadcast together (both
default 0, so by default x is one slot's state at flush 0), and element `e` (flat index inside
its slot's state, `e < 2^24`) takes the low `sr_bits` bits of its lane of
`randint4x(seed, (slot << 44) | (flush << 24) | (e // E), philox_rounds)` (for 32 bits and 10
rounds: word `e % 4` of counter `e // 4`; `lowprec.philox` gives the lanes).
`round_to(s, "fp16", "sr", seed=seed, slot=torch.arange(n), flush=f)` of a cache's
`[n, h, d_v, d_k]` state is a flush's recurrence copy bit for bit. `sr_bits` applies to
`rand` and `seed` alike; `philox_rounds` only to `seed`; both only to SR.

Gradients. Rounding has no useful derivative, and a straight-through estimator is a modelling
choice the caller should make in the open: an input that requires grad (with grad mode on) is
refused; write `x + (fake_quantize(x.detach(), fmt) - x).detach()` for the estimator.

The module is callable: `lowprec.quantize(x, fmt, ...)` is `lowprec.quantize.quantize(x, fmt,
...)`, so the package attribute is both the function and this module (`from lowprec import
quantize as q; q.pack(...)` and `from lowprec.quantize import fake_quantize` keep working).
"""

from __future__ import annotations

import math
import operator
import sys
import types
from dataclasses import dataclass

import torch

from lowprec import formats, philox
from lowprec._checks import check_device
from lowprec.formats import E4M3, ElementFormat, Format

ROUNDINGS = ("rn", "sr")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# the dtypes the arithmetic runs in; fp16 and bf16 inputs are widened to fp32 (exactly)
COMPUTE_DTYPES = (torch.float32, torch.float64)

_UNSIGNED = {8: torch.uint8, 16: torch.uint16, 32: torch.uint32, 64: torch.uint64}
E8M0_BIAS = 127


# --------------------------------------------------------------------------------------------
# validation


def _check_input(x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16, float32 or float64, got "
                         f"{x.dtype}")
    check_device(name, x)
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name}: expected a tensor that does not require grad (rounding has no gradient), "
            f"got requires_grad=True; pass {name}.detach(), or for a straight-through "
            f"estimator {name} + (fake_quantize({name}.detach(), fmt) - {name}).detach()"
        )


def _fits(element: ElementFormat, dtype: torch.dtype) -> bool:
    """True when every value of `element` is exact in `dtype`."""
    info = torch.finfo(dtype)
    dtype_mbits = round(-math.log2(info.eps))
    return (
        element.mbits <= dtype_mbits
        and element.min_subnormal >= info.smallest_normal * info.eps
        and element.max_finite <= info.max
    )


def result_dtype(fmt: Format | str, dtype: torch.dtype) -> torch.dtype:
    """The dtype `round_to`/`fake_quantize`/`dequantize` return for inputs of `dtype` (module
    doc, "Dtypes"): `dtype` for fp32 and fp64, and for fp16/bf16 where every value of the
    format is exact in it; fp32 otherwise."""
    if isinstance(fmt, ElementFormat):
        element, block = fmt, None
    else:
        fmt = formats.get(fmt)
        element, block = fmt.element, fmt.block
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype: expected one of {list(INPUT_DTYPES)}, got {dtype!r}")
    if dtype in COMPUTE_DTYPES or (block is None and _fits(element, dtype)):
        return dtype
    return torch.float32


def _draws(sr_bits: int) -> str:
    """What `rand` holds, for messages: 'uint32 words' or '16-bit draws (sr_bits=16)'."""
    if sr_bits == 32:
        return "uint32 words"
    return f"{sr_bits}-bit draws (sr_bits={sr_bits})"


def _check_rounding(rounding: str, rand, shape, device=None,
                    sr_bits: int = philox.DEFAULT_SR_BITS) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "rn":
        if rand is not None:
            raise ValueError("rand: expected None for rounding='rn', got a tensor")
        return
    if rand is None:
        raise ValueError(
            f"rand: expected an int64 tensor of {_draws(sr_bits)} for rounding='sr' (or "
            f"seed=), got None"
        )
    if not isinstance(rand, torch.Tensor) or rand.dtype != torch.int64:
        got = rand.dtype if isinstance(rand, torch.Tensor) else type(rand).__name__
        raise ValueError(f"rand: expected dtype int64, got {got}")
    if tuple(rand.shape) != tuple(shape):
        raise ValueError(f"rand: expected shape {list(shape)}, got {list(rand.shape)}")
    check_device("rand", rand, device, "x's")
    if rand.numel() and (int(rand.min()) < 0 or int(rand.max()) >= 1 << sr_bits):
        raise ValueError(
            f"rand: expected {_draws(sr_bits)} in [0, 2^{sr_bits}), got range "
            f"[{int(rand.min())}, {int(rand.max())}]"
        )


def _sr_parameters(rounding, rand, seed, sr_bits, philox_rounds) -> tuple[int, int]:
    """(sr_bits, philox_rounds) checked: values SR supports, and left at their defaults where
    nothing reads them (RN draws nothing; `rand` is drawn already)."""
    sr_bits = philox.check_sr_bits(sr_bits)
    philox_rounds = philox.check_philox_rounds(philox_rounds)
    if rounding != "sr" and sr_bits != philox.DEFAULT_SR_BITS:
        raise ValueError(f"sr_bits: expected the default {philox.DEFAULT_SR_BITS} for "
                         f"rounding={rounding!r} (only SR draws bits), got {sr_bits}")
    if (rounding != "sr" or seed is None) and philox_rounds != philox.DEFAULT_PHILOX_ROUNDS:
        why = "only SR draws words" if rounding != "sr" else "rand is drawn already; pass seed="
        raise ValueError(f"philox_rounds: expected the default {philox.DEFAULT_PHILOX_ROUNDS} "
                         f"without seed= ({why}), got {philox_rounds}")
    return sr_bits, philox_rounds


def _seed_words(rounding, rand, seed, slot, flush, x: torch.Tensor,
                sr_bits: int = philox.DEFAULT_SR_BITS,
                philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS):
    """`rand` itself, or the draws of `seed` for x (module doc, "Random draws")."""
    if seed is None:
        if slot is not None or flush is not None:
            raise ValueError("seed: expected a seed with slot= or flush= (they place the "
                             "seed's words), got seed=None")
        return rand
    if rand is not None:
        raise ValueError("seed: expected either rand or seed for rounding='sr', got both")
    if rounding != "sr":
        raise ValueError(f"seed: expected None for rounding={rounding!r} (only SR draws "
                         f"words), got {seed!r}")
    seed = philox._check_seed(seed)
    slot = 0 if slot is None else slot
    flush = 0 if flush is None else flush
    batch = torch.broadcast_shapes(*(torch.as_tensor(v).shape if not isinstance(v, torch.Tensor)
                                     else v.shape for v in (slot, flush)))
    if tuple(x.shape[:len(batch)]) != tuple(batch) or len(batch) > x.dim():
        raise ValueError(f"slot: expected slot and flush to broadcast to x's leading dims "
                         f"(x {list(x.shape)}), got batch shape {list(batch)}")
    state = tuple(x.shape[len(batch):])
    if math.prod(state) > philox.ELEMENT_LIMIT:
        raise ValueError(f"x: expected at most 2^24 elements per slot for seed= (the words' "
                         f"element field), got a state {list(state)}; pass slot= a tensor "
                         f"over x's leading dim")
    return philox.random_words(seed, slot, flush, state, sr_bits=sr_bits,
                               philox_rounds=philox_rounds).to(x.device)


def _element_of(element) -> ElementFormat:
    """An ElementFormat from itself, an element name ('e2m1') or an element-only format
    ('fp8_e4m3', a `Format` without blocks)."""
    if isinstance(element, ElementFormat):
        return element
    if isinstance(element, str) and element in formats.ELEMENTS:
        return formats.ELEMENTS[element]
    if isinstance(element, str) and element in formats.names():
        element = formats.get(element)
    if isinstance(element, Format) and element.block is None:
        return element.element
    element_only = [n for n in formats.names() if formats.get(n).block is None]
    raise ValueError(f"element: expected an ElementFormat or one of {sorted(formats.ELEMENTS)} "
                     f"(elements) or {element_only} (element formats), got {element!r}")


# --------------------------------------------------------------------------------------------
# element rounding


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exactly 2^k as float64, for integer k in [-1074, 1023] (subnormals included)."""
    k = k.to(torch.int64)
    normal_bits = (k + 1023).clamp(min=1) << 52
    subnormal_bits = torch.ones_like(k) << (k + 1074).clamp(min=0, max=51)
    return torch.where(k >= -1022, normal_bits, subnormal_bits).view(torch.float64)


_POW2_TABLES: dict[torch.dtype, tuple[int, torch.Tensor]] = {}


def _pow2_table(dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """(k_min, table) with table[k - k_min] = 2^k for every power of two `dtype` holds."""
    if dtype not in _POW2_TABLES:
        info = torch.finfo(dtype)
        k_min = round(math.log2(info.smallest_normal)) - (round(-math.log2(info.eps)))
        k_max = round(math.log2(info.max))
        table = _pow2(torch.arange(k_min, k_max + 1)).to(dtype)
        _POW2_TABLES[dtype] = (k_min, table)
    return _POW2_TABLES[dtype]


def _is_identity(element: ElementFormat, dtype: torch.dtype) -> bool:
    """True when the element grid contains every finite value of `dtype`."""
    info = torch.finfo(dtype)
    return (
        element.mbits >= -math.log2(info.eps)
        and element.emin <= math.log2(info.smallest_normal)
        and element.max_finite >= info.max
    )


# Far below the smallest subnormal `|x| / ulp` only has to stay below 2^-33, where RN and SR
# (threshold floor(frac * 2^k) = 0 for k <= 32) both give 0; capping the subnormal shift
# there keeps the power-of-two factor normal, so the product below is exact.
_SHIFT_MARGIN = 40


def round_to(
    x: torch.Tensor,
    element: ElementFormat | Format | str,
    rounding: str = "rn",
    rand: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    slot=None,
    flush=None,
    sr_bits: int = philox.DEFAULT_SR_BITS,
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
) -> torch.Tensor:
    """Round `x` element-wise onto `element`'s grid (RN or SR, saturating); returns
    `result_dtype(element, x.dtype)` (x's dtype for fp32/fp64 input).

    element: an ElementFormat, an element name ('e2m1') or an element-only format ('fp16',
    'fp8_e4m3'). SR needs one of rand (int64 tensor of draws in [0, 2^sr_bits), shape of x)
    or seed (draws per slot and flush in `philox_rounds` rounds, module doc "Random draws").
    sr_bits: random bits per element, in `lowprec.philox.SR_BITS` (8, 13, 16, 32).

    With `x = mant * 2^ex` (frexp, 0.5 <= |mant| < 1) the binade is `ex - 1` and

        m = |x| / 2^(max(ex - 1, emin) - mbits) = |mant| * 2^(mbits + 1 - max(emin - ex + 1, 0))
    """
    _check_input(x)
    element = _element_of(element)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")
    sr_bits, philox_rounds = _sr_parameters(rounding, rand, seed, sr_bits, philox_rounds)
    rand = _seed_words(rounding, rand, seed, slot, flush, x, sr_bits, philox_rounds)
    _check_rounding(rounding, rand, x.shape, x.device, sr_bits)
    if x.dtype not in COMPUTE_DTYPES:
        rounded = _round_to(x.float(), element, rounding, rand, sr_bits)
        return rounded.to(result_dtype(element, x.dtype))
    return _round_to(x, element, rounding, rand, sr_bits)


def _round_to(x, element: ElementFormat, rounding: str, rand,
              sr_bits: int = philox.DEFAULT_SR_BITS) -> torch.Tensor:
    """`round_to` of a checked fp32/fp64 `x`."""
    if _is_identity(element, x.dtype):
        # Only inf moves. The fp64 format's saturation value overflows fp32, so fp32 input
        # keeps its infinities there (the saturated value, cast back to x's dtype).
        fits = element.max_finite <= torch.finfo(x.dtype).max
        limit = element.max_finite if fits else math.inf
        return torch.where(x.isinf(), torch.copysign(torch.full_like(x, limit), x), x)

    k_min, pow2 = _pow2_table(x.dtype)
    mant, ex = torch.frexp(x)  # inf and NaN come back as mantissa inf / NaN, exponent 0
    shift_cap = element.mbits + _SHIFT_MARGIN
    subnormal_shift = (element.emin + 1 - ex).clamp_(min=0, max=shift_cap)
    m = mant.abs_() * pow2[element.mbits + 1 - k_min - subnormal_shift]
    if rounding == "rn":
        steps = torch.round(m)  # ties to even
    else:
        steps = torch.floor(m)
        threshold = torch.floor((m - steps) * float(1 << sr_bits))  # top sr_bits of frac
        threshold = torch.where(threshold.isfinite(), threshold, 0.0).to(torch.int64)
        steps += rand < threshold
    ulp = pow2[ex.clamp_(min=element.emin + 1) - (element.mbits + 1 + k_min)]
    # steps * ulp overflows to inf only past max_finite; inf and NaN inputs reach here as
    # steps = inf / NaN, so the clamp saturates inf and keeps NaN.
    q = steps.mul_(ulp).clamp_(max=element.max_finite)
    return torch.copysign(q, x)


# --------------------------------------------------------------------------------------------
# bits of one element


def _field_layout(element: ElementFormat):
    exp_mask = (1 << element.ebits) - 1
    man_mask = (1 << element.mbits) - 1
    sign_shift = element.ebits + element.mbits
    if element.has_inf:
        nan_code = (exp_mask << element.mbits) | (1 << (element.mbits - 1))
    else:
        max_significand = int(math.ldexp(element.max_finite, element.mbits - element.emax))
        max_code = ((element.emax + element.bias) << element.mbits) | (max_significand & man_mask)
        all_ones = (1 << sign_shift) - 1
        nan_code = all_ones if max_code < all_ones else None
    return exp_mask, man_mask, sign_shift, nan_code


def encode_bits(values: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """Bit codes (int64) of values that lie on `element`'s grid.

    NaN encodes as the format's canonical NaN (ValueError for E2M1, which has none); inf
    only where the format has one. For 64-bit elements the int64 holds the bit pattern
    (negative when the sign bit is set). Values off the grid raise ValueError.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise ValueError(f"values: expected a floating-point tensor, got {values!r:.60}")
    if element.bits == 64:
        return values.to(torch.float64).view(torch.int64).clone()
    exp_mask, man_mask, sign_shift, nan_code = _field_layout(element)
    v = values.to(torch.float64)
    a = v.abs()
    nan = a.isnan()
    inf = a.isinf()
    if nan.any() and nan_code is None:
        raise ValueError(f"values: {element.name} has no NaN encoding, got NaN (a non-finite "
                         f"input, inf or NaN, quantises to NaN in a block format)")
    if inf.any() and not element.has_inf:
        raise ValueError(f"values: {element.name} has no infinity, got inf")
    a_fin = torch.where(nan | inf, 0.0, a)
    binade = (torch.frexp(a_fin).exponent.to(torch.int64) - 1).clamp(min=element.emin)
    significand = a_fin / _pow2(binade - element.mbits)
    on_grid = (significand == torch.floor(significand)) & (a_fin <= element.max_finite)
    if not bool(on_grid.all()):
        bad = values[~on_grid].flatten()[0].item()
        raise ValueError(f"values: expected values on the {element.name} grid, got {bad!r}")
    significand = significand.to(torch.int64)
    normal = significand >> element.mbits > 0
    exp_field = torch.where(normal, binade + element.bias, 0)
    codes = (exp_field << element.mbits) | (significand & man_mask)
    if element.has_inf:
        codes = torch.where(inf, exp_mask << element.mbits, codes)
    if nan_code is not None:
        codes = torch.where(nan, nan_code, codes)
    sign = torch.signbit(v).to(torch.int64) & ~nan
    return codes | (sign << sign_shift)


def decode_bits(
    codes: torch.Tensor, element: ElementFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Values of bit codes (any integer dtype) in `element`, as `dtype` (exact)."""
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point():
        raise ValueError(f"codes: expected an integer tensor, got {codes!r:.60}")
    if element.bits == 64:
        return codes.view(torch.int64).view(torch.float64).to(dtype)
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << element.bits):
        raise ValueError(
            f"codes: expected values in [0, 2^{element.bits}) for {element.name}, got range "
            f"[{int(c.min())}, {int(c.max())}]"
        )
    exp_mask, man_mask, sign_shift, nan_code = _field_layout(element)
    exp_field = (c >> element.mbits) & exp_mask
    man_field = c & man_mask
    normal = exp_field > 0
    significand = torch.where(normal, man_field | (1 << element.mbits), man_field)
    binade = torch.where(normal, exp_field - element.bias, element.emin)
    value = significand.to(torch.float64) * _pow2(binade - element.mbits)
    magnitude_code = c & ((1 << sign_shift) - 1)
    if element.has_inf:
        special = exp_field == exp_mask
        value = torch.where(special & (man_field == 0), math.inf, value)
        value = torch.where(special & (man_field != 0), math.nan, value)
    elif nan_code is not None:
        value = torch.where(magnitude_code == nan_code, math.nan, value)
    value = torch.where((c >> sign_shift) > 0, -value, value)
    return value.to(dtype)


# --------------------------------------------------------------------------------------------
# block formats


@dataclass
class Quantized:
    """A tensor in a format: element values, block scales, second-level scale (see module doc)."""

    fmt: Format
    elements: torch.Tensor
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None


def _block_scales(amax_b: torch.Tensor, fmt: Format):
    """(block scale values s_b, second-level scale s_g or None, divisor per block), all fp32."""
    element = fmt.element
    if fmt.scale == "e4m3":
        global_scale = amax_b.amax(dim=(-2, -1))
        global_scale = global_scale / (E4M3.max_finite * element.max_finite)  # / 2688 for nvfp4
        den = (element.max_finite * global_scale)[..., None, None]
        ratio = torch.where(amax_b == 0, 0.0, amax_b / den)
        s_b = round_to(ratio, E4M3)
        return s_b, global_scale, s_b * global_scale[..., None, None]
    if fmt.scale == "e8m0":
        binade = torch.frexp(amax_b).exponent.to(torch.int64) - 1
        exponent = (binade - element.emax).clamp(-E8M0_BIAS, E8M0_BIAS)
        exponent = torch.where(amax_b == 0, -E8M0_BIAS, exponent)
        s_b = _pow2(exponent).to(torch.float32)
        return s_b, None, s_b
    s = amax_b / element.max_finite  # 'fp32': ideal scale, unrounded
    return s, None, s


def _to_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, RN with finite values past FLT_MAX saturating (as `round_to(x, FP32)`; a
    plain cast makes them inf, and one inf turns an nvfp4 state into NaN); +-inf stays inf."""
    if x.dtype != torch.float64:  # fp32 itself; fp16 and bf16 widen exactly
        return x.float()
    flt_max = torch.finfo(torch.float32).max
    return torch.where(x.isinf(), x, x.clamp(-flt_max, flt_max)).to(torch.float32)


def quantize(
    x: torch.Tensor,
    fmt: Format | str,
    rounding: str = "rn",
    rand: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    slot=None,
    flush=None,
    sr_bits: int = philox.DEFAULT_SR_BITS,
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
) -> Quantized:
    """Quantise a state-shaped `x` ([..., d_v, d_k]) to `fmt`; RN or SR on elements only (SR
    draws of `sr_bits` bits from `rand` or `seed`, as in `round_to`)."""
    fmt = formats.get(fmt)
    _check_input(x)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")
    sr_bits, philox_rounds = _sr_parameters(rounding, rand, seed, sr_bits, philox_rounds)
    rand = _seed_words(rounding, rand, seed, slot, flush, x, sr_bits, philox_rounds)
    _check_rounding(rounding, rand, x.shape, x.device, sr_bits)
    if fmt.block is None:
        return Quantized(fmt, round_to(x, fmt.element, rounding, rand, sr_bits=sr_bits))

    block = fmt.block_length(x.shape)
    if fmt.two_level and x.shape[-2] == 0:  # no rows: no amax to take s_g from
        raise ValueError(f"x: expected d_v >= 1 for {fmt.name!r} (its per-state scale), got "
                         f"shape {list(x.shape)}")
    blocked_shape = (*x.shape[:-1], x.shape[-1] // block, block)
    xb = _to_fp32(x).reshape(blocked_shape)  # [..., d_v, n_blocks, block]
    amax_b = xb.abs().amax(dim=-1)  # [..., d_v, n_blocks]
    s_b, global_scale, divisor = _block_scales(amax_b, fmt)
    if rand is not None:
        rand = rand.reshape(blocked_shape)
    codes = _round_to(xb / divisor[..., None], fmt.element, rounding, rand, sr_bits)
    zero_block = ((amax_b == 0) | (divisor == 0))[..., None]
    codes = torch.where(zero_block, 0.0, codes)
    # E2M1 and E4M3 codes are exact in every input dtype
    return Quantized(fmt, codes.reshape(x.shape).to(x.dtype), s_b, global_scale)


def _check_quantized(q, name: str = "q") -> None:
    """`q` is a Quantized whose fields have the shapes and dtypes its format gives them."""
    if not isinstance(q, Quantized):
        raise ValueError(f"{name}: expected a Quantized, got {type(q).__name__}")
    fmt = formats.get(q.fmt)
    elements = q.elements
    if not isinstance(elements, torch.Tensor) or elements.dtype not in INPUT_DTYPES:
        got = elements.dtype if isinstance(elements, torch.Tensor) else type(elements).__name__
        raise ValueError(f"{name}.elements: expected a float16/bfloat16/float32/float64 "
                         f"tensor, got {got}")
    check_device(f"{name}.elements", elements)
    shape = tuple(elements.shape)
    if fmt.block is None:
        for field in ("scales", "global_scale"):
            if getattr(q, field) is not None:
                raise ValueError(f"{name}.{field}: expected None for format {fmt.name!r} "
                                 f"(no scales), got a tensor")
        return
    n_blocks = shape[-1] // fmt.block_length(shape) if len(shape) else 0
    expected = {"scales": (*shape[:-1], n_blocks),
                "global_scale": shape[:-2] if fmt.two_level else None}
    for field, want in expected.items():
        t = getattr(q, field)
        if want is None:
            if t is not None:
                raise ValueError(f"{name}.{field}: expected None for format {fmt.name!r}, "
                                 f"got a tensor")
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}.{field}: expected a float32 tensor, got {got}")
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{name}.{field}: expected shape {list(want)} (elements "
                             f"{list(shape)} in {fmt.name!r}), got {list(t.shape)}")
        check_device(f"{name}.{field}", t, elements.device, "the elements'")


def _check_scale_values(name: str, scales: torch.Tensor, why: str) -> None:
    """Scales are finite and >= 0: a NaN or negative one would decode without a word."""
    if not scales.numel():
        return
    bad = ~scales.isfinite() | (scales < 0)
    if bool(bad.any()):
        raise ValueError(f"{name}: expected finite scales >= 0, got "
                         f"{scales[bad].flatten()[0].item()!r} ({int(bad.sum())} such values; "
                         f"{why})")


_NONFINITE = "the quantised tensor held inf or NaN, which a block format cannot store"
_CORRUPT = "storage that pack never writes"


def dequantize(q: Quantized) -> torch.Tensor:
    """Values of `q` as `result_dtype(q.fmt, q.elements.dtype)` (x's dtype for fp32/fp64):
    `(code * s_b) * s_g` in fp32. Scales of the wrong shape are refused (ValueError naming the
    field, the expected and the actual shape)."""
    _check_quantized(q)
    if q.scales is None:
        return q.elements.clone()
    shape = q.elements.shape
    n_blocks = q.scales.shape[-1]
    codes = q.elements.to(torch.float32).reshape(*shape[:-1], n_blocks, shape[-1] // n_blocks)
    values = codes * q.scales[..., None]
    if q.global_scale is not None:
        values = values * q.global_scale[..., None, None, None]
    return values.reshape(shape).to(result_dtype(q.fmt, q.elements.dtype))


def fake_quantize(
    x: torch.Tensor,
    fmt: Format | str,
    rounding: str = "rn",
    rand: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    slot=None,
    flush=None,
    sr_bits: int = philox.DEFAULT_SR_BITS,
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
) -> torch.Tensor:
    """`dequantize(quantize(x, fmt, ...))`: x's values after a store in `fmt`, as
    `result_dtype(fmt, x.dtype)`."""
    return dequantize(quantize(x, fmt, rounding, rand, seed=seed, slot=slot, flush=flush,
                               sr_bits=sr_bits, philox_rounds=philox_rounds))


# --------------------------------------------------------------------------------------------
# packed storage


def _pack_codes(elements: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    if element.bits == 64:
        return elements.to(torch.float64).view(torch.uint64).clone()
    codes = encode_bits(elements, element)
    if element.bits == 4:
        if elements.shape[-1] % 2:
            raise ValueError(
                f"elements: expected an even last dim for 4-bit codes, got {elements.shape[-1]}"
            )
        pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
        codes = pairs[..., 0] | (pairs[..., 1] << 4)  # low nibble = even index
        return codes.to(torch.uint8)
    return codes.to(_UNSIGNED[element.bits])


def _unpack_codes(codes: torch.Tensor, element: ElementFormat, dtype) -> torch.Tensor:
    if element.bits == 4:
        c = codes.to(torch.int64)
        codes = torch.stack((c & 0xF, c >> 4), dim=-1).flatten(-2)
    return decode_bits(codes, element, dtype)


def pack(q: Quantized) -> dict[str, torch.Tensor]:
    """Storage tensors of `q` (layout in the module doc)."""
    _check_quantized(q)
    fmt = formats.get(q.fmt)
    for field in ("scales", "global_scale"):  # before the codes: they say why codes are NaN
        if getattr(q, field) is not None:
            _check_scale_values(f"q.{field}", getattr(q, field), _NONFINITE)
    packed = {"codes": _pack_codes(q.elements, fmt.element)}
    if fmt.scale == "e4m3":
        packed["scales"] = encode_bits(q.scales, E4M3).to(torch.uint8)
    elif fmt.scale == "e8m0":
        exponent = torch.frexp(q.scales).exponent.to(torch.int64) - 1
        packed["scales"] = (exponent + E8M0_BIAS).to(torch.uint8)
    elif fmt.scale == "fp32":
        packed["scales"] = q.scales.to(torch.float32).clone()
    if fmt.two_level:
        packed["global_scale"] = q.global_scale.to(torch.float32).clone()
    return packed


def _expect(packed: dict, key: str, dtype: torch.dtype, shape) -> torch.Tensor:
    if key not in packed:
        raise ValueError(f"packed: expected key {key!r}, got keys {sorted(packed)}")
    t = packed[key]
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"packed[{key!r}]: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}"
        )
    return t


def unpack(packed: dict, fmt: Format | str, shape, dtype: torch.dtype = torch.float32) -> Quantized:
    """Inverse of `pack` for a tensor of `shape`; elements come back as `dtype`."""
    fmt = formats.get(fmt)
    if not isinstance(packed, dict):
        raise ValueError(f"packed: expected a dict of tensors, got {type(packed).__name__}")
    try:
        shape = tuple(operator.index(n) for n in shape)
    except TypeError:
        raise ValueError(f"shape: expected a sequence of ints, got {shape!r}") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"shape: expected dims >= 0, got {list(shape)}")
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype: expected one of {list(INPUT_DTYPES)}, got {dtype!r}")
    if dtype not in COMPUTE_DTYPES and fmt.block is None and not _fits(fmt.element, dtype):
        raise ValueError(f"dtype: expected a dtype that holds every {fmt.name} value exactly, "
                         f"got {dtype}")
    if fmt.block is not None:
        fmt.block_length(shape)  # the shape's last dim against the block, named
    for key, t in packed.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"packed[{key!r}]: expected a tensor, got {type(t).__name__}")
        check_device(f"packed[{key!r}]", t)
    element = fmt.element
    code_shape = (*shape[:-1], shape[-1] // 2) if element.bits == 4 else shape
    code_dtype = torch.uint8 if element.bits == 4 else _UNSIGNED[element.bits]
    expected_keys = {"codes"} | ({"scales"} if fmt.scale else set())
    expected_keys |= {"global_scale"} if fmt.two_level else set()
    if set(packed) != expected_keys:
        raise ValueError(f"packed: expected keys {sorted(expected_keys)}, got {sorted(packed)}")
    codes = _expect(packed, "codes", code_dtype, code_shape)
    elements = _unpack_codes(codes, element, dtype)
    if fmt.scale is None:
        return Quantized(fmt, elements)
    finite = elements.isfinite()
    if not bool(finite.all()):  # a NaN code (E4M3's 0x7F) under a scale
        raise ValueError(f"packed['codes']: expected finite {element.name} codes in a block "
                         f"format ({_CORRUPT}), got {int((~finite).sum())} NaN or inf codes")

    scale_shape = (*shape[:-1], shape[-1] // fmt.block_length(shape))
    scale_dtype = torch.float32 if fmt.scale == "fp32" else torch.uint8
    scale_codes = _expect(packed, "scales", scale_dtype, scale_shape)
    if fmt.scale == "e4m3":
        bad = scale_codes >= 0x7F  # 0x7F and 0xFF are NaN; a set sign bit is a negative scale
        if bool(bad.any()):
            raise ValueError(
                f"packed['scales']: expected E4M3 bytes in [0x00, 0x7E] (a block scale is "
                f"finite and >= 0; 0x7F/0xFF are NaN), got 0x{int(scale_codes[bad][0]):02X} "
                f"({int(bad.sum())} such bytes)"
            )
        scales = decode_bits(scale_codes, E4M3)
    elif fmt.scale == "e8m0":
        if scale_codes.numel() and int(scale_codes.max()) > 2 * E8M0_BIAS:
            raise ValueError(
                f"packed['scales']: expected E8M0 bytes in [0, 254] (255 is NaN), got "
                f"{int(scale_codes.max())}"
            )
        scales = _pow2(scale_codes.to(torch.int64) - E8M0_BIAS).to(torch.float32)
    else:
        _check_scale_values("packed['scales']", scale_codes, _CORRUPT)
        scales = scale_codes.clone()
    global_scale = None
    if fmt.two_level:
        global_scale = _expect(packed, "global_scale", torch.float32, shape[:-2]).clone()
        _check_scale_values("packed['global_scale']", global_scale, _CORRUPT)
    return Quantized(fmt, elements, scales, global_scale)


class _CallableModule(types.ModuleType):
    """This module, callable as its `quantize` function (module doc): `lowprec.quantize` is
    the submodule the import system binds, and calling it quantises."""

    def __call__(self, x, fmt, rounding="rn", rand=None, *, seed=None, slot=None, flush=None,
                 sr_bits=philox.DEFAULT_SR_BITS, philox_rounds=philox.DEFAULT_PHILOX_ROUNDS):
        return quantize(x, fmt, rounding, rand, seed=seed, slot=slot, flush=flush,
                        sr_bits=sr_bits, philox_rounds=philox_rounds)


sys.modules[__name__].__class__ = _CallableModule


__all__ = [
    "Quantized",
    "decode_bits",
    "dequantize",
    "encode_bits",
    "fake_quantize",
    "pack",
    "quantize",
    "result_dtype",
    "round_to",
    "unpack",
]
