"""Precision policies and their simulator: exact arms are exact, the conventional FP16 state
stays at FP16 roundoff on a short-memory head, the separate arm's error is at most one rounding
of the checkpoint, SR uses the documented counters; plus the metric and input validation.

Bounds used below (``E`` a state error, ``q`` a query, norms 2-norm / Frobenius):

- ``||E q|| <= ||E||_F ||q||``.
- One step of any of the three recurrences maps a state difference ``E`` to
  ``E diag(a) (I - beta k k^T)`` (Mamba-2: ``beta = 0``; GDN: scalar ``a``), whose Frobenius
  norm is at most ``max(a) ||E||_F`` when ``0 <= beta ||k||^2 <= 2`` (the bracket then has
  spectral norm <= 1). The tests draw unit ``k`` and ``beta`` in [0, 1).
- RN to FP16 changes a normal value by at most ``u |x|`` with ``u = 2^-11``, a subnormal one by
  at most ``2^-25``; so ``||Q(S) - S||_F <= u ||Q(S)||_F / (1 - u) + 2^-25 sqrt(numel)``.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from lowprec import formats
from lowprec.metrics import rel_err
from lowprec.philox import random_words
from lowprec.policies import ARMS, Policy, Simulator, make_policy
from lowprec.quantize import fake_quantize

F64 = torch.float64
U_FP16 = 2.0**-11
SLACK = 1e-12  # relative FP64 slack: reference and arm evaluate the same sums in other orders


class Tokens:
    """Random inputs of the simulator's generic form for a recurrence."""

    def __init__(self, recurrence, b, h, dv, dk, seed, decay=(0.8, 1.0)):
        self.recurrence, self.shape = recurrence, (b, h, dv, dk)
        self.gen = torch.Generator().manual_seed(seed)
        self.decay = decay

    def __call__(self):
        b, h, dv, dk = self.shape
        r = lambda *s: torch.randn(*s, dtype=F64, generator=self.gen)  # noqa: E731
        lo, hi = self.decay
        a_shape = (b, h, dk) if self.recurrence == "kda" else (b, h)
        a = lo + (hi - lo) * torch.rand(*a_shape, dtype=F64, generator=self.gen)
        k = F.normalize(r(b, h, dk), dim=-1)
        beta = None
        if self.recurrence != "mamba2":
            beta = torch.rand(b, h, dtype=F64, generator=self.gen)
        return a, r(b, h, dv), k, r(b, h, dk), beta


RECURRENCES = ["mamba2", "gdn", "kda"]


@pytest.mark.parametrize("recurrence", RECURRENCES)
def test_fp64_formats_give_zero_error_in_every_arm(recurrence):
    """Every arm whose copies are all FP64 (RN and SR alike: FP64 rounding is the identity)
    reproduces the exact arm bit for bit, on flush and non-flush steps. (separate_fp16sr's
    recurrence copy is FP16 by definition; its FP64 twin is the last policy here.)"""
    b, h, dv, dk = 2, 3, 5, 7
    policies = [make_policy(arm, "fp64", window=4) for arm in ARMS if arm != "separate_fp16sr"]
    policies += [make_policy(arm, "fp64", "sr", window=4) for arm in ("every_step", "shared")]
    policies.append(Policy("separate", fmt="fp64", hi_fmt="fp64", window=1))
    policies.append(Policy("separate", fmt="fp64", hi_fmt="fp64", hi_rounding="sr", window=5))
    sims = [Simulator(recurrence, p, b, h, dv, dk) for p in policies]
    exact = Simulator(recurrence, Policy("exact"), b, h, dv, dk)
    tokens = Tokens(recurrence, b, h, dv, dk, seed=30)
    for t in range(13):
        tok = tokens()
        y = exact.step(*tok)
        for p, sim in zip(policies, sims, strict=True):
            y_hat = sim.step(*tok)
            assert torch.equal(y_hat, y), f"{p} differs at t={t}: {rel_err(y_hat, y).tolist()}"


