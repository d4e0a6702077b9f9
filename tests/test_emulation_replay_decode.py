"""The Triton ReplaySSM decode step equals lowprec's, stored copies bit for bit.

For the same cache and token the emulation's step must give:
- outputs within the fp32 bound below of `lowprec.mamba2.mamba2_replay_output` (non-flush
  slots, read copy + ring) or of the flush output (flush slots, unrounded new state);
- at flush slots an unrounded new state (`debug_state`) within the same bound of
  `lowprec.mamba2.mamba2_replay_flush`, and stored copies equal, bit for bit, to lowprec applied
  to that state: hi = `policies.round_state(S, hi_format, hi_rounding, seed, slot, flushes)`,
  lo = `quantize(S, lo_format)` (values, block scales, second-level scale);
- untouched copies at non-flush slots, the record appended to the ring, cursors and flush
  counters moved as DESIGN.md says.
Slots sit at different ring positions in one call; outputs are pre-filled with NaN so that an
unwritten element fails. Over several windows each step is checked against lowprec applied to
the emulation's own cache (so the bit-exact check holds every window), and the drift of the
whole run is checked separately against the fp64 recurrence.

fp32 bound (u = 2^-24). An output or state element is a sum of n <= dstate + Lcap + 2 terms,
each a product of at most four fp32-rounded factors, one of them a decay exp(A * cumsum(dt))
whose fp32 exp and cumsum (<= Lcap terms) and softplus add a few u relative. Higham's
|fl(sum) - sum| <= gamma_n sum|terms| with gamma_n ~ n u, plus ~(Lcap + 8) u per term for the
factors, gives |err| <= (dstate + 2 Lcap + 16) u * sum|terms|, where sum|terms| is the same
replay evaluated on absolute values (decays are positive). The tests allow twice that.
"""

import copy
import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton cannot compile for a CPU: interpret (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checks import assert_bits_equal, assert_within
from gdn_emulation_cases import random_copies  # noqa: E402

from emulation.replay_decode import ReplayCache, mamba2_replay_decode  # noqa: E402
from lowprec import formats, mamba2, philox  # noqa: E402
from lowprec import quantize as lq  # noqa: E402
from lowprec.policies import round_state  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="compiled Triton: GPU")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
U = 2.0**-24
F64 = torch.float64
SHAPES = {  # odd sizes: headdim 5 and 7, dstate 48 (not a power of two), 1..3 groups
    "h3-p5-n32-g1": dict(nheads=3, headdim=5, dstate=32, ngroups=1),
    "h3-p7-n48-g3": dict(nheads=3, headdim=7, dstate=48, ngroups=3),
    "h4-p8-n32-g2": dict(nheads=4, headdim=8, dstate=32, ngroups=2),
}
WINDOW = 4
SEED = 2**33 + 7  # above 2^32: the key's high word is used


# --------------------------------------------------------------------------------------------
# helpers


def make_params(gen, nheads):
    """A [h] in [-1.2, -0.2], D [h], dt_bias [h] (fp32)."""
    return dict(
        A=-(torch.rand(nheads, generator=gen) + 0.2),
        D=torch.randn(nheads, generator=gen),
        dt_bias=0.3 * torch.randn(nheads, generator=gen),
    )


def make_token(gen, slots, shape, act_dtype, device):
    """One token's x, dt (raw), B, C, z for every slot."""
    h, p, n, g = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]
    t = dict(
        x=torch.randn(slots, h, p, generator=gen).to(act_dtype),
        dt=torch.randn(slots, h, generator=gen) - 1.0,
        B=torch.randn(slots, g, n, generator=gen).to(act_dtype),
        C=torch.randn(slots, g, n, generator=gen).to(act_dtype),
        z=torch.randn(slots, h, p, generator=gen).to(act_dtype),
    )
    return {k: v.to(device) for k, v in t.items()}


