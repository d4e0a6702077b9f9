"""Reference recurrences: the plain steps against explicit per-head formulas, and the ReplaySSM
forms (checkpoint + ring, no state formed) against the plain steps in FP64.

Tolerance (one table, used by every replay check): ``REPLAY_RTOL = 1e-12`` relative in the
2-norm. The replay and the step differ only by FP64 rounding order: a window of at most 12
records, decay products as one ``exp`` of a difference of cumulative sums (|exponent| <= ~10,
so ~10 eps = 2e-15 relative per factor) and sums of 12 terms whose cancellation (sum of
magnitudes over magnitude of the sum) stays below ~100 for random inputs: about 1e-13 at worst,
kept 10x below the tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

from lowprec.gdn import gdn_replay_flush, gdn_replay_output, gdn_replay_u, gdn_step
from lowprec.kda import kda_replay_flush, kda_replay_output, kda_replay_u, kda_step
from lowprec.mamba2 import (
    mamba2_process_dt,
    mamba2_replay_flush,
    mamba2_replay_output,
    mamba2_replay_verify,
    mamba2_step,
)

REPLAY_RTOL = 1e-12
F64 = torch.float64


def assert_rel_close(actual, expected, rtol, what):
    """2-norm relative error below ``rtol``; on failure name the worst element."""
    err = (actual - expected).norm() / expected.norm()
    if not bool(err <= rtol):
        diff = (actual - expected).abs()
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {rtol:.0e}; worst element {worst}: "
            f"{actual[worst].item()!r} vs {expected[worst].item()!r}; "
            f"NaNs: {int(actual.isnan().sum())}"
        )


def randn(*shape, gen):
    return torch.randn(*shape, dtype=F64, generator=gen)


def nan_ring(*shape):
    return torch.full(shape, float("nan"), dtype=F64)


# ---- plain steps against explicit formulas -------------------------------------------------------


def test_mamba2_step_matches_a_per_head_loop_with_groups_D_z_and_dt_bias():
    """Head h reads group h // (nheads // ngroups); dt = softplus(dt + bias); a = exp(dt A);
    y = (S_t C + D x) silu(z), checked head by head with 2 heads per group."""
    gen = torch.Generator().manual_seed(1)
    b, h, g, dv, dk = 3, 6, 3, 5, 7
    state = randn(b, h, dv, dk, gen=gen)
    x, z = randn(b, h, dv, gen=gen), randn(b, h, dv, gen=gen)
    dt, bias = randn(b, h, gen=gen), randn(h, gen=gen)
    A, D = -torch.rand(h, dtype=F64, generator=gen) - 0.1, randn(h, gen=gen)
    B, C = randn(b, g, dk, gen=gen), randn(b, g, dk, gen=gen)

    y, new_state = mamba2_step(state, x, dt, A, B, C, D, z, dt_bias=bias)

    for i in range(b):
        for j in range(h):
            grp = j // (h // g)
            step = F.softplus(dt[i, j] + bias[j])
            s = torch.exp(step * A[j]) * state[i, j] + step * torch.outer(x[i, j], B[i, grp])
            y_ij = (s @ C[i, grp] + D[j] * x[i, j]) * F.silu(z[i, j])
            # O(1) values from a few fp64 operations: a few eps (2.2e-16) absolute.
            torch.testing.assert_close(new_state[i, j], s, rtol=1e-14, atol=1e-15)
            torch.testing.assert_close(y[i, j], y_ij, rtol=1e-13, atol=1e-14)


def test_mamba2_step_without_softplus_uses_dt_plus_bias_as_is():
    gen = torch.Generator().manual_seed(2)
    b, h, dv, dk = 2, 3, 5, 7
    state = randn(b, h, dv, dk, gen=gen)
    x, dt = randn(b, h, dv, gen=gen), torch.rand(b, h, dtype=F64, generator=gen)
    A, B, C = (
        -torch.rand(h, dtype=F64, generator=gen),
        randn(b, 1, dk, gen=gen),
        randn(b, 1, dk, gen=gen),
    )
    _, new_state = mamba2_step(state, x, dt, A, B, C, dt_softplus=False)
    expected = (
        torch.exp(dt * A)[..., None, None] * state
        + (dt[..., None] * x)[..., None] * B[:, :1, None, :]
    )
    torch.testing.assert_close(new_state, expected, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_delta_step_matches_the_householder_form(per_channel):
    """S_t = S_{t-1} diag(a) (I - beta k k^T) + beta v k^T (GDN: scalar a), y = S_t q: the
    matrix form, independent of the u form the code uses."""
    gen = torch.Generator().manual_seed(3)
    b, h, dv, dk = 2, 3, 5, 7
    state = randn(b, h, dv, dk, gen=gen)
    q, k, v = randn(b, h, dk, gen=gen), randn(b, h, dk, gen=gen), randn(b, h, dv, gen=gen)
    g = -torch.rand(b, h, *((dk,) if per_channel else ()), dtype=F64, generator=gen)
    beta = torch.rand(b, h, dtype=F64, generator=gen)

    y, new_state = (kda_step if per_channel else gdn_step)(state, q, k, v, g, beta)

    eye = torch.eye(dk, dtype=F64)
    for i in range(b):
        for j in range(h):
            decay = torch.diag(torch.exp(g[i, j])) if per_channel else torch.exp(g[i, j]) * eye
            kk = torch.outer(k[i, j], k[i, j])
            s = state[i, j] @ decay @ (eye - beta[i, j] * kk) + beta[i, j] * torch.outer(
                v[i, j], k[i, j]
            )
            torch.testing.assert_close(new_state[i, j], s, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(y[i, j], s @ q[i, j], rtol=1e-12, atol=1e-14)


# ---- replay against the plain steps --------------------------------------------------------------
#
# Every slot re-checkpoints on its own phase: slot s folds its ring when (t + phase[s]) % L == 0,
# so at any step the slots sit at different ring positions, and over 3 windows every slot visits
# every position. Ring entries past `count` are NaN: reading one would show.

L = 6
PHASES = [0, 1, 3, 5]
STEPS = 3 * L


def _mamba2_inputs(gen, b, h, g, dv, dk):
    return dict(
        x=randn(b, h, dv, gen=gen),
        dt=randn(b, h, gen=gen) * 0.5 - 1.0,
        B=randn(b, g, dk, gen=gen),
        C=randn(b, g, dk, gen=gen),
        z=randn(b, h, dv, gen=gen),
    )


def test_mamba2_replay_equals_recurrence_at_every_ring_position():
    gen = torch.Generator().manual_seed(4)
    b, h, g, dv, dk = len(PHASES), 6, 3, 5, 7
    A, D = -torch.rand(h, dtype=F64, generator=gen) - 0.2, randn(h, gen=gen)
    bias = randn(h, gen=gen) * 0.3
    state = randn(b, h, dv, dk, gen=gen)
    ckpt = state.clone()
    ring_x, ring_dt, ring_B = nan_ring(b, h, L, dv), nan_ring(b, h, L), nan_ring(b, g, L, dk)
    count = torch.zeros(b, dtype=torch.int64)
    phase = torch.tensor(PHASES)
    visited = set()

    for t in range(STEPS):
        fold = ((t + phase) % L == 0) & (count > 0)
        if bool(fold.any()):
            new_ckpt = mamba2_replay_flush(ckpt, ring_x, ring_dt, ring_B, count, A)
            assert_rel_close(new_ckpt[fold], state[fold], REPLAY_RTOL, f"flush at t={t}")
            ckpt = torch.where(fold[:, None, None, None], new_ckpt, ckpt)
            count = torch.where(fold, 0, count)
            for ring in (ring_x, ring_dt, ring_B):
                ring[fold] = float("nan")
        inp = _mamba2_inputs(gen, b, h, g, dv, dk)
        y, state = mamba2_step(state, **inp, A=A, D=D, dt_bias=bias)
        slots = torch.arange(b)
        ring_x[slots, :, count] = inp["x"]
        ring_dt[slots, :, count] = mamba2_process_dt(inp["dt"], bias)
        ring_B[slots, :, count] = inp["B"]
        count = count + 1
        visited.update(zip(range(b), count.tolist(), strict=True))

        y_replay = mamba2_replay_output(
            ckpt, ring_x, ring_dt, ring_B, count, inp["C"], inp["x"], A, D, inp["z"]
        )
        assert_rel_close(y_replay, y, REPLAY_RTOL, f"output at t={t}, count={count.tolist()}")
        folded = mamba2_replay_flush(ckpt, ring_x, ring_dt, ring_B, count, A)
        assert_rel_close(folded, state, REPLAY_RTOL, f"state at t={t}")

    assert visited == {(s, n) for s in range(b) for n in range(1, L + 1)}


def test_mamba2_replay_verify_gives_every_query_its_own_prefix():
    """T queries at once equal T single-query replays with count - T + 1 .. count records."""
    gen = torch.Generator().manual_seed(5)
    b, h, g, dv, dk, lcap, T = 3, 4, 2, 5, 7, 9, 3
    A, D = -torch.rand(h, dtype=F64, generator=gen) - 0.2, randn(h, gen=gen)
    ckpt = randn(b, h, dv, dk, gen=gen)
    ring_x, ring_B = randn(b, h, lcap, dv, gen=gen), randn(b, g, lcap, dk, gen=gen)
    ring_dt = torch.rand(b, h, lcap, dtype=F64, generator=gen)
    count = torch.tensor([3, 9, 6])
    C, z = randn(b, g, T, dk, gen=gen), randn(b, h, T, dv, gen=gen)
    x = torch.stack([ring_x[i, :, count[i] - T : count[i]] for i in range(b)])

    y = mamba2_replay_verify(ckpt, ring_x, ring_dt, ring_B, count, C, x, A, D, z)

    for t in range(T):
        single = mamba2_replay_output(
            ckpt,
            ring_x,
            ring_dt,
            ring_B,
            count - T + 1 + t,
            C[:, :, t],
            x[:, :, t],
            A,
            D,
            z[:, :, t],
        )
        assert_rel_close(y[:, :, t], single, REPLAY_RTOL, f"query {t}")


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_delta_replay_equals_recurrence_at_every_ring_position(per_channel):
    """u from ckpt + ring, output from ckpt + ring (u cached), flush recomputing u from raw v:
    all equal the plain step at every position, slots on different phases."""
    step, replay_u, replay_output, replay_flush = (
        (kda_step, kda_replay_u, kda_replay_output, kda_replay_flush)
        if per_channel
        else (gdn_step, gdn_replay_u, gdn_replay_output, gdn_replay_flush)
    )
    gen = torch.Generator().manual_seed(6 + per_channel)
    b, h, dv, dk = len(PHASES), 3, 5, 7
    decay_dims = (dk,) if per_channel else ()
    state = randn(b, h, dv, dk, gen=gen)
    ckpt = state.clone()
    ring_u, ring_v = nan_ring(b, h, L, dv), nan_ring(b, h, L, dv)
    ring_k, ring_g, ring_beta = (
        nan_ring(b, h, L, dk),
        nan_ring(b, h, L, *decay_dims),
        nan_ring(b, h, L),
    )
    rings = (ring_u, ring_v, ring_k, ring_g, ring_beta)
    count = torch.zeros(b, dtype=torch.int64)
    phase = torch.tensor(PHASES)
    visited = set()

    for t in range(STEPS):
        fold = ((t + phase) % L == 0) & (count > 0)
        if bool(fold.any()):
            new_ckpt = replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count)
            assert_rel_close(new_ckpt[fold], state[fold], REPLAY_RTOL, f"flush at t={t}")
            ckpt = torch.where(fold[:, None, None, None], new_ckpt, ckpt)
            count = torch.where(fold, 0, count)
            for ring in rings:
                ring[fold] = float("nan")
        q = randn(b, h, dk, gen=gen)
        k = F.normalize(randn(b, h, dk, gen=gen), dim=-1)
        v = randn(b, h, dv, gen=gen)
        g = -0.5 * torch.rand(b, h, *decay_dims, dtype=F64, generator=gen)
        beta = torch.rand(b, h, dtype=F64, generator=gen)
        decayed_k = torch.einsum("bhvk,bhk->bhv", state * torch.exp(g).view(b, h, 1, -1), k)
        u_expected = beta[..., None] * (v - decayed_k)
        y, state = step(state, q, k, v, g, beta)

        slots = torch.arange(b)
        ring_v[slots, :, count], ring_k[slots, :, count] = v, k
        ring_g[slots, :, count], ring_beta[slots, :, count] = g, beta
        count = count + 1
        visited.update(zip(range(b), count.tolist(), strict=True))

        u = replay_u(ckpt, ring_u, ring_v, ring_k, ring_g, ring_beta, count)
        assert_rel_close(u, u_expected, REPLAY_RTOL, f"u at t={t}")
        ring_u[slots, :, count - 1] = u
        y_replay = replay_output(ckpt, ring_u, ring_k, ring_g, count, q)
        assert_rel_close(y_replay, y, REPLAY_RTOL, f"output at t={t}, count={count.tolist()}")
        folded = replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count)
        assert_rel_close(folded, state, REPLAY_RTOL, f"state at t={t}")

    assert visited == {(s, n) for s in range(b) for n in range(1, L + 1)}


def test_gdn_flush_folds_exactly_count_records_per_slot():
    """Slots holding 4 and 2 records: the flush folds each slot's own prefix, sequentially."""
    gen = torch.Generator().manual_seed(8)
    b, h, dv, dk, lcap = 2, 3, 5, 7, 4
    ckpt = randn(b, h, dv, dk, gen=gen)
    ring_v, ring_k = randn(b, h, lcap, dv, gen=gen), randn(b, h, lcap, dk, gen=gen)
    ring_g = -torch.rand(b, h, lcap, dtype=F64, generator=gen)
    ring_beta = torch.rand(b, h, lcap, dtype=F64, generator=gen)
    count = torch.tensor([4, 2])
    state = ckpt.clone()
    for j in range(lcap):
        _, stepped = gdn_step(
            state,
            ring_k[:, :, j],
            ring_k[:, :, j],
            ring_v[:, :, j],
            ring_g[:, :, j],
            ring_beta[:, :, j],
        )
        state = torch.where((j < count)[:, None, None, None], stepped, state)
    folded = gdn_replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count)
    assert_rel_close(folded, state, REPLAY_RTOL, "flush")


