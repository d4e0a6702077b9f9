"""ReplaySSM standard decode for Gated DeltaNet and KDA in Triton, copies emulated in fp32.

The state follows `lowprec.gdn`: `S [d_v, d_k]` per (slot, head), `y = S q`, and

    S_t = S_{t-1} diag(a_t) + u_t k_t^T,   u_t = beta_t (v_t - S_{t-1} diag(a_t) k_t)

with `a_t = exp(g_t)`: one log-decay per head for GDN, one per channel of d_k for KDA (the
same kernels, `PER_CHANNEL` a compile-time flag). One call of `gdn_replay_decode` /
`kda_replay_decode` advances every slot by one token, each at its own ring position
`c = cursors[s]` (records 0..c-1 in the ring, record c the inputs):

    non-flush (c < L-1)  one pass over the read copy S_lo forms both products
                         S_lo (G_c k_c) and S_lo (G_c q_c), G_c = exp(g_0 + ... + g_c);
                         u_c = beta_c (v_c - [S_lo G_c k_c + sum_{j<c} u_j (k_j G_{j+1:c}) . k_c])
                         y   = S_lo G_c q_c + sum_{j<=c} u_j (k_j G_{j+1:c}) . q_c
                         the record (u_c, v_c, k_c, g_c, beta_c) goes to ring position c; no
                         state is formed or written
    flush     (c = L-1)  S = S_hi; for j = 0..L-1: S <- S diag(a_j); u = beta_j (v_j - S k_j);
                         S <- S + u k_j^T   (every u recomputed from the recurrence copy and
                         the raw v: the cached u, which read the read copy, are not trusted)
                         y = S_new q;  hi <- ROUND_hi(S_new) (SR draws random_words(seed, s,
                         flushes[s], element, sr_bits, philox_rounds), as the Mamba-2
                         path), lo <- RN_lo(S_new) in any
                         lowprec format but fp64; cursors[s] = 0, flushes[s] += 1

`G_{i:c} = exp(cum_c - cum_{i-1})` from cumulative sums of the log-decays, the order of
operations of `lowprec.gdn._read`; the flush is `lowprec.gdn._delta_update` step by step. The
kernels differ from lowprec only in the order of the sums inside a reduction (over d_k, or the
ring); the stored words are lowprec's rounding of the kernel's fp32 S_new, bit for bit
(`Policy.write_copies`, `quantize`).

Output bound against the FP64 reference on the same cache (u = 2^-24; Higham's
|fl(sum) - sum| <= gamma_n sum |terms|, gamma_n = n u / (1 - n u)):

- non-flush: every term of u_c and y is a product of a checkpoint or ring value, a key or
  query, and one decay exp(cum_c - cum_j). The cumulative sums carry an absolute error of at
  most 2 gamma_L Gamma, Gamma = sum_{l<=c} |g_l| (per channel for KDA), and exp adds a few u, so
  each decay is within (2 L Gamma + 4) u relative; the products and the sums over d_k and the
  ring add (d_k + L + 4) u. Hence
        |err u_c| <= beta_c e M_u + u |u_c|,    |err y| <= e M_y + |k_c . q| |err u_c|,
        e = (d_k + L + 8 + 2 (L + 1) Gamma) u,
  with M_u, M_y the same replay evaluated on absolute values (|S_lo|, |u_j|, |k|, |q|, decays).
- flush: step j's rounding errors are at most (d_k + 8) u M_j elementwise, where
  M_0 = |S_hi|, M_j = (M_{j-1} diag(a_j)) (I + beta_j |k_j| |k_j|^T) + beta_j |v_j| |k_j|^T
  bounds every term of S_j; an error E maps through the step to at most E diag(a_j)
  (I + beta_j |k_j||k_j|^T), the map that carries M, so the errors of the L steps sum to
        |err S_new| <= L (d_k + 8) u M_L,   |err y| <= (L (d_k + 8) + d_k) u M_L |q|.
  (`output_bound_flush` / `output_bound_window` compute both in fp64; the tests hold the
  kernels to them, and check the bound is not vacuous.)

Containers as `replay_decode.ReplayCache`: `lo` holds the dequantised read copy, `lo_scales`
its block scales, `lo_global` nvfp4's second-level scale; `hi` fp32 or the format's dtype.

Two launches on the current stream, so that no program reads what another writes:

    _gdn_replay_decode_kernel   grid (nheads, slots): reads the copies and the ring, writes y,
                                the current record's u (non-flush rows), the copies (flush rows)
    _gdn_append_kernel          grid (slots,): appends v, k, g, beta to the ring and moves
                                `cursors` / `flushes` (shared with the speculative verify)
"""

