"""cute_kernels/numerics.py: the device rounding and random words equal lowprec bit for bit.

The numerics functions run on two backends: DSL scalars inside kernels and numpy arrays. On the
CPU the numpy backend (the very integer code the kernels trace) is compared with `lowprec`
exhaustively: every fp16 code, its fp32 neighbours and the midpoints to the next code, with
random and edge words, for 32-bit words and k-bit draws (16, 13, 8), Philox in 1..10 rounds.
A probe kernel compiles for sm_90a on the CPU (its PTX must use the exact instructions the
contract names); on the GPU its outputs must equal both.
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Uint32  # noqa: E402

from cute_kernels import _compile  # noqa: E402  (sets the target before cutlass)
from cute_kernels import numerics as nm  # noqa: E402
from cute_kernels import tensor_core as tc  # noqa: E402
from lowprec import philox  # noqa: E402
from lowprec import quantize as q  # noqa: E402
from lowprec.formats import E2M1, E4M3, FP16  # noqa: E402

SEED = 0x0123456789ABCDEF


def fp16_neighbourhoods() -> np.ndarray:
    """fp32 inputs around every fp16 code: the code's value and its fp32 neighbours (+-1, +-2
    ulp), the midpoint to the next code and its neighbours (RN ties and SR's smallest
    fractions), plus random values over 18 decades and special values."""
    codes = np.arange(1 << 16, dtype=np.uint32)
    value = codes.astype(np.uint16).view(np.float16).astype(np.float32)
    nxt = (codes + 1).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):
        mid = ((value.astype(np.float64) + nxt.astype(np.float64)) / 2).astype(np.float32)
    step = [np.uint32(0), np.uint32(1), np.uint32(2)]
    bits = [value.view(np.uint32) + d for d in step] + [value.view(np.uint32) - d for d in step[1:]]
    bits += [mid.view(np.uint32) + d for d in step[:2]] + [mid.view(np.uint32) - step[1]]
    x = np.concatenate(bits).view(np.float32)
    rng = np.random.default_rng(7)
    scale = np.float32(10.0) ** rng.integers(-12, 6, 20001).astype(np.float32)
    random = (rng.standard_normal(20001).astype(np.float32) * scale).astype(np.float32)
    special = np.array(
        [
            np.inf,
            -np.inf,
            np.nan,
            0.0,
            -0.0,
            65504.0,
            65519.99,
            65520.0,
            -65536.0,
            1e-45,
            2.98e-8,
            448.0,
            464.0,
            480.0,
            6.0,
            7.0,
            0.25,
            0.75,
            1.25,
            2.5,
            5.0,
            3e38,
        ],
        dtype=np.float32,
    )
    return np.concatenate([x, random, special]).astype(np.float32)


def lowprec_codes(x: np.ndarray, element, rounding="rn", words=None) -> np.ndarray:
    """lowprec's codes of x: RN, or SR with whole 32-bit `words` (sr_bits=32)."""
    rand = None if words is None else torch.from_numpy(words.astype(np.int64))
    sr = {} if words is None else {"sr_bits": 32}
    rounded = q.round_to(torch.from_numpy(x.copy()), element, rounding, rand, **sr)
    if element is E2M1 or element is E4M3:
        rounded = torch.nan_to_num(rounded, nan=0.0)  # E2M1/E4M3 NaN is outside the contract
    return q.encode_bits(rounded, element).numpy().astype(np.uint32)


def first_mismatches(x, want, got, words=None, n=5):
    bad = np.nonzero(want != got)[0][:n]
    rows = [
        f"x={x[i]!r} ({x[i : i + 1].view(np.uint32)[0]:#010x})"
        + ("" if words is None else f" r={words[i]:#010x}")
        + f" want {want[i]:#x} got {got[i]:#x}"
        for i in bad
    ]
    return f"{len(np.nonzero(want != got)[0])} mismatches; first: " + "; ".join(rows)


X = fp16_neighbourhoods()
FINITE_OR_INF = X[~np.isnan(X)]


@pytest.mark.parametrize(
    "element, fn",
    [(FP16, nm.rn_fp16_bits), (E4M3, nm.rn_e4m3_byte), (E2M1, nm.rn_e2m1_nibble)],
    ids=["fp16", "e4m3", "e2m1"],
)
def test_rn_codes_equal_lowprec_around_every_fp16_code(element, fn):
    """RN (ties to even, saturating) codes equal lowprec.encode_bits(round_to(x, 'rn')), e.g.
    fp16 65519.99 -> 0x7BFF, 65520 (a tie past the max) -> 0x7BFF, e4m3 464 (tie) -> 0x7E."""
    x = X if element is FP16 else FINITE_OR_INF
    want = lowprec_codes(x, element)
    got = fn(x)
    assert np.array_equal(want, got), first_mismatches(x, want, got)


