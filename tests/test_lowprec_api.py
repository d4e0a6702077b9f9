"""The package-level API of `lowprec` and its refusals: the README example runs as written,
both spellings of `lowprec.quantize` work, fp16/bf16 inputs and `seed=` behave as the module
doc says, and bad input (corrupt storage, empty batches, meta tensors, aliased inputs, wrong
types) is answered by one ValueError that names the argument."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import lowprec
from lowprec import contract, formats, metrics, philox
from lowprec.gdn import gdn_replay_output
from lowprec.mamba2 import mamba2_replay_output, mamba2_step
from lowprec.policies import make_policy
from lowprec.replay import GDNReplay, KDAReplay, Mamba2Replay

# the example of lowprec/README.md, run as written
README_EXAMPLE = """\
import torch
import lowprec

state = torch.randn(8, 64, 128, dtype=torch.bfloat16)            # [..., d_v, d_k]
q = lowprec.quantize(state, "nvfp4")                               # E2M1 codes, E4M3 scales
stored = lowprec.pack(q)                                           # {codes, scales, global_scale}
back = lowprec.dequantize(lowprec.unpack(stored, "nvfp4", state.shape, state.dtype))
assert torch.equal(back, lowprec.fake_quantize(state, "nvfp4"))   # fp32 (lowprec.result_dtype)
hi = lowprec.round_to(state.float(), "fp16", rounding="sr", seed=0)   # Philox words of seed 0
policy = lowprec.make_policy("separate_fp16sr", "nvfp4", window=16, seed=0)
print(back.dtype, hi.dtype, policy)
"""


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _python(code: str) -> str:
    """stdout of `code` in a fresh interpreter (the import system's state starts empty)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, check=True, timeout=120)
    return done.stdout


# --------------------------------------------------------------------------------------------
# the public names


def test_the_readme_example_runs_as_written_and_prints_its_dtypes(capsys):
    """Ten lines: bf16 state -> nvfp4 -> bytes -> values, fp32 out (a block format's values are
    fp32 products); SR of the fp32 state to fp16 from seed 0 keeps fp32."""
    exec(compile(README_EXAMPLE, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("torch.float32 torch.float32 Policy(kind='separate'"), out


IMPORT_ORDERS = [
    "import lowprec",
    "from lowprec import quantize as q",
    "from lowprec.quantize import fake_quantize",
    "import lowprec.quantize",
    "import lowprec.replay",
]


def test_lowprec_quantize_is_the_function_and_the_module_whatever_is_imported_first():
    """`lowprec.quantize(x, fmt)` quantises and `lowprec.quantize.pack` is the module's
    function after each way of importing it first (one fresh interpreter; lowprec's modules
    are dropped from sys.modules between the cases, so each starts from an empty import)."""
    out = _python(f"""
        import sys
        import torch
        x = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1))
        for first in {IMPORT_ORDERS!r}:
            for name in [m for m in sys.modules if m.split(".")[0] == "lowprec"]:
                del sys.modules[name]
            exec(first)
            import lowprec
            from lowprec import quantize as q
            from lowprec.quantize import fake_quantize, quantize
            a = lowprec.quantize(x, "nvfp4")
            b = q.quantize(x, "nvfp4")
            assert q is lowprec.quantize and quantize is q.quantize, first
            assert torch.equal(a.elements, b.elements) and torch.equal(a.scales, b.scales)
            assert torch.equal(q.dequantize(a), fake_quantize(x, "nvfp4")), first
            print(first, "|", sorted(q.pack(a)), lowprec.mamba2.__name__, lowprec.gdn.__name__,
                  lowprec.kda.__name__)
    """)
    lines = out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == IMPORT_ORDERS
    for line in lines:
        assert line.split(" | ")[1] == ("['codes', 'global_scale', 'scales'] lowprec.mamba2 "
                                        "lowprec.gdn lowprec.kda"), line


def test_package_level_names_are_the_module_functions():
    from lowprec import policies
    from lowprec import quantize as q
    assert lowprec.dequantize is q.dequantize and lowprec.round_to is q.round_to
    assert lowprec.fake_quantize is q.fake_quantize and lowprec.pack is q.pack
    assert lowprec.unpack is q.unpack and lowprec.Quantized is q.Quantized
    assert lowprec.Policy is policies.Policy and lowprec.make_policy is policies.make_policy
    assert lowprec.result_dtype is q.result_dtype


# --------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize(("fmt", "dtype", "want"), [
    ("nvfp4", torch.bfloat16, torch.float32),
    ("mxfp4", torch.float16, torch.float32),
    ("fp8_e4m3", torch.bfloat16, torch.bfloat16),
    ("fp8_e5m2", torch.float16, torch.float16),
    ("fp16", torch.float16, torch.float16),
    ("fp16", torch.bfloat16, torch.float32),  # 65504 has 11 significant bits
    ("bf16", torch.float16, torch.float32),  # bf16's range passes fp16's
    ("fp32", torch.float16, torch.float32),
    ("nvfp4", torch.float64, torch.float64),
    ("fp16", torch.float32, torch.float32),
])
def test_half_inputs_give_the_fp32_computation_in_the_dtype_result_dtype_names(fmt, dtype, want):
    """fp16/bf16 widen exactly to fp32; the result is the fp32 input's result, returned in the
    input dtype where every value of the format is exact in it, else fp32 (no second rounding)."""
    x = (_rand(3, 5, 64, seed=2) * 3).to(dtype)
    assert lowprec.result_dtype(fmt, dtype) == want
    got = lowprec.fake_quantize(x, fmt)
    assert got.dtype == want
    wide = lowprec.fake_quantize(x if dtype == torch.float64 else x.float(), fmt)
    assert torch.equal(got.to(wide.dtype), wide)
    words = philox.random_words(5, 0, 0, x.shape)
    sr = lowprec.round_to(x, formats.get(fmt).element, "sr", words)
    assert torch.equal(sr.float(), lowprec.round_to(x.float(), formats.get(fmt).element, "sr",
                                                    words).float())


def test_unpack_refuses_a_dtype_that_cannot_hold_the_format_exactly():
    x = _rand(2, 8)
    packed = lowprec.pack(lowprec.quantize(x, "fp16"))
    with pytest.raises(ValueError, match="dtype: expected a dtype that holds every fp16 value"):
        lowprec.unpack(packed, "fp16", x.shape, torch.bfloat16)
    back = lowprec.unpack(packed, "fp16", x.shape, torch.float16).elements
    assert torch.equal(back.float(), lowprec.fake_quantize(x, "fp16"))


# --------------------------------------------------------------------------------------------
# seed=


def test_seed_draws_the_kernels_words_and_matches_a_flush_copy_bit_for_bit():
    """round_to(..., seed=s, slot=arange(n), flush=f) of a [n, h, dv, dk] state is what
    contract.flush_copies stores as the fp16 SR recurrence copy."""
    state = _rand(3, 2, 5, 32, seed=3) * 10
    flushes = torch.tensor([0, 7, 3])
    want = contract.flush_copies(state, seed=11, flushes=flushes, lo_format=None)["hi"]
    got = lowprec.round_to(state, "fp16", rounding="sr", seed=11, slot=torch.arange(3),
                           flush=flushes)
    assert torch.equal(lowprec.pack(lowprec.quantize(got, "fp16"))["codes"], want)
    words = philox.random_words(11, torch.arange(3), flushes, (2, 5, 32))
    assert torch.equal(got, lowprec.round_to(state, "fp16", "sr", words))
    one = lowprec.round_to(state[1], "fp16", "sr", seed=11, slot=1, flush=7)
    assert torch.equal(one, got[1])  # ints: x is one slot's state


def test_seed_and_rand_are_alternatives_and_a_seed_needs_sr():
    x = _rand(4, 16)
    words = philox.random_words(0, 0, 0, x.shape)
    assert torch.equal(lowprec.round_to(x, "e2m1", "sr", seed=0),
                       lowprec.round_to(x, "e2m1", "sr", words))
    assert torch.equal(lowprec.fake_quantize(x, "nvfp4", "sr", seed=np.int64(9)),
                       lowprec.fake_quantize(x, "nvfp4", "sr", philox.random_words(9, 0, 0,
                                                                                   x.shape)))
    with pytest.raises(ValueError, match="seed: expected either rand or seed.*got both"):
        lowprec.round_to(x, "e2m1", "sr", words, seed=0)
    with pytest.raises(ValueError, match="seed: expected None for rounding='rn'"):
        lowprec.quantize(x, "nvfp4", seed=0)
    with pytest.raises(ValueError, match="seed: expected a seed with slot= or flush="):
        lowprec.round_to(x, "e2m1", "sr", words, slot=1)
    with pytest.raises(ValueError, match="slot: expected slot and flush to broadcast to x's"):
        lowprec.round_to(x, "e2m1", "sr", seed=0, slot=torch.arange(3))
    with pytest.raises(ValueError, match=r"seed: expected an int in \[0, 2\^64\), got 1.5"):
        lowprec.round_to(x, "e2m1", "sr", seed=1.5)


@pytest.mark.parametrize("make", [
    lambda s: philox.random_words(s, 0, 0, (3,)),
    lambda s: philox.randint(s, torch.arange(3)),
    lambda s: make_policy("separate_fp16sr", "nvfp4", seed=s).seed,
    lambda s: lowprec.Policy("shared", "fp16", "sr", seed=s).seed,
])
def test_numpy_integer_seeds_are_ints(make):
    """np.int64(5) is the seed 5 (a Policy stores it as the int 5)."""
    got, want = make(np.int64(5)), make(5)
    assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
    if not isinstance(got, torch.Tensor):
        assert type(got) is int


# --------------------------------------------------------------------------------------------
# storage readers


def _nvfp4_storage(seed=0):
    x = _rand(2, 3, 32, seed=seed)
    return x, lowprec.pack(lowprec.quantize(x, "nvfp4"))


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x80, 0xC5])
def test_unpack_refuses_nan_and_negative_e4m3_scale_bytes(byte):
    """0x7F/0xFF are E4M3's NaN (384 NaN values out); a set sign bit flips 16 signs."""
    x, packed = _nvfp4_storage()
    packed["scales"][1, 2, 0] = byte
    with pytest.raises(ValueError, match=rf"packed\['scales'\]: expected E4M3 bytes in "
                                         rf"\[0x00, 0x7E\].*got 0x{byte:02X}"):
        lowprec.unpack(packed, "nvfp4", x.shape)


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), -0.5])
def test_unpack_refuses_a_negative_or_non_finite_global_scale(value):
    x, packed = _nvfp4_storage(1)
    packed["global_scale"][1] = value
    with pytest.raises(ValueError, match=r"packed\['global_scale'\]: expected finite scales "
                                         r">= 0"):
        lowprec.unpack(packed, "nvfp4", x.shape)


