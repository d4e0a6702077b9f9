"""Kernel benchmark on the GPU: each state format's decode time against the copy ceiling, against
FP32 and 16-bit states, and against vLLM's, FlashInfer's and FLA's kernels.

    python -m experiments.kernel_bench                       # full grid, on the GPU machine
    python -m experiments.kernel_bench --shapes qwen3-next-80b   # the Gated DeltaNet layer
    python -m experiments.kernel_bench --quick               # a small grid (smoke test), into
                                                             # runs/kernel_bench_quick/
    python -m experiments.kernel_bench --merge a.csv b.csv --out merged.csv   # then plot
    python -m experiments.kernel_bench --plot-only results/kernel_bench.csv

**Shapes** (`--shapes`): the Mamba-2 layers of Nemotron-3-Super and mamba2-2.7b and the Gated
DeltaNet layer of Qwen3-Next-80B (`cases.SHAPES`). The shape decides the recurrence: the same
kernel name builds the Mamba-2 kernel at a Mamba-2 shape and the GDN kernel at a GDN shape, and
each kernel is timed at the shapes whose recurrence has it (`--list-kernels` says which); a
kernel named that none of the shapes has is refused.

**Kernels** (`--kernels`, names `impl:step:variant`, `--list-kernels` prints them all; each in
its default configuration): the kit's CuTe kernels and the Triton emulation
(`experiments.cases`, `experiments.gdn_cases`), vLLM's, FlashInfer's and FLA's
(`experiments.peers`, imported from `--peers-dir`; a peer that cannot be imported is recorded
with its reason). The SR kernels' other settings are named by their random bits and Philox
rounds (`cute:flush:fp16sr16r7+nvfp4`, `cute:update:fp16sr8r4`; `experiments.cases`), timed
when named.

**Batches.** Uniform: every slot holds the same number of records, `cursor` (the records in the
ring before the step: our `cursors`, vLLM's `write_pos`, FlashInfer's `prev_num_accepted`).
Non-flush steps are timed at `cursor = L/2` and, for the window numbers, also at the ends of the
non-flush range; flush steps at the flush cursor (`L - 1`; FlashInfer `L`, its current token
stays in the ring). Inputs are random (never zeros); no `z` gate (vLLM applies it after the
kernel).

**Correctness first.** Each kernel is checked once per (shape, window) against the fp64
reference (`cases.check_kernel`); a kernel that fails is not timed (`status` says so; `check`
is the largest error over its bound, pass <= 1).

**Timing** (`experiments.harness`): the same run measures the copy and streaming-read ceilings
first; each kernel is timed by CUDA-graph replay of one launch per buffer set, `sets` sets
rotating so that one replay touches at least `l2_multiple` x the L2, after `--warm-replays`
untimed replays, each replay behind a GPU spin of `--lead-cycles`. `time_us` is the median
per-launch time over `reps` replays (`p10`, `p90` beside it). A kernel that cannot be captured
is timed with events around eager launches (`timing = events`: host launch overhead included).

**Per committed token** (rows `step = token`): a ReplaySSM window is `L - 1` non-flush steps and
one flush, `((L - 1) * mean_nonflush + flush) / L`, where `mean_nonflush` averages over the
non-flush cursors (`0..L-2`; FlashInfer `1..L-1`) the piecewise-linear interpolation of the
measured cursors (constant beyond the ends); a conventional step is one token. Bytes per token
are exact (summed over the window's cursors).

**Output.** A tidy CSV at `--out` (one row per kernel x shape x batch x window x cursor, plus
the token rows; columns in `COLUMNS`), its `.meta.json`, three PNGs from `plot(csv)` (which
reads only the CSV) into `--plot-dir` (default: the CSV's folder), and a summary of the goals
at the headline point of each shape (`GOALS`, per recurrence), printed last.

**Duration.** The two Mamba-2 shapes' full grid took about 4 minutes on an H200 with vLLM's
kernels (docs/performance.md). The Gated DeltaNet shape adds 294 points and the first compiles
of its CuTe kernels: 2 to 4 minutes by estimate (about a quarter of a second a point, the
Mamba-2 grid's pace, plus about 20 compiles), not a measurement. The whole default grid should
fit in 10 minutes; `--budget-s` keeps a run inside a time limit (the headline points come
first).
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.kernel_bench")

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from experiments import harness
from experiments._common import (
    OneLineParser,
    default_out,
    file_problem,
    folder_problem,
    is_file,
    is_folder,
    runs_folder,
)
from experiments.cases import (
    ACT_DTYPES,
    KERNELS,
    PEER_IMPLS,
    RECURRENCES,
    SCHEMES,
    SHAPES,
    SR_SETTINGS,
    BenchShape,
    KernelSpec,
    Unavailable,
    build_case,
    check_kernel,
    kernel_bytes,
    sr_variant,
)
from experiments.kernel_bench_plots import plot
from lowprec._checks import repeated

__all__ = [
    "BenchShape",
    "SHAPES",
    "KernelSpec",
    "KERNELS",
    "SCHEMES",
    "COMPARISONS",
    "GOALS",
    "COLUMNS",
    "BenchConfig",
    "kernel_bytes",
    "run",
    "token_rows",
    "with_token_rows",
    "speedups",
    "summarize",
    "format_summary",
    "read_csv",
    "plot",
    "main",
]

HEADLINE_BATCH = 256
HEADLINE_WINDOW = 16

# The peers' schemes: all of them, and those keeping an fp32 or a bf16 state
PEER_SCHEMES = tuple(s for s, ks in SCHEMES.items() if KERNELS[ks[0]].impl in PEER_IMPLS)
PEER_FP32 = tuple(s for s in PEER_SCHEMES if s.endswith("fp32"))
PEER_BF16 = tuple(s for s in PEER_SCHEMES if s.endswith("bf16"))

# (label, numerator, denominator): kernel names compare non-flush steps at cursor L/2, scheme
# names cost per token; a tuple of schemes is the fastest of them at each point.
COMPARISONS = (
    ("non-flush: nvfp4 vs fp32 checkpoint", "cute:nonflush:fp32", "cute:nonflush:nvfp4"),
    ("non-flush: fp8_e4m3 vs fp32 checkpoint", "cute:nonflush:fp32", "cute:nonflush:fp8_e4m3"),
    ("non-flush: fp16 vs fp32 checkpoint", "cute:nonflush:fp32", "cute:nonflush:fp16"),
    ("token: two-precision vs FP32 ReplaySSM", "fp32-replay", "two-precision"),
    ("token: two-precision vs conventional fp32", "conventional-fp32", "two-precision"),
    ("token: two-precision vs conventional fp16", "conventional-fp16", "two-precision"),
    ("token: two-precision vs conventional fp16 SR", "conventional-fp16sr", "two-precision"),
    ("token: two-precision vs conventional bf16", "conventional-bf16", "two-precision"),
    ("token: two-precision vs vLLM fp32 update", "vllm-conventional-fp32", "two-precision"),
    ("token: two-precision vs vLLM fp16 update", "vllm-conventional-fp16", "two-precision"),
    ("token: two-precision vs vLLM bf16 update", "vllm-conventional-bf16", "two-precision"),
    ("token: two-precision vs vLLM FP32 ReplaySSM", "vllm-replay-fp32", "two-precision"),
    ("token: two-precision vs FlashInfer fp32 update", "flashinfer-conventional-fp32",
     "two-precision"),
    ("token: two-precision vs FlashInfer fp16 update", "flashinfer-conventional-fp16",
     "two-precision"),
    ("token: two-precision vs FlashInfer FP32 ReplaySSM", "flashinfer-replay-fp32",
     "two-precision"),
    ("token: two-precision vs FLA fp32 update", "fla-conventional-fp32", "two-precision"),
    ("token: two-precision vs FLA bf16 update", "fla-conventional-bf16", "two-precision"),
    ("token: two-precision vs fastest peer, fp32 state", PEER_FP32, "two-precision"),
    ("token: two-precision vs fastest peer, bf16 state", PEER_BF16, "two-precision"),
    ("token: two-precision vs fastest peer", PEER_SCHEMES, "two-precision"),
    ("token: cute conventional fp32 vs vLLM fp32 update", "vllm-conventional-fp32",
     "conventional-fp32"),
)
# Each SR setting of the recurrence copy (cases.SR_SETTINGS): its flush against the default's,
# and its token against the per-token targets' denominators
COMPARISONS += tuple(
    row for bits, rounds in SR_SETTINGS for row in (
        (f"flush: fp16sr vs fp16sr{bits}r{rounds}", "cute:flush:fp16sr+nvfp4",
         f"cute:flush:{sr_variant((bits, rounds))}+nvfp4"),
        (f"token: two-precision sr{bits}r{rounds} vs vLLM FP32 ReplaySSM", "vllm-replay-fp32",
         f"two-precision-sr{bits}r{rounds}"),
        (f"token: two-precision sr{bits}r{rounds} vs conventional fp32", "conventional-fp32",
         f"two-precision-sr{bits}r{rounds}"),
    )
)

# The goals per recurrence, at the headline window: (comparison, batch (None: the headline
# batch), speedup goal); the two-precision non-flush step's fraction of the copy bandwidth
# (goal NONFLUSH_GOAL) comes first for every recurrence.
NONFLUSH_GOAL = 0.85
GOALS = {
    "mamba2": (
        ("non-flush: nvfp4 vs fp32 checkpoint", None, 5.0),
        ("token: two-precision vs FP32 ReplaySSM", None, 4.0),
        ("token: two-precision vs conventional fp32", None, 7.5),
        ("token: two-precision vs conventional fp32", 1, 1.0),
    ),
    "gdn": (
        ("token: two-precision vs fastest peer, fp32 state", None, 5.0),
        ("token: two-precision vs fastest peer, bf16 state", None, 2.5),
        ("token: two-precision vs fastest peer", 1, 1.0),
    ),
}

# The CSV's columns and their types (read_csv checks them); one row per point of KEY.
COLUMN_TYPES = {
    "run": "str", "kernel": "str", "impl": "str", "step": "str", "scheme": "str",
    "shape": "str", "batch": "int", "window": "int", "cursor": "int", "time_us": "float",
    "time_us_p10": "float", "time_us_p90": "float", "bytes": "float", "gbps": "float",
    "frac_copy": "float", "frac_read": "float", "copy_gbps": "float", "read_gbps": "float",
    "check": "float", "status": "str", "sets": "int", "timing": "str", "note": "str",
}
COLUMNS = list(COLUMN_TYPES)
KEY = ["run", "kernel", "scheme", "shape", "batch", "window", "cursor"]


# --------------------------------------------------------------------------------------------
# Configuration and command line
# --------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """What to measure (`main` builds it from the command line)."""

    shapes: tuple[str, ...] = tuple(SHAPES)
    batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256, 512)
    windows: tuple[int, ...] = (8, 16, 32)
    kernels: tuple[str, ...] | None = None  # None: the default CuTe kernels of the shapes
    peers: tuple[str, ...] = PEER_IMPLS
    out: str = "results/kernel_bench.csv"
    plot_dir: str | None = ""  # '': the CSV's folder; None: no plots
    reps: int = 20
    l2_multiple: float = harness.L2_MULTIPLE
    lead_cycles: int = harness.LEAD_CYCLES
    warm_replays: int = harness.WARM_REPLAYS
    budget_s: float | None = None
    peers_dir: str = ".peers"
    run_label: str = "A"
    quick: bool = False
    seed: int = 0
    device: str = "cuda"
    act: str = "bf16"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in self.shapes:
            if name not in SHAPES:
                raise ValueError(f"shapes: expected names in {list(SHAPES)}, got {name!r}")
        if self.kernels is None:
            self.kernels = for_shapes(self.shapes, ("cute",))
        for name in self.kernels:
            if name not in KERNELS:
                raise ValueError(f"kernels: expected names in {list(KERNELS)}, got {name!r}")
            if self.shapes and name not in for_shapes(self.shapes, (KERNELS[name].impl,), False):
                # none of the shapes has it: the message names the first shape's recurrence
                try:
                    KERNELS[name].check_shape(SHAPES[self.shapes[0]])
                except ValueError as error:
                    raise ValueError(f"kernels: {str(error).removeprefix('kernel: ')}") from None
        for peer in self.peers:
            if peer not in PEER_IMPLS:
                raise ValueError(f"peers: expected {', '.join(PEER_IMPLS)} or none, got "
                                 f"{peer!r}")
        for name in ("shapes", "kernels", "peers", "batches", "windows"):
            twice = sorted(map(str, repeated(list(getattr(self, name)))))
            if twice:  # each would be timed again
                raise ValueError(f"{name}: expected each once, got {', '.join(twice)} twice")
        for name, values in (("batches", self.batches), ("windows", self.windows)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                 for v in values):
                raise ValueError(f"{name}: expected positive integers, got {list(values)}")
        if any(w < 4 or w > 32 for w in self.windows):
            raise ValueError(f"windows: expected values in [4, 32], got {list(self.windows)}")
        for name in ("lead_cycles", "warm_replays"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
        if self.reps < 1:
            raise ValueError(f"reps: expected >= 1, got {self.reps}")
        if self.budget_s is not None and not (math.isfinite(self.budget_s)
                                              and self.budget_s > 0):
            raise ValueError(f"budget_s: expected a finite number > 0, got {self.budget_s}")
        if self.act not in ACT_DTYPES:
            raise ValueError(f"act: expected one of {list(ACT_DTYPES)}, got {self.act!r}")

    def all_kernels(self) -> tuple[str, ...]:
        """The kernels asked for, plus each peer's default kernels at the shapes."""
        return tuple(dict.fromkeys([*self.kernels, *for_shapes(self.shapes, self.peers)]))


