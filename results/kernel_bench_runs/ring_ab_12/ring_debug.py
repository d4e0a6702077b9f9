"""One-off diagnosis of test_ring_stage_keeps_every_bit's two failures at 076c55a, as run on the
H200 (2026-11-30) from the repository root as `python ring_debug.py` (its imports reformatted
since); its printed output is diagnosis.txt. Kept for the record: the test now compares both
forms with the reference (test_ring_stage_keeps_the_results)."""
import sys

import torch

sys.path.insert(0, "tests")
import test_cute_replay_output as T  # noqa: E402

for fmt, shape, act, knobs in [("nvfp4", "odd", "fp32", dict(warps=1)),
                               ("fp32", "nemotron", "bf16", dict(head_splits=1)),
                               ("nvfp4", "nemotron", "bf16", dict(head_splits=1))]:
    window = T.SHAPES[shape][-1]
    lo, lo64, t = T._inputs(fmt, shape, act, seed=59)
    res = {}
    for where in ("registers", "smem", "registers2"):
        lo_d, t_d = T._to_cuda(lo, t)
        out = torch.full_like(t_d["x"], float("nan"))
        T._call(lo_d, t_d, fmt, window, out, ring_stage=where.rstrip("2"), **knobs)
        torch.cuda.synchronize()
        res[where] = ({k: v.cpu() for k, v in t_d.items()}, out.cpu().double())
    a, b, c = res["registers"][1], res["smem"][1], res["registers2"][1]
    live = ~a.isnan()
    d = (a - b).abs()[live]
    nz = (d > 0)
    print(fmt, shape, act, knobs, "differing", int(nz.sum()), "of", int(live.sum()),
          "max rel", float((d / a.abs()[live].clamp_min(1e-30)).max()),
          "regs run-to-run equal", bool(torch.equal(a.nan_to_num(), c.nan_to_num())))
    idx = ((a - b).abs().nan_to_num() > 0).nonzero()
    print("  first differing (slot, head, row):", idx[:8].tolist())
    print("  cursors:", t["cursors"].tolist())
    for k in ("ring_x", "ring_dt", "ring_B", "cursors"):
        x, y = res["registers"][0][k], res["smem"][0][k]
        print("  ", k, "equal" if torch.equal(x.nan_to_num(), y.nan_to_num()) else "DIFFER")