def test_unpack_refuses_nan_fp32_scales_and_keeps_refusing_e8m0_255():
    x = _rand(2, 3, 32, seed=2)
    packed = lowprec.pack(lowprec.quantize(x, "fp4_e2m1_b16"))
    packed["scales"][0, 0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"packed\['scales'\]: expected finite scales >= 0"):
        lowprec.unpack(packed, "fp4_e2m1_b16", x.shape)
    packed = lowprec.pack(lowprec.quantize(x, "mxfp4"))
    packed["scales"][1, 1, 0] = 255
    with pytest.raises(ValueError, match=r"expected E8M0 bytes in \[0, 254\]"):
        lowprec.unpack(packed, "mxfp4", x.shape)


@pytest.mark.parametrize(("field", "bad"), [
    ("scales", lambda t: t[..., :1]),
    ("scales", lambda t: t.reshape(-1)),
    ("scales", lambda t: t.double()),
    ("global_scale", lambda t: t[:1]),
    ("global_scale", lambda t: None),
])
def test_dequantize_refuses_scales_of_the_wrong_shape_naming_the_field(field, bad):
    q = lowprec.quantize(_rand(3, 4, 32, seed=3), "nvfp4")
    setattr(q, field, bad(getattr(q, field)))
    with pytest.raises(ValueError, match=rf"q\.{field}: expected"):
        lowprec.dequantize(q)
    with pytest.raises(ValueError, match=rf"q\.{field}: expected"):
        lowprec.pack(q)