@pytest.mark.parametrize("recurrence", RECURRENCES)
def test_conventional_fp16_rn_on_a_short_memory_head_stays_at_unit_roundoff(recurrence):
    """a in [0.45, 0.55]: each store adds at most u ||S_t|| (u = 2^-11) and the loop damps the
    past by a <= 0.55, so ||E_t||_F <= B_t = max(a) B_{t-1} + u ||Q(S_t)||_F / (1 - u) + subnormal
    term, checked every step, and ||y_hat - y|| <= B_t ||q||. With a stationary state norm
    B_t / ||S_t|| -> u / (1 - 0.55) = 2.2 u: the mean relative output error stays below 2.2 u
    (about 0.65 u measured) and the state's relative error below 3 u at every step."""
    b, h, dv, dk = 3, 2, 9, 32
    exact = Simulator(recurrence, Policy("exact"), b, h, dv, dk)
    conv = Simulator(recurrence, make_policy("every_step", "fp16"), b, h, dv, dk)
    tokens = Tokens(recurrence, b, h, dv, dk, seed=31, decay=(0.45, 0.55))
    subnormal = 2.0**-25 * math.sqrt(dv * dk)
    bound = torch.zeros(b, h, dtype=F64)
    errs = []
    for t in range(200):
        a, v, k, q, beta = tokens()
        y, y_hat = exact.step(a, v, k, q, beta), conv.step(a, v, k, q, beta)
        a_max = a.amax(dim=-1) if recurrence == "kda" else a
        stored = torch.linalg.matrix_norm(conv.lo)
        bound = a_max * bound + U_FP16 * stored / (1 - U_FP16) + subnormal
        state_err = torch.linalg.matrix_norm(conv.lo - exact.hi)
        assert bool((state_err <= bound * (1 + SLACK)).all()), f"state bound at t={t}"
        out_err = torch.linalg.vector_norm(y_hat - y, dim=-1)
        assert bool((out_err <= bound * q.norm(dim=-1) * (1 + SLACK)).all()), f"t={t}"
        rel_state = state_err / torch.linalg.matrix_norm(exact.hi)
        assert float(rel_state.max()) < 3 * U_FP16, f"t={t}: {rel_state.max() / U_FP16:.2f} u"
        errs.append(rel_err(y_hat, y))
    assert float(torch.stack(errs).mean()) < 2.2 * U_FP16


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "fp16"])
@pytest.mark.parametrize("recurrence", RECURRENCES)
def test_separate_exact_error_is_at_most_one_rounding_of_the_checkpoint(recurrence, fmt):
    """Recurrence copy FP64, read copy Q = fmt RN. At a flush the error is exactly zero and the
    copies are exactly S_c and Q(S_c). A non-flush step j tokens later reads a state that differs
    from the exact one by E = Q(S_c) - S_c carried through j steps, so

        ||y_hat - y|| <= P_j ||Q(S_c) - S_c||_F ||q||,   P_j = prod of max(a) over the j steps

    (one rounding, damped, never accumulated). For Mamba-2 it is an identity,
    y_hat - y = P_j (Q(S_c) - S_c) q, checked too."""
    b, h, dv, dk = 2, 3, 5, 32
    window = 6
    exact = Simulator(recurrence, Policy("exact"), b, h, dv, dk)
    sep = Simulator(recurrence, make_policy("separate_exact", fmt, window=window), b, h, dv, dk)
    tokens = Tokens(recurrence, b, h, dv, dk, seed=32)
    ckpt_err = torch.zeros(b, h, dv, dk, dtype=F64)
    decay = torch.ones(b, h, dtype=F64)
    for t in range(4 * window):
        a, v, k, q, beta = tokens()
        y, y_hat = exact.step(a, v, k, q, beta), sep.step(a, v, k, q, beta)
        decay = decay * (a.amax(dim=-1) if recurrence == "kda" else a)
        if sep.last_was_flush:
            assert torch.equal(y_hat, y), f"flush output at t={t}"
            assert torch.equal(sep.hi, exact.hi)
            assert torch.equal(sep.lo, fake_quantize(exact.hi, fmt))
            ckpt_err = sep.lo - exact.hi
            decay = torch.ones(b, h, dtype=F64)
            continue
        err = torch.linalg.vector_norm(y_hat - y, dim=-1)
        bound = decay * torch.linalg.matrix_norm(ckpt_err) * q.norm(dim=-1)
        slack = SLACK * y.norm(dim=-1)
        assert bool((err <= bound + slack).all()), f"t={t}: {(err / bound).max():.3f}"
        if recurrence == "mamba2":
            predicted = decay[..., None] * (ckpt_err @ q[..., None])[..., 0]
            assert bool(((y_hat - y - predicted).norm(dim=-1) <= slack).all())
    assert sep.flushes == 4