def filled_cache(gen, slots, shape, hi, lo, act_dtype, device, cursors, flushes,
                 window=WINDOW, **sr):
    """A cache with random copies (exactly representable in their formats), records at ring
    positions < cursors and NaN past them, and the given counters (`sr`: the cache's
    sr_bits / philox_rounds)."""
    h, p, n, g = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]
    cache = ReplayCache.empty(
        slots, h, p, n, ngroups=g, window=window, hi_format=hi[0], hi_rounding=hi[1],
        lo_format=lo, seed=SEED, act_dtype=act_dtype, device=device, **sr,
    )
    random_copies(cache, hi[0], lo, gen)
    lcap = cache.ring_x.shape[2]
    held = torch.arange(lcap)[None, :] < torch.tensor(cursors)[:, None]  # [slots, Lcap]
    ring_x = torch.randn(slots, h, lcap, p, generator=gen)
    ring_B = torch.randn(slots, g, lcap, n, generator=gen)
    ring_dt = F.softplus(torch.randn(slots, h, lcap, generator=gen) - 1.0)
    cache.ring_x.copy_(torch.where(held[:, None, :, None], ring_x, math.nan).to(act_dtype))
    cache.ring_B.copy_(torch.where(held[:, None, :, None], ring_B, math.nan).to(act_dtype))
    cache.ring_dt.copy_(torch.where(held[:, None, :], ring_dt, math.nan))
    cache.cursors.copy_(torch.tensor(cursors, dtype=torch.int32))
    cache.flushes.copy_(torch.tensor(flushes, dtype=torch.int32))
    return cache


def snapshot(cache):
    """The cache's tensors on the CPU (fp64 for the numeric ones), before a step."""
    out = {k: getattr(cache, k).detach().cpu().clone() for k in (
        "hi", "lo", "lo_scales", "lo_global", "ring_x", "ring_dt", "ring_B", "cursors",
        "flushes") if getattr(cache, k) is not None}
    return out