def for_shapes(shapes, impls, default: bool = True) -> tuple[str, ...]:
    """The kernels of `impls` that one of `shapes` has a form for (`default`: only those timed
    by default)."""
    kinds = {SHAPES[name].kind for name in shapes}
    return tuple(name for name, spec in KERNELS.items()
                 if spec.impl in impls and kinds & set(spec.recurrences)
                 and (spec.default or not default))


QUICK = dict(batches=(1, 256), windows=(16,), reps=5, l2_multiple=2.0)


class _ListError(argparse.ArgumentTypeError, ValueError):
    """A bad comma-separated list: argparse reports it after the flag's name, and
    config_from_args's callers catch it as a ValueError."""


def _names(text: str, name: str = "") -> tuple[str, ...]:
    """Comma-separated names; an empty item ("a,,b", a trailing comma) is an error (a typo)."""
    parts = tuple(p.strip() for p in text.split(","))
    if not all(parts):
        prefix = f"{name}: " if name else ""
        raise _ListError(f"{prefix}expected comma-separated names without empty items, got "
                         f"{text!r}")
    return parts


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p.strip()) for p in text.split(","))
    except ValueError as error:
        raise _ListError(f"expected comma-separated integers, got {text!r}") from error


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m experiments.kernel_bench",
                      description="Time the kit's CuTe decode kernels and the peers' on the GPU "
                      "(see the module docstring); writes a CSV, its .meta.json, PNGs and a "
                      "summary.")
    defaults = BenchConfig()
    p.add_argument("--shapes", type=_names, default=None,
                   help=f"comma-separated, of {', '.join(SHAPES)} (default: all; the Mamba-2 "
                   "shapes' full grid takes about 4 minutes on an H200, the Gated DeltaNet "
                   "shape an estimated 2-4 more)")
    p.add_argument("--batches", type=_ints, default=None,
                   help="comma-separated batch sizes (default: "
                   f"{','.join(map(str, defaults.batches))})")
    p.add_argument("--windows", type=_ints, default=None,
                   help="comma-separated windows L (default: "
                   f"{','.join(map(str, defaults.windows))})")
    p.add_argument("--kernels", default="default",
                   help="comma-separated kernel names, 'default' (the CuTe kernels), 'all' "
                   "(see --list-kernels) or 'none' (the peers' alone); the peers' kernels come "
                   "with --peers")
    p.add_argument("--peers", default=",".join(PEER_IMPLS),
                   help=f"peers whose default kernels are added at the shapes that have them: "
                   f"{', '.join(PEER_IMPLS)}, or none (default: %(default)s)")
    p.add_argument("--peers-dir", default=defaults.peers_dir,
                   help="folder built by scripts/peers/prepare.sh (default: .peers)")
    p.add_argument("--out", default=None,
                   help=f"CSV path (default: {defaults.out} for the default grid, the command that "
                   "regenerates it; runs/kernel_bench_<settings>/ for any other; --merge needs "
                   "it)")
    p.add_argument("--plot-dir", default=None,
                   help="folder for the PNGs, or 'none' (default: the folder of the CSV "
                   "written, or of --plot-only's CSV, or of --out given with --plot-only)")
    p.add_argument("--quick", action="store_true",
                   help="small grid: batches 1,256, L = 16, 5 replays (explicit flags win)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop timing after this many seconds; the rest is recorded as skipped")
    p.add_argument("--reps", type=int, default=None, help="graph replays per point (default 20)")
    p.add_argument("--lead-cycles", type=int, default=None,
                   help=f"GPU cycles of spin queued before each timed region, so the host's "
                   f"submission of the work is not timed (default {harness.LEAD_CYCLES:,}; "
                   f"0: none)")
    p.add_argument("--warm-replays", type=int, default=None,
                   help=f"untimed graph replays before each point's timed ones (default "
                   f"{harness.WARM_REPLAYS}: a new buffer set runs slower for its first 10-26 "
                   f"passes)")
    p.add_argument("--run-label", default=defaults.run_label,
                   help="label of this run in the CSV's run column (default: %(default)s)")
    sources = p.add_mutually_exclusive_group()
    sources.add_argument("--merge", nargs="+", metavar="CSV",
                         help="merge these CSVs (each once) into --out (no GPU needed), "
                         "recompute the token rows")
    sources.add_argument("--plot-only", metavar="CSV", help="only plot and summarise this CSV")
    p.add_argument("--list-kernels", action="store_true", help="print the kernel names and exit")
    p.add_argument("--profile", metavar="KERNEL",
                   help="for ncu --profile-from-start off: launch KERNEL once per set at the "
                   "first shape, batch and window given, between cudaProfilerStart/Stop")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The configuration the flags ask for; raises ValueError on a bad value."""
    values = {}
    if args.quick:
        values.update(QUICK)
        values["shapes"] = ((args.shapes or BenchConfig.shapes)[0],)
    for name in ("shapes", "batches", "windows", "reps", "lead_cycles", "warm_replays"):
        if getattr(args, name) is not None:  # given flags win over --quick's grid
            values[name] = getattr(args, name)
    shapes = [s for s in values.get("shapes", BenchConfig.shapes) if s in SHAPES]
    if args.kernels == "default":
        kernels = None
    elif args.kernels.strip() == "none":  # the peers' kernels alone (no CuTe DSL at hand)
        kernels = ()
    elif args.kernels == "all":
        kernels = for_shapes(shapes, ("cute", "emulation"), False)
    else:
        kernels = _names(args.kernels, "kernels")
    peers = () if args.peers.strip() == "none" else _names(args.peers, "peers")
    if args.kernels == "all":
        kernels = kernels + for_shapes(shapes, peers, False)
    if kernels == () and not peers:
        raise ValueError("kernels: 'none' with --peers none leaves nothing to time")
    plot_dir = {"none": None, None: ""}.get(args.plot_dir, args.plot_dir)
    # main resolves --out first (_common.default_out); a quick grid never names the committed CSV
    out = args.out or str(runs_folder("kernel_bench", ["quick"]) / "kernel_bench.csv"
                          if args.quick else BenchConfig.out)
    return BenchConfig(kernels=kernels, peers=tuple(peers), out=out, plot_dir=plot_dir,
                       budget_s=args.budget_s, peers_dir=args.peers_dir,
                       run_label=args.run_label, quick=args.quick, **values)


# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------


REDUCED_BATCHES = (256, 1, 32, 512)


def plan(config: BenchConfig) -> list[tuple]:
    """The points to measure, most important first: (tier, kernel, shape, window, batch,
    cursor). Tier 0 is the headline (first shape, L = 16, batch 256); 1 the first shape's other
    batches at L = 16; 2 the other shapes at L = 16 and 3 the other windows, both at the batches
    of `REDUCED_BATCHES`; 4 the rest of the grid. Within a tier the headline cursors come before
    the ones only the window numbers use, batch 256 and batch 1 first."""
    headline_window = HEADLINE_WINDOW if HEADLINE_WINDOW in config.windows else config.windows[0]
    batch_order = sorted(config.batches, key=lambda b: (b != HEADLINE_BATCH, b != 1, -b))
    points = []
    for s_idx, shape in enumerate(config.shapes):
        for window in config.windows:
            for b_idx, batch in enumerate(batch_order):
                if s_idx == 0 and window == headline_window:
                    tier = 0 if batch == HEADLINE_BATCH else 1
                elif batch in REDUCED_BATCHES:
                    tier = 2 if window == headline_window else 3
                else:
                    tier = 4
                for kernel in config.all_kernels():
                    if SHAPES[shape].kind not in KERNELS[kernel].recurrences:
                        continue
                    for c_idx, cursor in enumerate(KERNELS[kernel].cursors(window)):
                        key = (tier, min(c_idx, 1), s_idx, window != headline_window, window,
                               b_idx)
                        points.append((key, (tier, kernel, shape, window, batch, cursor)))
    points.sort(key=lambda p: p[0])
    return [p[1] for p in points]


def _row(config, spec, shape, batch, window, cursor, ceilings, **values) -> dict:
    row = dict(run=config.run_label, kernel=spec.name, impl=spec.impl, step=spec.step,
               scheme="", shape=shape, batch=batch, window=window, cursor=cursor,
               time_us=math.nan, time_us_p10=math.nan, time_us_p90=math.nan,
               bytes=kernel_bytes(spec, SHAPES[shape], batch, cursor), gbps=math.nan,
               frac_copy=math.nan, frac_read=math.nan, copy_gbps=ceilings["copy_gbps"],
               read_gbps=ceilings["read_gbps"], check=math.nan, status="ok", sets=0,
               timing="", note="")
    row.update(values)
    if row["time_us"] == row["time_us"]:
        row["gbps"] = row["bytes"] / row["time_us"] / 1e3
        row["frac_copy"] = row["gbps"] / row["copy_gbps"]
        row["frac_read"] = row["gbps"] / row["read_gbps"]
    return row


def _check(config, spec, shape, window, device) -> tuple[float, str]:
    """(ratio, status) of the kernel's fp64 check; status 'ok' only for a pass."""
    try:
        ratio = check_kernel(spec, shape, window, device, Path(config.peers_dir),
                             seed=config.seed, act=ACT_DTYPES[config.act])
    except Unavailable as error:
        return math.nan, f"unavailable: {harness.reason(error, False)}"
    except Exception as error:  # a kernel that raises is reported, the run goes on
        return math.nan, f"error: {harness.reason(error)}"
    return ratio, "ok" if ratio <= 1.0 else "check failed: not timed"


