"""ReplaySSM speculative decoding for Mamba-2 in Triton: verify T drafts in one call.

The cache is `replay_decode.ReplayCache` with `draft = T` (ring capacity L + T). Per slot with
`h = cursors[s]` committed records, `mamba2_replay_verify` decides the flush before anything
runs, `h + T > L`, and then:

    flush       S_new = g_{0:h} S_hi + sum_{j<h} g_{j+1:h} dt_j x_j B_j^T  (the h committed
                records only); both copies are written from it (flush counter flushes[s], as
                the standard decode), the drafts start a new window at ring positions 0..T-1
                and are read against the unrounded S_new; cursors[s] = 0, flushes[s] += 1
    non-flush   the drafts go to positions h..h+T-1 and are read against the read copy

All T outputs come from one read of the checkpoint (base = S_new or S_lo) and the records
before each query (committed ones, then drafts 0..t for draft t):

    y_t = g_{0:p_t} (base C_t) + sum_{j<=p_t} g_{j+1:p_t} dt_j (B_j . C_t) x_j + D x_t
        = diag(g) (C base^T)  +  (W o (C B^T)) X          W[t, j] = g_{j+1:p_t} dt_j, j <= p_t

with `C [T, dstate]` the queries, `B, X` the records: `C base^T`, `C B^T` and `(W o C B^T) X` are
three small matrix products and W is a causal mask over decays. `mamba2_replay_commit(cache, a)`
then accepts the first `a[s]` drafts of each slot by moving its pointer, `cursors[s] += a[s]`;
rejected drafts stay in the ring past the pointer and are overwritten by the next verify.

This equals `lowprec.replay.Mamba2Replay.verify` / `commit` (whose flush rotates the ring
instead of writing the drafts at position 0) and, with fp32 copies, decoding the accepted
tokens one by one, to fp32 rounding.
"""

# emulation.numerics comes first: without CUDA it switches Triton's interpreter on, which has to
# happen before triton is first imported.
from emulation.numerics import format_spec  # noqa: I001
import contextlib

import torch
import triton
import triton.language as tl

from emulation.replay_decode import (
    ReplayCache,
    _expect,
    check_cache,
    check_cursors,
    check_outputs,
    check_step_inputs,
    check_switch,
    gate_output,
    launch_config,
    process_dt,
    store_copies,
)

__all__ = ["mamba2_replay_verify", "mamba2_replay_commit", "commit_drafts"]


