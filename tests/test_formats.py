"""Formats as data: element constants agree with the libraries, storage sizes with DESIGN.md."""

import math

import ml_dtypes
import pytest
import torch

from lowprec import formats, philox
from lowprec.formats import BF16, E2M1, E4M3, E5M2, FP16, FP32, FP64, ROW, Format

# element format -> the same format in torch (None: torch has no fp4) and in ml_dtypes
LIBRARY_TWINS = [
    (FP64, torch.float64, None),
    (FP32, torch.float32, None),
    (FP16, torch.float16, None),
    (BF16, torch.bfloat16, ml_dtypes.bfloat16),
    (E4M3, torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    (E5M2, torch.float8_e5m2, ml_dtypes.float8_e5m2),
    (E2M1, None, ml_dtypes.float4_e2m1fn),
]


def test_names_are_the_documented_list_and_get_returns_each():
    assert formats.names() == [
        "fp64",
        "fp32",
        "fp16",
        "bf16",
        "fp8_e4m3",
        "fp8_e5m2",
        "nvfp4",
        "mxfp4",
        "fp8_e4m3_row",
        "fp4_e2m1_b16",
        "fp4_e2m1_b32",
    ]
    for name in formats.names():
        assert formats.get(name).name == name
        assert formats.get(formats.get(name)) is formats.get(name)


def test_unknown_format_raises_value_error_listing_the_known_names():
    with pytest.raises(ValueError, match=r"format: expected one of \['fp64'.*got 'fp6'"):
        formats.get("fp6")


@pytest.mark.parametrize("element,torch_dtype,ml_dtype", LIBRARY_TWINS, ids=lambda v: str(v))
def test_element_constants_match_the_libraries(element, torch_dtype, ml_dtype):
    """max_finite, smallest normal 2^emin, epsilon 2^-mbits and width agree with finfo."""
    info = torch.finfo(torch_dtype) if torch_dtype is not None else ml_dtypes.finfo(ml_dtype)
    assert element.max_finite == float(info.max)
    assert math.ldexp(1.0, element.emin) == float(info.smallest_normal)
    assert math.ldexp(1.0, -element.mbits) == float(info.eps)
    assert element.bits == info.bits
    assert element.emin == 1 - element.bias


def test_only_ieee_style_formats_reserve_the_top_exponent_for_inf():
    assert [e.name for e in formats.ELEMENTS.values() if e.has_inf] == [
        "fp64",
        "fp32",
        "fp16",
        "bf16",
        "e5m2",
    ]


def test_block_formats_are_described_by_their_fields():
    assert formats.get("nvfp4") == Format("nvfp4", E2M1, 16, "e4m3", True)
    assert formats.get("mxfp4") == Format("mxfp4", E2M1, 32, "e8m0", False)
    assert formats.get("fp8_e4m3_row") == Format("fp8_e4m3_row", E4M3, ROW, "fp32", False)
    assert formats.get("fp4_e2m1_b16") == Format("fp4_e2m1_b16", E2M1, 16, "fp32", False)
    assert formats.get("fp16") == Format("fp16", FP16)


def test_bits_per_element_amortise_block_scales():
    """nvfp4: 4 + 8/16; mxfp4: 4 + 8/32; fp4_e2m1_b16: 4 + 32/16; unscaled: the element."""
    expected = {"nvfp4": 4.5, "mxfp4": 4.25, "fp4_e2m1_b16": 6.0, "fp16": 16.0, "fp8_e4m3_row": 8.0}
    for name, bits in expected.items():
        assert formats.get(name).bits_per_element == bits


def test_nemotron_state_bytes_match_design():
    """DESIGN.md: one fp32 state [128, 64, 128] is 4 MiB; its NVFP4 read copy is 576 KiB of
    codes and E4M3 scales, plus 128 fp32 second-level scales (512 B)."""
    shape = (128, 64, 128)
    assert formats.get("fp32").nbytes(shape) == 4 * 2**20
    assert formats.get("fp16").nbytes(shape) == 2 * 2**20
    assert formats.get("nvfp4").nbytes(shape) == 576 * 2**10 + 128 * 4
    assert formats.get("mxfp4").nbytes(shape) == 512 * 2**10 + 2**20 // 32
    assert formats.get("nvfp4").bits_per_element_at(shape) == 4.5 + 32 * 128 / 2**20


def test_nbytes_counts_every_scale_for_odd_leading_dims():
    shape = (3, 5, 7, 64)
    n = 3 * 5 * 7 * 64
    assert formats.get("fp8_e4m3_row").nbytes(shape) == n + 3 * 5 * 7 * 4
    assert formats.get("fp4_e2m1_b16").nbytes(shape) == n // 2 + n // 16 * 4
    assert formats.get("nvfp4").nbytes(shape) == n // 2 + n // 16 + 3 * 5 * 4
    assert formats.get("fp8_e5m2").nbytes(shape) == n


def test_nbytes_rejects_a_last_dim_that_is_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match=r"d_k.*block 32.*got d_k=40"):
        formats.get("mxfp4").nbytes((6, 5, 40))
    with pytest.raises(ValueError, match=r"expects \[..., d_v, d_k\]"):
        formats.get("nvfp4").nbytes((64,))


def test_inconsistent_format_fields_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match="scale: expected one of"):
        Format("x", E2M1, 16, "e5m2")
    with pytest.raises(ValueError, match="block and scale"):
        Format("x", E2M1, 16, None)
    with pytest.raises(ValueError, match="block: expected a positive length"):
        Format("x", E2M1, 0, "fp32")
    with pytest.raises(ValueError, match="two_level"):
        Format("x", E2M1, 32, "e8m0", True)


