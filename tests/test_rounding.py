"""Element rounding (README.md "Element formats"): RN against the libraries, SR exhaustively.

RN is checked bit for bit against numpy/ml_dtypes and torch casts over every code of each
format, every midpoint between neighbours and the fp32 neighbours of both, and against an
exact rational oracle for fp64 inputs (ml_dtypes converts fp64 to fp8/fp4 through fp32, a
double rounding, so it cannot be the oracle there). Saturation, NaN and signed zeros are
checked separately because the libraries overflow to inf/NaN where the contract saturates.

SR is checked with whole 32-bit words (sr_bits=32, the reference setting) by exhaustive sweeps
over the random word's high bits (the round-up count is the discarded fraction exactly), by
exact thresholds for fp64 inputs and by a table of special values; a statistical unbiasedness
test runs it and the default 16-bit draws. Fewer random bits: tests/test_sr_bits.py.
"""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from lowprec import philox
from lowprec.formats import BF16, E2M1, E4M3, E5M2, FP16, FP32, FP64
from lowprec.quantize import round_to

NARROW = [FP16, BF16, E4M3, E5M2, E2M1]
ML_DTYPE = {
    FP16: np.float16,
    BF16: ml_dtypes.bfloat16,
    E4M3: ml_dtypes.float8_e4m3fn,
    E5M2: ml_dtypes.float8_e5m2,
    E2M1: ml_dtypes.float4_e2m1fn,
}
TORCH_DTYPE = {
    FP16: torch.float16,
    BF16: torch.bfloat16,
    E4M3: torch.float8_e4m3fn,
    E5M2: torch.float8_e5m2,
}
UINT = {4: np.uint8, 8: np.uint8, 16: np.uint16}
TWO32 = 1 << 32
ids = [e.name for e in NARROW]


def codes_and_values(element):
    """(codes, values as float64) of every code of `element`, from ml_dtypes."""
    codes = np.arange(1 << element.bits, dtype=UINT[element.bits])
    with np.errstate(invalid="ignore"):  # NaN codes convert to NaN, with a warning
        return codes, codes.view(ML_DTYPE[element]).astype(np.float64)


def finite_grid(element) -> np.ndarray:
    """Sorted distinct finite values of `element` (zero once), float64."""
    _, values = codes_and_values(element)
    return np.unique(values[np.isfinite(values)])


def top_half_ulp(element) -> float:
    return math.ldexp(1.0, element.emax - element.mbits - 1)


def library_bits(x: np.ndarray, element) -> np.ndarray:
    return x.astype(ML_DTYPE[element]).view(UINT[element.bits]).astype(np.int64)


def our_bits(x: np.ndarray, element, rounding="rn", rand=None) -> np.ndarray:
    q = round_to(torch.from_numpy(x), element, rounding, rand).numpy()
    return library_bits(q, element)  # exact: q is on the grid


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str):
    """Equal values and signs (NaN matches NaN); on failure, hex of the first mismatches."""
    same = (actual == expected) & (actual.signbit() == expected.signbit())
    same |= actual.isnan() & expected.isnan()
    if not bool(same.all()):
        bad = (~same).nonzero()[:5]
        rows = [
            f"  at {tuple(i.tolist())}: got {actual[tuple(i)].item().hex()}, "
            f"expected {expected[tuple(i)].item().hex()}"
            for i in bad
        ]
        pytest.fail(f"{what}: {int((~same).sum())} mismatches\n" + "\n".join(rows))


def rn_probes_fp32(element) -> np.ndarray:
    """Every grid value, every midpoint and the fp32 neighbours of both, both signs."""
    grid = finite_grid(element)
    points = np.concatenate([grid, (grid[:-1] + grid[1:]) / 2])
    points32 = points.astype(np.float32)
    assert np.array_equal(points32.astype(np.float64), points)  # midpoints are exact in fp32
    probes = np.concatenate(
        [points32, np.nextafter(points32, np.float32(np.inf)), np.nextafter(points32, -np.inf)]
    )
    return np.unique(np.concatenate([probes, -probes]))


# --------------------------------------------------------------------------------------------
# RN


@pytest.mark.parametrize("element", NARROW, ids=ids)
def test_rn_of_fp32_matches_ml_dtypes_on_every_code_midpoint_and_neighbour(element):
    x = rn_probes_fp32(element)
    x = x[np.abs(x) < element.max_finite + top_half_ulp(element)]  # libraries saturate below
    np.testing.assert_array_equal(our_bits(x, element), library_bits(x, element))


