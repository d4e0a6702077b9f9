"""ReplaySSM speculative decoding for Gated DeltaNet and KDA in Triton: verify T drafts per call.

The cache is `gdn_replay_decode.GDNReplayCache` with `draft = T` (ring capacity L + T). Per slot
with `h = cursors[s]` committed records, `gdn_replay_verify` decides the flush before anything
runs, `h + T > L`, and then:

    flush       S_new = the h committed records folded into the recurrence copy one by one
                (every u recomputed from the raw v, as the standard flush); both copies are
                written from it (flush counter flushes[s]); the drafts start a new window at
                ring positions 0..T-1 and read the unrounded S_new; cursors[s] = 0,
                flushes[s] += 1
    non-flush   the drafts go to positions h..h+T-1 and read the read copy and the committed
                records' cached u

The drafts' u depend on each other, so they are computed in order, each as a non-flush
decode step computes its record (one pass over the checkpoint, two products), and cached in
the ring with the raw v, k, g, beta. `gdn_replay_commit(cache, a)` accepts the first `a[s]`
drafts by moving the pointer, `cursors[s] += a[s]`; the rejected ones stay past it and are
overwritten by the next verify.

This is `lowprec.replay.GDNReplay.verify` / `commit` (whose flush rotates the ring instead of
writing the drafts at position 0) to fp32 rounding, copies bit for bit; KDA likewise with the
per-channel decay.
"""

# emulation.numerics comes first: without CUDA it switches Triton's interpreter on, which has to
# happen before triton is first imported.
import emulation.numerics  # noqa: F401, I001
import torch
import triton
import triton.language as tl

from emulation.gdn_replay_decode import (
    GDNReplayCache,
    check_gdn_cache,
    fold_ring,
    load_record,
    load_ring,
    program_bases,
    replay_record,
    run_replay,
)
from emulation.replay_decode import store_copies, tile_offsets
from emulation.replay_spec import commit_drafts

__all__ = ["gdn_replay_verify", "gdn_replay_commit", "kda_replay_verify", "kda_replay_commit"]


@triton.jit
def _gdn_replay_verify_kernel(
    p_hi, p_lo, p_lo_scales, p_lo_global,
    p_ring_u, p_ring_v, p_ring_k, p_ring_g, p_ring_beta, p_cursors, p_flushes,
    p_q, p_k, p_v, p_g, p_beta, p_y, p_debug,
    seed, nheads, dv, dk, lcap, n_blocks,
    T: tl.constexpr, WINDOW: tl.constexpr, PER_CHANNEL: tl.constexpr, HI: tl.constexpr,
    HI_SR: tl.constexpr, SR_BITS: tl.constexpr, ROUNDS: tl.constexpr, LO: tl.constexpr,
    HAS_DEBUG: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr, NC: tl.constexpr,
):
    # h: committed records
    i_s, i_h, i_sh, h, flush, p_ru, p_rv, p_rk, p_rg, p_rbeta = program_bases(
        p_cursors, p_flushes, p_ring_u, p_ring_v, p_ring_k, p_ring_g, p_ring_beta,
        nheads, dv, dk, lcap, PER_CHANNEL)

    o_v, o_k, m_v, m_vk, o_vk = tile_offsets(dv, dk, BV, BK)  # [BV, BK] tile of the state
    p_state = i_sh * dv * dk

    is_flush = h + T > WINDOW
    if is_flush:
        # flush: fold the h committed records into the recurrence copy; the drafts read S_new
        b_base = tl.load(p_hi + p_state + o_vk, mask=m_vk, other=0.0).to(tl.float32)
        b_base = fold_ring(b_base, p_rk, p_rv, p_rg, p_rbeta, h, WINDOW, dv, dk, PER_CHANNEL,
                           BV, BK, NC)
        store_copies(b_base, p_hi, p_lo, p_lo_scales, p_lo_global, p_debug, i_sh, seed, i_s,
                     i_h, flush, dv, dk, n_blocks, HI, HI_SR, SR_BITS, ROUNDS, LO, HAS_DEBUG,
                     BV, BK)
    else:
        b_base = tl.load(p_lo + p_state + o_vk, mask=m_vk, other=0.0)
    n_prev = tl.where(is_flush, 0, h)  # committed records the drafts see besides the base
    b_U, b_K, b_G = load_ring(p_ru, p_rk, p_rg, n_prev, lcap, dv, dk, PER_CHANNEL,
                              BV, BK, BL, NC)
    for t in tl.static_range(T):
        p = n_prev + t
        row = i_sh * T + t
        b_k, b_v, b_g, beta = load_record(p_k, p_v, p_g, p_beta, row, dv, dk, PER_CHANNEL,
                                          BV, BK, NC)
        b_q = tl.load(p_q + row * dk + o_k, mask=o_k < dk, other=0.0).to(tl.float32)
        b_u, b_U, b_K, b_G, b_y = replay_record(b_base, b_U, b_K, b_G, p, b_k, b_v, b_g, beta,
                                                b_q, BL)
        # the drafts' u: positions >= n_prev, which this program alone reads (v, k, g, beta
        # follow in the append launch: a flush read the committed ones at 0..h-1)
        tl.store(p_ru + p * dv + o_v, b_u, mask=m_v & (p < lcap))
        tl.store(p_y + row * dv + o_v, b_y.to(p_y.dtype.element_ty), mask=m_v)


def gdn_replay_verify(
    cache: GDNReplayCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outputs of T = cache.draft GDN drafts per slot in one call (module docstring); returns
    y [slots, nheads, T, dv]. Follow with `gdn_replay_commit`.

    q, k [slots, nheads, T, dk], v [slots, nheads, T, dv] (activation dtype), g, beta
    [slots, nheads, T] fp32. `debug_state` fp32 [slots, nheads, dv, dk] receives S_new at
    flush rows. Launches on the current stream."""
    return run_replay(_gdn_replay_verify_kernel, cache, q, k, v, g, beta, out, debug_state,
                      False, True)


def kda_replay_verify(
    cache: GDNReplayCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gdn_replay_verify` for KDA: g [slots, nheads, T, dk] fp32 (per-channel log-decay)."""
    return run_replay(_gdn_replay_verify_kernel, cache, q, k, v, g, beta, out, debug_state,
                      True, True)


def gdn_replay_commit(cache: GDNReplayCache, accepted) -> None:
    """Accept the first `accepted[s]` drafts of each slot's last verify: cursors += accepted.
    One commit a verify (without a pending verify it raises). accepted: an int, or an
    int32/int64 tensor [slots] on the cache's device, in [0, T]."""
    check_gdn_cache(cache, False)
    commit_drafts(cache, accepted, "gdn_replay_verify")


def kda_replay_commit(cache: GDNReplayCache, accepted) -> None:
    """`gdn_replay_commit` for a KDA cache."""
    check_gdn_cache(cache, True)
    commit_drafts(cache, accepted, "kda_replay_verify")
