"""The one GPU benchmark harness of the kit: every timing in `experiments` goes through it.

    buffers   `Buffers`: each named tensor in one allocation of `sets` rows (256-byte aligned),
              so that a set per launch rotates through more memory than the L2 holds
              (`sets_for`) and one op fills or resets every set
    timing    `time_launches`: one launch per set captured in a CUDA graph, `reset()` between
              replays outside the timed region, `WARM_REPLAYS` untimed replays first, each
              timed replay behind a GPU spin of `LEAD_CYCLES` so that the host's submission is
              not timed; eager launches timed by events where capture fails
    ceilings  `measure_ceilings`: after a second of copies, the device-to-device copy (bytes
              read + written) and a streaming read of 1 GiB, timed behind the same spin
    outputs   `write_csv` (temp name in the same folder, then rename), `write_run_meta`
              (the command, the commit, the GPU's identity), `save_figure` (PNG at 150 dpi)
    reading   `read_table`: a CSV checked against its columns' types and its key, refused in
              one line naming the file and the row

The bit checks before timing live with the cases (`experiments.cases.check_kernel`): a case
whose check fails is never handed to `time_launches`.
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments._interrupt import raise_if_interrupted

__all__ = [
    "LEAD_CYCLES",
    "WARM_REPLAYS",
    "L2_MULTIPLE",
    "SETTLING",
    "FIG_DPI",
    "Buffers",
    "fill",
    "event_time_ms",
    "measure_ceilings",
    "time_launches",
    "quantiles",
    "settling_note",
    "sets_for",
    "l2_bytes",
    "reason",
    "gpu_identity",
    "versions",
    "write_csv",
    "write_run_meta",
    "save_figure",
    "read_table",
]

# A spin of this many GPU cycles (about 100 us at 1.98 GHz) is queued before each timed
# region's start event, so that the GPU is still busy with it while the host submits the event
# and the work: without it the start event fires at once on an idle stream and the host's
# submission (several microseconds for a graph launch) is timed as well.
LEAD_CYCLES = 200_000

# Replays not timed before each point's timed ones: a freshly built buffer set runs 6% slower
# for its first 10-26 passes with the clocks at 1,980 MHz throughout (H200, 2026-12-01,
# `python -m experiments.warm_transient`, results/warm_transient.csv); 32 puts every timed
# replay past that transient. A point whose timed replays still drift is noted (`settling_note`).
WARM_REPLAYS = 32

# Buffer sets so that one rotation touches at least this many times the L2 (`sets_for`).
L2_MULTIPLE = 4.0

# The timed replays' first half this much slower than their second: flagged as still settling.
SETTLING = 1.02

FIG_DPI = 150
_ALIGN = 256  # bytes between sets' rows (the CuTe kernels need 16-byte-aligned tensors)


# --------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------


class Buffers:
    """Per-set tensors of one configuration. `views[name]` is the list over sets; each field
    lives in one allocation (`bases[name]`, one row a set, rows 256-byte aligned)."""

    def __init__(self, sets: int, device, generator: torch.Generator,
                 act: torch.dtype = torch.bfloat16):
        self.sets = sets
        self.device = device
        self.gen = generator
        self.act = act
        self.bases: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        self.nbytes = 0

    def add(self, name: str, shape, dtype: torch.dtype, kind: str, *args) -> list[torch.Tensor]:
        """A new field of `shape` and `dtype` in every set, filled by `kind` (see `fill`)."""
        if name in self.views:
            raise ValueError(f"name: expected a new field, got {name!r} twice")
        numel = math.prod(shape)
        item = torch.empty((), dtype=dtype).element_size()
        row = -(-numel * item // _ALIGN) * _ALIGN // item
        base = torch.empty(self.sets, row, dtype=dtype, device=self.device)
        fill(base, kind, self.gen, *args)
        self.bases[name] = base
        self.views[name] = [base[i, :numel].view(shape) for i in range(self.sets)]
        self.nbytes += numel * item
        return self.views[name]

    def __getitem__(self, name: str) -> list[torch.Tensor]:
        return self.views[name]

    def __contains__(self, name: str) -> bool:
        return name in self.views

    def at(self, i: int) -> dict[str, torch.Tensor]:
        """Set `i`'s tensors by name."""
        return {name: views[i] for name, views in self.views.items()}