@pytest.mark.parametrize("element", [e for e in NARROW if e in TORCH_DTYPE], ids=lambda e: e.name)
def test_rn_of_fp32_matches_torch_casts(element):
    x = torch.from_numpy(rn_probes_fp32(element))
    x = x[x.abs() < element.max_finite + top_half_ulp(element)]
    expected = x.to(TORCH_DTYPE[element]).to(torch.float32)
    assert_same(round_to(x, element), expected, f"RN {element.name}")


def test_rn_of_fp64_to_fp32_matches_torch_cast_including_subnormals():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(20011, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-160, 120, x.shape, generator=g).double())
    x = torch.cat([x, x.float().double().nextafter(torch.tensor(math.inf, dtype=torch.float64))])
    assert_same(round_to(x, FP32), x.float().double(), "RN fp64 -> fp32")


def exact_rn(a: float, element, grid: np.ndarray, even: dict) -> float:
    """RN (ties to the even code), saturating, by exact rational comparison with the grid."""
    mag = abs(a)
    if mag >= element.max_finite:
        return math.copysign(element.max_finite, a)
    i = int(np.searchsorted(grid, mag))  # grid[i - 1] < mag <= grid[i]
    lo, hi = grid[i - 1], grid[i]
    if mag == hi:
        return math.copysign(hi, a)
    d_lo, d_hi = Fraction(mag) - Fraction(lo), Fraction(hi) - Fraction(mag)
    nearest = lo if d_lo < d_hi else hi if d_hi < d_lo else (lo if even[lo] else hi)
    return math.copysign(nearest, a)


