"""One Mamba-2 ReplaySSM decode step on the GPU: the non-flush kernel and the flush kernel.

`mamba2_replay_decode(cache, x, dt, A, B, C, ...)` advances every slot of a
`cute_kernels.cache.ReplayCache` by one token (the contract of `emulation/replay_decode.py`
and `lowprec/mamba2.py`): a slot with `cursors[s] + 1 < window` appends its record and
computes its output from the read copy (replay_output.py); a slot with `cursors[s] + 1 ==
window` flushes (replay_flush.py). Launch order, on torch's current stream
and (step 3, by default) a side stream forked from it after step 1 and joined before step 4,
all capturable in a CUDA graph:

    1. decision = cursors.clone()      this step's cursor values, before anything changes them
    2. non-flush kernel(cursors)       non-flush slots: output, record, cursors[s] += 1
                                       (its CTAs hand the cursor over among themselves);
                                       flush slots (cursor == window - 1) are left alone
    3. flush kernel(decision)          flush slots by the snapshot: reads, never writes, counters;
                                       given `flush_slots`, a CTA per listed slot and head; else
                                       a CTA a slot and head (fp16 hi), or for fp32 hi one wave
                                       of CTAs looping over the slots (`slot_loop`): a CTA for
                                       every slot makes a step where few slots flush pay for all
                                       (docs/performance.md); on the side stream it runs
                                       beside step 2 (they touch disjoint slots' rows): 6%
                                       faster on a staggered batch of 256 (130.4 -> 122.8 us,
                                       H200, 90bfcc1)
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

from cute_kernels import cache as kv
from cute_kernels import replay_flush as rf
from cute_kernels import replay_output as ro
from cute_kernels import replay_output_config as roc

__all__ = ["mamba2_replay_decode"]


def mamba2_replay_decode(cache: kv.ReplayCache, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                         dt_softplus=True, out=None, debug_state=None, check_counters=False,
                         flush_slots=None, overlap_flush=True):
    """Advance every slot of ``cache`` by one token; returns out [slots, nheads, headdim]
    (x's dtype).

    Arguments as `mamba2_replay_flush` (the flush kernel at its defaults), within the
    non-flush kernel's limits as well (window >= 2; headdim a multiple of 16; dstate a
    multiple of 128 for nvfp4, 64 for fp8_e4m3, 32 for fp16 and fp32): both kernels' checks
    run before either kernel is launched, so a refused call leaves the cache as it was.
    ``debug_state`` receives the unrounded new state of the slots that flushed.
    ``overlap_flush`` (default): the flush kernel runs on a side stream beside the non-flush
    kernel; False launches the two in turn on the current stream. Counter values are not
    checked unless ``check_counters=True`` (it synchronises): cursors in [0, window - 1],
    flushes in [0, 2^20 - 1).

    ``flush_slots``: optional int32 tensor (on the cache's device) of exactly the slots whose
    cursor is ``window - 1`` this step, in any order, as a server that counts its sequences'
    tokens knows them. The flush kernel is then launched on those slots only (a CTA per entry
    and head; none for an empty table) instead of on every slot: at batch 256 on the H200 a
    step with no slot flushing took 85.1 us without the table, 62.5 with it. A listed slot
    that does not flush is skipped; a flushing slot left out would not be flushed while its
    cursor is reset, and an entry outside [0, slots) or listed twice is undefined (the kernel
    reads the table as given), so ``check_counters=True`` (a sync) also compares the table
    with the cursors and raises ValueError on a difference.
    """
    view = kv.check_replay_cache(cache)
    kv.check_step(view, x, dt, A, B, C, D, z, dt_bias, out=out, debug_state=debug_state)
    cfg = rf.flush_config(cache, view, x, dt, D, z, dt_bias, dt_softplus=dt_softplus,
                          has_debug=debug_state is not None)
    for name, flag in (("overlap_flush", overlap_flush), ("check_counters", check_counters)):
        kv.check_switch(name, flag)
    if check_counters:
        kv.check_counter_values(cache.cursors, cache.flushes, cache.window)
    # the non-flush kernel's checks too (its limits are narrower than the flush's), before the
    # flush is launched: a refusal after it would leave flushed slots whose cursors were not
    # reset
    fmt, _ = roc.read_copy(cache)
    out_cfg = roc._config(view, fmt, cache.window, x, dt, D, z, dt_bias, dt_softplus,
                         roc._sm_count(view.device))
    if flush_slots is not None:  # before the device check, so that it names the table
        flush_slots = _checked_table(flush_slots, cache, check_counters)
    kv.require_cuda("cache.hi", cache.hi)
    if out is None:
        out = torch.empty_like(x)
    if view.slots == 0:
        return out
    slot_ctas = None
    if flush_slots is not None:
        cfg = dataclasses.replace(cfg, slot_table=True)
    elif cfg.hi_format == "fp32":
        # fp32: CTAs that loop over slots (at batch 256 staggered, L = 16, 355.6 -> 321.7 us a
        # step); the fp16-SR + nvfp4 kernel compiles to 1.7x slower code with the loop, so it
        # keeps one CTA a slot and head
        cfg = dataclasses.replace(cfg, slot_loop=True)
        slot_ctas = rf.decode_slot_ctas(cfg, view.slots, roc._sm_count(view.device))
    decision = cache.cursors.clone()

    def flush():
        rf.launch_flush(cfg, cache, decision, x, dt, A, B, C, D, z, dt_bias, out, debug_state,
                        slot_ctas=slot_ctas, slot_table=flush_slots)

    main = torch.cuda.current_stream(cache.hi.device)
    if flush_slots is not None and flush_slots.numel() == 0:
        overlap_flush = False  # nothing to flush, nothing launched
    if overlap_flush:
        # the flush kernel on a side stream, forked after the snapshot and joined before the
        # counters: it touches only the flushing slots' rows, the non-flush kernel the others'
        side = _side_stream(cache.hi.device)
        side.wait_stream(main)
        decision.record_stream(side)
        if flush_slots is not None:
            flush_slots.record_stream(side)
        with torch.cuda.stream(side):
            flush()
    ro.launch_replay_output(out_cfg, cache, x, dt, A, B, C, D, z, dt_bias, out)
    if overlap_flush:
        main.wait_stream(side)
    else:
        flush()
    rf.launch_advance_counters(decision, cache.cursors, cache.flushes, cache.window)
    return out


def _checked_table(flush_slots, cache, check: bool):
    """The flush slots' table, validated: int32, one dimension, the cache's device, no more
    entries than slots; with ``check`` (a sync), equal as a set to the slots at ``window -
    1``, which also refuses an entry out of range or listed twice."""
    cursors, window = cache.cursors, cache.window
    if not isinstance(flush_slots, torch.Tensor) or flush_slots.dim() != 1:
        kv.fail("flush_slots", "a 1-D int32 tensor of slot indices",
                getattr(flush_slots, "shape", type(flush_slots).__name__))
    if flush_slots.dtype != torch.int32 or flush_slots.device != cursors.device:
        kv.fail("flush_slots", f"int32 on {cursors.device}",
                f"{flush_slots.dtype} on {flush_slots.device}")
    if flush_slots.numel() > cursors.numel():
        kv.fail("flush_slots", f"at most {cursors.numel()} entries (the slots)",
                flush_slots.numel())
    kv.check_apart("flush_slots", flush_slots, cursors=cursors, flushes=cache.flushes)
    if check:
        listed = sorted(flush_slots.tolist())
        due = torch.nonzero(cursors == window - 1).flatten().tolist()
        if listed != due:
            kv.fail("flush_slots", f"the slots at cursor {window - 1}: {due}", listed)
    return flush_slots.contiguous()


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    """One side stream per device for the flush kernel (created once: a stream per step would
    leak into CUDA graphs' capture as new resources)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]