def run(config: BenchConfig, log=print) -> pd.DataFrame:
    """Measure every planned point (each kernel checked first; a failed check is not timed),
    write the tidy CSV to `config.out` and return it, token rows included. The rows so far
    are also written there every ~10 s, so a run killed at a time limit leaves its rows."""
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("kernel_bench: needs a CUDA GPU (torch.cuda.is_available() is False); "
                           "on a CPU machine use --plot-only or --merge")
    start = time.perf_counter()
    out = Path(config.out)
    ceilings = harness.measure_ceilings(lead_cycles=config.lead_cycles)
    log(f"copy {ceilings['copy_gbps']:,.0f} GB/s (read + write), streaming read "
        f"{ceilings['read_gbps']:,.0f} GB/s {ceilings['note']}")
    l2 = harness.l2_bytes(device)
    checks: dict[tuple, tuple[float, str]] = {}
    rows = []
    saved = time.perf_counter()
    for tier, kernel, shape_name, window, batch, cursor in plan(config):
        if time.perf_counter() - saved > 10.0:
            harness.write_csv(pd.DataFrame(rows, columns=COLUMNS), out)
            saved = time.perf_counter()
        spec, shape = KERNELS[kernel], SHAPES[shape_name]
        point = (config, spec, shape_name, batch, window, cursor, ceilings)
        if config.budget_s is not None and time.perf_counter() - start > config.budget_s:
            rows.append(_row(*point, status=f"skipped: budget {config.budget_s:.0f} s spent",
                             note=f"tier {tier}"))
            continue
        key = (kernel, shape_name, window)
        if key not in checks:
            checks[key] = _check(config, spec, shape, window, device)
            log(f"check {kernel:28s} {shape_name:16s} L={window:<3d} {checks[key][0]:8.3g}  "
                f"{checks[key][1]}")
        ratio, status = checks[key]
        if status != "ok":
            rows.append(_row(*point, check=ratio, status=status))
            continue
        try:
            sets = harness.sets_for(kernel_bytes(spec, shape, batch, cursor), l2,
                                    config.l2_multiple)
            case = build_case(spec, shape, batch, window, cursor, sets, device, config.seed,
                              Path(config.peers_dir), ACT_DTYPES[config.act])
            times, method = harness.time_launches(case.launchers(), case.reset, config.reps,
                                                  config.lead_cycles, config.warm_replays)
            del case
        except Exception as error:  # out of memory, a launch failure: record and go on
            rows.append(_row(*point, check=ratio, status=f"error: {harness.reason(error)}"))
            torch.cuda.empty_cache()
            continue
        p10, median, p90 = harness.quantiles(times)
        row = _row(*point, time_us=median, time_us_p10=p10, time_us_p90=p90, check=ratio,
                   sets=sets, timing=method, note=harness.settling_note(times))
        rows.append(row)
        log(f"{kernel:28s} {shape_name:16s} L={window:<3d} b={batch:<4d} c={cursor:<3d} "
            f"{row['time_us']:10.2f} us {row['gbps']:8.0f} GB/s {row['frac_copy']:6.1%}")
        torch.cuda.empty_cache()
    frame = pd.DataFrame(rows, columns=COLUMNS)
    config.extra["ceilings_start"] = ceilings
    try:  # the copy ceiling again, to see whether the card's state moved during the run
        config.extra["ceilings_end"] = harness.measure_ceilings(warm_s=0.0,
                                                                lead_cycles=config.lead_cycles)
    except Exception as error:  # a sticky CUDA error from a kernel: keep what was measured
        config.extra["ceilings_end"] = {"error": harness.reason(error)}
    config.extra["seconds"] = round(time.perf_counter() - start, 1)
    frame = with_token_rows(frame)
    harness.write_csv(frame, out)
    return frame


