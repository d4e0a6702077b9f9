"""Gated DeltaNet decode: the plain step and its ReplaySSM form (naive PyTorch references).

Per slot and head, with log-decay ``g_t`` (``a_t = exp(g_t)``), keys/queries ``[d_k]``, values
``[d_v]`` and state ``S [d_v, d_k]``:

    S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
        = a_t S_{t-1} + u_t k_t^T,        u_t = beta_t (v_t - a_t S_{t-1} k_t)
    y_t = S_t q_t

Given the corrected values ``u_j``, the state is a plain decayed sum of outer products, so the
replay of Mamba-2 carries over: after record ``p`` of the ring,
``S_p = G_{0:p} S_ckpt + sum_{j<=p} G_{j+1:p} u_j k_j^T`` with
``G_{i:p} = exp(sum_{l=i..p} g_l)``. ``u_c`` itself needs ``a_c S_{c-1} k_c``, the same sum
over ``j < c``.

The ring caches, per record, ``u`` (computed on its own step from the rebuilt state, i.e. from
whichever checkpoint copy the step read), the raw ``v`` and ``k, g, beta``. The flush does not
trust the cached ``u``: it recomputes every ``u`` from raw ``v`` sequentially, starting from the
checkpoint it is given (the recurrence copy), so an error of the read copy stops at the flush.

Ring layout: ``ring_u, ring_v [b, h, Lcap, dv]``, ``ring_k [b, h, Lcap, dk]``,
``ring_g, ring_beta [b, h, Lcap]``, ``count [b]`` records held per slot (entries at positions
``>= count`` are never read). KDA (``lowprec.kda``) is the same with a per-channel decay
``g [..., dk]``; the private helpers below take both, the decay's last dim being 1 or ``d_k``.
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

__all__ = ["gdn_step", "gdn_replay_u", "gdn_replay_output", "gdn_replay_flush"]


def _delta_update(state, k, v, log_decay, beta):
    """One delta-rule update. ``log_decay [b, h, c]`` with ``c`` 1 (GDN) or ``dk`` (KDA) scales
    the state's columns: ``S' = S diag(exp(log_decay))``. Returns ``(new_state, u)``."""
    decayed = state * torch.exp(log_decay)[..., None, :]  # [b, h, dv, dk]
    u = beta[..., None] * (v - torch.einsum("bhvk,bhk->bhv", decayed, k))
    return decayed + u[..., :, None] * k[..., None, :], u


def _check_step(state, q, k, v, g, beta, per_channel):
    check_float("state", state)
    check_ndim("state", state, 4, "[b, h, dv, dk]")
    b, h, dv, dk = state.shape
    dtype = state.dtype
    for name, t, shape in (("q", q, (b, h, dk)), ("k", k, (b, h, dk)), ("v", v, (b, h, dv))):
        check_float(name, t, dtype)
        check_shape(name, t, shape)
    check_float("g", g, dtype)
    check_shape("g", g, (b, h, dk) if per_channel else (b, h))
    check_float("beta", beta, dtype)
    check_shape("beta", beta, (b, h))
    check_same_device({"state": state, "q": q, "k": k, "v": v, "g": g, "beta": beta})


def _step(state, q, k, v, log_decay, beta):
    new_state, _ = _delta_update(state, k, v, log_decay, beta)
    return torch.einsum("bhvk,bhk->bhv", new_state, q), new_state


def gdn_step(state, q, k, v, g, beta):
    """One decode step; returns ``(y [b, h, dv], new_state [b, h, dv, dk])``.

    ``state [b, h, dv, dk]``, ``q, k [b, h, dk]``, ``v [b, h, dv]``, ``g, beta [b, h]``
    (``g`` the log-decay, ``a = exp(g)``)."""
    _check_step(state, q, k, v, g, beta, False)
    return _step(state, q, k, v, g[..., None], beta)


def _check_ring(ckpt, rings, count, per_channel):
    """Validate ``ckpt`` and the ring tensors given by name in ``rings``; returns
    ``(b, h, Lcap, dv, dk)``."""
    check_float("ckpt", ckpt)
    check_ndim("ckpt", ckpt, 4, "[b, h, dv, dk]")
    b, h, dv, dk = ckpt.shape
    check_ndim("ring_k", rings["ring_k"], 4, "[b, h, Lcap, dk]")
    lcap = rings["ring_k"].shape[2]
    expected = {
        "ring_u": (b, h, lcap, dv),
        "ring_v": (b, h, lcap, dv),
        "ring_k": (b, h, lcap, dk),
        "ring_g": (b, h, lcap, dk) if per_channel else (b, h, lcap),
        "ring_beta": (b, h, lcap),
    }
    for name, t in rings.items():
        check_float(name, t, ckpt.dtype)
        check_shape(name, t, expected[name])
    check_same_device({"ckpt": ckpt, **rings, "count": count})
    check_count("count", count, b, 0, lcap)
    return b, h, lcap, dv, dk


def _held(count, lcap, below):
    """``[b, Lcap]`` mask of ring positions ``< count - below``."""
    return torch.arange(lcap, device=count.device)[None, :] < (count - below)[:, None]


def _read(ckpt, ring_u, ring_k, log_decay, count, query, inclusive):
    """``S query`` for the state at the slot's last record ``p = count - 1``, from the checkpoint
    and the ring, without forming a state.

    ``inclusive``: ``S = S_p`` (the output). Otherwise ``S = S_{p-1} diag(a_p)`` (what ``u_p``
    subtracts: record ``p``'s decay applies, its own ``u_p k_p^T`` does not).
    ``log_decay [b, h, Lcap, c]`` with ``c`` 1 or ``dk``. Returns ``[b, h, dv]``.
    """
    lcap = ring_k.shape[2]
    held = _held(count, lcap, 0)[:, None, :, None]  # [b, 1, Lcap, 1]
    log_decay = torch.where(held, log_decay, 0.0)
    cum = torch.cumsum(log_decay, dim=2)  # [b, h, Lcap, c]
    cum0 = F.pad(cum, (0, 0, 1, 0))  # cum0[p + 1] = cum[p]; cum0[0] = 0
    last = count[:, None, None, None].expand(-1, cum.shape[1], 1, cum.shape[3])
    cum_p = torch.gather(cum0, 2, last)  # [b, h, 1, c]
    used = _held(count, lcap, 0 if inclusive else 1)[:, None, :, None]
    decay_j = torch.where(used, torch.exp(cum_p - cum), 0.0)  # G_{j+1:p}, [b, h, Lcap, c]
    k_q = (torch.where(used, ring_k, 0.0) * decay_j) @ query[..., :, None]  # [b, h, Lcap, 1]
    u = torch.where(used, ring_u, 0.0)
    ckpt_term = torch.einsum("bhvk,bhk->bhv", ckpt, torch.exp(cum_p[:, :, 0]) * query)
    return ckpt_term + (u * k_q).sum(dim=2)


def _gather_last(ring, count):
    """The record at position ``count - 1`` of ``ring [b, h, Lcap, ...]``: ``[b, h, ...]``."""
    idx = (count - 1).clamp(min=0).view(-1, 1, 1, *([1] * (ring.dim() - 3)))
    idx = idx.expand(-1, ring.shape[1], 1, *ring.shape[3:])
    return torch.gather(ring, 2, idx).squeeze(2)


def _as_channels(ring_g, per_channel):
    return ring_g if per_channel else ring_g[..., None]


def _replay_u(ckpt, ring_u, ring_v, ring_k, ring_g, ring_beta, count, per_channel):
    rings = {
        "ring_u": ring_u,
        "ring_v": ring_v,
        "ring_k": ring_k,
        "ring_g": ring_g,
        "ring_beta": ring_beta,
    }
    _check_ring(ckpt, rings, count, per_channel)
    _check_nonempty(count)
    k = _gather_last(ring_k, count)
    decayed_k = _read(ckpt, ring_u, ring_k, _as_channels(ring_g, per_channel), count, k, False)
    return _gather_last(ring_beta, count)[..., None] * (_gather_last(ring_v, count) - decayed_k)


def _replay_output(ckpt, ring_u, ring_k, ring_g, count, q, per_channel):
    rings = {"ring_u": ring_u, "ring_k": ring_k, "ring_g": ring_g}
    b, h, _, _, dk = _check_ring(ckpt, rings, count, per_channel)
    _check_nonempty(count)
    check_float("q", q, ckpt.dtype)
    check_shape("q", q, (b, h, dk))
    check_same_device({"ckpt": ckpt, "q": q})
    return _read(ckpt, ring_u, ring_k, _as_channels(ring_g, per_channel), count, q, True)


def _replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count, per_channel):
    rings = {"ring_v": ring_v, "ring_k": ring_k, "ring_g": ring_g, "ring_beta": ring_beta}
    _check_ring(ckpt, rings, count, per_channel)
    log_decay = _as_channels(ring_g, per_channel)
    state = ckpt
    for j in range(int(count.max()) if count.numel() else 0):
        stepped, _ = _delta_update(
            state, ring_k[:, :, j], ring_v[:, :, j], log_decay[:, :, j], ring_beta[:, :, j]
        )
        state = torch.where((j < count)[:, None, None, None], stepped, state)
    return state


def _check_nonempty(count):
    if count.numel() and int(count.min()) < 1:
        raise ValueError(
            f"count: expected >= 1 (the current record is in the ring), got {count.tolist()}"
        )


def gdn_replay_u(ckpt, ring_u, ring_v, ring_k, ring_g, ring_beta, count):
    """Corrected value ``u [b, h, dv]`` of the current record (ring position ``count - 1``, whose
    ``v, k, g, beta`` are already in the ring; its ``ring_u`` entry is not read):

        u_c = beta_c (v_c - [G_{0:c} S_ckpt + sum_{j<c} G_{j+1:c} u_j k_j^T] k_c)
    """
    return _replay_u(ckpt, ring_u, ring_v, ring_k, ring_g, ring_beta, count, False)


def gdn_replay_output(ckpt, ring_u, ring_k, ring_g, count, q):
    """Output ``y [b, h, dv]`` of the current record (``ring_u`` filled through ``count - 1``):

    y = G_{0:c} (S_ckpt q) + sum_{j<=c} G_{j+1:c} (k_j . q) u_j
    """
    return _replay_output(ckpt, ring_u, ring_k, ring_g, count, q, False)


def gdn_replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count):
    """New state ``[b, h, dv, dk]``: the ``count[b]`` records folded into ``ckpt`` one by one,
    every ``u`` recomputed from the raw ``v`` (cached ``u`` are not read)."""
    return _replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count, False)

