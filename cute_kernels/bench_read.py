"""Timing of the non-flush (read-path) kernels at the Nemotron-3-Super layer shape (or, with
``--shape mamba2-2.7b``, Mamba-2 2.7B's one group of 80 heads).

    python -m cute_kernels.bench_read --batch 256 512 --out results/bench_read.csv
    python -m cute_kernels.bench_read --knob-variants --batch 256   # L2 prefetch, layouts
    python -m cute_kernels.bench_read --ablations --batch 256       # stages left out
    python -m cute_kernels.bench_read --early-variants --batch 1 256  # prologue loads together
    python -m cute_kernels.bench_read --pass-variants --batch 256     # two heads a pass
    python -m cute_kernels.bench_read --eager-variants --batch 1 8    # loads with the cursor's
    python -m cute_kernels.bench_read --splits-sweep --shape mamba2-2.7b --splits 1 2 4 5 \
        --batch 32 128 512                                            # head splits

For each read-copy format (nvfp4, fp8_e4m3, fp16, fp32 = the single-copy FP32 ReplaySSM
baseline) and batch: checks the kernel against the fp64 reference on the first slots (a
format whose check fails is reported, never timed), then times it with CUDA-graph replays over
``sets`` independent buffer sets (each a full cache: the working set is far beyond the 50 MB
L2, so no call finds its state in cache), resetting the cursors between replays outside the
timed region so every call runs at the same ``h``. Bytes moved follow
`replay_output.traffic_bytes`. The ceilings come from the same run, after a ~1 s warm-up: a
device-to-device copy (bytes read + written) and a streaming read (16-byte loads).
Prints one table last; writes a tidy CSV when ``--out`` is given. Ablations (a stage left
out, `ReplayOutputConfig.ablate`) give wrong outputs by design: they are timed without the
check, whose column then reads nan.
"""

from __future__ import annotations  # noqa: I001  (_compile must precede cutlass)

import argparse
import statistics
import time

import torch

from cute_kernels import _compile
from cute_kernels import replay_output as ro
from lowprec import models
from lowprec._checks import repeated
from lowprec._paths import file_problem

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32


def _model_layer(name: str) -> dict:
    """The Mamba-2 layer of the lowprec.models shape `name`, in replay_output's names."""
    ssm = models.get(name).ssm
    return dict(nheads=ssm.nheads, headdim=ssm.d_v, dstate=ssm.d_k, ngroups=ssm.ngroups)


# --shape: the layer timed, experiments.kernel_bench's shapes (mamba2-2.7b: one group of 80)
SHAPES = {name: _model_layer(name) for name in ("nemotron3-super", "mamba2-2.7b")}
NEMOTRON = SHAPES["nemotron3-super"]
SHAPE = dict(NEMOTRON)


# --------------------------------------------------------------------------------------------
# ceilings


