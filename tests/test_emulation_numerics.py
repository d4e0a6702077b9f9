"""Triton rounding, block quantisation and random words equal lowprec's, bit for bit.

`emulation.numerics` computes in fp32 registers what `lowprec.quantize` computes in PyTorch; for
the same fp32 input and random words the results must be identical (atol = rtol = 0), on the
special values of each format (zeros, subnormals, ties, the largest finite value and past it,
inf, NaN) and on random values across many binades, for RN and SR, element and block formats.

Runs under TRITON_INTERPRET=1 on the CPU (set below before triton is imported) and compiled on
a GPU (the `gpu` variants).
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton cannot compile for a CPU: interpret (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checks import assert_bits_equal, assert_within

from emulation import numerics  # noqa: E402
from lowprec import formats, philox  # noqa: E402
from lowprec import quantize as lq  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="compiled Triton: GPU")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
ELEMENTS = ["fp32", "fp16", "bf16", "e4m3", "e5m2", "e2m1"]
KERNEL_FORMATS = [name for name in formats.names() if name != "fp64"]
BLOCK_FORMATS = ["nvfp4", "mxfp4", "fp8_e4m3_row", "fp4_e2m1_b16", "fp4_e2m1_b32"]


def special_values(element: formats.ElementFormat) -> torch.Tensor:
    """Values where rounding has a decision to make, both signs."""
    tiny = math.ldexp(1.0, element.emin - element.mbits)  # smallest subnormal
    ulp1 = math.ldexp(1.0, -element.mbits)  # spacing at 1
    top = element.max_finite
    top_ulp = math.ldexp(1.0, element.emax - element.mbits)
    values = [
        0.0, tiny, tiny / 2, tiny / 4, 0.75 * tiny, 1.5 * tiny, 2.5 * tiny,
        math.ldexp(1.0, element.emin), math.ldexp(1.0, element.emin) - tiny / 2,
        1.0, 1.0 + ulp1 / 2, 1.0 + 1.5 * ulp1, 1.0 + ulp1 / 4, 1.0 + 0.75 * ulp1, 2.0 - ulp1 / 4,
        top, top + top_ulp / 2, top + top_ulp / 4, 2 * top, 1e30,
        math.ldexp(1.0, -149), math.ldexp(1.0, -140), math.ldexp(1.0, -126),  # fp32 subnormals
        3.4028234663852886e38, math.inf, math.nan,
    ]
    v = torch.tensor(values, dtype=torch.float64).clamp(max=3.4028234663852886e38)
    v = torch.where(torch.tensor(values).isinf(), math.inf, v)
    v = torch.where(torch.tensor(values).isnan(), math.nan, v).float()
    return torch.cat([v, -v])


def random_values(n: int, seed: int) -> torch.Tensor:
    """fp32 values spread over 2^-40 .. 2^40, both signs (never all zero)."""
    gen = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(n, generator=gen) + 0.5
    exponent = torch.randint(-40, 41, (n,), generator=gen).float()
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return sign * mantissa * torch.exp2(exponent)


def test_bit_and_bound_checks_refuse_other_shapes():
    """The shared checks compare shapes first: a [1] or [n, 1] result broadcast against the
    expected [n, k] and passed."""
    with pytest.raises(pytest.fail.Exception, match=r"shape \[1\] vs expected \[3\]"):
        assert_bits_equal(torch.zeros(1), torch.zeros(3), "s_g")
    with pytest.raises(pytest.fail.Exception, match="shape"):
        assert_within(torch.zeros(3, 1), torch.zeros(3, 5, dtype=torch.float64),
                      torch.ones(3, 5, dtype=torch.float64), "y")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["rn", "sr"])
@pytest.mark.parametrize("element_name", ELEMENTS)
def test_round_element_equals_lowprec(element_name, rounding, device):
    """round_element == lowprec round_to, bit for bit, on special and random values."""
    element = formats.ELEMENTS[element_name]
    x = torch.cat([special_values(element), random_values(2001, seed=len(element_name))])
    rand = philox.random_words(11, 3, 7, x.shape) if rounding == "sr" else None
    expected = lq.round_to(x, element, rounding, rand)
    actual = numerics.round_to(
        x.to(device), element, rounding, None if rand is None else rand.to(device)
    )
    assert_bits_equal(actual, expected, f"{element_name} {rounding}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("element_name", ["fp16", "bf16", "e4m3", "e5m2", "e2m1"])
def test_sr_rounds_up_iff_word_below_threshold(element_name, device):
    """SR at 1 + ulp/4: threshold floor(0.25 * 2^32) = 2^30, so word 2^30 - 1 rounds up to
    1 + ulp and word 2^30 stays at 1 (the words around the edge of the discarded fraction);
    at 1 + 3 ulp/4 the threshold is 3 * 2^30 and the word 2^32 - 1 never rounds up; the
    word 0, the most eager (and a valid word: one in 2^32 of a flush's words), rounds up
    (whole 32-bit words: sr_bits=32)."""
    element = formats.ELEMENTS[element_name]
    ulp = math.ldexp(1.0, -element.mbits)
    x = torch.tensor([1 + ulp / 4, 1 + ulp / 4, -(1 + ulp / 4), 1 + 0.75 * ulp, 1 + 0.75 * ulp,
                      1 + ulp / 4])
    words = torch.tensor([2**30 - 1, 2**30, 2**30 - 1, 3 * 2**30 - 1, 2**32 - 1, 0])
    expected = torch.tensor([1 + ulp, 1.0, -(1 + ulp), 1 + ulp, 1.0, 1 + ulp])
    actual = numerics.round_to(x.to(device), element, "sr", words.to(device), sr_bits=32)
    assert_bits_equal(actual, expected, f"{element_name} SR edges")
    assert_bits_equal(actual, lq.round_to(x, element, "sr", words, sr_bits=32),
                      f"{element_name} vs lowprec")


def block_test_states(dk: int, seed: int) -> torch.Tensor:
    """Three [5, dk] states: random magnitudes per row (2^-20 .. 2^20), a zero block (32 wide:
    one of mxfp4's too, whose zero block's scale 2^-127 is no zero divisor), a block whose amax
    is 1000x its other values, a state of fp32 subnormals (s_g underflows to 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, dk, generator=gen)
    x *= torch.exp2(torch.randint(-20, 21, (3, 5, 1), generator=gen).float())
    x[0, 1, :32] = 0.0
    x[0, 1, 3] = -0.0
    x[0, 2, 16] = 1000.0 * x[0, 2, 17:32].abs().max()
    x[1, 3] = x[1, 3] * 2.0**-60  # tiny row inside an ordinary state: zero or small scales
    x[2] = x[2].sign() * torch.ldexp(torch.ones(5, dk), torch.full((5, dk), -140))
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["rn", "sr"])
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_quantize_tile_equals_lowprec(fmt, rounding, device):
    """quantize_tile == lowprec quantize: dequantised values, element codes, block scales and
    the second-level scale, bit for bit (dstate 32, headdim 5; and dstate 48 where the block
    divides it, which pads the tile to 64)."""
    for dk in (32, 48):
        if formats.get(fmt).block not in (None, formats.ROW) and dk % formats.get(fmt).block:
            continue
        x = block_test_states(dk, seed=dk)
        rand = None
        if rounding == "sr":
            rand = philox.random_words(5, torch.arange(3), 2, x.shape[1:])
        expected = lq.quantize(x, fmt, rounding, rand)
        actual = numerics.quantize(
            x.to(device), fmt, rounding, None if rand is None else rand.to(device)
        )
        what = f"{fmt} {rounding} dk={dk}"
        assert_bits_equal(lq.dequantize(actual), lq.dequantize(expected), what + " values")
        assert_bits_equal(actual.elements, expected.elements, what + " codes")
        if expected.scales is not None:
            assert_bits_equal(actual.scales, expected.scales, what + " scales")
        if expected.global_scale is not None:
            assert_bits_equal(actual.global_scale, expected.global_scale, what + " s_g")


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_blocks_whose_divisor_underflows_match_lowprec(device):
    """States so small that s_b * s_g underflows fp32: s_g itself 0 (scale byte 0x7E) in row
    0, s_g and s_b nonzero with a zero product in row 1's second block; the emulation stores
    lowprec's scales and codes (+0) bit for bit."""
    x = torch.zeros(2, 1, 32)  # two states of one row each
    x[0, 0, 0], x[0, 0, 3] = 1000 * 2.0**-149, -7 * 2.0**-149  # block 1 stays zero
    x[1, 0, 0], x[1, 0, 16] = 2688 * 2.0**-141, 2.0**-148
    expected = lq.quantize(x, "nvfp4")
    actual = numerics.quantize(x.to(device), "nvfp4")
    assert expected.scales.tolist() == [[[448.0, 0.0]], [[448.0, 2.0**-9]]]  # the corner
    assert expected.global_scale.tolist() == [0.0, 2.0**-141]
    for field in ("elements", "scales", "global_scale"):
        assert_bits_equal(getattr(actual, field), getattr(expected, field), field)
    assert lq.pack(actual)["scales"].cpu().tolist() == [[[0x7E, 0x00]], [[0x7E, 0x01]]]


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_codes_of_a_tiny_state_match_lowprec(device):
    """A state whose amax is ~2^-128 (s_g ~ 2^-139, an fp32 subnormal) and a block of values a
    few 2^-149 (s_b = 2^-9): the container (code * s_b) * s_g = +-1.5 * 2^-9 * s_g rounds to
    +-3 * 2^-149 and lost the code (dividing it back gives 2, not 1.5), so the codes quantize
    returns are the kernel's own, equal to lowprec's (codes_of recovered 2)."""
    x = torch.zeros(1, 32)
    x[0, 0] = float.fromhex("0x1.1efe08p-128")
    x[0, 16:20] = torch.tensor([15.0, -3.0, 3.0, 1.0]) * 2.0**-149
    expected = lq.quantize(x, "nvfp4")
    assert expected.elements[0, 16:20].tolist() == [6.0, -1.5, 1.5, 0.5]
    actual = numerics.quantize(x.to(device), "nvfp4")
    for field in ("global_scale", "scales", "elements"):
        assert_bits_equal(getattr(actual, field), getattr(expected, field), field)
    assert_bits_equal(lq.dequantize(actual), lq.dequantize(expected), "values")


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_block_scales_at_e4m3_ties_match_lowprec(device):
    """Block amaxes within a few fp32 ulps of (E4M3 midpoint) * 6 s_g, where one ulp of the
    quotient decides the block scale: the emulation's s_b is lowprec's, bit for bit, so it too
    divides amax_b by den = 6 * s_g rounded first (amax_b / 6 / s_g would flip some)."""
    grid = lq.decode_bits(torch.arange(0x7F), formats.E4M3).double()  # 0 .. 448
    midpoints = ((grid[:-1] + grid[1:]) / 2)[1:]
    s_g = torch.tensor(1000.0) / 2688.0
    centre = (midpoints * (torch.tensor(6.0) * s_g).double()).float()
    amax_b = torch.cat([centre + k * torch.finfo().eps * centre for k in range(-3, 4)])
    amax_b = torch.cat([torch.tensor([1000.0]), amax_b[amax_b < 1000]])
    x = torch.zeros(1, len(amax_b), 16)  # one state, a block a row
    x[0, :, 5] = amax_b
    x[0, 1::2, 9] = -amax_b[1::2] / 3  # a second value in some blocks: codes, not only scales
    expected = lq.quantize(x, "nvfp4")
    actual = numerics.quantize(x.to(device), "nvfp4")
    for field in ("global_scale", "scales", "elements"):
        assert_bits_equal(getattr(actual, field), getattr(expected, field), field)
    other_order = lq.round_to(amax_b / 6.0 / s_g, formats.E4M3)
    assert not torch.equal(expected.scales[0, :, 0], other_order)  # the test can tell


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_codes_at_e2m1_decision_points_match_lowprec(device):
    """For every positive E4M3 block scale s_b, a block whose quotients x / (s_b s_g) lie on
    E2M1's decision points (0.25, 0.75, ..., 5: ties to even), 2^-6 beside them and on grid
    values, both signs (s_g = 2^-10, every value exact in fp32): the emulation's codes are
    lowprec's, bit for bit. Computing x * RN(1 / divisor) instead of the division would flip
    some ties (checked below), which random states never reach."""
    s_b = lq.decode_bits(torch.arange(1, 0x7F), formats.E4M3)  # every positive finite scale
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1, 1.5, 2, 3, 4])
    steps = torch.tensor([0.0, 1.0, -1.0])
    quotients = (points[:, None] * (1 + steps * 2.0**-6)).flatten()  # 42 values
    n = len(s_b)
    q = torch.empty(n, 2, 32)  # a state per scale: 2 rows of 2 blocks
    q[...] = quotients.repeat(2)[: 2 * 32].reshape(2, 32)
    q[..., ::16] = 6.0  # each block's amax
    sign = torch.where(torch.arange(2 * 32).reshape(2, 32) % 3 == 1, -1.0, 1.0)
    scale = s_b[:, None, None].expand(n, 2, 32).clone()
    scale[:, 0, :16] = 448.0  # the state's amax 6 * 448 * 2^-10, so s_g = 2^-10
    x = sign * q * scale * 2.0**-10
    assert torch.equal(x.double(), sign.double() * q.double() * scale.double() * 2.0**-10)
    expected = lq.quantize(x, "nvfp4")
    assert bool((expected.global_scale == 2.0**-10).all())
    assert torch.equal(expected.scales, scale[..., ::16])
    actual = numerics.quantize(x.to(device), "nvfp4")
    for field in ("global_scale", "scales", "elements"):
        assert_bits_equal(getattr(actual, field), getattr(expected, field), field)
    divisor = (scale * 2.0**-10)
    by_reciprocal = lq.round_to(x * (1.0 / divisor), formats.E2M1)
    assert not torch.equal(by_reciprocal, expected.elements)  # the test can tell


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_worked_example(device):
    """s_g = 2688 / 2688 = 1. Row 0 block 1: amax 500, s_b = RN_e4m3(83.3) = 80, 500 / 80 =
    6.25 -> 6, 60 / 80 = 0.75 -> 1 (tie to even). Row 1 block 1: amax 0.01, s_b = 2^-9 (E4M3
    subnormal), 0.0049 / 2^-9 = 2.51 -> 3. Row 2 block 0: amax 0.0005, s_b = RN(0.000083) = 0:
    a zero block. Packed bytes equal lowprec.pack's."""
    x = torch.zeros(3, 32)
    x[0, :4] = torch.tensor([2688.0, 1000.0, 700.0, -3.0])
    x[0, 16:21] = torch.tensor([500.0, 250.0, -130.0, 20.0, 60.0])
    x[1, 16:19] = torch.tensor([0.01, 0.0049, -0.0005])
    x[2, :2] = torch.tensor([0.0005, -0.0002])
    x[2, 16:18] = torch.tensor([-448.0, 1.0])
    q = numerics.quantize(x.to(device), "nvfp4")
    scales = q.scales.cpu()
    assert q.global_scale.item() == 1.0
    assert scales[0].tolist() == [448.0, 80.0]
    assert scales[1].tolist() == [0.0, 2.0**-9]
    assert scales[2].tolist() == [0.0, 72.0]
    assert q.elements[0, 16:21].tolist() == [6.0, 3.0, -1.5, 0.0, 1.0]
    assert q.elements[1, 16:19].tolist() == [6.0, 3.0, -0.5]
    packed = lq.pack(lq.Quantized(q.fmt, q.elements.cpu(), scales, q.global_scale.cpu()))
    expected = lq.pack(lq.quantize(x, "nvfp4"))
    for key in expected:
        assert torch.equal(packed[key], expected[key]), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_codes_of_recovers_codes_from_containers(fmt, device):
    """The fp32 container (code * s_b) * s_g with its scales gives back lowprec's codes, so
    packing the emulation's copy gives lowprec's bytes."""
    x = block_test_states(32, seed=3)[:2]
    expected = lq.quantize(x, fmt)
    values = lq.dequantize(expected)
    codes = numerics.codes_of(values.to(device), fmt, expected.scales.to(device),
                              None if expected.global_scale is None
                              else expected.global_scale.to(device))
    assert_bits_equal(codes, expected.elements, fmt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "seed, slot, flush",
    [(0, 0, 0), (12345, 3, 7), (2**32 + 17, 2**20 - 1, 2**20 - 1), (2**63 + 5, 1, 2)],
    ids=["zero", "small", "max-counters", "seed>=2^63"],
)
def test_random_words_equal_lowprec_philox(seed, slot, flush, device):
    """The default draws (16 bits, 7 rounds) == lowprec.philox.random_words; with 32 bits and
    10 rounds, word e % 4 of tl.randint4x at (slot << 44) | (flush << 24) | (e // 4) ==
    random_words(..., sr_bits=32, philox_rounds=10) == lowprec.philox.randint4x's."""
    n = 3000
    words = numerics.random_words_host(seed, slot, flush, n, device=device)
    assert torch.equal(words.cpu(), philox.random_words(seed, slot, flush, [n]))
    words = numerics.random_words_host(seed, slot, flush, n, device=device, sr_bits=32,
                                       philox_rounds=10).cpu()
    assert torch.equal(words, philox.random_words(seed, slot, flush, [n], sr_bits=32,
                                                  philox_rounds=10))
    four = philox.randint4x(seed, (slot << 44) | (flush << 24) | torch.arange(n // 4))
    assert torch.equal(words, torch.stack(four, -1).flatten())


SR_SETTINGS = [(32, 10), (16, 10), (13, 10), (8, 10), (16, 7), (32, 7), (8, 7), (32, 4),
               (8, 4), (16, 1)]
# every setting in the interpreter; compiled, one per lane width with 7, 4, 1 and 10 rounds
SR_GPU = {(32, 7), (16, 1), (13, 10), (8, 4)}
SR_DRAW_CASES = [pytest.param(k, r, device.values[0], id=f"{k}b-{r}r-{device.values[0]}",
                              marks=device.marks)
                 for k, r in SR_SETTINGS for device in DEVICES
                 if device.values[0] == "cpu" or (k, r) in SR_GPU]


@pytest.mark.parametrize("sr_bits, philox_rounds, device", SR_DRAW_CASES)
def test_random_draws_every_sr_setting_equal_lowprec(sr_bits, philox_rounds, device):
    """The kernels' draws of k = sr_bits bits from R-round Philox are lowprec.philox's, draw for
    draw (1037 elements: the last counter partly used for every lane width; slot 2^19 + 3 sets
    the offset's top bit), each below 2^k; a k or R other than the defaults (16, 7) gives
    other draws than the defaults."""
    seed, slot, flush, n = 2**33 + 7, 2**19 + 3, 77, 1037
    draws = numerics.random_words_host(seed, slot, flush, n, device=device, sr_bits=sr_bits,
                                       philox_rounds=philox_rounds).cpu()
    expected = philox.random_words(seed, slot, flush, [n], sr_bits=sr_bits,
                                   philox_rounds=philox_rounds)
    assert torch.equal(draws, expected)
    assert int(draws.max()) < 2**sr_bits and int(draws.max()) >= 2**(sr_bits - 1)
    default = (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)
    if (sr_bits, philox_rounds) != default:
        assert not torch.equal(draws, philox.random_words(seed, slot, flush, [n]) % 2**sr_bits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sr_bits", [8, 13])
def test_k_bit_sr_rounds_up_for_exactly_floor_frac_2k_draws(sr_bits, device):
    """Every k-bit draw (exhaustive, 2^k of them) at FP16 values 1 + f ulp with f = j / 2^13:
    the round-ups number floor(f 2^k) (j >> 5 for k = 8, j for k = 13), the draws below that
    threshold, and the results equal lowprec's bit for bit. For k = 8 and j not a multiple of
    32 that is the bias of k-bit SR: the fraction's bits below its top 8 never round up."""
    ulp = 2.0**-10
    j = torch.tensor([0, 1, 31, 32, 33, 4095, 4096, 5000, 8191])
    x = (1 + j.double() / 2**13 * ulp).float()  # 1 + f ulp: 23 fraction bits, exact in fp32
    draws = torch.arange(2**sr_bits)
    xs, rs = x[:, None].expand(-1, draws.numel()).contiguous(), draws.expand(x.numel(), -1)
    rs = rs.contiguous()
    actual = numerics.round_to(xs.to(device), "fp16", "sr", rs.to(device),
                               sr_bits=sr_bits).cpu()
    assert_bits_equal(actual, lq.round_to(xs, "fp16", "sr", rs, sr_bits=sr_bits).float(),
                      f"k={sr_bits} vs lowprec")
    ups = (actual > 1.0).sum(dim=1)
    threshold = j >> (13 - sr_bits)
    assert ups.tolist() == threshold.tolist()
    assert torch.equal(actual > 1.0, rs < threshold[:, None])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt, sr_bits", [("nvfp4", 8), ("mxfp4", 13), ("fp16", 16),
                                          ("fp8_e4m3", 8)])
def test_quantize_k_bit_sr_equals_lowprec(fmt, sr_bits, device):
    """quantize_tile with k-bit SR draws (random_words(..., sr_bits=k, philox_rounds=7)) stores
    lowprec's values, codes and scales bit for bit (dstate 32: zero blocks, outliers and
    subnormal states, as the RN/SR test)."""
    x = block_test_states(32, seed=7)
    rand = philox.random_words(5, torch.arange(3), 2, x.shape[1:], sr_bits=sr_bits,
                               philox_rounds=7)
    expected = lq.quantize(x, fmt, "sr", rand, sr_bits=sr_bits)
    actual = numerics.quantize(x.to(device), fmt, "sr", rand.to(device), sr_bits=sr_bits)
    what = f"{fmt} SR k={sr_bits}"
    assert_bits_equal(lq.dequantize(actual), lq.dequantize(expected), what + " values")
    assert_bits_equal(actual.elements, expected.elements, what + " codes")
    if expected.scales is not None:
        assert_bits_equal(actual.scales, expected.scales, what + " scales")


def test_format_spec_is_format_data():
    """The kernel data of a format is read from lowprec.formats (no table of names here)."""
    nvfp4 = numerics.format_spec("nvfp4")
    assert nvfp4.element == numerics.element_spec(formats.E2M1)
    assert (nvfp4.block, nvfp4.two_level, nvfp4.pow2_scale) == (16, True, False)
    assert nvfp4.scale.max_finite == 448.0
    assert numerics.format_spec("mxfp4").pow2_scale
    assert numerics.format_spec("fp8_e4m3_row").block == formats.ROW
    assert numerics.element_spec(formats.FP32).identity
    assert not numerics.element_spec(formats.FP16).identity


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: numerics.round_to(torch.zeros(3, dtype=torch.float64), formats.FP16), "x:"),
        (lambda: numerics.round_to(torch.zeros(3), formats.FP64), "element:"),
        (lambda: numerics.round_to(torch.zeros(3), formats.FP16, "sr"), "rand:"),
        (lambda: numerics.round_to(torch.zeros(3), formats.FP16, "up"), "rounding:"),
        (lambda: numerics.quantize(torch.zeros(4, 40), "nvfp4"), "fmt:.*divisible by 16"),
        (lambda: numerics.quantize(torch.zeros(4, 32), "fp64"), "fmt:.*32-bit"),
        (lambda: numerics.quantize(torch.zeros(32), "nvfp4"), "x:.*dv, dk"),
        (lambda: numerics.round_to(torch.ones(2), formats.FP16, "sr", torch.tensor([-1, 0]),
                                   sr_bits=32),
         r"rand: expected uint32 words in \[0, 2\^32\), got range \[-1, 0\]"),
        (lambda: numerics.quantize(torch.ones(1, 16), "nvfp4", "sr",
                                   torch.full((1, 16), 2**32), sr_bits=32),
         "rand: expected uint32 words"),
        (lambda: numerics.round_to(torch.ones(2), formats.FP16, "sr", torch.tensor([0, 2**16])),
         r"rand: expected 16-bit draws \(sr_bits=16\) in \[0, 2\^16\), got range \[0, 65536\]"),
        (lambda: numerics.quantize(torch.zeros(2, 0, 32), "nvfp4"), "x: expected dv >= 1"),
        (lambda: numerics.random_words_host(0, 2**20, 0, 8), r"slot: .*\[0, 2\^20\), got"),
        (lambda: numerics.random_words_host(0, 0, -1, 8), "flush: expected an int"),
        (lambda: numerics.random_words_host(-1, 0, 0, 8), "seed: expected an int"),
        (lambda: numerics.random_words_host(0, 0, 0, 2**24 + 4), "numel: expected an int"),
        (lambda: numerics.random_words_host(0, 0, 0, 8.0), "numel: expected an int"),
        (lambda: numerics.codes_of(torch.ones(3, 32), "nvfp4", torch.ones(3, 2)),
         "global_scale: expected a float32 tensor, got NoneType"),
        (lambda: numerics.codes_of(torch.ones(3, 32), "mxfp4", torch.ones(3, 1), torch.ones(())),
         "global_scale: expected None for 'mxfp4'"),
        (lambda: numerics.codes_of(torch.ones(3, 32), "mxfp4", torch.ones(1, 3)),
         r"scales: expected shape \[3, 1\], got \[1, 3\]"),
        (lambda: numerics.codes_of(torch.ones(3, 32), "fp16", None), "fmt: expected a block"),
        # a name the kernels do not round to lists the names they do
        (lambda: numerics.round_to(torch.zeros(3), "fp7"),
         r"element: .* or one of \['fp32', 'fp16', 'bf16', 'e4m3', 'e5m2', 'e2m1'\], got 'fp7'"),
        (lambda: numerics.round_to(torch.ones(2), "fp16", "sr", torch.tensor([0, 256]),
                                   sr_bits=8),
         r"rand: expected 8-bit draws \(sr_bits=8\) in \[0, 2\^8\), got range \[0, 256\]"),
        (lambda: numerics.round_to(torch.ones(2), "fp16", sr_bits=8),
         r"sr_bits: expected the default 16 for rounding='rn' \(only SR draws bits\), got 8"),
        (lambda: numerics.quantize(torch.ones(1, 16), "nvfp4", "sr", torch.zeros(1, 16,
                                   dtype=torch.int64), sr_bits=12),
         r"sr_bits: expected random bits per element in \[8, 13, 16, 32\], got 12"),
        (lambda: numerics.random_words_host(0, 0, 0, 8, philox_rounds=0),
         r"philox_rounds: expected Philox rounds in \[1, 10\], got 0"),
        (lambda: numerics.random_words_host(0, 0, 0, 8, sr_bits=True),
         "sr_bits: expected random bits per element"),
    ],
    ids=["dtype", "fp64-element", "sr-without-words", "rounding", "block", "fp64", "ndim",
         "negative-word", "word-past-2^32", "default-draw-past-2^16", "nvfp4-no-rows",
         "slot-2^20", "flush-negative",
         "seed-negative", "numel-past-2^24", "numel-float", "codes-of-without-s_g",
         "codes-of-extra-s_g", "codes-of-scales-shape", "codes-of-element-format",
         "unknown-element-name", "draw-past-2^k", "sr-bits-with-rn", "sr-bits-12",
         "rounds-0", "sr-bits-bool"],
)
def test_invalid_inputs_raise_value_error(call, match):
    """Bad inputs are refused with a ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        call()