def _gdn_update(state, a, v, k, beta):
    """The simulator's GDN update, in its operation order (so SR decisions match bit for bit)."""
    decayed = state * a[..., None, None]
    u = beta[..., None] * (v - (decayed @ k[..., :, None])[..., 0])
    return torch.addcmul(decayed, u[..., :, None], k[..., None, :])


def test_conventional_sr_uses_the_token_counter_and_separate_sr_the_flush_counter():
    """Conventional SR: the state stored at token t is fake_quantize(S_t, fp16, 'sr',
    random_words(seed, slots, t, [h, dv, dk])) of the update of the stored state. Separate
    FP16-SR (L = 3): the recurrence copy of flush f uses random_words(seed, slots, f, ...), the
    read copy is nvfp4 RN of the same unrounded state. Checked bit for bit against the formula."""
    b, h, dv, dk = 2, 3, 5, 16
    seed = 12345
    slots = torch.arange(b)
    conv = Simulator("gdn", make_policy("every_step", "fp16", "sr", seed=seed), b, h, dv, dk)
    sep = Simulator(
        "gdn", make_policy("separate_fp16sr", "nvfp4", window=3, seed=seed), b, h, dv, dk
    )
    tokens = Tokens("gdn", b, h, dv, dk, seed=33)
    stored = torch.zeros(b, h, dv, dk, dtype=F64)
    recur = torch.zeros(b, h, dv, dk, dtype=F64)  # sep's recurrence trajectory
    for t in range(7):
        a, v, k, q, beta = tokens()
        conv.step(a, v, k, q, beta)
        words = random_words(seed, slots, t, (h, dv, dk))
        stored = fake_quantize(_gdn_update(stored, a, v, k, beta), "fp16", "sr", words)
        assert torch.equal(conv.lo, stored), f"conventional store at t={t}"

        sep.step(a, v, k, q, beta)
        recur = _gdn_update(recur, a, v, k, beta)
        if sep.last_was_flush:
            words = random_words(seed, slots, sep.flushes - 1, (h, dv, dk))
            assert torch.equal(sep.hi, fake_quantize(recur, "fp16", "sr", words)), f"t={t}"
            assert torch.equal(sep.lo, fake_quantize(recur, "nvfp4", "rn")), f"t={t}"
            recur = sep.hi
    assert sep.flushes == 2


def test_sr_arms_are_reproducible_and_depend_on_the_seed():
    b, h, dv, dk = 2, 2, 5, 16
    runs = {}
    for seed in (1, 1, 2):
        sim = Simulator(
            "mamba2", make_policy("shared", "fp16", "sr", window=2, seed=seed), b, h, dv, dk
        )
        tokens = Tokens("mamba2", b, h, dv, dk, seed=34)
        runs.setdefault(seed, []).append(torch.stack([sim.step(*tokens()) for _ in range(6)]))
    assert torch.equal(runs[1][0], runs[1][1])
    assert not torch.equal(runs[1][0], runs[2][0])


def test_flush_steps_are_the_last_token_of_each_window():
    sim = Simulator("mamba2", make_policy("shared", "fp16", window=3), 1, 1, 2, 3)
    tokens = Tokens("mamba2", 1, 1, 2, 3, seed=35)
    flags = []
    for _ in range(7):
        sim.step(*tokens())
        flags.append(sim.last_was_flush)
    assert flags == [False, False, True, False, False, True, False]
    assert (sim.tokens, sim.flushes) == (7, 2)


