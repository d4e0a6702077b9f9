"""Timing of the write-path kernels at the Nemotron-3-Super layer shape (first timing).

    python -m cute_kernels.bench_write --batch 256 --out results/bench_write.csv

Kernels (128 heads, 64 x 128 states, 8 groups, window 16, bf16 activations):

    flush fp16-SR + nvfp4     the two-precision flush, every slot flushing
    flush fp32 single copy    the single-copy FP32 ReplaySSM flush, every slot flushing
    flush ..., <what differs> the same flush with a stage left out (no SR, no read copy;
                              "no global loads": timing only, FlushConfig.ablate), or with
                              the fold, chunk, layout or register cap that the defaults
                              replaced (FlushConfig), for comparison
    flush, no slot flushing   the same launch when no slot flushes (the cost of a skip)
    state_update fp32 / fp16 RN / fp16 SR   the conventional every-token step
    window/token fp16-SR + nvfp4 | fp32 single copy   16 replay_decode_step calls with the
                              slots staggered over the ring (each flushes once), per token

Each kernel is first checked on a few slots against lowprec (codes bit for bit where the
contract says so, the state to a relative 1e-4 of its magnitude); a failed check is reported
and its kernel not timed. Timing: CUDA-graph replays of `reps` launches rotating over `sets`
independent buffer sets, after a ~1 s warm-up of the card; the median (and min-max) over
`replays` replays, per launch. Bytes follow each kernel's `traffic_bytes` (each input read
once, each output written once); the copy ceiling is a device-to-device copy of 1 GiB (bytes
read + written) timed in the same run. Prints one table last; writes a tidy CSV with --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch

from cute_kernels import bench_read
from cute_kernels import replay_flush as rf
from cute_kernels import state_update as su
from lowprec import mamba2, philox
from lowprec import quantize as q
from lowprec._paths import file_problem
from lowprec.formats import FP16

# the layer timed: lowprec.models' nemotron3-super, as bench_read and kernel_bench take it
NEMOTRON = bench_read.NEMOTRON
ACT = torch.bfloat16


@dataclass
class BenchConfig:
    batch: int = 256
    window: int = 16
    sets: int = 3
    reps: int = 12
    replays: int = 15
    seed: int = 0x5EED


# --------------------------------------------------------------------------------------------
# inputs


def randn(gen, *shape, dtype=ACT, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def make_token(batch, gen):
    H, P, N, G = (NEMOTRON[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    return dict(
        x=randn(gen, batch, H, P),
        dt=randn(gen, batch, H, dtype=torch.float32),
        A=-(0.2 + 1.8 * torch.rand(H, generator=gen, device="cuda")),
        B=randn(gen, batch, G, N),
        C=randn(gen, batch, G, N),
        D=randn(gen, H, dtype=torch.float32),
        z=randn(gen, batch, H, P),
        dt_bias=randn(gen, H, dtype=torch.float32, scale=0.5),
    )


def make_cache(batch, window, hi_format, lo_format, gen, cursors):
    H, P, N, G = (NEMOTRON[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    hi_dtype = torch.float16 if hi_format == "fp16" else torch.float32
    lo = None
    if lo_format == "nvfp4":
        lo = dict(
            codes=torch.zeros(batch, H, P, N // 2, dtype=torch.uint8, device="cuda"),
            scales=torch.zeros(batch, H, P, N // 16, dtype=torch.uint8, device="cuda"),
            global_scale=torch.zeros(batch, H, device="cuda"),
        )
    cache = dict(
        hi=randn(gen, batch, H, P, N, dtype=hi_dtype),
        lo=lo,
        ring_x=randn(gen, batch, H, window, P),
        ring_dt=torch.nn.functional.softplus(randn(gen, batch, H, window, dtype=torch.float32) - 1),
        ring_B=randn(gen, batch, G, window, N),
        cursors=cursors.to(torch.int32).cuda(),
        flushes=torch.randint(0, 500, (batch,), generator=gen, device="cuda", dtype=torch.int32),
    )
    return cache  # the read copy's contents do not change the time: zeros


# --------------------------------------------------------------------------------------------
# checks (a kernel whose check fails is not timed)


def check_flush(hi_format, lo_format, window, seed, slots=4, **knobs):
    gen = torch.Generator(device="cuda").manual_seed(1)
    cache = make_cache(slots, window, hi_format, lo_format, gen, torch.full((slots,), window - 1))
    tok = make_token(slots, gen)
    before = {k: v.clone() for k, v in cache.items() if isinstance(v, torch.Tensor)}
    debug = torch.full_like(cache["hi"], float("nan"), dtype=torch.float32)
    rf.replay_flush(
        **cache,
        **tok,
        window=window,
        hi_format=hi_format,
        hi_rounding="sr",
        lo_format=lo_format,
        seed=seed,
        debug_state=debug,
        **knobs,
    )
    state = debug.cpu()
    ring = {k: cache[k].cpu().double() for k in ("ring_x", "ring_dt", "ring_B")}
    ref = mamba2.mamba2_replay_flush(
        before["hi"].cpu().double(),
        ring["ring_x"],
        ring["ring_dt"],
        ring["ring_B"],
        torch.full((slots,), window),
        tok["A"].cpu().double(),
    )
    scale = ref.abs().amax(dim=(-2, -1), keepdim=True)
    ok = bool(((state.double() - ref).abs() <= 1e-4 * scale).all())
    if hi_format == "fp16":
        rand = philox.random_words(
            seed, torch.arange(slots), before["flushes"].cpu().long(), state.shape[1:]
        )
        want = q.encode_bits(q.round_to(state, FP16, "sr", rand), FP16)
        ok &= torch.equal(cache["hi"].cpu().view(torch.int16).long() & 0xFFFF, want)
    else:
        ok &= torch.equal(cache["hi"].cpu(), state)
    if lo_format == "nvfp4":
        packed = q.pack(q.quantize(state, "nvfp4", "rn"))
        ok &= all(torch.equal(cache["lo"][k].cpu(), packed[k]) for k in packed)
    ok &= bool(cache["cursors"].eq(0).all())
    return ok


def check_state_update(state_dtype, rounding, seed, slots=4):
    gen = torch.Generator(device="cuda").manual_seed(2)
    H, P, N = NEMOTRON["nheads"], NEMOTRON["headdim"], NEMOTRON["dstate"]
    state = randn(gen, slots, H, P, N, dtype=state_dtype)
    tok = make_token(slots, gen)
    before = state.cpu().double()
    counters = torch.arange(slots, dtype=torch.int32, device="cuda") if rounding == "sr" else None
    debug = torch.empty(slots, H, P, N, device="cuda")
    out = su.state_update(
        state, **tok, rounding=rounding, seed=seed, counters=counters, debug_state=debug
    )
    t = {k: v.cpu().double() for k, v in tok.items()}
    y_ref, s_ref = mamba2.mamba2_step(
        before, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"]
    )
    new = debug.cpu()
    ok = bool(((new.double() - s_ref).abs() <= 1e-4 * s_ref.abs().amax()).all())
    ok &= bool(((out.cpu().double() - y_ref).abs() <= 2e-2 * (1 + y_ref.abs())).all())
    if state_dtype == torch.float16:
        rand = None
        if rounding == "sr":
            rand = philox.random_words(
                seed, torch.arange(slots), torch.arange(slots), new.shape[1:]
            )
        want = q.encode_bits(q.round_to(new, FP16, rounding, rand), FP16)
        ok &= torch.equal(state.cpu().view(torch.int16).long() & 0xFFFF, want)
    return ok


# --------------------------------------------------------------------------------------------
# timing


def warm_up(seconds=1.0):
    a = torch.empty(2**28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            b.copy_(a)
        torch.cuda.synchronize()


def warm_graph_replays(sets: int, launches_a_replay: int) -> int:
    """Untimed replays of a graph of `launches_a_replay` launches cycling over `sets` buffer
    sets (launch r on set r % sets) so that every set it launches on gets at least
    bench_read.WARM_REPLAYS passes: new buffers run slower for their first 10-26 on the H200
    (experiments/warm_transient.py). The least-visited set gets launches // sets passes a
    replay (one, with fewer launches than sets)."""
    per_replay = max(1, launches_a_replay // sets)
    return -(-bench_read.WARM_REPLAYS // per_replay)


def time_graph(launches, reps, replays):
    """Per-launch ms (median, min, max) of a CUDA graph of `reps` launches cycling through
    `launches` (one callable per buffer set)."""
    for f in launches:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            launches[r % len(launches)]()
    for _ in range(warm_graph_replays(len(launches), reps)):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(bench_read.LEAD_CYCLES)  # the host's submission is not timed
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times), min(times), max(times)


def flush_config(batch, window, hi_format, lo_format, hi_rounding=None, elements_per_thread=None,
                 **knobs):
    """The flush at the Nemotron layer; elements per thread and fold as replay_flush's
    defaults; `knobs`: other FlushConfig fields (min_ctas_per_sm, fold, chunk, ...)."""
    if elements_per_thread is None:
        elements_per_thread = rf.default_elements_per_thread(NEMOTRON["headdim"],
                                                             NEMOTRON["dstate"], hi_format)
    return rf.FlushConfig(
        **NEMOTRON,
        window=window,
        ring_len=window,
        act="bf16",
        dt_dtype="fp32",
        hi_format=hi_format,
        hi_rounding=hi_rounding or ("sr" if hi_format == "fp16" else "rn"),
        lo_format=lo_format,
        has_D=True,
        has_z=True,
        has_dt_bias=True,
        dt_softplus=True,
        has_debug=False,
        elements_per_thread=elements_per_thread,
        **knobs,
    )


def bench_flush(
    cfg: BenchConfig, hi_format, lo_format, flushing=True, hi_rounding=None,
    elements_per_thread=None, **knobs,
):
    B, L = cfg.batch, cfg.window
    # the config first: a case whose knobs FlushConfig refuses fails here, before the GPU
    fcfg = flush_config(B, L, hi_format, lo_format, hi_rounding, elements_per_thread, **knobs)
    gen = torch.Generator(device="cuda").manual_seed(3)
    launches = []
    for _ in range(cfg.sets):
        cache = make_cache(B, L, hi_format, "none", gen, torch.full((B,), L - 1 if flushing else 0))
        if lo_format == "nvfp4":
            H, P, N = NEMOTRON["nheads"], NEMOTRON["headdim"], NEMOTRON["dstate"]
            cache["lo"] = dict(
                codes=torch.zeros(B, H, P, N // 2, dtype=torch.uint8, device="cuda"),
                scales=torch.zeros(B, H, P, N // 16, dtype=torch.uint8, device="cuda"),
                global_scale=torch.zeros(B, H, device="cuda"),
            )
        tok = make_token(B, gen)
        out = torch.empty_like(tok["x"])
        lo = cache["lo"] or {}

        def launch(c=cache, t=tok, o=out, lo=lo):
            rf.launch_flush(
                fcfg,
                c["hi"],
                lo,
                c["ring_x"],
                c["ring_dt"],
                c["ring_B"],
                c["cursors"],
                c["flushes"],
                t["x"],
                t["dt"],
                t["A"],
                t["B"],
                t["C"],
                t["D"],
                t["z"],
                t["dt_bias"],
                o,
                None,
                cfg.seed,
            )

        launches.append(launch)
    ms = time_graph(launches, cfg.reps, cfg.replays)
    return ms, rf.traffic_bytes(fcfg, B if flushing else 0)


def bench_state_update(cfg: BenchConfig, state_dtype, rounding):
    gen = torch.Generator(device="cuda").manual_seed(4)
    B = cfg.batch
    H, P, N = NEMOTRON["nheads"], NEMOTRON["headdim"], NEMOTRON["dstate"]
    launches = []
    for _ in range(cfg.sets):
        state = randn(gen, B, H, P, N, dtype=state_dtype, scale=0.1)
        tok = make_token(B, gen)
        out = torch.empty_like(tok["x"])
        counters = torch.zeros(B, dtype=torch.int32, device="cuda") if rounding == "sr" else None

        def launch(s=state, t=tok, o=out, c=counters):
            su.state_update(s, **t, out=o, rounding=rounding, seed=cfg.seed, counters=c)

        launches.append(launch)
    ms = time_graph(launches, cfg.reps, cfg.replays)
    name = "fp32" if state_dtype == torch.float32 else "fp16"
    return ms, su.traffic_bytes(name, B, H, P, N, NEMOTRON["ngroups"])


def bench_window(cfg: BenchConfig, hi_format, lo_format):
    """Per-token time of 16 consecutive decode steps with slot s starting at cursor s % L:
    every step has batch / L flushing slots, every slot flushes once."""
    from cute_kernels.replay_decode import replay_decode_step

    gen = torch.Generator(device="cuda").manual_seed(5)
    B, L = cfg.batch, cfg.window
    cache = make_cache(B, L, hi_format, lo_format, gen, torch.arange(B) % L)
    toks = [make_token(B, gen) for _ in range(2)]
    out = torch.empty_like(toks[0]["x"])

    def window():
        for step in range(L):
            replay_decode_step(
                **cache,
                **toks[step % 2],
                out=out,
                window=L,
                hi_format=hi_format,
                lo_format=lo_format,
                seed=cfg.seed,
            )

    ms = time_graph([window], 2, cfg.replays)
    return tuple(m / L for m in ms), None


# --------------------------------------------------------------------------------------------
# run


def bench_cases(cfg: BenchConfig) -> list:
    """(name, check, bench) of every case; nothing runs until a check or bench is called, so
    the names can be matched against ``--only`` on a machine without a GPU."""
    return [
        (
            "flush fp16-SR + nvfp4",
            lambda: check_flush("fp16", "nvfp4", cfg.window, cfg.seed),
            lambda: bench_flush(cfg, "fp16", "nvfp4"),
        ),
        (
            "flush fp32 single copy",
            lambda: check_flush("fp32", "none", cfg.window, cfg.seed),
            lambda: bench_flush(cfg, "fp32", "none"),
        ),
        # where the flush's time goes: the same kernel with a stage left out
        (
            "flush fp16-RN + nvfp4 (no Philox, no SR)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", hi_rounding="rn"),
        ),
        (
            "flush fp16-SR, no read copy (no NVFP4 encode)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "none"),
        ),
        (
            "flush fp16-RN, no read copy (fold, output, stores)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "none", hi_rounding="rn"),
        ),
        # timing only (FlushConfig.ablate): the same work without its loads' round trips,
        # the bound of any scheme that hides them (a CTA prefetching its next head)
        (
            "flush fp16-SR + nvfp4, no global loads (timing only)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", ablate=("loads",)),
        ),
        (
            "flush fp16-RN, no read copy, no global loads (timing only)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "none", hi_rounding="rn", ablate=("loads",)),
        ),
        # the layouts and folds the defaults replaced (correctness: the gpu tests of
        # tests/test_cute_replay_flush.py run each)
        (
            "flush fp16-SR + nvfp4, mma fold, 8-element chunks, no register cap",
            lambda: check_flush("fp16", "nvfp4", cfg.window, cfg.seed, fold="mma", chunk=8),
            lambda: bench_flush(cfg, "fp16", "nvfp4", fold="mma", chunk=8, min_ctas_per_sm=0),
        ),
        (
            "flush fp16-SR + nvfp4, mma fold, no register cap",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", fold="mma", min_ctas_per_sm=0),
        ),
        (
            "flush fp16-SR + nvfp4, no register cap",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", min_ctas_per_sm=0),
        ),
        (  # more warps an SM for more spills (static SASS, sm_90a: 4 CTAs 64 registers, 9
            # spill accesses; 5 CTAs 48 and 122; 6 CTAs 40 and 186). Slower: 634.7 us (the
            # default, 4 CTAs) against 729.4-734.3 (5) and 871.1-871.9 (6) at batch 256
            # (results/gpu_first_timing/bench_write_20c_{a,b}.csv)
            "flush fp16-SR + nvfp4, 5 CTAs an SM (48 registers)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", min_ctas_per_sm=5),
        ),
        (
            "flush fp16-SR + nvfp4, 6 CTAs an SM (40 registers)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", min_ctas_per_sm=6),
        ),
        (
            "flush fp16-SR + nvfp4, E2M1 codes one at a time",
            lambda: check_flush("fp16", "nvfp4", cfg.window, cfg.seed, e2m1_pairs=False),
            lambda: bench_flush(cfg, "fp16", "nvfp4", e2m1_pairs=False),
        ),
        (
            "flush fp16-SR + nvfp4, ring loads in turn (x, then B, then the dt chain)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", ring_loads_first=False),
        ),
        (
            "flush fp32 single copy, ring loads in turn",
            lambda: True,
            lambda: bench_flush(cfg, "fp32", "none", ring_loads_first=False),
        ),
        (
            "flush fp16-SR + nvfp4, FFMA fold",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", fold="fma"),
        ),
        (
            "flush fp16-SR + nvfp4, 64 elements per thread (128 threads)",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", elements_per_thread=64),
        ),
        (
            "flush fp32 single copy, FFMA fold",
            lambda: True,
            lambda: bench_flush(cfg, "fp32", "none", fold="fma"),
        ),
        (  # faster here (785.6 against 799.6 us, bench_write_8c.csv) but slower in the
            # benchmark (769.5 against 687.9): not the fp32 default
            "flush fp32 single copy, direct fold (32 elements per thread)",
            lambda: True,
            lambda: bench_flush(cfg, "fp32", "none", elements_per_thread=32, fold="direct"),
        ),
        (
            "flush, no slot flushing",
            lambda: True,
            lambda: bench_flush(cfg, "fp16", "nvfp4", flushing=False),
        ),
        (
            "state_update fp32",
            lambda: check_state_update(torch.float32, "rn", cfg.seed),
            lambda: bench_state_update(cfg, torch.float32, "rn"),
        ),
        (
            "state_update fp16 RN",
            lambda: check_state_update(torch.float16, "rn", cfg.seed),
            lambda: bench_state_update(cfg, torch.float16, "rn"),
        ),
        (
            "state_update fp16 SR",
            lambda: check_state_update(torch.float16, "sr", cfg.seed),
            lambda: bench_state_update(cfg, torch.float16, "sr"),
        ),
        ("window/token fp16-SR + nvfp4", lambda: True, lambda: bench_window(cfg, "fp16", "nvfp4")),
        ("window/token fp32 single copy", lambda: True, lambda: bench_window(cfg, "fp32", "none")),
    ]


def matches(name: str, only) -> bool:
    """Whether a case's name is one that ``--only`` asks for: it contains one of the strings,
    or is one given with a leading '='."""
    return any(name == o[1:] if o.startswith("=") else o in name for o in only)


def run(cfg: BenchConfig, only=None):
    """Checks and times every case (or those whose name contains one of the strings in
    ``only``); returns one row per case."""
    torch.manual_seed(0)
    rows = []
    cases = [c for c in bench_cases(cfg) if not only or matches(c[0], only)]
    warm_up()
    # The ceiling is measured the one way the kit measures it (bench_read.ceilings: warm
    # device-to-device copy of 1 GiB, events, median). A graph-replayed copy timed here right
    # after warm_up() read 2,708 GB/s on 2026-11-29 against 4,166 GB/s from ceilings() in the
    # same call: the lower figure was not a ceiling.
    copy_gbs, _ = bench_read.ceilings()
    for name, check, bench in cases:
        row = dict(
            kernel=name,
            batch=cfg.batch,
            window=cfg.window,
            check="",
            us=float("nan"),
            us_min=float("nan"),
            us_max=float("nan"),
            MB=float("nan"),
            GBs=float("nan"),
            copy_GBs=copy_gbs,
        )
        try:
            ok = check()
            row["check"] = "ok" if ok else "FAILED"
            if ok:
                (ms, ms_min, ms_max), nbytes = bench()
                row.update(us=1e3 * ms, us_min=1e3 * ms_min, us_max=1e3 * ms_max)
                if nbytes:
                    row.update(MB=nbytes / 1e6, GBs=nbytes / ms / 1e6)
        except Exception as e:  # report and go on: one broken kernel must not hide the rest
            row["check"] = f"error: {type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def print_table(rows):
    copy_gbs = rows[0]["copy_GBs"]
    print(
        f"\nbatch {rows[0]['batch']}, window {rows[0]['window']}; "
        f"device-to-device copy {copy_gbs:,.0f} GB/s (read + write)"
    )
    print(
        f"{'kernel':32s} {'check':>6s} {'us':>9s} {'min-max':>15s} {'MB':>8s} {'GB/s':>7s} "
        f"{'%copy':>6s}"
    )
    for r in rows:
        status = r["check"] if r["check"] in ("ok", "FAILED") else "error"
        spread = f"{r['us_min']:.1f}-{r['us_max']:.1f}"
        print(
            f"{r['kernel']:32s} {status:>6s} {r['us']:9.1f} {spread:>15s} {r['MB']:8.1f} "
            f"{r['GBs']:7.0f} {100 * r['GBs'] / copy_gbs:6.1f}"
        )
    us = {r["kernel"]: r["us"] for r in rows}
    two = us.get("window/token fp16-SR + nvfp4", float("nan"))
    print(
        f"conventional fp32 / two-precision window, per token: "
        f"{us.get('state_update fp32', float('nan')) / two:.2f}x (target 7.5x); "
        f"fp32 ReplaySSM / two-precision: "
        f"{us.get('window/token fp32 single copy', float('nan')) / two:.2f}x (target 4x)"
    )
    for r in rows:
        if r["check"] not in ("ok", "FAILED"):
            print(f"  {r['kernel']}: {r['check']}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cute_kernels.bench_write",
        allow_abbrev=False,  # a flag reads the same in a results file as in --help
        description=__doc__.splitlines()[0] + " Needs a CUDA GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = BenchConfig()
    parser.add_argument("--batch", type=int, default=defaults.batch, help="batch size")
    parser.add_argument("--window", type=int, default=defaults.window, help="window L")
    parser.add_argument("--reps", type=int, default=defaults.reps,
                        help="launches per graph replay")
    parser.add_argument("--replays", type=int, default=defaults.replays,
                        help="timed graph replays; the median is reported")
    parser.add_argument("--out", default=None,
                        help="CSV path; without it only the table is printed")
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="TEXT",
        help="time only the cases whose name contains one of these strings (e.g. 'flush "
        "fp16-SR'), or, with a leading '=', is it ('=flush fp16-SR + nvfp4': the default only)",
    )
    args = parser.parse_args(argv)
    for name in ("batch", "window", "reps", "replays"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    cfg = BenchConfig(batch=args.batch, window=args.window, reps=args.reps, replays=args.replays)
    names = [case[0] for case in bench_cases(cfg)]
    for text in args.only or ():  # each must pick a case: a typo used to time nothing, late
        if not any(matches(name, [text]) for name in names):
            parser.error(f"--only: no case name {'is' if text.startswith('=') else 'contains'} "
                         f"{text.removeprefix('=')!r}; the cases:\n  " + "\n  ".join(names))
    if args.out is not None and (problem := file_problem(args.out)):  # before the timing
        parser.error(f"--out: {problem}")
    if not torch.cuda.is_available():
        parser.exit(2, "bench_write: needs a CUDA GPU (torch.cuda.is_available() is False)\n")
    rows = run(cfg, args.only)
    print_table(rows)
    if args.out:  # after the table, so that a failed write loses no measurement
        import pandas as pd

        frame = pd.DataFrame(rows)
        frame["device"] = torch.cuda.get_device_name()
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            frame.to_csv(args.out, index=False)
        except OSError as error:
            raise SystemExit(f"bench_write: --out {args.out}: {error.strerror or error} (the "
                             "table above is all that is left of this run)") from None
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