# --------------------------------------------------------------------------------------------
# Derived rows: cost per committed token, speedups
# --------------------------------------------------------------------------------------------


def _mean_interpolated(cursors, times, lo: int, hi: int) -> float:
    """Mean over the integer cursors lo..hi of the piecewise-linear interpolation of `times`
    measured at `cursors` (constant beyond the measured ends)."""
    import numpy as np

    order = np.argsort(np.asarray(cursors))
    xs, ys = np.asarray(cursors)[order], np.asarray(times)[order]
    return float(np.mean(np.interp(np.arange(lo, hi + 1), xs, ys)))


def token_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One `step = token` row per scheme x run x shape x batch x window whose kernels were all
    timed (module docstring, **Per committed token**)."""
    measured = frame[(frame["step"] != "token") & (frame["status"] == "ok")]
    columns = ("time_us", "time_us_p10", "time_us_p90")
    rows = []
    for scheme, kernels in SCHEMES.items():
        parts = measured[measured["kernel"].isin(kernels)]
        for (run_label, shape, batch, window), group in parts.groupby(
                ["run", "shape", "batch", "window"]):
            if set(group["kernel"]) != set(kernels):
                continue
            spec0 = KERNELS[kernels[0]]
            if spec0.step == "update":
                r = group.iloc[0]
                times = tuple(r[c] for c in columns)
                total_bytes, note = float(r["bytes"]), "one update per token"
            else:
                nonflush, flush = (group[group["kernel"] == k] for k in kernels)
                lo, hi = spec0.first_cursor, window - 2 + spec0.first_cursor
                f = flush.iloc[0]
                times = tuple(((window - 1) * _mean_interpolated(nonflush["cursor"],
                                                                 nonflush[c], lo, hi)
                               + f[c]) / window for c in columns)
                total_bytes = (sum(kernel_bytes(kernels[0], SHAPES[shape], batch, c)
                                   for c in range(lo, hi + 1))
                               + kernel_bytes(kernels[1], SHAPES[shape], batch, int(f["cursor"])))
                total_bytes /= window
                note = f"non-flush cursors timed: {sorted(nonflush['cursor'].astype(int))}"
            first = group.iloc[0]
            gbps = total_bytes / times[0] / 1e3
            rows.append(dict(
                run=run_label, kernel=f"{spec0.impl}:token:{scheme}", impl=spec0.impl,
                step="token", scheme=scheme, shape=shape, batch=batch, window=window, cursor=-1,
                time_us=times[0], time_us_p10=times[1], time_us_p90=times[2], bytes=total_bytes,
                gbps=gbps, frac_copy=gbps / first["copy_gbps"], frac_read=gbps / first["read_gbps"],
                copy_gbps=first["copy_gbps"], read_gbps=first["read_gbps"],
                check=group["check"].max(), status="ok", sets=int(group["sets"].min()),
                timing=",".join(sorted(set(group["timing"]))), note=note,
            ))
    return pd.DataFrame(rows, columns=COLUMNS)


def with_token_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` without its token rows, then the token rows recomputed from it."""
    base = frame[frame["step"] != "token"]
    tokens = token_rows(base)
    return (pd.concat([base, tokens], ignore_index=True) if len(tokens)
            else base.reset_index(drop=True))


