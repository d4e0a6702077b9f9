"""Device numerics shared by the CuTe DSL kernels: bit for bit the contract of lowprec/README.md.

Hopper (sm_90) has no stochastic-rounding conversion and no FP4 conversion instruction, so those
roundings are integer arithmetic on the fp32 bits; nothing depends on an instruction that a
later architecture might add. E4M3 <-> fp32/f16 and fp32 -> f16 RN use the hardware
conversions Hopper has (sm_89 and later), checked against the integer forms on the device.
Each function is a plain Python function of DSL scalars, traced into the calling kernel (no
call overhead), and states its equivalence to `lowprec`:

    philox_keys, philox_word,   lowprec.philox.randint / randint4x (= Triton tl.randint,
      philox_words              tl.randint4x): Philox-4x32 in R rounds (the keys' count; 10
                                by default), key (seed lo, seed hi), counter (offset lo, offset
                                hi, 0, 0); the first word, or all four
    state_counter               the counter words of offset = (slot<<44)|(flush<<24)|counter,
                                counter = element // E (E = 4 elements a counter for 32-bit
                                draws: element e takes word e % 4; 8 for 16 and 13; 16 for 8)
    sr_draw, sr_addend          element e's k-bit draw r_k, the low k bits of its lane of a
                                word (lowprec.philox.random_words, sr_bits=k), and what the
                                one-add form adds for it (docs/design.md)
    sr_fp16_bits                encode_bits(round_to(x, FP16, 'sr', r, sr_bits=k), FP16)
    sr_fp16_bits_fast           the same by one add where |x| >= 2^-14, with a flag elsewhere
    sr_fp16x2_fast,             two of them by two adds and one cvt.rz.satfinite.f16x2.f32
      sr_fp16x2_lanes           where 2^-14 <= |x| < 2^127 (the kernels' fast path), 32-bit
                                words or k-bit lanes
    piece_words, group_words,   a thread's 8 or 16 consecutive elements: the words of their
      shared_words,             Philox counters (one call a counter: W / E, at least one),
      sr_fp16_piece             drawn a group of 8 at a time, and SR
    rn_fp16_bits, rn_e4m3_byte, encode_bits(round_to(x, fmt, 'rn'), fmt): ties to even,
      rn_e2m1_nibble            saturating (plain hardware cvt.rn.f16 gives inf from 65520 on)
    rn_fp16x2                   two rn_fp16_bits with cvt.rn.satfinite.f16x2.f32 (fast path)
    e4m3_value                  decode_bits(byte, E4M3) for a block scale: exact
    div_rn                      one correctly rounded fp32 division (PTX div.rn.f32)
    e2m1_pair_fast              two rn_e2m1_nibble(div_rn(x, d)), nibbles e and e + 4 of a
                                word, from x * RN(1/d) by one fp16 conversion and one packed
                                min when provably equal, else a flag asking for the division
                                (the flush's fast path)
    saturate_f32                lowprec's fp32 "rounding" of fp32: identity, +-inf -> +-FLT_MAX

Why integers are exact. For an fp32 input with significand `F` (the hidden bit included; 23
bits for fp32 subnormals) and biased exponent `E` (`Eeff = max(E, 1)`), lowprec's
`m = |x| / ulp` is `F / 2^shift` with

    shift = (23 - mbits) + max(0, emin + 127 - Eeff)

so `floor(m) = F >> shift`, `floor(frac * 2^32)` is the `shift` discarded bits of `F`
left-aligned in 32 bits, and RN's remainder and half-way point are those bits and `2^(shift-1)`.
The code of `(floor(m) + up) * ulp` is `(max(Eeff - 127 - emin, 0) << mbits) + floor(m) + up`: a
carry out of the significand moves into the exponent field by itself, and below the smallest
normal the exponent field is 0 (subnormal codes). Saturation is a `min` with the largest
finite code; NaN becomes the canonical NaN without a sign (as `encode_bits` does); `-0` keeps
its sign; `+-inf` saturate like any value past the largest finite one.

Shifts: LLVM makes a shift by >= 32 poison, so every data-dependent shift amount is clamped to
[0, 31] (the clamped cases are those where the clamped result is already right).

Two backends. The same functions accept numpy uint32/float32 arrays: the CPU tests run the
identical integer code on arrays and compare it with `lowprec` exhaustively, and the GPU tests
check that the compiled kernels agree with it.
"""

from __future__ import annotations

import cutlass  # noqa: I001
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Uint32
from cutlass.cutlass_dsl import T

from cute_kernels import _compile  # noqa: F401  (sets the sm_90a target before cutlass)
from cute_kernels.ptx import inline_ptx

# SR's settings are lowprec's (docs/design.md, "Stochastic rounding: random bits and Philox
# rounds"): SR_BITS, the default (16, 7) and the generator's own 10 rounds
from lowprec.philox import (
    DEFAULT_PHILOX_ROUNDS,
    DEFAULT_SR_BITS,
    REFERENCE_PHILOX_ROUNDS,
    SR_BITS,
)