def test_rn_fp16x2_numpy_path_equals_two_scalar_roundings():
    """The packed form's reference path is two scalar RN roundings, low half first."""
    a, b = X[: X.size // 2 * 2 : 2], X[1 : X.size // 2 * 2 : 2]
    packed = nm.rn_fp16x2(a, b)
    assert np.array_equal(packed & 0xFFFF, nm.rn_fp16_bits(a))
    assert np.array_equal(packed >> 16, nm.rn_fp16_bits(b))


@pytest.mark.parametrize("kind", ["random", "zero", "max", "half"])
def test_sr_fp16_equals_lowprec_for_every_fp16_neighbourhood(kind):
    """SR bits with 32-bit words (sr_bits=32) equal lowprec's for random words and the edge
    words 0 (rounds up iff any fraction is discarded), 2^32-1 (never rounds up) and 2^31."""
    rng = np.random.default_rng(11)
    words = {
        "random": rng.integers(0, 1 << 32, X.size, dtype=np.uint64).astype(np.uint32),
        "zero": np.zeros(X.size, np.uint32),
        "max": np.full(X.size, 0xFFFFFFFF, np.uint32),
        "half": np.full(X.size, 0x80000000, np.uint32),
    }[kind]
    want = lowprec_codes(X, FP16, "sr", words)
    got = nm.sr_fp16_bits(X, words, 32)
    assert np.array_equal(want, got), first_mismatches(X, want, got, words)


def test_sr_fp16_threshold_is_exact():
    """32-bit words just below and at floor(frac * 2^32) decide up/down: 1 + 2^-12 lies
    2^-12 / 2^-10 = 1/4 of an fp16 ulp above 1, so the threshold is 2^30: r = 2^30 - 1 rounds
    up to 0x3C01, r = 2^30 stays at 0x3C00; 16-bit draws' threshold is 2^14."""
    x = np.array([1 + 2.0**-12] * 2, np.float32)
    words = np.array([(1 << 30) - 1, 1 << 30], np.uint32)
    assert nm.sr_fp16_bits(x, words, 32).tolist() == [0x3C01, 0x3C00]
    draws = np.array([(1 << 14) - 1, 1 << 14], np.uint32)
    assert nm.sr_fp16_bits(x, draws, 16).tolist() == [0x3C01, 0x3C00]


def test_philox_words_equal_lowprec_randint():
    """First Philox-4x32-10 word of counter (offset lo, offset hi, 0, 0), key (seed lo, hi)."""
    offsets = torch.cat(
        [
            torch.randint(0, 1 << 62, (4000,), dtype=torch.int64),
            torch.tensor([0, 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1]),
        ]
    )
    want = philox.randint(SEED, offsets).numpy().astype(np.uint32)
    o = offsets.numpy().astype(np.uint64)
    keys = nm.philox_keys(np.uint32(SEED & 0xFFFFFFFF), np.uint32(SEED >> 32))
    got = nm.philox_word((o & 0xFFFFFFFF).astype(np.uint32), (o >> 32).astype(np.uint32), keys)
    assert np.array_equal(want, got)


def test_state_counter_packs_slot_flush_element():
    """offset = (slot << 44) | (flush << 24) | element, split into 32-bit counter words."""
    slot = np.array([0, 5, 1023, (1 << 20) - 1], np.uint32)
    flush = np.array([0, 300, 255, (1 << 20) - 1], np.uint32)
    element = np.array([0, 7, (1 << 24) - 1, 12345], np.uint32)
    lo, hi = nm.state_counter(slot, flush, element)
    offset = philox.state_offsets(
        torch.from_numpy(slot.astype(np.int64)), torch.from_numpy(flush.astype(np.int64)), [1]
    )[:, 0]
    offset = offset.numpy().astype(np.uint64) | element.astype(np.uint64)
    assert np.array_equal(lo, (offset & 0xFFFFFFFF).astype(np.uint32))
    assert np.array_equal(hi, (offset >> 32).astype(np.uint32))


def _flagged(value, flag, bit):
    return value.astype(np.uint32) | (flag.astype(np.uint32) << np.uint32(bit))


def test_philox_words_equal_lowprec_randint4x():
    """All four words of the counter (offset lo, offset hi, 0, 0), in Triton's order."""
    offsets = torch.cat(
        [torch.randint(0, 1 << 62, (3001,), dtype=torch.int64), torch.tensor([0, (1 << 63) - 1])]
    )
    want = [w.numpy().astype(np.uint32) for w in philox.randint4x(SEED, offsets)]
    o = offsets.numpy().astype(np.uint64)
    keys = nm.philox_keys(np.uint32(SEED & 0xFFFFFFFF), np.uint32(SEED >> 32))
    got = nm.philox_words((o & 0xFFFFFFFF).astype(np.uint32), (o >> 32).astype(np.uint32), keys)
    for k in range(4):
        assert np.array_equal(want[k], got[k]), f"word {k}"


@pytest.mark.parametrize("rounds", [1, 4, 7])
def test_philox_words_in_fewer_rounds_equal_lowprec_randint4x(rounds):
    """The keys' count is the rounds: philox_words under philox_keys(seed, R) is
    lowprec.philox.randint4x(seed, offset, R) (Triton's tl.randint4x(..., n_rounds=R)), all
    four words, for R = 1 (round 1 alone, specialised for c2 = c3 = 0), 4 and 7."""
    offsets = torch.cat(
        [torch.randint(0, 1 << 62, (2001,), dtype=torch.int64), torch.tensor([0, (1 << 63) - 1])]
    )
    want = [w.numpy().astype(np.uint32) for w in philox.randint4x(SEED, offsets, rounds)]
    o = offsets.numpy().astype(np.uint64)
    keys = nm.philox_keys(np.uint32(SEED & 0xFFFFFFFF), np.uint32(SEED >> 32), rounds)
    assert len(keys) == rounds
    got = nm.philox_words((o & 0xFFFFFFFF).astype(np.uint32), (o >> 32).astype(np.uint32), keys)
    for k in range(4):  # (after one round word 1 is the constant 0: broadcast)
        assert np.array_equal(want[k], np.broadcast_to(got[k], want[k].shape)), f"word {k}"
    with pytest.raises(ValueError, match="rounds: expected an int in"):
        nm.philox_keys(np.uint32(1), np.uint32(2), 11)


@pytest.mark.parametrize("sr_bits", [16, 13, 8])
@pytest.mark.parametrize("kind", ["random", "zero", "max"])
def test_k_bit_sr_fp16_equals_lowprec_for_every_fp16_neighbourhood(sr_bits, kind):
    """sr_fp16_bits with k-bit draws equals lowprec's round_to(..., sr_bits=k): rounds up iff
    r < floor(frac 2^k), so draw 0 rounds up whenever the top k bits of the dropped fraction
    are not all zero, and 2^k - 1 never rounds up (subnormals, saturation, NaN included)."""
    rng = np.random.default_rng(12 + sr_bits)
    draws = {"random": rng.integers(0, 1 << sr_bits, X.size, dtype=np.uint64),
             "zero": np.zeros(X.size, np.uint64),
             "max": np.full(X.size, (1 << sr_bits) - 1, np.uint64)}[kind].astype(np.uint32)
    rand = torch.from_numpy(draws.astype(np.int64))
    rounded = q.round_to(torch.from_numpy(X.copy()), FP16, "sr", rand, sr_bits=sr_bits)
    want = q.encode_bits(rounded, FP16).numpy().astype(np.uint32)
    got = nm.sr_fp16_bits(X, draws, sr_bits)
    assert np.array_equal(want, got), first_mismatches(X, want, got, draws)


@pytest.mark.parametrize("sr_bits", [32, 16, 13, 8])
def test_sr_draw_and_addend_are_the_lane_and_its_complement_aligned_to_13_bits(sr_bits):
    """sr_draw(word, lane, k) is the low k bits of the word's lane of W bits, and sr_addend is
    c_k = 2^k - 1 - r_k aligned to FP16's 13 dropped bits (docs/design.md's table: shifted
    right by k - 13 for k >= 13, left by 5 for k = 8), below 2^13 for every word and lane."""
    rng = np.random.default_rng(sr_bits)
    words = np.concatenate([rng.integers(0, 1 << 32, 5000, dtype=np.uint64).astype(np.uint32),
                            np.array([0, 0xFFFFFFFF, 0x80008080, 0x7FFF7F7F], np.uint32)])
    width = nm.lane_bits(sr_bits)
    for lane in range(32 // width):
        lane_value = (words.astype(np.uint64) >> np.uint64(width * lane)) & np.uint64(
            (1 << width) - 1)
        draw = lane_value & np.uint64((1 << sr_bits) - 1)
        assert np.array_equal(nm.sr_draw(words, lane, sr_bits), draw.astype(np.uint32))
        complement = np.uint64((1 << sr_bits) - 1) - draw
        aligned = (complement >> np.uint64(sr_bits - 13) if sr_bits >= 13
                   else complement << np.uint64(13 - sr_bits))
        addend = nm.sr_addend(words, lane, sr_bits)
        assert np.array_equal(addend, aligned.astype(np.uint32)), lane
        assert int(addend.max()) < 1 << 13


@pytest.mark.parametrize("sr_bits", [16, 13, 8])
def test_k_bit_paired_sr_equals_the_general_form_for_every_draw(sr_bits):
    """sr_fp16x2_lanes (two adds of sr_addend, one truncating conversion) equals sr_fp16_bits
    with the lane's draw, both halves, wherever both inputs lie in 2^-14 <= |x| < 2^127, and
    flags the rest; for 24 values of each fp16 binade and sign, exhaustively over all 2^k
    draws of the low half's lane (k = 16: 65,536), the high half taking lane + 1."""
    rng = np.random.default_rng(40 + sr_bits)
    binades = rng.integers(113, 143, 24).astype(np.uint32)  # fp16's normal range and above
    bits = (rng.integers(0, 1 << 23, 24).astype(np.uint32) | (binades << np.uint32(23))
            | (rng.integers(0, 2, 24).astype(np.uint32) << np.uint32(31)))
    values = np.concatenate([bits.view(np.float32),
                             np.array([65504.0, -65519.0, 2.0**-14, 1e-6, 0.0], np.float32)])
    width = nm.lane_bits(sr_bits)
    draws = np.arange(1 << sr_bits, dtype=np.uint32)
    for lane in range(0, 32 // width, 2):
        x = np.repeat(values, draws.size)
        y = np.roll(x, 7)
        r = np.tile(draws, values.size)
        word = (r << np.uint32(width * lane)) | (r[::-1] << np.uint32(width * (lane + 1)))
        pair, exact = nm.sr_fp16x2_lanes(x, y, word, word, lane, lane + 1, sr_bits)
        with np.errstate(invalid="ignore"):
            inside = [(np.abs(v) >= np.float32(2.0**-14)) & (np.abs(v) < np.float32(2.0**127))
                      for v in (x, y)]  # fmt: skip
        assert np.array_equal(exact, inside[0] & inside[1])
        general = (nm.sr_fp16_bits(x, nm.sr_draw(word, lane, sr_bits), sr_bits)
                   | (nm.sr_fp16_bits(y, nm.sr_draw(word, lane + 1, sr_bits), sr_bits)
                      << np.uint32(16)))
        assert exact.mean() > 0.6
        assert np.array_equal(pair[exact], general[exact]), lane


@pytest.mark.parametrize("sr_bits, width, rounds", [
    (32, 8, 10), (32, 16, 7), (16, 8, 7), (16, 16, 10), (13, 16, 4), (8, 8, 4), (8, 16, 7),
])
def test_piece_words_give_every_element_lowprecs_draw(sr_bits, width, rounds):
    """A kernel's piece of `width` elements (element0 a multiple of it) takes its draws from
    piece_words (one Philox call a counter it touches) and sr_draw: element element0 + v the
    lane v % n of word v // n. Every piece of a 4096-element state of slot 777 at flush 300
    gets lowprec.philox.random_words' draws for its elements, bit for bit."""
    slot, flush, numel = 777, 300, 4096
    want = philox.random_words(SEED, slot, flush, (numel,), sr_bits=sr_bits,
                               philox_rounds=rounds).numpy().astype(np.uint32)
    element0 = np.arange(0, numel, width, dtype=np.uint32)
    ones = np.ones_like(element0)
    counter_lo0, counter_hi = nm.state_counter(
        ones * np.uint32(slot), ones * np.uint32(flush),
        element0 >> np.uint32(nm.counter_shift(sr_bits)))
    keys = nm.philox_keys(np.uint32(SEED & 0xFFFFFFFF), np.uint32(SEED >> 32), rounds)
    words = nm.piece_words(counter_lo0, counter_hi, keys, width, sr_bits, element0)
    lanes = 32 // nm.lane_bits(sr_bits)
    assert len(words) == width // lanes
    got = np.stack([nm.sr_draw(words[v // lanes], v % lanes, sr_bits) for v in range(width)],
                   axis=1).reshape(-1)
    assert np.array_equal(got, want)


def _fp16_neighbourhood_inputs(rng, n):
    """fp32 values around every fp16 exponent (subnormal range, normal range, overflow), zeros,
    infinities and NaNs, and words at and next to each value's rounding threshold."""
    exponent = rng.integers(95, 150, n).astype(np.uint32)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    bits = (bits & np.uint32(0x807FFFFF)) | (exponent << np.uint32(23))
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                        113 << 23, (113 << 23) - 1, 0x477FEFFF, 0x477FF000], np.uint32)
    bits[: special.size] = special
    words = rng.integers(0, 1 << 32, n, dtype=np.uint64)
    threshold = (bits & np.uint32(0x1FFF)).astype(np.uint64) << np.uint64(19)
    near = (threshold + rng.integers(-1, 2, n).astype(np.uint64)) & np.uint64(0xFFFFFFFF)
    words = np.where(rng.random(n) < 0.5, near, words).astype(np.uint32)
    return bits.view(np.float32), words


def test_sr_fp16_fast_equals_the_general_form_wherever_it_claims_to():
    """The one-add SR with 32-bit words is exact for every |x| >= 2^-14 (infinities
    saturate), flags smaller |x| and NaN, and agrees bit for bit with sr_fp16_bits(x, r, 32)
    (tied to lowprec above)."""
    x, words = _fp16_neighbourhood_inputs(np.random.default_rng(5), 400_000)
    fast, exact = nm.sr_fp16_bits_fast(x, words)
    with np.errstate(invalid="ignore"):
        should = (np.abs(x) >= np.float32(2.0**-14)) & ~np.isnan(x)
    assert np.array_equal(exact, should)
    assert np.array_equal(fast[exact], nm.sr_fp16_bits(x, words, 32)[exact])


def test_sr_fp16x2_fast_equals_the_general_form_wherever_it_claims_to():
    """The paired SR with 32-bit words (two adds, one truncating conversion) is
    sr_fp16_bits(., ., 32) for both halves wherever both inputs lie in 2^-14 <= |x| < 2^127,
    and says so exactly there: zero, fp16 subnormals, NaN, infinities and the top binade
    (where the add could carry into the exponent's all-ones) go to the general form."""
    x, words = _fp16_neighbourhood_inputs(np.random.default_rng(5), 400_000)
    y, more = _fp16_neighbourhood_inputs(np.random.default_rng(9), 400_000)
    top = np.array([2.0**127, -(2.0**127), 3.4028235e38, 2.0**127 * 0.99999994], np.float32)
    x[-top.size :], y[-top.size :] = top, np.float32(1.5)
    pair, exact = nm.sr_fp16x2_fast(x, y, words, more)
    with np.errstate(invalid="ignore"):
        inside = [(np.abs(v) >= np.float32(2.0**-14)) & (np.abs(v) < np.float32(2.0**127))
                  for v in (x, y)]  # fmt: skip
    assert np.array_equal(exact, inside[0] & inside[1])
    assert 0.3 < exact.mean() < 0.9 and not exact[-top.size : -1].any() and exact[-1]
    general = nm.sr_fp16_bits(x, words, 32) | (nm.sr_fp16_bits(y, more, 32) << np.uint32(16))
    assert np.array_equal(pair[exact], general[exact])


E2M1_POINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0, 0.5, 1, 1.5, 2, 3, 4, 6, 7, 9])


def _near_e2m1_points(rng, d):
    """x with x / d (one per divisor in d) on, or 1-3 ulps from, E2M1's decision points (the
    first 7 of E2M1_POINTS), its values, 0 and past saturation for half of them, uniform in
    [0, 8) for the rest; either sign."""
    n = d.size
    target = np.where(rng.random(n) < 0.5, E2M1_POINTS[rng.integers(0, E2M1_POINTS.size, n)],
                      rng.uniform(0, 8, n)) * np.where(rng.random(n) < 0.5, -1, 1)
    x = (target * d.astype(np.float64)).astype(np.float32)
    for _ in range(3):
        step = rng.integers(-1, 2, n)
        x = np.where(step > 0, np.nextafter(x, np.float32(np.inf)), x)
        x = np.where(step < 0, np.nextafter(x, np.float32(-np.inf)), x)
    return x


def test_recip_usable_refuses_non_finite_and_extreme_reciprocals():
    """recip_usable (behind recip14_usable) is False for inf, NaN, 2^127 and the subnormal
    2^-127, True for normal reciprocals between."""
    bad = np.array([np.inf, np.nan, 2.0**127, 2.0**-127], np.float32)
    good = np.array([2.0**-125, 0.75, 1.0 / 3.0, 2.0**125], np.float32)
    assert not nm.recip_usable(bad).any()
    assert nm.recip_usable(good).all()


def test_e2m1_pair_fast_equals_the_division_wherever_it_claims_to():
    """Two quotients x * RN(1/d) rounded at once give lowprec's E2M1 codes of RN(x / d) at
    nibbles e and e + 4 wherever the pair says it is exact (divisors over 2^-60 .. 2^60,
    quotients on and 1-3 ulps from every decision point, every code value, 0 and past
    saturation); nothing else of the word is set; away from decision points (more than
    2^-19 relative, up to 6.5) every quotient is exact, and at random about one pair in
    2^16 is not."""
    rng = np.random.default_rng(16)
    n = 400_000
    d = (rng.uniform(0.5, 2, n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    points = E2M1_POINTS
    a, b = _near_e2m1_points(np.random.default_rng(1), d), _near_e2m1_points(
        np.random.default_rng(2), d)
    recip = (np.float32(1) / d).astype(np.float32)
    assert nm.recip14_usable(recip).all()
    recip14 = (recip * np.float32(nm.E2M1_PAIR_SCALE)).astype(np.float32)
    want_a = nm.rn_e2m1_nibble((a / d).astype(np.float32))
    want_b = nm.rn_e2m1_nibble((b / d).astype(np.float32))
    for slot in range(4):
        word, margin = nm.e2m1_pair_fast(a, b, recip14, slot)
        exact = margin >= nm.E2M1_PAIR_MARGIN
        low = (word >> np.uint32(4 * slot)) & np.uint32(0xF)
        high = (word >> np.uint32(4 * slot + 16)) & np.uint32(0xF)
        assert not (word & ~np.uint32((0xF << 4 * slot) | (0xF << (4 * slot + 16)))).any()
        assert np.array_equal(low[exact], want_a[exact])
        assert np.array_equal(high[exact], want_b[exact])
    quotients = np.abs(np.stack([a, b]) / d)
    far = (np.min(np.abs(quotients[..., None] - points[:7]), axis=-1) > 2.0**-19 * quotients)
    far &= quotients < 6.5  # above, patterns like 7's ask for the division (a block's
    assert exact[far.all(axis=0)].all()  # quotients stay below 6 * 17 / 16)
    assert 0.3 < exact.mean() < 0.95  # both paths are exercised
    x, y = rng.standard_normal((2, n)).astype(np.float32)
    _, margin = nm.e2m1_pair_fast(x, y, np.float32(np.float32(1 / 0.37) * 2.0**-14), 0)
    assert 0 < (margin < nm.E2M1_PAIR_MARGIN).mean() < 2.0**-15  # pairs
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)  # E2M1's values: never divided
    _, margin = nm.e2m1_pair_fast(grid, -grid, np.float32(2.0**-14), 1)
    assert (margin >= nm.E2M1_PAIR_MARGIN).all()
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, 3e38, -1e-30], np.float32)
    word, margin = nm.e2m1_pair_fast(special, np.float32(1.5), np.float32(0.75 * 2.0**-14), 0)
    assert (margin >= nm.E2M1_PAIR_MARGIN).all()
    # +-inf and large saturate to +-6, +-0 keep their sign, tiny quotients round to +-0
    assert list(word & np.uint32(0xF)) == [7, 15, 0, 8, 0, 7, 8]
    assert list(word >> np.uint32(16)) == [2] * 7  # 1.125: 1
    assert list(nm.recip14_usable(np.array([2.0**-111, 2.0**-112, 2.0**125, 2.0**126, np.nan],
                                           np.float32))) == [True, False, True, False, False]


def test_e4m3_values_are_exact_for_every_scale_byte():
    """Every non-negative, non-NaN E4M3 byte decodes to lowprec's value (0x01 = 2^-9,
    0x7E = 448)."""
    b = np.arange(0x7F, dtype=np.uint32)
    want = q.decode_bits(torch.from_numpy(b.astype(np.int64)), E4M3).numpy()
    assert np.array_equal(want.view(np.uint32), nm.e4m3_value(b).view(np.uint32))


def test_saturate_f32_maps_only_infinities():
    x = np.array([np.inf, -np.inf, 1.0, -0.0, 3.4e38], np.float32)
    got = nm.saturate_f32(x)
    want = q.round_to(torch.from_numpy(x.copy()), q.formats.FP32).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# --------------------------------------------------------------------------------------------
# the probe kernel: every function applied element-wise on the device


OUTPUTS = (
    "sr_fp16",
    "rn_fp16",
    "rn_fp16x2",
    "rn_e4m3",
    "rn_e2m1",
    "philox",
    "div_rn",
    "e4m3_value",
    "sr_fp16_fast",  # bits | exact << 16
    "philox_w3",  # the last of the four words (the first is "philox")
    "sr_fp16x2_fast",  # SR of (x, y) with words (w, w ^ 0x9E3779B9) where exact, else 0
    "sr_fp16x2_exact",  # 1 where exact
    "e2m1_pair",  # nibbles 3 and 7 of (x, y) * PROBE_RECIP14
    "e2m1_pair_margin",  # exact where >= E2M1_PAIR_MARGIN
    "bf16x3_hi",  # tensor_core.split_bf16x3(x, y): three bf16x2 words
    "bf16x3_mid",
    "bf16x3_lo",
    "sr_fp16_k13",  # sr_fp16_bits with the 13-bit draw r & 0x1FFF
    "sr_fp16x2_k8",  # sr_fp16x2_lanes of (x, y), lanes 2 and 3 of w, 8 bits, where exact
    "philox_r7_w2",  # word 2 of Philox-4x32-7
)
PROBE_RECIP14 = float(np.float32(np.float32(1 / 0.37) * np.float32(2.0**-14)))


@cute.kernel
def _probe_kernel(
    x: cute.Tensor,
    y: cute.Tensor,
    words: cute.Tensor,
    out: cute.Tensor,
    seed_lo: Uint32,
    seed_hi: Uint32,
    n: Int32,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < n:
        v = x[i]
        r = words[i]
        keys = nm.philox_keys(seed_lo, seed_hi)
        out[i, 0] = nm.sr_fp16_bits(v, r, 32)
        out[i, 1] = nm.rn_fp16_bits(v)
        out[i, 2] = nm.rn_fp16x2(v, y[i])
        out[i, 3] = nm.rn_e4m3_byte(v)
        out[i, 4] = nm.rn_e2m1_nibble(v)
        out[i, 5] = nm.philox_word(r, nm.f32_bits(y[i]), keys)
        out[i, 6] = nm.f32_bits(nm.div_rn(v, y[i]))
        out[i, 7] = nm.f32_bits(nm.e4m3_value(r & Uint32(0x7F)))
        fast, exact = nm.sr_fp16_bits_fast(v, r)
        out[i, 8] = fast | (nm._sel(exact, Uint32(1), Uint32(0)) << Uint32(16))
        out[i, 9] = nm.philox_words(r, nm.f32_bits(y[i]), keys)[3]
        pair, exact = nm.sr_fp16x2_fast(v, y[i], r, r ^ Uint32(0x9E3779B9))
        out[i, 10] = nm._sel(exact, pair, Uint32(0))
        out[i, 11] = nm._sel(exact, Uint32(1), Uint32(0))
        word, margin = nm.e2m1_pair_fast(v, y[i], Float32(PROBE_RECIP14), 3)
        out[i, 12] = word
        out[i, 13] = margin
        for k, part in enumerate(tc.split_bf16x3(v, y[i])):
            out[i, 14 + k] = part
        out[i, 17] = nm.sr_fp16_bits(v, r & Uint32(0x1FFF), 13)
        pair, exact = nm.sr_fp16x2_lanes(v, y[i], r, r, 2, 3, 8)
        out[i, 18] = nm._sel(exact, pair, Uint32(0))
        keys7 = nm.philox_keys(seed_lo, seed_hi, 7)
        out[i, 19] = nm.philox_words(r, nm.f32_bits(y[i]), keys7)[2]


@cute.jit
def _probe_host(
    p_x: cute.Pointer,
    p_y: cute.Pointer,
    p_words: cute.Pointer,
    p_out: cute.Pointer,
    seed_lo: Uint32,
    seed_hi: Uint32,
    n: Int32,
    stream,
):
    x = cute.make_tensor(p_x, cute.make_layout(n))
    y = cute.make_tensor(p_y, cute.make_layout(n))
    words = cute.make_tensor(p_words, cute.make_layout(n))
    out = cute.make_tensor(p_out, cute.make_layout((n, len(OUTPUTS)), stride=(len(OUTPUTS), 1)))
    _probe_kernel(x, y, words, out, seed_lo, seed_hi, n).launch(
        grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream
    )


def _compile_probe(keep_ptx=False):
    def build():
        f = _compile.fake_ptr
        args = (
            f(Float32),
            f(Float32),
            f(Uint32),
            f(Uint32),
            Uint32(0),
            Uint32(0),
            Int32(0),
            _compile.fake_stream(),
        )
        return cute.compile(_probe_host, *args, options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("numerics_probe", keep_ptx), build)


def test_probe_compiles_for_sm90a_with_the_contract_instructions():
    """The PTX uses div.rn.f32 (never div.approx or rcp), the satfinite packed fp16
    conversion and 32-bit high multiplies for Philox; no local memory."""
    ptx = _compile_probe(keep_ptx=True).__ptx__
    assert ".target sm_90a" in ptx
    assert "div.rn.f32" in ptx
    assert "div.approx" not in ptx and "div.full" not in ptx and "rcp." not in ptx
    assert "cvt.rn.satfinite.f16x2.f32" in ptx
    assert "cvt.rz.satfinite.f16x2.f32" in ptx  # the paired SR's truncation
    assert "mul.hi.u32" in ptx or "mul.wide.u32" in ptx
    assert ".local" not in ptx


def _split_bf16x3(x, y):
    """tensor_core.split_bf16x3's three bf16x2 words on the CPU (each part the RN bf16, by
    torch, of what the previous parts left; x's in bits 0-15, y's in bits 16-31), and where
    every part is a number (no NaN, whose payload the device may pick otherwise: inf - inf,
    or a value that rounds to a bf16 inf)."""
    rests = [torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))]
    words, numbers = [], np.ones(x.shape, dtype=bool)
    for _ in range(3):
        parts = [r.to(torch.bfloat16) for r in rests]
        bits = [p.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) for p in parts]
        words.append(bits[0] | (bits[1] << np.uint32(16)))
        numbers &= ~(parts[0].isnan() | parts[1].isnan()).numpy()
        rests = [r - p.float() for r, p in zip(rests, parts, strict=True)]
    return words, numbers


