"""Speculative decoding in Triton: verify T drafts in one call, commit by moving the pointer.

Properties:
- each verify equals lowprec on the emulation's own cache: drafts read the read copy and the
  committed records (`lowprec.mamba2.mamba2_replay_verify`), or on a flush (h + T > L) the
  unrounded new state folded from the h committed records (`mamba2_replay_flush`), whose
  stored copies are lowprec's quantisation of it, bit for bit;
- with random acceptance per slot, the accepted drafts' outputs equal decoding the accepted
  tokens one at a time with the emulation's standard decode, the checkpoints equal the fp64
  recurrence after the committed tokens, and the pointers and flush counters follow
  `lowprec.replay.Mamba2Replay`.

fp32 bound per element as in test_emulation_replay_decode.py: (dstate + 2 Lcap + 16) u times
the replay evaluated on absolute values, times 2 (u = 2^-24).
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

from emulation.replay_decode import ReplayCache, mamba2_replay_decode  # noqa: E402
from emulation.replay_spec import mamba2_replay_commit, mamba2_replay_verify  # noqa: E402
from lowprec import mamba2  # noqa: E402
from lowprec import quantize as lq  # noqa: E402
from lowprec.policies import Policy, round_state  # noqa: E402
from lowprec.replay import Mamba2Replay  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="compiled Triton: GPU")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
U = 2.0**-24
WINDOW, DRAFT = 5, 3
SHAPE = dict(nheads=3, headdim=7, dstate=32, ngroups=3)
SEED = 99


def make_params(gen, nheads):
    return dict(
        A=-(torch.rand(nheads, generator=gen) + 0.2),
        D=torch.randn(nheads, generator=gen),
        dt_bias=0.3 * torch.randn(nheads, generator=gen),
    )


def make_drafts(gen, slots, T):
    """T draft tokens per slot: x, z [s, h, T, p], dt [s, h, T], B, C [s, g, T, n] (fp32)."""
    h, p, n, g = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"], SHAPE["ngroups"]
    return dict(
        x=torch.randn(slots, h, T, p, generator=gen),
        dt=torch.randn(slots, h, T, generator=gen) - 1.0,
        B=torch.randn(slots, g, T, n, generator=gen),
        C=torch.randn(slots, g, T, n, generator=gen),
        z=torch.randn(slots, h, T, p, generator=gen),
    )


def rel_rms(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


def appended(ring, drafts, start):
    """ring [s, h|g, Lcap, ...] with drafts [s, h|g, T, ...] written at start[s] + 0..T-1."""
    ring = ring.clone()
    T = drafts.shape[2]
    for s in range(ring.shape[0]):
        ring[s, :, int(start[s]):int(start[s]) + T] = drafts[s]
    return ring


def reference_verify(before, drafts, params, window):
    """lowprec's verify on the cache snapshot `before`, given the emulation's S_new (debug)."""
    d = {k: v.double() for k, v in drafts.items()}
    p = {k: v.double() for k, v in params.items()}
    T = d["x"].shape[2]
    h = before["cursors"].long()
    is_flush = h + T > window
    ring_x, ring_dt, ring_B = (before[k].double() for k in ("ring_x", "ring_dt", "ring_B"))
    held = torch.arange(ring_x.shape[2])[None, :] < h[:, None]
    ring_x = torch.where(held[:, None, :, None], ring_x, 0.0)  # NaN past the committed records
    ring_B = torch.where(held[:, None, :, None], ring_B, 0.0)
    ring_dt = torch.where(held[:, None, :], ring_dt, 0.0)
    S_ref = mamba2.mamba2_replay_flush(before["hi"].double(), ring_x, ring_dt, ring_B, h, p["A"])
    mag_S = mamba2.mamba2_replay_flush(before["hi"].double().abs(), ring_x.abs(), ring_dt,
                                       ring_B.abs(), h, p["A"])
    start = torch.where(is_flush, 0, h)
    dt = mamba2.mamba2_process_dt(d["dt"], p["dt_bias"])
    rx, rdt, rB = appended(ring_x, d["x"], start), appended(ring_dt, dt, start), \
        appended(ring_B, d["B"], start)
    base = torch.where(is_flush[:, None, None, None], before["debug"].double(),
                       before["lo"].double())
    count = start + T
    y = mamba2.mamba2_replay_verify(base, rx, rdt, rB, count, d["C"], d["x"], p["A"], p["D"],
                                    d["z"])
    mag = mamba2.mamba2_replay_verify(base.abs(), rx.abs(), rdt, rB.abs(), count, d["C"].abs(),
                                      d["x"].abs(), p["A"], p["D"].abs(), None)
    mag = mag * F.silu(d["z"]).abs()
    lcap, dstate = before["ring_B"].shape[2:]
    factor = 2 * (dstate + 2 * lcap + 16) * U
    return y, factor * mag, S_ref, factor * mag_S, is_flush


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "hi, lo", [(("fp16", "sr"), "nvfp4"), (("bf16", "rn"), "fp4_e2m1_b16")],
    ids=["fp16sr-nvfp4", "bf16rn-fp4b16"],
)
def test_verify_matches_lowprec_copies_bit_exact(hi, lo, device):
    """Six verify/commit rounds, slots at different positions with random acceptance: every
    verify's outputs within the fp32 bound of lowprec on the emulation's own cache; at flush
    slots both copies (codes, block scales and nvfp4's s_g) bit for bit lowprec's rounding of
    the unrounded new state, at the others every copy untouched."""
    gen = torch.Generator().manual_seed(11)
    h, p, n, g = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"], SHAPE["ngroups"]
    slots = 3
    cache = ReplayCache.empty(slots, h, p, n, ngroups=g, window=WINDOW, draft=DRAFT,
                              hi_format=hi[0], hi_rounding=hi[1], lo_format=lo, seed=SEED,
                              act_dtype=torch.float32, device=device)
    params = make_params(gen, h)
    flushed = 0
    for _ in range(6):
        drafts = make_drafts(gen, slots, DRAFT)
        before = {k: getattr(cache, k).cpu().clone() for k in (
            "hi", "lo", "lo_scales", "lo_global", "ring_x", "ring_dt", "ring_B", "cursors",
            "flushes") if getattr(cache, k) is not None}
        y = torch.full((slots, h, DRAFT, p), math.nan, device=device)
        debug = torch.full(cache.hi.shape, math.nan, device=device)
        mamba2_replay_verify(cache, **to(drafts, device), **to(params, device), out=y,
                             debug_state=debug)
        before["debug"] = debug.cpu()
        y_ref, y_bound, S_ref, S_bound, is_flush = reference_verify(before, drafts, params,
                                                                     WINDOW)
        assert_within(y, y_ref, y_bound, "draft outputs")
        fl = is_flush.nonzero()[:, 0]
        S_new = before["debug"][fl]
        assert_within(S_new, S_ref[fl], S_bound[fl], "unrounded new state")
        hi_ref = round_state(S_new, hi[0], hi[1], SEED, fl, before["flushes"][fl].long())
        assert_bits_equal(cache.hi.cpu()[fl], hi_ref, "hi copy")
        q = lq.quantize(S_new, lo)
        assert_bits_equal(cache.lo.cpu()[fl], lq.dequantize(q), "lo copy")
        assert_bits_equal(cache.lo_scales.cpu()[fl], q.scales, "lo scales")
        if q.global_scale is not None:
            assert_bits_equal(cache.lo_global.cpu()[fl], q.global_scale, "lo s_g")
        keep = (~is_flush).nonzero()[:, 0]
        for name in ("hi", "lo", "lo_scales", "lo_global"):
            if name in before:
                assert_bits_equal(getattr(cache, name).cpu()[keep], before[name][keep],
                                  f"{name} at non-flush slots")
        assert cache.flushes.cpu().tolist() == (before["flushes"] + is_flush).tolist()
        flushed += int(is_flush.sum())
        accepted = torch.randint(0, DRAFT + 1, (slots,), generator=gen)
        mamba2_replay_commit(cache, accepted.to(device))
    assert flushed >= 2, "the rounds should include flushes"


@pytest.mark.parametrize("device", DEVICES)
def test_verify_equals_sequential_decode_of_accepted_tokens(device):
    """fp32 copies: with random acceptance per slot, accepted drafts' outputs equal the
    standard decode of the accepted tokens one at a time (a batch-1 cache per slot), the
    checkpoint after each flush equals the fp64 recurrence after the committed tokens, and the
    pointers and flush counters equal lowprec.replay.Mamba2Replay's.

    Tolerance: both paths are fp32 replays of the same tokens from fp32 checkpoints, differing
    in where the windows break; each differs from exact arithmetic by the fp32 bound, ~ (32 +
    16 + 16) * 2u * condition ~ 1e-5 at worst over a few windows; we see ~1e-7 and allow 1e-5
    relative RMS."""
    gen = torch.Generator().manual_seed(12)
    h, p, n, g = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"], SHAPE["ngroups"]
    slots, rounds = 3, 6
    kw = dict(ngroups=g, window=WINDOW, hi_format="fp32", hi_rounding="rn", lo_format="fp32",
              act_dtype=torch.float32, device=device)
    spec = ReplayCache.empty(slots, h, p, n, draft=DRAFT, **kw)
    sequential = [ReplayCache.empty(1, h, p, n, **kw) for _ in range(slots)]
    params = make_params(gen, h)
    p64 = {k: v.double() for k, v in params.items()}
    ref = Mamba2Replay.create(slots, h, p, n, p64["A"], ngroups=g, D=p64["D"],
                              dt_bias=p64["dt_bias"], policy=Policy("exact", window=WINDOW),
                              draft=DRAFT)
    states = torch.zeros(slots, h, p, n, dtype=torch.float64)  # fp64 recurrence, committed
    ys, ys_seq, ckpts, ckpts_ref = [], [], [], []
    for _ in range(rounds):
        drafts = make_drafts(gen, slots, DRAFT)
        flushes_before = spec.flushes.cpu().clone()
        committed_state = states.clone()
        y = mamba2_replay_verify(spec, **to(drafts, device), **to(params, device)).cpu()
        ref.verify(*(drafts[k].double() for k in ("x", "dt", "B", "C", "z")))
        for s in (spec.flushes.cpu() > flushes_before).nonzero()[:, 0].tolist():
            ckpts.append(spec.hi[s].cpu().double())
            ckpts_ref.append(committed_state[s])
        accepted = torch.randint(0, DRAFT + 1, (slots,), generator=gen)
        mamba2_replay_commit(spec, accepted.to(device))
        ref.commit(accepted)
        for s in range(slots):
            for t in range(int(accepted[s])):
                token = {k: v[s:s + 1, :, t] for k, v in drafts.items()}
                y_seq = mamba2_replay_decode(sequential[s], **to(token, device),
                                             **to(params, device))
                ys.append(y[s, :, t])
                ys_seq.append(y_seq[0].cpu())
                t64 = {k: v.double() for k, v in token.items()}
                _, new = mamba2.mamba2_step(states[s:s + 1], t64["x"], t64["dt"], p64["A"],
                                            t64["B"], t64["C"], p64["D"], t64["z"],
                                            p64["dt_bias"])
                states[s] = new[0]
        assert spec.cursors.cpu().tolist() == ref.count.tolist()
        assert spec.flushes.cpu().tolist() == ref.flushes.tolist()
    assert len(ys) >= 8 and len(ckpts) >= 2, "the rounds should accept tokens and flush"
    err = rel_rms(torch.stack(ys), torch.stack(ys_seq).double())
    assert err <= 1e-5, f"spec vs sequential outputs: relative RMS {err:.2e}"
    err = rel_rms(torch.stack(ckpts), torch.stack(ckpts_ref))
    assert err <= 1e-5, f"checkpoints vs fp64 recurrence: relative RMS {err:.2e}"


def _cache(**kw):
    h, p, n, g = SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"], SHAPE["ngroups"]
    args = dict(ngroups=g, window=WINDOW, draft=DRAFT, act_dtype=torch.float32)
    args.update(kw)
    return ReplayCache.empty(2, h, p, n, **args)


def _verify(cache, drafts=None, dt_softplus=True, out=None, **change):
    gen = torch.Generator().manual_seed(13)
    drafts = make_drafts(gen, 2, DRAFT) if drafts is None else drafts
    drafts.update(change)
    out = drafts["x"] if out == "x" else out
    mamba2_replay_verify(cache, **drafts, **make_params(gen, SHAPE["nheads"]),
                         dt_softplus=dt_softplus, out=out)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: _verify(_cache(draft=0)), "cache.draft: expected T >= 1"),
        (lambda: _verify(_cache(), x=torch.zeros(2, 3, 2, 7)), r"x: expected shape \[2, 3, 3, 7\]"),
        (lambda: _verify(_cache(), C=torch.zeros(2, 3, 3, 32, dtype=torch.float16)),
         "C: expected dtype"),
        (lambda: mamba2_replay_commit(_cache(), DRAFT + 1), r"accepted: expected values in \[0"),
        (lambda: mamba2_replay_commit(_cache(), torch.ones(3, dtype=torch.int32)),
         r"accepted: expected shape \[2\]"),
        (lambda: mamba2_replay_commit(_cache(), 1.0), "accepted: expected an int"),
        (lambda: mamba2_replay_commit(_cache(draft=0), 1), "cache.draft"),
        (lambda: mamba2_replay_commit(None, 1), "cache: expected a ReplayCache, got NoneType"),
        (lambda: _verify(None), "cache: expected a ReplayCache, got NoneType"),
        (lambda: _verify(_cache(), dt_softplus="no"), "dt_softplus: expected a bool"),
        (lambda: mamba2_replay_decode(_cache(), **{k: v[:, :, 0] for k, v in make_drafts(
            torch.Generator().manual_seed(0), 2, DRAFT).items()}, **make_params(
            torch.Generator().manual_seed(0), 3)), "cache.draft: expected 0"),
    ],
    ids=["no-drafts", "x-shape", "C-dtype", "accept-too-many", "accept-shape", "accept-float",
         "commit-no-drafts", "commit-no-cache", "verify-no-cache", "softplus-word",
         "decode-with-drafts"],
)
def test_invalid_inputs_raise_value_error(call, match):
    """Bad drafts, acceptance counts and modes raise a ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        call()


def test_verify_refuses_an_out_that_is_an_input():
    """out=x stored y as the drafts' ring records (they are appended after y is written)."""
    with pytest.raises(ValueError, match="out: expected a tensor that shares no memory"):
        _verify(_cache(), out="x")


def test_commit_needs_its_own_verify():
    """One commit a verify, as lowprec's ReplaySSM.commit: a commit with no verify before it,
    or a second commit after one verify, is refused and leaves the cursors alone (it would
    count stale ring entries as records); a cursor past the window is refused as well."""
    cache = _cache()
    with pytest.raises(ValueError, match="commit: expected a mamba2_replay_verify"):
        mamba2_replay_commit(cache, 1)
    _verify(cache)
    before = cache.cursors.clone()
    mamba2_replay_commit(cache, 1)
    assert torch.equal(cache.cursors, before + 1)
    with pytest.raises(ValueError, match="commit: expected a mamba2_replay_verify"):
        mamba2_replay_commit(cache, 1)
    assert torch.equal(cache.cursors, before + 1)
    cache.pending = True  # a cache whose cursors were set by hand past the window
    cache.cursors.fill_(WINDOW - 1)
    with pytest.raises(ValueError, match="accepted: expected cursors"):
        mamba2_replay_commit(cache, 2)


def test_format_of_copies_is_checked():
    """An fp64 read copy cannot be emulated in fp32 registers."""
    with pytest.raises(ValueError, match="lo_format"):
        _cache(lo_format="fp64")
