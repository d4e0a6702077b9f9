"""ReplaySSM bookkeeping: standard and speculative decoding in FP64 equal the plain recurrence
decoded token by token; the precision policies write the copies the simulator writes; bad
configurations are refused.

Tolerance: ``RTOL = 1e-12`` relative (2-norm), as in test_recurrences.py: the replay and the
step differ only by FP64 rounding order over windows of at most L + T = 10 records.
"""

import pytest
import torch
import torch.nn.functional as F

from lowprec import replay
from lowprec.gdn import gdn_step
from lowprec.kda import kda_step
from lowprec.mamba2 import mamba2_step
from lowprec.policies import Policy, Simulator, make_policy
from lowprec.quantize import fake_quantize
from lowprec.replay import GDNReplay, KDAReplay, Mamba2Replay

RTOL = 1e-12
F64 = torch.float64


def assert_rel_close(actual, expected, rtol, what):
    err = (actual - expected).norm() / expected.norm()
    if not bool(err <= rtol):
        diff = (actual - expected).abs()
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {rtol:.0e}; worst element {worst}: "
            f"{actual[worst].item()!r} vs {expected[worst].item()!r}; "
            f"NaNs: {int(actual.isnan().sum())}"
        )


class Mamba2Case:
    """Random Mamba-2 tokens and the plain recurrence, for a batch of slots."""

    name = "mamba2"

    def __init__(self, gen, b=4, h=6, g=3, dv=5, dk=7):
        self.gen, self.dims = gen, (b, h, g, dv, dk)
        self.A = -torch.rand(h, dtype=F64, generator=gen) - 0.2
        self.D = torch.randn(h, dtype=F64, generator=gen)
        self.dt_bias = 0.3 * torch.randn(h, dtype=F64, generator=gen)

    def create(self, window, draft, policy=None):
        b, h, g, dv, dk = self.dims
        policy = Policy("exact", window=window) if policy is None else policy
        return Mamba2Replay.create(
            b,
            h,
            dv,
            dk,
            self.A,
            ngroups=g,
            D=self.D,
            dt_bias=self.dt_bias,
            policy=policy,
            draft=draft,
        )

    def tokens(self, *t):
        """One token per slot (``t = ()``) or ``T`` drafts (``t = (T,)``), as a dict."""
        b, h, g, dv, dk = self.dims
        r = lambda *s: torch.randn(*s, dtype=F64, generator=self.gen)  # noqa: E731
        return dict(
            x=r(b, h, *t, dv),
            dt=0.5 * r(b, h, *t) - 1.0,
            B=r(b, g, *t, dk),
            C=r(b, g, *t, dk),
            z=r(b, h, *t, dv),
        )

    @staticmethod
    def pick(tok, i):
        """Draft ``i`` of a drafts dict, as a one-token dict."""
        return {name: t[:, :, i] for name, t in tok.items()}

    def step(self, state, tok):
        return mamba2_step(state, **tok, A=self.A, D=self.D, dt_bias=self.dt_bias)


class DeltaCase(Mamba2Case):
    """Random GDN (or KDA) tokens and the plain recurrence."""

    def __init__(self, gen, per_channel, b=4, h=3, dv=5, dk=7):
        self.gen, self.dims, self.per_channel = gen, (b, h, 1, dv, dk), per_channel
        self.name = "kda" if per_channel else "gdn"

    def create(self, window, draft, policy=None):
        b, h, _, dv, dk = self.dims
        policy = Policy("exact", window=window) if policy is None else policy
        cls = KDAReplay if self.per_channel else GDNReplay
        return cls.create(b, h, dv, dk, policy=policy, draft=draft)

    def tokens(self, *t):
        b, h, _, dv, dk = self.dims
        r = lambda *s: torch.randn(*s, dtype=F64, generator=self.gen)  # noqa: E731
        decay = (dk,) if self.per_channel else ()
        return dict(
            q=r(b, h, *t, dk),
            k=F.normalize(r(b, h, *t, dk), dim=-1),
            v=r(b, h, *t, dv),
            g=-0.5 * torch.rand(b, h, *t, *decay, dtype=F64, generator=self.gen),
            beta=torch.rand(b, h, *t, dtype=F64, generator=self.gen),
        )

    def step(self, state, tok):
        return (kda_step if self.per_channel else gdn_step)(state, **tok)