def fill(t: torch.Tensor, kind: str, gen: torch.Generator, *args) -> None:
    """Random contents by kind (never zeros where values are read): randn [scale], dt_raw
    (softplus input), dt_proc (a processed dt in (0.01, 0.51)), unit n (runs of n consecutive
    elements of unit L2 norm: GDN's normalised keys and queries), sigmoid (a GDN beta in
    (0, 1)), log_decay (a GDN g = -exp(randn / 2) / tau, tau log-uniform in [1, 1000]: short
    and long memory side by side), bytes low high, e4m3 (valid codes), const value, empty
    (left as allocated: written before it is read)."""
    if kind == "randn":
        scale = args[0] if args else 1.0
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device) * scale)
    elif kind == "unit":
        (n,) = args
        values = torch.randn(t.shape, generator=gen, device=t.device).reshape(t.shape[0], -1)
        whole = values.shape[1] // n * n  # a set's padding after its last run stays random
        runs = values[:, :whole].unflatten(1, (-1, n))
        values[:, :whole] = (runs / runs.norm(dim=-1, keepdim=True)).flatten(1)
        t.copy_(values.view(t.shape))
    elif kind == "sigmoid":
        t.copy_(torch.sigmoid(torch.randn(t.shape, generator=gen, device=t.device)))
    elif kind == "log_decay":
        tau = torch.exp(torch.rand(t.shape, generator=gen, device=t.device) * math.log(1000.0))
        t.copy_(-torch.exp(0.5 * torch.randn(t.shape, generator=gen, device=t.device)) / tau)
    elif kind == "dt_raw":
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device) - 1.0)
    elif kind == "dt_proc":
        t.copy_(torch.rand(t.shape, generator=gen, device=t.device) * 0.5 + 0.01)
    elif kind == "bytes":
        low, high = args
        t.copy_(torch.randint(low, high, t.shape, generator=gen, device=t.device))
    elif kind == "e4m3":
        values = torch.randn(t.shape, generator=gen, device=t.device)
        t.copy_(values.to(torch.float8_e4m3fn).view(torch.uint8))
    elif kind == "const":
        t.fill_(args[0])
    elif kind != "empty":
        raise ValueError(f"kind: expected randn, dt_raw, dt_proc, unit, sigmoid, log_decay, "
                         f"bytes, e4m3, const or empty, got {kind!r}")


def sets_for(call_bytes: int, l2: int, multiple: float = L2_MULTIPLE,
             max_sets: int = 1024) -> int:
    """Buffer sets so that one rotation of calls (each moving `call_bytes`) touches at least
    `multiple` x the L2; 4 at least, so a replay never times a single launch."""
    return int(min(max(4, math.ceil(multiple * l2 / max(call_bytes, 1))), max_sets))


