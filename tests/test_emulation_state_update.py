"""The conventional Triton decode step stores lowprec's state, bit for bit, every token.

For every format and rounding: the unrounded state (`debug_state`) is within the fp32 bound of
`lowprec.mamba2.mamba2_step` applied to the stored state; the stored state is, bit for bit,
`lowprec.policies.round_state(S, format, rounding, seed, slot, tokens[slot])` of that unrounded
state (block scales and the second-level scale included); the output reads the stored state
(as `lowprec.policies` defines the conventional arm; or the unrounded one with
output_from='unrounded', as the CuTe kernel does) and the token counter moves by one.

fp32 bound (u = 2^-24): S = exp(dt A) S + (dt x) B^T is two terms of at most three rounded
factors (exp and softplus a few u each): |err| <= 16 u (|a S| + |dt x B|). y = S C + D x is a
sum of dstate + 1 terms: |err| <= (dstate + 16) u sum|terms| (Higham's gamma_n). Tests allow
twice each.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton cannot compile for a CPU: interpret (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checks import assert_bits_equal, assert_within
from checks import to_device as to

from emulation.state_update import StateCache, mamba2_state_update  # noqa: E402
from lowprec import formats, mamba2, philox  # noqa: E402
from lowprec import quantize as lq  # noqa: E402
from lowprec.policies import Policy, Simulator, round_state  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="compiled Triton: GPU")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
U = 2.0**-24
FORMATS = [name for name in formats.names() if name != "fp64"]
SHAPE = dict(nheads=3, headdim=5, dstate=32, ngroups=3)
SEED = 2024


def make_params(gen, nheads):
    return dict(
        A=-(torch.rand(nheads, generator=gen) + 0.2),
        D=torch.randn(nheads, generator=gen),
        dt_bias=0.3 * torch.randn(nheads, generator=gen),
    )


def make_token(gen, slots):
    h, p, n, g = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"], SHAPE["ngroups"]
    return dict(
        x=torch.randn(slots, h, p, generator=gen),
        dt=torch.randn(slots, h, generator=gen) - 1.0,
        B=torch.randn(slots, g, n, generator=gen),
        C=torch.randn(slots, g, n, generator=gen),
        z=torch.randn(slots, h, p, generator=gen),
    )


def run_and_check(cache, token, params, output_from="stored"):
    """One step checked against lowprec applied to the state it started from."""
    before = cache.state.detach().cpu().double()
    tokens = cache.tokens.cpu().long()
    slots, nheads, headdim, dstate = cache.state.shape
    device = cache.state.device
    y = torch.full((slots, nheads, headdim), math.nan, device=device)
    debug = torch.full(cache.state.shape, math.nan, device=device)
    mamba2_state_update(cache, **to(token, device), **to(params, device), out=y,
                        debug_state=debug, output_from=output_from)
    d = {k: v.double() for k, v in {**token, **params}.items()}
    _, S_ref = mamba2.mamba2_step(before, d["x"], d["dt"], d["A"], d["B"], d["C"],
                                  dt_bias=d["dt_bias"])
    _, S_mag = mamba2.mamba2_step(before.abs(), d["x"].abs(), d["dt"], d["A"], d["B"].abs(),
                                  d["C"], dt_bias=d["dt_bias"])
    assert_within(debug, S_ref, 32 * U * S_mag, "unrounded state")

    debug = debug.cpu()
    slot_ids = torch.arange(slots)
    sr = dict(sr_bits=cache.sr_bits, philox_rounds=cache.philox_rounds)
    stored = round_state(debug, cache.format, cache.rounding, SEED, slot_ids, tokens, **sr)
    assert_bits_equal(cache.state.cpu().float(), stored, f"state ({cache.format})")
    if cache.scales is not None:
        q = lq.quantize(debug, cache.format, cache.rounding, None if cache.rounding == "rn"
                        else _words(slot_ids, tokens, debug.shape[1:], **sr),
                        sr_bits=cache.sr_bits)
        assert_bits_equal(cache.scales.cpu(), q.scales, "block scales")
        if q.global_scale is not None:
            assert_bits_equal(cache.global_scale.cpu(), q.global_scale, "s_g")

    C_h = d["C"].repeat_interleave(nheads // d["C"].shape[1], dim=1)
    Dx = d["D"][None, :, None] * d["x"]
    gate = F.silu(d["z"])
    read = stored.double() if output_from == "stored" else S_ref
    y_ref = (torch.einsum("bhvk,bhk->bhv", read, C_h) + Dx) * gate
    y_mag = (torch.einsum("bhvk,bhk->bhv", read.abs(), C_h.abs()) + Dx.abs())
    assert_within(y, y_ref, 2 * (dstate + 16) * U * y_mag * gate.abs(), "y")
    assert cache.tokens.cpu().tolist() == (tokens + 1).tolist()
    return y


def _words(slots, tokens, shape, **sr):
    return philox.random_words(SEED, slots, tokens, shape, **sr)


def filled_cache(gen, fmt, rounding, device, tokens, **sr):
    """A random state exactly representable in `fmt` at the given token counters (`sr`: the
    cache's sr_bits / philox_rounds)."""
    h, p, n = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"]
    slots = len(tokens)
    cache = StateCache.empty(slots, h, p, n, format=fmt, rounding=rounding, seed=SEED,
                             device=device, **sr)
    q = lq.quantize(torch.randn(slots, h, p, n, generator=gen), fmt)
    cache.state.copy_(lq.dequantize(q))
    if q.scales is not None:
        cache.scales.copy_(q.scales)
    if q.global_scale is not None:
        cache.global_scale.copy_(q.global_scale)
    cache.tokens.copy_(torch.tensor(tokens, dtype=torch.int32))
    return cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["rn", "sr"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_state_bit_exact_every_format(fmt, rounding, device):
    """Three slots with token counters 0, 7 and 3: the stored state is lowprec's rounding of
    the unrounded state with each slot's own counter, bit for bit; y reads the stored state."""
    gen = torch.Generator().manual_seed(21)
    cache = filled_cache(gen, fmt, rounding, device, tokens=[0, 7, 3])
    run_and_check(cache, make_token(gen, 3), make_params(gen, SHAPE["nheads"]))


# SR settings (sr_bits, philox_rounds): every width at 10 rounds, 7 and 4 rounds at 32 and 8
# bits; the fast ones cover each lane width (32, 16, 13 masked, 8) and 10, 7 and 4 rounds
SR_SETTINGS = [(32, 10), (16, 10), (13, 10), (8, 10), (32, 7), (8, 7), (32, 4), (8, 4)]
SR_FAST = {(16, 10), (13, 10), (8, 7), (32, 4)}
SR_CASES = [pytest.param(k, r, "cpu", id=f"cpu-{k}b-{r}r", marks=(
    pytest.mark.skipif(not INTERPRETED, reason="compiled Triton: GPU"),
    *(() if (k, r) in SR_FAST else (pytest.mark.slow,)))) for k, r in SR_SETTINGS] + [
    pytest.param(8, 7, "cuda", id="cuda-8b-7r", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("sr_bits, philox_rounds, device", SR_CASES)
@pytest.mark.parametrize("fmt", ["fp16", "mxfp4"])
def test_stored_state_every_sr_setting(fmt, sr_bits, philox_rounds, device):
    """The conventional state stored by SR with `sr_bits` random bits per element from
    `philox_rounds`-round Philox, at token counters 0, 2^19 + 5 and 3: lowprec's `round_state(
    S, fmt, 'sr', ..., sr_bits=, philox_rounds=)` bit for bit over two tokens (FP16 elements,
    and MXFP4 codes in blocks of 32, whose SR steps are E2M1 ulps); a twin at the defaults
    (16, 7) stores another state from the first token."""
    gen = torch.Generator().manual_seed(23)
    sr = dict(sr_bits=sr_bits, philox_rounds=philox_rounds)
    cache = filled_cache(gen, fmt, "sr", device, tokens=[0, 2**19 + 5, 3], **sr)
    twin = StateCache(cache.state.clone(), None if cache.scales is None else cache.scales.clone(),
                      None, cache.tokens.clone(), fmt, "sr", SEED)
    params = make_params(gen, SHAPE["nheads"])
    token = make_token(gen, 3)
    run_and_check(cache, token, params)
    mamba2_state_update(twin, **to(token, device), **to(params, device))
    if (sr_bits, philox_rounds) != (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS):
        assert not torch.equal(cache.state.cpu(), twin.state.cpu())
    run_and_check(cache, make_token(gen, 3), params)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp4_e2m1_b32"])
def test_empty_state_is_lowprecs_zero_state(fmt):
    """StateCache.empty holds lowprec's quantisation of the zero state, scales included
    (mxfp4's zero blocks have scale 2^-127, not 0.0, which packs as the scale 0.5)."""
    cache = StateCache.empty(2, 3, 5, 32, format=fmt)
    expected = lq.quantize(torch.zeros(2, 3, 5, 32), fmt)
    assert_bits_equal(cache.state, lq.dequantize(expected), "state")
    assert_bits_equal(cache.scales, expected.scales, "scales")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp16", "nvfp4"])
def test_output_from_unrounded_state(fmt, device):
    """output_from='unrounded' (the CuTe kernel's and mamba_ssm's choice): y reads the new
    state before rounding, within the fp32 bound of lowprec.mamba2.mamba2_step's y; the stored
    state is the same as with 'stored'."""
    gen = torch.Generator().manual_seed(25)
    cache = filled_cache(gen, fmt, "sr", device, tokens=[4, 0, 1])
    run_and_check(cache, make_token(gen, 3), make_params(gen, SHAPE["nheads"]), "unrounded")


@pytest.mark.parametrize("device", DEVICES)
def test_several_tokens_and_fp16_tensor(device):
    """Six tokens of FP16 SR carried on the emulation's own state, each bit exact; a float16
    state tensor stores the same bits as the fp32 container."""
    gen = torch.Generator().manual_seed(22)
    params = make_params(gen, SHAPE["nheads"])
    cache = filled_cache(gen, "fp16", "sr", device, tokens=[0, 1, 2])
    twin = StateCache(cache.state.clone().half(), None, None, cache.tokens.clone(), "fp16", "sr",
                      SEED)
    for _ in range(6):
        token = make_token(gen, 3)
        run_and_check(cache, token, params)
        mamba2_state_update(twin, **to(token, device), **to(params, device))
    assert_bits_equal(twin.state.float(), cache.state, "float16 state vs fp32 container")


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_follow_the_conventional_policy_simulator(device):
    """Eight tokens of the FP16 RN state from zero, no D or z: y stays within 2^-13 relative
    RMS of lowprec.policies.Simulator('conventional', fp16, rn) (fp64 arithmetic, so a state
    value near an fp16 tie may round the other way: one fp16 ulp, 2^-10 relative, on a few
    elements; measured 1.1e-5). Tight enough to fail when the state is stored unrounded
    (3.6e-4: the fp32 state against the simulator's fp16 one) or the step reads the unrounded
    state."""
    gen = torch.Generator().manual_seed(23)
    h, p, n, g = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"], SHAPE["ngroups"]
    cache = StateCache.empty(2, h, p, n, format="fp16", rounding="rn", seed=SEED, device=device)
    sim = Simulator("mamba2", Policy("conventional", fmt="fp16", rounding="rn"), 2, h, p, n)
    params = make_params(gen, h)
    errs, refs = [], []
    for _ in range(8):
        tok = make_token(gen, 2)
        y = mamba2_state_update(cache, tok["x"].to(device), tok["dt"].to(device),
                                params["A"].to(device), tok["B"].to(device),
                                tok["C"].to(device), dt_bias=params["dt_bias"].to(device))
        dt = mamba2.mamba2_process_dt(tok["dt"].double(), params["dt_bias"].double())
        heads = h // g
        y_sim = sim.step(torch.exp(dt * params["A"].double()), dt[..., None] * tok["x"].double(),
                         tok["B"].double().repeat_interleave(heads, dim=1),
                         tok["C"].double().repeat_interleave(heads, dim=1))
        errs.append(y.cpu().double() - y_sim)
        refs.append(y_sim)
    err = torch.stack(errs).norm() / torch.stack(refs).norm()
    assert err <= 2.0**-13, f"relative RMS {err:.2e}"


def _valid(**change):
    gen = torch.Generator().manual_seed(24)
    cache = filled_cache(gen, "nvfp4", "rn", "cpu", tokens=[0, 0])
    token = make_token(gen, 2)
    params = make_params(gen, SHAPE["nheads"])
    token.update({k: v for k, v in change.items() if k in token})
    params.update({k: v for k, v in change.items() if k in params})
    for k, v in change.items():
        if hasattr(cache, k):
            setattr(cache, k, v)
    extra = {k: change[k] for k in ("dt_softplus", "check_counters") if k in change}
    if change.get("out") == "x":
        extra["out"] = token["x"]
    if change.get("out") == "state":  # out over the state's bytes, which the step rewrites
        size = token["x"].numel() * token["x"].element_size()
        state_bytes = cache.state.view(-1).view(torch.uint8)
        extra["out"] = state_bytes[:size].view(token["x"].dtype).view(token["x"].shape)
    mamba2_state_update(cache, **token, **params, output_from=change.get("output_from", "stored"),
                        **extra)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=torch.zeros(2, 3, 4)), r"x: expected shape \[2, 3, 5\]"),
        (dict(B=torch.zeros(2, 2, 32)), "B: expected ngroups dividing"),
        (dict(C=torch.zeros(2, 3, 32, dtype=torch.float16)), "C: expected dtype"),
        (dict(dt_bias=torch.zeros(3, dtype=torch.float64)), "dt_bias: expected dtype"),
        (dict(format="fp64"), "cache.format"),
        (dict(format="mxfp4"), "cache.scales: expected shape"),
        (dict(rounding="nearest"), "cache.rounding"),
        (dict(tokens=torch.full((2,), 2**20, dtype=torch.int32)), "cache.tokens: expected "
                                                                   "values"),
        (dict(state=torch.zeros(2, 3, 5, 32, dtype=torch.float16)), "cache.state: expected "
                                                                     "dtype"),
        (dict(output_from="fresh"), "output_from"),
        (dict(out="x"), "out: expected a tensor that shares no memory with the inputs"),
        (dict(out="state"), "out: expected a tensor .* got one that shares cache.state's"),
        (dict(dt_softplus="no"), "dt_softplus: expected a bool"),
        (dict(check_counters=0), "check_counters: expected a bool"),
        (dict(state=torch.zeros(2, 3, 0, 32)), "cache.state: expected nheads, headdim and"),
    ],
    ids=["x-shape", "ngroups", "C-dtype", "dt_bias-dtype", "fp64", "scales", "rounding",
         "tokens", "state-dtype", "output-from", "out-is-x", "out-over-state", "softplus-word",
         "check-int", "no-headdim"],
)
def test_invalid_inputs_raise_value_error(change, match):
    """Bad shapes, dtypes, formats and counters raise a ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        _valid(**change)
