"""Conventional Gated DeltaNet decode step (CuTe DSL): read and write the whole state every token.

The baseline the GDN ReplaySSM kernels are measured against, written for bandwidth as they are
(`lowprec.gdn.gdn_step`, `emulation.gdn_state_update` with `output_from='unrounded'`):

    S  <- S exp(g);   u = beta (v - S k);   S <- S + u k^T      fp32 on the loaded state
    y   = S q                                                   from the new, unrounded state
    S  <- fp32, or bf16 RN (cvt.rn.bf16: ties to even; bf16 has fp32's range)

Thread ownership: the flush kernel's (`gdn_replay_flush`): dv dk / 64 threads (256 for the
Qwen3-Next head, dv = dk = 128), thread t the 16-column chunk t % R (R = dk / 16) of rows
t // R + (T / R) i, i = 0..3; every state access 64 B (fp32: four 128-bit accesses) or 32 B
(bf16: two), all loads issued before the first use; a row's sums meet in a shuffle
reduction over its R lanes.

Bytes per call (`traffic_bytes`): the state read and written once (4 or 2 dv dk B each way a
(slot, head)), q, k, v, g, beta read, y written.
"""

from __future__ import annotations

import cutlass  # noqa: I001
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from cute_kernels import _compile
from cute_kernels import gdn_cache as gc
from cute_kernels.cache import check_switch, fail
from cute_kernels.gdn_replay_flush import (
    ACT_BYTES,
    CUTE_DTYPES,
    GDNConfig,
    W,
    chunk_of,
    delta_step,
    load_vector_chunk,
    optional_ptr,
    row_outputs,
    store_hi_chunk,
)

__all__ = ["gdn_state_update", "compile_gdn_state_update", "traffic_bytes"]

STATE_CUTE = {"fp32": Float32, "bf16": cutlass.BFloat16}
OUTPUT_FROM = ("unrounded",)