# ---- bad input -----------------------------------------------------------------------------------


def _mamba2_args(b=2, h=4, g=2, dv=5, dk=7, dtype=F64):
    gen = torch.Generator().manual_seed(9)
    return dict(
        state=torch.randn(b, h, dv, dk, generator=gen).to(dtype),
        x=torch.randn(b, h, dv, generator=gen).to(dtype),
        dt=torch.randn(b, h, generator=gen).to(dtype),
        A=-torch.rand(h, generator=gen).to(dtype),
        B=torch.randn(b, g, dk, generator=gen).to(dtype),
        C=torch.randn(b, g, dk, generator=gen).to(dtype),
    )


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("x", torch.zeros(2, 4, 6, dtype=F64), r"x: expected shape \[2, 4, 5\], got \[2, 4, 6\]"),
        ("dt", torch.zeros(2, 4, dtype=torch.float32), "dt: expected dtype torch.float64"),
        ("A", torch.zeros(3, dtype=F64), r"A: expected shape \[4\], got \[3\]"),
        ("B", torch.zeros(2, 3, 7, dtype=F64), "ngroups: expected a divisor of nheads=4, got 3"),
        ("C", torch.zeros(2, 2, 8, dtype=F64), r"C: expected shape \[2, 2, 7\]"),
        ("state", torch.zeros(2, 4, 5, dtype=F64), r"state: expected shape \[b, h, dv, dk\]"),
        ("x", torch.zeros(2, 4, 5, dtype=torch.int64), "x: expected a floating-point dtype"),
    ],
    ids=["x-shape", "dt-dtype", "A-shape", "B-groups", "C-shape", "state-ndim", "x-int"],
)
def test_mamba2_step_rejects_bad_input_naming_the_argument(name, bad, message):
    args = _mamba2_args()
    args[name] = bad
    with pytest.raises(ValueError, match=message):
        mamba2_step(**args)


