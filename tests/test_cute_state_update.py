"""cute_kernels/state_update.py: the conventional (every-token) baseline against lowprec.

CPU: the three variants (fp32, fp16 RN, fp16 SR) compile for sm_90a with 128-bit state
accesses only; bad arguments raise ValueErrors. GPU: the new state matches
lowprec.mamba2.mamba2_step (fp64) to a derived fp32 bound, the stored fp16 bits equal lowprec's
RN / SR of the kernel's own unrounded state (draws of (seed, slot, token counter) with each
SR setting of random bits and Philox rounds), outputs match, SR counters advance by one per
call.
"""

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cute_kernels import state_update as su  # noqa: E402
from cute_kernels.cache import StateCache  # noqa: E402
from lowprec import mamba2, philox  # noqa: E402
from lowprec import quantize as q  # noqa: E402
from lowprec.formats import FP16  # noqa: E402

DEVICE = torch.device("cuda")
EPS = 2.0**-24
SEED = 0xC0FFEE_0042
NEMOTRON = dict(nheads=128, headdim=64, dstate=128, ngroups=8)
ODD = dict(nheads=6, headdim=24, dstate=64, ngroups=3)
VARIANTS = [("fp32", "rn"), ("fp16", "rn"), ("fp16", "sr")]
# (random bits an element, Philox rounds) of SR: the default (16, 7), and besides it whole
# Philox-4x32-10 words (the reference), 13 bits, bytes, whole words in 7 rounds
DEFAULT_SR = (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)
SR_SETTINGS = [(32, 10), (13, 10), (8, 4), (32, 7)]


def sr_id(sr):
    return f"sr{sr[0]}r{sr[1]}"


def state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                 out=None, *, rounding="rn", seed=0, counters=None, debug_state=None,
                 check_counters=False, sr=DEFAULT_SR):
    """su.mamba2_state_update on the test's tensors packed as a StateCache (shared: the step
    updates them in place; without counters, a zero token counter)."""
    if counters is None and isinstance(state, torch.Tensor):
        counters = torch.zeros(state.shape[0], dtype=torch.int32, device=state.device)
    fmt = {torch.float32: "fp32", torch.float16: "fp16"}.get(getattr(state, "dtype", None),
                                                             str(getattr(state, "dtype", "")))
    cache = StateCache(state=state, scales=None, global_scale=None, tokens=counters, format=fmt,
                       rounding=rounding, seed=seed, sr_bits=sr[0], philox_rounds=sr[1])
    return su.mamba2_state_update(cache, x, dt, A, B, C, D, z, dt_bias, dt_softplus=dt_softplus,
                                  out=out, debug_state=debug_state,
                                  check_counters=check_counters)


def config(state, rounding, shape=NEMOTRON, sr=DEFAULT_SR):
    return su.StateUpdateConfig(
        **shape,
        state=state,
        rounding=rounding,
        act="bf16",
        dt_dtype="fp32",
        has_D=True,
        has_z=True,
        has_dt_bias=True,
        dt_softplus=True,
        has_debug=False,
        sr_bits=sr[0],
        philox_rounds=sr[1],
    )


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_compiles_for_sm90a_with_128_bit_state_accesses(variant):
    """64 state elements per thread, every one loaded and stored with 128-bit accesses: fp32
    16 + 16 per thread, fp16 8 + 8; no local memory."""
    ptx = su.compile_state_update(config(*variant), keep_ptx=True).__ptx__
    per_thread = 16 if variant[0] == "fp32" else 8
    assert ".target sm_90a" in ptx
    assert ptx.count("ld.global.v4.b32") >= per_thread
    assert ptx.count("st.global.v4.b32") == per_thread
    assert ".local" not in ptx
    if variant == ("fp16", "rn"):
        assert "cvt.rn.satfinite.f16x2.f32" in ptx


