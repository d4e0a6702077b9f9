"""Conventional Gated DeltaNet / KDA decode step in Triton: the state is stored every token.

The baseline that ReplaySSM is measured against (`lowprec.policies` kind 'conventional', the
experiments' `every_step` arm). One call advances every slot by one token:

    S = ROUND(S diag(a) + u k^T),  u = beta (v - S diag(a) k),  a = exp(g)
                                       (lowprec.gdn._delta_update's order, fp32 registers)
    y = S q                            from the stored (rounded) state, as lowprec.policies
                                       defines the conventional arm ('stored'), or from the
                                       unrounded one ('unrounded')

ROUND is any lowprec format but fp64, RN or SR; SR draws are `random_words(seed, slot,
tokens[slot], element, cache.sr_bits, cache.philox_rounds)`, the per-slot token counter in the
flush counter's place (as `lowprec.policies.Simulator` draws them), and the call increments
`tokens`. The cache is
`emulation.state_update.StateCache` ([slots, nheads, headdim = d_v, dstate = d_k]).
"""

# emulation.numerics comes first: without CUDA it switches Triton's interpreter on, which has to
# happen before triton is first imported.
from emulation.numerics import format_spec  # noqa: I001
import torch
import triton
import triton.language as tl

from emulation.gdn_replay_decode import delta_step, device_context, load_record
from emulation.replay_decode import (
    ACT_DTYPES,
    _expect,
    check_switch,
    launch_config,
    store_tile,
    tile_offsets,
)
from emulation.state_update import (
    OUTPUT_FROM,
    StateCache,
    check_state_cache,
    check_state_outputs,
)

__all__ = ["StateCache", "gdn_state_update", "kda_state_update"]


@triton.jit
def _gdn_state_update_kernel(
    p_state, p_scales, p_global, p_tokens,
    p_q, p_k, p_v, p_g, p_beta, p_y, p_debug,
    seed, nheads, dv, dk, n_blocks,
    PER_CHANNEL: tl.constexpr, F: tl.constexpr, USE_SR: tl.constexpr,
    SR_BITS: tl.constexpr, ROUNDS: tl.constexpr, HAS_DEBUG: tl.constexpr, READ_STORED: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, NC: tl.constexpr,
):
    i_h = tl.program_id(0)
    i_s = tl.program_id(1).to(tl.int64)
    i_sh = i_s * nheads + i_h
    token = tl.load(p_tokens + i_s)

    o_v, o_k, m_v, m_vk, o_vk = tile_offsets(dv, dk, BV, BK)  # [BV, BK] tile of the state

    b_k, b_v, b_g, beta = load_record(p_k, p_v, p_g, p_beta, i_sh, dv, dk, PER_CHANNEL,
                                      BV, BK, NC)
    b_q = tl.load(p_q + i_sh * dk + o_k, mask=o_k < dk, other=0.0).to(tl.float32)
    b_S = tl.load(p_state + i_sh * dv * dk + o_vk, mask=m_vk, other=0.0).to(tl.float32)
    b_S = delta_step(b_S, b_k, b_v, b_g, beta)
    b_st = store_tile(b_S, p_state + i_sh * dv * dk, p_scales + i_sh * dv * n_blocks,
                      p_global + i_sh, p_debug + i_sh * dv * dk, seed, i_s, i_h, token, dv, dk,
                      n_blocks, F, USE_SR, SR_BITS, ROUNDS, HAS_DEBUG, BV, BK)
    b_y = tl.sum((b_st if READ_STORED else b_S) * b_q[None, :], axis=1)  # [BV]
    tl.store(p_y + i_sh * dv + o_v, b_y.to(p_y.dtype.element_ty), mask=m_v)


def _state_update(cache, q, k, v, g, beta, output_from, out, debug_state, check_counters,
                  per_channel):
    check_state_cache(cache)
    check_switch("check_counters", check_counters)
    if output_from not in OUTPUT_FROM:
        raise ValueError(f"output_from: expected one of {OUTPUT_FROM}, got {output_from!r}")
    slots, nheads, dv, dk = cache.state.shape
    device = cache.state.device
    f32 = (torch.float32,)
    _expect("v", v, (slots, nheads, dv), ACT_DTYPES, device)
    act = (v.dtype,)
    _expect("q", q, (slots, nheads, dk), act, device)
    _expect("k", k, (slots, nheads, dk), act, device)
    _expect("g", g, (slots, nheads, dk) if per_channel else (slots, nheads), f32, device)
    _expect("beta", beta, (slots, nheads), f32, device)
    out = check_state_outputs(cache, dict(q=q, k=k, v=v, g=g, beta=beta), out, debug_state,
                              (slots, nheads, dv), v.dtype, check_counters)
    if slots == 0:
        return out
    cfg = launch_config(dv, dk, 1)
    del cfg["BL"]
    n_blocks = cache.scales.shape[-1] if cache.scales is not None else 1
    unused = cache.state
    with device_context(device):
        _gdn_state_update_kernel[(nheads, slots)](
            cache.state,
            cache.scales if cache.scales is not None else unused,
            cache.global_scale if cache.global_scale is not None else unused,
            cache.tokens,
            q, k, v, g, beta, out, debug_state if debug_state is not None else unused,
            cache.seed, nheads, dv, dk, n_blocks,
            PER_CHANNEL=per_channel, F=format_spec(cache.format), USE_SR=cache.rounding == "sr",
            SR_BITS=cache.sr_bits, ROUNDS=cache.philox_rounds,
            HAS_DEBUG=debug_state is not None, READ_STORED=output_from == "stored",
            NC=cfg["BK"] if per_channel else 1, **cfg,
        )
        cache.tokens.add_(1)
    return out


def gdn_state_update(
    cache: StateCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    output_from: str = "stored",
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
    check_counters: bool = True,
) -> torch.Tensor:
    """One conventional GDN decode step of every slot (module docstring); returns y.

    `cache.state [slots, nheads, dv, dk]`; q, k [slots, nheads, dk] and v [slots, nheads, dv]
    in one activation dtype (fp32, fp16 or bf16); g (log-decay), beta [slots, nheads] fp32.
    `out` [slots, nheads, dv] (default v's dtype); `debug_state` fp32 receives the unrounded
    new state; `output_from` 'stored' or 'unrounded'. `check_counters=False` skips the range
    check of `cache.tokens` (a stream sync). Launches on the current stream."""
    return _state_update(cache, q, k, v, g, beta, output_from, out, debug_state,
                         check_counters, False)


def kda_state_update(
    cache: StateCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    output_from: str = "stored",
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
    check_counters: bool = True,
) -> torch.Tensor:
    """`gdn_state_update` for KDA: g [slots, nheads, dk] fp32, the log-decay per channel."""
    return _state_update(cache, q, k, v, g, beta, output_from, out, debug_state,
                         check_counters, True)