@pytest.mark.parametrize("argv, message", [
    (["--heads", "0"], "--heads must be >= 1 (got 0)"),  # blamed --dk ("got 128")
    (["--dv", "-1"], "--dv must be >= 1 (got -1)"),
    (["--dk", "48"], "--dk must be a positive multiple of 32 (got 48)"),
    (["--seed", "-1"], "--seed must be in [0, 2^64) (got -1)"),  # were ValueError tracebacks
    (["--seed", str(philox.SEED_LIMIT)], f"--seed must be in [0, 2^64) (got {philox.SEED_LIMIT})"),
    (["--heads", str(philox.ELEMENT_LIMIT // (3 * 96) + 1), "--dv", "3", "--dk", "96"],
     f"--heads x --dv x --dk must be at most {philox.ELEMENT_LIMIT:,} state elements"),
])
def test_the_tour_names_the_bad_argument(capsys, argv, message):
    """`python -m lowprec` with a bad size or seed: exit status 2 and one line about that flag."""
    from lowprec.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_tour_accepts_the_largest_seed(capsys):
    """The seed range is Philox's [0, 2^64): its last seed runs."""
    from lowprec.__main__ import main

    main(["--heads", "3", "--dv", "5", "--dk", "32", "--seed", str(philox.SEED_LIMIT - 1)])
    assert capsys.readouterr().out.startswith("one state 3 x 5 x 32")


def test_the_tour_prints_the_records_of_mamba2_gdn_and_kda(capsys):
    """After the formats, each registered model's record: its fields, its bytes and what each
    step reads of it, the state copies and the bytes a token moves at L = 16, all from
    lowprec.traffic (Qwen3-Next GDN: 32 * 1,032 B, the non-flush step reads 32 * 772, the
    flush 32 * 520; Kimi Linear KDA: g fp32 per channel, 32 * 1,540 B)."""
    from lowprec import models
    from lowprec import traffic as tr
    from lowprec.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "the ReplaySSM records of Mamba-2, Gated DeltaNet and KDA" in " ".join(
        capsys.readouterr().out.split())
    main(["--heads", "3", "--dv", "5", "--dk", "32"])
    out = capsys.readouterr().out.split("\nReplaySSM records")[1]
    blocks = {}
    for line in out.splitlines()[1:]:
        if not line.startswith(" "):
            name = line.split(":")[0]
        blocks.setdefault(name, []).append(line)
    assert list(blocks) == models.names()
    assert blocks["qwen3-next-80b"][0].startswith("qwen3-next-80b: Gated DeltaNet, 32 heads")
    assert blocks["kimi-linear-48b"][0].startswith("kimi-linear-48b: KDA, 32 heads")
    assert blocks["nemotron3-super"][1].split(None, 1)[1] == (
        "per head: x [64] bf16, dt [1] fp32; per group: B [128] bf16")
    assert blocks["kimi-linear-48b"][1].split(None, 1)[1] == (
        "per head: u [128] fp32, v [128] bf16, k [128] bf16, g [128] fp32, beta [1] fp32")
    assert blocks["qwen3-next-80b"][2].split(None, 1)[1] == (
        "33,024 a record; of each held record a non-flush step reads 24,704, the flush 16,640")
    for name in models.names():
        ssm = models.get(name).ssm
        record = tr.ring_record(ssm)
        lo, hi = tr.state_bytes(ssm, "nvfp4"), tr.state_bytes(ssm, "fp16")
        lines = blocks[name]
        assert f"{record.write:,} a record" in lines[2]
        assert f"reads {record.nonflush_read:,}, the flush {record.flush_read:,}" in lines[2]
        assert f"read copy nvfp4 {lo:,}; recurrence copy fp16 {hi:,}" in lines[3]
        assert f"fp16 + nvfp4 {tr.replay(16, record, lo, hi).per_token:,.0f};" in lines[4]


def test_the_tour_prints_every_format(capsys):
    """A row a format; fp64 stores the fp64 state exactly, and fp32's two columns are its own
    RN and SR of that state (both columns showed the fp32 cast's RN error), SR the larger."""
    from lowprec.__main__ import main

    main(["--heads", "3", "--dv", "5", "--dk", "32"])
    out = capsys.readouterr().out
    assert out.startswith("one state 3 x 5 x 32")
    assert all(f" {name} " in out for name in formats.names())
    table = out.splitlines()[2:2 + len(formats.names())]
    rows = {line.split()[0]: line.split() for line in table}
    assert float(rows["fp64"][3]) == float(rows["fp64"][4]) == 0.0
    rn, sr = float(rows["fp32"][3]), float(rows["fp32"][4])
    assert 0 < rn < sr < 2**-23
    # the bytes and ratio columns are each format's storage, and every RN error is positive
    # and under the element's unit roundoff (only the fp64 and fp32 rows were checked)
    shape, fp32 = (3, 5, 32), formats.get("fp32").nbytes((3, 5, 32))
    for name in formats.names():
        fmt, row = formats.get(name), rows[name]
        assert row[1:3] == [f"{fmt.nbytes(shape):,}", f"{fp32 / fmt.nbytes(shape):.2f}x"], row
        if name != "fp64":
            assert 0 < float(row[3]) < 2.0 ** -(fmt.element.mbits + 1), row
