"""GDN/KDA speculative decoding in Triton: verify T drafts per call, commit by moving the pointer.

Properties:
- each verify equals lowprec on the emulation's own cache: a flush (h + T > L) folds the h
  committed records into the recurrence copy (`lowprec.gdn._replay_flush`, within the flush
  bound) and stores lowprec's copies of it bit for bit; every draft's u and y are lowprec's
  replay (`_replay_u`, `_replay_output`) from the base (read copy, or the unrounded new state)
  and the records before it, within the window bound;
- with random acceptance per slot the pointers and flush counters follow
  `lowprec.replay.GDNReplay` / `KDAReplay`, and with fp32 copies the outputs stay within 1e-5
  relative RMS of lowprec's fp64 verify.
Tests with a `cuda` variant run the compiled kernels on a GPU with the same checks.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton cannot compile for a CPU: interpret (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checks import assert_within  # noqa: E402
from gdn_emulation_cases import (  # noqa: E402
    CPU_ONLY,
    DEVICES,
    RING,
    SEED,
    check_copies,
    filled_cache,
    make_token,
    snapshot,
)

from emulation.gdn_replay_decode import (  # noqa: E402
    GDNReplayCache,
    output_bound_flush,
    output_bound_window,
)
from emulation.gdn_replay_spec import (  # noqa: E402
    gdn_replay_commit,
    gdn_replay_verify,
    kda_replay_commit,
    kda_replay_verify,
)
from lowprec import gdn  # noqa: E402
from lowprec.policies import Policy  # noqa: E402
from lowprec.replay import GDNReplay, KDAReplay  # noqa: E402

VERIFY = {False: gdn_replay_verify, True: kda_replay_verify}
COMMIT = {False: gdn_replay_commit, True: kda_replay_commit}
RECURRENCES = [pytest.param(False, id="gdn"), pytest.param(True, id="kda")]
WINDOW, DRAFT = 5, 3
H, DV, DK = 2, 5, 32


def run_and_check_verify(cache, drafts):
    """One verify checked against lowprec on the cache it started from; returns y."""
    before = snapshot(cache)
    slots = cache.hi.shape[0]
    T, pc = cache.draft, cache.per_channel
    device = cache.hi.device
    y = torch.full((slots, H, T, DV), math.nan, device=device)
    debug = torch.full(cache.hi.shape, math.nan, device=device)
    VERIFY[pc](cache, **drafts, out=y, debug_state=debug)
    y, debug = y.cpu(), debug.cpu()
    drafts = {name: value.cpu() for name, value in drafts.items()}
    h = before["cursors"].long()
    is_flush = h + T > cache.window
    r = {n: before[n].double() for n in RING}
    hi = before["hi"].double()
    S_new = gdn._replay_flush(hi, r["ring_v"], r["ring_k"], r["ring_g"], r["ring_beta"], h, pc)
    S_bound, _ = output_bound_flush(hi, r["ring_v"], r["ring_k"], r["ring_g"], r["ring_beta"],
                                    h, torch.zeros(slots, H, DK, dtype=torch.float64), pc)
    fl = is_flush.nonzero()[:, 0]
    nf = (~is_flush).nonzero()[:, 0]
    assert_within(debug[fl], S_new[fl], S_bound[fl], "unrounded new state")
    assert bool(debug[nf].isnan().all()), "debug_state written at a non-flush slot"
    check_copies(cache, before, debug, is_flush)

    # drafts: positions start + t, u cached by the emulation for the drafts before each
    start = torch.where(is_flush, 0, h)
    base = torch.where(is_flush[:, None, None, None], debug.double(), before["lo"].double())
    s_idx, h_idx = torch.arange(slots)[:, None], torch.arange(H)[None, :]
    after_u = cache.ring_u.cpu().double()
    ring = {n: r[n].clone() for n in RING}
    for t in range(T):
        p = start + t
        for name in ("v", "k", "g", "beta"):
            ring["ring_" + name][s_idx, h_idx, p[:, None]] = drafts[name][:, :, t].double()
        held = p + 1
        u_ref = gdn._replay_u(base, ring["ring_u"], ring["ring_v"], ring["ring_k"],
                              ring["ring_g"], ring["ring_beta"], held, pc)
        u_emu = after_u[s_idx, h_idx, p[:, None]]
        q = drafts["q"][:, :, t].double()
        ring["ring_u"][s_idx, h_idx, p[:, None]] = u_emu
        u_bound, y_bound = output_bound_window(base, ring["ring_u"], ring["ring_v"],
                                               ring["ring_k"], ring["ring_g"],
                                               ring["ring_beta"], held, q, pc)
        assert_within(u_emu, u_ref, u_bound, f"u of draft {t}")
        y_ref = gdn._replay_output(base, ring["ring_u"], ring["ring_k"], ring["ring_g"], held,
                                   q, pc)
        assert_within(y[:, :, t], y_ref, y_bound, f"y of draft {t}")
    for name in ("ring_v", "ring_k", "ring_g", "ring_beta"):
        drafted = torch.arange(cache.ring_v.shape[2])[None, :] >= start[:, None]
        drafted &= torch.arange(cache.ring_v.shape[2])[None, :] < (start + T)[:, None]
        shape = drafted.shape[:1] + (1,) + drafted.shape[1:] + (1,) * (ring[name].dim() - 3)
        m = drafted.view(shape).expand_as(ring[name])
        assert torch.equal(getattr(cache, name).cpu().double()[m], ring[name][m]), name
    assert cache.cursors.cpu().tolist() == start.tolist() and cache.pending
    return y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_channel", RECURRENCES)
def test_verify_commit_rounds_match_lowprec_on_own_cache(per_channel, device):
    """Six verify/commit rounds, random acceptance per slot, slots starting at random ring
    positions (L = 5, T = 3: flushes whenever h > 2): every verify matches lowprec on the
    emulation's own cache, copies bit for bit (FP16-SR recurrence copy, NVFP4 / MXFP4 read
    copy), and the pointers move by the accepted counts."""
    gen = torch.Generator().manual_seed(3)
    lo = "mxfp4" if per_channel else "nvfp4"
    cursors = torch.randint(0, WINDOW + 1, (3,), generator=gen).tolist()
    cache = filled_cache(gen, 3, H, DV, DK, ("fp16", "sr"), lo, per_channel, cursors=cursors,
                         flushes=[0, 4, 1], window=WINDOW, draft=DRAFT, device=device)
    flushes0 = cache.flushes.cpu().clone()
    expected_flushes = torch.zeros(3, dtype=torch.int64)
    for _ in range(6):
        h = cache.cursors.cpu().long()
        expected_flushes += (h + DRAFT > WINDOW).long()
        run_and_check_verify(cache, make_token(gen, 3, H, DV, DK, per_channel, ndraft=DRAFT,
                                               device=device))
        accepted = torch.randint(0, DRAFT + 1, (3,), generator=gen, dtype=torch.int32)
        start = cache.cursors.cpu().clone()
        COMMIT[per_channel](cache, accepted.to(device))
        assert cache.cursors.cpu().tolist() == (start + accepted).tolist()
        assert not cache.pending
    assert (cache.flushes.cpu() - flushes0).tolist() == expected_flushes.tolist()
    assert int(expected_flushes.min()) >= 1


@CPU_ONLY
@pytest.mark.parametrize("per_channel", RECURRENCES)
def test_verify_commit_follow_lowprec_replay_fp64(per_channel):
    """From the zero state with fp32 copies, six rounds of verify + random commit beside
    lowprec's GDNReplay/KDAReplay (fp64, exact copies): the same pointers and flush counters,
    outputs within 1e-5 relative RMS (fp32 rounding: a few units of 2^-24 times d_k + L per
    step, and the delta rule contracts)."""
    gen = torch.Generator().manual_seed(6)
    cache = GDNReplayCache.empty(3, H, DV, DK, per_channel=per_channel, window=WINDOW,
                                 draft=DRAFT, hi_format="fp32", hi_rounding="rn",
                                 lo_format="fp32", seed=SEED)
    cls = KDAReplay if per_channel else GDNReplay
    ref = cls.create(3, H, DV, DK, policy=Policy("exact", window=WINDOW), draft=DRAFT)
    errs, refs = [], []
    for _ in range(6):
        drafts = make_token(gen, 3, H, DV, DK, per_channel, ndraft=DRAFT)
        y = VERIFY[per_channel](cache, **drafts)
        y_ref = ref.verify(*(drafts[n].double() for n in ("q", "k", "v", "g", "beta")))
        errs.append(y.double() - y_ref)
        refs.append(y_ref)
        accepted = torch.randint(0, DRAFT + 1, (3,), generator=gen)
        COMMIT[per_channel](cache, accepted.int())
        ref.commit(accepted)
        assert cache.cursors.tolist() == ref.count.tolist()
        assert cache.flushes.tolist() == ref.flushes.tolist()
    err = torch.stack(errs).norm() / torch.stack(refs).norm()
    assert err <= 1e-5, f"relative RMS error {err:.3e}"


@CPU_ONLY
def test_commit_refuses_without_verify_and_the_other_recurrence():
    """A commit with no verify pending, a KDA commit of a GDN cache and an acceptance past T
    raise a ValueError naming what was expected."""
    cache = GDNReplayCache.empty(2, H, DV, DK, window=WINDOW, draft=DRAFT)
    with pytest.raises(ValueError, match="commit: expected a gdn_replay_verify before"):
        gdn_replay_commit(cache, 1)
    with pytest.raises(ValueError, match="cache.per_channel: expected True"):
        kda_replay_commit(cache, 1)
    cache.pending = True
    with pytest.raises(ValueError, match=r"accepted: expected values in \[0, T=3\]"):
        gdn_replay_commit(cache, 4)