# emulation.numerics comes first: without CUDA it switches Triton's interpreter on, which has to
# happen before triton is first imported.
from emulation.numerics import check_kernel_format, format_spec  # noqa: I001
import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from emulation.replay_decode import (
    ACT_DTYPES,
    _expect,
    check_copies,
    check_counters_apart,
    check_empty_args,
    check_inputs_apart,
    check_outputs,
    check_switch,
    empty_fields,
    launch_config,
    store_copies,
    tile_offsets,
)
from lowprec import philox
from lowprec.replay import check_counter_ranges

__all__ = [
    "GDNReplayCache",
    "gdn_replay_decode",
    "kda_replay_decode",
    "gdn_generic_step",
    "kda_generic_step",
    "output_bound_window",
    "output_bound_flush",
]

U32 = 2.0**-24


# --------------------------------------------------------------------------------------------
# config


@dataclass
class GDNReplayCache:
    """The ReplaySSM cache of a batch of GDN or KDA slots, in emulation containers.

    Tensors (all on one device, contiguous; the state as `lowprec.gdn`, [d_v, d_k]):
        hi         fp32 (or hi_format's dtype)  [slots, nheads, dv, dk]  recurrence copy
        lo         fp32                         [slots, nheads, dv, dk]  read copy
        lo_scales  fp32 [slots, nheads, dv, dk // block]   block formats, else None
        lo_global  fp32 [slots, nheads]                     nvfp4, else None
        ring_u     fp32      [slots, nheads, Lcap, dv]   u of each record (read-copy based)
        ring_v     act dtype [slots, nheads, Lcap, dv]   raw v (the flush recomputes u from it)
        ring_k     act dtype [slots, nheads, Lcap, dk]
        ring_g     fp32      [slots, nheads, Lcap]        log-decay (KDA: [.., Lcap, dk])
        ring_beta  fp32      [slots, nheads, Lcap]
        cursors    int32 [slots]   records held before this step (committed records, h)
        flushes    int32 [slots]   checkpoint writes so far (the Philox flush counter)

    Config: `hi_format` / `hi_rounding`, `lo_format` (RN), `window` L, `draft` T (speculative
    decoding; Lcap = L + T), Philox `seed`, `per_channel` (True: KDA's decay per channel), and
    SR's `sr_bits` (8, 13, 16, 32) and `philox_rounds` (1..10), the defaults (16, 7) for an RN copy.
    """

    hi: torch.Tensor
    lo: torch.Tensor
    lo_scales: torch.Tensor | None
    lo_global: torch.Tensor | None
    ring_u: torch.Tensor
    ring_v: torch.Tensor
    ring_k: torch.Tensor
    ring_g: torch.Tensor
    ring_beta: torch.Tensor
    cursors: torch.Tensor
    flushes: torch.Tensor
    hi_format: str = "fp16"
    hi_rounding: str = "sr"
    lo_format: str = "nvfp4"
    window: int = 16
    draft: int = 0
    seed: int = 0
    per_channel: bool = False
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS
    # speculative decoding (host side): a verify awaits its commit
    pending: bool = False

    @classmethod
    def empty(
        cls,
        slots: int,
        nheads: int,
        dv: int,
        dk: int,
        *,
        per_channel: bool = False,
        window: int = 16,
        draft: int = 0,
        hi_format: str = "fp16",
        hi_rounding: str = "sr",
        lo_format: str = "nvfp4",
        seed: int = 0,
        hi_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.float32,
        device=None,
        sr_bits: int = philox.DEFAULT_SR_BITS,
        philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
    ) -> "GDNReplayCache":
        """A cache at the zero state with empty rings (ring entries NaN, so that a read of an
        unwritten record shows)."""
        check_switch("per_channel", per_channel)
        sr_bits, philox_rounds = check_empty_args(
            (("slots", slots, 0), ("nheads", nheads, 1), ("dv", dv, 1), ("dk", dk, 1),
             ("window", window, 1), ("draft", draft, 0)), hi_rounding, sr_bits, philox_rounds,
            act_dtype)
        shared = empty_fields(slots, nheads, dv, dk, hi_dtype, device, hi_format=hi_format,
                              hi_rounding=hi_rounding, lo_format=lo_format, window=window,
                              draft=draft, seed=seed, sr_bits=sr_bits,
                              philox_rounds=philox_rounds)
        lcap = window + draft
        f32 = dict(dtype=torch.float32, device=device)
        act = dict(dtype=act_dtype, device=device)
        nan = float("nan")
        decay = (slots, nheads, lcap, dk) if per_channel else (slots, nheads, lcap)
        cache = cls(
            ring_u=torch.full((slots, nheads, lcap, dv), nan, **f32),
            ring_v=torch.full((slots, nheads, lcap, dv), nan, **act),
            ring_k=torch.full((slots, nheads, lcap, dk), nan, **act),
            ring_g=torch.full(decay, nan, **f32),
            ring_beta=torch.full((slots, nheads, lcap), nan, **f32),
            per_channel=per_channel,
            **shared,
        )
        check_gdn_cache(cache)
        return cache

    @property
    def shape(self):
        """(slots, nheads, dv, dk, Lcap)."""
        slots, nheads, dv, dk = self.hi.shape
        return slots, nheads, dv, dk, self.ring_v.shape[2]


