"""One Mamba-2 ReplaySSM decode step on the GPU: the non-flush kernel and the flush kernel.

`replay_decode_step` advances every slot by one token (the contract of
`emulation/replay_decode.py` and `lowprec/mamba2.py`): a slot with `cursors[s] + 1 < window`
appends its record and computes its output from the read copy (replay_output.py); a slot with
`cursors[s] + 1 == window` flushes (replay_flush.py). Launch order, all on torch's current
stream (capturable in a CUDA graph):

    1. decision = cursors.clone()      this step's cursor values, before anything changes them
    2. replay_output(cursors)          non-flush slots: output, record, cursors[s] += 1
                                       (its CTAs hand the cursor over among themselves);
                                       flush slots (cursor == window - 1) are left alone
    3. flush kernel(decision)          flush slots by the snapshot: reads, never writes, counters;
                                       a CTA a slot and head (fp16 hi), or for fp32 hi one wave
                                       of CTAs looping over the slots (`slot_loop`): a CTA for
                                       every slot makes a step where few slots flush pay for all
                                       (results/README.md, "Staggered batches")
    4. counter kernel(decision)        flush slots: cursors[s] = 0, flushes[s] += 1

Why the snapshot: step 2 moves a slot from window - 2 to window - 1, so a flush kernel that
read the live cursors after it would flush that slot a token early; run before it, a flush
that reset its cursors to 0 would make step 2 treat the slot as non-flush. Reading one copy
taken before both kernels makes each decide from the value the step started with. The flush
kernel itself never writes counters, because its CTAs of one slot (one per head) all read
them; the reset is a separate one-thread-per-slot launch.

With `lo_format='none'` the checkpoint is a single copy: non-flush steps read `hi` itself
(fp32: the single-copy FP32 ReplaySSM baseline; fp16: a shared FP16 checkpoint).
"""

from __future__ import annotations

import dataclasses

import torch

from cute_kernels.replay_flush import (
    _prepare_flush,
    decode_slot_ctas,
    launch_advance_counters,
    launch_flush,
)
from cute_kernels.replay_output import _sm_count, replay_output

__all__ = ["replay_decode_step"]


def replay_decode_step(
    hi,
    lo,
    ring_x,
    ring_dt,
    ring_B,
    cursors,
    flushes,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    out=None,
    *,
    window=16,
    hi_format="fp16",
    hi_rounding="sr",
    lo_format="nvfp4",
    seed=0,
    debug_state=None,
):
    """Advance every slot by one token; returns out `[slots, nheads, headdim]` (x's dtype).

    Arguments as `replay_flush` (cute_kernels/replay_flush.py); `debug_state` receives the
    unrounded new state of the slots that flushed. Cursor values are not checked (that would
    synchronise): they must lie in [0, window - 1].
    """
    cfg, lo = _prepare_flush(
        hi,
        lo,
        ring_x,
        ring_dt,
        ring_B,
        cursors,
        flushes,
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        dt_softplus,
        out,
        window,
        hi_format,
        hi_rounding,
        lo_format,
        seed,
        debug_state,
    )
    if out is None:
        out = torch.empty_like(x)
    if hi.shape[0] == 0:
        return out
    slot_ctas = None
    if cfg.hi_format == "fp32":
        # fp32: CTAs that loop over slots (at batch 256 staggered, L = 16, 355.6 -> 320.8 us a
        # step); the fp16-SR + nvfp4 kernel compiles to 1.7x slower code with the loop
        # (scripts/flush_slot_loop_probe.py, 740 -> 1,277 us at batch 256 even with one slot a
        # CTA; fp32 618 -> 579), so it keeps one CTA a slot and head
        cfg = dataclasses.replace(cfg, slot_loop=True)
        slot_ctas = decode_slot_ctas(cfg, hi.shape[0], _sm_count(hi.device))
    decision = cursors.clone()
    if lo_format == "none":
        read_copy, read_format = {"values": hi}, hi_format
    else:
        read_copy, read_format = lo, lo_format
    replay_output(
        read_copy,
        ring_x,
        ring_dt,
        ring_B,
        cursors,
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        dt_softplus,
        out,
        window=window,
        lo_format=read_format,
    )
    launch_flush(
        cfg,
        hi,
        lo,
        ring_x,
        ring_dt,
        ring_B,
        decision,
        flushes,
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        out,
        debug_state,
        seed,
        slot_ctas=slot_ctas,
    )
    launch_advance_counters(decision, cursors, flushes, window, advance_others=False)
    return out