def _headline_time(frame: pd.DataFrame, name: str | tuple[str, ...]) -> pd.DataFrame:
    """Per (run, shape, batch, window): the time of a scheme's token row, or of a kernel at its
    headline cursor (L/2 for non-flush steps); for a tuple of schemes, the least of theirs."""
    keys = ["run", "shape", "batch", "window"]
    if isinstance(name, tuple):
        times = pd.concat([_headline_time(frame, n) for n in name], ignore_index=True)
        return times.groupby(keys, as_index=False)["time_us"].min()
    ok = frame[frame["status"] == "ok"]
    if name in SCHEMES:
        sel = ok[(ok["step"] == "token") & (ok["scheme"] == name)]
    else:
        sel = ok[ok["kernel"] == name]
        headline = sel["window"].map(lambda w: KERNELS[name].cursors(int(w))[0])
        sel = sel[sel["cursor"] == headline]
    return sel[[*keys, "time_us"]]


def _target(label: str, shape: str) -> float | None:
    """The goal of a comparison at the headline batch for `shape`'s recurrence, or None."""
    kind = SHAPES[shape].kind if shape in SHAPES else "mamba2"
    goals = [goal for name, batch, goal in GOALS[kind] if name == label and batch is None]
    return goals[0] if goals else None


def speedups(frame: pd.DataFrame) -> pd.DataFrame:
    """Every comparison of `COMPARISONS` at every (shape, batch, window) where both sides were
    timed; a pair from two runs is marked `same_run = False`; `target`: the goal at the
    headline batch for the shape's recurrence (`GOALS`)."""
    keys = ["shape", "batch", "window"]
    rows = []
    for label, numerator, denominator in COMPARISONS:
        num, den = _headline_time(frame, numerator), _headline_time(frame, denominator)
        if num.empty or den.empty:
            continue
        merged = num.merge(den, on=keys, suffixes=("_num", "_den"))
        names = "|".join(numerator) if isinstance(numerator, tuple) else numerator
        for _, r in merged.iterrows():
            rows.append(dict(comparison=label, numerator=names, denominator=denominator,
                             shape=r["shape"], batch=int(r["batch"]), window=int(r["window"]),
                             speedup=r["time_us_num"] / r["time_us_den"],
                             same_run=r["run_num"] == r["run_den"], run_num=r["run_num"],
                             run_den=r["run_den"], target=_target(label, r["shape"])))
    frame = pd.DataFrame(rows, columns=["comparison", "numerator", "denominator", "shape",
                                        "batch", "window", "speedup", "same_run", "run_num",
                                        "run_den", "target"])
    # one value per comparison and point: a same-run pair if there is one, then the first
    # run by label (as the plots draw kernels), whatever order the CSVs were merged in
    frame = frame.sort_values(["same_run", "run_num", "run_den"], ascending=[False, True, True],
                              kind="stable")
    return frame.drop_duplicates(["comparison", "shape", "batch", "window"]).sort_values(
        ["comparison", "shape", "window", "batch"]).reset_index(drop=True)


