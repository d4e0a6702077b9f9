"""SR with k random bits per element and Philox with R rounds (docs/design.md, "Stochastic
rounding: random bits and Philox rounds"), checked on the CPU against models written here:

- Philox with R rounds: an independent Philox-4x32 on Python ints, itself checked against
  Random123's published known answers for 10 and 7 rounds; the module against it for 10, 7, 4, 2.
- Which bits go to element e: the counter's 128 bits dealt out W to an element, on Python ints.
- The k-bit rule, exhaustively over all 2^k draws for k = 8, 13, 16: the round-up count is
  floor(2^k frac), the draws that round up are exactly r < floor(2^k frac), and the mean over
  all draws is x - sign(x) rho_k ulp (rho_k: frac below its top k bits), from exact rationals.
- The integer form a kernel uses (add a complemented draw to the fp32 bits, truncate).
- A table of special values per k, and the parameters threaded through quantize, policies and
  contract.

Failures print the first mismatches in hex.
"""

import math
from fractions import Fraction

import pytest
import torch

from lowprec import contract, philox, policies
from lowprec import quantize as q

MASK32 = 0xFFFFFFFF
FP16_MAX = 65504.0
FP16_EMIN = -14
FP16_MBITS = 10
SMALL_K = (8, 13, 16)
LANE = {8: 8, 13: 16, 16: 16, 32: 32}  # W: the lane a k-bit draw is the low bits of