def check_gdn_cache(cache: GDNReplayCache, per_channel: bool | None = None) -> None:
    """ValueError unless every tensor of `cache` has the layout of its docstring (and, if
    given, `cache.per_channel` is `per_channel`: a GDN call refuses a KDA cache)."""
    if not isinstance(cache, GDNReplayCache):
        raise ValueError(f"cache: expected a GDNReplayCache, got {type(cache).__name__}")
    check_switch("cache.per_channel", cache.per_channel)
    if per_channel is not None and cache.per_channel != per_channel:
        which = "KDA (per-channel decay)" if cache.per_channel else "GDN (per-head decay)"
        call = "kda_*" if cache.per_channel else "gdn_*"
        raise ValueError(f"cache.per_channel: expected {per_channel} for this call, got "
                         f"{cache.per_channel} (a {which} cache: use {call})")
    slots, nheads, dv, dk, device = check_copies(cache, "dv", "dk")
    lcap = cache.window + cache.draft
    rv = cache.ring_v
    if not isinstance(rv, torch.Tensor):
        raise ValueError(f"cache.ring_v: expected a tensor, got {type(rv).__name__}")
    _expect("cache.ring_v", rv, (slots, nheads, lcap, dv), ACT_DTYPES, device)
    _expect("cache.ring_k", cache.ring_k, (slots, nheads, lcap, dk), (rv.dtype,), device)
    _expect("cache.ring_u", cache.ring_u, (slots, nheads, lcap, dv), (torch.float32,), device)
    decay = (slots, nheads, lcap, dk) if cache.per_channel else (slots, nheads, lcap)
    _expect("cache.ring_g", cache.ring_g, decay, (torch.float32,), device)
    _expect("cache.ring_beta", cache.ring_beta, (slots, nheads, lcap), (torch.float32,), device)
    check_counters_apart(cache, slots, device)


def check_gdn_inputs(cache, q, k, v, g, beta, ndraft=None):
    """ValueError unless the token inputs match the (checked) cache: q, k [slots, nheads, dk]
    and v [slots, nheads, dv] in the ring's activation dtype, g [slots, nheads] (KDA:
    [slots, nheads, dk]) and beta [slots, nheads] in fp32 (`ndraft`: a T dim after heads), none
    sharing memory with the cache."""
    slots, nheads, dv, dk, _ = cache.shape
    device = cache.hi.device
    act = (cache.ring_v.dtype,)
    f32 = (torch.float32,)
    t = () if ndraft is None else (ndraft,)
    _expect("q", q, (slots, nheads, *t, dk), act, device)
    _expect("k", k, (slots, nheads, *t, dk), act, device)
    _expect("v", v, (slots, nheads, *t, dv), act, device)
    _expect("g", g, (slots, nheads, *t, dk) if cache.per_channel else (slots, nheads, *t), f32,
            device)
    _expect("beta", beta, (slots, nheads, *t), f32, device)
    check_inputs_apart(cache, q=q, k=k, v=v, g=g, beta=beta)


def gdn_launch_config(cache) -> dict:
    _, _, dv, dk, lcap = cache.shape
    cfg = launch_config(dv, dk, lcap)
    cfg["NC"] = cfg["BK"] if cache.per_channel else 1
    return cfg


# --------------------------------------------------------------------------------------------
# device functions shared with gdn_replay_spec.py