def summarize(frame: pd.DataFrame, shape: str = "nemotron3-super", batch: int = HEADLINE_BATCH,
              window: int = HEADLINE_WINDOW) -> pd.DataFrame:
    """The goals of `shape`'s recurrence at the headline point (`GOALS`): (comparison,
    achieved, goal, met, run). Where several runs timed a point, the value comes from the first
    run by label (a same-run pair first, for a ratio), as the plots draw it; `run` names it
    ("A", or "A/B" for a pair of runs)."""
    kind = SHAPES[shape].kind if shape in SHAPES else "mamba2"
    ok = frame[frame["status"] == "ok"]
    rows = []
    nf = ok[(ok["kernel"] == "cute:nonflush:nvfp4") & (ok["shape"] == shape)
            & (ok["batch"] == batch) & (ok["window"] == window)
            & (ok["cursor"] == KERNELS["cute:nonflush:nvfp4"].cursors(window)[0])]
    nf = nf.sort_values("run", kind="stable")
    frac = float(nf["frac_copy"].iloc[0]) if len(nf) else math.nan
    rows.append(("two-precision non-flush, fraction of copy bandwidth", frac, NONFLUSH_GOAL,
                 nf["run"].iloc[0] if len(nf) else ""))
    sp = speedups(frame)
    point = sp[(sp["shape"] == shape) & (sp["window"] == window)]

    def pick(sel):
        if not len(sel):
            return math.nan, ""
        r = sel.iloc[0]
        run = r["run_num"] if r["run_num"] == r["run_den"] else f"{r['run_num']}/{r['run_den']}"
        return float(r["speedup"]), run

    for label, at, goal in GOALS[kind]:
        at = batch if at is None else at
        speedup, run = pick(point[(point["comparison"] == label) & (point["batch"] == at)])
        rows.append((f"{label} (batch {at})", speedup, goal, run))
    out = pd.DataFrame(rows, columns=["comparison", "achieved", "goal", "run"])
    out["met"] = out["achieved"] >= out["goal"]
    return out[["comparison", "achieved", "goal", "met", "run"]]