# Random123 kat_vectors (philox4x32 lines): rounds, counter[4], key[2] -> output[4]
RANDOM123 = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (MASK32,) * 4, (MASK32,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def reference_philox(counter, key, rounds):
    """Philox-4x32 (Salmon et al. 2011) on Python ints: one S-box pair per round, then the
    Weyl key schedule."""
    x = list(counter)
    k = list(key)
    for _ in range(rounds):
        hi0, lo0 = divmod(0xD2511F53 * x[0], 1 << 32)
        hi1, lo1 = divmod(0xCD9E8D57 * x[2], 1 << 32)
        x = [hi1 ^ x[1] ^ k[0], lo1, hi0 ^ x[3] ^ k[1], lo0]
        k = [(k[0] + 0x9E3779B9) % (1 << 32), (k[1] + 0xBB67AE85) % (1 << 32)]
    return tuple(x)


def reference_draw(seed, slot, flush, e, k, rounds):
    """Element e's k-bit draw: the counter's four words as one 128-bit integer (w0 lowest),
    element e % E taking its bits [W (e % E), W (e % E) + k)."""
    per_counter = 4 * (32 // LANE[k])
    offset = (slot << 44) | (flush << 24) | (e // per_counter)
    words = reference_philox((offset & MASK32, offset >> 32, 0, 0), (seed & MASK32, seed >> 32),
                             rounds)
    string = sum(w << (32 * j) for j, w in enumerate(words))
    return (string >> (LANE[k] * (e % per_counter))) & ((1 << k) - 1)


def fp16_model(x: float, k: int):
    """(down, up, t, rho, ulp) of x's k-bit SR onto fp16, from the definition in exact
    rationals: the two candidates as floats (saturated at 65504, with x's sign, zeros
    included), the round-up threshold t = floor(2^k frac), the part rho of frac below its top
    k bits and the ulp (Fractions)."""
    v = Fraction(x)
    a = abs(v)
    e = FP16_EMIN if a == 0 else max(math.floor(math.log2(a)), FP16_EMIN)
    # log2 of a Fraction can be off by one at a power of two: settle the binade exactly
    while a != 0 and e > FP16_EMIN and Fraction(2) ** e > a:
        e -= 1
    while a != 0 and Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (e - FP16_MBITS)
    m = a / ulp
    fl = math.floor(m)
    frac = m - fl
    t = math.floor(frac * 2**k)
    rho = frac - Fraction(t, 2**k)
    down, up = (math.copysign(float(min(n * ulp, Fraction(FP16_MAX))), x) for n in (fl, fl + 1))
    return down, up, t, rho, ulp


def fp16_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def hex_dump(x, r, got, want, limit=5) -> str:
    """The first mismatches: x's bits, the draw, the fp16 bits stored and expected."""
    x, r, got, want = (t.flatten() for t in (x, r, got, want))
    bad = (got != want).nonzero().flatten()[:limit].tolist()
    xbits = x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int64)
    return "; ".join(f"x={int(xbits[i]) & ((1 << 8 * x.element_size()) - 1):x} r={int(r[i]):x} "
                     f"got {int(got[i]):04x} want {int(want[i]):04x}" for i in bad)


def sweep(x: torch.Tensor, k: int):
    """round_to(x_i, fp16, SR) for every x_i and every k-bit draw r: [len(x), 2^k] each."""
    r = torch.arange(1 << k, dtype=torch.int64).expand(len(x), -1)
    xs = x[:, None].expand(-1, 1 << k)
    return xs, r, q.round_to(xs, "fp16", "sr", r, sr_bits=k)


def random_fp16_range(n: int, seed: int) -> torch.Tensor:
    """fp32 values with random mantissa bits across fp16's normal and subnormal binades."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g, dtype=torch.float64) + 1.0
    ex = torch.randint(-26, 16, (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.pow(2.0, ex.double())).float().clamp(-65000, 65000)


CONSTRUCTED = [
    1.0 + 2**-10,  # on the grid
    1.0 + 2**-10 + 2**-23,  # one fp32 ulp above: frac 2^-13
    1.0 + 2**-10 - 2**-23,  # one fp32 ulp below: frac 1 - 2^-13
    1.0 + 2**-11 + 2**-20 + 2**-23,  # frac 0.5 + 2^-10 + 2^-13: bits below the top 8
    -(3.0 + 5 * 2**-22),  # negative, frac 5 * 2^-13 (below the top 8 bits)
    0.75 * 2**-24,  # fp16 subnormal, frac 0.75
    2**-24 + 2**-40,  # fp16 subnormal, frac 2^-16
    -(5 * 2**-24 + 2**-33 + 2**-45),  # negative subnormal with bits far below
    2**-149,  # the smallest fp32 subnormal: frac 2^-125
    65490.5,  # the top binade, below max
]


# --------------------------------------------------------------------------------------------
# Philox with R rounds


@pytest.mark.parametrize("rounds,counter,key,expected", RANDOM123,
                         ids=[f"r{r}-{i % 3}" for i, (r, *_rest) in enumerate(RANDOM123)])
def test_the_reference_philox_and_the_module_give_random123s_known_answers(rounds, counter,
                                                                           key, expected):
    """Random123's kat_vectors for Philox-4x32 with 7 and 10 rounds, e.g. counter 0 key 0 in 7
    rounds is 5f6fb709 0d893f64 4f121f81 4f730a48."""
    assert reference_philox(counter, key, rounds) == expected
    got = tuple(int(w) for w in philox.philox4x32(*counter, *key, rounds=rounds))
    assert got == expected, [f"{w:08x}" for w in got]


@pytest.mark.parametrize("rounds", [10, 7, 4, 2, 1])
def test_philox_of_r_rounds_equals_the_reference_on_random_counters_and_keys(rounds):
    """Both paths (numpy for CPU tensors, torch ops for GPU tensors) on 61 random counters and
    keys, and randint4x's key and counter from seed and offset, for R rounds."""
    g = torch.Generator().manual_seed(rounds)
    cols = torch.randint(0, 1 << 32, (6, 61), generator=g, dtype=torch.int64)
    want = [reference_philox(tuple(c[:4]), tuple(c[4:]), rounds) for c in cols.T.tolist()]
    numpy_words = torch.stack(philox.philox4x32(*cols, rounds=rounds), -1)
    torch_words = torch.stack(philox._rounds_torch(list(cols[:4]), cols[4], cols[5],
                                                   cols[0].shape, rounds), -1)
    assert numpy_words.tolist() == [list(w) for w in want]
    assert torch_words.tolist() == [list(w) for w in want]
    seed, offsets = 0x1234_5678_9ABC_DEF0, torch.tensor([0, 5, -1, (3 << 44) | 77])
    four = torch.stack(philox.randint4x(seed, offsets, rounds), -1).tolist()
    patterns = [o & ((1 << 64) - 1) for o in offsets.tolist()]
    assert four == [list(reference_philox((p & MASK32, p >> 32, 0, 0),
                                          (seed & MASK32, seed >> 32), rounds))
                    for p in patterns]
    assert philox.randint(seed, offsets, rounds).tolist() == [w[0] for w in four]


def test_the_defaults_are_16_bits_7_rounds_and_other_rounds_give_other_words():
    """random_words' defaults are (16, 7), the module's DEFAULT_*; the reference (32, 10) are
    whole words of randint4x at 10 rounds (tl.randint4x's); 16-bit draws of other rounds differ
    almost everywhere (two 16-bit draws agree with probability 2^-16)."""
    assert (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS) == (16, 7)
    assert (philox.REFERENCE_SR_BITS, philox.REFERENCE_PHILOX_ROUNDS) == (32, 10)
    shape = (3, 5, 7)
    default = philox.random_words(11, 4, 9, shape)
    assert torch.equal(default, philox.random_words(11, 4, 9, shape, sr_bits=16,
                                                    philox_rounds=7))
    reference = philox.random_words(11, 4, 9, shape, sr_bits=32, philox_rounds=10)
    counters = (4 << 44) | (9 << 24) | torch.arange(27)  # 105 elements, 4 a counter
    words = torch.stack(philox.randint4x(11, counters), -1).flatten()[:105]
    assert torch.equal(reference.flatten(), words)
    for rounds in (10, 4, 2):
        other = philox.random_words(11, 4, 9, shape, philox_rounds=rounds)
        assert (other != default).float().mean() > 0.99


# --------------------------------------------------------------------------------------------
# which bits go to element e


@pytest.mark.parametrize("rounds", [10, 7, 4])
@pytest.mark.parametrize("k", philox.SR_BITS)
def test_element_e_takes_the_low_k_bits_of_its_lane_of_its_counter(k, rounds):
    """An odd state (3, 5, 7) = 105 elements (not a multiple of any E), three slots with the
    top field bits set: every draw equals the 128-bit-string model."""
    seed, shape = 0xFEED_0000_0000_0042, (3, 5, 7)
    slots, flushes = [0, 2**19 + 3, 2**20 - 1], [5, 0, 2**20 - 1]
    got = philox.random_words(seed, torch.tensor(slots), torch.tensor(flushes), shape,
                              sr_bits=k, philox_rounds=rounds)
    assert got.shape == (3, *shape) and int(got.max()) < 1 << k
    want = [[reference_draw(seed, s, f, e, k, rounds) for e in range(105)]
            for s, f in zip(slots, flushes, strict=True)]
    flat = got.reshape(3, 105).tolist()
    first = [(i, e, f"{flat[i][e]:x}", f"{want[i][e]:x}") for i in range(3) for e in range(105)
             if flat[i][e] != want[i][e]][:5]
    assert flat == want, f"(slot row, element, got, want) {first}"
    per_counter = philox.elements_per_counter(k)
    offsets = philox.state_offsets(torch.tensor(slots), torch.tensor(flushes), shape, sr_bits=k)
    e = torch.arange(105).reshape(shape)
    assert torch.equal(offsets[1] & ((1 << 24) - 1), e // per_counter)


def test_the_13_bit_draw_is_the_16_bit_draw_masked_and_8_bit_lanes_tile_the_word():
    """k = 13 takes the lane of k = 16 (low 13 bits); four 8-bit draws of a word rebuild it,
    as two 16-bit draws and one 32-bit word of the same counter do (randint4x's words at the
    default 7 rounds; at 10 rounds the 32-bit draws are tl.randint4x's words whole)."""
    shape = (2, 3, 16)  # 96 elements: 6 counters at k = 8, 12 at k = 16
    d16 = philox.random_words(3, 1, 2, shape, sr_bits=16)
    assert torch.equal(philox.random_words(3, 1, 2, shape, sr_bits=13), d16 & 0x1FFF)
    d8 = philox.random_words(3, 1, 2, shape, sr_bits=8).flatten()
    words8 = (d8.reshape(-1, 4) << torch.tensor([0, 8, 16, 24])).sum(-1)  # 24 words
    counters = philox.randint4x(3, (1 << 44) | (2 << 24) | torch.arange(6), 7)
    assert torch.equal(words8, torch.stack(counters, -1).flatten())
    words16 = (d16.flatten().reshape(-1, 2) << torch.tensor([0, 16])).sum(-1)  # 48 words
    counters16 = philox.randint4x(3, (1 << 44) | (2 << 24) | torch.arange(12), 7)
    assert torch.equal(words16, torch.stack(counters16, -1).flatten())
    d32 = philox.random_words(3, 1, 2, shape, sr_bits=32, philox_rounds=10).flatten()
    counters32 = philox.randint4x(3, (1 << 44) | (2 << 24) | torch.arange(24))
    assert torch.equal(d32, torch.stack(counters32, -1).flatten())


@pytest.mark.parametrize("k", philox.SR_BITS)
def test_each_draw_bit_is_set_half_the_time(k):
    """2^15 elements: each of the k bits set with frequency 1/2 within 5 std (5 / 2 / 181)."""
    draws = philox.random_words(5, 3, 11, (128, 256), sr_bits=k)
    bits = (draws[..., None] >> torch.arange(k)) & 1
    assert bool(((bits.double().mean(dim=(0, 1)) - 0.5).abs() < 5 / 362).all())


# --------------------------------------------------------------------------------------------
# the k-bit rule, exhaustively


@pytest.mark.parametrize("k", SMALL_K)
def test_round_up_count_over_all_draws_is_floor_2k_frac_and_the_rule_is_r_below_t(k):
    """For each x (constructed neighbours, subnormals, and random fp32 over fp16's range), all
    2^k draws: the draws that round up are exactly r < t = floor(2^k frac) (so their count is
    t), and every result is one of the two exact candidates, bit for bit."""
    xs = torch.cat([torch.tensor(CONSTRUCTED, dtype=torch.float32),
                    random_fp16_range(14, seed=k)])
    x, r, got = sweep(xs, k)
    models = [fp16_model(float(v), k) for v in xs.tolist()]
    t = torch.tensor([m[2] for m in models])[:, None]
    down = torch.tensor([m[0] for m in models], dtype=torch.float64)[:, None]
    up = torch.tensor([m[1] for m in models], dtype=torch.float64)[:, None]
    want = torch.where(r < t, up, down).expand_as(got)
    got_bits, want_bits = fp16_bits(got), fp16_bits(want)
    assert torch.equal(got_bits, want_bits), hex_dump(x, r, got_bits, want_bits)
    counts = (got.double() != down).sum(dim=1)
    moved = down[:, 0] != up[:, 0]
    assert torch.equal(counts[moved], t[moved, 0]), (counts.tolist(), t[:, 0].tolist())


@pytest.mark.parametrize("k", SMALL_K)
def test_mean_over_all_draws_is_x_minus_its_fraction_below_the_top_k_bits(k):
    """E[SR_k(x)] - x = -sign(x) rho_k ulp, rho_k in [0, 2^-k), zero when frac has no bits below
    its top k: exact rationals from the results of all 2^k draws. Worked numbers: x = 1 + 2^-10
    + 2^-23 has frac 2^-13, so k = 8 never rounds up (bias -2^-13 ulp) and k = 13, 16 are
    unbiased; an fp64 x = 1 + 2^-10 (0.5 + 2^-20) has bits below 16 for every k here."""
    fp32 = [v for v in CONSTRUCTED if abs(v) < FP16_MAX] + random_fp16_range(6, 40 + k).tolist()
    fp64 = [1.0 + 2**-10 * (0.5 + 2**-20), -(2.0 + 2**-9 * (0.25 + 2**-30)),
            2**-24 * (0.5 + 2**-17 + 2**-40)]
    for dtype, values in ((torch.float32, fp32), (torch.float64, fp64)):
        xs = torch.tensor(values, dtype=dtype)
        _, _, got = sweep(xs, k)
        for value, row in zip(xs.tolist(), got, strict=True):
            _, _, t, rho, ulp = fp16_model(value, k)
            results, counts = row.double().unique(return_counts=True)
            mean = sum(Fraction(v) * c for v, c in zip(results.tolist(), counts.tolist(),
                                                       strict=True)) / 2**k
            sign = -1 if value < 0 else 1
            bias = mean - Fraction(value)
            assert bias == -sign * rho * ulp, (value.hex(), k, bias, rho)
            assert 0 <= rho < Fraction(1, 2**k)
            if (Fraction(value) / ulp * 2**k).denominator == 1:
                assert bias == 0, value.hex()


def test_k_at_least_the_dropped_width_is_unbiased_and_8_bits_keep_the_low_5_bits_as_bias():
    """FP16 from FP32 drops d = 13 bits in fp16's normal range: for k = 13 and 16 the mean of
    all draws is x exactly; for k = 8 the bias is -(low 5 dropped bits) 2^-13 ulp."""
    xs = random_fp16_range(40, seed=99)
    xs = xs[(xs.abs() >= 2**-14)][:12]
    bits = xs.view(torch.int32).to(torch.int64)
    exponent = ((bits >> 23) & 0xFF) - 127
    ulp = torch.pow(2.0, (exponent - 10).double())
    for k in (13, 16, 8):
        _, _, got = sweep(xs, k)
        bias = got.double().mean(dim=1) - xs.double()  # exact: 2^k grid values near x
        want = torch.zeros_like(bias) if k != 8 else (
            -torch.sign(xs.double()) * (bits & 0x1F).double() * 2.0**-13 * ulp)
        assert torch.equal(bias, want), (k, bias.tolist(), want.tolist())


def test_32_bit_draws_round_up_exactly_below_the_threshold():
    """k = 32 (2^32 draws cannot be enumerated): r = t - 1 rounds up, r = t and r = 2^32 - 1 do
    not, with t = floor(2^32 frac), for the constructed values (frac 2^-13: t = 2^19)."""
    xs = torch.tensor([v for v in CONSTRUCTED if abs(v) < FP16_MAX], dtype=torch.float32)
    for value in xs.tolist():
        down, up, t, _, _ = fp16_model(value, 32)
        draws = torch.tensor([max(t - 1, 0), t, MASK32])
        got = q.round_to(torch.full((3,), value), "fp16", "sr", draws, sr_bits=32)
        got = got.double().tolist()
        want = [up if t > 0 else down, down, down]
        assert got == want, (value.hex(), t, got, want)


# --------------------------------------------------------------------------------------------
# the integer form a kernel uses


def integer_sr(x: torch.Tensor, r: torch.Tensor, k: int) -> torch.Tensor:
    """SR_k onto fp16 for fp32 x in fp16's normal range as a kernel does it: add the
    complemented draw, shifted into the 13 dropped bits, to x's bits, then truncate them."""
    b = x.view(torch.int32).to(torch.int64) & MASK32
    c = ~r & ((1 << k) - 1)
    add = c << (13 - k) if k <= 13 else c >> (k - 13)
    truncated = ((b + add) & ~0x1FFF) & MASK32
    return torch.where(truncated >= 1 << 31, truncated - (1 << 32), truncated).to(
        torch.int32).view(torch.float32)


@pytest.mark.parametrize("k", [8, 13, 16, 32])
def test_adding_the_complemented_draw_to_the_fp32_bits_and_truncating_is_the_rule(k):
    """docs/design.md's integer form (k = 32: ~w >> 19; 16: (~L & 0xFFFF) >> 3; 13: ~L & 0x1FFF;
    8: (~L & 0xFF) << 5) equals round_to for all draws (k <= 16) or 2^16 random ones (k = 32),
    on random fp32 values in [2^-14, 65504) of both signs."""
    xs = random_fp16_range(64, seed=7 + k)
    xs = xs[(xs.abs() >= 2**-14) & (xs.abs() < 65472)][:10]
    if k <= 16:
        x, r, want = sweep(xs, k)
    else:
        g = torch.Generator().manual_seed(k)
        r = torch.randint(0, 1 << 32, (len(xs), 1 << 16), generator=g, dtype=torch.int64)
        x = xs[:, None].expand_as(r)
        want = q.round_to(x, "fp16", "sr", r, sr_bits=k)
    got = integer_sr(x.contiguous(), r, k)
    got_bits, want_bits = fp16_bits(got), fp16_bits(want)
    assert torch.equal(got_bits, want_bits), hex_dump(x, r, got_bits, want_bits)


# --------------------------------------------------------------------------------------------
# special values


SPECIAL = [
    # name, x, {k: round-up count over all 2^k draws} or a fixed result for every draw
    ("grid point 1 + 2^-10", 1.0 + 2**-10, {8: 0, 13: 0, 16: 0}),
    ("one fp32 ulp above a grid point", 1.0 + 2**-10 + 2**-23, {8: 0, 13: 1, 16: 8}),
    ("one fp32 ulp below a grid point", 1.0 + 2**-10 - 2**-23, {8: 255, 13: 8191, 16: 65528}),
    ("fp16 subnormal 0.75 * 2^-24", 0.75 * 2**-24, {8: 192, 13: 6144, 16: 49152}),
    ("fp16 subnormal 2^-24 + 2^-40", 2**-24 + 2**-40, {8: 0, 13: 0, 16: 1}),
    ("smallest fp32 subnormal", 2**-149, {8: 0, 13: 0, 16: 0}),
    ("largest fp16 subnormal + 2^-30", 1023 * 2**-24 + 2**-30, {8: 4, 13: 128, 16: 1024}),
    ("halfway past fp16 max", 65520.0, 65504.0),
    ("far past fp16 max", 1e6, 65504.0),
    ("+inf", math.inf, 65504.0),
    ("-inf", -math.inf, -65504.0),
    ("+0", 0.0, 0.0),
    ("-0", -0.0, -0.0),
    ("NaN", math.nan, math.nan),
]


@pytest.mark.parametrize("name,x,expected", SPECIAL, ids=[s[0] for s in SPECIAL])
@pytest.mark.parametrize("k", SMALL_K)
def test_special_values_round_as_the_table_says_for_every_draw(k, name, x, expected):
    """Per k, either the number of the 2^k draws that round up (away from zero by one fp16
    ulp) or the one result every draw gives (saturation at 65504, signed zeros, NaN)."""
    xs, r, got = sweep(torch.tensor([x], dtype=torch.float32), k)
    if isinstance(expected, dict):
        down = fp16_model(x, k)[0]
        count = int((got.double() != down).sum())
        assert count == expected[k], f"{name}: {count} of 2^{k} round up, want {expected[k]}"
        return
    want = torch.full_like(got, expected)
    got_bits, want_bits = fp16_bits(got), fp16_bits(want)
    if math.isnan(expected):
        assert bool(got.isnan().all()), name
    else:
        assert torch.equal(got_bits, want_bits), f"{name}: " + hex_dump(xs, r, got_bits,
                                                                        want_bits)


# --------------------------------------------------------------------------------------------
# the parameters threaded through quantize, policies and contract


@pytest.mark.parametrize("k,rounds", [(32, 10), (16, 7), (13, 10), (8, 4)])
def test_seed_path_policy_and_contract_use_the_draws_of_random_words(k, rounds):
    """round_to(seed=), quantize(seed=) of a block format, Policy.write_copies and
    contract.flush_copies all take random_words(..., sr_bits=k, philox_rounds=R) for a
    [3, 2, 5, 16] state of random values; the default (16, 7) is the contract's without
    arguments and gives other codes than the other settings."""
    g = torch.Generator().manual_seed(k + rounds)
    state = torch.randn(3, 2, 5, 16, generator=g) * 3
    slots, flushes = torch.tensor([4, 0, 9]), torch.tensor([2, 7, 0])
    draws = philox.random_words(21, slots, flushes, (2, 5, 16), sr_bits=k, philox_rounds=rounds)
    want = q.round_to(state, "fp16", "sr", draws, sr_bits=k)
    kwargs = {"sr_bits": k, "philox_rounds": rounds}
    got = q.round_to(state, "fp16", "sr", seed=21, slot=slots, flush=flushes, **kwargs)
    assert torch.equal(got, want)
    block = q.quantize(state, "fp4_e2m1_b16", "sr", seed=21, slot=slots, flush=flushes, **kwargs)
    assert torch.equal(block.elements,
                       q.quantize(state, "fp4_e2m1_b16", "sr", draws, sr_bits=k).elements)
    policy = policies.make_policy("separate_fp16sr", "nvfp4", seed=21, **kwargs)
    assert (policy.sr_bits, policy.philox_rounds) == (k, rounds)
    hi, _ = policy.write_copies(state.double(), slots, flushes)
    assert torch.equal(hi, q.round_to(state.double(), "fp16", "sr", philox.random_words(
        21, slots, flushes, (2, 5, 16), **kwargs), sr_bits=k))
    copies = contract.flush_copies(state, seed=21, slots=slots, flushes=flushes, **kwargs)
    assert torch.equal(copies["hi"].to(torch.int64), fp16_bits(want))
    default = contract.flush_copies(state, seed=21, slots=slots, flushes=flushes)
    assert torch.equal(copies["hi"], default["hi"]) == ((k, rounds) == (16, 7))
    assert torch.equal(copies["lo.codes"], default["lo.codes"])  # the read copy is RN


@pytest.mark.parametrize("call, message", [
    (lambda: philox.random_words(0, 0, 0, (4,), sr_bits=12),
     r"sr_bits: expected random bits per element in \[8, 13, 16, 32\], got 12"),
    (lambda: philox.random_words(0, 0, 0, (4,), sr_bits=16.0), r"sr_bits: .*got 16.0"),
    (lambda: philox.random_words(0, 0, 0, (4,), sr_bits=True), r"sr_bits: .*got True"),
    (lambda: philox.random_words(0, 0, 0, (4,), philox_rounds=0),
     r"philox_rounds: expected Philox rounds in \[1, 10\], got 0"),
    (lambda: philox.random_words(0, 0, 0, (4,), philox_rounds=11), r"philox_rounds: .*got 11"),
    (lambda: philox.randint4x(0, torch.zeros(2, dtype=torch.int64), 12), r"n_rounds: .*got 12"),
    (lambda: philox.philox4x32(0, 0, 0, 0, 0, 0, rounds=-1), r"rounds: .*got -1"),
    (lambda: philox.state_offsets(0, 0, (4,), sr_bits=4), r"sr_bits: .*got 4"),
    (lambda: q.round_to(torch.ones(3), "fp16", "sr", seed=1, sr_bits=24), r"sr_bits: .*got 24"),
    (lambda: q.round_to(torch.ones(3), "fp16", "rn", sr_bits=32),
     r"sr_bits: expected the default 16 for rounding='rn' \(only SR draws bits\), got 32"),
    (lambda: q.round_to(torch.ones(3), "fp16", "sr", torch.zeros(3, dtype=torch.int64),
                        philox_rounds=10),
     r"philox_rounds: expected the default 7 without seed= \(rand is drawn already; pass "
     r"seed=\), got 10"),
    (lambda: q.round_to(torch.ones(3), "fp16", "sr", torch.tensor([0, 1, 256]), sr_bits=8),
     r"rand: expected 8-bit draws \(sr_bits=8\) in \[0, 2\^8\), got range \[0, 256\]"),
    (lambda: q.quantize(torch.ones(2, 16), "fp4_e2m1_b16", "sr", seed=1, philox_rounds=0),
     r"philox_rounds: .*got 0"),
    (lambda: q.fake_quantize(torch.ones(2, 16), "nvfp4", "rn", philox_rounds=4),
     r"philox_rounds: expected the default 7 without seed= \(only SR draws words\), got 4"),
    (lambda: policies.Policy("shared", "fp16", "sr", sr_bits=9), r"sr_bits: .*got 9"),
    (lambda: policies.Policy("shared", "fp16", "rn", sr_bits=32),
     r"sr_bits: expected the default 16 for kind 'shared' with rounding 'rn' .*got 32"),
    (lambda: policies.Policy("exact", philox_rounds=10),
     r"philox_rounds: expected the default 7 for kind 'exact' \(nothing is rounded\), got 10"),
    (lambda: policies.make_policy("separate_fp16sr", "nvfp4", philox_rounds=0),
     r"philox_rounds: .*got 0"),
    (lambda: contract.flush_copies(torch.ones(1, 1, 2, 16), sr_bits=7), r"sr_bits: .*got 7"),
    (lambda: contract.flush_copies(torch.ones(1, 1, 2, 16), hi_rounding="rn", philox_rounds=10),
     r"philox_rounds: expected the default 7 with hi_rounding='rn' .*got 10"),
])
def test_unsupported_sr_settings_are_refused_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_make_policy_drops_sr_settings_of_an_arm_without_sr():
    """As it drops the seed: every arm takes the same arguments, and only an SR copy uses them
    (an invalid value is still refused, above)."""
    policy = policies.make_policy("separate_exact", "nvfp4", seed=5, sr_bits=8, philox_rounds=4)
    assert (policy.seed, policy.sr_bits, policy.philox_rounds) == (0, 16, 7)
    sr = policies.make_policy("every_step", "fp16", "sr", seed=5, sr_bits=8, philox_rounds=4)
    assert (sr.seed, sr.sr_bits, sr.philox_rounds) == (5, 8, 4)