@triton.jit
def _mamba2_replay_verify_kernel(
    p_hi, p_lo, p_lo_scales, p_lo_global,
    p_ring_x, p_ring_dt, p_ring_B, p_cursors, p_flushes,
    p_x, p_dt, p_A, p_B, p_C, p_D, p_z, p_dt_bias, p_y, p_debug,
    seed, nheads, headdim, dstate, ngroups, lcap, window, n_blocks,
    T: tl.constexpr, HI: tl.constexpr, HI_SR: tl.constexpr, SR_BITS: tl.constexpr,
    ROUNDS: tl.constexpr, LO: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DEBUG: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr, BT: tl.constexpr,
):
    i_h = tl.program_id(0)
    i_s = tl.program_id(1).to(tl.int64)
    i_g = i_h // (nheads // ngroups)
    i_sh = i_s * nheads + i_h
    i_sg = i_s * ngroups + i_g
    h = tl.load(p_cursors + i_s)  # committed records
    flush = tl.load(p_flushes + i_s)

    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    o_t = tl.arange(0, BT)
    m_v = o_v < headdim
    m_k = o_k < dstate
    m_t = o_t < T
    m_vk = m_v[:, None] & m_k[None, :]
    o_vk = o_v[:, None] * dstate + o_k[None, :]  # [BV, BK]
    A = tl.load(p_A + i_h)

    # committed records 0..h-1
    m_l = o_l < h
    p_rx = p_ring_x + (i_sh * lcap + o_l[:, None]) * headdim + o_v[None, :]
    b_rx = tl.load(p_rx, mask=m_l[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BL, BV]
    p_rB = p_ring_B + (i_sg * lcap + o_l[:, None]) * dstate + o_k[None, :]
    b_rB = tl.load(p_rB, mask=m_l[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BL, BK]
    b_rdt = tl.load(p_ring_dt + i_sh * lcap + o_l, mask=m_l, other=0.0)  # [BL]

    is_flush = h + T > window
    n_prev = tl.where(is_flush, 0, h)  # committed records the drafts see besides the base
    if is_flush:
        # flush: fold the h committed records into the recurrence copy; the drafts read S_new
        b_cum = tl.cumsum(b_rdt, axis=0)
        cum_h = tl.sum(b_rdt, axis=0)
        b_w = tl.where(m_l, tl.exp(A * (cum_h - b_cum)) * b_rdt, 0.0)  # [BL]
        b_hi = tl.load(p_hi + i_sh * headdim * dstate + o_vk, mask=m_vk, other=0.0)
        b_xw = tl.trans(b_rx * b_w[:, None])  # [BV, BL]
        b_base = tl.exp(A * cum_h) * b_hi.to(tl.float32) + tl.dot(b_xw, b_rB,
                                                                   input_precision="ieee")
        store_copies(b_base, p_hi, p_lo, p_lo_scales, p_lo_global, p_debug, i_sh, seed, i_s, i_h,
                     flush, headdim, dstate, n_blocks, HI, HI_SR, SR_BITS, ROUNDS, LO, HAS_DEBUG,
                     BV, BK)
    else:
        b_base = tl.load(p_lo + i_sh * headdim * dstate + o_vk, mask=m_vk, other=0.0)

    # the records the drafts see: n_prev committed ones, then the T drafts at n_prev..
    m_prev = o_l < n_prev
    o_d = o_l - n_prev  # draft index of each ring position
    m_d = (o_l >= n_prev) & (o_d < T)
    p_dx = p_x + (i_sh * T + o_d[:, None]) * headdim + o_v[None, :]
    b_dx = tl.load(p_dx, mask=m_d[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_X = tl.where(m_prev[:, None], b_rx, b_dx)  # [BL, BV]
    p_dB = p_B + (i_sg * T + o_d[:, None]) * dstate + o_k[None, :]
    b_dB = tl.load(p_dB, mask=m_d[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    b_Bm = tl.where(m_prev[:, None], b_rB, b_dB)  # [BL, BK]
    b_dt_bias = tl.load(p_dt_bias + i_h) if HAS_DT_BIAS else 0.0
    b_ddt = process_dt(tl.load(p_dt + i_sh * T + o_d, mask=m_d, other=0.0), b_dt_bias,
                       DT_SOFTPLUS)
    b_dt = tl.where(m_prev, b_rdt, tl.where(m_d, b_ddt, 0.0))  # [BL]

    # queries: draft t sits at position p_t = n_prev + t and sees records j <= p_t
    b_C = tl.load(p_C + (i_sg * T + o_t[:, None]) * dstate + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BT, BK]
    m_causal = o_l[None, :] <= (n_prev + o_t)[:, None]  # [BT, BL]
    b_cum = tl.cumsum(b_dt, axis=0)  # [BL]
    b_cum_q = tl.sum(tl.where(m_causal, b_dt[None, :], 0.0), axis=1)  # [BT]
    b_W = tl.where(m_causal, tl.exp(A * (b_cum_q[:, None] - b_cum[None, :])) * b_dt[None, :], 0.0)
    b_CS = tl.dot(b_C, tl.trans(b_base), input_precision="ieee")  # [BT, BV]
    b_CB = tl.dot(b_C, tl.trans(b_Bm), input_precision="ieee")  # [BT, BL]
    b_y = tl.exp(A * b_cum_q)[:, None] * b_CS + tl.dot(b_W * b_CB, b_X, input_precision="ieee")

    m_tv = m_t[:, None] & m_v[None, :]
    o_tv = (i_sh * T + o_t[:, None]) * headdim + o_v[None, :]  # [BT, BV]
    b_xq = tl.load(p_x + o_tv, mask=m_tv, other=0.0).to(tl.float32)
    D = tl.load(p_D + i_h) if HAS_D else 0.0
    b_z = tl.load(p_z + o_tv, mask=m_tv, other=0.0).to(tl.float32) if HAS_Z else b_xq
    b_y = gate_output(b_y, b_xq, D, b_z, HAS_Z)
    tl.store(p_y + o_tv, b_y.to(p_y.dtype.element_ty), mask=m_tv)


@triton.jit
def _mamba2_append_drafts_kernel(
    p_ring_x, p_ring_dt, p_ring_B, p_cursors, p_flushes,
    p_x, p_dt, p_B, p_dt_bias,
    nheads, headdim, dstate, ngroups, lcap, window,
    T: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    BH: tl.constexpr, BG: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
):
    """Write slot i_s's T drafts behind its committed records (at 0 after a flush)."""
    i_s = tl.program_id(0).to(tl.int64)
    h = tl.load(p_cursors + i_s)
    is_flush = h + T > window
    start = tl.where(is_flush, 0, h)
    o_h = tl.arange(0, BH)
    o_g = tl.arange(0, BG)
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_h = o_h < nheads
    m_hv = m_h[:, None] & (o_v[None, :] < headdim)
    m_gk = (o_g[:, None] < ngroups) & (o_k[None, :] < dstate)
    b_dt_bias = tl.load(p_dt_bias + o_h, mask=m_h, other=0.0) if HAS_DT_BIAS else 0.0
    for t in tl.static_range(T):
        pos = start + t
        b_x = tl.load(p_x + ((i_s * nheads + o_h[:, None]) * T + t) * headdim + o_v[None, :],
                      mask=m_hv)
        p_rx = p_ring_x + ((i_s * nheads + o_h[:, None]) * lcap + pos) * headdim + o_v[None, :]
        tl.store(p_rx, b_x, mask=m_hv)  # [BH, BV]
        b_dt = process_dt(tl.load(p_dt + (i_s * nheads + o_h) * T + t, mask=m_h, other=0.0),
                          b_dt_bias, DT_SOFTPLUS)
        tl.store(p_ring_dt + (i_s * nheads + o_h) * lcap + pos, b_dt, mask=m_h)  # [BH]
        b_B = tl.load(p_B + ((i_s * ngroups + o_g[:, None]) * T + t) * dstate + o_k[None, :],
                      mask=m_gk)
        p_rB = p_ring_B + ((i_s * ngroups + o_g[:, None]) * lcap + pos) * dstate + o_k[None, :]
        tl.store(p_rB, b_B, mask=m_gk)  # [BG, BK]
    tl.store(p_cursors + i_s, start)
    tl.store(p_flushes + i_s, tl.load(p_flushes + i_s) + is_flush.to(tl.int32))


def mamba2_replay_verify(
    cache: ReplayCache,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    *,
    dt_softplus: bool = True,
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outputs of T = cache.draft drafts per slot in one call (module docstring); returns
    y [slots, nheads, T, headdim]. Follow with `mamba2_replay_commit`.

    Shapes: x, z [slots, nheads, T, headdim], B, C [slots, ngroups, T, dstate] (activation
    dtype), dt [slots, nheads, T] (raw) and A, D, dt_bias [nheads] in fp32. `debug_state` fp32
    [slots, nheads, headdim, dstate] receives S_new at flush rows. Launches on the current
    stream.
    """
    if not isinstance(cache, ReplayCache):
        raise ValueError(f"cache: expected a ReplayCache, got {type(cache).__name__}")
    T = cache.draft
    if T < 1:
        raise ValueError(f"cache.draft: expected T >= 1 for speculative decoding, got {T}")
    check_step_inputs(cache, x, dt, A, B, C, D, z, dt_bias, ndraft=T)
    check_switch("dt_softplus", dt_softplus)
    slots, nheads, headdim, dstate, ngroups, lcap = cache.shape
    check_cursors(cache, 0, cache.window)
    device = cache.hi.device
    # the drafts are appended after y is written
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    out = check_outputs(cache, out, debug_state, inputs, (slots, nheads, T, headdim), x.dtype)
    cache.pending = True  # the inputs are good: this verify awaits its commit
    if slots == 0:
        return out

    cfg = launch_config(headdim, dstate, lcap)
    n_blocks = cache.lo_scales.shape[-1] if cache.lo_scales is not None else 1
    unused = cache.lo
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _mamba2_replay_verify_kernel[(nheads, slots)](
            cache.hi, cache.lo,
            cache.lo_scales if cache.lo_scales is not None else unused,
            cache.lo_global if cache.lo_global is not None else unused,
            cache.ring_x, cache.ring_dt, cache.ring_B, cache.cursors, cache.flushes,
            x, dt, A, B, C,
            D if D is not None else A, z if z is not None else x,
            dt_bias if dt_bias is not None else A, out,
            debug_state if debug_state is not None else unused,
            cache.seed, nheads, headdim, dstate, ngroups, lcap, cache.window, n_blocks,
            T=T, HI=format_spec(cache.hi_format), HI_SR=cache.hi_rounding == "sr",
            SR_BITS=cache.sr_bits, ROUNDS=cache.philox_rounds, LO=format_spec(cache.lo_format),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus), HAS_DEBUG=debug_state is not None,
            BT=max(16, triton.next_power_of_2(T)),
            **cfg,
        )
        _mamba2_append_drafts_kernel[(slots,)](
            cache.ring_x, cache.ring_dt, cache.ring_B, cache.cursors, cache.flushes,
            x, dt, B, dt_bias if dt_bias is not None else A,
            nheads, headdim, dstate, ngroups, lcap, cache.window,
            T=T, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
            BH=triton.next_power_of_2(nheads), BG=triton.next_power_of_2(ngroups),
            BV=triton.next_power_of_2(headdim), BK=triton.next_power_of_2(dstate),
        )
    return out


def mamba2_replay_commit(cache: ReplayCache, accepted) -> None:
    """Accept the first `accepted[s]` drafts of each slot's last verify: cursors += accepted.
    One commit a verify, as lowprec's `ReplaySSM.commit`: without a pending verify it raises.

    accepted: an int, or an int32/int64 tensor [slots] on the cache's device, in [0, T].
    """
    if not isinstance(cache, ReplayCache):
        raise ValueError(f"cache: expected a ReplayCache, got {type(cache).__name__}")
    check_cache(cache)
    commit_drafts(cache, accepted, "mamba2_replay_verify")


def commit_drafts(cache, accepted, verify_name: str) -> None:
    """`cursors += accepted` after the checks every cache's commit shares (`cache` already
    checked; `verify_name` names the verify that must precede)."""
    T = cache.draft
    if T < 1:
        raise ValueError(f"cache.draft: expected T >= 1 for speculative decoding, got {T}")
    slots = cache.cursors.shape[0]
    device = cache.cursors.device
    if isinstance(accepted, bool) or not isinstance(accepted, (int, torch.Tensor)):
        raise ValueError(f"accepted: expected an int or an int tensor, got {accepted!r}")
    if isinstance(accepted, int):
        accepted = torch.full((slots,), accepted, dtype=torch.int32, device=device)
    _expect("accepted", accepted, (slots,), (torch.int32, torch.int64), device)
    if slots and (int(accepted.min()) < 0 or int(accepted.max()) > T):
        raise ValueError(f"accepted: expected values in [0, T={T}], got {accepted.tolist()}")
    if not cache.pending:
        raise ValueError(f"commit: expected a {verify_name} before each commit, got none "
                         "pending (a second commit would count stale ring entries as records)")
    if slots and int((cache.cursors + accepted).max()) > cache.window:
        raise ValueError(
            f"accepted: expected cursors + accepted <= L={cache.window} (a verify before each "
            f"commit), got cursors {cache.cursors.tolist()} + {accepted.tolist()}"
        )
    cache.cursors.add_(accepted.to(torch.int32))
    cache.pending = False