@triton.jit
def load_record(p_k, p_v, p_g, p_beta, row, dv, dk, PER_CHANNEL: tl.constexpr,
                BV: tl.constexpr, BK: tl.constexpr, NC: tl.constexpr):
    """Record `row` of [rows, dk] keys, [rows, dv] values, [rows] (KDA [rows, dk]) log-decays
    and [rows] betas, in fp32: `(b_k [BK], b_v [BV], b_g [NC], beta)` (padding 0)."""
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    b_k = tl.load(p_k + row * dk + o_k, mask=o_k < dk, other=0.0).to(tl.float32)
    b_v = tl.load(p_v + row * dv + o_v, mask=o_v < dv, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        b_g = tl.load(p_g + row * dk + o_k, mask=o_k < dk, other=0.0)
    else:
        b_g = tl.load(p_g + row + tl.arange(0, NC))
    beta = tl.load(p_beta + row)
    return b_k, b_v, b_g, beta


@triton.jit
def delta_step(b_S, b_k, b_v, b_g, beta):
    """One delta-rule update of `b_S [BV, BK]` (lowprec.gdn._delta_update's order):
    S <- S diag(exp(g)); u = beta (v - S k); S <- S + u k^T."""
    b_S = b_S * tl.exp(b_g)[None, :]
    b_u = beta * (b_v - tl.sum(b_S * b_k[None, :], axis=1))  # [BV]
    return b_S + b_u[:, None] * b_k[None, :]


@triton.jit
def fold_ring(b_S, p_rk, p_rv, p_rg, p_rbeta, n, n_max: tl.constexpr, dv, dk,
              PER_CHANNEL: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, NC: tl.constexpr):
    """Fold ring records 0..n-1 (pointers at the (slot, head) ring bases) into `b_S`, every u
    recomputed from the raw v. The loop runs to the compile-time `n_max >= n` (records past n
    are read from the ring, which holds at least n_max rows, and discarded)."""
    for j in range(0, n_max):
        b_kj, b_vj, b_gj, beta_j = load_record(p_rk, p_rv, p_rg, p_rbeta, j, dv, dk,
                                               PER_CHANNEL, BV, BK, NC)
        b_S = tl.where(j < n, delta_step(b_S, b_kj, b_vj, b_gj, beta_j), b_S)
    return b_S


@triton.jit
def replay_record(b_base, b_U, b_K, b_G, p, b_k, b_v, b_g, beta, b_q, BL: tl.constexpr):
    """u and y of the record at ring position `p` from a checkpoint `b_base [BV, BK]` and the
    records before it (`b_U [BL, BV]`, `b_K [BL, BK]`, `b_G [BL, NC]`; rows >= p are ignored),
    with `lowprec.gdn._read`'s order of operations. Returns `(b_u [BV], b_U, b_K, b_G, b_y)`
    with record p written into the three row blocks."""
    o_l = tl.arange(0, BL)
    is_p = (o_l == p)[:, None]
    b_K = tl.where(is_p, b_k[None, :], b_K)
    b_G = tl.where(is_p, b_g[None, :], b_G)
    m_held = (o_l <= p)[:, None]
    b_cum = tl.cumsum(tl.where(m_held, b_G, 0.0), axis=0)  # [BL, NC]
    cum_p = tl.sum(tl.where(is_p, b_cum, 0.0), axis=0)  # [NC]: cum at p, as lowprec gathers it
    b_KW = tl.where(m_held, b_K * tl.exp(cum_p[None, :] - b_cum), 0.0)  # k_j G_{j+1:p} [BL, BK]
    g_p = tl.exp(cum_p)  # G_{0:p} [NC]
    # one pass over the checkpoint, two products
    b_Sk = tl.sum(b_base * (g_p * b_k)[None, :], axis=1)  # [BV]
    b_Sq = tl.sum(b_base * (g_p * b_q)[None, :], axis=1)  # [BV]
    b_kk = tl.sum(b_KW * b_k[None, :], axis=1)  # [BL]
    b_before = tl.where((o_l < p)[:, None], b_U, 0.0)
    b_u = beta * (b_v - (b_Sk + tl.sum(b_before * b_kk[:, None], axis=0)))
    b_U = tl.where(is_p, b_u[None, :], b_U)
    b_kq = tl.sum(b_KW * b_q[None, :], axis=1)  # [BL]
    b_y = b_Sq + tl.sum(tl.where(m_held, b_U, 0.0) * b_kq[:, None], axis=0)
    return b_u, b_U, b_K, b_G, b_y


@triton.jit
def load_ring(p_ru, p_rk, p_rg, n, lcap, dv, dk, PER_CHANNEL: tl.constexpr,
              BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr, NC: tl.constexpr):
    """Ring rows 0..n-1 (and < lcap) of u, k and the log-decays in fp32, zeros past them:
    `(b_U [BL, BV], b_K [BL, BK], b_G [BL, NC])`."""
    o_l = tl.arange(0, BL)
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_l = (o_l < n) & (o_l < lcap)
    b_U = tl.load(p_ru + o_l[:, None] * dv + o_v[None, :],
                  mask=m_l[:, None] & (o_v[None, :] < dv), other=0.0)
    b_K = tl.load(p_rk + o_l[:, None] * dk + o_k[None, :],
                  mask=m_l[:, None] & (o_k[None, :] < dk), other=0.0).to(tl.float32)
    if PER_CHANNEL:
        b_G = tl.load(p_rg + o_l[:, None] * dk + o_k[None, :],
                      mask=m_l[:, None] & (o_k[None, :] < dk), other=0.0)
    else:
        b_G = tl.load(p_rg + o_l[:, None] + tl.arange(0, NC)[None, :], mask=m_l[:, None],
                      other=0.0)
    return b_U, b_K, b_G


@triton.jit
def program_bases(p_cursors, p_flushes, p_ring_u, p_ring_v, p_ring_k, p_ring_g, p_ring_beta,
                  nheads, dv, dk, lcap, PER_CHANNEL: tl.constexpr):
    """The (nheads, slots) grid's program: `(i_s, i_h, i_sh, cursor, flush, p_ru, p_rv, p_rk,
    p_rg, p_rbeta)`, its slot, head and (slot, head) row, the slot's cursor and flush counter,
    and the row's bases of the five rings."""
    i_h = tl.program_id(0)
    i_s = tl.program_id(1).to(tl.int64)
    i_sh = i_s * nheads + i_h
    nc = dk if PER_CHANNEL else 1
    return (i_s, i_h, i_sh, tl.load(p_cursors + i_s), tl.load(p_flushes + i_s),
            p_ring_u + i_sh * lcap * dv, p_ring_v + i_sh * lcap * dv,
            p_ring_k + i_sh * lcap * dk, p_ring_g + i_sh * lcap * nc, p_ring_beta + i_sh * lcap)


# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _gdn_replay_decode_kernel(
    p_hi, p_lo, p_lo_scales, p_lo_global,
    p_ring_u, p_ring_v, p_ring_k, p_ring_g, p_ring_beta, p_cursors, p_flushes,
    p_q, p_k, p_v, p_g, p_beta, p_y, p_debug,
    seed, nheads, dv, dk, lcap, n_blocks,
    WINDOW: tl.constexpr, PER_CHANNEL: tl.constexpr, HI: tl.constexpr, HI_SR: tl.constexpr,
    SR_BITS: tl.constexpr, ROUNDS: tl.constexpr, LO: tl.constexpr, HAS_DEBUG: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr, NC: tl.constexpr,
):
    # cursor: this record's ring position
    i_s, i_h, i_sh, cursor, flush, p_ru, p_rv, p_rk, p_rg, p_rbeta = program_bases(
        p_cursors, p_flushes, p_ring_u, p_ring_v, p_ring_k, p_ring_g, p_ring_beta,
        nheads, dv, dk, lcap, PER_CHANNEL)

    o_v, o_k, m_v, m_vk, o_vk = tile_offsets(dv, dk, BV, BK)  # [BV, BK] tile of the state
    p_state = i_sh * dv * dk

    # the current record and query, in fp32
    b_k, b_v, b_g, beta = load_record(p_k, p_v, p_g, p_beta, i_sh, dv, dk, PER_CHANNEL,
                                      BV, BK, NC)
    b_q = tl.load(p_q + i_sh * dk + o_k, mask=o_k < dk, other=0.0).to(tl.float32)  # [BK]

    if cursor == WINDOW - 1:
        # flush: fold the L records into the recurrence copy, u recomputed from raw v
        b_S = tl.load(p_hi + p_state + o_vk, mask=m_vk, other=0.0).to(tl.float32)
        b_S = fold_ring(b_S, p_rk, p_rv, p_rg, p_rbeta, WINDOW - 1, WINDOW - 1, dv, dk,
                        PER_CHANNEL, BV, BK, NC)
        b_S = delta_step(b_S, b_k, b_v, b_g, beta)
        b_y = tl.sum(b_S * b_q[None, :], axis=1)  # [BV], from the unrounded new state
        store_copies(b_S, p_hi, p_lo, p_lo_scales, p_lo_global, p_debug, i_sh, seed, i_s, i_h,
                     flush, dv, dk, n_blocks, HI, HI_SR, SR_BITS, ROUNDS, LO, HAS_DEBUG, BV, BK)
    else:
        # non-flush: the read copy and the ring's cached u, no state
        b_lo = tl.load(p_lo + p_state + o_vk, mask=m_vk, other=0.0)
        b_U, b_K, b_G = load_ring(p_ru, p_rk, p_rg, cursor, lcap, dv, dk, PER_CHANNEL,
                                  BV, BK, BL, NC)
        b_u, b_U, b_K, b_G, b_y = replay_record(b_lo, b_U, b_K, b_G, cursor, b_k, b_v, b_g,
                                                beta, b_q, BL)
        in_ring = (cursor >= 0) & (cursor < lcap)  # check_counters=False: stay in the ring
        tl.store(p_ru + cursor * dv + o_v, b_u, mask=m_v & in_ring)
    tl.store(p_y + i_sh * dv + o_v, b_y.to(p_y.dtype.element_ty), mask=m_v)