# ---- metric --------------------------------------------------------------------------------------


def test_rel_err_is_the_2norm_ratio_over_heads_and_dv_per_batch_row():
    """Row 0: y = [[3, 4]], y_hat = [[3, 4.5]] -> 0.5 / 5 = 0.1; row 1: error 0 -> 0; row 2:
    row 0 / 8, a norm below 1 (a denominator clamped at 1 gave 0.0625 there) -> 0.1."""
    y = torch.tensor([[[3.0, 4.0]], [[1.0, 2.0]], [[3 / 8, 4 / 8]]], dtype=F64)
    y_hat = torch.tensor([[[3.0, 4.5]], [[1.0, 2.0]], [[3 / 8, 4.5 / 8]]], dtype=F64)
    torch.testing.assert_close(rel_err(y_hat, y), torch.tensor([0.1, 0.0, 0.1], dtype=F64))
    torch.testing.assert_close(rel_err(y_hat, y, dims=-1),
                               torch.tensor([[0.1], [0.0], [0.1]], dtype=F64))


def test_rel_err_of_a_zero_reference_is_zero_or_inf():
    y = torch.zeros(2, 1, 3, dtype=F64)
    y_hat = torch.zeros(2, 1, 3, dtype=F64)
    y_hat[1, 0, 2] = 1e-3
    assert rel_err(y_hat, y).tolist() == [0.0, math.inf]


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: make_policy("every_token", "fp16"), r"arm: expected one of \['exact', "),
        (lambda: make_policy("shared", "fp17"), "fmt: expected one of"),
        (lambda: make_policy("separate_exact", "nvfp4", "sr"), "rounding: expected 'rn'"),
        (lambda: make_policy("shared", "fp16", "rz"), r"rounding: expected one of \['rn', 'sr'\]"),
        (lambda: make_policy("shared", "fp16", window=0), "window: expected an integer >= 1"),
        (lambda: Policy("hybrid"), "kind: expected one of"),
        (lambda: Policy("separate", hi_fmt="int8"), "hi_fmt: expected one of"),
        (lambda: Policy("exact", seed=-1), "seed: expected an integer >= 0, got -1"),
    ],
    ids=["arm", "fmt", "separate-sr", "rounding", "window", "kind", "hi_fmt", "seed"],
)
def test_bad_policies_raise_value_errors_naming_the_argument(make, message):
    with pytest.raises(ValueError, match=message):
        make()


UNUSED = "which does not use it"


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="exact", fmt="nvfp4"),
     rf"fmt: expected the default 'fp64' for kind 'exact', {UNUSED} \(nothing is rounded\), "
     r"got 'nvfp4'"),
    (dict(kind="exact", rounding="sr"), r"rounding: expected the default 'rn' for kind 'exact'"),
    (dict(kind="exact", hi_fmt="fp16", window=5),
     r"hi_fmt: expected the default 'fp64' for kind 'exact'"),
    (dict(kind="exact", hi_rounding="sr"), r"hi_rounding: expected the default 'rn' for kind"),
    (dict(kind="exact", seed=13),
     r"seed: expected the default 0 for kind 'exact' \(nothing is rounded\), got 13"),
    (dict(kind="conventional", fmt="fp16", window=7),
     rf"window: expected the default 16 for kind 'conventional', {UNUSED} \(it writes the "
     r"state every token, there are no windows\), got 7"),
    (dict(kind="conventional", fmt="fp16", hi_fmt="fp32"),
     rf"hi_fmt: expected the default 'fp64' for kind 'conventional', {UNUSED} \(it keeps one "
     r"copy, in fmt; hi_\* are the separate policy's recurrence copy\), got 'fp32'"),
    (dict(kind="shared", fmt="fp8_e4m3", hi_rounding="sr", window=5),
     r"hi_rounding: expected the default 'rn' for kind 'shared'"),
    (dict(kind="shared", fmt="fp16", hi_fmt="fp16", rounding="sr", seed=3),
     r"hi_fmt: expected the default 'fp64' for kind 'shared'"),
    (dict(kind="shared", fmt="fp16", seed=3, window=5),
     r"seed: expected the default 0 for kind 'shared' with rounding 'rn' \(the seed only draws "
     r"SR words\), got 3"),
    (dict(kind="conventional", fmt="bf16", seed=2**63 + 1),
     r"seed: expected the default 0 for kind 'conventional' with rounding 'rn'"),
    (dict(kind="separate", fmt="nvfp4", hi_fmt="fp16", seed=29, window=3),
     r"seed: expected the default 0 for kind 'separate' with hi_rounding 'rn' .*, got 29"),
], ids=["exact-fmt", "exact-rounding", "exact-hi_fmt", "exact-hi_rounding", "exact-seed",
        "conventional-window", "conventional-hi_fmt", "shared-hi_rounding", "shared-hi_fmt",
        "shared-rn-seed", "conventional-rn-seed", "separate-rn-seed"])
