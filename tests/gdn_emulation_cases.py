"""Inputs, caches and the lowprec reference shared by the GDN/KDA emulation tests.

Inputs are drawn as real GDN/KDA layers produce them: keys and queries L2-normalised (the
models normalise q and k before the recurrence), beta = sigmoid(randn) in (0, 1), and
log-decays g = -exp(randn) / tau with a memory time scale tau drawn log-uniform in [1, 1000]
per head (KDA: per channel), so a batch holds short memory (a ~ e^-2 per token) beside long
memory (a ~ 0.999).

Every helper takes a `device`: "cpu" runs the kernels in Triton's interpreter, "cuda" compiled;
the lowprec reference always runs on the CPU.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from checks import assert_bits_equal, assert_within

from emulation.gdn_replay_decode import GDNReplayCache, output_bound_flush, output_bound_window
from lowprec import formats, gdn
from lowprec import quantize as lq
from lowprec.policies import Policy
from lowprec.replay import GDNReplay, KDAReplay

SEED = 2**33 + 7  # above 2^32: the key's high word is used
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter on a machine without CUDA; compiled Triton on a GPU
CPU_ONLY = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter test (compiled: GPU)")
DEVICES = [pytest.param("cpu", marks=CPU_ONLY), pytest.param("cuda", marks=pytest.mark.gpu)]
# SR settings (sr_bits, philox_rounds): every width at 10 rounds, 7 and 4 rounds at 32 and 8
# bits; the fast ones cover each lane width (32, 16, 13 masked, 8) and 10, 7 and 4 rounds
SR_SETTINGS = [(32, 10), (16, 10), (13, 10), (8, 10), (32, 7), (8, 7), (32, 4), (8, 4)]
SR_FAST = {(16, 10), (13, 10), (8, 7), (32, 4)}


def log_decay(gen, shape):
    """g = -exp(randn) / tau, tau log-uniform in [1, 1000] (short and long memory)."""
    tau = torch.exp(torch.rand(shape, generator=gen) * math.log(1000.0))
    return -torch.exp(0.5 * torch.randn(shape, generator=gen)) / tau


def make_token(gen, slots, nheads, dv, dk, per_channel, ndraft=None, act_dtype=torch.float32,
               device="cpu"):
    """One token (or `ndraft` drafts) per slot: q, k, v, g, beta (drawn on the CPU)."""
    t = () if ndraft is None else (ndraft,)
    token = dict(
        q=F.normalize(torch.randn(slots, nheads, *t, dk, generator=gen), dim=-1).to(act_dtype),
        k=F.normalize(torch.randn(slots, nheads, *t, dk, generator=gen), dim=-1).to(act_dtype),
        v=torch.randn(slots, nheads, *t, dv, generator=gen).to(act_dtype),
        g=log_decay(gen, (slots, nheads, *t, dk) if per_channel else (slots, nheads, *t)),
        beta=torch.sigmoid(torch.randn(slots, nheads, *t, generator=gen)),
    )
    return {name: value.to(device) for name, value in token.items()}


def random_copies(cache, hi_format: str, lo_format: str, gen) -> None:
    """Fill a fresh emulation cache's (Mamba-2 or GDN) copies from a random state: hi its
    rounding to `hi_format`, lo a nearby state stored in `lo_format` (dequantised, with its
    scales), so that a step that reads the wrong copy shows."""
    state = torch.randn(cache.hi.shape, generator=gen)
    cache.hi.copy_(lq.round_to(state, formats.get(hi_format).element))
    q = lq.quantize(state + 0.1 * torch.randn(state.shape, generator=gen), lo_format)
    cache.lo.copy_(lq.dequantize(q))
    if q.scales is not None:
        cache.lo_scales.copy_(q.scales)
    if q.global_scale is not None:
        cache.lo_global.copy_(q.global_scale)


def filled_cache(gen, slots, nheads, dv, dk, hi, lo, per_channel, cursors, flushes, window,
                 draft=0, act_dtype=torch.float32, device="cpu", **sr):
    """A cache with random copies (exactly representable in their formats), records at ring
    positions < cursors (u drawn as a cached u would be: of v's size) and NaN past them
    (`sr`: the cache's sr_bits / philox_rounds)."""
    cache = GDNReplayCache.empty(
        slots, nheads, dv, dk, per_channel=per_channel, window=window, draft=draft,
        hi_format=hi[0], hi_rounding=hi[1], lo_format=lo, seed=SEED, act_dtype=act_dtype,
        device=device, **sr,
    )
    random_copies(cache, hi[0], lo, gen)
    lcap = window + draft
    rec = make_token(gen, slots, nheads, dv, dk, per_channel, ndraft=lcap, act_dtype=act_dtype)
    held = torch.arange(lcap)[None, :] < torch.tensor(cursors)[:, None]  # [slots, Lcap]
    h4 = held[:, None, :, None]
    cache.ring_u.copy_(torch.where(h4, torch.randn(slots, nheads, lcap, dv, generator=gen),
                                   math.nan))
    cache.ring_v.copy_(torch.where(h4, rec["v"].float(), math.nan).to(act_dtype))
    cache.ring_k.copy_(torch.where(h4, rec["k"].float(), math.nan).to(act_dtype))
    cache.ring_g.copy_(torch.where(h4 if per_channel else held[:, None], rec["g"], math.nan))
    cache.ring_beta.copy_(torch.where(held[:, None], rec["beta"], math.nan))
    cache.cursors.copy_(torch.tensor(cursors, dtype=torch.int32))
    cache.flushes.copy_(torch.tensor(flushes, dtype=torch.int32))
    return cache


RING = ("ring_u", "ring_v", "ring_k", "ring_g", "ring_beta")
COPIES = ("hi", "lo", "lo_scales", "lo_global")


def snapshot(cache):
    names = (*COPIES, *RING, "cursors", "flushes")
    return {n: getattr(cache, n).detach().cpu().clone() for n in names
            if getattr(cache, n) is not None}


def policy_of(cache):
    """The lowprec policy whose copies the cache stores."""
    sr = cache.hi_rounding == "sr"
    return Policy("separate", fmt=cache.lo_format, hi_fmt=cache.hi_format,
                  hi_rounding=cache.hi_rounding, window=cache.window,
                  seed=cache.seed if sr else 0, sr_bits=cache.sr_bits,
                  philox_rounds=cache.philox_rounds)


def lowprec_write_copies(cache, before, new_state, mask):
    """lowprec's GDNReplay/KDAReplay (fp32, the same policy) at the cache's counters, writing
    both copies of the slots in `mask` from `new_state`: returns the twin."""
    slots, nheads, dv, dk, _ = cache.shape
    cls = KDAReplay if cache.per_channel else GDNReplay
    twin = cls.create(slots, nheads, dv, dk, policy=policy_of(cache), draft=cache.draft,
                      dtype=torch.float32)
    twin.hi = before["hi"].float()
    twin.lo = before["lo"].clone()
    twin.flushes = before["flushes"].long()
    twin._write_copies(new_state, mask)
    return twin


def check_copies(cache, before, debug, is_flush):
    """At flush slots the stored words are lowprec's copies of the kernel's unrounded state,
    bit for bit (hi, lo values, block scales, s_g); elsewhere the copies are untouched."""
    fl = is_flush.nonzero()[:, 0]
    keep = (~is_flush).nonzero()[:, 0]
    # non-flush rows of debug_state are NaN (unwritten): lowprec's formats refuse NaN
    state = torch.where(is_flush[:, None, None, None], debug.cpu(), 0.0)
    twin = lowprec_write_copies(cache, before, state, is_flush)
    what = f"{cache.hi_format} {cache.hi_rounding} / {cache.lo_format}"
    assert_bits_equal(cache.hi.cpu().float()[fl], twin.hi[fl], f"hi copy ({what})")
    assert_bits_equal(cache.lo.cpu()[fl], twin.lo[fl], f"lo copy ({what})")
    q = lq.quantize(debug.cpu()[fl], cache.lo_format)
    if q.scales is not None:
        assert_bits_equal(cache.lo_scales.cpu()[fl], q.scales, "lo block scales")
    if q.global_scale is not None:
        assert_bits_equal(cache.lo_global.cpu()[fl], q.global_scale, "lo s_g")
    assert cache.flushes.cpu().long().tolist() == twin.flushes.tolist()
    for name in COPIES:
        if name in before:
            assert_bits_equal(getattr(cache, name).cpu()[keep].float(),
                              before[name][keep].float(), f"{name} at non-flush slots")


def ring64(before, token, position, per_channel):
    """The ring (fp64) with the token's record (v, k, g, beta) at `position [slots]`."""
    rings = {n: before[n].double().clone() for n in RING}
    s = torch.arange(position.shape[0])[:, None]
    h = torch.arange(before["ring_v"].shape[1])[None, :]
    p = position[:, None]
    for name in ("v", "k", "g", "beta"):
        rings["ring_" + name][s, h, p] = token[name].double()
    return rings


# the unit roundoff of the dtype a decode writes y in: its rounding of y joins y's bound
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def run_and_check_step(cache, token, decode, y_dtype=torch.float32):
    """One emulation decode step checked against lowprec on the cache it started from;
    `y_dtype`: the dtype the decode writes y in (the CuTe kernels write v's)."""
    before = snapshot(cache)
    slots, nheads, dv, dk, lcap = cache.shape
    pc = cache.per_channel
    device = cache.hi.device
    y = torch.full((slots, nheads, dv), math.nan, device=device)
    debug = torch.full(cache.hi.shape, math.nan, device=device)
    decode(cache, **token, out=y, debug_state=debug)
    y, debug = y.cpu(), debug.cpu()
    t64 = {k: v.cpu().double() for k, v in token.items()}
    cur = before["cursors"].long()
    held = cur + 1
    is_flush = held == cache.window
    r = ring64(before, t64, cur, pc)
    lo, hi, q = before["lo"].double(), before["hi"].double(), t64["q"]
    # the emulation's u for the current record, checked, then used by the reference output
    s_idx, h_idx = torch.arange(slots)[:, None], torch.arange(nheads)[None, :]
    u_emu = cache.ring_u.cpu()[s_idx, h_idx, cur[:, None]].double()  # [slots, h, dv]
    u_ref = gdn._replay_u(lo, r["ring_u"], r["ring_v"], r["ring_k"], r["ring_g"],
                          r["ring_beta"], held, pc)
    r["ring_u"][s_idx, h_idx, cur[:, None]] = torch.where(is_flush[:, None, None], u_ref, u_emu)
    u_bound, y_bound_w = output_bound_window(lo, r["ring_u"], r["ring_v"], r["ring_k"],
                                             r["ring_g"], r["ring_beta"], held, q, pc)
    nf = (~is_flush).nonzero()[:, 0]
    assert_within(u_emu[nf], u_ref[nf], u_bound[nf], "u of the current record")
    y_w = gdn._replay_output(lo, r["ring_u"], r["ring_k"], r["ring_g"], held, q, pc)
    S_new = gdn._replay_flush(hi, r["ring_v"], r["ring_k"], r["ring_g"], r["ring_beta"], held, pc)
    S_bound, y_bound_f = output_bound_flush(hi, r["ring_v"], r["ring_k"], r["ring_g"],
                                            r["ring_beta"], held, q, pc)
    y_f = torch.einsum("bhvk,bhk->bhv", S_new, q)
    f3 = is_flush[:, None, None]
    y_ref = torch.where(f3, y_f, y_w)
    y_bound = torch.where(f3, y_bound_f, y_bound_w)
    if y_dtype != torch.float32:
        y_bound = y_bound + UNIT_ROUNDOFF[y_dtype] * (y_ref.abs() + y_bound)
    assert_within(y, y_ref, y_bound, "y")
    fl = is_flush.nonzero()[:, 0]
    assert bool(debug[nf].isnan().all()), "debug_state written at a non-flush slot"
    assert_within(debug[fl], S_new[fl], S_bound[fl], "unrounded new state")
    check_copies(cache, before, debug, is_flush)
    # the ring: the record at the cursor, nothing else; the counters
    for name in ("ring_v", "ring_k", "ring_g", "ring_beta"):
        after = getattr(cache, name).cpu().double()
        assert torch.equal(after.nan_to_num(7.0), r[name].nan_to_num(7.0)), name
    assert cache.cursors.cpu().tolist() == torch.where(is_flush, 0, held).tolist()
    ratio = torch.cat([((y - y_ref).abs() / y_bound).flatten(),
                       ((u_emu[nf] - u_ref[nf]).abs() / u_bound[nf]).flatten()])
    return y, float(ratio.max())