def test_replay_rejects_counts_outside_the_ring_and_empty_queries():
    gen = torch.Generator().manual_seed(10)
    b, h, dv, dk, lcap = 2, 3, 5, 7, 4
    ckpt = randn(b, h, dv, dk, gen=gen)
    ring_x, ring_dt, ring_B = (
        randn(b, h, lcap, dv, gen=gen),
        randn(b, h, lcap, gen=gen),
        randn(b, 1, lcap, dk, gen=gen),
    )
    A, C, x = -torch.ones(h, dtype=F64), randn(b, 1, dk, gen=gen), randn(b, h, dv, gen=gen)
    with pytest.raises(ValueError, match=r"count: expected values in \[0, 4\], got \[5, 1\]"):
        mamba2_replay_output(ckpt, ring_x, ring_dt, ring_B, torch.tensor([5, 1]), C, x, A)
    with pytest.raises(ValueError, match="count: expected every slot to hold its T=1"):
        mamba2_replay_output(ckpt, ring_x, ring_dt, ring_B, torch.tensor([0, 1]), C, x, A)
    for bad in (torch.tensor([1.0, 1.0]), torch.tensor([1, 1], dtype=torch.int16),
                torch.tensor([1, 1], dtype=torch.uint8)):  # small ints failed in a gather
        with pytest.raises(ValueError, match="count: expected dtype torch.int32 or torch.int64"):
            mamba2_replay_flush(ckpt, ring_x, ring_dt, ring_B, bad, A)
    with pytest.raises(ValueError, match=r"ring_dt: expected shape \[2, 3, 4\]"):
        mamba2_replay_flush(ckpt, ring_x, ring_dt[:, :, :3], ring_B, torch.tensor([1, 1]), A)
    ring_g = -torch.rand(b, h, lcap, dtype=F64, generator=gen)
    with pytest.raises(ValueError, match=r"ring_g: expected shape \[2, 3, 4, 7\]"):
        kda_replay_output(
            ckpt, ring_x, ring_B.expand(b, h, lcap, dk), ring_g, torch.tensor([1, 1]), C[:, 0]
        )
    with pytest.raises(ValueError, match="count: expected >= 1"):
        gdn_replay_output(
            ckpt, ring_x, ring_B.expand(b, h, lcap, dk), ring_g, torch.tensor([0, 1]), C[:, 0]
        )