CASES = {
    "mamba2": lambda gen: Mamba2Case(gen),
    "gdn": lambda gen: DeltaCase(gen, per_channel=False),
    "kda": lambda gen: DeltaCase(gen, per_channel=True),
}


@pytest.mark.parametrize("recurrence", list(CASES))
def test_standard_decoding_equals_the_recurrence_and_flushes_every_L_tokens(recurrence):
    """L = 5: tokens 4, 9, 14 are flush steps; the recurrence copy then equals the state,
    ``count`` cycles 1, 2, 3, 4, 0 and every output matches the plain step."""
    gen = torch.Generator().manual_seed(20)
    case = CASES[recurrence](gen)
    window = 5
    cache = case.create(window, draft=0)
    b, h, _, dv, dk = case.dims
    state = torch.zeros(b, h, dv, dk, dtype=F64)
    for t in range(3 * window + 2):
        tok = case.tokens()
        y_ref, state = case.step(state, tok)
        y = cache.step(**tok)
        assert_rel_close(y, y_ref, RTOL, f"{recurrence} output at t={t}")
        assert cache.count.tolist() == [(t + 1) % window] * b
        assert cache.flushes.tolist() == [(t + 1) // window] * b
        if (t + 1) % window == 0:
            assert_rel_close(cache.hi, state, RTOL, f"checkpoint at t={t}")
            assert torch.equal(cache.hi, cache.lo)


def _speculate(case, window, draft, acceptance, iterations):
    """Verify/commit ``iterations`` times with ``acceptance(it) -> [slots]`` accepted drafts;
    check every draft's output against the recurrence run from the committed state through
    the drafts, and every checkpoint write against the committed state. Ring entries past the
    committed pointer are poisoned with NaN after each commit (rejected drafts must never be
    read). Returns the number of checkpoint writes per slot."""
    b, h, _, dv, dk = case.dims
    cache = case.create(window, draft)
    committed = torch.zeros(b, h, dv, dk, dtype=F64)
    for it in range(iterations):
        flush_expected = cache.count + draft > window  # decided before the step
        flushes_before = cache.flushes.clone()
        drafts = case.tokens(draft)
        y = cache.verify(**drafts)

        branch, outputs, states = committed, [], []
        for i in range(draft):
            y_i, branch = case.step(branch, case.pick(drafts, i))
            outputs.append(y_i)
            states.append(branch)
        assert_rel_close(y, torch.stack(outputs, dim=2), RTOL, f"drafts at iteration {it}")
        assert torch.equal(cache.flushes - flushes_before, flush_expected.long())
        if bool(flush_expected.any()):
            m = flush_expected
            assert_rel_close(cache.hi[m], committed[m], RTOL, f"checkpoint at iteration {it}")

        accepted = acceptance(it)
        cache.commit(accepted)
        stacked = torch.stack([committed, *states])  # [T + 1, b, h, dv, dk]
        committed = stacked[accepted, torch.arange(b)]
        assert int(cache.count.max()) <= window, "more committed records than L"
        assert int(cache.count.max()) + draft <= cache.capacity, "ring overrun"
        for ring in cache.ring.values():
            past = torch.arange(ring.shape[2])[None, :] >= cache.count[:, None]
            ring[past[:, None].expand(ring.shape[:3])] = float("nan")
    return cache.flushes


@pytest.mark.parametrize("recurrence", list(CASES))
def test_speculative_decoding_with_random_acceptance_equals_token_by_token(recurrence):
    """L = 7, T = 3, 30 verify steps, accepted drafts drawn uniformly from 0..T per slot (so
    slots sit at different ring positions and flush at different steps)."""
    gen = torch.Generator().manual_seed(21)
    case = CASES[recurrence](gen)
    b = case.dims[0]
    draw = torch.Generator().manual_seed(22)
    flushes = _speculate(
        case,
        window=7,
        draft=3,
        iterations=30,
        acceptance=lambda it: torch.randint(0, 4, (b,), generator=draw),
    )
    assert int(flushes.min()) >= 3  # about 45 committed tokens per slot: several windows


def test_rollback_of_40_steps_then_continuing_equals_token_by_token():
    """40 consecutive verifies with nothing accepted (after the first, which may flush what is
    committed, each a pure pointer rollback, no flush), between random-acceptance phases;
    outputs and checkpoints still match the recurrence."""
    gen = torch.Generator().manual_seed(23)
    case = Mamba2Case(gen)
    b = case.dims[0]
    draw = torch.Generator().manual_seed(24)

    def acceptance(it):
        if 5 <= it < 45:
            return torch.zeros(b, dtype=torch.int64)
        return torch.randint(0, 5, (b,), generator=draw)

    _speculate(case, window=6, draft=4, acceptance=acceptance, iterations=60)


def test_draft_equal_to_window_flushes_whenever_anything_is_committed():
    """T = L: any committed record makes h + T > L, so every verify after an acceptance
    flushes; the ring of 2L never overruns."""
    gen = torch.Generator().manual_seed(25)
    case = Mamba2Case(gen)
    b = case.dims[0]
    draw = torch.Generator().manual_seed(26)
    _speculate(
        case,
        window=3,
        draft=3,
        iterations=12,
        acceptance=lambda it: torch.randint(0, 4, (b,), generator=draw),
    )


# ---- precision policies in the cache -------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        Policy("separate", fmt="nvfp4", hi_fmt="fp32", window=4),
        Policy("shared", fmt="fp8_e4m3", window=4),
        Policy("separate", fmt="fp16", hi_fmt="fp64", window=4),
    ],
    ids=["separate-nvfp4-fp32", "shared-e4m3", "separate-fp16-exact"],
)
@pytest.mark.parametrize("recurrence", ["mamba2", "gdn", "kda"])
def test_cache_with_a_policy_equals_the_simulator(recurrence, policy):
    """Two implementations of a policy's recurrence and flush schedule agree: the ring replay
    (this cache) and the simulator's running states. (Both round through Policy.write_copies,
    which tests/test_policies.py checks against fake_quantize.) Mamba-2 maps onto the
    simulator's form with one head per group, a = exp(dt A), v = dt x, k = B, q = C (no D, z,
    bias, softplus). Only RN roundings: the two
    unrounded states differ by FP64 rounding (~1e-16), which flips an RN decision with
    probability ~1e-16 / 2^-24 per element, i.e. never in practice; an SR decision could flip."""
    gen = torch.Generator().manual_seed(27)
    b, h, dv, dk = 3, 2, 5, 32  # dk a multiple of nvfp4's block of 16
    sim = Simulator(recurrence, policy, b, h, dv, dk)
    if recurrence == "mamba2":
        A = -torch.rand(h, dtype=F64, generator=gen) - 0.2
        cache = Mamba2Replay.create(b, h, dv, dk, A, ngroups=h, dt_softplus=False, policy=policy)
    else:
        cache = (KDAReplay if recurrence == "kda" else GDNReplay).create(
            b, h, dv, dk, policy=policy
        )
    r = lambda *s: torch.randn(*s, dtype=F64, generator=gen)  # noqa: E731
    for t in range(3 * policy.window + 1):
        if recurrence == "mamba2":
            x, dt, B, C = (
                r(b, h, dv),
                torch.rand(b, h, dtype=F64, generator=gen),
                r(b, h, dk),
                r(b, h, dk),
            )
            y = cache.step(x, dt, B, C)
            y_sim = sim.step(torch.exp(dt * A), dt[..., None] * x, B, C)
        else:
            per_channel = recurrence == "kda"
            q, k, v = r(b, h, dk), F.normalize(r(b, h, dk), dim=-1), r(b, h, dv)
            g = -0.5 * torch.rand(b, h, *((dk,) if per_channel else ()), dtype=F64, generator=gen)
            beta = torch.rand(b, h, dtype=F64, generator=gen)
            y = cache.step(q, k, v, g, beta)
            y_sim = sim.step(torch.exp(g), v, k, q, beta)
        assert_rel_close(y, y_sim, RTOL, f"{recurrence} output at t={t}")
        assert sim.last_was_flush == bool((cache.count == 0).all())
    assert_rel_close(cache.hi, sim.hi, RTOL, "recurrence copy")
    assert_rel_close(cache.lo, sim.lo, RTOL, "read copy")
    assert cache.flushes.tolist() == [sim.flushes] * b


