"""Probe (GPU): the flush kernel with and without `slot_loop` on a batch where every slot
flushes, at several `slot_ctas`, timed by CUDA-graph replay over rotating sets, fp16-SR +
nvfp4 and fp32 at the Nemotron-3-Super layer. Says whether a looping CTA costs per slot
(slot_ctas = batch: one slot a CTA, as the default kernel) or only when it loops.

    PYTHONPATH=$PWD:$PYTHONPATH python scripts/flush_slot_loop_probe.py [batch]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from cute_kernels import replay_flush as rf
from experiments import kernel_bench as kb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/flush_slot_loop_probe.py",
        description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("batch", nargs="?", type=int, default=64,
                        help="slots, every one flushing (default %(default)s; at least 4)")
    args = parser.parse_args(argv)
    if args.batch < 4:
        parser.error(f"batch: expected an integer >= 4, got {args.batch}")
    if not torch.cuda.is_available():
        print(f"{parser.prog}: needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    batch = args.batch
    shape = kb.SHAPES["nemotron3-super"]
    for spec_name in ("cute:flush:fp16sr+nvfp4", "cute:flush:fp32"):
        spec = kb.KERNELS[spec_name]
        case = kb.build_case(spec, shape, batch, 16, 15, 4, torch.device("cuda"))
        t0 = case.bufs.at(0)
        hi_fmt = "fp32" if spec.variant == "fp32" else "fp16"
        lo_fmt = "none" if hi_fmt == "fp32" else "nvfp4"
        cfg, lo = rf._prepare_flush(
            t0["hi"], kb._lo_dict(t0), t0["ring_x"], t0["ring_dt"], t0["ring_B"],
            t0["cursors"], t0["flushes"], t0["x"], t0["dt"], case.params["A"], t0["B"],
            t0["C"], case.params["D"], None, case.params["dt_bias"], True, t0["out"], 16,
            hi_fmt, "sr" if hi_fmt == "fp16" else "rn", lo_fmt, 12345, None)
        looped = dataclasses.replace(cfg, slot_loop=True)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        per_wave = rf.decode_slot_ctas(looped, batch, sms)
        variants = [("one slot a CTA", cfg, batch),
                    ("loop, slot_ctas = batch", looped, batch),
                    ("loop, slot_ctas = batch / 4", looped, batch // 4),
                    (f"loop, slot_ctas = {per_wave} (decode)", looped, per_wave)]
        for name, c, slot_ctas in variants:
            def step(i, c=c, slot_ctas=slot_ctas, case=case):
                t = case.bufs.at(i)
                lo_i = kb._lo_dict(t) or {}
                rf.launch_flush(c, t["hi"], lo_i, t["ring_x"], t["ring_dt"], t["ring_B"],
                                t["cursors"], t["flushes"], t["x"], t["dt"], case.params["A"],
                                t["B"], t["C"], case.params["D"], None, case.params["dt_bias"],
                                t["out"], None, 12345, slot_ctas=slot_ctas)
            for i in range(4):
                step(i)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(4):
                    step(i)
            times = [kb._event_time_ms(graph.replay) * 1e3 / 4 for _ in range(15)]
            print(f"{spec_name:26s} b={batch:<4d} {name:34s} {statistics.median(times):9.1f} us",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
