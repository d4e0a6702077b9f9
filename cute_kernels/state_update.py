"""Conventional Mamba-2 decode step (CuTe DSL): read and write the whole state every token.

This is the baseline the ReplaySSM kernels are measured against (the 7.5x target's
denominator), so it is written for bandwidth as carefully as they are:

    dt  = softplus(dt + dt_bias)          (or dt + dt_bias; per slot and head)
    S   = exp(dt A) S + dt x B^T           fp32 arithmetic on the loaded state
    y   = S C + D x, times silu(z)          from the new, unrounded state
    S  <- fp32, or fp16 RN, or fp16 SR with the draws lowprec.philox.random_words(seed, slot,
          tokens[s], sr_bits=, philox_rounds=) (the per-slot token counter plays the flush
          counter; +1 per SR call; the cache's sr_bits and philox_rounds, compile-time knobs)

Thread ownership (one CTA per (slot, head), 128 threads for a 64 x 128 head, 64 elements per
thread, every state access one 128-bit load or store coalesced across the warp):

    fp32 state: a chunk is 4 elements (16 B); a row is 32 chunks = one warp
             chunk  0    1   ...  31
    p = 0         t0   t1  ...  t31       thread t: column chunk t % 32, rows t // 32 + 4 i,
    p = 1         t32  ... ...  t63       i = 0..15; warp w streams rows w, w+4, ... (512 B
    p = 2, 3      t64 .. t127             per warp per access)

    fp16 state: a chunk is 8 elements (16 B); a row is 16 chunks = half a warp
    p = 0         t0 .. t15,   p = 1  t16 .. t31, ...  rows t // 16 + 8 i, i = 0..7

All of a thread's state loads are issued before the first use (64 registers of fp32 or 32 of
fp16 pairs in flight per thread). The output's row sums meet in a shuffle reduction over the
row's lanes. Bytes per call: the state read and written once, plus x, dt, z, out per head and
B, C per group (see `traffic_bytes`).

Counters: every CTA of a slot reads `cache.tokens[s]` for its words, so the increment is a
separate `tokens += 1` on the same stream after the kernel (no CTA may change what a sibling
still reads). RN draws no words, and its steps leave `tokens` alone (no extra launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass  # noqa: I001
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint32

from cute_kernels import _compile
from cute_kernels import cache as kv
from cute_kernels import numerics as nm
from cute_kernels.replay_flush import CUTE_DTYPES
from cute_kernels.replay_flush_config import check_flush_shape
from lowprec.replay import check_flush_field

__all__ = ["StateUpdateConfig", "mamba2_state_update", "compile_state_update", "traffic_bytes"]

ROUNDINGS = ("rn", "sr")
STATE_DTYPES = {torch.float32: "fp32", torch.float16: "fp16"}
ACCESS_BYTES = 16
ELEMENTS_PER_THREAD = 64


@dataclass(frozen=True)
class StateUpdateConfig:
    """Static parameters of one compiled kernel (the compile-cache key)."""

    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    state: str  # 'fp32' or 'fp16'
    rounding: str  # 'rn' or 'sr' (fp16 only)
    act: str
    dt_dtype: str
    has_D: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    has_debug: bool
    # SR's random bits an element and Philox rounds; the defaults (16, 7) unless rounding is 'sr'
    sr_bits: int = nm.DEFAULT_SR_BITS
    philox_rounds: int = nm.DEFAULT_PHILOX_ROUNDS

    def __post_init__(self):
        if self.state not in STATE_DTYPES.values():
            kv.fail("state", f"one of {tuple(STATE_DTYPES.values())}", repr(self.state))
        if self.rounding not in ROUNDINGS or (self.state == "fp32" and self.rounding != "rn"):
            kv.fail("rounding", f"one of {ROUNDINGS} ('rn' for fp32)", repr(self.rounding))
        sr = kv.check_sr_settings(self.sr_bits, self.philox_rounds, self.rounding, "rounding")
        object.__setattr__(self, "sr_bits", sr[0])  # plain ints: one compile-cache key each
        object.__setattr__(self, "philox_rounds", sr[1])
        if self.chunks_per_row > 32:
            kv.fail("dstate", f"at most {32 * self.vec} for an {self.state} state (a row's "
                          "16-byte chunks within one warp: its output is a warp shuffle sum)",
                          self.dstate)

    @property
    def vec(self) -> int:
        """Elements per 128-bit access."""
        return ACCESS_BYTES // (4 if self.state == "fp32" else 2)

    @property
    def threads(self) -> int:
        return min(max(self.headdim * self.dstate // ELEMENTS_PER_THREAD, 32), 1024)

    @property
    def chunks_per_row(self) -> int:
        return self.dstate // self.vec

    @property
    def rows_per_pass(self) -> int:
        return self.threads // self.chunks_per_row

    @property
    def passes(self) -> int:
        return self.headdim // self.rows_per_pass


class StateUpdate:
    def __init__(self, config: StateUpdateConfig):
        self.cfg = config

    @cute.jit
    def __call__(
        self,
        p_state: cute.Pointer,
        p_counters: cute.Pointer,
        p_x: cute.Pointer,
        p_dt: cute.Pointer,
        p_A: cute.Pointer,
        p_B: cute.Pointer,
        p_C: cute.Pointer,
        p_D: cute.Pointer,
        p_z: cute.Pointer,
        p_dt_bias: cute.Pointer,
        p_out: cute.Pointer,
        p_debug: cute.Pointer,
        batch: Int32,
        seed_lo: Uint32,
        seed_hi: Uint32,
        stream,
    ):
        cfg = self.cfg
        H, P, N, G = cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups
        state_layout = cute.make_layout((batch, H, P, N), stride=(H * P * N, P * N, N, 1))
        state = cute.make_tensor(p_state, state_layout)
        debug = cute.make_tensor(p_debug, state_layout)
        counters = cute.make_tensor(p_counters, cute.make_layout(batch))
        head_rows = cute.make_layout((batch, H, P), stride=(H * P, P, 1))
        x = cute.make_tensor(p_x, head_rows)
        z = cute.make_tensor(p_z, head_rows)
        out = cute.make_tensor(p_out, head_rows)
        dt = cute.make_tensor(p_dt, cute.make_layout((batch, H), stride=(H, 1)))
        A = cute.make_tensor(p_A, cute.make_layout(H))
        D = cute.make_tensor(p_D, cute.make_layout(H))
        dt_bias = cute.make_tensor(p_dt_bias, cute.make_layout(H))
        group_rows = cute.make_layout((batch, G, N), stride=(G * N, N, 1))
        B = cute.make_tensor(p_B, group_rows)
        C = cute.make_tensor(p_C, group_rows)
        self.kernel(
            state, counters, x, dt, A, B, C, D, z, dt_bias, out, debug, seed_lo, seed_hi
        ).launch(grid=[H, batch, 1], block=[cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        state: cute.Tensor,
        counters: cute.Tensor,
        x: cute.Tensor,
        dt: cute.Tensor,
        A: cute.Tensor,
        B: cute.Tensor,
        C: cute.Tensor,
        D: cute.Tensor,
        z: cute.Tensor,
        dt_bias: cute.Tensor,
        out: cute.Tensor,
        debug: cute.Tensor,
        seed_lo: Uint32,
        seed_hi: Uint32,
    ):
        cfg = self.cfg
        P, N, V = cfg.headdim, cfg.dstate, cfg.vec
        R, rows, passes = cfg.chunks_per_row, cfg.rows_per_pass, cfg.passes
        tidx, _, _ = cute.arch.thread_idx()
        h, s, _ = cute.arch.block_idx()
        g = h // (cfg.nheads // cfg.ngroups)
        col = tidx % R
        row0 = tidx // R
        S_h = state[s, h, None, None]

        # every state load in flight first
        acc = []
        for i in cutlass.range_constexpr(passes):
            s_frag = cute.make_rmem_tensor((V,), state.element_type)
            cute.autovec_copy(_chunk(S_h, row0 + rows * i, col, V), s_frag)
            acc.append(s_frag.load().to(Float32))

        dt_h = dt[s, h].to(Float32)
        if cutlass.const_expr(cfg.has_dt_bias):
            dt_h = dt_h + dt_bias[h]
        if cutlass.const_expr(cfg.dt_softplus):
            dt_h = nm.softplus(dt_h)
        decay = cute.math.exp(dt_h * A[h])
        b_frag = cute.make_rmem_tensor((V,), B.element_type)
        cute.autovec_copy(cute.local_tile(B[s, g, None], (V,), (col,)), b_frag)
        b_vec = b_frag.load().to(Float32)
        c_frag = cute.make_rmem_tensor((V,), C.element_type)
        cute.autovec_copy(cute.local_tile(C[s, g, None], (V,), (col,)), c_frag)
        c_vec = c_frag.load().to(Float32)

        # S = decay S + (dt x_p) B;  y_p = S_p . C  (+ D x_p) (* silu(z_p))
        for i in cutlass.range_constexpr(passes):
            p = row0 + rows * i
            x_p = x[s, h, p].to(Float32)
            acc[i] = acc[i] * decay + (dt_h * x_p) * b_vec
            part = (acc[i] * c_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            y = cute.arch.warp_reduction(part, _add, threads_in_group=R)
            if col == 0:
                if cutlass.const_expr(cfg.has_D):
                    y = y + D[h] * x_p
                if cutlass.const_expr(cfg.has_z):
                    y = y * nm.silu(z[s, h, p].to(Float32))
                out[s, h, p] = y.to(out.element_type)

        if cutlass.const_expr(cfg.has_debug):
            debug_h = debug[s, h, None, None]
            for i in cutlass.range_constexpr(passes):
                d_frag = cute.make_rmem_tensor((V,), Float32)
                d_frag.store(acc[i])
                cute.autovec_copy(d_frag, _chunk(debug_h, row0 + rows * i, col, V))

        if cutlass.const_expr(cfg.state == "fp32"):
            for i in cutlass.range_constexpr(passes):
                o_frag = cute.make_rmem_tensor((V,), Float32)
                o_frag.store(acc[i])
                cute.autovec_copy(o_frag, _chunk(S_h, row0 + rows * i, col, V))
        else:
            bits = cute.make_tensor(
                cute.recast_ptr(S_h.iterator, dtype=Uint32),
                cute.make_layout((P, N // 2), stride=(N // 2, 1)),
            )
            keys = nm.philox_keys(seed_lo, seed_hi, cfg.philox_rounds)
            counter = Uint32(counters[s])
            _, counter_hi = nm.state_counter(Uint32(s), counter, Uint32(0))
            for i in cutlass.range_constexpr(passes):
                p = row0 + rows * i
                w_frag = cute.make_rmem_tensor((V // 2,), Uint32)
                element0 = Uint32((h * P + p) * N + col * V)
                if cutlass.const_expr(cfg.rounding == "sr"):
                    nm.sr_fp16_piece(w_frag, acc[i], V, Uint32(s), counter, element0, counter_hi,
                                     keys, cfg.sr_bits)
                else:
                    for v2 in cutlass.range_constexpr(V // 2):
                        w_frag[v2] = nm.rn_fp16x2(acc[i][2 * v2], acc[i][2 * v2 + 1])
                cute.autovec_copy(w_frag, _chunk(bits, p, col, V // 2))


def _add(a, b):
    return a + b


def _chunk(t2d, row, col, width):
    return cute.local_tile(t2d[row, None], (width,), (col,))


def compile_state_update(cfg: StateUpdateConfig, keep_ptx: bool = False):
    """The compiled kernel of `cfg` (cached); `keep_ptx` keeps its PTX text."""

    def build():
        act = CUTE_DTYPES[cfg.act]
        f = _compile.fake_ptr
        args = (
            f(Float32 if cfg.state == "fp32" else cutlass.Float16),
            f(Int32),
            f(act),
            f(CUTE_DTYPES[cfg.dt_dtype]),
            f(Float32),
            f(act),
            f(act),
            f(Float32),
            f(act),
            f(Float32),
            f(act),
            f(Float32),
            Int32(1),
            Uint32(0),
            Uint32(0),
            _compile.fake_stream(),
        )
        return cute.compile(StateUpdate(cfg), *args, options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("state_update", cfg, keep_ptx), build)


OUTPUT_FROM = ("unrounded",)  # y from the new state before its store is rounded


def mamba2_state_update(cache: kv.StateCache, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                        dt_softplus=True, output_from="unrounded", out=None, debug_state=None,
                        check_counters=False):
    """One conventional decode step of every slot and head, in place on ``cache.state``;
    returns out [slots, nheads, headdim] (x's dtype).

    ``cache``: a `cute_kernels.cache.StateCache` (format 'fp32', dstate at most 128, or
    'fp16'; rounding 'rn', or 'sr' for fp16, whose words come from ``cache.tokens``, advanced
    by one after the kernel). Token inputs as `emulation.state_update.mamba2_state_update`.
    ``output_from``: 'unrounded' (y from the new state before its store is rounded; the
    only form this kernel has). ``debug_state`` fp32, state-shaped, receives the unrounded
    new state. ``check_counters=True`` checks the token counters lie in [0, 2^20 - 1) (a
    stream sync). Runs on torch's current stream.
    """
    view = kv.check_state_cache(cache)
    if output_from not in OUTPUT_FROM:
        kv.fail("output_from", f"one of {OUTPUT_FROM} (this kernel's)", repr(output_from))
    kv.check_switch("dt_softplus", dt_softplus)
    kv.check_switch("check_counters", check_counters)
    check_flush_shape(view, ELEMENTS_PER_THREAD)
    if cache.format == "fp32" and view.dstate > 32 * ACCESS_BYTES // 4:
        # a row of 64 fp32 chunks would span two warps, and y's shuffle sum stays in one
        kv.fail("cache.state.shape[3] (dstate)", "at most 128 for an fp32 state", view.dstate)
    act, dt_name, ngroups = kv.check_step(view, x, dt, A, B, C, D, z, dt_bias, out=out,
                                          debug_state=debug_state)
    sr = cache.rounding == "sr"
    if check_counters and sr:
        check_flush_field("cache.tokens", cache.tokens)
    kv.require_cuda("cache.state", cache.state)
    if out is None:
        out = torch.empty_like(x)
    cfg = StateUpdateConfig(
        nheads=view.nheads,
        headdim=view.headdim,
        dstate=view.dstate,
        ngroups=ngroups,
        state=cache.format,
        rounding=cache.rounding,
        act=act,
        dt_dtype=dt_name,
        has_D=D is not None,
        has_z=z is not None,
        has_dt_bias=dt_bias is not None,
        dt_softplus=dt_softplus,
        has_debug=debug_state is not None,
        sr_bits=cache.sr_bits,
        philox_rounds=cache.philox_rounds,
    )
    if view.slots == 0:
        return out
    kernel = compile_state_update(cfg)
    f32, act_t = Float32, CUTE_DTYPES[act]
    opt = _optional_ptr
    kernel(
        _compile.gmem_ptr(cache.state),
        opt(cache.tokens if sr else None, Int32),
        _compile.gmem_ptr(x),
        _compile.gmem_ptr(dt),
        _compile.gmem_ptr(A),
        _compile.gmem_ptr(B),
        _compile.gmem_ptr(C),
        opt(D, f32),
        opt(z, act_t),
        opt(dt_bias, f32),
        _compile.gmem_ptr(out),
        opt(debug_state, f32),
        Int32(view.slots),
        Uint32(cache.seed & 0xFFFFFFFF),
        Uint32(cache.seed >> 32),
        _compile.current_stream(),
    )
    if sr:
        cache.tokens.add_(1)
    return out


def _optional_ptr(tensor, dtype):
    return _compile.fake_ptr(dtype) if tensor is None else _compile.gmem_ptr(tensor, dtype)


def traffic_bytes(
    state_dtype: str, slots, nheads, headdim, dstate, ngroups, act_bytes=2, has_z=True
) -> int:
    """Bytes one call must move, each read once and each write once: the state read and
    written, x, dt (act), out (and z) per head, B and C per group (D, A, dt_bias are noise)."""
    state_bytes = headdim * dstate * (4 if state_dtype == "fp32" else 2)
    per_head = 2 * state_bytes + headdim * act_bytes * (3 if has_z else 2) + act_bytes
    per_group = 2 * dstate * act_bytes
    return slots * (nheads * per_head + ngroups * per_group)