def _draft_decay(case, drafts, i):
    """Decay factor of draft ``i`` on a state ``[b, h, dv, dk]``: Mamba-2's ``exp(dt A)`` per
    head, GDN's ``exp(g)`` per head, KDA's ``exp(g)`` per column (d_k channel)."""
    if case.name == "mamba2":
        dt = F.softplus(drafts["dt"][:, :, i] + case.dt_bias)
        return torch.exp(dt * case.A)[..., None, None]
    g = drafts["g"][:, :, i]
    return torch.exp(g)[..., None, :] if case.per_channel else torch.exp(g)[..., None, None]


@pytest.mark.parametrize("recurrence", list(CASES))
def test_speculative_decoding_with_two_copies_reads_the_read_copy_and_folds_the_other(
        recurrence):
    """Separate policy, recurrence copy FP16 RN and read copy FP8 RN (so hi, lo and the
    unrounded state all differ), L = 6, T = 2, random acceptance 0..T per slot. With FP64 (exact
    policy) the copies coincide, so the tests above cannot tell which copy a verify reads or a
    flush folds. Here, against a model of two trajectories: the flush's unrounded state is the
    recurrence copy advanced exactly by the committed records, and both copies are its
    roundings; a flush verify's drafts read that unrounded state, any other verify's drafts the
    read copy plus the committed records. GDN/KDA cache each draft's u from the state the draft
    read, so after a flush verify the window reads lo's decayed term plus the u computed from
    the unrounded state: read = branch + G (lo - S_new), G the accepted drafts' decay (for
    Mamba-2 that is lo advanced by the drafts). Tolerance: RTOL as above; the copies compared
    bit for bit (an RN decision flipped by FP64 rounding order: ~1e-16 / 2^-11, never)."""
    gen = torch.Generator().manual_seed(40)
    case = CASES[recurrence](gen)
    b, h, _, dv, dk = case.dims
    window, draft = 6, 2
    policy = Policy("separate", fmt="fp8_e4m3", hi_fmt="fp16", window=window)
    cache = case.create(window, draft, policy=policy)
    zero = torch.zeros(b, h, dv, dk, dtype=F64)
    recur, read, lo = zero, zero, zero  # flush input, non-flush read state, read copy
    draw = torch.Generator().manual_seed(41)
    flushed, quiet = 0, 0  # quiet: verifies after the first flush in which no slot flushes
    for it in range(15):
        flush = (cache.count + draft > window)[:, None, None, None]
        drafts = case.tokens(draft)
        y = cache.verify(**drafts)
        if bool(flush.any()):
            m = flush[:, 0, 0, 0]
            assert torch.equal(cache.hi[m], fake_quantize(recur, "fp16")[m]), f"hi at {it}"
            lo = torch.where(flush, fake_quantize(recur, "fp8_e4m3"), lo)
            assert torch.equal(cache.lo, lo), f"lo at iteration {it}"
            flushed += int(m.sum())
        elif flushed:
            quiet += 1
        branch = torch.where(flush, recur, read)
        outputs, branches, decays = [], [branch], [torch.ones_like(zero)]
        for i in range(draft):
            y_i, branch = case.step(branch, case.pick(drafts, i))
            outputs.append(y_i)
            branches.append(branch)
            decays.append(decays[-1] * _draft_decay(case, drafts, i))
        assert_rel_close(y, torch.stack(outputs, dim=2), RTOL, f"drafts at iteration {it}")

        accepted = torch.randint(0, draft + 1, (b,), generator=draw)
        cache.commit(accepted)
        slots = torch.arange(b)
        branch, decay = torch.stack(branches)[accepted, slots], torch.stack(decays)[accepted, slots]
        read = torch.where(flush, branch + decay * (lo - recur), branch)
        recur = torch.where(flush, cache.hi, recur)
        for i in range(draft):
            _, stepped = case.step(recur, case.pick(drafts, i))
            recur = torch.where((i < accepted)[:, None, None, None], stepped, recur)
    assert flushed >= 2 * b and quiet >= 2  # both kinds of verify, after copies are written


