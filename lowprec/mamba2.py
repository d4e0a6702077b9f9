"""Mamba-2 decode: the plain step and its ReplaySSM form (naive PyTorch references).

Per slot ``b`` and head ``h`` the state ``S`` has shape ``(d_v, d_k)`` (``headdim x dstate``):

    dt_t = softplus(dt_raw + dt_bias)                   (if dt_softplus; else dt_raw + dt_bias)
    a_t  = exp(dt_t * A)                                A < 0, one per head
    S_t  = a_t * S_{t-1} + dt_t * x_t B_t^T
    y_t  = S_t C_t + D * x_t,   then  y_t *= silu(z_t)  if z is given

``B`` and ``C`` have ``ngroups`` rows shared by the ``nheads // ngroups`` consecutive heads of a
group (head ``h`` reads group ``h // (nheads // ngroups)``).

**Replay.** With a checkpoint ``S_ckpt`` and the ring of the ``n`` records written since,
``(x_j, dt_j, B_j)`` for ``j = 0..n-1`` (``dt_j`` already processed), the state after record ``p``
is ``S_p = g_{0:p} S_ckpt + sum_{j<=p} g_{j+1:p} dt_j x_j B_j^T`` with
``g_{i:p} = exp(A * sum_{l=i..p} dt_l)``: every decay product is one ``exp`` of a difference of
cumulative sums of ``dt``. The replay functions never form a state except in the flush.

Ring layout (DESIGN.md): ``ring_x [b, h, Lcap, dv]``, ``ring_dt [b, h, Lcap]``,
``ring_B [b, g, Lcap, dk]``, ``count [b]`` records held per slot. Slots may hold different
numbers of records; entries at positions ``>= count`` are never read (they may hold anything,
NaN included).

All functions work in the dtype of the state (fp64 for the exact arms) and validate their inputs
with ``ValueError`` naming the argument, the expected and the actual value.
"""

import torch
import torch.nn.functional as F

from lowprec._checks import (
    check_count,
    check_float,
    check_ndim,
    check_same_device,
    check_shape,
)

__all__ = [
    "mamba2_process_dt",
    "mamba2_step",
    "mamba2_replay_output",
    "mamba2_replay_verify",
    "mamba2_replay_flush",
]


def _heads_per_group(nheads: int, ngroups: int) -> int:
    if ngroups < 1 or nheads % ngroups != 0:
        raise ValueError(f"ngroups: expected a divisor of nheads={nheads}, got {ngroups}")
    return nheads // ngroups


def _group_to_heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """Repeat a per-group tensor ``[b, g, ...]`` along dim 1 so that head ``h`` sees group
    ``h // (nheads // g)``."""
    return t.repeat_interleave(nheads // t.shape[1], dim=1)


def mamba2_process_dt(dt, dt_bias=None, dt_softplus=True):
    """``dt + dt_bias`` (bias ``[h]`` broadcast over the trailing head dim of ``dt [b, h]``),
    then softplus if ``dt_softplus``: the ``dt`` the recurrence and the ring use."""
    if not isinstance(dt_softplus, bool):  # a word such as "false" would read as True
        raise ValueError(f"dt_softplus: expected a bool, got {dt_softplus!r}")
    check_float("dt", dt)
    if dt_bias is not None:
        check_float("dt_bias", dt_bias, dt.dtype)
        check_same_device({"dt": dt, "dt_bias": dt_bias})
        check_shape("dt_bias", dt_bias, (dt.shape[1],))
        dt = dt + dt_bias.view(1, -1, *([1] * (dt.dim() - 2)))
    return F.softplus(dt) if dt_softplus else dt


def _gate(y, D, x, z):
    """``y + D x``, times ``silu(z)`` if given; ``D [h]`` broadcast over ``[b, h, ..., dv]``."""
    if D is not None:
        y = y + D.view(1, -1, *([1] * (x.dim() - 2))) * x
    if z is not None:
        y = y * F.silu(z)
    return y


def mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True):
    """One decode step of every slot and head; returns ``(y [b, h, dv], new_state)``.

    Shapes: ``state [b, h, dv, dk]``, ``x [b, h, dv]``, ``dt [b, h]`` (raw), ``A [h]``,
    ``B, C [b, g, dk]``, ``D [h]``, ``z [b, h, dv]``, ``dt_bias [h]``. ``y`` reads the new state.
    """
    check_float("state", state)
    check_ndim("state", state, 4, "[b, h, dv, dk]")
    b, h, dv, dk = state.shape
    dtype = state.dtype
    check_float("x", x, dtype)
    check_shape("x", x, (b, h, dv))
    check_float("dt", dt, dtype)
    check_shape("dt", dt, (b, h))
    check_float("A", A, dtype)
    check_shape("A", A, (h,))
    check_float("B", B, dtype)
    check_ndim("B", B, 3, f"[b, ngroups, dk] = [{b}, g, {dk}]")
    g = B.shape[1]
    _heads_per_group(h, g)
    check_shape("B", B, (b, g, dk))
    check_float("C", C, dtype)
    check_shape("C", C, (b, g, dk))
    _check_gate_args(D, z, dtype, h, (b, h, dv))
    check_same_device({"state": state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z,
                       "dt_bias": dt_bias})

    dt = mamba2_process_dt(dt, dt_bias, dt_softplus)
    decay = torch.exp(dt * A)  # [b, h]
    B_h = _group_to_heads(B, h)  # [b, h, dk]
    C_h = _group_to_heads(C, h)
    update = (dt[..., None] * x)[..., :, None] * B_h[..., None, :]  # [b, h, dv, dk]
    new_state = decay[..., None, None] * state + update
    y = torch.einsum("bhvk,bhk->bhv", new_state, C_h)
    return _gate(y, D, x, z), new_state