def reference_step(before, token, params, window):
    """lowprec's step on the snapshot `before`: (y, S_new, y bound, S bound, is_flush, ring).

    Bounds are (dstate + 2 Lcap + 16) u * sum|terms| (module docstring), times 2.
    """
    d = {k: v.detach().cpu().double() for k, v in token.items()}
    p = {k: v.detach().cpu().double() for k, v in params.items()}
    slots, nheads = d["x"].shape[:2]
    lcap, dstate = before["ring_B"].shape[2:]
    cur = before["cursors"].long()
    dt = mamba2.mamba2_process_dt(d["dt"], p["dt_bias"])
    s_idx, h_idx = torch.arange(slots)[:, None], torch.arange(nheads)[None, :]
    g_idx = torch.arange(before["ring_B"].shape[1])[None, :]
    ring_x, ring_dt, ring_B = (before[k].double().clone() for k in ("ring_x", "ring_dt", "ring_B"))
    ring_x[s_idx, h_idx, cur[:, None]] = d["x"]
    ring_dt[s_idx, h_idx, cur[:, None]] = dt
    ring_B[s_idx, g_idx, cur[:, None]] = d["B"]
    held = cur + 1
    is_flush = held == window
    gate = F.silu(d["z"])
    args = (held, d["C"], d["x"], p["A"], p["D"], d["z"])
    y_out = mamba2.mamba2_replay_output(before["lo"].double(), ring_x, ring_dt, ring_B, *args)
    abs_args = (held, d["C"].abs(), d["x"].abs(), p["A"], p["D"].abs(), None)
    mag_out = mamba2.mamba2_replay_output(
        before["lo"].double().abs(), ring_x.abs(), ring_dt, ring_B.abs(), *abs_args
    ) * gate.abs()
    S_new = mamba2.mamba2_replay_flush(before["hi"].double(), ring_x, ring_dt, ring_B, held,
                                       p["A"])
    mag_S = mamba2.mamba2_replay_flush(before["hi"].double().abs(), ring_x.abs(), ring_dt,
                                       ring_B.abs(), held, p["A"])
    C_h = d["C"].repeat_interleave(nheads // d["C"].shape[1], dim=1)
    Dx = p["D"][None, :, None] * d["x"]
    y_flush = (torch.einsum("bhvk,bhk->bhv", S_new, C_h) + Dx) * gate
    mag_flush = (torch.einsum("bhvk,bhk->bhv", mag_S, C_h.abs()) + Dx.abs()) * gate.abs()
    flush3 = is_flush[:, None, None]
    y = torch.where(flush3, y_flush, y_out)
    factor = 2 * (dstate + 2 * lcap + 16) * U
    y_bound = factor * torch.where(flush3, mag_flush, mag_out)
    return y, S_new, y_bound, factor * mag_S, is_flush, (ring_x, ring_dt, ring_B)


def run_and_check_step(cache, token, params, hi, lo):
    """One emulation step checked against lowprec on the cache it started from."""
    before = snapshot(cache)
    slots, nheads, headdim, dstate = cache.hi.shape
    y = torch.full((slots, nheads, headdim), math.nan, device=cache.hi.device)
    debug = torch.full(cache.hi.shape, math.nan, device=cache.hi.device)
    mamba2_replay_decode(cache, **token, **params, out=y, debug_state=debug)
    y_ref, S_ref, y_bound, S_bound, is_flush, ring = reference_step(
        before, token, params, cache.window
    )
    assert_within(y, y_ref, y_bound, "y")
    debug = debug.cpu()
    fl = is_flush.nonzero()[:, 0]
    keep = (~is_flush).nonzero()[:, 0]
    assert bool(debug[keep].isnan().all()), "debug_state written at a non-flush slot"
    assert_within(debug[fl], S_ref[fl], S_bound[fl], "unrounded new state")

    # stored copies: lowprec applied to the emulation's own unrounded state, bit for bit
    hi_ref = round_state(debug[fl], hi[0], hi[1], cache.seed, fl, before["flushes"][fl].long(),
                         sr_bits=cache.sr_bits, philox_rounds=cache.philox_rounds)
    assert_bits_equal(cache.hi.cpu()[fl], hi_ref, f"hi copy ({hi[0]} {hi[1]})")
    q = lq.quantize(debug[fl], lo)
    assert_bits_equal(cache.lo.cpu()[fl], lq.dequantize(q), f"lo copy ({lo})")
    if q.scales is not None:
        assert_bits_equal(cache.lo_scales.cpu()[fl], q.scales, f"lo block scales ({lo})")
    if q.global_scale is not None:
        assert_bits_equal(cache.lo_global.cpu()[fl], q.global_scale, f"lo s_g ({lo})")
    for name in ("hi", "lo", "lo_scales", "lo_global"):
        if name in before:
            assert_bits_equal(getattr(cache, name).cpu()[keep], before[name][keep],
                              f"{name} at non-flush slots")

    # ring and counters
    ring_x, ring_dt, ring_B = ring
    lcap = ring_x.shape[2]
    valid = torch.arange(lcap)[None, :] <= before["cursors"].long()[:, None]  # [slots, Lcap]
    vx = valid[:, None, :, None].expand_as(ring_x)
    vB = valid[:, None, :, None].expand_as(ring_B)
    assert torch.equal(cache.ring_x.cpu().double()[vx], ring_x[vx])
    assert torch.equal(cache.ring_B.cpu().double()[vB], ring_B[vB])
    vdt = valid[:, None, :].expand_as(ring_dt)
    assert_within(cache.ring_dt.cpu()[vdt], ring_dt[vdt], 16 * U * ring_dt[vdt].abs(), "ring dt")
    cursors = torch.where(is_flush, 0, before["cursors"].long() + 1)
    assert cache.cursors.cpu().long().tolist() == cursors.tolist()
    assert cache.flushes.cpu().long().tolist() == (before["flushes"] + is_flush).tolist()
    return y


# --------------------------------------------------------------------------------------------
# one step


LO_FORMATS = [name for name in formats.names() if name != "fp64"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lo", LO_FORMATS)
def test_step_copies_bit_exact_every_read_format(lo, device):
    """Slots at ring positions L-1 (flush), 0 and 2 in one call: outputs to the fp32 bound,
    hi = FP16-SR(S_new) with each slot's own flush counter and lo = RN_lo(S_new) bit for bit."""
    gen = torch.Generator().manual_seed(1)
    shape = SHAPES["h3-p5-n32-g1"]
    hi = ("fp16", "sr")
    cache = filled_cache(gen, 3, shape, hi, lo, torch.float32, device,
                         cursors=[WINDOW - 1, 0, 2], flushes=[5, 0, 2])
    params = {k: v.to(device) for k, v in make_params(gen, shape["nheads"]).items()}
    run_and_check_step(cache, make_token(gen, 3, shape, torch.float32, device), params, hi, lo)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape_id, hi, lo, act_dtype",
    [
        ("h3-p7-n48-g3", ("fp32", "rn"), "nvfp4", torch.float32),
        ("h4-p8-n32-g2", ("fp16", "sr"), "mxfp4", torch.bfloat16),
        ("h3-p7-n48-g3", ("bf16", "sr"), "fp8_e4m3_row", torch.float16),
        ("h4-p8-n32-g2", ("fp32", "rn"), "fp32", torch.float32),
    ],
    ids=["fp32-nvfp4-f32act", "fp16sr-mxfp4-bf16act", "bf16sr-e4m3row-f16act", "fp32-fp32"],
)
def test_step_odd_shapes_and_activation_dtypes(shape_id, hi, lo, act_dtype, device):
    """Odd shapes (headdim 7, dstate 48, 3 groups of 1 head, 2 groups of 2), bf16/fp16
    activations and other copy formats, four slots at positions L-1, 1, L-1, 0."""
    gen = torch.Generator().manual_seed(2)
    shape = SHAPES[shape_id]
    cache = filled_cache(gen, 4, shape, hi, lo, act_dtype, device,
                         cursors=[WINDOW - 1, 1, WINDOW - 1, 0], flushes=[0, 3, 1, 9])
    params = {k: v.to(device) for k, v in make_params(gen, shape["nheads"]).items()}
    run_and_check_step(cache, make_token(gen, 4, shape, act_dtype, device), params, hi, lo)


@pytest.mark.parametrize("lo", ["nvfp4", "mxfp4", "fp8_e4m3_row", "fp4_e2m1_b16"])
def test_empty_cache_read_copy_is_lowprecs_zero_state(lo):
    """ReplayCache.empty's read copy is lowprec's quantisation of the zero state, scales
    included, so it packs to the same bytes (mxfp4's zero blocks have scale 2^-127, byte 0x00:
    a 0.0 scale packed as byte 126)."""
    cache = ReplayCache.empty(2, 3, 5, 32, lo_format=lo)
    expected = lq.quantize(torch.zeros(2, 3, 5, 32), lo)
    assert_bits_equal(cache.lo_scales, expected.scales, "lo_scales")
    actual = lq.Quantized(expected.fmt, cache.lo, cache.lo_scales, cache.lo_global)
    for key, value in lq.pack(expected).items():
        assert torch.equal(lq.pack(actual)[key], value), key


@pytest.mark.parametrize("device", DEVICES)
def test_hi_copy_in_fp16_dtype_holds_the_same_bits(device):
    """A float16 hi tensor stores the same values as the fp32 container of fp16."""
    gen = torch.Generator().manual_seed(3)
    shape = SHAPES["h3-p5-n32-g1"]
    caches = []
    for hi_dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(3)
        cache = filled_cache(g, 2, shape, ("fp16", "sr"), "nvfp4", torch.float32, device,
                             cursors=[WINDOW - 1, WINDOW - 1], flushes=[0, 4])
        cache.hi = cache.hi.to(hi_dtype)
        caches.append(cache)
    params = {k: v.to(device) for k, v in make_params(gen, shape["nheads"]).items()}
    token = make_token(gen, 2, shape, torch.float32, device)
    for cache in caches:
        mamba2_replay_decode(cache, **token, **params)
    assert_bits_equal(caches[1].hi.float(), caches[0].hi, "fp16 tensor vs fp32 container")


# SR settings (sr_bits, philox_rounds): every width at 10 rounds, 7 and 4 rounds at 32 and 8
# bits; the fast ones cover each lane width (32, 16, 13 masked, 8) and 10, 7 and 4 rounds
SR_SETTINGS = [(32, 10), (16, 10), (13, 10), (8, 10), (32, 7), (8, 7), (32, 4), (8, 4)]
SR_FAST = {(16, 10), (13, 10), (8, 7), (32, 4)}
SR_CASES = [pytest.param(k, r, "cpu", id=f"cpu-{k}b-{r}r", marks=(
    pytest.mark.skipif(not INTERPRETED, reason="compiled Triton: GPU"),
    *(() if (k, r) in SR_FAST else (pytest.mark.slow,)))) for k, r in SR_SETTINGS] + [
    pytest.param(13, 7, "cuda", id="cuda-13b-7r", marks=pytest.mark.gpu),
    pytest.param(8, 4, "cuda", id="cuda-8b-4r", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("sr_bits, philox_rounds, device", SR_CASES)
def test_flush_hi_words_every_sr_setting(sr_bits, philox_rounds, device):
    """An FP16-SR recurrence copy with `sr_bits` random bits per element from
    `philox_rounds`-round Philox: at slots flushing with counters 0, 2^19 + 5 and 3 (beside
    one that does not) the hi words are lowprec's `round_state(S_new, 'fp16', 'sr', ...,
    sr_bits=, philox_rounds=)` bit for bit (h 3, headdim 5, dstate 24: a head's 120 elements
    end mid-counter for 8 and 16 bits). A twin cache at the defaults (16, 7) stores other hi
    words from the same step and the same read copy."""
    shape = dict(nheads=3, headdim=5, dstate=24, ngroups=1)
    hi, lo = ("fp16", "sr"), "fp8_e4m3_row"
    cursors, flushes = [WINDOW - 1, WINDOW - 1, 1, WINDOW - 1], [0, 2**19 + 5, 1, 3]
    cache = filled_cache(torch.Generator().manual_seed(13), 4, shape, hi, lo, torch.float32,
                         device, cursors, flushes, sr_bits=sr_bits, philox_rounds=philox_rounds)
    twin = filled_cache(torch.Generator().manual_seed(13), 4, shape, hi, lo, torch.float32,
                        device, cursors, flushes)
    gen = torch.Generator().manual_seed(14)
    params = {k: v.to(device) for k, v in make_params(gen, shape["nheads"]).items()}
    token = make_token(gen, 4, shape, torch.float32, device)
    run_and_check_step(cache, token, params, hi, lo)
    mamba2_replay_decode(twin, **token, **params)
    fl = torch.tensor([0, 1, 3])
    assert torch.equal(cache.lo.cpu(), twin.lo.cpu())
    if (sr_bits, philox_rounds) != (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS):
        assert not torch.equal(cache.hi.cpu()[fl], twin.hi.cpu()[fl])


@pytest.mark.gpu
@pytest.mark.parametrize("lo", ["nvfp4", "mxfp4"])
def test_nemotron_layer_size_step_bit_exact(lo):
    """The Nemotron-3-Super Mamba-2 layer (128 heads, headdim 64, dstate 128, 8 groups, L=16,
    bf16 activations), six slots at ring positions 15, 0, 7, 15, 3, 14: the same checks as the
    small shapes (compiled kernel only: far too slow for the interpreter)."""
    gen = torch.Generator().manual_seed(7)
    shape = dict(nheads=128, headdim=64, dstate=128, ngroups=8)
    cache = filled_cache(gen, 6, shape, ("fp16", "sr"), lo, torch.bfloat16, "cuda",
                         cursors=[15, 0, 7, 15, 3, 14], flushes=[0, 1, 2, 3, 4, 5], window=16)
    params = {k: v.cuda() for k, v in make_params(gen, 128).items()}
    run_and_check_step(cache, make_token(gen, 6, shape, torch.bfloat16, "cuda"), params,
                       ("fp16", "sr"), lo)


# --------------------------------------------------------------------------------------------
# several windows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape_id, hi, lo",
    [("h3-p7-n48-g3", ("fp16", "sr"), "nvfp4"), ("h4-p8-n32-g2", ("fp32", "rn"), "mxfp4")],
    ids=["fp16sr-nvfp4", "fp32-mxfp4"],
)
def test_windows_copies_bit_exact_from_own_cache(shape_id, hi, lo, device):
    """Nine tokens (2.25 windows of L = 4) from slots starting at positions 0, 1 and 3: every
    step matches lowprec on the emulation's own cache, copies bit for bit at every flush."""
    gen = torch.Generator().manual_seed(4)
    shape = SHAPES[shape_id]
    cache = filled_cache(gen, 3, shape, hi, lo, torch.float32, device,
                         cursors=[0, 1, 3], flushes=[0, 1, 2])
    params = {k: v.to(device) for k, v in make_params(gen, shape["nheads"]).items()}
    flushes_before = cache.flushes.clone()
    for _ in range(9):
        run_and_check_step(cache, make_token(gen, 3, shape, torch.float32, device), params,
                           hi, lo)
    assert (cache.flushes - flushes_before).tolist() == [2, 2, 3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "hi, lo, rtol",
    [
        # exact arm: only fp32 arithmetic; the fp32 bound above, summed over 12 steps of a
        # recurrence that contracts (|a| < 1), stays below ~100 * 64 u ~ 4e-4 relative to
        # sum|terms|; relative to the RMS of y, 1e-5 leaves a 10x margin over what we see.
        (("fp32", "rn"), "fp32", 1e-5),
        # fp16 copies: each flush rounds the state to 11 bits (RN) or one fp16 ulp (SR),
        # |err| <= 2^-10 relative per element; through y = S C with random C the error stays
        # of that order: 4 * 2^-10 relative RMS over 3 windows.
        (("fp16", "sr"), "fp16", 4 * 2.0**-10),
    ],
    ids=["fp32-fp32", "fp16sr-fp16"],
)
def test_drift_against_fp64_recurrence(hi, lo, rtol, device):
    """Twelve tokens (3 windows) from the zero state: outputs stay within rtol (relative RMS)
    of the fp64 recurrence decoded token by token (lowprec.mamba2.mamba2_step)."""
    gen = torch.Generator().manual_seed(5)
    shape = SHAPES["h4-p8-n32-g2"]
    h, p, n, g = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]
    cache = ReplayCache.empty(2, h, p, n, ngroups=g, window=WINDOW, hi_format=hi[0],
                              hi_rounding=hi[1], lo_format=lo, seed=SEED,
                              act_dtype=torch.float32, device=device)
    params = make_params(gen, h)
    p64 = {k: v.double() for k, v in params.items()}
    state = torch.zeros(2, h, p, n, dtype=F64)
    errs, refs = [], []
    for _ in range(3 * WINDOW):
        token = make_token(gen, 2, shape, torch.float32, "cpu")
        t64 = {k: v.double() for k, v in token.items()}
        y_ref, state = mamba2.mamba2_step(state, t64["x"], t64["dt"], p64["A"], t64["B"],
                                          t64["C"], p64["D"], t64["z"], p64["dt_bias"])
        y = mamba2_replay_decode(cache, **{k: v.to(device) for k, v in token.items()},
                                 **{k: v.to(device) for k, v in params.items()})
        errs.append(y.cpu().double() - y_ref)
        refs.append(y_ref)
    err = torch.stack(errs).norm() / torch.stack(refs).norm()
    assert err <= rtol, f"relative RMS error {err:.3e} > {rtol:.1e}"


# --------------------------------------------------------------------------------------------
# validation


def _valid_call_parts(device="cpu"):
    gen = torch.Generator().manual_seed(6)
    shape = SHAPES["h3-p5-n32-g1"]
    cache = filled_cache(gen, 2, shape, ("fp16", "sr"), "nvfp4", torch.float32, device,
                         cursors=[0, 1], flushes=[0, 0])
    return cache, make_token(gen, 2, shape, torch.float32, device), make_params(gen, 3)


def _call_with(change):
    cache, token, params = _valid_call_parts()
    change(cache, token, params)
    mamba2_replay_decode(cache, **token, **params)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c, t, p: t.update(x=t["x"][:, :, :4]), r"x: expected shape \[2, 3, 5\]"),
        (lambda c, t, p: t.update(x=t["x"].double()), "x: expected dtype"),
        (lambda c, t, p: t.update(dt=t["dt"].half()), "dt: expected dtype"),
        (lambda c, t, p: t.update(B=t["B"].repeat(1, 1, 2)[:, :, ::2]),
         "B: expected a contiguous"),
        (lambda c, t, p: p.update(A=p["A"][:2]), r"A: expected shape \[3\]"),
        (lambda c, t, p: c.cursors.fill_(WINDOW), r"cache.cursors: expected values in \[0, 3\]"),
        (lambda c, t, p: setattr(c, "lo_format", "mxfp4"), "cache.lo_scales: expected shape"),
        (lambda c, t, p: setattr(c, "hi_format", "nvfp4"), "cache.hi_format: expected an "
                                                           "element format"),
        (lambda c, t, p: setattr(c, "hi_rounding", "up"), "cache.hi_rounding"),
        (lambda c, t, p: setattr(c, "ring_dt", c.ring_dt[:, :, :2]), "cache.ring_dt: expected "
                                                                     "shape"),
        (lambda c, t, p: setattr(c, "cursors", c.cursors.long()), "cache.cursors: expected "
                                                                  "dtype"),
        (lambda c, t, p: setattr(c, "draft", 1), "cache.draft: expected 0"),
        (lambda c, t, p: t.update(z=t["z"].to("meta")), "z: expected device"),
    ],
    ids=["x-shape", "x-dtype", "dt-dtype", "B-strides", "A-shape", "cursor-range",
         "lo-scales", "hi-block-format", "hi-rounding", "ring-shape", "cursor-dtype",
         "draft", "z-device"],
)
def test_invalid_inputs_raise_value_error(change, match):
    """Bad shapes, dtypes, strides, devices, ring positions and formats raise a ValueError
    naming the argument, the expected and the actual value."""
    with pytest.raises(ValueError, match=match):
        _call_with(change)


