"""One Gated DeltaNet ReplaySSM decode step on the GPU: the non-flush kernel and the flush kernel.

`gdn_replay_decode(cache, q, k, v, g, beta, ...)` advances every slot of a
`cute_kernels.gdn_cache.GDNReplayCache` by one token (the contract of
`emulation/gdn_replay_decode.py` and `lowprec/gdn.py`): a slot with `cursors[s] < window - 1`
appends its record and computes its output from the read copy (gdn_replay_output.py); a slot
with `cursors[s] == window - 1` flushes (gdn_replay_flush.py). Three launches on torch's
current stream, capturable in a CUDA graph:

    1. non-flush kernel       non-flush slots: output, record (u, v, k, g, beta) at the cursor
    2. flush kernel           flush slots: fold, output, both copies, record at window - 1
    3. counter kernel         non-flush slots: cursors[s] += 1; flush slots: cursors[s] = 0,
                              flushes[s] += 1

Neither of the first two writes a counter (every CTA of a slot reads them), so both decide
from the value the step started with and no snapshot is needed; the counter kernel (one
thread a slot) moves them after both. `gdn_replay_output` and `gdn_replay_flush` run one of
the two kernels and move only its slots' counters, so that the two in turn are one decode
step.

With `lo_format='none'` (and an fp32 recurrence copy) the checkpoint is a single copy: the
non-flush step reads `hi` itself (the single-copy FP32 ReplaySSM baseline).

KDA (per-channel decay, `g [slots, nheads, dk]`) is not built. What it would take: the flush
multiplies each thread's chunk by its 16 columns' `exp(g_j[d])` (a 16-element vector per
record instead of a scalar: the same loop); the non-flush step needs per-column cumulative
sums, so `w_j` becomes a [L, dk] table (exp of differences per column) staged in shared
memory, the read copy's products use `G_c[d] k_c[d]` (already per column in the kernel's
vectors), and kk_j, kq_j take the per-column weights inside their dot products: about 4 KiB
more shared memory and dk exps per record instead of one, no change of thread ownership.

Bytes per step (explicit counts for the benchmark): `gdn_replay_output.traffic_bytes` (a
non-flush (slot, head) at nvfp4, bf16 activations, dv = dk = 128, c records held: 9,220 B of
read copy + c (4 dv + 2 dk + 4) B of ring + 2,064 B of inputs, output and record) and
`gdn_replay_flush.traffic_bytes` (hi read and written, the whole ring, both copies written).
"""

from __future__ import annotations

import cutlass  # noqa: I001
import cutlass.cute as cute
import torch
from cutlass import Int32

from cute_kernels import _compile
from cute_kernels import gdn_cache as gc
from cute_kernels import gdn_replay_flush as gf
from cute_kernels import gdn_replay_output as go
from cute_kernels.cache import check_counter_values, check_switch

__all__ = ["gdn_replay_decode", "gdn_replay_output", "gdn_replay_flush", "compile_advance"]


# --------------------------------------------------------------------------------------------
# counters: one thread per slot, after the step's kernels


