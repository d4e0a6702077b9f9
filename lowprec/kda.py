"""Kimi Delta Attention decode: Gated DeltaNet with a per-channel decay (naive references).

Per slot and head, with a log-decay vector ``g_t [d_k]`` (``a_t = exp(g_t)``):

    S_t = S_{t-1} diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
        = S_{t-1} diag(a_t) + u_t k_t^T,     u_t = beta_t (v_t - S_{t-1} diag(a_t) k_t)
    y_t = S_t q_t

Replay: ``S_p = S_ckpt diag(G_{0:p}) + sum_{j<=p} u_j (k_j * G_{j+1:p})^T`` with the decay
products ``G_{i:p} = exp(sum_{l=i..p} g_l)`` taken per channel. Everything else (ring contents,
``u`` cached on its own step, the flush recomputing ``u`` from raw ``v``) is as in
``lowprec.gdn``, whose helpers take the decay's channel dim as data; the only layout change is
``ring_g [b, h, Lcap, dk]``.
"""

from lowprec.gdn import _check_step, _replay_flush, _replay_output, _replay_u, _step

__all__ = ["kda_step", "kda_replay_u", "kda_replay_output", "kda_replay_flush"]


def kda_step(state, q, k, v, g, beta):
    """One decode step; returns ``(y [b, h, dv], new_state [b, h, dv, dk])``.

    ``state [b, h, dv, dk]``, ``q, k [b, h, dk]``, ``v [b, h, dv]``, ``g [b, h, dk]`` (log-decay
    per channel), ``beta [b, h]``."""
    _check_step(state, q, k, v, g, beta, True)
    return _step(state, q, k, v, g, beta)


def kda_replay_u(ckpt, ring_u, ring_v, ring_k, ring_g, ring_beta, count):
    """Corrected value ``u [b, h, dv]`` of the record at ring position ``count - 1``:
    ``u_c = beta_c (v_c - S_{c-1} diag(a_c) k_c)`` with ``S_{c-1}`` rebuilt from the ring."""
    return _replay_u(ckpt, ring_u, ring_v, ring_k, ring_g, ring_beta, count, True)


def kda_replay_output(ckpt, ring_u, ring_k, ring_g, count, q):
    """Output ``y [b, h, dv]`` of the record at ``count - 1`` (its ``u`` already in the ring)."""
    return _replay_output(ckpt, ring_u, ring_k, ring_g, count, q, True)


def kda_replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count):
    """New state: the ``count[b]`` records folded into ``ckpt`` one by one, every ``u``
    recomputed from raw ``v``."""
    return _replay_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count, True)