__all__ = [
    "SR_BITS",
    "DEFAULT_SR_BITS",
    "DEFAULT_PHILOX_ROUNDS",
    "FP16",
    "E4M3",
    "E2M1",
    "philox_keys",
    "philox_word",
    "philox_words",
    "state_counter",
    "lane_bits",
    "counter_shift",
    "sr_draw",
    "sr_addend",
    "f32_bits",
    "bits_f32",
    "sr_fp16_bits",
    "sr_fp16_bits_fast",
    "sr_fp16x2_fast",
    "sr_fp16x2_lanes",
    "sr_fp16_chunk",
    "shared_words",
    "group_words",
    "piece_words",
    "sr_fp16_piece",
    "rn_code",
    "rn_fp16_bits",
    "rn_fp16x2",
    "rn_e4m3_byte",
    "rn_e2m1_nibble",
    "e4m3_value",
    "div_rn",
    "recip_usable",
    "e2m1_pair_fast",
    "e2m1_margin",
    "recip14_usable",
    "E2M1_PAIR_SCALE",
    "E2M1_PAIR_MARGIN",
    "E2M1_MARGIN_SHIFT",
    "saturate_f32",
    "softplus",
    "silu",
]

ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
MASK32 = 0xFFFFFFFF
SLOT_SHIFT = 44
FLUSH_SHIFT = 24

# Element formats as data: (mbits, bias, largest finite code, NaN code, sign bit position).
FP16 = (10, 15, 0x7BFF, 0x7E00, 15)  # 65504; NaN 0x7E00
E4M3 = (3, 7, 0x7E, 0x7F, 7)  # OCP E4M3FN: 448; S.1111.111 is NaN
E2M1 = (1, 1, 0x7, 0x7, 3)  # 6; no NaN: a NaN input (outside the contract) saturates


# --------------------------------------------------------------------------------------------
# the two backends: DSL scalars in kernels, numpy arrays in CPU tests


def _is_np(v) -> bool:
    return isinstance(v, (np.ndarray, np.generic))


def _u(value, like):
    """The uint32 constant `value` in `like`'s backend."""
    return np.uint32(value) if _is_np(like) else Uint32(value)


def _sel(cond, a, b):
    """`a if cond else b`, element-wise; a and b of one type (uint32 or fp32)."""
    if _is_np(cond) or _is_np(a) or _is_np(b):
        return np.where(cond, a, b).astype(np.asarray(a).dtype)
    return type(a)(cutlass.select_(cond, a, b))


def _umin(a, b):
    return _sel(a < b, a, b)


def _umax(a, b):
    return _sel(a > b, a, b)


def _mul_hi(a, constant: int):
    if _is_np(a):
        return ((a.astype(np.uint64) * np.uint64(constant)) >> np.uint64(32)).astype(np.uint32)
    return cute.arch.mul_hi(Uint32(a), Uint32(constant))


def _mul_lo(a, constant: int):
    if _is_np(a):
        return ((a.astype(np.uint64) * np.uint64(constant)) & np.uint64(MASK32)).astype(np.uint32)
    return Uint32(a) * Uint32(constant)


def f32_bits(x):
    """The 32 bits of an fp32 value (a register move, no instruction)."""
    if _is_np(x):
        return np.asarray(x, dtype=np.float32).view(np.uint32)
    return Float32(x).bitcast(Uint32)


def bits_f32(u):
    """The fp32 value of 32 bits."""
    if _is_np(u):
        return np.asarray(u, dtype=np.uint32).view(np.float32)
    return Uint32(u).bitcast(Float32)


# --------------------------------------------------------------------------------------------
# Philox-4x32