def _check_gate_args(D, z, dtype, nheads, z_shape):
    if D is not None:
        check_float("D", D, dtype)
        check_shape("D", D, (nheads,))
    if z is not None:
        check_float("z", z, dtype)
        check_shape("z", z, z_shape)


def _check_ring(ckpt, ring_x, ring_dt, ring_B, count, A):
    """Validate the checkpoint and ring; returns ``(b, h, g, Lcap, dv, dk)``."""
    check_float("ckpt", ckpt)
    check_ndim("ckpt", ckpt, 4, "[b, h, dv, dk]")
    b, h, dv, dk = ckpt.shape
    dtype = ckpt.dtype
    check_float("ring_x", ring_x, dtype)
    check_ndim("ring_x", ring_x, 4, "[b, h, Lcap, dv]")
    lcap = ring_x.shape[2]
    check_shape("ring_x", ring_x, (b, h, lcap, dv))
    check_float("ring_dt", ring_dt, dtype)
    check_shape("ring_dt", ring_dt, (b, h, lcap))
    check_float("ring_B", ring_B, dtype)
    check_ndim("ring_B", ring_B, 4, "[b, g, Lcap, dk]")
    g = ring_B.shape[1]
    _heads_per_group(h, g)
    check_shape("ring_B", ring_B, (b, g, lcap, dk))
    check_float("A", A, dtype)
    check_shape("A", A, (h,))
    check_same_device({"ckpt": ckpt, "ring_x": ring_x, "ring_dt": ring_dt, "ring_B": ring_B,
                       "count": count, "A": A})
    check_count("count", count, b, 0, lcap)
    return b, h, g, lcap, dv, dk


def _decay_weights(ring_dt, count, positions, A):
    """Decay products for queries at ring ``positions [b, T]`` (-1: before the first record).

    Returns ``(g_ckpt [b, h, T], w [b, h, T, Lcap])`` with ``g_ckpt = exp(A * cum[p])`` and
    ``w[j] = exp(A * (cum[p] - cum[j])) * dt_j`` for ``j <= p`` and 0 elsewhere, where
    ``cum[p] = sum_{l<=p} dt_l`` over valid records. Unused ring entries (``>= count``) are
    replaced, not multiplied, so NaN there cannot leak.
    """
    lcap = ring_dt.shape[-1]
    j = torch.arange(lcap, device=ring_dt.device)
    held = j[None, :] < count[:, None]  # [b, Lcap]
    dt = torch.where(held[:, None, :], ring_dt, torch.zeros((), dtype=ring_dt.dtype))
    cum = torch.cumsum(dt, dim=-1)  # [b, h, Lcap]
    cum0 = F.pad(cum, (1, 0))  # cum0[p + 1] = cum[p]; cum0[0] = 0
    idx = (positions + 1)[:, None, :].expand(-1, cum.shape[1], -1)
    cum_p = torch.gather(cum0, -1, idx)  # [b, h, T]
    g_ckpt = torch.exp(A[None, :, None] * cum_p)
    causal = j[None, None, :] <= positions[:, :, None]  # [b, T, Lcap]
    expo = A[None, :, None, None] * (cum_p[..., None] - cum[:, :, None, :])  # [b, h, T, Lcap]
    w = torch.where(causal[:, None], torch.exp(expo) * dt[:, :, None, :], 0.0)
    return g_ckpt, w