@pytest.mark.parametrize("sr", [(32, 10), (8, 4), (13, 10)], ids=sr_id)
def test_each_sr_setting_compiles_calling_philox_only_as_often_as_it_needs(sr):
    """fp16 SR with k random bits an element in R rounds: 8 pieces of 8 elements a thread,
    Philox once a counter (16 counters a thread at 32 bits, 8 at 16 and 13, 8 at 8 bits,
    where a piece takes half of a 16-element counter), two mul.hi.u32 a round after the
    first, against the default's 8 counters in 7 rounds; 128-bit state accesses, no spills."""
    ptx = su.compile_state_update(config("fp16", "sr", sr=sr), keep_ptx=True).__ptx__
    default = su.compile_state_update(config("fp16", "sr"), keep_ptx=True).__ptx__
    assert ptx.count("st.global.v4.b32") == 8 and ".local" not in ptx
    counters = {32: 16, 16: 8, 13: 8, 8: 8}[sr[0]]
    assert ptx.count("mul.hi.u32") - default.count("mul.hi.u32") == 2 * (
        counters * (sr[1] - 1) - 8 * 6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rounding="sr", sr_bits=4), r"sr_bits: expected random bits per element in"),
    (dict(rounding="sr", philox_rounds=12), r"philox_rounds: expected Philox rounds in"),
    (dict(rounding="rn", sr_bits=32),
     r"sr_bits: expected the default 16 with rounding='rn' .*got 32"),
])
def test_state_cache_takes_the_emulations_sr_settings_and_refuses_others(kwargs, message):
    """StateCache.empty, the config and the step take sr_bits and philox_rounds as the
    emulation's StateCache does (the defaults for RN), refusing others by name."""
    with pytest.raises(ValueError, match=message):
        StateCache.empty(2, 2, 16, 32, **kwargs)
    cache = StateCache.empty(2, 2, 16, 32, rounding="sr", sr_bits=8, philox_rounds=3)
    assert (cache.sr_bits, cache.philox_rounds) == (8, 3)
    with pytest.raises(ValueError, match="sr_bits: expected the default 16 with rounding='rn'"):
        config("fp16", "rn", sr=(8, 7))
    with pytest.raises(ValueError, match="philox_rounds: expected the default 7 with "
                                         "rounding='rn'"):
        config("fp16", "rn", sr=(16, 10))
    args = {**cpu_args(), "state": torch.zeros(3, 6, 24, 64, dtype=torch.float16)}
    with pytest.raises(ValueError, match="cache.philox_rounds: expected Philox rounds in"):
        state_update(**args, rounding="sr", sr=(16, 0))
    with pytest.raises(ValueError, match="cache.state: expected a CUDA tensor"):
        state_update(**args, rounding="sr", sr=(13, 5))


def cpu_args(slots=3, shape=ODD):
    H, P, N, G = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]
    f32 = torch.float32
    return dict(
        state=torch.zeros(slots, H, P, N),
        x=torch.zeros(slots, H, P, dtype=f32),
        dt=torch.zeros(slots, H),
        A=torch.zeros(H),
        B=torch.zeros(slots, G, N),
        C=torch.zeros(slots, G, N),
    )


@pytest.mark.parametrize(
    "change, kwargs, message",
    [
        (dict(state=torch.zeros(3, 6, 24, 64, dtype=torch.bfloat16)), {}, "cache.format"),
        ({}, dict(rounding="sr"), "'rn' for fp32: its store is exact"),
        (
            dict(state=torch.zeros(3, 6, 24, 64, dtype=torch.float16)),
            dict(rounding="sr", counters=torch.zeros(3, dtype=torch.int64)),
            "cache.tokens: expected dtype torch.int32",
        ),
        (dict(C=torch.zeros(3, 3, 32)), {}, r"C: expected shape \[3, 3, 64\]"),
        ({}, dict(rounding="up"), "rounding: expected one of"),
    ],
)
def test_bad_arguments_raise_value_errors(change, kwargs, message):
    args = {**cpu_args(), **change}
    with pytest.raises(ValueError, match=message):
        state_update(**args, **kwargs)


def test_fp32_rows_wider_than_a_warp_are_refused_by_the_call_and_the_config():
    """An fp32 row of dstate 256 is 64 chunks of 4, two warps' worth, while the output's row
    sum is one warp's shuffle reduction (its butterfly at lane distance 32 reads the lane's own
    value): the kernel would write twice one warp's half of each sum, so the shape is refused,
    by state_update naming the argument and by the config. fp16 (32 chunks of 8) passes."""
    def args(dtype, N=256, P=64):
        return dict(state=torch.zeros(2, 2, P, N, dtype=dtype), x=torch.zeros(2, 2, P),
                    dt=torch.zeros(2, 2), A=torch.zeros(2), B=torch.zeros(2, 1, N),
                    C=torch.zeros(2, 1, N))

    for P in (64, 8):  # 8 x 256 gave no row a pass (ZeroDivisionError at the compile)
        with pytest.raises(ValueError,
                           match=r"cache.state.shape\[3\] \(dstate\): expected at most 128"):
            state_update(**args(torch.float32, P=P))
    with pytest.raises(ValueError, match="cache.state: expected a CUDA tensor"):
        state_update(**args(torch.float16))
    with pytest.raises(ValueError, match="dstate: expected at most 128 for an fp32 state"):
        config("fp32", "rn", dict(NEMOTRON, dstate=256))
    assert config("fp16", "sr", dict(NEMOTRON, dstate=256)).chunks_per_row == 32
    assert config("fp32", "rn").chunks_per_row == 32