def philox_keys(seed_lo, seed_hi, rounds: int = REFERENCE_PHILOX_ROUNDS) -> list:
    """The `rounds` round keys `(k0, k1)` of a seed (their count is the rounds philox_words
    applies): compute once per thread outside element loops (they are uniform across the grid,
    so they cost registers, not instructions)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= 10:
        raise ValueError(f"rounds: expected an int in [1, 10], got {rounds!r}")
    k0, k1 = seed_lo, seed_hi
    keys = []
    for _ in range(rounds):
        keys.append((k0, k1))
        if _is_np(k0):
            k0 = np.uint32((int(k0) + KEY_A) & MASK32)
            k1 = np.uint32((int(k1) + KEY_B) & MASK32)
        else:
            k0 = Uint32(k0) + Uint32(KEY_A)
            k1 = Uint32(k1) + Uint32(KEY_B)
    return keys


def philox_word(c0, c1, keys):
    """First word of Philox-4x32 of the counter `(c0, c1, 0, 0)` under `keys`: equal to
    `lowprec.philox.randint(seed, offset, R)` and Triton's `tl.randint(seed, offset, R)` for
    `offset = c1 << 32 | c0` and `keys = philox_keys(seed & 0xffffffff, seed >> 32, R)`. (The
    kernels take all four words, philox_words; this is the one-word form the tests use.)"""
    return philox_words(c0, c1, keys)[0]


def philox_words(c0, c1, keys):
    """The four words of Philox-4x32 of the counter `(c0, c1, 0, 0)` under `keys`, in
    `len(keys)` rounds: `lowprec.philox.randint4x(seed, offset, len(keys))` and Triton's
    `tl.randint4x`. Round 1 is specialised for `c2 = c3 = 0`: 2R - 1 wide multiplies for four
    words (19 at R = 10)."""
    k0, k1 = keys[0]
    c0, c1, c2, c3 = c1 ^ k0, _u(0, c0), _mul_hi(c0, ROUND_A) ^ k1, _mul_lo(c0, ROUND_A)
    for r in range(1, len(keys)):
        k0, k1 = keys[r]
        c0, c1, c2, c3 = (
            _mul_hi(c2, ROUND_B) ^ c1 ^ k0,
            _mul_lo(c2, ROUND_B),
            _mul_hi(c0, ROUND_A) ^ c3 ^ k1,
            _mul_lo(c0, ROUND_A),
        )
    return c0, c1, c2, c3


def state_counter(slot, flush, counter):
    """Counter words `(lo, hi)` of `offset = (slot << 44) | (flush << 24) | counter`
    (lowprec.philox.state_offsets: counter = element // E, `counter_shift`), for slot, flush < 2^20
    and counter < 2^22."""
    lo = ((flush & _u(0xFF, flush)) << _u(FLUSH_SHIFT, flush)) | counter
    hi = (slot << _u(SLOT_SHIFT - 32, slot)) | (flush >> _u(32 - FLUSH_SHIFT, flush))
    return lo, hi


def lane_bits(sr_bits: int) -> int:
    """W, the lane of a word whose low `sr_bits` bits are an element's draw: 8, 16 or 32."""
    if sr_bits not in SR_BITS:
        raise ValueError(f"sr_bits: expected one of {list(SR_BITS)}, got {sr_bits!r}")
    return 8 if sr_bits == 8 else 16 if sr_bits < 32 else 32


def counter_shift(sr_bits: int) -> int:
    """log2 of E, the consecutive elements one counter's four words serve (4, 8, 8, 16 for
    32, 16, 13, 8 bits): element e's counter is e >> counter_shift."""
    return {32: 2, 16: 3, 8: 4}[lane_bits(sr_bits)]


def sr_draw(word, lane: int, sr_bits: int):
    """r_k of the element that takes lane `lane` of `word`: the low k = `sr_bits` bits of its
    W = lane_bits(k) bits (lowprec.philox.random_words)."""
    if sr_bits == 32:
        return word
    shift = lane * lane_bits(sr_bits)
    lane_word = word >> _u(shift, word) if shift else word
    return lane_word & _u((1 << sr_bits) - 1, word)


def sr_addend(word, lane: int, sr_bits: int):
    """What SR of FP16 from FP32 adds to the fp32 bits of x (2^-14 <= |x| < 2^127, where the
    low d = 13 bits are dropped) for the draw r_k in lane `lane` of `word`: c_k = ~r_k &
    (2^k - 1) aligned to the dropped field, c_k >> (k - 13) for k >= 13, c_k << 5 for k = 8;
    the sum carries into bit 13 exactly when r_k < floor(frac 2^k) (docs/design.md: `~w >> 19`,
    `(~L & 0xFFFF) >> 3`, `~L & 0x1FFF`, `(~L & 0xFF) << 5`). A shift and a mask (one LOP3
    with the complement) an element."""
    if sr_bits == 32:  # 0x1FFF - (r >> 19) = ~r >> 19: the form the 32-bit kernels compile
        return _u(0x1FFF, word) - (word >> _u(19, word))
    inverted = ~word
    shift = lane * lane_bits(sr_bits) + sr_bits - 13  # the lane's top 13 bits (k >= 13)
    if sr_bits == 8:  # its 8 bits at bits 5..12 of the dropped field
        shift = lane * 8 - 5
        if shift < 0:
            return (inverted << _u(-shift, word)) & _u(0xFF << 5, word)
        return (inverted >> _u(shift, word)) & _u(0xFF << 5, word)
    moved = inverted >> _u(shift, word) if shift else inverted
    return moved & _u(0x1FFF, word)


# --------------------------------------------------------------------------------------------
# rounding fp32 values onto narrower grids


def _decompose(x):
    """(sign bit, |x| bits, significand F with its hidden bit, Eeff = max(E, 1)) of fp32 x."""
    u = f32_bits(x)
    sign = u >> _u(31, u)
    a = u & _u(0x7FFFFFFF, u)
    e = a >> _u(23, u)
    man = a & _u(0x7FFFFF, u)
    significand = _sel(e == _u(0, u), man, man | _u(0x800000, u))
    return sign, a, significand, _umax(e, _u(1, u))


def _shift(e_eff, mbits: int, bias: int):
    """(23 - mbits) + max(0, emin + 127 - Eeff): bits of F below the target grid."""
    emin_biased = _u(128 - bias, e_eff)  # Eeff of the target's smallest normal
    extra = _sel(e_eff < emin_biased, emin_biased - e_eff, _u(0, e_eff))
    return _u(23 - mbits, e_eff) + extra


def _exponent_field(e_eff, mbits: int, bias: int):
    """max(Eeff - 127 - emin, 0) << mbits: what floor(m) + up is added to for the code."""
    emin_biased = _u(128 - bias, e_eff)
    over = _sel(e_eff > emin_biased, e_eff - emin_biased, _u(0, e_eff))
    return over << _u(mbits, e_eff)


def _finish(sign, a, magnitude, fmt):
    _, _, max_code, nan_code, sign_bit = fmt
    code = _umin(magnitude, _u(max_code, a)) | (sign << _u(sign_bit, a))
    return _sel(a > _u(0x7F800000, a), _u(nan_code, a), code)


def sr_fp16_bits(x, r, sr_bits: int):
    """fp16 bits (in the low 16 bits) of SR(x) with the draw r in [0, 2^sr_bits) (a whole
    random word for 32 bits).

    lowprec: up = r < floor(frac * 2^k) (unsigned, k = sr_bits), subnormals included,
    saturating at 65504, NaN -> 0x7E00, -0 -> 0x8000; zero never rounds up.
    """
    mbits, bias = FP16[0], FP16[1]
    sign, a, significand, e_eff = _decompose(x)
    shift = _shift(e_eff, mbits, bias)  # 13 .. 138
    floor_m = significand >> _umin(shift, _u(31, a))
    # floor(frac * 2^32): the discarded bits left-aligned (shift <= 32), or shifted further
    # right (shift > 32; 0 from shift = 56 on since F < 2^24)
    left = significand << (_u(32, a) - _umin(shift, _u(32, a)))
    right = significand >> _umin(_umax(shift, _u(32, a)) - _u(32, a), _u(31, a))
    threshold = _sel(shift <= _u(32, a), left, right)
    if sr_bits != 32:  # floor(frac * 2^k): the top k bits of floor(frac * 2^32)
        threshold = threshold >> _u(32 - sr_bits, a)
    up = _sel(r < threshold, _u(1, a), _u(0, a))
    return _finish(sign, a, _exponent_field(e_eff, mbits, bias) + floor_m + up, FP16)


def sr_fp16_bits_fast(x, r):
    """(bits, exact): fp16 bits of SR(x) with the 32-bit word r by one add, and whether they
    are sr_fp16_bits(x, r, 32): true for |x| >= 2^-14 (fp16's normal range and above, inf included),
    false for smaller |x| (fp16 subnormals and zero, where more than 13 bits are dropped) and NaN.

    Why: for |x| >= 2^-14 SR drops the low 13 bits of the fp32 significand, and lowprec's
    `r < floor(frac * 2^32) = low13 << 19` is `(r >> 19) < low13`, i.e. exactly when
    `low13 + (~r >> 19)` carries out of 13 bits. So `(|x| bits + (~r >> 19)) >> 13` is fp32's
    exponent and top 10 significand bits after rounding (a carry moves into the exponent), and
    subtracting 112 << 10 rebiases them to fp16; a min with 0x7BFF saturates as lowprec does.
    Eight integer operations against sr_fp16_bits' general shift arithmetic.
    """
    u = f32_bits(x)
    a = u & _u(0x7FFFFFFF, u)
    rounded = (a + ((~r & _u(MASK32, u)) >> _u(19, u))) >> _u(13, u)
    code = _umin(rounded - _u(112 << 10, u), _u(FP16[2], u))
    exact = (a >= _u(113 << 23, u)) & (a <= _u(0x7F800000, u))
    return code | ((u >> _u(16, u)) & _u(0x8000, u)), exact


def sr_fp16x2_fast(a, b, ra, rb):
    """(bits, exact): sr_fp16_bits(a, ra, 32) in the low half and sr_fp16_bits(b, rb, 32) in
    the high half of one word, and whether both are: true where 2^-14 <= |a|, |b| < 2^127
    (NaN, zero, fp16 subnormals, infinities and the top binade are left to the caller).

    Why: as in sr_fp16_bits_fast, adding ~r >> 19 (= 0x1FFF - (r >> 19)) to the low 13 bits
    of the significand carries into bit 13 exactly when lowprec rounds up, and the add can
    work on the signed bits: below 2^127 no carry reaches the exponent's top or the sign.
    Truncating the sum to fp16 is then the rounded value, which the hardware does for two
    values in one `cvt.rz.satfinite.f16x2.f32`: toward zero drops the 13 bits (every |sum| >=
    2^-14 has an fp16 normal or overflow code), satfinite clamps past 65504 to 65504 as
    lowprec's min does. Per element an add, a shift, half a conversion and two compares,
    against sr_fp16_bits_fast's integer rebias, clamp, sign and packing.
    """
    return sr_fp16x2_lanes(a, b, ra, rb, 0, 0, 32)


def sr_fp16x2_lanes(a, b, word_a, word_b, lane_a: int, lane_b: int, sr_bits: int):
    """(bits, exact): sr_fp16x2_fast for k-bit draws, SR(a) with the draw in lane `lane_a` of
    `word_a` (sr_draw) in the low half, SR(b) with lane `lane_b` of `word_b` in the high half;
    exact where 2^-14 <= |a|, |b| < 2^127. The addend is sr_addend's (below 2^13 for every k,
    so the argument of sr_fp16x2_fast holds as it stands)."""
    exact = (_fabs(a) >= _f(2.0**-14, a)) & (_fabs(a) < _f(2.0**127, a))
    exact = exact & (_fabs(b) >= _f(2.0**-14, b)) & (_fabs(b) < _f(2.0**127, b))
    if _is_np(a):  # the device's arithmetic: the same adds, then what the truncating
        # conversion does with a sum of |t| >= 2^-14 (its low 13 significand bits dropped,
        # |t| clamped to 65504), so that the CPU tests check this formula, not another one
        def truncated(v, word, lane):
            t = f32_bits(v) + sr_addend(np.asarray(word, np.uint32), lane, sr_bits)
            with np.errstate(invalid="ignore", over="ignore"):
                t = np.clip(bits_f32(t & np.uint32(0xFFFFE000)), -65504.0, 65504.0)
                return t.astype(np.float16).view(np.uint16).astype(np.uint32)

        return truncated(a, word_a, lane_a) | (truncated(b, word_b, lane_b) << np.uint32(16)), exact
    ta = f32_bits(a) + sr_addend(word_a, lane_a, sr_bits)
    tb = f32_bits(b) + sr_addend(word_b, lane_b, sr_bits)
    packed = inline_ptx(
        T.i32(),
        [bits_f32(tb).ir_value(), bits_f32(ta).ir_value()],
        "cvt.rz.satfinite.f16x2.f32 $0, $1, $2;",
        "=r,f,f",
    )
    return Uint32(packed), exact


@cute.jit
def sr_fp16_chunk(frag, values, counter_lo0, counter_hi, keys, first: int = 0):
    """fp16 SR bits of the 8 consecutive state elements values[first .. first + 7] (the first
    a multiple of 4), two per uint32 of `frag` (from frag[first // 2]): element first + 4j + k
    takes word k of the counter `(counter_lo0 + first // 4 + j, counter_hi)`. The one-add form
    (sr_fp16x2_fast, a pair a conversion) where all eight lie in 2^-14 <= |x| < 2^127; a
    thread holding an fp16 subnormal, zero, NaN or infinity redoes its eight the general way."""
    words = []
    for j in cutlass.range_constexpr(2):
        words.extend(philox_words(counter_lo0 + Uint32(first // 4 + j), counter_hi, keys))
    f2 = first // 2
    exact = cutlass.Boolean(True)
    for v2 in cutlass.range_constexpr(4):
        frag[f2 + v2], exact_pair = sr_fp16x2_fast(
            values[first + 2 * v2], values[first + 2 * v2 + 1], words[2 * v2], words[2 * v2 + 1]
        )
        exact = exact & exact_pair
    if not exact:
        for v2 in cutlass.range_constexpr(4):
            low = sr_fp16_bits(values[first + 2 * v2], words[2 * v2], 32)
            high = sr_fp16_bits(values[first + 2 * v2 + 1], words[2 * v2 + 1], 32)
            frag[f2 + v2] = low | (high << Uint32(16))


def shared_words(counter_lo0, counter_hi, keys, W: int, sr_bits: int, element0):
    """8 bits: the words of the one counter a piece of W (8 or 16) elements element0 ..
    (element0 a multiple of W, counter_lo0 the low word of element0 >> 4) draws from, all
    four for 16 elements, for 8 the two its elements own (bit 3 of element0); None for the
    other settings, whose groups of 8 elements have counters of their own."""
    if sr_bits != 8:
        return None
    words = list(philox_words(counter_lo0, counter_hi, keys))
    if W == 8:
        upper = (element0 & _u(8, element0)) != _u(0, element0)
        words = [_sel(upper, words[2], words[0]), _sel(upper, words[3], words[1])]
    return words


def group_words(counter_lo0, counter_hi, keys, sr_bits: int, first: int, shared) -> list:
    """The random words of elements first .. first + 7 of a piece (first a multiple of 8;
    counter_lo0 the low word of the piece's first counter), n = 32 // lane_bits(sr_bits)
    elements a word, element first + v taking lane v % n of word v // n: two philox_words
    for 32 bits, one for 16 and 13, a share of `shared_words` for 8."""
    if sr_bits == 8:
        return shared[first // 4: first // 4 + 2]
    per_counter = 1 << counter_shift(sr_bits)
    words = []
    for j in range(first // per_counter, (first + 8) // per_counter):
        counter = counter_lo0 + _u(j, counter_lo0) if j else counter_lo0
        words.extend(philox_words(counter, counter_hi, keys))
    return words


def piece_words(counter_lo0, counter_hi, keys, W: int, sr_bits: int, element0) -> list:
    """Every group's words of a piece of W elements, in element order (what the kernels draw
    a group at a time, `sr_fp16_piece`): one philox_words a counter the piece touches, W / 4
    for 32 bits, W / 8 for 16 and 13, one for 8."""
    shared = shared_words(counter_lo0, counter_hi, keys, W, sr_bits, element0)
    return [word for first in range(0, W, 8)
            for word in group_words(counter_lo0, counter_hi, keys, sr_bits, first, shared)]


@cute.jit
def sr_fp16_piece(frag, values, W: cutlass.Constexpr, slot, flush, element0, counter_hi, keys,
                  sr_bits: cutlass.Constexpr = DEFAULT_SR_BITS):
    """fp16 SR bits of the W (8 or 16) consecutive state elements element0 .. element0 + W - 1
    (element0 a multiple of W) holding values[0 .. W-1], two per uint32 of `frag`, with
    `sr_bits` random bits an element, their words drawn a group of 8 at a time (group_words:
    Philox as often as the setting needs; a group's words die with it, which at the 64
    registers of the Nemotron flush is 0.7 SASS instructions an element fewer than drawing
    the piece's words first). `counter_hi`: the high counter word of (slot, flush)
    (state_counter); `keys`: philox_keys, whose count is the rounds. 32 bits:
    sr_fp16_chunk a group."""
    counter_lo0, _ = state_counter(slot, flush, element0 >> Uint32(counter_shift(sr_bits)))
    if cutlass.const_expr(sr_bits == 32):
        for first in cutlass.range_constexpr(0, W, 8):
            sr_fp16_chunk(frag, values, counter_lo0, counter_hi, keys, first)
    else:
        lanes = 32 // lane_bits(sr_bits)
        shared = shared_words(counter_lo0, counter_hi, keys, W, sr_bits, element0)
        for first in cutlass.range_constexpr(0, W, 8):
            words = group_words(counter_lo0, counter_hi, keys, sr_bits, first, shared)
            _sr_fp16_lanes8(frag, values, words, first, lanes, sr_bits)


@cute.jit
def _sr_fp16_lanes8(frag, values, words, first: cutlass.Constexpr, lanes: cutlass.Constexpr,
                    sr_bits: cutlass.Constexpr):
    """values[first .. first + 7] with k-bit draws, element first + v taking lane v % lanes of
    words[v // lanes]: the paired one-add form, or the general one for all eight where a
    value is outside its range (as sr_fp16_chunk)."""
    f2 = first // 2
    exact = cutlass.Boolean(True)
    for v2 in cutlass.range_constexpr(4):
        v = 2 * v2
        frag[f2 + v2], exact_pair = sr_fp16x2_lanes(
            values[first + v], values[first + v + 1], words[v // lanes], words[(v + 1) // lanes],
            v % lanes, (v + 1) % lanes, sr_bits)
        exact = exact & exact_pair
    if not exact:
        for v2 in cutlass.range_constexpr(4):
            v = 2 * v2
            low = sr_fp16_bits(values[first + v], sr_draw(words[v // lanes], v % lanes, sr_bits),
                               sr_bits)
            high = sr_fp16_bits(values[first + v + 1],
                                sr_draw(words[(v + 1) // lanes], (v + 1) % lanes, sr_bits),
                                sr_bits)
            frag[f2 + v2] = low | (high << Uint32(16))


def rn_code(x, fmt):
    """Code of RN(x) (ties to even, saturating) in the element format `fmt` (FP16, E4M3,
    E2M1 of this module)."""
    mbits, bias = fmt[0], fmt[1]
    sign, a, significand, e_eff = _decompose(x)
    shift = _umin(_shift(e_eff, mbits, bias), _u(31, a))  # >= 13 for every format here
    floor_m = significand >> shift
    remainder = significand & ((_u(1, a) << shift) - _u(1, a))
    half = _u(1, a) << (shift - _u(1, a))
    odd = (floor_m & _u(1, a)) == _u(1, a)
    up = _sel((remainder > half) | ((remainder == half) & odd), _u(1, a), _u(0, a))
    return _finish(sign, a, _exponent_field(e_eff, mbits, bias) + floor_m + up, fmt)


def rn_fp16_bits(x):
    """fp16 bits of RN(x), saturating at 65504."""
    return rn_code(x, FP16)


def rn_fp16x2(a, b):
    """fp16 bits of RN(a) (low half) and RN(b) (high half) in one word, saturating at 65504:
    the hardware `cvt.rn.satfinite.f16x2.f32` (satfinite clamps past 65504 to 65504, which is
    lowprec's min(RN(x), max)), with NaN mapped to lowprec's 0x7E00 (hardware gives 0x7FFF).
    Same bits as two rn_fp16_bits; the fast path for kernels that round every element."""
    if _is_np(a):
        return rn_fp16_bits(a) | (rn_fp16_bits(b) << np.uint32(16))
    a, b = Float32(a), Float32(b)
    packed = Uint32(
        inline_ptx(
            T.i32(),
            [b.ir_value(), a.ir_value()],
            "cvt.rn.satfinite.f16x2.f32 $0, $1, $2;",
            "=r,f,f",
        )
    )
    low = _sel(a != a, Uint32(0x7E00), packed & Uint32(0xFFFF))
    high = _sel(b != b, Uint32(0x7E000000), packed & Uint32(0xFFFF0000))
    return low | high


def rn_e4m3_byte(x):
    """OCP E4M3FN byte of RN(x), saturating at 448. On the device the hardware conversion
    `cvt.rn.satfinite.e4m3x2.f32` (sm_89 and later: ties to even, subnormals, and past 448 the
    largest finite byte, as lowprec), with NaN mapped to lowprec's 0x7F (the hardware keeps a
    NaN's sign): 3 instructions instead of about 20 for the integer rounding."""
    if _is_np(x):
        return rn_code(x, E4M3)
    x = Float32(x)
    byte = Uint32(
        inline_ptx(
            T.i32(),
            [x.ir_value()],
            "{.reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; cvt.u32.u16 $0, t;}",
            "=r,f",
        )
    )
    return _sel(x != x, Uint32(0x7F), byte & Uint32(0xFF))


def rn_e2m1_nibble(x):
    """E2M1 nibble `s e1 e0 m` of RN(x), saturating at 6."""
    return rn_code(x, E2M1)


def e4m3_value(byte):
    """Exact fp32 value of a non-negative, non-NaN E4M3 byte (a block scale). On the device
    the hardware converts it to f16 (every E4M3 value is an f16 normal) and f16 to fp32; the
    NaN byte 0x7F (the scale of a block whose ratio was NaN) gives 480 as the integer form
    does, not the hardware's NaN, so that such a block's codes stay lowprec's."""
    if not _is_np(byte):
        value = Float32(
            inline_ptx(
                T.f32(),
                [Uint32(byte).ir_value()],
                "{.reg .b16 b, l, h; .reg .b32 p; cvt.u16.u32 b, $1; "
                "cvt.rn.f16x2.e4m3x2 p, b; mov.b32 {l, h}, p; cvt.f32.f16 $0, l;}",
                "=f,r",
            )
        )
        return _sel(Uint32(byte) == Uint32(0x7F), Float32(480.0), value)
    exponent = byte >> _u(3, byte)
    mantissa = byte & _u(7, byte)
    normal = bits_f32(((exponent + _u(120, byte)) << _u(23, byte)) | (mantissa << _u(20, byte)))
    subnormal = _mantissa_as_f32(mantissa) * 2.0**-9  # exact: a power-of-two scaling
    return _sel(exponent == _u(0, byte), subnormal, normal)


def _mantissa_as_f32(mantissa):
    if _is_np(mantissa):
        return mantissa.astype(np.float32)
    return Float32(mantissa.to(cutlass.Int32))


def div_rn(a, b):
    """a / b correctly rounded: IEEE fp32 division, PTX div.rn.f32 (no flush to zero)."""
    if _is_np(a) or _is_np(b):
        return (np.asarray(a, np.float32) / np.asarray(b, np.float32)).astype(np.float32)
    return _f32_ptx("div.rn.f32", a, b)


def _f32_ptx(op: str, a, b) -> Float32:
    """The fp32 PTX instruction `op` on a and b, exactly as written (LLVM cannot rewrite it)."""
    result = inline_ptx(
        T.f32(), [Float32(a).ir_value(), Float32(b).ir_value()], f"{op} $0, $1, $2;", "=f,f,f"
    )
    return Float32(result)


def _f(value, like):
    """The fp32 constant `value` in `like`'s backend."""
    return np.float32(value) if _is_np(like) else Float32(value)


def _fabs(a):
    return np.abs(a).astype(np.float32) if _is_np(a) else cute.math.absf(a)


def recip_usable(recip, smallest: float = 2.0**-125):
    """True where `recip` = RN(1/d) is at least `smallest` (normal) and below 2^126, so that
    x * recip carries a relative error of at most 2^-23 + 2^-48 (False for NaN and inf)."""
    return (recip >= _f(smallest, recip)) & (recip < _f(2.0**126, recip))


# e2m1_pair_fast's quotients are taken times 2^-14: E2M1's grid 0, 0.5, 1, ..., 6 is then
# fp16's 0x0000, 0x0200 (a subnormal), 0x0400, ..., 0x0E00, its code the bits 9-11
E2M1_PAIR_SCALE = 2.0**-14
# Taken times 2^-126 instead, every E2M1 decision point (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)
# has an fp32 pattern that is an odd multiple of 2^21 (0.25 and 0.75 as subnormals, the
# others in their binades) and every grid value an even one; quotients within this many
# units of an odd multiple take the division (e2m1_margin below E2M1_PAIR_MARGIN)
E2M1_PAIR_NEAR = 8
# e2m1_margin keeps the pattern's distance to the next odd multiple (22 bits) in a word's top
# bits, so that one multiply-add forms it: margins and the threshold are times 2^10
E2M1_MARGIN_SHIFT = 10
E2M1_PAIR_MARGIN = 2 * E2M1_PAIR_NEAR << E2M1_MARGIN_SHIFT


def recip14_usable(recip):
    """True where recip = RN(1/d) times E2M1_PAIR_SCALE is an fp32 normal below 2^126 (so
    the scaling is exact and x * it carries the relative error e2m1_pair_fast assumes)."""
    return recip_usable(recip, 2.0**-111)


def _cvt_rz_f16x2_min6(lo, hi):
    """fp16 bits of RZ(lo) (low half) and RZ(hi) (high half), satfinite, then each magnitude
    clamped at 0x0E00 (6 * 2^-14) with its sign kept: `cvt.rz.satfinite.f16x2.f32` and
    `min.xorsign.abs.f16x2` (sm_86 and later). A NaN (outside the contract) converts to the
    canonical NaN, which the min takes as absent: 0x0E00."""
    if _is_np(lo):
        def half(v):
            v = np.asarray(v, np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                h = v.astype(np.float16)  # RN; RZ is RN or one step toward zero
                over = np.abs(h.astype(np.float32)) > np.abs(v)
            bits = h.view(np.uint16).astype(np.uint32) - over.astype(np.uint32)
            bits = np.where(np.isnan(v), np.uint32(0x7FFF), bits)  # the canonical NaN
            magnitude = np.minimum(bits & np.uint32(0x7FFF), np.uint32(0x0E00))
            return (bits & np.uint32(0x8000)) | magnitude

        return half(lo) | (half(hi) << np.uint32(16))
    packed = inline_ptx(
        T.i32(),
        [Float32(hi).ir_value(), Float32(lo).ir_value(), Uint32(0x0E000E00).ir_value()],
        "{.reg .b32 h; cvt.rz.satfinite.f16x2.f32 h, $1, $2; "
        "min.xorsign.abs.f16x2 $0, h, $3;}",
        "=r,f,f,r",
    )
    return Uint32(packed)


def e2m1_pair_fast(a, b, recip14, slot: int):
    """(word, margin): the E2M1 nibbles `s e1 e0 m` of RN_e2m1(a * recip) at nibble `slot`
    (0..3) and of RN_e2m1(b * recip) at nibble slot + 4 of a word (nothing else set), for
    recip14 = RN(1/d) * E2M1_PAIR_SCALE, recip14_usable(RN(1/d)); both are provably
    lowprec's RN_e2m1(RN(x / d)) where margin >= E2M1_PAIR_MARGIN (where not, about one
    pair in 2^16 at random, the caller divides).

    Why the codes are exact where the margin is. u = RN(x recip14) is x/d 2^-14 to within
    2^-23 relative (the scaling is exact), and lowprec's RN(x/d) 2^-14 within 2^-24: both
    within a few units of u's last place, so u 2^-112 and RN(x/d) 2^-126 (whose decision
    points are the odd multiples of 2^21, E2M1_PAIR_NEAR) are within a unit or four of each
    other's patterns. Where u 2^-112 is more than E2M1_PAIR_NEAR units from every odd
    multiple, both lie on one side of every decision point. The truncation of u to fp16
    keeps that side (each decision point times 2^-14 is on fp16's grid, subnormal or
    normal) and saturates; adding half of E2M1's last place (0x100 a half) and taking bits
    9-11 rounds half up, which equals lowprec's ties to even wherever no tie is possible.
    The sign is the signed quotient's, kept by the conversion and the xorsign min (so -0
    and negative quotients rounding to 0 give 8, as lowprec). Infinities saturate (7, 15)
    as lowprec's do.

    Per element: two multiplies, half a conversion, half a min, half an add, a shift and a
    mask for the code and one each for the sign (two of each a pair), and the margin (an
    add, a mask, a min)."""
    ua, ub = _mul_rn(a, recip14), _mul_rn(b, recip14)  # as written: never refolded
    c = _cvt_rz_f16x2_min6(ua, ub)
    r = c + _u(0x01000100, c)  # half up at bit 9 of each half (magnitudes <= 0x0F00: no carry)
    code_mask = (0x7 << (4 * slot)) | (0x7 << (4 * slot + 16))
    sign_mask = (0x8 << (4 * slot)) | (0x8 << (4 * slot + 16))
    word = (_shift_to(r, 9, 4 * slot) & _u(code_mask, r)) | (
        _shift_to(r, 15, 4 * slot + 3) & _u(sign_mask, r))
    return word, umin(e2m1_margin(ua), e2m1_margin(ub))


def e2m1_margin(u14):
    """How far u14 2^-112's fp32 pattern is from the odd multiples of 2^21 (the decision
    points of RN_e2m1 times 2^-126; subnormal below 2^-126), offset so that a quotient is
    provably on one side of every decision point where its margin is at least
    E2M1_PAIR_MARGIN: ((pattern + E2M1_PAIR_NEAR + 2^21) mod 2^22) 2^10, one `mad.lo.u32`
    (the modulo is the word's overflow). Margins are combined by their minimum (one unsigned
    min an element; the caller compares once a block)."""
    bits = f32_bits(_mul_rn(u14, 2.0**-112))
    scale = 1 << E2M1_MARGIN_SHIFT
    offset = (E2M1_PAIR_NEAR + 0x200000) << E2M1_MARGIN_SHIFT
    if _is_np(bits):  # a NaN (outside the contract) as the device's multiplies give it
        bits = np.where(np.isnan(bits.view(np.float32)), np.uint32(0x7FFFFFFF), bits)
        with np.errstate(over="ignore"):
            return (bits * np.uint32(scale) + np.uint32(offset)).astype(np.uint32)
    return Uint32(inline_ptx(T.i32(), [Uint32(bits).ir_value()],
                             f"mad.lo.u32 $0, $1, {scale}, {offset};", "=r,r"))


def umin(a, b):
    """The unsigned minimum (one IMNMX.U32 on the device). PTX's min.u32 as written:
    cutlass.min folded a constant 0xFFFFFFFF operand as a signed -1 (the first form of the
    flush's margin lost its first pair's margins that way). The general paths' `_umin` (a
    select, on operands far below 2^31) is left as their benchmarked SASS has it."""
    if _is_np(a) or _is_np(b):
        return np.minimum(a, b).astype(np.uint32)
    return Uint32(inline_ptx(T.i32(), [Uint32(a).ir_value(), Uint32(b).ir_value()],
                             "min.u32 $0, $1, $2;", "=r,r,r"))


def e2m1_words(values, W: int, recip, words):
    """The E2M1 codes of values[0 .. W-1] / divisor (recip = RN(1/divisor)) into
    words[0 .. W/8 - 1], eight a word (low nibble first), nibbles e and e + 4 of a word at
    once (e2m1_pair_fast); returns whether every one is provably lowprec's (else the
    caller divides). Traced into the caller (a plain function: its loops unroll)."""
    recip14 = recip * Float32(E2M1_PAIR_SCALE)  # exact: a power of two, both normal
    margin = None
    for w in range(W // 8):
        word = Uint32(0)
        for e in range(4):
            pair, margin_e = e2m1_pair_fast(values[8 * w + e], values[8 * w + e + 4],
                                            recip14, e)
            word = word | pair
            margin = margin_e if margin is None else umin(margin, margin_e)
        words[w] = word
    return recip14_usable(recip) & (margin >= Uint32(E2M1_PAIR_MARGIN))


def _shift_to(u, bit: int, to: int):
    """u shifted so that its bit `bit` lands on bit `to` (right or left; logical)."""
    if bit >= to:
        return u >> _u(bit - to, u)
    return u << _u(to - bit, u)


def _mul_rn(a, b):
    """a * b rounded to nearest even, subnormals kept (no flush to zero), never fused."""
    if _is_np(a) or _is_np(b):
        return (np.float32(a) * np.float32(b)).astype(np.float32)
    return _f32_ptx("mul.rn.f32", a, b)


def saturate_f32(x):
    """lowprec's fp32 store of an fp32 value: the identity except +-inf -> +-FLT_MAX."""
    u = f32_bits(x)
    is_inf = (u & _u(0x7FFFFFFF, u)) == _u(0x7F800000, u)
    return bits_f32(_sel(is_inf, u - _u(1, u), u))


# --------------------------------------------------------------------------------------------
# Mamba-2 scalar math (fp32 tolerance, not bit-exact: lowprec uses torch's exp and log1p)


def softplus(x):
    """torch.nn.functional.softplus with its default threshold: x above 20, else log1p(exp(x))."""
    return _sel(x > Float32(20.0), x, cute.math.log1p(cute.math.exp(x)))


def silu(z):
    """z * sigmoid(z)."""
    return z / (Float32(1.0) + cute.math.exp(-z))


def e2m1_as_e4m3(word):
    """The 8 E2M1 nibbles of ``word`` re-packed as E4M3 bytes of E2M1 x 2^-6, exactly:
    (even, odd), byte b of ``even`` from nibble 2b (element 2b), of ``odd`` from nibble
    2b + 1, so that `cvt.rn.f16x2.e4m3x2` converts two at a time.

    A nibble ``s e1 e0 m`` becomes the byte ``s 0 0 e1 e0 m 0 0``: exponent field ``e1 e0``
    and mantissa ``m 0 0`` give ``2^(e-7) (1 + m/2)`` = E2M1 x 2^-6 for e >= 1, and the
    subnormal ``2^-6 m/2`` for e = 0. Odd nibbles already have their sign at bit 7 of their
    byte, so they take a shift and two logic ops, even ones two shifts and two logic ops:
    7 integer instructions per 8 elements. Also runs on numpy uint32 arrays (the CPU tests
    check it against lowprec for every nibble).
    """
    u = np.uint32 if isinstance(word, (np.ndarray, np.generic)) else Uint32
    odd = (word & u(0x80808080)) | ((word >> u(2)) & u(0x1C1C1C1C))
    even = ((word << u(4)) & u(0x80808080)) | ((word << u(2)) & u(0x1C1C1C1C))
    return even, odd