def test_a_field_the_kind_does_not_use_is_refused_naming_the_field_and_the_kind(kwargs, message):
    """A field the kind never reads, set to anything but its default, is an error: ignored, it
    would let a typo'd experiment run another one (an exact policy 'in nvfp4' simulates fp64, a
    shared one with an fp16 hi copy keeps one copy, a seed without SR draws no word)."""
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)


def test_fields_a_kind_uses_and_defaults_of_unused_ones_are_accepted():
    """The refusal is of ignored values only: defaults passed explicitly, the window of an
    exact policy (a replay cache's ring length) and the seed of an SR copy stay accepted."""
    assert Policy("exact", "fp64", "rn", "fp64", "rn", 16, 0) == Policy("exact")
    assert Policy("exact", window=5).window == 5
    assert Policy("conventional", fmt="fp16", rounding="sr", seed=17).seed == 17
    assert Policy("shared", fmt="nvfp4", rounding="sr", window=7, seed=2**64 - 1).window == 7
    sep = Policy("separate", fmt="mxfp4", hi_fmt="fp16", hi_rounding="sr", window=9, seed=23)
    assert (sep.window, sep.seed) == (9, 23)


@pytest.mark.parametrize("arm, rounding, want_window, want_seed", [
    ("exact", "rn", 7, 0),
    ("exact", "sr", 7, 0),  # exact's fmt and rounding were always dropped
    ("every_step", "rn", 16, 0),
    ("every_step", "sr", 16, 31),
    ("shared", "rn", 7, 0),
    ("shared", "sr", 7, 31),
    ("separate_exact", "rn", 7, 0),
    ("separate_fp16sr", "rn", 7, 31),
])
def test_make_policy_drops_what_the_arm_does_not_use(arm, rounding, want_window, want_seed):
    """The experiments make every arm with one call (window and seed included), so make_policy
    drops a window the every-step arm has no use for and a seed no SR copy draws with, rather
    than have Policy refuse it; what an arm uses is kept."""
    policy = make_policy(arm, "fp8_e4m3", rounding, window=7, seed=31)
    assert (policy.window, policy.seed) == (want_window, want_seed)


@pytest.mark.parametrize("arm", ["exact", "every_step", "shared", "separate_exact"])
def test_make_policy_still_checks_a_value_it_drops(arm):
    """A window or seed the arm does not use is dropped, not waved through: a bad one is the
    caller's error whatever the arm (make_policy refused these before, through Policy)."""
    with pytest.raises(ValueError, match="seed: expected an integer >= 0, got -3"):
        make_policy(arm, "fp16", seed=-3)
    with pytest.raises(ValueError, match=r"seed: expected an integer in \[0, 2\^64\), got"):
        make_policy(arm, "fp16", seed=2**64)
    with pytest.raises(ValueError, match="window: expected an integer >= 1, got 0"):
        make_policy(arm, "fp16", window=0)