@cute.kernel
def _advance_kernel(cursors: cute.Tensor, flushes: cute.Tensor, batch: Int32,
                    window: cutlass.Constexpr, nonflush: cutlass.Constexpr,
                    flush: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    s = bidx * 128 + tidx
    if s < batch:
        c = cursors[s]
        if cutlass.const_expr(flush):
            if c == window - 1:
                cursors[s] = 0
                flushes[s] = flushes[s] + 1
        if cutlass.const_expr(nonflush):
            if (c >= 0) & (c < window - 1):
                cursors[s] = c + 1


@cute.jit
def _advance_host(p_cursors: cute.Pointer, p_flushes: cute.Pointer, batch: Int32,
                  window: cutlass.Constexpr, nonflush: cutlass.Constexpr,
                  flush: cutlass.Constexpr, stream):
    cursors = cute.make_tensor(p_cursors, cute.make_layout(batch))
    flushes = cute.make_tensor(p_flushes, cute.make_layout(batch))
    _advance_kernel(cursors, flushes, batch, window, nonflush, flush).launch(
        grid=[(batch + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)


def compile_advance(window: int, nonflush: bool, flush: bool, keep_ptx: bool = False):
    """The counter kernel: (``nonflush``) slots below window - 1 move on by one; (``flush``)
    slots at window - 1 go to 0 with one more flush."""

    def build():
        ptr = _compile.fake_ptr(Int32)
        return cute.compile(_advance_host, ptr, ptr, Int32(1), window, nonflush, flush,
                            _compile.fake_stream(), options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("gdn_advance", window, nonflush, flush, keep_ptx), build)


def launch_advance(cache, nonflush: bool, flush: bool) -> None:
    kernel = compile_advance(cache.window, nonflush, flush)
    kernel(_compile.gmem_ptr(cache.cursors), _compile.gmem_ptr(cache.flushes),
           Int32(cache.cursors.shape[0]), _compile.current_stream())


# --------------------------------------------------------------------------------------------
# public functions


def _prepare(cache, q, k, v, g, beta, out, debug_state, check_counters, heads_per_cta=None):
    """Every check of a step, before any launch; returns (config, out, view)."""
    view = gc.check_gdn_cache(cache)
    act = gc.check_gdn_step(view, q, k, v, g, beta, out=out, debug_state=debug_state)
    check_switch("check_counters", check_counters)
    cfg = gf.config_of(cache, view, act, has_debug=debug_state is not None)
    if heads_per_cta is not None:
        go.GDNOutputConfig(cfg, heads_per_cta)  # raises for a value the kernel cannot take
    if check_counters:
        check_counter_values(cache.cursors, cache.flushes, cache.window)
    if view.device.type != "cuda":
        raise ValueError(f"cache.hi: expected a CUDA tensor (every argument on one GPU), got "
                         f"{view.device}")
    if out is None:
        out = torch.empty_like(v)
    return cfg, out, view


def gdn_replay_decode(cache: gc.GDNReplayCache, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                      out: torch.Tensor | None = None, debug_state: torch.Tensor | None = None,
                      check_counters: bool = False,
                      heads_per_cta: int | None = None) -> torch.Tensor:
    """Advance every slot of a GDN ``cache`` by one token (module docstring); returns y
    [slots, nheads, dv] in v's dtype.

    Arguments in `lowprec.gdn.gdn_step`'s order: q, k [slots, nheads, dk] and v
    [slots, nheads, dv] in the ring's activation dtype; g (log-decay) and beta [slots, nheads]
    fp32. ``debug_state`` fp32 [slots, nheads, dv, dk] receives the unrounded new state at
    flush rows and is untouched elsewhere. ``check_counters=True`` checks (a stream sync) the
    cursors lie in [0, window - 1] and the flush counters in [0, 2^20 - 1); without it a
    cursor out of range leaves its slot's state, ring and output row untouched. No input,
    ``out`` or ``debug_state`` may share memory with the cache or each other's outputs.
    ``heads_per_cta``: heads each CTA of the non-flush kernel takes in turn (a divisor of
    nheads in [1, 16]; None: one, the fastest measured). Launches on the current stream.
    """
    cfg, out, view = _prepare(cache, q, k, v, g, beta, out, debug_state, check_counters,
                              heads_per_cta)
    if view.slots == 0:
        return out
    go.launch_gdn_output(cfg, cache, q, k, v, g, beta, out, heads_per_cta)
    gf.launch_gdn_flush(cfg, cache, cache.cursors, q, k, v, g, beta, out, debug_state)
    launch_advance(cache, nonflush=True, flush=True)
    return out


def gdn_replay_output(cache: gc.GDNReplayCache, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                      out: torch.Tensor | None = None,
                      check_counters: bool = False,
                      heads_per_cta: int | None = None) -> torch.Tensor:
    """The non-flush half of `gdn_replay_decode`: slots with ``cursors[s] < window - 1`` get
    their output, their record and cursor + 1; flush slots (and their rows of ``out``) are
    left alone. Arguments as `gdn_replay_decode`."""
    cfg, out, view = _prepare(cache, q, k, v, g, beta, out, None, check_counters,
                              heads_per_cta)
    if view.slots == 0:
        return out
    go.launch_gdn_output(cfg, cache, q, k, v, g, beta, out, heads_per_cta)
    launch_advance(cache, nonflush=True, flush=False)
    return out


def gdn_replay_flush(cache: gc.GDNReplayCache, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     out: torch.Tensor | None = None, debug_state: torch.Tensor | None = None,
                     check_counters: bool = False) -> torch.Tensor:
    """The flush half of `gdn_replay_decode`: slots with ``cursors[s] == window - 1`` fold
    their window into both copies, get their output, cursor 0 and one more flush; the other
    slots (and their rows of ``out``) are left alone. Arguments as `gdn_replay_decode`."""
    cfg, out, view = _prepare(cache, q, k, v, g, beta, out, debug_state, check_counters)
    if view.slots == 0:
        return out
    gf.launch_gdn_flush(cfg, cache, cache.cursors, q, k, v, g, beta, out, debug_state)
    launch_advance(cache, nonflush=False, flush=True)
    return out
