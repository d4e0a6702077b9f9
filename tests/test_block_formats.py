"""Block formats (README.md "Block formats", "Packed storage"): worked examples, pack/unpack,
SQNR floors, zero blocks, element codes.

Worked nvfp4 example (state [3, 32], two blocks of 16 per row; s_g = 2688 / 2688 = 1):

    row 0, block 0: amax 2688: s_b = RN_e4m3(2688 / 6 = 448) = 448 (byte 0x7E)
        2688 / 448 = 6 -> 6;  1000 / 448 = 2.23 -> 2;  700 / 448 = 1.5625 -> 1.5;
        -3 / 448 = -0.0067 -> -0 (nibble 0x8)
    row 0, block 1: amax 500: s_b = RN_e4m3(83.33) = 80 (ulp 8 in [64, 128); byte 0x6A)
        500 / 80 = 6.25 -> 6;  250 / 80 = 3.125 -> 3;  -130 / 80 = -1.625 -> -1.5;
        20 / 80 = 0.25 -> 0 (tie, even);  60 / 80 = 0.75 -> 1 (tie, even)
    row 1, block 0: all zero (one -0): scale 0 (byte 0x00), codes +0
    row 1, block 1: amax 0.01: 0.01 / 6 = 0.00167 -> E4M3 subnormal 2^-9 (byte 0x01)
        0.01 / 2^-9 = 5.12 -> 6;  0.0049 / 2^-9 = 2.51 -> 3;  -0.0005 / 2^-9 = -0.256 -> -0.5
    row 2, block 0: amax 0.0005: 0.0005 / 6 / 2^-9 = 0.043 -> s_b = 0: a zero block, codes 0
    row 2, block 1: amax 448: s_b = RN_e4m3(74.67) = 72 (byte 0x69)
        -448 / 72 = -6.22 -> -6;  1 / 72 = 0.014 -> 0

Scaling the whole state by 2^-10 gives s_g = 2^-10 and the same bytes (every step scales).
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowprec import formats, philox
from lowprec.formats import BF16, E2M1, E4M3, E5M2, FP16, FP32, FP64
from lowprec.quantize import (
    Quantized,
    decode_bits,
    dequantize,
    encode_bits,
    fake_quantize,
    pack,
    quantize,
    round_to,
    unpack,
)

BLOCK_FORMATS = ["nvfp4", "mxfp4", "fp8_e4m3_row", "fp4_e2m1_b16", "fp4_e2m1_b32"]


def nvfp4_example_state() -> torch.Tensor:
    s = torch.zeros(3, 32)
    s[0, :4] = torch.tensor([2688.0, 1000.0, 700.0, -3.0])
    s[0, 16:21] = torch.tensor([500.0, 250.0, -130.0, 20.0, 60.0])
    s[1, 0] = -0.0
    s[1, 16:19] = torch.tensor([0.01, 0.0049, -0.0005])
    s[2, :2] = torch.tensor([0.0005, -0.0002])
    s[2, 16:18] = torch.tensor([-448.0, 1.0])
    return s


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = ""):
    """Equal dtype, values and signs (NaN matches NaN)."""
    assert actual.dtype == expected.dtype, what
    same = (actual == expected) & (actual.signbit() == expected.signbit())
    same |= actual.isnan() & expected.isnan()
    if not bool(same.all()):
        i = (~same).nonzero()[0]
        pytest.fail(
            f"{what}: {int((~same).sum())} mismatches, first at {i.tolist()}: "
            f"{actual[tuple(i)].item()!r} vs {expected[tuple(i)].item()!r}"
        )


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float((x * x).sum() / ((y - x) ** 2).sum()))


# --------------------------------------------------------------------------------------------
# worked examples


@pytest.mark.parametrize("state_scale", [1.0, 2.0**-10], ids=["s_g=1", "s_g=2^-10"])
def test_nvfp4_worked_example_scales_codes_and_bytes(state_scale):
    """The module docstring's example, value by value and byte by byte."""
    q = quantize(nvfp4_example_state() * state_scale, "nvfp4")
    assert q.global_scale.shape == () and q.global_scale.item() == state_scale
    assert q.scales.tolist() == [[448.0, 80.0], [0.0, 2.0**-9], [0.0, 72.0]]
    picked = [0, 1, 2, 3, 16, 17, 18, 19, 20]
    assert q.elements[:, picked].tolist() == [
        [6.0, 2.0, 1.5, -0.0, 6.0, 3.0, -1.5, 0.0, 1.0],
        [0.0, 0.0, 0.0, 0.0, 6.0, 3.0, -0.5, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, -6.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert q.elements[0, 3].signbit() and not q.elements[1, 0].signbit()
    packed = pack(q)
    assert packed["scales"].tolist() == [[0x7E, 0x6A], [0x00, 0x01], [0x00, 0x69]]
    # byte = even-index nibble | odd-index nibble << 4; E2M1 nibbles: 6 -> 7, 2 -> 4, ...
    assert packed["codes"][0, [0, 1, 8, 9, 10]].tolist() == [0x47, 0x83, 0x57, 0x0B, 0x02]
    assert packed["codes"][1, [0, 8, 9]].tolist() == [0x00, 0x57, 0x09]
    assert packed["codes"][2, [0, 8]].tolist() == [0x00, 0x0F]
    assert torch.equal(packed["global_scale"], torch.tensor(state_scale))
    # dequantise: (code * s_b) * s_g, e.g. 6 * 80 = 480 for the 500 of row 0
    values = dequantize(q) / state_scale
    assert values[0, [0, 1, 2, 16, 17, 18, 20]].tolist() == [2688, 896, 672, 480, 240, -120, 80]
    assert values[2].abs().sum() == 432


def test_mxfp4_worked_example_power_of_two_scales_and_clamp():
    """Block amax 5: s_b = 2^(floor(log2 5) - 2) = 1 (byte 127); 5 -> 4 (tie, even), 3.5 -> 4.
    Block amax 127: s_b = 2^(6 - 2) = 16 (byte 131); 127 / 16 = 7.9 saturates to 6;
    100 / 16 = 6.25 -> 6; 9 / 16 = 0.5625 -> 0.5. Zero block: 2^-127 (byte 0). Block amax
    3 * 2^-128: exponent -129 clamps to -127; 3 * 2^-128 / 2^-127 = 1.5 -> 1.5."""
    x = torch.zeros(2, 64)
    x[0, :3] = torch.tensor([5.0, 3.5, -0.2])
    x[0, 32:35] = torch.tensor([127.0, 100.0, 9.0])
    x[1, 32] = 3 * 2.0**-128
    q = quantize(x, "mxfp4")
    assert q.global_scale is None
    assert q.scales.tolist() == [[1.0, 16.0], [2.0**-127, 2.0**-127]]
    assert q.elements[:, [0, 1, 2, 32, 33, 34]].tolist() == [
        [4.0, 4.0, -0.0, 6.0, 6.0, 0.5],
        [0.0, 0.0, 0.0, 1.5, 0.0, 0.0],
    ]
    packed = pack(q)
    assert packed["scales"].tolist() == [[127, 131], [0, 0]]
    assert packed["codes"][:, [0, 1, 16, 17]].tolist() == [[0x66, 0x08, 0x77, 0x01], [0, 0, 3, 0]]
    assert dequantize(q)[0, 32:35].tolist() == [96.0, 96.0, 8.0]


def test_fp4_e2m1_b32_is_mxfp4_without_its_scale_rounding():
    """Blocks of 32 both: where a block's amax is 6 * 2^k, mxfp4's E8M0 scale
    2^(floor(log2 amax) - 2) is the ideal amax / 6, and the two formats store the same
    elements and scales; elsewhere the ideal scale is never a worse fit on Gaussian blocks."""
    g = torch.Generator().manual_seed(61)
    x = torch.randn(4, 9, 64, generator=g)
    amax = x.reshape(4, 9, 2, 32).abs().amax(-1, keepdim=True)
    k = torch.randint(-20, 20, amax.shape, generator=g).float()
    x = (x.reshape(4, 9, 2, 32) / amax * 6 * torch.exp2(k)).reshape(4, 9, 64)
    ideal, mx = quantize(x, "fp4_e2m1_b32"), quantize(x, "mxfp4")
    assert torch.equal(ideal.scales, torch.exp2(k)[..., 0]) and torch.equal(ideal.scales, mx.scales)
    assert torch.equal(ideal.elements, mx.elements)
    y = torch.randn(9, 33, 128, generator=g)
    assert sqnr_db(y, fake_quantize(y, "fp4_e2m1_b32")) > sqnr_db(y, fake_quantize(y, "mxfp4"))


def test_ideal_scale_formats_worked_examples():
    """fp4_e2m1_b16: block amax 3 -> s = 3 / 6 = 0.5; 1.2 / 0.5 = 2.4 -> 2, back to 1.0.
    fp8_e4m3_row: row amax 896 -> s = 2; 300 / 2 = 150 -> 144 (ulp 16), back to 288."""
    x = torch.zeros(2, 16)
    x[0, :2] = torch.tensor([3.0, 1.2])
    q = quantize(x, "fp4_e2m1_b16")
    assert q.scales.tolist() == [[0.5], [0.0]]
    assert dequantize(q)[0, :2].tolist() == [3.0, 1.0]
    x[1, :2] = torch.tensor([896.0, 300.0])
    q = quantize(x, "fp8_e4m3_row")
    assert torch.equal(q.scales, torch.tensor([[3.0], [896.0]]) / 448.0)  # fp32 divisions
    assert q.elements[1, :2].tolist() == [448.0, 144.0]
    assert dequantize(q)[1, :2].tolist() == [896.0, 288.0]


def test_nvfp4_scale_arithmetic_is_fp32_in_readme_order():
    """Random states: every intermediate equals the fp32 operation of README's formula."""
    g = torch.Generator().manual_seed(41)
    n = 301
    x = torch.randn(n, 7, 48, generator=g) * torch.exp2(torch.randn(n, 1, 1, generator=g) * 8)
    q = quantize(x, "nvfp4")
    amax_b = x.abs().reshape(n, 7, 3, 16).amax(-1)
    amax = x.abs().amax(dim=(-2, -1))
    s_g = amax / torch.tensor(2688.0)
    assert not torch.equal(s_g, amax * (1 / 2688.0))  # a reciprocal would be caught
    s_b = round_to(amax_b / (torch.tensor(6.0) * s_g)[:, None, None], E4M3)
    scale = (s_b * s_g[:, None, None])[..., None]
    codes = round_to(x.reshape(n, 7, 3, 16) / scale, E2M1).reshape(x.shape)
    assert torch.equal(q.global_scale, s_g) and torch.equal(q.scales, s_b)
    assert_same(q.elements, codes)
    expected = (codes.reshape(n, 7, 3, 16) * s_b[..., None]) * s_g[:, None, None, None]
    assert_same(dequantize(q), expected.reshape(x.shape))


def test_nvfp4_block_scales_at_e4m3_ties_follow_readme_division_order():
    """Block amaxes within a few fp32 ulps of (E4M3 midpoint) * den, where one ulp of the
    quotient decides s_b: s_b must be RN_e4m3(amax_b / den) with den = 6 * s_g rounded first
    (amax_b / 6 / s_g, or amax_b * (1 / den), would flip some of these)."""
    grid = decode_bits(torch.arange(0x7F), E4M3).double()  # 0 .. 448
    midpoints = ((grid[:-1] + grid[1:]) / 2)[1:]
    s_g = torch.tensor(1000.0) / 2688.0
    den = torch.tensor(6.0) * s_g
    centre = (midpoints * den.double()).float()
    amax_b = torch.cat([centre + k * torch.finfo().eps * centre for k in range(-3, 4)])
    amax_b = torch.cat([torch.tensor([1000.0]), amax_b[amax_b < 1000]])
    x = torch.zeros(len(amax_b), 16)
    x[:, 5] = amax_b
    q = quantize(x, "nvfp4")
    assert q.global_scale == s_g
    expected = round_to(amax_b / den, E4M3)
    assert torch.equal(q.scales[:, 0], expected)
    assert not torch.equal(expected, round_to(amax_b / 6.0 / s_g, E4M3))  # the test can tell


# --------------------------------------------------------------------------------------------
# zero blocks, SR, fp64 input


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_all_zero_state_stores_zero_codes_and_dequantises_to_zero(fmt):
    x = torch.zeros(3, 5, 64)
    x[1, 2, 7] = -0.0
    q = quantize(x, fmt)
    assert not bool(q.elements.signbit().any()) and bool((q.elements == 0).all())
    assert bool(q.scales.isfinite().all())
    if fmt == "nvfp4":
        assert bool((q.global_scale == 0).all()) and bool((q.scales == 0).all())
    packed = pack(q)
    assert bool((packed["codes"] == 0).all())
    if packed["scales"].dtype == torch.uint8:
        assert bool((packed["scales"] == 0).all())  # E4M3 zero, or E8M0 2^-127
    assert torch.equal(dequantize(q), torch.zeros_like(x))


def test_nvfp4_zero_block_inside_a_nonzero_state_keeps_the_other_blocks():
    g = torch.Generator().manual_seed(43)
    x = torch.randn(2, 3, 48, generator=g)
    x[1, 2, 16:32] = 0.0
    q = quantize(x, "nvfp4")
    assert q.scales[1, 2, 1] == 0 and bool((q.scales[0] > 0).all())
    assert torch.equal(dequantize(q)[1, 2, 16:32], torch.zeros(16))
    assert sqnr_db(x, dequantize(q)) > 15


def test_nvfp4_blocks_whose_divisor_underflows_store_zero_codes_and_the_computed_scale():
    """Where s_b * s_g is 0 the codes are +0 and the scale byte is the one computed, as the
    module doc says: s_g underflowing to 0 (amax below 2688 * 2^-150) gives amax_b / 0 = inf,
    which saturates s_b at 448 (0x7E); s_g and s_b nonzero with an underflowing product keep
    s_b's byte. A block left alone beside them keeps its codes."""
    tiny = torch.zeros(1, 16)
    tiny[0, 0], tiny[0, 3] = 1000 * 2.0**-149, -7 * 2.0**-149  # fp32 subnormals
    q = quantize(tiny, "nvfp4")
    packed = pack(q)
    assert q.global_scale.item() == 0.0 and q.scales.item() == 448.0
    assert packed["scales"].item() == 0x7E and not packed["codes"].any()
    assert torch.equal(dequantize(q), torch.zeros(1, 16))

    mixed = torch.zeros(1, 32)
    mixed[0, 0] = 2688 * 2.0**-141  # s_g = 2^-141 (subnormal), block 0 s_b = 448
    mixed[0, 16] = 2.0**-148  # block 1: s_b = RN_e4m3(2^-148 / (6 2^-141)) = 2^-9, s_b s_g -> 0
    q = quantize(mixed, "nvfp4")
    packed = pack(q)
    assert q.global_scale.item() == 2.0**-141
    assert q.scales[0].tolist() == [448.0, 2.0**-9]
    assert packed["scales"][0].tolist() == [0x7E, 0x01]
    assert not packed["codes"][0, 8:].any()  # block 1: every code +0
    assert packed["codes"][0, 0].item() & 0xF == 0x7  # block 0: 6 * 448 * s_g, code 6
    assert dequantize(q)[0, 16].item() == 0.0


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_sr_rounds_elements_only_with_the_words_given(fmt):
    """SR scales equal RN scales; SR codes are ROUND_sr(x / scale) with each element's word,
    so each is one of the two grid neighbours of x / scale."""
    g = torch.Generator().manual_seed(47)
    x = torch.randn(3, 5, 64, generator=g)
    words = philox.random_words(9, torch.arange(3), 4, (5, 64))
    rn, sr = quantize(x, fmt), quantize(x, fmt, "sr", words)
    assert torch.equal(rn.scales, sr.scales)
    y = x / (dequantize(Quantized(rn.fmt, torch.ones_like(x), rn.scales, rn.global_scale)))
    assert_same(sr.elements, round_to(y, rn.fmt.element, "sr", words))
    assert not torch.equal(rn.elements, sr.elements)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_fp64_input_is_quantised_from_its_fp32_value_and_returns_fp64(fmt):
    g = torch.Generator().manual_seed(53)
    x = torch.randn(3, 5, 64, generator=g, dtype=torch.float64)
    q64, q32 = quantize(x, fmt), quantize(x.float(), fmt)
    assert q64.elements.dtype == torch.float64 and dequantize(q64).dtype == torch.float64
    assert_same(q64.elements, q32.elements.double())
    assert_same(dequantize(q64), dequantize(q32).double())


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_fp64_input_past_fp32_max_saturates_like_round_to_fp32(fmt):
    """A finite fp64 element past FLT_MAX is RN'd to fp32 saturating (as round_to(x, FP32)),
    not converted to inf, which made nvfp4's whole state NaN (amax inf: s_g inf)."""
    g = torch.Generator().manual_seed(59)
    x = torch.randn(3, 5, 96, generator=g, dtype=torch.float64) * 1e37
    x[0, 1, 7], x[2, 4, 50], x[1, 3, 33] = 1e39, -5e38, 3.4028235e38 * (1 + 2**-30)
    flt_max = torch.finfo(torch.float32).max
    saturated = x.clamp(-flt_max, flt_max)
    assert_same(round_to(x, FP32), saturated.float().double())  # what block formats start from
    q, expected = quantize(x, fmt), quantize(saturated.float(), fmt)
    assert not q.elements.isnan().any() and dequantize(q).isfinite().all()
    assert_same(q.elements, expected.elements.double())
    assert_same(q.scales, expected.scales)
    top = expected.fmt.element.max_finite
    assert q.elements[0, 1, 7] == top and q.elements[2, 4, 50] == -top
    words = philox.random_words(5, torch.arange(3), 2, (5, 96))
    assert_same(quantize(x, fmt, "sr", words).elements,
                quantize(saturated.float(), fmt, "sr", words).elements.double())


# --------------------------------------------------------------------------------------------
# SQNR floors

# Gaussian states [9, 33, 128], seed 0. Uniform-error model: RN error variance step^2 / 12 at
# each element's grid spacing. For an unscaled format with log-uniform mantissas,
# E[(step / x)^2] = 4^-mbits * E[(2^e / x)^2] = 4^-mbits * (3/4) / (2 ln 2) = 0.541 * 4^-mbits,
# so SQNR = 10 log10(12 / 0.541) + 6.02 mbits = 13.46 + 6.02 mbits dB: fp16 73.7, bf16 55.6,
# e4m3 31.5, e5m2 25.5 (fp8_e4m3_row puts the bulk in e4m3's normal range: 31.5 too). For the
# E2M1 block formats the same model, evaluated at y = x / scale on these states (a third of y
# lies in the subnormal step 0.5 below 1), gives 19.3 dB for nvfp4 and fp4_e2m1_b16 and
# 19.0 dB for mxfp4 (power-of-two scales waste up to a binade). RN floors: model - 1 dB
# (measured: 73.7, 55.6, 31.5, 25.5, 31.8, 20.4, 20.5, 18.8). SR's error variance is
# p (1 - p) step^2, on average step^2 / 6: twice RN's, 3 dB lower; SR floors: RN floors - 3 dB
# (measured 70.6, 52.5, 28.6, 22.5, 28.8, 17.2, 17.5, 16.0). fp4_e2m1_b32 (ideal scales on
# mxfp4's blocks of 32) measured 19.9 RN and 16.8 SR: its floor is mxfp4's plus 0.8 dB, the
# scale rounding it leaves out.
SQNR_FLOOR_DB = {
    "fp16": 72.7,
    "bf16": 54.6,
    "fp8_e4m3": 30.5,
    "fp8_e5m2": 24.5,
    "fp8_e4m3_row": 30.5,
    "nvfp4": 18.3,
    "fp4_e2m1_b16": 18.3,
    "mxfp4": 18.0,
    "fp4_e2m1_b32": 18.8,
}


@pytest.mark.parametrize("rounding", ["rn", "sr"])
@pytest.mark.parametrize("fmt", list(SQNR_FLOOR_DB))
def test_sqnr_of_gaussian_states_is_above_the_model_floor(fmt, rounding):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 33, 128, generator=g)
    words = philox.random_words(1, torch.arange(9), 0, (33, 128)) if rounding == "sr" else None
    floor = SQNR_FLOOR_DB[fmt] - (3.0 if rounding == "sr" else 0.0)
    assert sqnr_db(x, fake_quantize(x, fmt, rounding, words)) > floor


def test_exact_formats_store_the_state_unchanged():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    assert torch.equal(fake_quantize(x, "fp64"), x)
    assert torch.equal(fake_quantize(x.float(), "fp32"), x.float())


class _OpLog(TorchDispatchMode):
    """Every aten op a block of code dispatches, with the dtype and size of its outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func), [(o.dtype, o.numel()) for o in outs
                                     if isinstance(o, torch.Tensor)]))
        return out


def _ops_of_nvfp4_fp64(shape):
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    fake_quantize(x, "nvfp4")  # fills the power-of-two tables once
    with _OpLog() as log:
        fake_quantize(x, "nvfp4")
    full_fp64 = [name for name, outs in log.ops
                 if any(dtype == torch.float64 and n >= x.numel() for dtype, n in outs)]
    return log.ops, full_fp64


def test_nvfp4_fake_quantize_of_an_fp64_state_is_a_fixed_count_of_fp32_tensor_ops():
    """It runs at every flush, so the work is checked, not the clock: a [64, 64, 128] fp64
    state dispatches exactly the ops of a [3, 16, 32] one (no loop over rows or blocks), under
    100 of them, and only four produce a full-size fp64 tensor: the saturating conversion to
    fp32 (clamp, where, the cast) and the cast of the result back; the arithmetic is fp32."""
    small_ops, small_fp64 = _ops_of_nvfp4_fp64((3, 16, 32))
    large_ops, large_fp64 = _ops_of_nvfp4_fp64((64, 64, 128))
    assert [name for name, _ in large_ops] == [name for name, _ in small_ops]
    assert len(large_ops) < 100, len(large_ops)
    assert large_fp64 == ["aten.clamp.default", "aten.where.self", "aten._to_copy.default",
                          "aten._to_copy.default"], large_fp64
    assert small_fp64 == large_fp64


# --------------------------------------------------------------------------------------------
# packed storage

PACKED_LAYOUT = {  # name -> {key: (dtype, shape of [3, 5, 7, 64])}
    "fp64": {"codes": (torch.uint64, (3, 5, 7, 64))},
    "fp32": {"codes": (torch.uint32, (3, 5, 7, 64))},
    "fp16": {"codes": (torch.uint16, (3, 5, 7, 64))},
    "bf16": {"codes": (torch.uint16, (3, 5, 7, 64))},
    "fp8_e4m3": {"codes": (torch.uint8, (3, 5, 7, 64))},
    "fp8_e5m2": {"codes": (torch.uint8, (3, 5, 7, 64))},
    "nvfp4": {
        "codes": (torch.uint8, (3, 5, 7, 32)),
        "scales": (torch.uint8, (3, 5, 7, 4)),
        "global_scale": (torch.float32, (3, 5)),
    },
    "mxfp4": {"codes": (torch.uint8, (3, 5, 7, 32)), "scales": (torch.uint8, (3, 5, 7, 2))},
    "fp8_e4m3_row": {
        "codes": (torch.uint8, (3, 5, 7, 64)),
        "scales": (torch.float32, (3, 5, 7, 1)),
    },
    "fp4_e2m1_b16": {
        "codes": (torch.uint8, (3, 5, 7, 32)),
        "scales": (torch.float32, (3, 5, 7, 4)),
    },
    "fp4_e2m1_b32": {
        "codes": (torch.uint8, (3, 5, 7, 32)),
        "scales": (torch.float32, (3, 5, 7, 2)),
    },
}


@pytest.mark.parametrize("rounding", ["rn", "sr"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("fmt", formats.names())
def test_pack_unpack_round_trip_is_exact_with_the_documented_layout(fmt, dtype, rounding):
    g = torch.Generator().manual_seed(59)
    shape = (3, 5, 7, 64)
    x = torch.randn(shape, generator=g, dtype=dtype)
    x = x * torch.exp2(torch.randint(-12, 12, (3, 5, 1, 1), generator=g)).to(dtype)
    x[0, 0, 0, :5] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.0])
    draws = 1 << philox.DEFAULT_SR_BITS  # the default SR draws: random 16-bit values
    words = torch.randint(0, draws, shape, generator=g) if rounding == "sr" else None
    q = quantize(x, fmt, rounding, words)
    packed = pack(q)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in packed.items()} == PACKED_LAYOUT[fmt]
    back = unpack(packed, fmt, shape, dtype)
    assert back.fmt == q.fmt
    assert_same(back.elements, q.elements, "elements")
    for name in ("scales", "global_scale"):
        ours, theirs = getattr(back, name), getattr(q, name)
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert_same(ours, theirs, name)
    assert_same(dequantize(back), dequantize(q), "values")


def test_four_bit_codes_put_the_even_index_in_the_low_nibble():
    """Elements [0.5, -6] pack to one byte: 0.5 -> nibble 0x1 (low), -6 -> 0xF (high)."""
    q = Quantized(formats.get("fp4_e2m1_b16"), torch.zeros(1, 16), torch.ones(1, 1))
    q.elements[0, :2] = torch.tensor([0.5, -6.0])
    assert pack(q)["codes"][0].tolist() == [0xF1] + [0] * 7


def test_unpack_rejects_missing_keys_and_wrong_shapes():
    q = quantize(torch.randn(2, 5, 32), "nvfp4")
    packed = pack(q)
    with pytest.raises(ValueError, match="packed: expected keys"):
        unpack({"codes": packed["codes"]}, "nvfp4", (2, 5, 32))
    with pytest.raises(ValueError, match=r"packed\['scales'\]: expected torch.uint8 \[2, 5, 2\]"):
        unpack({**packed, "scales": packed["scales"][..., :1]}, "nvfp4", (2, 5, 32))


def test_unpack_takes_every_finite_e8m0_byte_and_refuses_nan():
    """mxfp4 scale bytes 0..254 are 2^-127..2^127 and unpack as such; 255 is E8M0's NaN,
    refused by name (it would decode as 2^128, which is no scale)."""
    q = quantize(torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(8)), "mxfp4")
    packed = pack(q)
    scales = torch.arange(42, dtype=torch.uint8).reshape(3, 7, 2) * 6 + 1  # 1 .. 247
    scales[1, 3, 1], scales[2, 6, 0], scales[0, 0, 0] = 254, 0, 253
    back = unpack({**packed, "scales": scales}, "mxfp4", (3, 7, 64))
    assert torch.equal(back.scales, torch.exp2(scales.double() - 127).float())
    scales[2, 1, 1] = 255
    with pytest.raises(ValueError, match=r"expected E8M0 bytes in \[0, 254\] .* got 255"):
        unpack({**packed, "scales": scales}, "mxfp4", (3, 7, 64))


# --------------------------------------------------------------------------------------------
# element codes

ML_TWINS = [
    (FP16, np.float16, np.uint16),
    (BF16, ml_dtypes.bfloat16, np.uint16),
    (E4M3, ml_dtypes.float8_e4m3fn, np.uint8),
    (E5M2, ml_dtypes.float8_e5m2, np.uint8),
    (E2M1, ml_dtypes.float4_e2m1fn, np.uint8),
]


@pytest.mark.parametrize("element,ml_dtype,uint", ML_TWINS, ids=lambda v: getattr(v, "name", ""))
def test_every_code_decodes_like_ml_dtypes_and_encodes_back(element, ml_dtype, uint):
    codes = np.arange(1 << element.bits, dtype=uint)
    with np.errstate(invalid="ignore"):
        expected = torch.from_numpy(codes.view(ml_dtype).astype(np.float32))
    ours = decode_bits(torch.from_numpy(codes.astype(np.int64)), element)
    assert_same(ours, expected, element.name)
    finite = ~ours.isnan()
    assert torch.equal(encode_bits(ours[finite], element), torch.arange(1 << element.bits)[finite])
    if element.has_inf or element is E4M3:
        # the canonical NaN, the library's: any NaN code would decode to NaN
        nan_code = int(encode_bits(torch.tensor([math.nan]), element))
        assert nan_code == int(np.array([math.nan]).astype(ml_dtype).view(uint)[0])
        assert math.isnan(float(decode_bits(torch.tensor([nan_code]), element)))


def test_wide_formats_encode_like_their_bit_views():
    g = torch.Generator().manual_seed(61)
    x = torch.randn(1001, generator=g) * torch.exp2(torch.randint(-140, 120, (1001,), generator=g))
    x = torch.cat([x, torch.tensor([0.0, -0.0, math.inf, -math.inf, 2.0**-149])])
    assert torch.equal(encode_bits(x, FP32), x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
    assert torch.equal(encode_bits(x.double(), FP64), x.double().view(torch.int64))
    assert_same(decode_bits(encode_bits(x, FP32), FP32), x)


def test_encode_bits_rejects_values_the_format_cannot_hold():
    with pytest.raises(ValueError, match="values: expected values on the e2m1 grid, got 2.5"):
        encode_bits(torch.tensor([1.0, 2.5]), E2M1)
    with pytest.raises(ValueError, match="e2m1 has no NaN encoding"):
        encode_bits(torch.tensor([math.nan]), E2M1)
    with pytest.raises(ValueError, match="e4m3 has no infinity"):
        encode_bits(torch.tensor([math.inf]), E4M3)
    with pytest.raises(ValueError, match="codes: expected values in"):
        decode_bits(torch.tensor([16]), E2M1)


# --------------------------------------------------------------------------------------------
# validation


def test_quantize_rejects_bad_arguments_with_value_errors_naming_them():
    x = torch.randn(2, 3, 48)
    with pytest.raises(ValueError, match=r"format: expected one of .* got 'nvfp8'"):
        quantize(x, "nvfp8")
    with pytest.raises(ValueError, match=r"d_k.*block 32.*got d_k=48"):
        quantize(x, "mxfp4")
    with pytest.raises(ValueError, match=r"expects \[..., d_v, d_k\]"):
        quantize(torch.randn(32), "nvfp4")
    with pytest.raises(ValueError, match=r"rand: expected shape \[2, 3, 48\], got \[2, 3, 16\]"):
        quantize(x, "nvfp4", "sr", torch.zeros(2, 3, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="rounding: expected one of"):
        quantize(x, "nvfp4", "stochastic")
    with pytest.raises(ValueError, match="x: expected dtype float16, bfloat16, float32 or"):
        quantize(x.to(torch.complex64), "nvfp4")


def test_format_definitions_that_pack_could_not_store_are_refused():
    """An E4M3 block scale without its per-state scale (computed with an s_g that pack then
    dropped: unpack gave other values), a fractional block, an empty d_k or d_v: refused
    with the argument named; round_to takes an element's name as quantize takes a format's."""
    with pytest.raises(ValueError, match="two_level: expected True exactly with an 'e4m3'"):
        formats.Format("e2m1_e4m3_b16", E2M1, block=16, scale="e4m3")
    with pytest.raises(ValueError, match="block: expected an int"):
        formats.Format("odd", E2M1, block=2.5, scale="fp32")
    with pytest.raises(ValueError, match=r"positive multiple of block 16 .* d_k=0"):
        quantize(torch.randn(2, 4, 0), "nvfp4")
    with pytest.raises(ValueError, match="x: expected d_v >= 1 for 'nvfp4'"):
        quantize(torch.randn(0, 16), "nvfp4")
    x = torch.randn(5, 7) * 100
    assert torch.equal(round_to(x, "fp16"), round_to(x, FP16))
    with pytest.raises(ValueError, match="element: expected an ElementFormat or one of"):
        round_to(x, "nvfp4")