def test_dequantize_names_expected_and_actual_scale_shapes():
    q = lowprec.quantize(_rand(3, 4, 32, seed=4), "nvfp4")
    q.scales = q.scales[..., :1]
    with pytest.raises(ValueError, match=r"q\.scales: expected shape \[3, 4, 2\] .*got "
                                         r"\[3, 4, 1\]"):
        lowprec.dequantize(q)


def test_pack_of_a_non_finite_state_says_it_is_non_finite():
    """An inf in an nvfp4 state makes its scales NaN: the error says so rather than 'e2m1 has
    no NaN encoding'."""
    x = _rand(2, 4, 32, seed=5)
    x[1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="held inf or NaN"):
        lowprec.pack(lowprec.quantize(x, "nvfp4"))
    with pytest.raises(ValueError, match=r"state: expected finite values .* got inf at "
                                         r"\(0, 1, 2, 3\)"):
        contract.flush_copies(x[None])


# --------------------------------------------------------------------------------------------
# empty batches


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp4_e2m1_b16", "fp8_e4m3_row", "fp16"])
def test_an_empty_batch_packs_unpacks_and_quantises_to_empty_tensors(fmt):
    x = torch.empty(0, 3, 64)
    q = lowprec.quantize(x, fmt)
    packed = lowprec.pack(q)
    assert all(t.shape[0] == 0 for t in packed.values())
    back = lowprec.dequantize(lowprec.unpack(packed, fmt, x.shape))
    assert back.shape == x.shape
    assert lowprec.fake_quantize(x, fmt, "sr", seed=3).shape == x.shape