@pytest.mark.parametrize("state, rounding, message", [
    ("bf16", "rn", "state: expected one of"), ("fp16", "up", "rounding: expected one of"),
    ("fp32", "sr", "rounding: expected one of"),
])
def test_config_refuses_formats_the_kernel_does_not_have(state, rounding, message):
    """StateUpdateConfig (compile_state_update's key) took any string: "bf16" compiled the
    fp16 kernel, "up" or fp32 with "sr" the RN one."""
    with pytest.raises(ValueError, match=message):
        config(state, rounding)


@pytest.mark.parametrize("slots, nheads, rounding, message", [
    (1 << 20, 2, "sr", r"cache.state.shape\[0\] \(slots\): expected fewer than 2\^20"),
    (2, 1032, "sr", r"cache.state.shape\[1:\] .*: expected at most 2\^24 elements a slot"),
    (1 << 20, 2, "rn", "cache.state: expected a tensor with storage"),  # RN draws no words
    (2, 1024, "sr", "cache.state: expected a tensor with storage"),  # e < 2^24
])
def test_sr_refuses_states_past_the_philox_fields(slots, nheads, rounding, message):
    """SR takes slot s's words from the counter (s << 44 | counters[s] << 24 | e / 4): 2^20
    slots or more than 2^24 elements a slot overlap its fields, so elements would silently
    share words. Meta tensors: nothing allocated, and the cache refused as one once its shapes
    pass."""
    m = dict(device="meta")
    P, N, G = 64, 256, 8 if nheads > 2 else 1
    args = dict(state=torch.empty(slots, nheads, P, N, dtype=torch.float16, **m),
                x=torch.empty(slots, nheads, P, **m), dt=torch.empty(slots, nheads, **m),
                A=torch.empty(nheads, **m), B=torch.empty(slots, G, N, **m),
                C=torch.empty(slots, G, N, **m))
    counters = torch.empty(slots, dtype=torch.int32, **m) if rounding == "sr" else None
    with pytest.raises(ValueError, match=message):
        state_update(**args, rounding=rounding, counters=counters)


def random_inputs(slots, shape, state_dtype, act, gen):
    H, P, N, G = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]

    def randn(*size, dtype=act):
        return torch.randn(*size, generator=gen).to(dtype).to(DEVICE)

    return dict(
        state=randn(slots, H, P, N, dtype=state_dtype),
        x=randn(slots, H, P),
        dt=randn(slots, H, dtype=torch.float32),
        A=-(0.2 + 1.8 * torch.rand(H, generator=gen)).to(DEVICE),
        B=randn(slots, G, N),
        C=randn(slots, G, N),
        D=randn(H, dtype=torch.float32),
        z=randn(slots, H, P),
        dt_bias=0.5 * randn(H, dtype=torch.float32),
    )


