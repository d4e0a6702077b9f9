"""Properties of `lowprec.quantize` over generated inputs (hypothesis, derandomised so that a CI
run is reproducible):

- the storage round trip `quantize -> pack -> unpack -> dequantize` equals `fake_quantize`
  bit for bit, for every format, fp16/bf16/fp32/fp64 inputs, odd and empty shapes,
  non-contiguous strides and special values (+-0, subnormals, the format's maximum and its
  neighbours, values past it, and inf/NaN where the format defines them);
- the storage readers, given storage with random bytes flipped, either decode a tensor of the
  right shape (never a NaN from a scale) or raise ValueError, never another exception;
- SR from `seed=` is reproducible, and unbiased on an exhaustive grid of its words' top bits.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowprec
from lowprec import formats, philox

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ALL_FORMATS = tuple(formats.names())
BLOCK_FORMATS = tuple(n for n in ALL_FORMATS if formats.get(n).block is not None)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype, shape and values, signs of zeros included; NaN where the other has NaN."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    g, w = got[~nan], want[~nan]
    return torch.equal(g, w) and torch.equal(g.signbit(), w.signbit())


def _specials(fmt: formats.Format, dtype: torch.dtype) -> list[float]:
    """Values where rounding has edges: zeros, the element's maximum, its neighbours and past
    it, the element's and the input dtype's smallest subnormals; inf and NaN for element
    formats (which saturate or keep them), not for block formats (outside their contract)."""
    element, info = fmt.element, torch.finfo(dtype)
    top = element.max_finite if fmt.block is None else element.max_finite * 100.0
    dtype_max = float(info.max)
    top = min(top, dtype_max)
    values = [0.0, -0.0, top, -top, math.nextafter(top, 0.0), math.nextafter(top, math.inf),
              dtype_max, element.min_subnormal, element.min_subnormal / 2,
              element.min_subnormal * 1.5, info.smallest_normal * info.eps, 1.0, -3.0]
    if fmt.block is None:
        values += [math.inf, -math.inf, math.nan]
    return values


@st.composite
def _states(draw, fmt_names=ALL_FORMATS):
    """(format name, x): x state-shaped for the format, any of the four dtypes, maybe an empty
    batch, maybe a non-contiguous view."""
    name = draw(st.sampled_from(fmt_names))
    fmt = formats.get(name)
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.lists(st.integers(0, 3), max_size=2))
    d_v = draw(st.integers(1, 5))
    if fmt.block is None or fmt.block == formats.ROW:
        d_k = draw(st.integers(1, 9))
        if fmt.element.bits == 4:
            d_k *= 2
    else:
        d_k = fmt.block * draw(st.integers(1, 2))
    shape = (*batch, d_v, d_k)
    numel = math.prod(shape)
    pool = st.one_of(st.sampled_from(_specials(fmt, dtype)),
                     st.floats(-2.0**14, 2.0**14, allow_nan=False, width=32),
                     st.floats(-2.0**-10, 2.0**-10, allow_nan=False, width=32))
    values = draw(st.lists(pool, min_size=numel, max_size=numel))
    x = torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)
    if fmt.block is not None:  # a cast may overflow to inf: block formats take finite states
        x = torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype))
    layout = draw(st.sampled_from(["contiguous", "strided", "transposed"]))
    if layout == "strided":  # every other column of a wider tensor
        wide = torch.zeros((*shape[:-1], 2 * d_k), dtype=dtype)
        wide[..., ::2] = x
        x = wide[..., ::2]
    elif layout == "transposed":  # [.., d_k, d_v] storage read as [.., d_v, d_k]
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return name, x


@PROPERTY
@given(case=_states(), rounding=st.sampled_from(["rn", "sr"]), seed=st.integers(0, 2**64 - 1))
def test_the_storage_round_trip_is_fake_quantize_bit_for_bit(case, rounding, seed):
    name, x = case
    sr = {"seed": seed} if rounding == "sr" else {}
    q = lowprec.quantize(x, name, rounding, **sr)
    back = lowprec.unpack(lowprec.pack(q), name, x.shape, q.elements.dtype)
    assert _same(back.elements, q.elements)
    for field in ("scales", "global_scale"):
        if getattr(q, field) is not None:
            assert _same(getattr(back, field), getattr(q, field)), field
    want = lowprec.fake_quantize(x, name, rounding, **sr)
    assert want.dtype == lowprec.result_dtype(name, x.dtype)
    assert _same(lowprec.dequantize(back), want)
    assert _same(lowprec.fake_quantize(x.contiguous(), name, rounding, **sr), want)


def _overwrite(t: torch.Tensor, positions, values) -> torch.Tensor:
    """`t` with the bytes at `positions` (of its byte view, wrapped) set to `values`."""
    raw = t.contiguous().clone().reshape(-1).view(torch.uint8)
    for pos, value in zip(positions, values, strict=False):
        raw[pos % raw.numel()] = value
    return raw.view(t.dtype).reshape(t.shape)


# NaN and sign bytes of E4M3/E8M0 and of an fp32's top byte come up often, any byte otherwise
_BYTES = st.one_of(st.sampled_from([0x7F, 0xFF, 0x80, 0xFE, 0x7E]), st.integers(0, 255))


@settings(PROPERTY, max_examples=100)
@given(case=_states(), data=st.data(),
       positions=st.lists(st.integers(0, 10**6), min_size=1, max_size=4),
       values=st.lists(_BYTES, min_size=4, max_size=4))
def test_a_reader_given_corrupted_bytes_decodes_or_raises_value_error(case, data, positions,
                                                                     values):
    """Either a tensor of x's shape comes back (for a block format without NaN: a scale is
    finite and >= 0, a code finite) or ValueError; any other exception fails."""
    name, x = case
    fmt = formats.get(name)
    packed = lowprec.pack(lowprec.quantize(x, name))
    key = data.draw(st.sampled_from(sorted(packed)), label="key")
    if not packed[key].numel():
        return
    packed[key] = _overwrite(packed[key], positions, values)
    dtype = lowprec.quantize(x, name).elements.dtype
    try:
        values = lowprec.dequantize(lowprec.unpack(packed, name, x.shape, dtype))
    except ValueError:
        return
    assert values.shape == x.shape
    if fmt.block is not None:
        assert not bool(values.isnan().any())


@PROPERTY
@given(case=_states(BLOCK_FORMATS), index=st.integers(0, 10**6))
def test_a_nan_or_negative_scale_byte_is_refused(case, index):
    """E4M3 bytes 0x7F/0xFF (NaN) and any byte with the sign bit: refused, naming the field."""
    name, x = case
    packed = lowprec.pack(lowprec.quantize(x, name))
    scales = packed["scales"]
    if not scales.numel():
        return
    if scales.dtype == torch.uint8:
        bad = {"e4m3": 0x7F + 0x80 * (index % 2), "e8m0": 0xFF}[formats.get(name).scale]
    else:
        bad = -1.0 if index % 2 else math.nan
    scales.view(-1)[index % scales.numel()] = bad
    with pytest.raises(ValueError, match=r"packed\['scales'\]"):
        lowprec.unpack(packed, name, x.shape, x.dtype)


ELEMENTS = ["e2m1", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16"]


@PROPERTY
@given(element=st.sampled_from(ELEMENTS), seed=st.integers(0, 2**64 - 1),
       shape=st.lists(st.integers(0, 6), min_size=1, max_size=3),
       dtype=st.sampled_from(DTYPES))
def test_sr_from_a_seed_is_reproducible_and_is_the_seeds_philox_words(element, seed, shape,
                                                                      dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed % 1000)).to(dtype)
    first = lowprec.round_to(x, element, "sr", seed=seed)
    assert _same(lowprec.round_to(x, element, "sr", seed=seed), first)
    words = philox.random_words(seed, 0, 0, tuple(shape))
    assert _same(lowprec.round_to(x, element, "sr", words), first)


@PROPERTY
@given(element=st.sampled_from(["e2m1", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16"]),
       exponent=st.integers(-6, 6), significand=st.integers(0, 15), k=st.integers(0, 15),
       low_bits=st.integers(0, 2**28 - 1), negative=st.booleans())
def test_sr_is_unbiased_over_every_value_of_its_words_top_four_bits(element, exponent,
                                                                   significand, k, low_bits,
                                                                   negative):
    """x = lo + (k / 16) ulp lies between grid neighbours lo and lo + ulp; with 32-bit words
    r_j = j * 2^28 + c (j = 0..15, any low bits c) exactly k of the 16 round up, since
    r < floor(k/16 * 2^32) = k * 2^28 iff j < k. So the mean of the 16 results is x itself."""
    fmt = formats.get(element) if element in formats.names() else None
    e = fmt.element if fmt else formats.ELEMENTS[element]
    binade = max(min(exponent, e.emax - 1), e.emin)
    ulp = math.ldexp(1.0, binade - e.mbits)
    lo = math.ldexp(1.0, binade) + (significand % (1 << e.mbits)) * ulp
    x_value = (lo + k / 16 * ulp) * (-1 if negative else 1)
    x = torch.full((16,), x_value, dtype=torch.float64)
    words = torch.arange(16, dtype=torch.int64) * 2**28 + low_bits
    rounded = lowprec.round_to(x, e, "sr", words, sr_bits=32)
    assert int((rounded.abs() > lo).sum()) == k
    assert rounded.mean().item() == x_value