@pytest.mark.gpu
def test_probe_kernel_equals_numpy_backend_and_lowprec():
    """On the device every function equals the numpy backend bit for bit (which the CPU
    tests tie to lowprec), and div_rn equals torch's correctly rounded fp32 division."""
    rng = np.random.default_rng(3)
    x = X
    y = np.where(rng.random(x.size) < 0.5, x[::-1], rng.standard_normal(x.size)).astype(np.float32)
    words = rng.integers(0, 1 << 32, x.size, dtype=np.uint64).astype(np.uint32)
    words[: x.size // 8] = 0  # rounds up whenever anything is discarded
    dev = torch.device("cuda")
    tx, ty = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
    tw = torch.from_numpy(words.view(np.int32)).to(dev)
    out = torch.full((x.size, len(OUTPUTS)), -1, dtype=torch.int32, device=dev)
    kernel = _compile_probe()
    ptr = _compile.gmem_ptr
    kernel(
        ptr(tx),
        ptr(ty),
        ptr(tw, Uint32),
        ptr(out, Uint32),
        Uint32(SEED & 0xFFFFFFFF),
        Uint32(SEED >> 32),
        Int32(x.size),
        _compile.current_stream(),
    )
    torch.cuda.synchronize()
    got = out.cpu().numpy().view(np.uint32)
    keys = nm.philox_keys(np.uint32(SEED & 0xFFFFFFFF), np.uint32(SEED >> 32))
    with np.errstate(all="ignore"):
        want = {
            "sr_fp16": nm.sr_fp16_bits(x, words, 32),
            "rn_fp16": nm.rn_fp16_bits(x),
            "rn_fp16x2": nm.rn_fp16x2(x, y),
            "rn_e4m3": nm.rn_e4m3_byte(x),
            "rn_e2m1": nm.rn_e2m1_nibble(x),
            "philox": nm.philox_word(words, y.view(np.uint32), keys),
            "div_rn": (x / y).astype(np.float32).view(np.uint32),  # IEEE, correctly rounded
            "e4m3_value": nm.e4m3_value(words & np.uint32(0x7F)).view(np.uint32),
            "sr_fp16_fast": _flagged(*nm.sr_fp16_bits_fast(x, words), 16),
            "philox_w3": nm.philox_words(words, y.view(np.uint32), keys)[3],
        }
        pair, exact = nm.sr_fp16x2_fast(x, y, words, words ^ np.uint32(0x9E3779B9))
        want["sr_fp16x2_fast"] = np.where(exact, pair, np.uint32(0))
        want["sr_fp16x2_exact"] = exact.astype(np.uint32)
        want["e2m1_pair"], want["e2m1_pair_margin"] = nm.e2m1_pair_fast(
            x, y, np.float32(PROBE_RECIP14), 3)
        parts, numbers = _split_bf16x3(x, y)
        want.update(zip(("bf16x3_hi", "bf16x3_mid", "bf16x3_lo"), parts, strict=True))
        want["sr_fp16_k13"] = nm.sr_fp16_bits(x, words & np.uint32(0x1FFF), 13)
        pair, exact = nm.sr_fp16x2_lanes(x, y, words, words, 2, 3, 8)
        want["sr_fp16x2_k8"] = np.where(exact, pair, np.uint32(0))
        keys7 = nm.philox_keys(np.uint32(SEED & 0xFFFFFFFF), np.uint32(SEED >> 32), 7)
        want["philox_r7_w2"] = nm.philox_words(words, y.view(np.uint32), keys7)[2]
    positive = y.view(np.uint32) < (1 << 31)  # offsets below 2^63 (lowprec takes int64)
    offsets = torch.from_numpy(
        (y[positive].view(np.uint32).astype(np.int64) << 32) | words[positive].astype(np.int64)
    )
    assert np.array_equal(
        want["philox"][positive], philox.randint(SEED, offsets).numpy().astype(np.uint32)
    )
    for k, name in enumerate(OUTPUTS):
        g = got[:, k]
        w = want[name].astype(np.uint32)
        if name == "div_rn":  # NaN payloads may differ; NaN must stay NaN
            nan = np.isnan(g.view(np.float32))
            assert np.array_equal(nan, np.isnan(w.view(np.float32))), name
            g, w = g[~nan], w[~nan]
        if name.startswith("bf16x3"):
            assert numbers.mean() > 0.9
            g, w = g[numbers], w[numbers]
        assert np.array_equal(g, w), f"{name}: " + first_mismatches(x, w, g, words)