@triton.jit
def _gdn_append_kernel(
    p_ring_v, p_ring_k, p_ring_g, p_ring_beta, p_cursors, p_flushes,
    p_k, p_v, p_g, p_beta,
    nheads, dv, dk, lcap, window,
    T: tl.constexpr, IS_VERIFY: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BH: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
):
    """Append slot i_s's T records (v, k, g, beta; u is written by the decode or verify
    kernel) and move its counters. Decode (T = 1): at position cursor, then the cursor moves
    on, back to 0 on a flush (cursor = L-1). Verify: the flush is h + T > L; the drafts go
    behind the h committed records, or to 0 after a flush, and the cursor stays at the
    committed records (the commit moves it)."""
    i_s = tl.program_id(0).to(tl.int64)
    cursor = tl.load(p_cursors + i_s)
    if IS_VERIFY:
        is_flush = cursor + T > window
        start = tl.where(is_flush, 0, cursor)
        new_cursor = start
    else:
        is_flush = cursor == window - 1
        start = cursor
        new_cursor = tl.where(is_flush, 0, cursor + 1)
    o_h = tl.arange(0, BH)
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_h = o_h < nheads
    m_hv = m_h[:, None] & (o_v[None, :] < dv)
    m_hk = m_h[:, None] & (o_k[None, :] < dk)
    row = (i_s * nheads + o_h) * T  # [BH] input rows of draft 0
    for t in tl.static_range(T):
        pos = start + t
        in_ring = (pos >= 0) & (pos < lcap)  # check_counters=False: stores stay in the ring
        ring_row = (i_s * nheads + o_h) * lcap + pos  # [BH]
        b_v = tl.load(p_v + (row + t)[:, None] * dv + o_v[None, :], mask=m_hv)
        tl.store(p_ring_v + ring_row[:, None] * dv + o_v[None, :], b_v, mask=m_hv & in_ring)
        b_k = tl.load(p_k + (row + t)[:, None] * dk + o_k[None, :], mask=m_hk)
        tl.store(p_ring_k + ring_row[:, None] * dk + o_k[None, :], b_k, mask=m_hk & in_ring)
        if PER_CHANNEL:
            b_g = tl.load(p_g + (row + t)[:, None] * dk + o_k[None, :], mask=m_hk)
            tl.store(p_ring_g + ring_row[:, None] * dk + o_k[None, :], b_g,
                     mask=m_hk & in_ring)
        else:
            b_g = tl.load(p_g + row + t, mask=m_h)
            tl.store(p_ring_g + ring_row, b_g, mask=m_h & in_ring)
        b_beta = tl.load(p_beta + row + t, mask=m_h)
        tl.store(p_ring_beta + ring_row, b_beta, mask=m_h & in_ring)
    tl.store(p_cursors + i_s, new_cursor)
    tl.store(p_flushes + i_s, tl.load(p_flushes + i_s) + is_flush.to(tl.int32))