def test_bad_simulator_input_raises_value_errors_naming_the_argument():
    p = Policy("exact")
    with pytest.raises(ValueError, match="recurrence: expected one of"):
        Simulator("mamba3", p, 1, 1, 2, 3)
    with pytest.raises(ValueError, match="policy: expected a Policy, got str"):
        Simulator("gdn", "exact", 1, 1, 2, 3)
    with pytest.raises(ValueError, match="dk: expected an integer >= 1, got 0"):
        Simulator("gdn", p, 1, 1, 2, 0)
    sim = Simulator("kda", p, 2, 3, 5, 7)
    a, v, k, q, beta = Tokens("kda", 2, 3, 5, 7, seed=36)()
    with pytest.raises(ValueError, match=r"a: expected shape \[2, 3, 7\], got \[2, 3\]"):
        sim.step(a[..., 0], v, k, q, beta)
    with pytest.raises(ValueError, match=r"beta: expected a tensor \[2, 3\], got None"):
        sim.step(a, v, k, q)
    with pytest.raises(ValueError, match="q: expected a floating-point dtype, got torch.int64"):
        sim.step(a, v, k, q.long(), beta)
    mamba = Simulator("mamba2", p, 2, 3, 5, 7)
    with pytest.raises(ValueError, match="beta: expected None for mamba2"):
        mamba.step(a[..., 0], v, k, q, beta)
    with pytest.raises(ValueError, match=r"v: expected shape \[2, 3, 5\], got \[2, 3, 4\]"):
        mamba.step(a[..., 0], v[..., :4], k, q)


def test_every_format_is_accepted_by_a_policy():
    for name in formats.names():
        assert make_policy("shared", name).fmt == name


@pytest.mark.parametrize("make, message", [
    (lambda: Simulator("mamba2", make_policy("shared", "nvfp4", window=3), 2, 3, 4, 16,
                       dtype=torch.float16), "dtype: expected torch.float32 or torch.float64"),
    (lambda: Simulator("mamba2", make_policy("shared", "nvfp4", window=3), 2, 3, 4, 24),
     r"d_k\) must be a positive multiple of block 16"),
    (lambda: Simulator("mamba2", make_policy("separate_fp16sr", "mxfp4", window=3), 2, 3, 4, 48),
     "block 32"),
    (lambda: Policy("shared", fmt="fp16", rounding="sr", seed=2**64), r"seed: expected .*2\^64"),
], ids=["fp16-state", "dk-not-a-block", "dk-not-an-mxfp4-block", "seed-past-philox"])
def test_settings_that_cannot_round_are_refused_when_made(make, message):
    """A policy that could never round its state (an fp16 state, d_k not a multiple of the
    block, a seed past Philox's) is refused when the simulator or policy is made, not at the
    first flush after that step's record is appended, where the error would name an argument
    the user never passed."""
    with pytest.raises(ValueError, match=message):
        make()
    Simulator("mamba2", make_policy("exact", "fp64"), 2, 3, 4, 24, dtype=torch.float16)


def test_round_state_takes_one_slot_and_counter_for_every_slot():
    """slots and counter as ints mean the same for every slot (it raised about `rand`)."""
    from lowprec.policies import round_state

    state = torch.randn(2, 3, 4, 16, dtype=torch.float64)
    by_int = round_state(state, "fp16", "sr", 5, 7, 3)
    by_tensor = round_state(state, "fp16", "sr", 5, torch.tensor([7, 7]), torch.tensor([3, 3]))
    assert torch.equal(by_int, by_tensor) and not torch.equal(by_int, state)


def test_rel_err_of_a_nan_output_against_a_zero_reference_is_not_zero():
    """0 only where y_hat equals y: a diverged (NaN) arm against y = 0 read as exact."""
    zero = torch.zeros(1, 2, 2)
    assert rel_err(torch.full((1, 2, 2), float("nan")), zero).isinf().all()
    assert rel_err(zero.clone(), zero).eq(0).all()