def test_sr_copies_are_reproducible_and_count_their_flushes():
    """FP16-SR recurrence copy: the same seed writes the same bits; the copy lies on the FP16
    grid; each flush advances the slot's flush counter. (That each flush rounds with the words
    of its own counter: the test below.)"""
    policy = make_policy("separate_fp16sr", "nvfp4", window=3, seed=7)
    caches = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(28)
        case = Mamba2Case(gen, g=3, dk=16)
        cache = case.create(3, 0, policy=policy)
        for _ in range(7):
            cache.step(**case.tokens())
        caches.append(cache)
    assert torch.equal(caches[0].hi, caches[1].hi)
    assert torch.equal(caches[0].lo, caches[1].lo)
    assert torch.equal(fake_quantize(caches[0].hi, "fp16"), caches[0].hi)
    assert caches[0].flushes.tolist() == [2] * 4


def test_each_flush_rounds_with_its_slots_own_words_for_that_flush(monkeypatch):
    """The words behind a flush are lowprec.philox.random_words(seed, slot, flushes before the
    flush): speculative steps with random acceptances make the slots flush at different
    times, and each flushed slot's FP16-SR copy equals fake_quantize of the unrounded state
    with exactly those words (its NVFP4 copy the RN of the same state), flush after flush."""
    from lowprec import mamba2, philox, replay

    unrounded = {}
    flush = mamba2.mamba2_replay_flush

    def keep(*args, **kwargs):
        unrounded["state"] = flush(*args, **kwargs)
        return unrounded["state"]

    monkeypatch.setattr(replay.mamba2, "mamba2_replay_flush", keep)
    gen = torch.Generator().manual_seed(31)
    b, h, dv, dk, T, seed = 4, 2, 3, 16, 2, 99
    A = -torch.rand(h, dtype=torch.float64, generator=gen) - 0.2
    cache = Mamba2Replay.create(b, h, dv, dk, A, draft=T,
                                policy=make_policy("separate_fp16sr", "nvfp4", window=4,
                                                   seed=seed))

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    checked, counters = 0, set()
    for _ in range(30):
        before = cache.flushes.clone()
        unrounded.clear()
        cache.verify(rand(b, h, T, dv), rand(b, h, T), rand(b, 1, T, dk), rand(b, 1, T, dk))
        flushed = (cache.flushes > before).nonzero().flatten().tolist()
        if flushed:
            words = philox.random_words(seed, torch.arange(b), before, (h, dv, dk))
            hi = fake_quantize(unrounded["state"], "fp16", "sr", words)
            lo = fake_quantize(unrounded["state"], "nvfp4", "rn")
            for slot in flushed:
                assert torch.equal(cache.hi[slot], hi[slot]), (slot, int(before[slot]))
                assert torch.equal(cache.lo[slot], lo[slot])
                checked += 1
                counters.add(int(before[slot]))
        cache.commit(torch.randint(0, T + 1, (b,), generator=gen))
    assert checked >= 20 and len(counters) >= 5  # many flushes, at several counter values
    assert len(set(cache.flushes.tolist())) > 1  # the slots flushed at different times