@pytest.mark.parametrize("element", NARROW, ids=ids)
def test_rn_of_fp64_matches_an_exact_rational_oracle(element):
    """fp64 inputs carry 53 bits: midpoints nudged by one fp64 ulp must leave the tie."""
    codes, values = codes_and_values(element)
    even = {v: (c & 1) == 0 for c, v in zip(codes, values, strict=True) if v >= 0}
    grid = finite_grid(element)
    grid = grid[grid >= 0]
    mids = (grid[:-1] + grid[1:]) / 2
    rng = np.random.default_rng(5)
    picks = np.concatenate(
        [mids[rng.permutation(len(mids))[:400]], grid[:: max(1, len(grid) // 200)]]
    )
    probes = np.concatenate([picks, np.nextafter(picks, np.inf), np.nextafter(picks, -np.inf)])
    probes = np.concatenate([probes, -probes, [element.max_finite * 1.25, 0.0]])
    expected = np.array([exact_rn(a, element, grid, even) for a in probes])
    ours = round_to(torch.from_numpy(probes), element)
    assert_same(ours, torch.from_numpy(expected), f"RN fp64 {element.name}")


@pytest.mark.parametrize("element", NARROW + [FP32], ids=ids + ["fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rn_saturates_past_max_finite_and_never_returns_inf(element, dtype):
    big = element.max_finite
    dtype_max = torch.finfo(dtype).max
    candidates = [big, big + top_half_ulp(element), big * 1.5, big * 2, dtype_max, math.inf]
    x = torch.tensor([v for v in candidates if big <= v <= dtype_max or v == math.inf])
    x = torch.cat([x, -x]).to(dtype)
    expected = torch.copysign(torch.full_like(x, big), x)
    assert_same(round_to(x, element), expected, f"saturation {element.name}")
    assert_same(round_to(x, element, "sr", torch.zeros_like(x, dtype=torch.int64)), expected, "sr")


@pytest.mark.parametrize("element", NARROW + [FP32, FP64], ids=ids + ["fp32", "fp64"])
def test_nan_stays_nan_and_signed_zeros_keep_their_sign(element):
    x = torch.tensor([math.nan, 0.0, -0.0, -math.nan])
    for rounding, rand in (("rn", None), ("sr", torch.zeros(4, dtype=torch.int64))):
        q = round_to(x, element, rounding, rand)
        assert q[0].isnan() and q[3].isnan()
        assert q[1] == 0 and not q[1].signbit() and q[2] == 0 and q[2].signbit()


def test_rn_subnormals_round_ties_to_even_in_worked_cases():
    """fp16: 2^-25 is half the smallest subnormal -> 0 (even); 3 * 2^-25 -> 2^-23 (code 2);
    e4m3: 2^-10 -> 0, 3 * 2^-10 -> 2^-8; e2m1: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0."""
    cases = [
        (FP16, [2**-25, 3 * 2**-25, 2**-24 * 1.5000001], [0.0, 2**-23, 2**-23]),
        (E4M3, [2**-10, 3 * 2**-10, 2**-7 - 2**-10], [0.0, 2**-8, 2**-7]),
        (E2M1, [0.25, 0.75, 1.25, 5.0, -2.5], [0.0, 1.0, 1.0, 4.0, -2.0]),
    ]
    for element, x, expected in cases:
        ours = round_to(torch.tensor(x, dtype=torch.float64), element)
        assert ours.tolist() == expected, element.name


def test_exact_formats_are_the_identity_on_finite_values():
    """fp64 on anything, fp32 on fp32 (subnormals included); only inf saturates."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**62), 2**62, (4099,), generator=g)
    x64 = bits.view(torch.float64)
    x64 = x64[x64.isfinite()]
    assert_same(round_to(x64, FP64), x64, "fp64 identity")
    x32 = torch.randint(0, 2**31, (4099,), generator=g).to(torch.int32).view(torch.float32)
    x32 = torch.cat([x32[x32.isfinite()], -x32[x32.isfinite()], torch.tensor([2.0**-149])])
    assert_same(round_to(x32, FP32), x32, "fp32 identity")


def test_round_to_rejects_bad_arguments_with_value_errors_naming_them():
    x = torch.ones(3, 5)
    words = torch.zeros(3, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"rounding: expected one of \('rn', 'sr'\), got 'rz'"):
        round_to(x, E2M1, "rz")
    with pytest.raises(ValueError, match="rand: expected None for rounding='rn'"):
        round_to(x, E2M1, "rn", words)
    with pytest.raises(ValueError, match="rand: expected an int64 tensor.*got None"):
        round_to(x, E2M1, "sr")
    with pytest.raises(ValueError, match=r"rand: expected shape \[3, 5\], got \[5, 3\]"):
        round_to(x, E2M1, "sr", words.T)
    with pytest.raises(ValueError, match="rand: expected dtype int64, got torch.int32"):
        round_to(x, E2M1, "sr", words.int())
    with pytest.raises(ValueError, match=r"rand: expected uint32 words"):
        round_to(x, E2M1, "sr", words - 1, sr_bits=32)
    with pytest.raises(ValueError, match=r"rand: expected uint32 words.*got range \[4294967296"):
        # one past the top word (it would never round up)
        round_to(x, E2M1, "sr", words + 2**32, sr_bits=32)
    with pytest.raises(ValueError, match=r"rand: expected 16-bit draws \(sr_bits=16\) in "
                                         r"\[0, 2\^16\), got range \[65536, 65536\]"):
        round_to(x, E2M1, "sr", words + 2**16)  # the default draws are 16 bits
    with pytest.raises(ValueError, match="x: expected dtype float16, bfloat16, float32 or "
                                         "float64, got torch.int32"):
        round_to(x.int(), E2M1)
    with pytest.raises(ValueError, match="element: expected an ElementFormat or one of"):
        round_to(x, "nvfp4")  # a format's name, not an element's
    assert torch.equal(round_to(x, "e2m1"), round_to(x, E2M1))  # an element's name is one


# --------------------------------------------------------------------------------------------
# SR


def sweep_bases(element):
    """(name, g): a normal grid point and the largest subnormal, whose ulp reaches 2^emin."""
    min_sub = element.min_subnormal
    return [("normal", 1.0), ("subnormal", min_sub * ((1 << element.mbits) - 1))]


@pytest.mark.parametrize("element", NARROW, ids=ids)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
def test_sr_roundup_count_equals_the_discarded_fraction_exhaustively(element, sign):
    """x = g + (j/1024) ulp for all j, r = (t << 22) | random low bits for all 10-bit t:
    floor(frac * 2^32) = j * 2^22, so x rounds away from zero iff t < j, exactly j of the
    1024 high patterns (j * 2^22 of all 2^32 words), whatever the low bits."""
    k = 10
    g = torch.Generator().manual_seed(17)
    j = torch.arange(1 << k, dtype=torch.float64)[:, None]
    t = torch.arange(1 << k, dtype=torch.int64)[None, :]
    for name, base in sweep_bases(element):
        ulp = math.ldexp(1.0, max(math.frexp(base)[1] - 1, element.emin) - element.mbits)
        x = (sign * (base + j * ulp / (1 << k))).expand(-1, 1 << k).float()
        assert torch.equal(x.double()[:, 0], sign * (base + j[:, 0] * ulp / (1 << k)))
        low = torch.randint(0, 1 << (32 - k), x.shape, generator=g)
        words = (t << (32 - k)) | low
        q = round_to(x, element, "sr", words, sr_bits=32).double()
        up = q.abs() == base + ulp
        assert bool((up | (q.abs() == base)).all()), f"{name}: a result off the two neighbours"
        assert bool((q.signbit() == (sign < 0)).all()) or base == 0
        assert torch.equal(up, t < j), f"{name}: the decision is not `high bits < j`"
        assert torch.equal(up.sum(1), torch.arange(1 << k)), name


@pytest.mark.parametrize("element", NARROW, ids=ids)
def test_sr_threshold_is_exact_for_fp64_inputs(element):
    """With 53-bit inputs the discarded fraction has more than 32 bits: r = floor(frac 2^32) - 1
    rounds up and r = floor(frac 2^32) does not (thresholds computed with Fractions)."""
    rng = np.random.default_rng(23)
    lo_exp, hi_exp = element.emin - element.mbits - 2, element.emax
    x = rng.uniform(1, 2, 500) * np.exp2(rng.integers(lo_exp, hi_exp, 500).astype(np.float64))
    x = x[x < element.max_finite] * rng.choice([-1.0, 1.0], x.size)
    thresholds, floors, ulps = [], [], []
    for a in np.abs(x):
        ulp = Fraction(2) ** (max(math.frexp(a)[1] - 1, element.emin) - element.mbits)
        m = Fraction(a) / ulp
        thresholds.append(math.floor((m - math.floor(m)) * TWO32))
        floors.append(float(math.floor(m) * ulp))
        ulps.append(float(ulp))
    thr = torch.tensor(thresholds)
    down = torch.copysign(torch.tensor(floors, dtype=torch.float64), torch.from_numpy(x))
    up = torch.copysign(down.abs() + torch.tensor(ulps, dtype=torch.float64), down)
    up = torch.copysign(up.abs().clamp(max=element.max_finite), up)
    xt = torch.from_numpy(x)
    has_up = thr > 0
    assert_same(
        round_to(xt, element, "sr", (thr - 1).clamp(min=0), sr_bits=32),
        torch.where(has_up, up, down),
        "r=thr-1",
    )
    assert_same(round_to(xt, element, "sr", thr, sr_bits=32), down, "r=thr")
    assert_same(round_to(xt, element, "sr", torch.full_like(thr, TWO32 - 1), sr_bits=32), down,
                "r=max")


@pytest.mark.parametrize("element", NARROW, ids=ids)
@pytest.mark.parametrize("rounding", ["rn", "sr"])
def test_fp32_and_fp64_evaluations_agree_bit_for_bit(element, rounding):
    """README: a kernel rounding in fp32 registers and the fp64 reference store the same bits
    (SR with random 32-bit words)."""
    g = torch.Generator().manual_seed(29)
    x = torch.randn(30011, generator=g) * torch.exp2(torch.randint(-30, 20, (30011,), generator=g))
    words = torch.randint(0, TWO32, x.shape, generator=g) if rounding == "sr" else None
    sr = {"sr_bits": 32} if rounding == "sr" else {}
    assert_same(
        round_to(x, element, rounding, words, **sr).double(),
        round_to(x.double(), element, rounding, words, **sr),
        "fp32 vs fp64",
    )


@pytest.mark.parametrize("sr_bits,rounds", [(32, 10), (16, 7)], ids=["32-bits", "16-bits"])
@pytest.mark.parametrize("element", [FP16, E4M3, E2M1], ids=["fp16", "e4m3", "e2m1"])
def test_sr_is_unbiased_within_binomial_error(element, sr_bits, rounds):
    """Each of 301 values is rounded with 4096 Philox draws of k = sr_bits bits; the mean's error
    must be within 5 binomial standard deviations ulp sqrt(p (1 - p) / 4096) (plus ulp 2^-k, the
    draw resolution); a deterministic seed, and P(|z| > 5) = 6e-7 per value for a fair
    rounding."""
    n_values, n_words = 301, 4096
    g = torch.Generator().manual_seed(31)
    grid = torch.from_numpy(finite_grid(element))
    grid = grid[grid >= 0]
    lo_idx = torch.randint(0, len(grid) - 1, (n_values,), generator=g)
    lo, hi = grid[lo_idx], grid[lo_idx + 1]
    x = (lo + torch.rand(n_values, generator=g, dtype=torch.float64) * (hi - lo)).float().double()
    x[:5] = lo[:5]  # grid points: p = 0, the mean must be exact
    words = philox.random_words(2024, torch.arange(n_values), 0, (n_words,), sr_bits=sr_bits,
                                philox_rounds=rounds)
    q = round_to(x[:, None].expand(-1, n_words).contiguous(), element, "sr", words,
                 sr_bits=sr_bits)
    p = (x - lo) / (hi - lo)
    sigma = (hi - lo) * torch.sqrt(p * (1 - p) / n_words)
    error = (q.mean(dim=1) - x).abs()
    bound = 5 * sigma + (hi - lo) * 2.0**-sr_bits
    assert bool((error <= bound).all()), float((error / sigma).max())
    assert torch.equal(q[:5], x[:5, None].expand(-1, n_words))


def sr_table():
    """(element, x, word, expected): the special values for 32-bit words, each with the reason
    it holds."""
    after = lambda v: float(np.nextafter(np.float32(v), np.float32(np.inf)))  # noqa: E731
    before = lambda v: float(np.nextafter(np.float32(v), np.float32(-np.inf)))  # noqa: E731
    top = TWO32 - 1
    return [
        # grid points never move, even with the most eager word
        (E2M1, 1.5, 0, 1.5),
        (E2M1, -6.0, 0, -6.0),
        (FP16, 1.0, 0, 1.0),
        (E4M3, 2.0**-9, 0, 2.0**-9),
        # fp32 neighbours of grid points: a sliver above moves up only for small words
        (E2M1, after(1.5), 0, 2.0),
        (E2M1, after(1.5), top, 1.5),
        (E2M1, before(1.5), top, 1.0),
        (E2M1, before(1.5), 0, 1.5),
        (FP16, after(1.0), 0, 1.0 + 2.0**-10),
        (FP16, after(1.0), 2**19, 1.0),  # frac = 2^-13: threshold 2^19
        (FP16, after(1.0), 2**19 - 1, 1.0 + 2.0**-10),
        # subnormals: half way, p = 1/2, threshold 2^31
        (E2M1, 0.25, 2**31 - 1, 0.5),
        (E2M1, 0.25, 2**31, 0.0),
        (FP16, 2.0**-25, 2**31 - 1, 2.0**-24),
        (FP16, 2.0**-25, 2**31, 0.0),
        (E4M3, -(2.0**-10), 2**31 - 1, -(2.0**-9)),
        # fractions below 2^-32 of an ulp never round up; 2^-32 exactly needs r = 0
        (E2M1, 2.0**-34, 0, 0.0),
        (E2M1, 2.0**-33, 0, 0.5),
        (E2M1, 2.0**-33, 1, 0.0),
        # at and past the maximum: saturation, whatever the word
        (E2M1, 6.0, 0, 6.0),
        (E2M1, 7.0, 0, 6.0),
        (E2M1, 7.0, top, 6.0),
        (E2M1, 1e30, 0, 6.0),
        (E2M1, -math.inf, 0, -6.0),
        (FP16, 65519.0, 0, 65504.0),
        (E4M3, 460.0, 0, 448.0),
        (BF16, math.inf, top, BF16.max_finite),
        # NaN and signed zeros
        (E2M1, math.nan, 0, math.nan),
        (FP16, 0.0, 0, 0.0),
        (FP16, -0.0, 0, -0.0),
    ]


@pytest.mark.parametrize("element,x,word,expected", sr_table())
def test_sr_special_values(element, x, word, expected):
    for dtype in (torch.float32, torch.float64):
        q = round_to(torch.tensor([x], dtype=dtype), element, "sr", torch.tensor([word]),
                     sr_bits=32)
        assert_same(q.double(), torch.tensor([expected], dtype=torch.float64), f"{dtype}")
