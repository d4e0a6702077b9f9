"""A server's steady state on the GPU: slots spread over the window, one decode step for all.

    python -m experiments.staggered_step                        # on the GPU machine
    python -m experiments.staggered_step --batches 256 --windows 16 --reps 20
    python -m experiments.staggered_step --cursor 8 --out results/staggered_step_cursor8.csv
    python -m experiments.staggered_step --plot-only results/staggered_step.csv

`kernel_bench` prices a token by the window formula, `((L - 1) * non-flush + flush) / L`, with
every slot at the same cursor, so the non-flush steps and the flush run one after the other.
A server's slots do not move in step: sequences start and end at different times, so at any
decode step about `B / L` slots flush and the rest take non-flush steps at every cursor. The
work of a step is then a window's work spread over the batch, and the two kernels can share
the machine: the flush is ALU-bound (SR, Philox, the E2M1 encode), the non-flush step is bound
by its loads' latency, so each can issue while the other waits. This script measures that
step.

**The batch.** `B` slots, a multiple of `L`; slot `s` holds `s * L // B` records, so each
cursor `0 .. L-1` has `B / L` slots and the last `B / L` flush. Random inputs, never zeros.

**Schemes.** `two-precision` (FP16-SR recurrence copy, NVFP4 read copy), `fp32-replay` (one
FP32 checkpoint, the single-copy FP32 ReplaySSM), and `conventional-fp32` (the kit's FP32
state update, the same kernel at every step: its row is the same as `kernel_bench`'s).

**Modes** (one step each; the same kernels, launched five ways):

    decode-step   `cute_kernels.replay_decode.mamba2_replay_decode` over the whole batch: the
                  non-flush kernel and the flush kernel each launched on every slot (a CTA of
                  a slot the kernel does not serve exits at once; the fp32 flush's CTAs loop
                  over slots instead), the flush on a side stream, then the counter kernel
    decode-step-serial  the same with `overlap_flush=False`: the two kernels in turn
    decode-step-indexed  the decode step given the flushing slots (`flush_slots`): the flush
                  kernel launched on those slots only
    grouped       slots grouped by cursor: the non-flush kernel on the non-flush slots, then
                  the flush kernel on the flush slots, one stream
    overlapped    the same two launches on two streams (flush on a side stream, forked and
                  joined inside the timed step), so that their CTAs can share SMs

**A synchronized batch** (`--cursor C`): every slot at the same non-flush cursor, so no slot
flushes; `decode-step` then says what the kit's decode step costs over the non-flush kernel
alone (`grouped`), since it launches the flush kernel (and the counter kernel) on every step.

`grouped` and `overlapped` launch each kernel on a contiguous sub-batch, standing in for a
launch through a slot index table (the non-flush kernel takes none; the flush kernel's,
`flush_slots` of the decode step, is what `decode-step-indexed` uses); the flush's random
words are then keyed by the slot's place in the sub-batch, so its FP16-SR bits differ from
`decode-step`'s. Before timing, each point runs every mode once on the same inputs and checks
that `grouped` and `overlapped` agree bit for bit (outputs, both copies, rings, counters),
that the three decode-step modes agree with each other bit for bit, and that they agree with
`grouped` bit for bit except the SR'd recurrence copy of the flush slots, which must lie
within one FP16 step (its neighbours), and the outputs, which may differ by up to 2^-6 of
their largest magnitude (either difference is noted in the CSV's `note`). The kernels themselves are
checked against the reference by the GPU tests and by `kernel_bench`'s gate.

**Timing** as `kernel_bench`: card warmed, copy ceiling measured in the same run, CUDA-graph
replay of one step per rotating buffer set (sets so that a replay touches at least 2x the L2),
counters reset between replays outside the timed region, each replay behind a GPU spin, the
median over `--reps` replays. **Bytes** per step are `kernel_bench.kernel_bytes` summed over
the slots at their cursors; `time_us` is the step's time, which is also the time per committed
token of the batch, the unit of `kernel_bench`'s token rows.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.staggered_step")

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from experiments import cases, harness
from experiments._common import OneLineParser, default_out, file_problem, folder_problem
from experiments.cases import SHAPES, BenchShape, kernel_bytes
from experiments.harness import Buffers
from experiments.kernel_bench_plots import _batch_ticks
from lowprec._checks import repeated

__all__ = ["SCHEMES", "MODES", "cursor_layout", "step_bytes", "check_modes", "run", "plot",
           "summarize", "read_csv", "main"]

SCHEMES = {
    # name: (hi format, hi rounding, lo format); None for the conventional update
    "two-precision": ("fp16", "sr", "nvfp4"),
    "fp32-replay": ("fp32", "rn", "none"),
    "conventional-fp32": None,
}
MODES = ("decode-step", "decode-step-serial", "decode-step-indexed", "grouped", "overlapped")
COLUMNS = ["run", "layout", "scheme", "mode", "shape", "batch", "window", "flush_slots", "time_us",
           "time_us_p10", "time_us_p90", "bytes", "gbps", "frac_copy", "copy_gbps", "sets",
           "timing", "status", "note"]
SEED = 12345
DEFAULT_BATCHES = (32, 64, 128, 256, 512)
DEFAULT_WINDOWS = (16,)


def cursor_layout(batch: int, window: int, cursor: int | None = None) -> list[int]:
    """Slot s holds `s * window // batch` records: every cursor on `batch / window` slots, the
    flush slots (cursor `window - 1`) last. With `cursor`, every slot holds that many records
    (a synchronized batch at one non-flush step: 0 .. window - 2)."""
    if window < 2:  # checked first: with --cursor it read "expected 0..-1"
        raise ValueError(f"--windows: expected windows >= 2 (a staggered batch needs a flush "
                         f"cursor and a non-flush one, --cursor a non-flush one), got {window}")
    if cursor is not None:
        if batch < 1 or not 0 <= cursor <= window - 2:
            raise ValueError(f"--cursor: expected 0..{window - 2} (a non-flush step of window "
                             f"{window}) and a batch >= 1, got cursor {cursor}, batch {batch}")
        return [cursor] * batch
    if batch < window or batch % window:
        raise ValueError(f"--batches: batch {batch} is not a multiple of the window {window} "
                         f"(--windows): a staggered batch puts batch / {window} slots at each "
                         f"cursor 0..{window - 1} (with --cursor any batch size is allowed)")
    return [s * window // batch for s in range(batch)]


def step_bytes(scheme: str, shape: BenchShape, batch: int, window: int,
               cursor: int | None = None) -> int:
    """Bytes one step must move: each slot's kernel at its cursor (kernel_bench's accounting),
    summed over the batch (`cursor`: as cursor_layout)."""
    if SCHEMES[scheme] is None:
        return kernel_bytes("cute:update:fp32", shape, batch, 0)
    nonflush, flush = cases.SCHEMES[scheme]
    total = 0
    for held in cursor_layout(batch, window, cursor):
        if held == window - 1:
            total += kernel_bytes(flush, shape, 1, held)
        else:
            total += kernel_bytes(nonflush, shape, 1, held)
    return total


# --------------------------------------------------------------------------------------------
# One staggered step's buffers and its three launchers
# --------------------------------------------------------------------------------------------


@dataclass
class Step:
    scheme: str
    shape: BenchShape
    batch: int
    window: int
    bufs: Buffers
    params: dict
    start_counters: dict[str, torch.Tensor]
    cursors: tuple[int, ...] = ()

    @property
    def flush_slots(self) -> int:
        return self.cursors.count(self.window - 1)

    def reset(self) -> None:
        for name, value in self.start_counters.items():
            self.bufs.bases[name].copy_(value)


def build_step(scheme: str, shape: BenchShape, batch: int, window: int, sets: int, device,
               seed: int = 0, cursor: int | None = None) -> Step:
    hi_fmt, _, lo_fmt = SCHEMES[scheme]
    gen = torch.Generator(device=device).manual_seed(seed)
    b = Buffers(sets, device, gen, cases.ACT)
    params = cases.params(shape, device, gen)
    S, H, P, N = batch, shape.nheads, shape.headdim, shape.dstate
    cases.token_buffers(b, shape, batch, dt_dtype=cases.KIT_DT)
    cases.ring_buffers(b, shape, batch, window)
    cursors = tuple(cursor_layout(batch, window, cursor))
    cases.counter(b, "cursors", batch, list(cursors))
    cases.counter(b, "flushes", batch, 0)
    b.add("hi", (S, H, P, N), cases.state_dtype(hi_fmt), "randn")
    if lo_fmt != "none":
        cases.lo_buffers(b, shape, batch, lo_fmt)
    # The grouped launches' own copies of the two groups (a sub-batch view of the full tensors
    # would start mid-allocation, and the kernels want 16-byte-aligned tensors)
    split = batch - cursors.count(window - 1)
    groups = [(prefix, rows) for prefix, rows in (("nf:", slice(0, split)),
                                                  ("fl:", slice(split, batch)))
              if rows.stop > rows.start]
    for name in list(b.views):
        for prefix, rows in groups:
            full = b.views[name]
            views = b.add(prefix + name, full[0][rows].shape, full[0].dtype, "empty")
            for view, source in zip(views, full, strict=True):
                view.copy_(source[rows])
    counters = [n for n in b.bases if n.split(":")[-1] in ("cursors", "flushes")]
    return Step(scheme, shape, batch, window, b, params,
                {n: b.bases[n].clone() for n in counters}, cursors)


def _cache(step: Step, t: dict, prefix: str = ""):
    from cute_kernels.cache import ReplayCache

    hi_fmt, hi_rounding, lo_fmt = SCHEMES[step.scheme]
    return cases.replay_cache(ReplayCache, t, hi_format=hi_fmt, hi_rounding=hi_rounding,
                              lo_format=lo_fmt, window=step.window, prefix=prefix)


def launcher(step: Step, i: int, mode: str, side: torch.cuda.Stream | None = None):
    """A function that runs one step of `mode` on buffer set `i` (capturable)."""
    from cute_kernels.replay_decode import mamba2_replay_decode
    from cute_kernels.replay_flush import mamba2_replay_flush
    from cute_kernels.replay_output import mamba2_replay_output

    every, p, L = step.bufs.at(i), step.params, step.window
    t = {k: v for k, v in every.items() if ":" not in k}
    has_nf = any(k.startswith("nf:") for k in every)
    has_fl = any(k.startswith("fl:") for k in every)
    def inputs(prefix):
        return (every[prefix + "x"], every[prefix + "dt"], p["A"], every[prefix + "B"],
                every[prefix + "C"], p["D"], None, p["dt_bias"])

    if mode.startswith("decode-step"):
        cache = _cache(step, t)
        table = (torch.tensor([s for s, c in enumerate(step.cursors) if c == L - 1],
                              dtype=torch.int32, device=t["cursors"].device)
                 if mode == "decode-step-indexed" else None)

        def run_step():
            mamba2_replay_decode(cache, *inputs(""), dt_softplus=True, out=t["out"],
                                 overlap_flush=mode != "decode-step-serial", flush_slots=table)
        return run_step

    nf_cache = _cache(step, every, "nf:") if has_nf else None
    fl_cache = _cache(step, every, "fl:") if has_fl else None

    def nonflush():
        mamba2_replay_output(nf_cache, *inputs("nf:"), dt_softplus=True, out=every["nf:out"])

    def flush():
        mamba2_replay_flush(fl_cache, *inputs("fl:"), dt_softplus=True, out=every["fl:out"])

    nf, fl = has_nf, has_fl
    if mode == "grouped":
        def run_step():
            if nf:
                nonflush()
            if fl:
                flush()
        return run_step
    if mode == "overlapped":
        if not (nf and fl):
            raise ValueError("overlapped: needs flush and non-flush slots (a staggered batch)")
        if side is None:
            raise ValueError("overlapped: needs a side stream")

        def run_step():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                flush()
            nonflush()
            main.wait_stream(side)
        return run_step
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


# --------------------------------------------------------------------------------------------
# The modes agree
# --------------------------------------------------------------------------------------------


def _snapshot(step: Step) -> dict[str, torch.Tensor]:
    return {name: views[0].clone() for name, views in step.bufs.views.items()}


def _restore(step: Step, saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        step.bufs.views[name][0].copy_(value)


def _fp16_neighbours(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every pair of fp16 values equal or adjacent (one SR decision apart)."""
    def ordered(t):  # order-preserving integer map of fp16 bits: neighbours differ by 1
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return bool(((ordered(a) - ordered(b)).abs() <= 1).all())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _as_batch(step: Step, mode: str, snap: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The buffers a mode ran on, as whole-batch tensors (the grouped modes' two groups
    joined back in slot order)."""
    names = [n for n in snap if ":" not in n]
    if mode.startswith("decode-step"):
        return {n: snap[n] for n in names}
    return {n: torch.cat([snap[g + n] for g in ("nf:", "fl:") if g + n in snap]) for n in names}


def check_modes(step: Step, modes=MODES) -> tuple[str, str]:
    """Run each mode once on set 0 from the same state. Returns (problem, note): `problem`
    (which stops the point from being timed) if `overlapped` and `grouped` differ in any bit,
    an output row is left unwritten, or `decode-step` differs by more than summation order
    allows; `note` says where `decode-step` differs within that (its flush slots' SR bits
    are keyed by their place in the batch, which differs from the grouped launch's)."""
    saved = _snapshot(step)
    side = torch.cuda.Stream()
    results = {}
    for mode in modes:
        _restore(step, saved)
        for name in ("out", "nf:out", "fl:out"):  # poison: every row must be written
            if name in step.bufs.views:
                step.bufs.views[name][0].fill_(float("nan"))
        launcher(step, 0, mode, side)()
        torch.cuda.synchronize()
        results[mode] = _as_batch(step, mode, _snapshot(step))
    _restore(step, saved)
    problems, notes = [], []
    for mode, got in results.items():
        if torch.isnan(got["out"].float()).any():
            problems.append(f"{mode}: output rows left unwritten")
    if "grouped" not in results:
        return "; ".join(problems), ""
    ref = results["grouped"]
    if "overlapped" in results:
        for name, value in results["overlapped"].items():
            if not _same_bits(value, ref[name]):
                problems.append(f"overlapped: {name} differs from grouped")
    for mode in [m for m in results if m.startswith("decode-step")]:
        got = results[mode]
        split = step.batch - step.flush_slots
        _, hi_rounding, _ = SCHEMES[step.scheme]
        for name, value in got.items():
            if _same_bits(value, ref[name]):
                continue
            if name == "hi" and hi_rounding == "sr":
                if (_same_bits(value[:split], ref[name][:split])
                        and _fp16_neighbours(value[split:], ref[name][split:])):
                    notes.append(f"{mode}: flush slots' SR bits differ (keyed by slot)")
                    continue
            if name == "out":
                a, r = value.double(), ref[name].double()
                worst = float(((a - r).abs() / (r.abs().max() + 1e-30)).max())
                if worst <= 2.0**-6:
                    notes.append(f"{mode}: out within {worst:.1e} of grouped's "
                                 "(max-relative)")
                    continue
            problems.append(f"{mode}: {name} differs from grouped")
    for other in ("decode-step-serial", "decode-step-indexed"):
        # the decode step's launches overlapped or in turn, on every slot or on the table's:
        # every bit the same
        if "decode-step" in results and other in results:
            for name, value in results["decode-step"].items():
                if not _same_bits(value, results[other][name]):
                    problems.append(f"decode-step: {name} differs from {other}")
    return "; ".join(problems), "; ".join(dict.fromkeys(notes))


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_step(step: Step, mode: str, reps: int, lead_cycles: int) -> tuple[list[float], str]:
    """Per-step microseconds over `reps` graph replays of one step per set (kernel_bench's
    timing: `time_case`)."""
    side = torch.cuda.Stream()
    runs = [launcher(step, i, mode, side) for i in range(step.bufs.sets)]
    return harness.time_launches(runs, step.reset, reps, lead_cycles)


def _update_time(shape, batch, sets, device, reps, lead_cycles) -> tuple[list[float], str]:
    case = cases.build_case("cute:update:fp32", shape, batch, 16, 0, sets, device)
    return harness.time_launches(case.launchers(), case.reset, reps, lead_cycles)


def layout_name(cursor: int | None) -> str:
    return "staggered" if cursor is None else f"cursor {cursor}"


def run(shape_name: str, batches, windows, schemes, modes, reps: int, lead_cycles: int,
        out: Path, log=print, cursor: int | None = None) -> pd.DataFrame:
    """Time every (window, batch, scheme, mode) point; `cursor`: a synchronized batch (every
    slot at that non-flush cursor) instead of a staggered one, where `overlapped` has nothing
    to overlap and is left out."""
    if not torch.cuda.is_available():
        raise RuntimeError("staggered_step: needs a CUDA GPU (torch.cuda.is_available() is "
                           "False); on a CPU machine use --plot-only")
    out.parent.mkdir(parents=True, exist_ok=True)  # here: a refused run leaves no folders
    device = torch.device("cuda")
    shape = SHAPES[shape_name]
    ceilings = harness.measure_ceilings(lead_cycles=lead_cycles)
    copy = ceilings["copy_gbps"]
    log(f"copy {copy:,.0f} GB/s (read + write)")
    l2 = harness.l2_bytes(device)
    run_label = time.strftime("%Y%m%dT%H%M%S")
    rows = []
    layout = layout_name(cursor)
    if cursor is not None:
        modes = tuple(m for m in modes if m != "overlapped")

    def add(scheme, mode, batch, window, times=None, sets=0, timing="", status="ok", note=""):
        nbytes = step_bytes(scheme, shape, batch, window, cursor)
        flushing = cursor_layout(batch, window, cursor).count(window - 1)
        row = dict(run=run_label, layout=layout, scheme=scheme, mode=mode, shape=shape_name,
                   batch=batch, window=window, flush_slots=flushing if SCHEMES[scheme] else 0,
                   time_us=math.nan, time_us_p10=math.nan, time_us_p90=math.nan,
                   bytes=nbytes, gbps=math.nan, frac_copy=math.nan, copy_gbps=copy, sets=sets,
                   timing=timing, status=status, note=note)
        if times:
            q = np.quantile(times, [0.1, 0.5, 0.9])
            row.update(time_us=float(q[1]), time_us_p10=float(q[0]), time_us_p90=float(q[2]))
            row["gbps"] = nbytes / row["time_us"] / 1e3
            row["frac_copy"] = row["gbps"] / copy
        rows.append(row)
        if times:
            log(f"{scheme:18s} {mode:12s} L={window:<3d} b={batch:<4d} {row['time_us']:9.2f} us "
                f"{row['gbps']:7.0f} GB/s {row['frac_copy']:6.1%}")
        else:
            log(f"{scheme:18s} {mode:12s} L={window:<3d} b={batch:<4d} {status}")
        harness.write_csv(pd.DataFrame(rows, columns=COLUMNS), out)

    points = [(w, b) for w in windows for b in batches]
    for window, batch in tqdm(points, desc="points", file=sys.stderr):
        for scheme in schemes:
            nbytes = step_bytes(scheme, shape, batch, window, cursor)
            sets = harness.sets_for(nbytes, l2, 2.0)
            if SCHEMES[scheme] is None:
                try:
                    times, timing = _update_time(shape, batch, sets, device, reps, lead_cycles)
                    add(scheme, "update", batch, window, times, sets, timing)
                except Exception as error:  # record and go on
                    add(scheme, "update", batch, window, status=f"error: {harness.reason(error)}")
                continue
            try:
                step = build_step(scheme, shape, batch, window, sets, device, cursor=cursor)
                problem, note = check_modes(step, modes)
            except Exception as error:
                for mode in modes:
                    add(scheme, mode, batch, window, status=f"error: {harness.reason(error)}")
                continue
            for mode in modes:
                if problem:
                    add(scheme, mode, batch, window, status=f"check failed: {problem}")
                    continue
                try:
                    times, timing = time_step(step, mode, reps, lead_cycles)
                    add(scheme, mode, batch, window, times, sets, timing,
                        note=note if mode.startswith("decode-step") else "")
                except Exception as error:
                    add(scheme, mode, batch, window, status=f"error: {harness.reason(error)}")
            del step
            torch.cuda.empty_cache()
    frame = pd.DataFrame(rows, columns=COLUMNS)
    harness.write_csv(frame, out)
    return frame


# --------------------------------------------------------------------------------------------
# Summary and plot (from the CSV only)
# --------------------------------------------------------------------------------------------


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (shape, batch, window): each scheme's best mode and the speedups of two-precision
    (FP32 ReplaySSM over two-precision, conventional FP32 over two-precision), mode by mode
    and best against best."""
    ok = frame[frame["status"] == "ok"]
    rows = []
    if "layout" not in ok.columns:
        ok = ok.assign(layout="staggered")
    for (layout, shape, batch, window), group in ok.groupby(["layout", "shape", "batch",
                                                              "window"]):
        times = {(r.scheme, r.mode): r.time_us for r in group.itertuples()}
        row = dict(layout=layout, shape=shape, batch=batch, window=window)
        for scheme in SCHEMES:
            candidates = {m: t for (s, m), t in times.items() if s == scheme}
            if candidates:
                mode = min(candidates, key=candidates.get)
                row[f"{scheme}_us"] = candidates[mode]
                row[f"{scheme}_mode"] = mode
        for mode in MODES:
            two = times.get(("two-precision", mode))
            fp32 = times.get(("fp32-replay", mode))
            if two and fp32:
                row[f"fp32-replay/two-precision ({mode})"] = fp32 / two
        if "two-precision_us" in row:
            for scheme in ("fp32-replay", "conventional-fp32"):
                if f"{scheme}_us" in row:
                    row[f"{scheme}/two-precision (best)"] = row[f"{scheme}_us"] / row[
                        "two-precision_us"]
        rows.append(row)
    return pd.DataFrame(rows)


def format_summary(frame: pd.DataFrame) -> str:
    table = summarize(frame)
    if table.empty:
        return "no timed points"
    lines = ["per step (= per committed token of the batch), µs, and speedups of two-precision:"]
    for row in table.to_dict("records"):
        parts = [f"{row['layout']}, {row['shape']} b={row['batch']} L={row['window']}:"]
        for scheme in SCHEMES:
            if f"{scheme}_us" in row and not pd.isna(row.get(f"{scheme}_us")):
                parts.append(f"{scheme} {row[scheme + '_us']:.1f} ({row[scheme + '_mode']})")
        for key in ("fp32-replay/two-precision (best)", "conventional-fp32/two-precision (best)"):
            if key in row and not pd.isna(row[key]):
                parts.append(f"{key.split('/')[0]} / two-precision {row[key]:.2f}x")
        lines.append("  " + parts[0] + " " + "; ".join(parts[1:]))
    return "\n".join(lines)


def plot(csv: str | Path, outdir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = read_csv(csv)
    frame = frame[frame["status"] == "ok"]
    outdir = Path(outdir)
    paths = []
    styles = {"decode-step": ":", "decode-step-serial": (0, (1, 1, 4, 1)),
              "decode-step-indexed": (0, (6, 2)), "grouped": "--", "overlapped": "-",
              "update": "-."}
    colours = {mode: f"C{i}" for i, mode in enumerate((*MODES, "update"))}
    for (layout, shape, window), group in frame.groupby(["layout", "shape", "window"]):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.6))
        batches = sorted(group["batch"].unique())
        update = group[group["scheme"] == "conventional-fp32"].sort_values("batch")
        for ax, scheme in zip(axes[0], ("two-precision", "fp32-replay"), strict=True):
            for mode, line in group[group["scheme"] == scheme].groupby("mode", sort=False):
                line = line.sort_values("batch")
                ax.plot(line["batch"], line["time_us"], linestyle=styles.get(mode, "-"),
                        marker="o", ms=3, color=colours.get(mode), label=mode)
            if len(update):
                ax.plot(update["batch"], update["time_us"], linestyle=styles["update"],
                        marker="o", ms=3, color="gray", label="conventional-fp32 update")
            ax.set(xscale="log", yscale="log", xlabel="batch (slots)",
                   ylabel="µs a step (= a committed token)",
                   title=f"{scheme}: one step by launch mode")
        handles, labels = axes[0, 0].get_legend_handles_labels()
        more = axes[0, 1].get_legend_handles_labels()
        for handle, label in zip(*more, strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
        axes[0, 1].legend(handles, labels, fontsize=7, loc="upper left",
                          bbox_to_anchor=(1.02, 1.0), frameon=False)
        table = summarize(group.assign(window=window))
        best, same = axes[1]
        for key, colour, label in (
                ("fp32-replay/two-precision (best)", "C3", "FP32 ReplaySSM / two-precision"),
                ("conventional-fp32/two-precision (best)", "C7",
                 "conventional FP32 / two-precision")):
            if key in table:
                best.plot(table["batch"], table[key], marker="o", color=colour, label=label)
        if layout == "staggered":  # a whole window's work: the per-token goals apply
            best.axhline(4.0, color="C3", lw=0.8, ls="--", label="goal 4x")
            best.axhline(7.5, color="C7", lw=0.8, ls="--", label="goal 7.5x")
        best.set(xscale="log", xlabel="batch (slots)", ylabel="speedup (x)", ylim=(0, 8),
                 title="two-precision's speedup, each scheme in its fastest mode")
        best.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
        for key in [k for k in table.columns if k.startswith("fp32-replay/two-precision (")
                    and "best" not in k]:
            mode = key[key.index("(") + 1:-1]
            same.plot(table["batch"], table[key], linestyle=styles.get(mode, ":"),
                      color=colours.get(mode), marker="o", ms=3, label=mode)
        same.set(xscale="log", xlabel="batch (slots)", ylabel="speedup (x)", ylim=(0, 8),
                 title="FP32 ReplaySSM / two-precision, both in the same mode")
        same.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
        for ax in axes.flat:
            _batch_ticks(ax, batches)
            ax.grid(True, lw=0.3, alpha=0.5)
        fig.suptitle(f"{shape}, L = {window}, {layout} batch: one decode step of the batch",
                     fontsize=10)
        fig.tight_layout()
        suffix = "" if layout == "staggered" else "_" + layout.replace(" ", "")
        path = outdir / f"staggered_step_{shape}_L{window}{suffix}.png"
        harness.save_figure(fig, path)
        plt.close(fig)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:  # an empty item ("8,,16") fails int(): a typo, not dropped
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    _once(values, text)
    return values


def _once(values: tuple, text: str) -> None:
    """Each value once: a repeated one would be timed again (minutes of GPU time),
    and its rows would repeat a point of the CSV (as kernel_bench refuses)."""
    twice = [str(v) for v in repeated(values)]
    if twice:
        raise argparse.ArgumentTypeError(f"expected each once, got {', '.join(twice)} twice "
                                         f"in {text!r}")


def _names(allowed):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(v.strip() for v in text.split(","))
        bad = [n for n in names if n not in allowed]  # an empty item too
        if bad:
            raise argparse.ArgumentTypeError(f"expected names from {', '.join(allowed)}; "
                                             f"got {text!r}")
        _once(names, text)
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(  # an argument error: one line on stderr, exit status 2
        prog="python -m experiments.staggered_step",
        description="One decode step of a batch whose slots are spread over the window (a "
                    "server's steady state): the two-precision scheme against single-copy "
                    "FP32 ReplaySSM and the conventional FP32 update, with the flush and the "
                    "non-flush kernels launched in turn or overlapped. Needs the GPU; "
                    "--plot-only redraws from a CSV anywhere.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="nemotron3-super",
                   choices=sorted(n for n, s in SHAPES.items() if s.kind == "mamba2"),
                   help="a Mamba-2 layer shape of kernel_bench's (the step is built of the "
                   "Mamba-2 kernels)")
    p.add_argument("--batches", type=_ints, default=",".join(map(str, DEFAULT_BATCHES)),
                   help="slots, comma-separated; each a multiple of every window (a "
                        "staggered batch puts batch / L slots at each cursor), except with "
                        "--cursor, where any batch size is allowed")
    p.add_argument("--windows", type=_ints, default=",".join(map(str, DEFAULT_WINDOWS)),
                   help="window lengths L, comma-separated")
    p.add_argument("--schemes", type=_names(tuple(SCHEMES)), default=",".join(SCHEMES),
                   help="comma-separated, from: " + ", ".join(SCHEMES))
    p.add_argument("--modes", type=_names(MODES), default=",".join(MODES),
                   help="comma-separated, from: " + ", ".join(MODES) + " (module doc); "
                        "for the replay schemes (conventional-fp32 is one update, mode "
                        "'update')")
    p.add_argument("--cursor", type=int, default=None,
                   help="every slot at this non-flush cursor (a synchronized batch) instead of "
                        "staggered: what mamba2_replay_decode costs on a step where no slot "
                        "flushes, against the non-flush kernel alone; batches of any size, "
                        "mode overlapped left out (nothing to overlap)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per point")
    p.add_argument("--lead-cycles", type=int, default=harness.LEAD_CYCLES,
                   help="GPU spin before each timed replay (kernel_bench's)")
    p.add_argument("--out", default=None,
                   help="the tidy CSV (default results/staggered_step.csv for the default "
                   "settings, the command that regenerates it; runs/staggered_step_<settings>/ "
                   "otherwise)")
    p.add_argument("--plot-dir", default=None,
                   help="where the PNGs go (default: the CSV's folder; '' or 'none' for none)")
    p.add_argument("--plot-only", metavar="CSV",
                   help="redraw and summarise a CSV; no GPU (with --plot-dir only: the run's "
                        "flags are refused)")
    return p


# the flags that only a run reads (--plot-only refuses them)
RUN_FLAGS = ("--shape", "--batches", "--windows", "--schemes", "--modes", "--cursor", "--reps",
             "--lead-cycles", "--out")
COLUMN_TYPES = {
    "run": "str", "layout": "str", "scheme": "str", "mode": "str", "shape": "str",
    "batch": "int", "window": "int", "flush_slots": "int", "time_us": "float",
    "time_us_p10": "float", "time_us_p90": "float", "bytes": "int", "gbps": "float",
    "frac_copy": "float", "copy_gbps": "float", "sets": "int", "timing": "str", "status": "str",
    "note": "str",
}
KEY = ["run", "layout", "shape", "scheme", "mode", "batch", "window"]


def read_csv(path: str | Path) -> pd.DataFrame:
    """A staggered_step CSV, checked (`harness.read_table`: columns, types, one row a point),
    with known schemes and modes, batches and windows >= 1 and positive times in its ok rows;
    a ValueError in one line names the file and the row."""
    frame = harness.read_table(path, COLUMN_TYPES, KEY, what="staggered_step CSV")
    ok = frame["status"] == "ok"
    checks = (("scheme", frame["scheme"].isin(list(SCHEMES)), f"one of {', '.join(SCHEMES)}"),
              ("mode", frame["mode"].isin([*MODES, "update"]),
               f"one of {', '.join(MODES)}, update"),
              ("batch", frame["batch"] >= 1, "an integer >= 1"),
              ("window", frame["window"] >= 1, "an integer >= 1"),
              ("time_us", ~ok | ((frame["time_us"] > 0) & np.isfinite(frame["time_us"])),
               "a time > 0 (µs) in an ok row"))
    for column, good, expected in checks:
        if not good.all():
            row = int(np.flatnonzero(~good.to_numpy())[0])
            value = frame[column].iloc[row]
            shown = repr(value) if isinstance(value, str) else f"{value:g}"
            raise ValueError(f"{path}: line {row + 2}: column {column}: expected {expected}, "
                             f"got {shown}")
    return frame


def _check_plot_dir(parser: argparse.ArgumentParser, plot_dir: str) -> None:
    """--plot-dir (unless '' for none) is a folder that can be written, before any work."""
    if plot_dir and (problem := folder_problem(plot_dir)):
        parser.error(f"--plot-dir: {problem}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None and not args.plot_only:
        args.out = str(default_out(parser, args, "staggered_step", "results/staggered_step.csv"))
    if args.plot_dir is None:  # beside the CSV written or read
        args.plot_dir = str(Path(args.plot_only or args.out).parent)
    elif args.plot_dir.lower() == "none":
        args.plot_dir = ""
    if args.reps < 1:
        parser.error(f"--reps: expected an integer >= 1, got {args.reps}")
    if args.lead_cycles < 0:
        parser.error(f"--lead-cycles: expected an integer >= 0, got {args.lead_cycles}")
    if args.plot_only:
        # the run's flags do nothing here: given, they were silently ignored
        given = [flag for flag in RUN_FLAGS
                 if any(a == flag or a.startswith(flag + "=") for a in argv)]
        if given:
            parser.error(f"--plot-only: redraws the CSV as it is; {', '.join(given)} "
                         f"{'is' if len(given) == 1 else 'are'} for a run (leave "
                         f"{'it' if len(given) == 1 else 'them'} out)")
        _check_plot_dir(parser, args.plot_dir)
        try:
            frame = read_csv(args.plot_only)
        except ValueError as error:
            parser.error(str(error))
        if args.plot_dir:
            for path in plot(args.plot_only, args.plot_dir):
                print(f"wrote {path}", file=sys.stderr)
        print(format_summary(frame))
        return 0
    replayed = any(SCHEMES[s] is not None for s in args.schemes)
    if not replayed and any(a == "--modes" or a.startswith("--modes=") for a in argv):
        # the conventional update is one kernel, timed as mode "update": --modes was ignored
        parser.error("--modes: applies to the replay schemes (two-precision, fp32-replay); "
                     "conventional-fp32 is timed as one update (leave --modes out)")
    if args.cursor is not None and replayed and set(args.modes) <= {"overlapped"}:
        parser.error(f"--modes: with --cursor, mode overlapped is left out (a synchronized "
                     f"batch has no flush to overlap), so the replay schemes would time "
                     f"nothing; ask for one of {', '.join(m for m in MODES if m != 'overlapped')}")
    for window in args.windows:
        for batch in args.batches:
            try:
                cursor_layout(batch, window, args.cursor)
            except ValueError as error:
                parser.error(str(error))
    out = Path(args.out)
    if problem := file_problem(out):
        parser.error(f"--out: cannot write {out}: {problem}")
    _check_plot_dir(parser, args.plot_dir)
    started = time.perf_counter()
    try:
        frame = run(args.shape, args.batches, args.windows, args.schemes, args.modes, args.reps,
                    args.lead_cycles, out, log=lambda text: print(text, file=sys.stderr,
                                                                 flush=True),
                    cursor=args.cursor)
    except RuntimeError as error:
        print(str(error), file=sys.stderr)
        return 2
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    harness.write_run_meta(out, "experiments.staggered_step", argv,
                           round(time.perf_counter() - started, 1), settings)
    print(f"wrote {out} ({len(frame)} rows)", file=sys.stderr)
    if args.plot_dir:
        for path in plot(out, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    print(format_summary(frame))
    return 0


if __name__ == "__main__":
    sys.exit(main())