def test_flush_copies_of_a_step_where_no_slot_flushes_is_empty():
    """The contract's pattern `flush_copies(s_new[flushing], ...)` with no flushing slot."""
    s_new = _rand(3, 2, 4, 32, seed=6)
    flushing = torch.zeros(3, dtype=torch.bool)
    copies = contract.flush_copies(s_new[flushing], seed=1, flushes=0)
    full = contract.flush_copies(s_new, seed=1, flushes=0)
    assert sorted(copies) == sorted(full)
    for name, t in copies.items():
        assert t.dtype == full[name].dtype and t.shape == (0, *full[name].shape[1:])


# --------------------------------------------------------------------------------------------
# named errors


def test_formats_and_metrics_name_the_argument_for_wrong_types():
    with pytest.raises(ValueError, match=r"format: expected one of .* got \['nvfp4'\]"):
        formats.get(["nvfp4"])
    with pytest.raises(ValueError, match="block: expected an int or None, got '16'"):
        formats.Format("x", formats.E2M1, block="16", scale="fp32")
    with pytest.raises(ValueError, match=r"shape: expected a non-empty shape of ints >= 1"):
        formats.get("nvfp4").bits_per_element_at((0, 16))
    with pytest.raises(ValueError, match=r"dims: expected distinct dims .* got \(0, 0\)"):
        metrics.rel_err(_rand(3, 4), _rand(3, 4, seed=1), dims=(0, 0))


def test_meta_tensors_are_refused_at_the_entry():
    x = torch.empty(3, 32, device="meta")
    for call in (lambda: lowprec.quantize(x, "nvfp4"), lambda: lowprec.round_to(x, "fp16"),
                 lambda: lowprec.fake_quantize(x, "mxfp4")):
        with pytest.raises(ValueError, match="x: expected a tensor with data .* got a meta"):
            call()


def test_a_tensor_that_requires_grad_is_refused_with_the_estimator_to_write():
    """Rounding has no gradient: refused while grad mode is on (an in-place op failed on
    backward), accepted under no_grad and after detach."""
    x = _rand(2, 32).requires_grad_()
    with pytest.raises(ValueError, match=r"x: expected a tensor that does not require grad.*"
                                         r"x \+ \(fake_quantize\(x\.detach\(\), fmt\) - x\)"):
        lowprec.fake_quantize(x, "nvfp4")
    with torch.no_grad():
        assert torch.equal(lowprec.fake_quantize(x, "nvfp4"),
                           lowprec.fake_quantize(x.detach(), "nvfp4"))
    ste = x + (lowprec.fake_quantize(x.detach(), "nvfp4") - x).detach()
    ste.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


# --------------------------------------------------------------------------------------------
# the references: devices, aliases, cursors


def _f64(*shape, seed=0, device=None):
    t = _rand(*shape, seed=seed, dtype=torch.float64)
    return t.to(device) if device else t