def launch_append(cache, k, v, g, beta, T, is_verify):
    slots, nheads, dv, dk, lcap = cache.shape
    _gdn_append_kernel[(slots,)](
        cache.ring_v, cache.ring_k, cache.ring_g, cache.ring_beta, cache.cursors, cache.flushes,
        k, v, g, beta,
        nheads, dv, dk, lcap, cache.window,
        T=T, IS_VERIFY=is_verify, PER_CHANNEL=cache.per_channel,
        BH=triton.next_power_of_2(nheads), BV=triton.next_power_of_2(dv),
        BK=triton.next_power_of_2(dk),
    )


def run_replay(kernel, cache, q, k, v, g, beta, out, debug_state, per_channel, is_verify,
               check_counters=True):
    """One decode (`is_verify` False: one token) or verify (T = cache.draft tokens) call: the
    checks, then `kernel` over (nheads, slots) and the append; returns y."""
    check_gdn_cache(cache, per_channel)
    T = cache.draft
    if is_verify and T < 1:
        raise ValueError(f"cache.draft: expected T >= 1 for speculative decoding, got {T}")
    if not is_verify and T != 0:
        raise ValueError(f"cache.draft: expected 0 for standard decoding, got {T} "
                         f"(use gdn_replay_spec)")
    check_gdn_inputs(cache, q, k, v, g, beta, ndraft=T if is_verify else None)
    check_switch("check_counters", check_counters)
    slots, nheads, dv, dk, lcap = cache.shape
    if check_counters:  # a verify flushes a full ring (h = L) first; a decode appends to it
        check_counter_ranges(cache.cursors, cache.flushes, 0,
                             cache.window if is_verify else cache.window - 1, "ring capacity",
                             "cache.")
    y_shape = (slots, nheads, T, dv) if is_verify else (slots, nheads, dv)
    out = check_outputs(cache, out, debug_state, dict(q=q, k=k, v=v, g=g, beta=beta), y_shape,
                        v.dtype)
    if is_verify:
        cache.pending = True  # the inputs are good: this verify awaits its commit
    if slots == 0:
        return out
    n_blocks = cache.lo_scales.shape[-1] if cache.lo_scales is not None else 1
    unused = cache.lo  # stands in for absent optional tensors (never read: flags are off)
    draft = dict(T=T) if is_verify else {}
    with device_context(cache.hi.device):
        kernel[(nheads, slots)](
            cache.hi, cache.lo,
            cache.lo_scales if cache.lo_scales is not None else unused,
            cache.lo_global if cache.lo_global is not None else unused,
            cache.ring_u, cache.ring_v, cache.ring_k, cache.ring_g, cache.ring_beta,
            cache.cursors, cache.flushes,
            q, k, v, g, beta, out, debug_state if debug_state is not None else unused,
            cache.seed, nheads, dv, dk, lcap, n_blocks,
            WINDOW=cache.window, PER_CHANNEL=cache.per_channel, HI=format_spec(cache.hi_format),
            HI_SR=cache.hi_rounding == "sr", SR_BITS=cache.sr_bits,
            ROUNDS=cache.philox_rounds,
            LO=format_spec(check_kernel_format("cache.lo_format", cache.lo_format)),
            HAS_DEBUG=debug_state is not None, **draft, **gdn_launch_config(cache),
        )
        launch_append(cache, k, v, g, beta, T if is_verify else 1, is_verify)
    return out