def format_summary(frame: pd.DataFrame, shape: str | None = None) -> str:
    """The summary printed last: per shape (`shape`, or each shape of the frame), the goals,
    then µs per committed token of every scheme."""
    present = set(frame["shape"])
    shapes = [shape] if shape else ([s for s in SHAPES if s in present]
                                    + sorted(present - set(SHAPES)) or [next(iter(SHAPES))])
    lines = []
    for name in shapes:
        kind = SHAPES[name].kind if name in SHAPES else "mamba2"
        lines.append(f"goals ({name}, {RECURRENCES[kind]}, batch {HEADLINE_BATCH}, "
                     f"L = {HEADLINE_WINDOW}):")
        for _, r in summarize(frame, name).iterrows():
            verdict = ("n/a" if r["achieved"] != r["achieved"]
                       else ("met" if r["met"] else "MISSED"))
            run = f"  (run {r['run']})" if r["run"] else ""
            lines.append(f"  {r['comparison']:<62s} {r['achieved']:8.3f}  goal "
                         f"{r['goal']:<5g} {verdict}{run}")
        tokens = frame[(frame["step"] == "token") & (frame["shape"] == name)
                       & (frame["window"] == HEADLINE_WINDOW)]
        if len(tokens):
            table = tokens.pivot_table(index="scheme", columns="batch", values="time_us",
                                       aggfunc="min")
            lines.append(f"µs per committed token ({name}, L = {HEADLINE_WINDOW}):")
            lines.append(table.to_string(float_format=lambda v: f"{v:.2f}"))
    skipped = frame["status"].str.startswith("skipped")
    if skipped.any():
        lines.append(f"  {int(skipped.sum())} points skipped by the time budget "
                     f"({', '.join(sorted(set(frame.loc[skipped, 'note'])))})")
    problems = frame[(frame["status"] != "ok") & ~skipped].drop_duplicates(["kernel", "status"])
    for _, r in problems.iterrows():
        lines.append(f"  not timed: {r['kernel']}: {r['status'][:160]}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Reading a CSV back
# --------------------------------------------------------------------------------------------


def read_csv(path: str | Path) -> pd.DataFrame:
    """A CSV written by `run` / `--merge`, checked (`harness.read_table`): the columns of
    `COLUMNS` with their types, one row per point, known kernels, steps and schemes. A
    ValueError names the file and the row."""
    frame = harness.read_table(path, COLUMN_TYPES, KEY, what="kernel_bench CSV")
    frame = frame[COLUMNS]
    checks = (("kernel", frame["step"] != "token", set(KERNELS)),
              ("scheme", frame["step"] == "token", set(SCHEMES)),
              ("step", slice(None), {"nonflush", "flush", "update", "token"}))
    for column, rows, allowed in checks:
        values = frame.loc[rows, column]
        bad = values[~values.isin(allowed)]
        if len(bad):
            raise ValueError(f"{path}: line {bad.index[0] + 2}: column {column}: unknown "
                             f"{column} {bad.iloc[0]!r}")
    return frame


# --------------------------------------------------------------------------------------------
# Entry points: profile, main
# --------------------------------------------------------------------------------------------


def profile(config: BenchConfig, kernel: str) -> int:
    """Launch `kernel` at the first shape, batch and window of `config` (headline cursor) on 4
    sets, warmed, with the CUDA profiler on only around one launch per set: the ncu reading of
    where its time goes (`ncu --profile-from-start off --clock-control none ...`)."""
    if not torch.cuda.is_available():
        print("kernel_bench: --profile needs a CUDA GPU", file=sys.stderr)
        return 2
    spec, shape = KERNELS[kernel], SHAPES[config.shapes[0]]
    window = config.windows[0]
    case = build_case(spec, shape, config.batches[0], window, spec.cursors(window)[0], 4,
                      torch.device("cuda"), config.seed, Path(config.peers_dir),
                      ACT_DTYPES[config.act])
    launches = case.launchers()
    reset = case.reset or (lambda: None)
    for _ in range(3):
        reset()
        for launch in launches:
            launch()
    reset()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {kernel} at {shape.name}, batch {config.batches[0]}, L = {window}",
          file=sys.stderr)
    return 0