def _mamba2_cache():
    A = -torch.rand(2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    return Mamba2Replay.create(2, 2, 4, 32, A, policy=make_policy("separate_fp16sr", "nvfp4",
                                                                  window=4))


def _mamba2_args(device=None, seed=0):
    return [_f64(2, 2, 4, seed=seed, device=device), _f64(2, 2, seed=seed + 1),
            _f64(2, 1, 32, seed=seed + 2), _f64(2, 1, 32, seed=seed + 3)]


def _delta_args(per_channel, meta_at=None, seed=0):
    shapes = [(2, 2, 32), (2, 2, 32), (2, 2, 4), (2, 2, 32) if per_channel else (2, 2), (2, 2)]
    return [_f64(*s, seed=seed + i, device="meta" if i == meta_at else None)
            for i, s in enumerate(shapes)]


@pytest.mark.parametrize("position", range(4))
def test_mamba2_step_refuses_a_meta_input_and_leaves_the_ring_untouched(position):
    cache = _mamba2_cache()
    cache.step(*_mamba2_args(seed=10))
    ring = {k: v.clone() for k, v in cache.ring.items()}
    args = _mamba2_args(seed=20)
    args[position] = torch.empty_like(args[position], device="meta")
    name = ["x", "dt", "B", "C"][position]
    with pytest.raises(ValueError, match=rf"{name}: expected a tensor with data"):
        cache.step(*args)
    assert all(torch.equal(ring[k].nan_to_num(7.0), v.nan_to_num(7.0))
               for k, v in cache.ring.items())
    assert cache.count.tolist() == [1, 1]


@pytest.mark.parametrize(("cls", "per_channel"), [(GDNReplay, False), (KDAReplay, True)])
@pytest.mark.parametrize("position", [0, 3, 4])
def test_delta_rule_steps_refuse_a_meta_input_by_name(cls, per_channel, position):
    cache = cls.create(2, 2, 4, 32, policy=make_policy("shared", "fp16", window=3))
    name = ["q", "k", "v", "g", "beta"][position]
    with pytest.raises(ValueError, match=rf"{name}: expected a tensor with data"):
        cache.step(*_delta_args(per_channel, meta_at=position))
    assert cache.count.tolist() == [0, 0]


def test_an_input_that_is_a_view_of_the_cache_is_refused_naming_both():
    """x given as a view of the checkpoint, beta as a view of the ring: the kernels would read
    them after writing those bytes, so the reference refuses them as the kernels must."""
    cache = _mamba2_cache()
    for _ in range(3):
        cache.step(*_mamba2_args(seed=30))
    args = _mamba2_args(seed=40)
    args[0] = cache.hi[:, :, :, 5]
    with pytest.raises(ValueError, match=r"x: expected memory apart from cache\.hi"):
        cache.step(*args)
    gdn = GDNReplay.create(2, 2, 4, 32, policy=make_policy("shared", "fp16", window=3))
    gdn.step(*_delta_args(False, seed=50))
    args = _delta_args(False, seed=60)
    args[4] = gdn.ring["beta"][:, :, 1]
    with pytest.raises(ValueError, match=r"beta: expected memory apart from "
                                         r"cache\.ring\['beta'\]"):
        gdn.step(*args)
    args[4] = gdn.ring["beta"][:, :, 1].clone()
    gdn.step(*args)  # a copy is fine


@pytest.mark.parametrize("value", [-1, 4, 9])
def test_a_cursor_out_of_range_is_refused_by_name(value):
    cache = _mamba2_cache()
    cache.count[1] = value
    with pytest.raises(ValueError, match=rf"count: expected values in \[0, 3\].*{value}"):
        cache.step(*_mamba2_args())


def test_the_reference_functions_refuse_meta_tensors_by_name():
    b, h, dv, dk, lcap = 2, 2, 4, 32, 3
    ckpt, A = _f64(b, h, dv, dk), -_f64(h).abs()
    count = torch.tensor([1, 2])
    ring_x, ring_dt, ring_B = _f64(b, h, lcap, dv), _f64(b, h, lcap), _f64(b, 1, lcap, dk)
    C, x = _f64(b, 1, dk), _f64(b, h, dv)
    with pytest.raises(ValueError, match="ring_dt: expected a tensor with data"):
        mamba2_replay_output(ckpt, ring_x, ring_dt.to("meta"), ring_B, count, C, x, A)
    with pytest.raises(ValueError, match="C: expected a tensor with data"):
        mamba2_replay_output(ckpt, ring_x, ring_dt, ring_B, count, C.to("meta"), x, A)
    with pytest.raises(ValueError, match="state: expected a tensor with data"):
        mamba2_step(ckpt.to("meta"), x, _f64(b, h), A, C, C)
    ring_u, ring_k, ring_g = _f64(b, h, lcap, dv), _f64(b, h, lcap, dk), _f64(b, h, lcap)
    with pytest.raises(ValueError, match="q: expected a tensor with data"):
        gdn_replay_output(ckpt, ring_u, ring_k, ring_g, count, _f64(b, h, dk).to("meta"))


def test_a_mamba2_cache_refuses_parameters_on_another_device():
    with pytest.raises(ValueError, match="A: expected a tensor with data"):
        Mamba2Replay.create(2, 2, 4, 32, torch.empty(2, dtype=torch.float64, device="meta"))