# ---- bad configurations --------------------------------------------------------------------------


def test_bad_configurations_raise_value_errors_naming_the_argument():
    gen = torch.Generator().manual_seed(29)
    case = Mamba2Case(gen)
    b, h, g, dv, dk = case.dims
    with pytest.raises(ValueError, match=r"window: expected an integer >= 1, got 0"):
        Policy("exact", window=0)
    with pytest.raises(ValueError, match=r"draft: expected T <= L = policy.window = 4, got 5"):
        case.create(window=4, draft=5)
    with pytest.raises(ValueError, match=r"draft: expected an integer >= 0, got -1"):
        case.create(window=4, draft=-1)
    with pytest.raises(ValueError, match="policy: expected kind 'exact', 'shared' or 'separate'"):
        case.create(4, 0, policy=make_policy("every_step", "fp16"))
    with pytest.raises(ValueError, match=r"A: expected shape \[6\], got \[5\]"):
        Mamba2Replay.create(b, h, dv, dk, case.A[:5], ngroups=g)
    with pytest.raises(ValueError, match="ngroups: expected a divisor of nheads=6, got 4"):
        Mamba2Replay.create(b, h, dv, dk, case.A, ngroups=4)

    standard = case.create(window=4, draft=0)
    with pytest.raises(ValueError, match="draft: expected T >= 1 for verify/commit, got 0"):
        standard.verify(**case.tokens(2))
    tok = case.tokens()
    tok["x"] = tok["x"][..., :4]
    with pytest.raises(ValueError, match=r"x: expected shape \[4, 6, 5\], got \[4, 6, 4\]"):
        standard.step(**tok)
    tok = case.tokens()
    tok["dt"] = tok["dt"].float()
    with pytest.raises(ValueError, match="dt: expected dtype torch.float64"):
        standard.step(**tok)

    spec = case.create(window=4, draft=2)
    with pytest.raises(ValueError, match="draft: expected 0 for step"):
        spec.step(**case.tokens())
    with pytest.raises(ValueError, match="commit: expected a verify"):
        spec.commit(1)
    spec.verify(**case.tokens(2))
    with pytest.raises(ValueError, match=r"accepted: expected values in \[0, T=2\]"):
        spec.commit(torch.tensor([0, 1, 3, 2]))
    with pytest.raises(ValueError, match=r"C: expected shape \[4, 3, 2, 7\]"):
        spec.verify(**{**case.tokens(2), "C": torch.zeros(4, 3, 3, 7, dtype=F64)})