@pytest.mark.parametrize("call, match", [
    (lambda c, t, p: mamba2_replay_decode(c, **t, **p, out=t["x"]),
     "out: expected a tensor that shares no memory with the inputs, got one that shares x's"),
    (lambda c, t, p: mamba2_replay_decode(c, **t, **p, dt_softplus="false"),
     "dt_softplus: expected a bool, got 'false'"),
    (lambda c, t, p: mamba2_replay_decode(c, **t, **p, check_counters=1),
     "check_counters: expected a bool"),
    (lambda c, t, p: ReplayCache.empty(3, 6, 5, 32, window=-1), "window: expected an int >= 1"),
    (lambda c, t, p: ReplayCache.empty(3, 6, 5, 32, window=2.0), "window: expected an int"),
    (lambda c, t, p: ReplayCache.empty(-1, 6, 5, 32), "slots: expected an int >= 0"),
    (lambda c, t, p: ReplayCache.empty(3, 0, 5, 32), "nheads: expected an int >= 1"),
    (lambda c, t, p: ReplayCache.empty(3, 6, 5, 32, act_dtype=torch.int8), "act_dtype"),
    (lambda c, t, p: mamba2_replay_decode(
        dataclasses.replace(c, hi=c.hi[:, :0], lo=c.lo[:, :0]), **t, **p),
     "cache.hi: expected nheads, headdim and dstate >= 1"),
], ids=["out-is-x", "softplus-word", "check-int", "window-neg", "window-float", "slots-neg",
        "no-heads", "act-int8", "empty-heads"])