def _plot_dir(config: BenchConfig, csv: Path) -> Path | None:
    if config.plot_dir is None:
        return None
    return Path(config.plot_dir) if config.plot_dir else csv.parent


def _finish(frame: pd.DataFrame, csv: Path, plot_dir: Path | None) -> None:
    if plot_dir is not None:
        for path in plot(csv, plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    print(format_summary(frame))


def _merge_or_plot(parser, args, config: BenchConfig, out: Path, plot_dir: Path | None,
                   argv) -> int:
    sources = [args.plot_only] if args.plot_only else args.merge
    try:
        frames = [read_csv(path) for path in sources]
    except (OSError, ValueError) as error:
        parser.error(str(error))
    labels = {}  # the run column keeps merged runs apart: one label, one file
    for path, part in zip(sources, frames, strict=True):
        for label in part["run"].unique():
            if label in labels:
                parser.error(f"--merge: run label {label!r} is in both {labels[label]} and "
                             f"{path} (relabel one run's rows)")
            labels[label] = path
    frame = with_token_rows(pd.concat(frames, ignore_index=True))
    csv = out if args.merge else Path(args.plot_only)
    try:  # os.access (the checks before) says yes to root for paths it cannot write
        if args.merge:
            harness.write_csv(frame, out)
            # a meta.json beside it records its bytes (read_csv checks them) and its sources
            harness.write_run_meta(out, "experiments.kernel_bench", argv, 0.0,
                                   {"merged": [str(path) for path in sources]})
            print(f"wrote {out} ({len(frame)} rows)", file=sys.stderr)
        _finish(frame, csv, plot_dir)
    except OSError as error:
        parser.error(f"cannot write the results: {error}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_kernels:
        for name, spec in KERNELS.items():
            kinds = ", ".join(RECURRENCES[r] for r in spec.recurrences)
            print(f"{name:30s} {'default' if spec.default else 'optional':9s} {kinds}")
        return 0
    if args.out is None and not args.merge and not args.plot_only:
        # the default grid regenerates the committed CSV; any other run goes to runs/
        args.out = str(default_out(parser, args, "kernel_bench", BenchConfig.out))
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    out = Path(config.out)
    if is_folder(out):
        parser.error(f"--out: expected a CSV path, got the folder {out}")
    if config.plot_dir and is_file(config.plot_dir):
        parser.error(f"--plot-dir: expected a folder or 'none', got the file {config.plot_dir}")
    if args.profile:
        if args.profile not in KERNELS:
            parser.error(f"--profile: expected a kernel name of --list-kernels, got "
                         f"{args.profile!r}")
        return profile(config, args.profile)
    if args.merge:
        seen = {}  # a CSV given twice would have every row of it counted twice
        for path in args.merge:
            if Path(path).resolve() in seen:
                parser.error(f"--merge: the CSV {path} is given twice (also as "
                             f"{seen[Path(path).resolve()]})")
            seen[Path(path).resolve()] = path
        if args.out is None:  # the default would replace the committed headline CSV
            parser.error(f"--merge: name the merged CSV with --out (e.g. --out "
                         f"{BenchConfig.out} to replace the committed one)")
    if not args.plot_only and (problem := file_problem(out)):  # --merge and a run write --out
        parser.error(f"--out: cannot write {out}: {problem}")
    # --plot-only puts its PNGs beside the CSV it reads, or beside an --out given with it
    plot_base = Path(args.plot_only) if args.plot_only and args.out is None else out
    plot_dir = _plot_dir(config, plot_base)
    if plot_dir is not None and (problem := folder_problem(plot_dir)):
        parser.error(f"--plot-dir: {problem}")
    if args.plot_only or args.merge:
        return _merge_or_plot(parser, args, config, out, plot_dir, argv)
    try:
        frame = run(config, log=lambda text: print(text, file=sys.stderr, flush=True))
    except RuntimeError as error:
        print(str(error), file=sys.stderr)
        return 2
    except OSError as error:  # the CSV is written as the run goes
        parser.error(f"cannot write the results: {error}")
    settings = asdict(replace(config, extra={}))
    settings.update(config.extra)
    try:
        harness.write_run_meta(out, "experiments.kernel_bench", argv,
                               config.extra.get("seconds", 0.0), settings)
        print(f"wrote {out} ({len(frame)} rows)", file=sys.stderr)
        _finish(frame, out, plot_dir)
    except OSError as error:
        parser.error(f"cannot write the results: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