def check_step(shape, slots, state_dtype, rounding, act, gen_seed=0, sr=DEFAULT_SR):
    gen = torch.Generator().manual_seed(gen_seed)
    inp = random_inputs(slots, shape, state_dtype, act, gen)
    H, P, N = shape["nheads"], shape["headdim"], shape["dstate"]
    before = {k: v.cpu().clone() for k, v in inp.items()}
    counters = None
    if rounding == "sr":
        counters = torch.randint(0, 900, (slots,), generator=gen, dtype=torch.int32).to(DEVICE)
    counters_before = None if counters is None else counters.cpu().clone()
    out = torch.full((slots, H, P), float("nan"), dtype=act, device=DEVICE)
    debug = torch.full((slots, H, P, N), float("nan"), device=DEVICE)
    state_update(
        **inp, out=out, rounding=rounding, seed=SEED, counters=counters, debug_state=debug, sr=sr
    )
    torch.cuda.synchronize()
    b = {k: v.double() for k, v in before.items()}
    y_ref, s_ref = mamba2.mamba2_step(
        b["state"], b["x"], b["dt"], b["A"], b["B"], b["C"], b["D"], b["z"], b["dt_bias"]
    )
    new = debug.cpu()
    assert not new.isnan().any()
    # bound: EPS (8 + 4 |A dt|) (|a S| + |dt x B|): exp (2 ulp) and the products; the
    # processed dt's few-ulp error enters the decay amplified by |A dt|
    dt = mamba2.mamba2_process_dt(b["dt"], b["dt_bias"])
    a = torch.exp(dt * b["A"])
    g = torch.arange(H) // (H // shape["ngroups"])
    outer = (dt[..., None] * b["x"])[..., None] * b["B"][:, g][:, :, None, :]
    mag = (a[..., None, None] * b["state"]).abs() + outer.abs()
    bound = EPS * (8 + 4 * (b["A"] * dt).abs())[..., None, None] * mag
    err = (new.double() - s_ref).abs()
    assert (err <= bound).all(), f"state error {err.max():.3e}"
    stored = inp["state"].cpu()
    if state_dtype == torch.float32:
        assert torch.equal(stored, new)
    else:
        rand = None
        if rounding == "sr":
            rand = philox.random_words(SEED, torch.arange(slots), counters_before.long(),
                                       (H, P, N), sr_bits=sr[0], philox_rounds=sr[1])
        want = q.encode_bits(q.round_to(new, FP16, rounding, rand, sr_bits=sr[0]), FP16)
        got = stored.view(torch.int16).long() & 0xFFFF
        mism = (want != got).nonzero()
        assert len(mism) == 0, f"{len(mism)} fp16 mismatches, first {mism[:3].tolist()}"
        if rounding == "sr":
            assert torch.equal(counters.cpu(), counters_before + 1)
    sc = new.double() * b["C"][:, g][:, :, None, :]
    gate = torch.nn.functional.silu(b["z"])
    y_new = (sc.sum(-1) + b["D"][None, :, None] * b["x"]) * gate
    y_bound = EPS * (N + 16) * (sc.abs().sum(-1) + (b["D"][None, :, None] * b["x"]).abs())
    y_bound = y_bound * gate.abs().clamp(min=1)
    if act != torch.float32:
        y_bound = y_bound + 2.0**-8 * y_new.abs()
    got_y = out.cpu().double()
    assert ((got_y - y_new).abs() <= y_bound).all(), (got_y - y_new).abs().max()
    # and against the fp64 step itself: the state's fp32 error carried through C
    assert torch.allclose(got_y, y_ref, rtol=2e-2 if act != torch.float32 else 1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_step_at_an_odd_shape_matches_lowprec(variant):
    dtype = torch.float32 if variant[0] == "fp32" else torch.float16
    check_step(ODD, 5, dtype, variant[1], torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_step_at_the_nemotron_shape_matches_lowprec(variant):
    dtype = torch.float32 if variant[0] == "fp32" else torch.float16
    check_step(NEMOTRON, 3, dtype, variant[1], torch.bfloat16, gen_seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("sr", SR_SETTINGS, ids=sr_id)
@pytest.mark.parametrize("shape", ["odd", "nemotron"])
def test_sr_step_with_each_setting_matches_lowprec(sr, shape):
    """fp16 SR with k random bits an element in R rounds: the stored bits are lowprec's
    round_to(..., sr_bits=k) with random_words(..., sr_bits=k, philox_rounds=R) of the
    kernel's own state, bit for bit; the token counters advance by one."""
    if shape == "odd":
        check_step(ODD, 5, torch.float16, "sr", torch.float32, gen_seed=sr[0], sr=sr)
    else:
        check_step(NEMOTRON, 3, torch.float16, "sr", torch.bfloat16, gen_seed=sr[1], sr=sr)


def test_counters_are_checked_when_asked_and_the_device_last():
    """check_counters=True refuses a token counter outside the Philox flush field (as the
    other kernels do when asked; state_update had no such check), and a CPU state passes
    every check but the device one, which names it."""
    args = {**cpu_args(), "state": torch.zeros(3, 6, 24, 64, dtype=torch.float16)}
    counters = torch.tensor([0, (1 << 20) - 1, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache.tokens: expected values in \[0, 2\^20 - 1\)"):
        state_update(**args, rounding="sr", counters=counters, check_counters=True)
    with pytest.raises(ValueError, match="check_counters: expected a bool"):
        state_update(**args, rounding="sr", counters=counters, check_counters="yes")
    counters[1] = (1 << 20) - 2
    with pytest.raises(ValueError, match="cache.state: expected a CUDA tensor"):
        state_update(**args, rounding="sr", counters=counters, check_counters=True)


@pytest.mark.parametrize("name, output, message", [
    ("out", lambda a: a["x"], "out: expected a tensor apart from x, got one sharing x's memory"),
    ("out", lambda a: a["state"].view(-1)[: a["x"].numel()].view(a["x"].shape),
     "out: expected a tensor apart from cache.state, got one sharing cache.state's memory"),
    ("debug_state", lambda a: a["state"],
     "debug_state: expected a tensor apart from cache.state"),
    ("out", lambda a: torch.zeros_like(a["x"]), "cache.state: expected a CUDA tensor"),
])
def test_an_output_sharing_an_input_s_memory_is_refused(name, output, message):
    """The kernel stores y and the state after reading the state it rewrites: an output over
    an input's bytes would be read back changed (the emulation refuses the same). A separate
    buffer passes and reaches the device check (CPU tensors)."""
    args = cpu_args()
    with pytest.raises(ValueError, match=re.escape(message)):
        state_update(**args, **{name: output(args)})