@pytest.mark.parametrize("cursors, flushes, message", [
    ([0, 5, 2], [0, 1, replay.FLUSH_COUNTER_LIMIT],
     r"flushes: expected values in \[0, 2\^20 - 1\) \(the Philox counter's flush field\), "
     r"got range \[0, 1048575\]"),
    ([0, 5, 2], [7, -3, 1], r"flushes: .* got range \[-3, 7\]"),
    ([0, 6, 2], [0, 1, 2],
     r"cache\.cursors: expected values in \[0, 5\] \(why\), got range \[0, 6\]"),
    ([-1, 5, 2], [0, 1, 2], r"got range \[-1, 5\]"),
])
def test_counter_ranges_refuse_cursors_past_their_bounds_and_flushes_past_the_philox_field(
        cursors, flushes, message):
    """check_counter_ranges (shared by the emulation and the CuTe kernels): cursors in [low,
    high], flush counters in [0, 2^20 - 1), int32 like the kernels' caches; the message
    names the offending range; the last counters that still leave room pass."""
    def as_int32(values):
        return torch.tensor(values, dtype=torch.int32)

    with pytest.raises(ValueError, match=message):
        replay.check_counter_ranges(as_int32(cursors), as_int32(flushes), 0, 5, "why", "cache.")
    last = replay.FLUSH_COUNTER_LIMIT - 1
    assert replay.check_counter_ranges(as_int32([0, 5, 3]), as_int32([0, last, 9]), 0, 5,
                                       "why") is None
    assert replay.check_counter_ranges(as_int32([]), as_int32([]), 0, 5, "why") is None


def test_switches_and_the_flush_counter_limit_are_checked():
    """dt_softplus must be a bool (the word 'false' applied softplus), and a flush at the last
    Philox flush counter is refused, as the kernels' counter check refuses it (the reference
    wrote it and failed at the next flush)."""
    A = -torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="dt_softplus: expected a bool"):
        Mamba2Replay.create(2, 3, 4, 16, A, dt_softplus="false")
    cache = Mamba2Replay.create(2, 3, 4, 16, A, policy=Policy("shared", fmt="fp16",
                                                              rounding="sr", window=1))
    cache.flushes = torch.tensor([0, replay.FLUSH_COUNTER_LIMIT])
    g = torch.Generator().manual_seed(3)
    x, dt = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.rand(2, 3,
                                                                             dtype=torch.float64)
    B, C = (torch.randn(2, 1, 16, generator=g, dtype=torch.float64) for _ in range(2))
    with pytest.raises(ValueError, match=r"flushes: expected values in \[0, 2\^20 - 1\)"):
        cache.step(x, dt, B, C)


def test_a_verify_refused_at_the_flush_counter_limit_leaves_nothing_to_commit():
    """A verify whose flush is refused (a slot at the last Philox flush counter) appended no
    draft, so a commit after it must be refused too, as the emulation refuses it (it marks a
    verify pending only once its checks pass); otherwise the commit would count a stale ring
    entry as a record (h > L here)."""
    A = -torch.ones(3, dtype=F64)
    cache = Mamba2Replay.create(2, 3, 4, 16, A, draft=2,
                                policy=Policy("shared", fmt="fp16", rounding="sr", window=2))
    g = torch.Generator().manual_seed(4)

    def drafts():
        r = lambda *s: torch.randn(*s, dtype=F64, generator=g)  # noqa: E731
        return r(2, 3, 2, 4), r(2, 3, 2), r(2, 1, 2, 16), r(2, 1, 2, 16)

    cache.verify(*drafts())
    cache.commit(2)  # h = 2: the next verify flushes
    cache.flushes = torch.tensor([0, replay.FLUSH_COUNTER_LIMIT])
    with pytest.raises(ValueError, match=r"flushes: expected values in \[0, 2\^20 - 1\)"):
        cache.verify(*drafts())
    with pytest.raises(ValueError, match="commit: expected a verify"):
        cache.commit(1)
    assert cache.count.tolist() == [2, 2]