class StreamRead:
    """Reads ``n16`` 16-byte chunks, four loads in flight per lane, XOR-folds them into one
    word per thread (so nothing is optimised away)."""

    threads = 256

    @cute.jit
    def __call__(self, src: cute.Pointer, dst: cute.Pointer, n16: Int32, blocks: Int32, stream):
        self.kernel(src, dst, n16).launch(grid=[blocks, 1, 1], block=[self.threads, 1, 1],
                                          stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Pointer, dst: cute.Pointer, n16: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        stride = nblk * self.threads
        i = bid * self.threads + tid
        acc = Uint32(0)
        base = src.toint()
        while i + 3 * stride < n16:
            for u in cutlass.range_constexpr(4):
                w = ro._load_words(base + Int64(i + u * stride) * 16, 4, True)
                acc = acc ^ w[0] ^ w[1] ^ w[2] ^ w[3]
            i = i + 4 * stride
        while i < n16:
            w = ro._load_words(base + Int64(i) * 16, 4, True)
            acc = acc ^ w[0] ^ w[1] ^ w[2] ^ w[3]
            i = i + stride
        ro._store_words(dst.toint() + Int64(bid * self.threads + tid) * 4, [acc])


# GPU cycles of spin queued before each timed region (about 100 us on the H200; kernel_bench's
# LEAD_CYCLES, tests/test_kernel_bench.py keeps the two equal), so that the
# start event fires with the work already queued and the host's submission is not timed (as
# experiments/kernel_bench.py does; the CSVs of gpu_first_timing/ before 2026-11-30 were timed
# without it, which added the host's few microseconds a replay)
LEAD_CYCLES = 200_000

# Untimed passes over a case's buffer sets before its timed replays (kernel_bench's
# WARM_REPLAYS; tests/test_kernel_bench.py keeps the two equal): on the H200 a freshly built
# buffer set runs about 6% slower for its first 10-26 passes (experiments/warm_transient.py,
# results/README.md, "Twenty-sixth session"). Before 2026-12-01 a case was timed after one
# untimed passes, so this tool's CSVs in gpu_first_timing/ sit in that transient, every
# variant alike.
WARM_REPLAYS = 32


def _time_ms(fn, reps=30):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda._sleep(LEAD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings(nbytes=2**30):
    """(copy GB/s counting read + write, streaming-read GB/s), after a ~1 s warm-up."""
    src = torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    t_end = time.time() + 1.0
    while time.time() < t_end:
        dst.copy_(src)
    torch.cuda.synchronize()
    copy_ms = _time_ms(lambda: dst.copy_(src))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = sms * 8
    out = torch.empty(blocks * StreamRead.threads, dtype=torch.int32, device="cuda")
    kernel = _compile.compile_cached(("stream_read",), lambda: cute.compile(
        StreamRead(), _compile.fake_ptr(cutlass.Int32), _compile.fake_ptr(cutlass.Int32),
        Int32(1), Int32(1), _compile.fake_stream(),
    ))
    args = (_compile.gmem_ptr(src), _compile.gmem_ptr(out), Int32(nbytes // 16), Int32(blocks))

    def read():
        kernel(*args, _compile.current_stream())

    read()
    read_ms = _time_ms(read)
    return 2 * nbytes / copy_ms / 1e6, nbytes / read_ms / 1e6


# --------------------------------------------------------------------------------------------
# the read kernels


def make_set(fmt, batch, h, window, gen_seed):
    """One decode step's buffers on the GPU, every slot holding h - 1 records."""
    S, H, P, N, G = batch, SHAPE["nheads"], SHAPE["headdim"], SHAPE["dstate"], SHAPE["ngroups"]
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(gen_seed)
    bf = torch.bfloat16

    def rn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    if fmt == "nvfp4":
        lo = {
            "codes": torch.randint(0, 256, (S, H, P, N // 2), generator=gen, device=dev,
                                   dtype=torch.int32).to(torch.uint8),
            "scales": torch.randint(0x20, 0x40, (S, H, P, N // 16), generator=gen, device=dev,
                                    dtype=torch.int32).to(torch.uint8),
            "global": rn(S, H).abs() * 1e-3,
        }
    elif fmt == "fp8_e4m3":
        lo = {"codes": rn(S, H, P, N).to(torch.float8_e4m3fn).view(torch.uint8)}
    elif fmt == "fp16":
        lo = {"values": rn(S, H, P, N).half()}
    else:
        lo = {"values": rn(S, H, P, N)}
    t = dict(
        ring_x=rn(S, H, window, P).to(bf),
        ring_dt=rn(S, H, window).abs() * 0.5,
        ring_B=rn(S, G, window, N).to(bf),
        cursors=torch.full((S,), h - 1, dtype=torch.int32, device=dev),
        x=rn(S, H, P).to(bf),
        dt=rn(S, H) - 1.0,
        A=-torch.exp(rn(H) * 0.5),
        B=rn(S, G, N).to(bf),
        C=rn(S, G, N).to(bf),
        D=rn(H),
        dt_bias=rn(H) * 0.1,
    )
    return lo, t


def dequantized(fmt, lo):
    """The read copy as fp64 (for the reference check)."""
    if fmt == "nvfp4":
        from lowprec.formats import E2M1, E4M3
        from lowprec.quantize import decode_bits

        c = lo["codes"].long()
        codes = torch.stack((c & 0xF, c >> 4), dim=-1).flatten(-2)
        values = decode_bits(codes.cpu(), E2M1, torch.float64)
        scales = decode_bits(lo["scales"].long().cpu(), E4M3, torch.float64)
        values = values.reshape(*values.shape[:-1], -1, 16) * scales[..., None]
        return values.flatten(-2) * lo["global"].double().cpu()[..., None, None]
    if fmt == "fp8_e4m3":
        return lo["codes"].view(torch.float8_e4m3fn).double().cpu()
    return lo["values"].double().cpu()


def call(fmt, lo, t, window, out, knobs=None):
    return ro.replay_output(
        lo, t["ring_x"], t["ring_dt"], t["ring_B"], t["cursors"], t["x"], t["dt"], t["A"],
        t["B"], t["C"], t["D"], None, t["dt_bias"], True, out, window=window, lo_format=fmt,
        **(knobs or {}),
    )


def check(fmt, lo, t, window, knobs=None, slots=4):
    """Max |out - ref| / (2^-8 |ref| + 2^-14 mag) over the first ``slots`` (pass: <= 1)."""
    from lowprec.mamba2 import mamba2_process_dt, mamba2_replay_output

    start = t["cursors"].clone()
    out = torch.full_like(t["x"], float("nan"))
    call(fmt, lo, t, window, out, knobs)
    torch.cuda.synchronize()
    t["cursors"].copy_(start)
    sl = slice(0, slots)
    d = {k: v[sl].double().cpu() for k, v in t.items() if k not in ("A", "D", "dt_bias")}
    A, D, bias = (t[k].double().cpu() for k in ("A", "D", "dt_bias"))
    cur = start[sl].long().cpu()
    rows = torch.arange(len(cur))
    rx, rdt, rB = d["ring_x"].clone(), d["ring_dt"].clone(), d["ring_B"].clone()
    rx[rows, :, cur] = d["x"]
    rdt[rows, :, cur] = mamba2_process_dt(d["dt"], bias, True)
    rB[rows, :, cur] = d["B"]
    ck = dequantized(fmt, {k: v[sl] for k, v in lo.items()})
    y = mamba2_replay_output(ck, rx, rdt, rB, cur + 1, d["C"], d["x"], A, D)
    mag = mamba2_replay_output(ck.abs(), rx.abs(), rdt, rB.abs(), cur + 1, d["C"].abs(),
                               d["x"].abs(), A, D.abs())
    err = (out[sl].double().cpu() - y).abs() / (2.0**-8 * y.abs() + 2.0**-14 * mag)
    return float(err.nan_to_num(float("inf")).max())


def time_format(fmt, batch, h, window, sets, reps, knobs=None):
    """(median microseconds per call, check ratio)."""
    bufs = [make_set(fmt, batch, h, window, 1000 + i) for i in range(sets)]
    ratio = check(fmt, *bufs[0], window, knobs)
    if knobs and knobs.get("ablate"):
        ratio = float("nan")  # timing only: a stage is left out, the outputs are wrong
    elif not ratio <= 1.0:
        return float("nan"), ratio
    outs = [torch.empty_like(t["x"]) for _, t in bufs]
    starts = [t["cursors"].clone() for _, t in bufs]

    def reset():
        for (_, t), c in zip(bufs, starts, strict=True):
            t["cursors"].copy_(c)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for (lo, t), o in zip(bufs, outs, strict=True):
            call(fmt, lo, t, window, o, knobs)
    torch.cuda.current_stream().wait_stream(stream)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for (lo, t), o in zip(bufs, outs, strict=True):
            call(fmt, lo, t, window, o, knobs)
    for _ in range(WARM_REPLAYS):  # past the new buffers' slow first passes
        reset()
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        reset()
        torch.cuda._sleep(LEAD_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / sets)
    return statistics.median(times), ratio


# Tuning variants timed besides the defaults: (format, warps per CTA, prefetch the next
# head, load a head's whole read copy first, CTAs per group). The head splits matter at small
# batches: --splits-sweep times a grid of them (results/gpu_first_timing/bench_read_splits_3.csv).
VARIANTS = [("nvfp4", 4, False, True, 1), ("nvfp4", 8, False, True, 1),
            ("nvfp4", 16, False, True, 1), ("nvfp4", 4, True, True, 1),
            ("nvfp4", 8, False, False, 1), ("fp8_e4m3", 8, False, False, 1),
            ("fp32", 4, False, None, 1), ("nvfp4", 4, False, True, 4),
            ("nvfp4", 1, False, True, 16), ("fp32", 8, False, None, 2)]
# Register caps (format, warps, resident CTAs per SM ptxas must allow): 5 -> 96 registers,
# 6 -> 80 for nvfp4 at 4 warps (more warps resident, a few spills).
MIN_CTAS_VARIANTS = [("nvfp4", 4, 5), ("nvfp4", 4, 6), ("fp8_e4m3", 4, 5)]
# The read copy staged through shared memory (format, warps, min CTAs per SM or None):
STAGE_VARIANTS = [("nvfp4", 4, None), ("nvfp4", 4, 5), ("nvfp4", 2, None), ("nvfp4", 2, 10)]

# Knobs at their defaults but one (format, knobs): bulk L2 prefetch of the next heads' read
# copy and ring records, the quad-major layout of the nvfp4 partial sums, two CTAs a group.
KNOB_VARIANTS = [
    ("nvfp4", dict(l2_prefetch=1)), ("nvfp4", dict(l2_prefetch=2)),
    ("nvfp4", dict(ys_layout="quads")), ("nvfp4", dict(l2_prefetch=1, ys_layout="quads")),
    ("fp8_e4m3", dict(l2_prefetch=1)), ("fp16", dict(l2_prefetch=1)),
    ("nvfp4", dict(head_splits=2)),  # 2 heads a warp: half the unrolled code
    ("nvfp4", dict(l2_prefetch=1, l2_prefetch_small=True)),
    ("nvfp4", dict(l2_prefetch=2, l2_prefetch_small=True)),
    ("nvfp4", dict(l2_prefetch=3, l2_prefetch_small=True)),
    ("fp8_e4m3", dict(l2_prefetch=1, l2_prefetch_small=True)),
    ("fp16", dict(l2_prefetch=1, l2_prefetch_small=True)),
]


# The prologue's loads issued together and the cursor atomic acted on after the heads
# (`ReplayOutputConfig.early_loads`), alone and with the other ways of overlapping loads.
EARLY_VARIANTS = [
    ("nvfp4", dict(early_loads=True)), ("nvfp4", dict(early_loads=True, prefetch=True)),
    ("nvfp4", dict(early_loads=True, stage="smem")),
    ("nvfp4", dict(early_loads=True, head_splits=2)),
    ("fp8_e4m3", dict(early_loads=True)), ("fp16", dict(early_loads=True)),
    ("fp32", dict(early_loads=True)),
]


# A warp's heads two at a time (`ReplayOutputConfig.heads_per_pass`): at the 128-register
# cap of 4 CTAs an SM (a few spills) and at 168 registers, 3 CTAs an SM (none).
PASS_VARIANTS = [
    ("nvfp4", dict(early_loads=True)), ("nvfp4", dict(early_loads=True, min_ctas_per_sm=3)),
    ("nvfp4", dict(early_loads=True, heads_per_pass=2)),
    ("nvfp4", dict(early_loads=True, heads_per_pass=2, min_ctas_per_sm=3)),
    ("fp8_e4m3", dict(early_loads=True)),
    ("fp8_e4m3", dict(early_loads=True, heads_per_pass=2, min_ctas_per_sm=3)),
]


# The first loads issued with the cursor's (`ReplayOutputConfig.eager_loads`, off by
# default: measured slower), forced on and off.
EAGER_VARIANTS = [
    ("nvfp4", dict(eager_loads=False)), ("nvfp4", dict(eager_loads=True)),
    ("fp32", dict(eager_loads=False)), ("fp32", dict(eager_loads=True)),
    ("fp8_e4m3", dict(eager_loads=False)), ("fp16", dict(eager_loads=False)),
]


# The read copy's loads pinned where the code issues them (`ReplayOutputConfig.pin_state_loads`),
# alone and with the next head's loads issued before the current head's work (prefetch).
PIN_VARIANTS = [
    ("nvfp4", dict(pin_state_loads=True)), ("nvfp4", dict(prefetch=True, pin_state_loads=True)),
    ("nvfp4", dict(prefetch=True)), ("fp8_e4m3", dict(pin_state_loads=True)),
    ("fp16", dict(pin_state_loads=True)), ("fp32", dict(pin_state_loads=True)),
]


# Where a warp works out its heads' decay weights (`ReplayOutputConfig.weights_at`): each
# format with the placement that is not its default (nvfp4: before the decode, the seventh
# session's form; the others: beside the first pass's checkpoint term).
WEIGHTS_VARIANTS = [("nvfp4", dict(weights_at="before_decode"))] + [
    (fmt, dict(weights_at="with_decode")) for fmt in ("fp8_e4m3", "fp16", "fp32")
]


# Where a head's ring records wait (`ReplayOutputConfig.ring_stage`): each format in the form
# that is not its default at L >= 16 (nvfp4: registers; the others: staged through shared
# memory), and nvfp4 staged with the next head prefetched (faster on the Nemotron layer at
# L = 16 only, `ReplayOutputConfig.prefetch`).
RING_VARIANTS = [("nvfp4", dict(ring_stage="registers")),
                 ("nvfp4", dict(ring_stage="smem", prefetch=True))] + [
    (fmt, dict(ring_stage="smem")) for fmt in ("fp8_e4m3", "fp16", "fp32")
]


# Stages left out, timing only (`ReplayOutputConfig.ablate`; the outputs are wrong, so the
# check is reported as nan): where the non-flush nvfp4 step's time goes.
ABLATION_VARIANTS = [
    ("nvfp4", dict(ablate=("scales",))), ("nvfp4", dict(ablate=("ring",))),
    ("nvfp4", dict(ablate=("decode",))), ("nvfp4", dict(ablate=("state",))),
    ("nvfp4", dict(ablate=("decode", "ring"))), ("nvfp4", dict(ablate=("ring", "state"))),
    ("nvfp4", dict(ablate=("decode", "ring", "scales"))),
    ("fp8_e4m3", dict(ablate=("decode",))), ("fp8_e4m3", dict(ablate=("ring", "state"))),
    # the prologue's loads, and with them the cursor's round trip (seventeenth session): what
    # hiding the prologue behind the previous (slot, group)'s heads could buy at most
    ("nvfp4", dict(ablate=("prologue",))), ("nvfp4", dict(ablate=("cursor", "prologue"))),
    ("nvfp4", dict(ablate=("cursor", "prologue", "ring", "state"))),
]


# The prologue left out (timing only) beside the forms that bring the read copy in ahead:
# what the read copy's staging and the prologue's hiding could buy together (seventeenth
# session).
_NO_PROLOGUE = ("cursor", "prologue")
PROLOGUE_VARIANTS = [
    ("nvfp4", dict(ablate=_NO_PROLOGUE)),
    ("nvfp4", dict(stage="bulk")), ("nvfp4", dict(stage="bulk", ablate=_NO_PROLOGUE)),
    ("nvfp4", dict(stage="bulk", eager_loads=True)),
    ("nvfp4", dict(prefetch=True)), ("nvfp4", dict(prefetch=True, ablate=_NO_PROLOGUE)),
    ("nvfp4", dict(eager_loads=True, prefetch=True)),
]


# The small-batch grid (--splits-sweep): (format, warps, head_splits), each a CTA of
# `warps` warps per 1/head_splits of a group's 16 heads, at the default prefetch and upfront.
SPLITS_SWEEP = [("nvfp4", 4, 1), ("nvfp4", 4, 2), ("nvfp4", 4, 4), ("nvfp4", 2, 4),
                ("nvfp4", 2, 8), ("nvfp4", 1, 8), ("nvfp4", 1, 16), ("fp32", 8, 1),
                ("fp32", 8, 2), ("fp32", 4, 2), ("fp32", 4, 4), ("fp32", 2, 8)]


# The flags that time the defaults and one of the lists above only: flag -> (list's name,
# what it varies). The last one given wins.
VARIANT_LISTS = {
    "knob-variants": ("KNOB_VARIANTS", "L2 prefetch, partial-sum layout"),
    "ablations": ("ABLATION_VARIANTS", "stages left out, timing only"),
    "early-variants": ("EARLY_VARIANTS", "prologue loads issued together"),
    "pass-variants": ("PASS_VARIANTS", "two heads a warp at once"),
    "eager-variants": ("EAGER_VARIANTS", "first loads with the cursor's"),
    "pin-variants": ("PIN_VARIANTS", "state loads kept where issued"),
    "weights-variants": ("WEIGHTS_VARIANTS", "the other decay-weights place"),
    "ring-variants": ("RING_VARIANTS", "ring records in registers or staged, and prefetch"),
    "prologue-variants": ("PROLOGUE_VARIANTS", "the prologue left out, with staging"),
}


def run(batches, h, window, sets, reps, out=None, variants=True, splits_sweep=False,
        splits=None, only=None):
    """Times the defaults of every format and (variants) the tuning lists, or with `only`
    (a list's name, VARIANT_LISTS) the defaults and that list, or (splits_sweep) the
    small-batch grid."""
    copy_gbs, read_gbs = ceilings()
    rows = []
    cases = [(fmt, None) for fmt in ro.LO_FORMATS]
    if variants:
        cases += [(fmt, dict(warps=w, prefetch=p, upfront=u, head_splits=k))
                  for fmt, w, p, u, k in VARIANTS]
        cases += [(fmt, dict(warps=w, prefetch=False, upfront=None, head_splits=1,
                             min_ctas_per_sm=m))
                  for fmt, w, m in MIN_CTAS_VARIANTS]
        cases += [(fmt, dict(warps=w, prefetch=False, upfront=None, head_splits=1,
                             min_ctas_per_sm=m, stage="smem"))
                  for fmt, w, m in STAGE_VARIANTS]
        cases += list(KNOB_VARIANTS)
    if only:
        cases = [(fmt, None) for fmt in ro.LO_FORMATS] + list(globals()[only])
    if splits_sweep:
        cases = [(fmt, None) for fmt in ("nvfp4", "fp32")]
        grid = SPLITS_SWEEP if not splits else [("nvfp4", 4, k) for k in splits]
        cases += [(fmt, dict(warps=w, prefetch=False, upfront=None, head_splits=k))
                  for fmt, w, k in grid]
    for batch in batches:
        for fmt, knobs in cases:
            if knobs and "cursor" in knobs.get("ablate", ()) and h != window // 2:
                print(f"skipped {fmt} without the cursor: it stands for h = window / 2 only")
                continue
            us, ratio = time_format(fmt, batch, h, window, sets, reps, knobs)
            nbytes = ro.traffic_bytes(fmt, batch, **SHAPE, h=h)
            name = fmt
            if knobs is not None and "ablate" in knobs:
                others = [f"{k}={v}" for k, v in knobs.items() if k != "ablate"]
                name += "/" + ",".join(others + ["no-" + "-".join(knobs["ablate"])])
            elif knobs is not None and "warps" not in knobs:  # a KNOB_VARIANTS entry
                name += "/" + ",".join(f"{k}={v}" for k, v in knobs.items())
            elif knobs is not None:
                name += f"/w{knobs['warps']}" + ("p" if knobs["prefetch"] else "")
                name += "" if knobs["upfront"] in (True, None) else "l"  # lazy state loads
                name += f"/s{knobs['head_splits']}" if knobs["head_splits"] > 1 else ""
                if knobs.get("min_ctas_per_sm") is not None:
                    name += f"/m{knobs['min_ctas_per_sm']}"
                name += "/smem" if knobs.get("stage") == "smem" else ""
            rows.append(dict(
                format=name, shape=next(k for k, v in SHAPES.items() if v == SHAPE),
                batch=batch, h=h, window=window, us=us, bytes=nbytes,
                gbs=nbytes / us / 1e3 if us == us else float("nan"), check=ratio,
                copy_gbs=copy_gbs, read_gbs=read_gbs,
                device=torch.cuda.get_device_name(0),
            ))
    fp32_us = {r["batch"]: r["us"] for r in rows if r["format"] == "fp32"}
    print(f"\ncopy {copy_gbs:,.0f} GB/s (read + write), streaming read {read_gbs:,.0f} GB/s")
    print(f"{'format':>14} {'batch':>5} {'h':>3} {'us':>9} {'MB':>8} {'GB/s':>7} "
          f"{'%copy':>6} {'%read':>6} {'x fp32':>7} {'check':>6}")
    for r in rows:
        print(f"{r['format']:>14} {r['batch']:>5} {r['h']:>3} {r['us']:>9.1f} "
              f"{r['bytes'] / 1e6:>8.1f} {r['gbs']:>7.0f} {100 * r['gbs'] / copy_gbs:>6.1f} "
              f"{100 * r['gbs'] / read_gbs:>6.1f} {fp32_us[r['batch']] / r['us']:>7.2f} "
              f"{r['check']:>6.3f}")
    if out:  # after the table, so that a failed write loses no measurement
        write_csv(out, rows)
    return rows


def write_csv(path, rows):
    """The rows as a tidy CSV at `path` (its folder made); a write that fails after the
    timing is a one-line error, with the table already printed."""
    import csv
    import os

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    except OSError as error:
        raise SystemExit(f"bench_read: --out {path}: {error.strerror or error} (the table above "
                         "is all that is left of this run)") from None
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m cute_kernels.bench_read",
        allow_abbrev=False,  # a flag reads the same in a results file as in --help
        description=" ".join(__doc__.split("\n\n")[0].split()) + " Needs a CUDA GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[256, 512], help="batch sizes")
    p.add_argument("--h", type=int, default=8,
                   help="records held after the append, 1 .. window - 1")
    p.add_argument("--window", type=int, default=16, help="window L")
    p.add_argument("--sets", type=int, default=4, help="buffer sets rotated per graph replay")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays per case")
    p.add_argument("--out", default=None, help="CSV path; without it only the table is printed")
    p.add_argument("--no-variants", action="store_true", help="time the defaults only")
    for flag, (name, what) in VARIANT_LISTS.items():
        p.add_argument(f"--{flag}", action="store_true",
                       help=f"the defaults and {name} only ({what})")
    p.add_argument("--shape", choices=list(SHAPES), default="nemotron3-super",
                   help="layer shape")
    p.add_argument("--splits", type=int, nargs="+", default=None,
                   help="with --splits-sweep: nvfp4 at 4 warps and these head_splits only")
    p.add_argument("--splits-sweep", action="store_true",
                   help="nvfp4 and fp32 only, over (warps, head_splits): the small-batch grid")
    a = p.parse_args(argv)
    for name in ("batch", "splits"):
        if any(v < 1 for v in getattr(a, name) or ()):
            p.error(f"--{name}: expected positive integers, got {getattr(a, name)}")
    for name in ("window", "sets", "reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name}: expected an integer >= 1, got {getattr(a, name)}")
    if not 1 <= a.h < a.window:
        p.error(f"--h: expected 1 .. {a.window - 1} (window {a.window}), got {a.h}")
    lists = [f"--{flag}" for flag in VARIANT_LISTS if getattr(a, flag.replace("-", "_"))]
    if len(lists) > 1:  # only the last one was run
        p.error(f"{lists[1]}: one variant list at a time (also given: {lists[0]})")
    if lists and (a.no_variants or a.splits_sweep):
        p.error(f"{lists[0]}: not with {'--no-variants' if a.no_variants else '--splits-sweep'}")
    if a.no_variants and a.splits_sweep:
        p.error("--no-variants: not with --splits-sweep")
    if a.splits is not None and not a.splits_sweep:  # was ignored
        p.error("--splits: only with --splits-sweep")
    heads = SHAPES[a.shape]["nheads"] // SHAPES[a.shape]["ngroups"]
    if a.splits and (bad := [k for k in a.splits if heads % (4 * k)]):  # the sweep's 4 warps
        p.error(f"--splits: {', '.join(map(str, bad))}: head_splits * 4 warps must divide the "
                f"{heads} heads of a group of {a.shape}")
    if repeated(a.batch) or repeated(a.splits or ()):
        p.error("--batch/--splits: a value given twice")
    if a.out is not None and (problem := file_problem(a.out)):  # before the timing, not after
        p.error(f"--out: {problem}")
    if not torch.cuda.is_available():
        p.exit(2, "bench_read: needs a CUDA GPU (torch.cuda.is_available() is False)\n")
    SHAPE.clear()
    SHAPE.update(SHAPES[a.shape])
    given = [name for flag, (name, _) in VARIANT_LISTS.items()
             if getattr(a, flag.replace("-", "_"))]
    run(a.batch, a.h, a.window, a.sets, a.reps, a.out, not a.no_variants, a.splits_sweep,
        a.splits, given[-1] if given else None)


if __name__ == "__main__":
    main()