def test_argument_mistakes_are_named(call, match):
    """Mistakes a caller makes (out aliasing x, which would store y as the ring's record; a
    word for a switch, which bool() reads as on; sizes torch's allocator or a Triton arange
    would refuse with their own errors) raise a ValueError naming the argument."""
    cache, token, params = _valid_call_parts()
    with pytest.raises(ValueError, match=match):
        call(cache, token, params)


def test_cursors_out_of_range_without_the_check_stay_in_their_ring():
    """With check_counters=False a cursor out of range (past the ring, or negative) gives a
    meaningless output for its slot but every ring access stays within that slot's ring: the
    other slots' rings hold exactly their own appended record (unmasked, such a cursor would
    write into the next slot's ring)."""
    gen = torch.Generator().manual_seed(9)
    shape = SHAPES["h3-p5-n32-g1"]
    cache = filled_cache(gen, 3, shape, ("fp16", "sr"), "nvfp4", torch.float32, "cpu",
                         cursors=[1, 0, 2], flushes=[0, 0, 0])
    token, params = make_token(gen, 3, shape, torch.float32, "cpu"), make_params(gen, 3)
    cache.cursors.copy_(torch.tensor([1, WINDOW + 3, 2], dtype=torch.int32))
    rings = {k: getattr(cache, k).clone() for k in ("ring_x", "ring_dt", "ring_B")}
    mamba2_replay_decode(cache, **token, **params, check_counters=False)
    for name, before in rings.items():
        after = getattr(cache, name)
        assert_bits_equal(after[1], before[1], f"{name} of the out-of-range slot")
        for s, pos in ((0, 1), (2, 2)):  # each other slot: its own record, nothing else
            changed = ~((after[s] == before[s]) | (after[s].isnan() & before[s].isnan()))
            by_position = changed.transpose(0, 1).reshape(changed.shape[1], -1).any(dim=1)
            assert by_position.nonzero().flatten().tolist() == [pos], (name, s)
    cache.cursors[1] = -5
    mamba2_replay_decode(cache, **token, **params, check_counters=False)