def l2_bytes(device=None) -> int:
    """The GPU's L2 size (50 MiB where there is no GPU: CPU runs of the harness)."""
    device = torch.device(device or "cuda")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).L2_cache_size
    return 50 * 2**20


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def event_time_ms(fn, lead_cycles: int = LEAD_CYCLES) -> float:
    """Milliseconds between CUDA events around `fn()`, the start queued behind a spin."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if lead_cycles:
        torch.cuda._sleep(lead_cycles)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure_ceilings(nbytes: int = 2**30, warm_s: float = 1.0, reps: int = 20,
                     lead_cycles: int = LEAD_CYCLES) -> dict:
    """Warm the card for `warm_s`, then {copy_gbps (bytes read + written), read_gbps (a
    streaming read, each byte once), note} on `nbytes` buffers."""
    src = torch.rand(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    deadline = time.perf_counter() + warm_s
    while time.perf_counter() < deadline:
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()
    copy_ms = statistics.median(event_time_ms(lambda: dst.copy_(src), lead_cycles)
                                for _ in range(reps))
    note = ""
    try:
        from experiments._stream_read import stream_read

        props = torch.cuda.get_device_properties(0)
        partial = torch.empty(props.multi_processor_count * 8, device="cuda")
        stream_read(src, partial)
        read_ms = statistics.median(
            event_time_ms(lambda: stream_read(src, partial), lead_cycles) for _ in range(reps))
    except Exception as error:  # Triton missing or failing: a torch reduction instead
        note = f"streaming read by torch.sum ({type(error).__name__})"
        read_ms = statistics.median(event_time_ms(lambda: src.sum(), lead_cycles)
                                    for _ in range(reps))
    return dict(copy_gbps=2 * nbytes / copy_ms / 1e6, read_gbps=nbytes / read_ms / 1e6,
                note=note)


def time_launches(launches: list, reset=None, reps: int = 20, lead_cycles: int = LEAD_CYCLES,
                  warm_replays: int = WARM_REPLAYS, streams: int = 1) -> tuple[list[float], str]:
    """Per-launch microseconds of `reps` replays of `launches` (one per rotating buffer set),
    captured in one CUDA graph (eager launches where capture fails), `reset()` before each
    replay outside the timed region, `warm_replays` replays first untimed; and the method
    ('graph' or 'events'). With `streams` > 1, launch i goes on side stream i % `streams`,
    forked from the current stream and joined to it inside the timed region, so consecutive
    launches may overlap (`experiments.tail_overlap`)."""
    reset = reset or (lambda: None)
    side = [torch.cuda.Stream() for _ in range(streams)] if streams > 1 else []

    def eager():
        main = torch.cuda.current_stream() if side else None
        for stream in side:
            stream.wait_stream(main)
        for i, launch in enumerate(launches):
            if side:
                with torch.cuda.stream(side[i % streams]):
                    launch()
            else:
                launch()
        for stream in side:
            main.wait_stream(stream)

    reset()
    eager()
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        reset()
        with torch.cuda.stream(stream):
            eager()
        torch.cuda.current_stream().wait_stream(stream)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        run_once, method = graph.replay, "graph"
    except Exception:  # not capturable (a host sync in a launcher): eager launches
        torch.cuda.synchronize()
        run_once, method = eager, "events"
    times = []
    for rep in range(reps + warm_replays):
        reset()
        elapsed = event_time_ms(run_once, lead_cycles) * 1e3 / len(launches)
        if rep >= warm_replays:
            times.append(elapsed)
    return times, method


def quantiles(times: list[float]) -> tuple[float, float, float]:
    """(p10, median, p90) of per-launch times."""
    q = np.quantile(np.asarray(times, dtype=float), [0.1, 0.5, 0.9])
    return float(q[0]), float(q[1]), float(q[2])


def settling_note(times: list[float]) -> str:
    """A note for the CSV if the timed replays were still settling (their first half's median
    more than `SETTLING` x the second half's: the warm-up too short on this machine), else ''."""
    half = len(times) // 2
    if half < 2:
        return ""
    early, late = statistics.median(times[:half]), statistics.median(times[half:])
    if early > SETTLING * late:
        return f"still settling: the first {half} timed replays {early / late - 1:.1%} slower"
    return ""


def reason(error: BaseException, with_type: bool = True) -> str:
    """An exception as one short line (CSV cells and logs)."""
    text = " ".join(str(error).split())
    text = f"{type(error).__name__}: {text}" if with_type else text
    return text if len(text) <= 300 else text[:297] + "..."


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------

GPU_IDENTITY_FIELDS = ("uuid", "serial", "pci.bus_id", "vbios_version", "driver_version",
                       "clocks.max.sm", "clocks.max.memory", "power.limit", "ecc.mode.current")


def gpu_identity(run=None) -> dict:
    """Which physical GPU ran (nvidia-smi's `GPU_IDENTITY_FIELDS` of GPU 0): H200 machines
    with equal clocks and copy ceilings within 0.7% timed the same non-flush step 6% apart
    (55.9-59.4 us at the headline point, 2026-11-30), so a time is compared only with times
    from the same machine. ``run``: a subprocess.run stand-in (tests). Never raises."""
    run = run or subprocess.run
    query = ["nvidia-smi", f"--query-gpu={','.join(GPU_IDENTITY_FIELDS)}",
             "--format=csv,noheader", "--id=0"]
    try:
        done = run(query, capture_output=True, text=True, timeout=20)
    except Exception as error:  # no nvidia-smi, or it hung
        return {"error": f"{type(error).__name__}: {error}"}
    values = [v.strip() for v in (done.stdout or "").strip().split(",")]
    if done.returncode != 0 or len(values) != len(GPU_IDENTITY_FIELDS):
        return {"error": f"nvidia-smi exit {done.returncode}: {(done.stderr or done.stdout)[:200]}"}
    return dict(zip(GPU_IDENTITY_FIELDS, values, strict=True))


def versions() -> dict:
    """Versions of the packages a timing depends on, and the GPU's name and identity."""
    found = {"torch": torch.__version__}
    for name in ("triton", "cutlass", "pandas"):
        try:
            found[name] = getattr(__import__(name), "__version__", "unknown")
        except Exception as error:  # a missing package is a fact worth recording
            found[name] = f"absent ({type(error).__name__})"
    try:
        from importlib.metadata import version

        found["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except Exception:
        found["nvidia-cutlass-dsl"] = "unknown (not installed as a distribution)"
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["cuda"] = torch.version.cuda
        found["gpu_identity"] = gpu_identity()
    return found


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def write_csv(frame: pd.DataFrame, path: str | Path, **options) -> Path:
    """`frame` as CSV at `path`, written under a temporary name in the same folder and then
    renamed, so that a reader (or a run killed mid-write) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            frame.to_csv(f, index=False, **options)
        raise_if_interrupted()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_run_meta(csv: str | Path, module: str, argv, seconds: float, config: dict) -> Path:
    """The `.meta.json` beside a GPU run's CSV: the command as typed, `config` with the
    package versions and the GPU's identity (experiments._common.write_meta)."""
    from experiments._common import write_meta

    argv = sys.argv[1:] if argv is None else list(argv)
    command = " ".join([f"python -m {module}", *map(shlex.quote, argv)])
    return write_meta(csv, command, seconds, {**config, "versions": versions()}, device="cuda")


def save_figure(fig, path: str | Path) -> Path:
    """`fig` as a PNG at `FIG_DPI`, cropped to what is drawn (legends outside the axes
    included), in a 128-colour palette (a third of the RGBA bytes, no visible change for line
    plots), folders made, written under a temporary name and renamed."""
    import io

    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=FIG_DPI, format="png", bbox_inches="tight")
    buffer.seek(0)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        with Image.open(buffer) as image:
            image.convert("RGB").quantize(colors=128).save(tmp, format="PNG", optimize=True)
        raise_if_interrupted()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------------------------
# Reading a CSV back
# --------------------------------------------------------------------------------------------


def read_table(path: str | Path, columns: dict[str, str], key: list[str] | None = None,
               optional: dict[str, str] | None = None, what: str = "") -> pd.DataFrame:
    """The CSV at `path`, checked by `_common.read_table` with loose columns: `columns` (name
    -> 'str', 'int', 'float' (NaN allowed) or 'bool') present, other columns kept as text,
    `optional` ones checked when present, no two rows with the same `key`, and, where its
    `.meta.json` records the CSV's sha256 (`write_run_meta`), those bytes. Raises ValueError
    in one line naming the file and the row (its line in the file, the header being line 1)."""
    from experiments._common import Column, Schema
    from experiments._common import read_table as read_checked

    kinds = {"str": str, "int": int, "float": float, "bool": bool}
    schema = Schema(
        (*(Column(n, kinds[k], loose=True) for n, k in columns.items()),
         *(Column(n, kinds[k], loose=True, optional=True)
           for n, k in (optional or {}).items() if n not in columns)),
        keys=tuple(key or ()), exact=False)
    return read_checked(path, schema, what=what, recorded=True)