def device_context(device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# public functions


def gdn_replay_decode(
    cache: GDNReplayCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
    check_counters: bool = True,
) -> torch.Tensor:
    """Advance every slot of a GDN `cache` by one token (module docstring); returns y.

    Arguments in `lowprec.gdn.gdn_step`'s order: q, k [slots, nheads, dk] and v
    [slots, nheads, dv] in the ring's activation dtype; g (log-decay) and beta [slots, nheads]
    in fp32. `out` [slots, nheads, dv] (fp32, fp16 or bf16; default v's dtype). `debug_state`
    fp32 [slots, nheads, dv, dk] receives the unrounded new state at flush rows and is
    untouched elsewhere. `check_counters=False` skips the range check of the cursors and flush
    counters (a stream sync) for a loop that keeps them in range by construction; every ring
    access stays within its slot's ring regardless. No input, `out` or `debug_state` may share
    memory with the cache or each other's outputs. Launches on the current stream.
    """
    return run_replay(_gdn_replay_decode_kernel, cache, q, k, v, g, beta, out, debug_state,
                      False, False, check_counters)


def kda_replay_decode(
    cache: GDNReplayCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
    check_counters: bool = True,
) -> torch.Tensor:
    """`gdn_replay_decode` for KDA (`cache.per_channel` True): g [slots, nheads, dk] fp32, the
    log-decay per channel of d_k (`lowprec.kda.kda_step`'s arguments)."""
    return run_replay(_gdn_replay_decode_kernel, cache, q, k, v, g, beta, out, debug_state,
                      True, False, check_counters)


# --------------------------------------------------------------------------------------------
# driving a batch from the generic inputs of lowprec.policies


def generic_kernel_inputs(a, v, k, q, beta, per_channel: bool, dtype=torch.float32):
    """`(q, k, v, g, beta)` of the GDN/KDA kernels for `lowprec.policies`' generic inputs
    (decay `a [b, h]` (KDA `[b, h, dk]`) in (0, 1], `v [b, h, dv]`, `k, q [b, h, dk]`,
    `beta [b, h]`, any float dtype): g = log(a) taken before the cast to fp32 (exp(g) is a to
    a few units of 2^-24), q, k, v in `dtype`, contiguous."""
    expected = 3 if per_channel else 2
    if not isinstance(a, torch.Tensor) or a.dim() != expected:
        got = list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
        layout = "[b, h, dk]" if per_channel else "[b, h]"
        raise ValueError(f"a: expected a decay tensor {layout}, got {got}")
    g = torch.log(a).to(torch.float32).contiguous()
    return (q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous(), g,
            beta.to(torch.float32).contiguous())


def _generic_step(cache, a, v, k, q, beta, check_counters, per_channel):
    # Imported here: state_update imports this module's neighbours, not the other way round.
    from emulation.gdn_state_update import StateCache, gdn_state_update, kda_state_update

    q, k, v, g, beta = generic_kernel_inputs(a, v, k, q, beta, per_channel)
    if isinstance(cache, StateCache):
        update = kda_state_update if per_channel else gdn_state_update
        return update(cache, q, k, v, g, beta, output_from="stored",
                      check_counters=check_counters)
    decode = kda_replay_decode if per_channel else gdn_replay_decode
    return decode(cache, q, k, v, g, beta, check_counters=check_counters)


def gdn_generic_step(cache, a, v, k, q, beta, *, check_counters: bool = True) -> torch.Tensor:
    """Advance a whole batch one GDN token through the emulation from `lowprec.policies`'
    generic inputs `(a, v, k, q, beta)` (the Simulator's step signature; `a [b, h]` the decay):
    `cache` a `GDNReplayCache` (the windowed arms: its hi/lo formats are the arm's copies) or
    an `emulation.state_update.StateCache` (every_step: the state in the arm's format, the
    output read from the stored state). Returns y [b, h, dv] in fp32."""
    return _generic_step(cache, a, v, k, q, beta, check_counters, False)


def kda_generic_step(cache, a, v, k, q, beta, *, check_counters: bool = True) -> torch.Tensor:
    """`gdn_generic_step` for KDA: `a [b, h, dk]`, the cache per-channel."""
    return _generic_step(cache, a, v, k, q, beta, check_counters, True)


# --------------------------------------------------------------------------------------------
# the fp32 bounds of the module docstring, evaluated in fp64


def _decay_matrix(ring_g, count, per_channel):
    """`exp(cum_p - cum_j)` for j <= p = count - 1 (0 elsewhere) [b, h, Lcap, c], G_{0:p}
    [b, h, c] and Gamma = sum_{j<=p} |g_j| [b, h, c]."""
    g = ring_g if per_channel else ring_g[..., None]
    lcap = g.shape[2]
    held = (torch.arange(lcap)[None, :] < count[:, None])[:, None, :, None]
    g = torch.where(held, g, 0.0)
    cum = torch.cumsum(g, dim=2)
    cum_p = cum.gather(2, (count - 1).clamp(min=0).view(-1, 1, 1, 1).expand(
        -1, g.shape[1], 1, g.shape[3]))
    return (torch.where(held, torch.exp(cum_p - cum), 0.0), torch.exp(cum_p[:, :, 0]),
            g.abs().sum(dim=2))


def output_bound_window(ckpt, ring_u, ring_v, ring_k, ring_g, ring_beta, count, q,
                        per_channel):
    """Bounds `(u_bound [b, h, dv], y_bound [b, h, dv])` of a non-flush step's u and y at ring
    position `count - 1` (its record in the ring, the u before it cached), fp64 inputs."""
    b, h, lcap, dv = ring_u.shape
    dk = ring_k.shape[-1]
    W, G, gamma = _decay_matrix(ring_g, count, per_channel)  # [b, h, L, c], [b, h, c], [b, h, c]
    e = (dk + lcap + 8 + 2 * (lcap + 1) * gamma.amax(dim=-1)) * U32  # [b, h]
    p = (count - 1).clamp(min=0)
    idx = p.view(-1, 1, 1, 1)
    k_c = ring_k.gather(2, idx.expand(-1, h, 1, dk))[:, :, 0]
    v_c = ring_v.gather(2, idx.expand(-1, h, 1, dv))[:, :, 0]
    beta_c = ring_beta.gather(2, p.view(-1, 1, 1).expand(-1, h, 1))[:, :, 0]
    before = (torch.arange(lcap)[None, :] < p[:, None])[:, None, :, None]
    upto = (torch.arange(lcap)[None, :] <= p[:, None])[:, None, :, None]
    KW = torch.where(upto, ring_k.abs(), 0.0) * W  # [b, h, L, dk] (past p: NaN in the ring)
    m_u = torch.einsum("bhvk,bhk->bhv", ckpt.abs(), G * k_c.abs()) + (
        torch.where(before, ring_u.abs(), 0.0) * (KW @ k_c.abs()[..., None])).sum(dim=2)
    u_c = ring_u.gather(2, idx.expand(-1, h, 1, dv))[:, :, 0]
    u_bound = beta_c[..., None] * (e[..., None] * (v_c.abs() + m_u)) + U32 * u_c.abs()
    m_y = torch.einsum("bhvk,bhk->bhv", ckpt.abs(), G * q.abs()) + (
        torch.where(upto, ring_u.abs(), 0.0) * (KW @ q.abs()[..., None])).sum(dim=2)
    kq = (k_c * q).sum(dim=-1).abs()
    return u_bound, e[..., None] * m_y + kq[..., None] * u_bound


def output_bound_flush(ckpt, ring_v, ring_k, ring_g, ring_beta, count, q, per_channel):
    """Bounds `(S_bound [b, h, dv, dk], y_bound [b, h, dv])` of a flush folding `count[b]`
    records into `ckpt` (fp64 inputs): L (d_k + 8) u M_L and (L (d_k + 8) + d_k) u M_L |q|."""
    dk = ring_k.shape[-1]
    g = ring_g if per_channel else ring_g[..., None]
    M = ckpt.abs()
    for j in range(int(count.max()) if count.numel() else 0):
        k = ring_k[:, :, j].abs()
        beta = ring_beta[:, :, j, None]
        Ma = M * torch.exp(g[:, :, j])[..., None, :]
        step = Ma + beta[..., None] * ((Ma @ k[..., None]) + ring_v[:, :, j, :, None].abs()) * (
            k[..., None, :])
        M = torch.where((j < count)[:, None, None, None], step, M)
    n = count.to(torch.float64)[:, None, None]
    s_bound = (n * (dk + 8) * U32)[..., None] * M
    y_bound = ((n * (dk + 8) + dk) * U32) * torch.einsum("bhvk,bhk->bhv", M, q.abs())
    return s_bound, y_bound
