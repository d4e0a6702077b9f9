"""One Mamba-2 ReplaySSM decode step on the GPU: the non-flush kernel and the flush kernel.

`replay_decode_step` advances every slot by one token (the contract of
`emulation/replay_decode.py` and `lowprec/mamba2.py`): a slot with `cursors[s] + 1 < window`
appends its record and computes its output from the read copy (replay_output.py); a slot with
`cursors[s] + 1 == window` flushes (replay_flush.py). Launch order, on torch's current stream
and (step 3, by default) a side stream forked from it after step 1 and joined before step 4,
all capturable in a CUDA graph:

    1. decision = cursors.clone()      this step's cursor values, before anything changes them
    2. replay_output(cursors)          non-flush slots: output, record, cursors[s] += 1
                                       (its CTAs hand the cursor over among themselves);
                                       flush slots (cursor == window - 1) are left alone
    3. flush kernel(decision)          flush slots by the snapshot: reads, never writes, counters;
                                       given `flush_slots`, a CTA per listed slot and head; else
                                       a CTA a slot and head (fp16 hi), or for fp32 hi one wave
                                       of CTAs looping over the slots (`slot_loop`): a CTA for
                                       every slot makes a step where few slots flush pay for all
                                       (results/README.md, "Staggered batches"); on the
                                       side stream it runs beside step 2 (they touch
                                       disjoint slots' rows): 6% faster on a staggered batch
                                       of 256 (130.4 -> 122.8 us, H200, 90bfcc1)
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

from cute_kernels import _compile
from cute_kernels.replay_flush import (
    _prepare_flush,
    check_counter_values,
    decode_slot_ctas,
    launch_advance_counters,
    launch_flush,
    require_cuda,
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
    overlap_flush=True,
    flush_slots=None,
    check_flush_slots=False,
    check_counters=False,
):
    """Advance every slot by one token; returns out `[slots, nheads, headdim]` (x's dtype).

    Arguments as `replay_flush` (cute_kernels/replay_flush.py; its tuning knobs,
    `elements_per_thread`, `fold`, `chunk` and `e2m1_pairs`, stay at their defaults here),
    within `replay_output`'s limits
    as well (window >= 2; headdim a multiple of 16; dstate a multiple of 128 for nvfp4, 64 for
    fp8_e4m3, 32 for fp16 and fp32): both kernels' argument checks run before either kernel is
    launched, so a refused call leaves the cache as it was. `debug_state` receives the
    unrounded new state of the slots that flushed. `overlap_flush` (default): the flush kernel
    runs on a side stream beside the non-flush kernel (results/README.md, "Staggered
    batches"); False launches the two in turn on the current stream. Cursor and flush-counter
    values are not checked unless `check_counters=True` (it synchronises; `replay_flush`'s):
    cursors must lie in [0, window - 1], flushes in [0, 2^20 - 1).

    `flush_slots`: optional int32 tensor (on the cursors' device) of exactly the slots whose
    cursor is `window - 1` this step, in any order, as a server that counts its sequences'
    tokens knows them. The flush kernel is then launched on those slots only (a CTA per entry
    and head; none for an empty table) instead of on every slot: the CTAs of slots that do
    not flush made a step with no slot flushing take 85.1 us at batch 256 on the H200, 62.5
    with the table (results/staggered_step_cursor8.csv). A listed slot that does not flush is
    skipped; a flushing slot left out would not be flushed while its cursor is reset, and an
    entry outside [0, slots) or listed twice is undefined (the kernel reads the table as
    given: an out-of-range read, or two CTAs flushing one slot), so `check_flush_slots=True`
    (which synchronises: for tests and debugging) compares the table with the cursors first
    and raises ValueError on a difference.
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
    for name, flag in (("overlap_flush", overlap_flush), ("check_flush_slots", check_flush_slots),
                       ("check_counters", check_counters)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    if check_counters:
        check_counter_values(cursors, flushes, window)
    if out is None:
        out = torch.empty_like(x)
    if lo_format == "none":
        read_copy, read_format = {"values": hi}, hi_format
    else:
        read_copy, read_format = lo, lo_format
    # replay_output's checks too (its limits are narrower than the flush's), before the flush
    # is launched: a refusal after it would leave flushed slots whose cursors were not reset
    replay_output(read_copy, ring_x, ring_dt, ring_B, cursors, x, dt, A, B, C, D, z, dt_bias,
                  dt_softplus, out, window=window, lo_format=read_format,
                  _config_for_sms=_sm_count(hi.device) if hi.is_cuda else _compile.H200_SM_COUNT)
    if flush_slots is not None:  # before the device check, so that it names the table
        flush_slots = _checked_table(flush_slots, cursors, window, check_flush_slots)
    require_cuda("hi", hi)
    if hi.shape[0] == 0:
        return out
    slot_ctas = None
    if flush_slots is not None:
        cfg = dataclasses.replace(cfg, slot_table=True)
    elif cfg.hi_format == "fp32":
        # fp32: CTAs that loop over slots (at batch 256 staggered, L = 16, 355.6 -> 321.7 us a
        # step); the fp16-SR + nvfp4 kernel compiles to 1.7x slower code with the loop
        # (scripts/flush_slot_loop_probe.py, 740 -> 1,277 us at batch 256 even with one slot a
        # CTA; fp32 618 -> 579), so it keeps one CTA a slot and head
        cfg = dataclasses.replace(cfg, slot_loop=True)
        slot_ctas = decode_slot_ctas(cfg, hi.shape[0], _sm_count(hi.device))
    decision = cursors.clone()

    def flush():
        launch_flush(cfg, hi, lo, ring_x, ring_dt, ring_B, decision, flushes, x, dt, A, B, C, D,
                     z, dt_bias, out, debug_state, seed, slot_ctas=slot_ctas,
                     slot_table=flush_slots)

    main = torch.cuda.current_stream(hi.device)
    if flush_slots is not None and flush_slots.numel() == 0:
        overlap_flush = False  # nothing to flush, nothing launched
    if overlap_flush:
        # the flush kernel on a side stream, forked after the snapshot and joined before the
        # counters: it touches only the flushing slots' rows, replay_output only the others'
        side = _side_stream(hi.device)
        side.wait_stream(main)
        decision.record_stream(side)
        if flush_slots is not None:
            flush_slots.record_stream(side)
        with torch.cuda.stream(side):
            flush()
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
    if overlap_flush:
        main.wait_stream(side)
    else:
        flush()
    launch_advance_counters(decision, cursors, flushes, window, advance_others=False)
    return out


def _checked_table(flush_slots, cursors, window: int, check: bool):
    """The flush slots' table, validated: int32, one dimension, the cursors' device, no more
    entries than slots; with `check` (a sync), equal as a set to the slots at `window - 1`,
    which also refuses an entry out of range or listed twice."""
    if not isinstance(flush_slots, torch.Tensor) or flush_slots.dim() != 1:
        raise ValueError("flush_slots: expected a 1-D int32 tensor of slot indices")
    if flush_slots.dtype != torch.int32 or flush_slots.device != cursors.device:
        raise ValueError(f"flush_slots: expected int32 on {cursors.device}, got "
                         f"{flush_slots.dtype} on {flush_slots.device}")
    if flush_slots.numel() > cursors.numel():
        raise ValueError(f"flush_slots: expected at most {cursors.numel()} entries (the "
                         f"slots), got {flush_slots.numel()}")
    if check:
        listed = sorted(flush_slots.tolist())
        due = torch.nonzero(cursors == window - 1).flatten().tolist()
        if listed != due:
            raise ValueError(f"flush_slots: the slots at cursor {window - 1} are {due}, the "
                             f"table lists {listed}")
    return flush_slots.contiguous()


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    """One side stream per device for the flush kernel (created once: a stream per step would
    leak into CUDA graphs' capture as new resources)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]