def test_outputs_sharing_a_cache_tensors_bytes_are_refused_and_disjoint_slices_are_not():
    """The kernel reads the cache after writing y (the ring's append, a flush's state), so an
    `out` over the ring's bytes, or a `debug_state` over out's, is refused by name, as the
    CuTe wrappers refuse it; x and out as two disjoint slices of one buffer share a storage
    but no byte, and give the outputs of separate buffers (bytes are compared, not
    storages)."""
    cache, token, params = _valid_call_parts()
    n = token["x"].numel()
    over_ring = cache.ring_x.view(-1)[:n].view(token["x"].shape)
    with pytest.raises(ValueError, match="out: .* got one that shares cache.ring_x's"):
        mamba2_replay_decode(cache, **token, **params, out=over_ring)
    debug = torch.empty(cache.hi.shape, dtype=torch.float32)
    with pytest.raises(ValueError, match="debug_state: .* got one that shares out's"):
        mamba2_replay_decode(cache, **token, **params, debug_state=debug,
                             out=debug.view(-1)[:n].view(token["x"].shape))

    want = mamba2_replay_decode(copy.deepcopy(cache), **token, **params)
    buffer = torch.empty(2 * n, dtype=token["x"].dtype)
    buffer[:n] = token["x"].reshape(-1)
    token = dict(token, x=buffer[:n].view(token["x"].shape))
    got = mamba2_replay_decode(cache, **token, **params, out=buffer[n:].view(want.shape))
    assert got.data_ptr() == buffer[n:].data_ptr()
    assert torch.equal(got, want)