def mamba2_replay_verify(ckpt, ring_x, ring_dt, ring_B, count, C, x, A, D=None, z=None):
    """Outputs of the last ``T`` records of the ring, all at once, without forming a state.

    The ring holds ``count[b]`` records; query ``t`` (``t = 0..T-1``) is the record at position
    ``count - T + t`` and sees records ``0..count-T+t``. ``C [b, g, T, dk]``, ``x [b, h, T, dv]``
    (for ``D x``) and ``z [b, h, T, dv]`` belong to the queries. Returns ``y [b, h, T, dv]``.
    Speculative decoding calls this with the ``T`` drafts; the plain step is ``T = 1``.
    """
    b, h, g, lcap, dv, dk = _check_ring(ckpt, ring_x, ring_dt, ring_B, count, A)
    dtype = ckpt.dtype
    check_float("C", C, dtype)
    check_ndim("C", C, 4, "[b, g, T, dk]")
    T = C.shape[2]
    check_shape("C", C, (b, g, T, dk))
    check_float("x", x, dtype)
    check_shape("x", x, (b, h, T, dv))
    _check_gate_args(D, z, dtype, h, (b, h, T, dv))
    check_same_device({"ckpt": ckpt, "C": C, "x": x, "D": D, "z": z})
    if bool((count < T).any()):
        raise ValueError(
            f"count: expected every slot to hold its T={T} query records, got {count.tolist()}"
        )

    positions = count[:, None] - T + torch.arange(T, device=count.device)[None, :]  # [b, T]
    g_ckpt, w = _decay_weights(ring_dt, count, positions, A)
    held = torch.arange(lcap, device=count.device)[None, :] < count[:, None]
    ring_x = torch.where(held[:, None, :, None], ring_x, 0.0)
    ring_B = torch.where(held[:, None, :, None], ring_B, 0.0)
    C_h = _group_to_heads(C, h)  # [b, h, T, dk]
    BC = _group_to_heads(torch.einsum("bgjk,bgtk->bgtj", ring_B, C), h)  # [b, h, T, Lcap]
    y = g_ckpt[..., None] * torch.einsum("bhvk,bhtk->bhtv", ckpt, C_h)
    y = y + torch.einsum("bhtj,bhjv->bhtv", w * BC, ring_x)
    return _gate(y, D, x, z)


def mamba2_replay_output(ckpt, ring_x, ring_dt, ring_B, count, C, x, A, D=None, z=None):
    """Output of the current step (the record at ring position ``count - 1``) from the
    checkpoint and the ring; ``C [b, g, dk]``, ``x, z [b, h, dv]``; returns ``y [b, h, dv]``
    (``p = count - 1``, decay products as in the module docstring):

        y = g_{0:p} (S_ckpt C) + sum_{j<=p} g_{j+1:p} dt_j (B_j . C) x_j + D x
    """
    check_ndim("C", C, 3, "[b, g, dk]")
    check_ndim("x", x, 3, "[b, h, dv]")
    if z is not None:
        check_ndim("z", z, 3, "[b, h, dv]")
    y = mamba2_replay_verify(
        ckpt,
        ring_x,
        ring_dt,
        ring_B,
        count,
        C[:, :, None],
        x[:, :, None],
        A,
        D,
        None if z is None else z[:, :, None],
    )
    return y[:, :, 0]


def mamba2_replay_flush(ckpt, ring_x, ring_dt, ring_B, count, A):
    """Fold the ``count[b]`` records of each slot's ring into a new state ``[b, h, dv, dk]``
    (``p = count - 1``; ``count = 0`` returns ``ckpt``):

    S_p = g_{0:p} S_ckpt + sum_{j<=p} g_{j+1:p} dt_j x_j B_j^T
    """
    b, h, g, lcap, dv, dk = _check_ring(ckpt, ring_x, ring_dt, ring_B, count, A)
    positions = (count - 1)[:, None]  # the last record; -1 leaves the checkpoint unchanged
    g_ckpt, w = _decay_weights(ring_dt, count, positions, A)
    held = torch.arange(lcap, device=count.device)[None, :] < count[:, None]
    ring_x = torch.where(held[:, None, :, None], ring_x, 0.0)
    B_h = _group_to_heads(torch.where(held[:, None, :, None], ring_B, 0.0), h)
    folded = torch.einsum("bhj,bhjv,bhjk->bhvk", w[:, :, 0], ring_x, B_h)
    return g_ckpt[:, :, 0, None, None] * ckpt + folded