class GDNStateUpdate:
    def __init__(self, config: GDNConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, p_state: cute.Pointer, p_q: cute.Pointer, p_k: cute.Pointer,
                 p_v: cute.Pointer, p_g: cute.Pointer, p_beta: cute.Pointer,
                 p_out: cute.Pointer, p_debug: cute.Pointer, batch: Int32, stream):
        cfg = self.cfg
        H, P, N = cfg.nheads, cfg.dv, cfg.dk
        layout = cute.make_layout((batch, H, P, N), stride=(H * P * N, P * N, N, 1))
        state = cute.make_tensor(p_state, layout)
        debug = cute.make_tensor(p_debug, layout)
        keys_rows = cute.make_layout((batch, H, N), stride=(H * N, N, 1))
        value_rows = cute.make_layout((batch, H, P), stride=(H * P, P, 1))
        per_head = cute.make_layout((batch, H), stride=(H, 1))
        self.kernel(state, cute.make_tensor(p_q, keys_rows), cute.make_tensor(p_k, keys_rows),
                    cute.make_tensor(p_v, value_rows), cute.make_tensor(p_g, per_head),
                    cute.make_tensor(p_beta, per_head), cute.make_tensor(p_out, value_rows),
                    debug).launch(grid=[H, batch, 1], block=[cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, state: cute.Tensor, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
               g: cute.Tensor, beta: cute.Tensor, out: cute.Tensor, debug: cute.Tensor):
        cfg = self.cfg
        R, step = cfg.lanes_per_row, cfg.rows_per_pass
        tidx, _, _ = cute.arch.thread_idx()
        h, s, _ = cute.arch.block_idx()
        col = tidx % R
        rows = [tidx // R + step * i for i in range(cfg.passes)]
        S_h = state[s, h, None, None]
        acc = []
        for i in cutlass.range_constexpr(cfg.passes):
            frag = cute.make_rmem_tensor((W,), state.element_type)
            cute.autovec_copy(chunk_of(S_h, rows[i], col), frag)
            acc.append(frag.load().to(Float32))
        k_vec = load_vector_chunk(k[s, h, None], col)
        delta_step(cfg, acc, k_vec, cute.math.exp(g[s, h]), beta[s, h], v[s, h, None], rows)
        row_outputs(cfg, acc, load_vector_chunk(q[s, h, None], col), rows, col,
                    out[s, h, None])
        debug_h = debug[s, h, None, None]
        for i in cutlass.range_constexpr(cfg.passes):
            if cutlass.const_expr(cfg.has_debug):
                d_frag = cute.make_rmem_tensor((W,), Float32)
                d_frag.store(acc[i])
                cute.autovec_copy(d_frag, chunk_of(debug_h, rows[i], col))
            store_hi_chunk(cfg.hi_format, "rn", S_h, acc[i], rows[i], col, None, None, None,
                           None, None)


def compile_gdn_state_update(cfg: GDNConfig, keep_ptx: bool = False):
    """The compiled kernel of `cfg` (cached; ``cfg.hi_format`` the state's format 'fp32' or
    'bf16'); `keep_ptx` keeps its PTX text."""
    if cfg.hi_format not in STATE_CUTE:
        fail("cfg.hi_format", f"one of {list(STATE_CUTE)} (the state's format)",
             repr(cfg.hi_format))

    def build():
        f = _compile.fake_ptr
        act = CUTE_DTYPES[cfg.act]
        args = (f(STATE_CUTE[cfg.hi_format]), f(act), f(act), f(act), f(Float32), f(Float32),
                f(act), f(Float32), Int32(1), _compile.fake_stream())
        return cute.compile(GDNStateUpdate(cfg), *args,
                            options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("gdn_state_update", cfg, keep_ptx), build)


def state_config(view: gc.GDNView, fmt: str, act: str, has_debug: bool) -> GDNConfig:
    return GDNConfig(nheads=view.nheads, dv=view.dv, dk=view.dk, window=1, hi_format=fmt,
                     hi_rounding="rn", lo_format="none", act=act, has_debug=has_debug)


def gdn_state_update(cache: gc.GDNStateCache, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     output_from: str = "unrounded", out: torch.Tensor | None = None,
                     debug_state: torch.Tensor | None = None,
                     check_counters: bool = False) -> torch.Tensor:
    """One conventional GDN decode step of every slot and head, in place on ``cache.state``
    (fp32 or bf16, stored RN); returns y [slots, nheads, dv] in v's dtype.

    Token inputs as `gdn_replay_decode` (`emulation.gdn_state_update.gdn_state_update`'s
    order). ``output_from``: 'unrounded' (y from the new state before its store is rounded;
    the only form this kernel has). ``debug_state`` fp32, state-shaped, receives the
    unrounded new state. ``check_counters``: accepted for the emulation's signature (a
    conventional state has no counters). Runs on torch's current stream.
    """
    view = gc.check_gdn_state_cache(cache)
    if output_from not in OUTPUT_FROM:
        fail("output_from", f"one of {OUTPUT_FROM} (this kernel's)", repr(output_from))
    check_switch("check_counters", check_counters)
    act = gc.check_gdn_step(view, q, k, v, g, beta, out=out, debug_state=debug_state)
    if view.device.type != "cuda":
        fail("cache.state", "a CUDA tensor (every argument on one GPU)", view.device)
    if out is None:
        out = torch.empty_like(v)
    if view.slots == 0:
        return out
    cfg = state_config(view, cache.format, act, debug_state is not None)
    kernel = compile_gdn_state_update(cfg)
    gp = _compile.gmem_ptr
    kernel(gp(cache.state), gp(q), gp(k), gp(v), gp(g), gp(beta), gp(out),
           optional_ptr(debug_state, Float32), Int32(view.slots), _compile.current_stream())
    return out


def traffic_bytes(state_format: str, act: str, slots: int, nheads: int, dv: int,
                  dk: int) -> int:
    """Bytes one call moves, each read once and each write once: the state read and written,
    q, k, v, g, beta read, y written."""
    a = ACT_BYTES[act]
    state_bytes = dv * dk * (4 if state_format == "fp32" else 2)
    return slots * nheads * (2 * state_bytes + (2 * dk + dv) * a + 8 + dv * a)
