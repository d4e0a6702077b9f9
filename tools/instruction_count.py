"""Static SASS instruction counts per state element, and registers per thread, of the kit's
kernels in their default configurations, compiled for sm_90a on the CPU.

    python -m tools.instruction_count            # flush and non-flush kernels, fast paths
                                                 # (and the GDN kernels)
    python -m tools.instruction_count --with-fallbacks
    python -m tools.instruction_count --pipes    # by Hopper pipe, floors, per-token budgets
    python -m tools.instruction_count --pipes --layer qwen3-next-80b  # the same for GDN
    python -m tools.instruction_count --sr 32:10,8:4  # and fp16 SR + nvfp4 at other SR settings
    python -m tools.instruction_count --ncu REPORT  # what ncu counted executed
        # (REPORT: the trimmed raw page `scripts/gpu.sh profile` writes)

The flush kernel is unrolled (its elements per thread, no loops but the CTA's ring staging), so
the number of SASS instructions in the compiled kernel divided by the elements a thread owns is
what one thread issues per element, which is what bounds an ALU-bound kernel. The counts of the
format pairs say where the instructions go: fp16 RN without a read copy is the fold, the output
and the stores; SR adds Philox and the rounding; nvfp4 adds the encoder.

The SR and NVFP4 encoders have a fast path and a general fallback that a thread takes only
for rare elements (fp16 subnormals, quotients within 2^-20 of an E2M1 decision point), so by
default the fallbacks are compiled out (replaced by a constant) to count what a thread runs;
`--with-fallbacks` counts the kernel as shipped.

Needs `ptxas` from CUDA 12.9 or newer (CuTe DSL 4.8 emits PTX 8.8) and `cuobjdump`: the
`CUDA_HOME` toolkit's, else the first on PATH, else (cuobjdump only: its ptxas is older) the
one in Triton's wheel. `--ncu` alone compiles nothing. docs/performance.md lists the counts
measured for each default and the commits that changed them.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.instruction_count")

import argparse  # noqa: I001  (_compile must precede cutlass)
import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

from cute_kernels import _compile  # (sm_90a target before cutlass)

import cutlass  # noqa: E402

from cute_kernels.cache import ReplayCache, check_replay_cache  # noqa: E402
from cute_kernels import numerics as nm  # noqa: E402
from cute_kernels import replay_flush as rf  # noqa: E402
from cute_kernels import replay_output as ro  # noqa: E402

# The flush's (recurrence copy, rounding, read copy) pairs: the kit's schemes, and the two
# halves of its two-precision flush (SR without the encoder, the encoder without SR).
FLUSH_FORMATS = (
    ("fp32", "rn", "none"),
    ("fp16", "rn", "none"),
    ("fp16", "sr", "none"),
    ("fp16", "rn", "nvfp4"),
    ("fp16", "sr", "nvfp4"),
)
# The non-flush kernel's read-copy formats.
NONFLUSH_FORMATS = ("nvfp4", "fp8_e4m3", "fp16", "fp32")
NEMOTRON = dict(nheads=128, headdim=64, dstate=128, ngroups=8, window=16)
HEADLINE_BATCH = 256  # the batch of the headline benchmark point


def _tool(name: str) -> str:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [os.path.join(home, "bin", name), shutil.which(name)]
    if name == "cuobjdump":  # Triton's wheel carries one; its ptxas is too old for CuTe DSL
        try:
            import triton

            bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
            candidates.append(os.path.join(bundled, name))
        except ImportError:
            pass
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise SystemExit(f"instruction_count: {name} not found (set CUDA_HOME to a CUDA 12.9+ toolkit)")


def tools_problem() -> str | None:
    """Why ptxas (CUDA 12.9 or newer: CuTe DSL 4.8 emits PTX 8.8) or cuobjdump cannot be used,
    or None."""
    try:
        ptxas, _ = _tool("ptxas"), _tool("cuobjdump")
        banner = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    except SystemExit as error:
        return str(error).removeprefix("instruction_count: ")
    except OSError as error:
        return f"ptxas --version failed: {error.strerror or error}"
    release = re.search(r"release (\d+)\.(\d+)", banner)
    if not release:
        return f"{ptxas} printed no release number"
    if (int(release[1]), int(release[2])) < (12, 9):
        return (f"{ptxas} is release {release[1]}.{release[2]}; CuTe DSL's PTX 8.8 needs 12.9 "
                "or newer (set CUDA_HOME)")
    return None


def tools_available() -> bool:
    """Whether ptxas (CUDA 12.9 or newer) and cuobjdump were found (tests skip without)."""
    return tools_problem() is None


def sass_histogram(ptx: str) -> tuple[collections.Counter, int]:
    """(opcode -> count, registers per thread) of the SASS that ptxas makes of `ptx` for
    sm_90a."""
    sass, log = _compile_sass(ptx)
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and m.group(1) not in ("NOP", "EXIT", "BRA"):
            ops[m.group(1)] += 1
    registers = re.findall(r"Used (\d+) registers", log)
    return ops, int(registers[-1]) if registers else -1


def _compile_sass(ptx: str) -> tuple[str, str]:
    """(cuobjdump's SASS listing, ptxas's -v log) of `ptx` compiled for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run(
            [_tool("ptxas"), "-arch=sm_90a", "-O3", "-v", src, "-o", cubin],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"instruction_count: ptxas failed:\n{done.stderr[-2000:]}")
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    return sass, done.stderr


def flush_config(hi: str, rounding: str, lo: str,
                 sr: tuple[int, int] = (nm.DEFAULT_SR_BITS, nm.DEFAULT_PHILOX_ROUNDS)
                 ) -> rf.FlushConfig:
    """The configuration `mamba2_replay_flush` runs at the Nemotron-3-Super head (bf16
    activations, fp32 dt, D and dt_bias, no z, no debug output): `rf.flush_config`'s defaults
    for a one-slot cache on the CPU (the flush's configuration does not depend on the batch);
    `sr`: the cache's (sr_bits, philox_rounds)."""
    cache = ReplayCache.empty(1, NEMOTRON["nheads"], NEMOTRON["headdim"], NEMOTRON["dstate"],
                              ngroups=NEMOTRON["ngroups"], window=NEMOTRON["window"],
                              hi_format=hi, hi_rounding=rounding, lo_format=lo,
                              sr_bits=sr[0], philox_rounds=sr[1])
    view = check_replay_cache(cache)
    x = torch.empty(1, NEMOTRON["nheads"], NEMOTRON["headdim"], dtype=torch.bfloat16)
    dt = torch.empty(1, NEMOTRON["nheads"], dtype=torch.float32)
    per_head = torch.empty(NEMOTRON["nheads"], dtype=torch.float32)
    return rf.flush_config(cache, view, x, dt, D=per_head, z=None, dt_bias=per_head)


def variant_name(pair: tuple) -> str:
    """'fp16 sr hi + nvfp4', or with an SR setting (a fourth entry) 'fp16 sr16r7 hi + nvfp4'."""
    hi, rounding, lo = pair[:3]
    if len(pair) > 3:
        rounding = f"{rounding}{pair[3][0]}r{pair[3][1]}"
    return f"{hi} {rounding} hi + {lo}"


def histograms(with_fallbacks: bool, formats=FLUSH_FORMATS
               ) -> list[tuple[tuple[str, str, str], collections.Counter, int, int]]:
    """Per flush format pair (hi, rounding, lo, and optionally (sr_bits, philox_rounds)):
    (formats, SASS opcode counts, registers per thread, elements per thread); without
    fallbacks the rare general paths' bodies are compiled out (what a thread runs)."""
    rows = []
    with compiled_fallbacks(with_fallbacks):
        for pair in formats:
            cfg = flush_config(*pair)
            ops, registers = sass_histogram(rf.compile_flush(cfg, keep_ptx=True).__ptx__)
            rows.append((pair, ops, registers, cfg.elements_per_thread))
    return rows


@contextlib.contextmanager
def compiled_fallbacks(with_fallbacks: bool):
    """Within: flush kernels compile with the rare general paths of SR and the E2M1 encode
    (`with_fallbacks`), or with their bodies replaced by constants (what a thread runs)."""
    general = (nm.sr_fp16_bits, nm.rn_e2m1_nibble)
    _compile._CACHE.clear()
    if not with_fallbacks:
        nm.sr_fp16_bits = lambda x, r, sr_bits: cutlass.Uint32(0)
        nm.rn_e2m1_nibble = lambda x: cutlass.Uint32(0)
    try:
        yield
    finally:
        nm.sr_fp16_bits, nm.rn_e2m1_nibble = general
        _compile._CACHE.clear()


def count(with_fallbacks: bool, formats=FLUSH_FORMATS
          ) -> list[tuple[tuple[str, str, str], float, int, list]]:
    """Per flush format pair: (formats, SASS instructions per state element, registers per
    thread, the 8 commonest opcodes per element)."""
    return [(pair, sum(ops.values()) / per, registers,
             [(op, n / per) for op, n in ops.most_common(8)])
            for pair, ops, registers, per in histograms(with_fallbacks, formats)]


# The non-flush kernel is unrolled over the heads a warp owns, so its SASS count divided by
# the elements one lane handles (heads per warp x headdim x dstate / 32) is what a lane issues
# per read-copy element, prologue and epilogue included.


def nonflush_config(lo_format: str, batch: int = HEADLINE_BATCH) -> ro.ReplayOutputConfig:
    """The configuration `mamba2_replay_output` runs at the Nemotron-3-Super layer on an H200
    for ``batch`` slots (bf16 activations, fp32 dt, D and dt_bias, no z): `ro.default_config`,
    the rule `ro.output_config` applies."""
    problem = dict(lo_format=lo_format, act="bf16", dt_dtype="fp32", **NEMOTRON,
                   ring_capacity=NEMOTRON["window"], has_D=True, has_z=False, has_dt_bias=True,
                   dt_softplus=True)
    return ro.default_config(problem, batch, _compile.H200_SM_COUNT)


def count_nonflush(formats=NONFLUSH_FORMATS, batch: int = HEADLINE_BATCH
                   ) -> list[tuple[str, float, int]]:
    """Per read-copy format: (format, SASS instructions per element and lane, registers per
    thread) of the non-flush kernel's default configuration at the Nemotron-3-Super layer and
    ``batch`` slots."""
    rows = []
    for lo_format in formats:
        cfg = nonflush_config(lo_format, batch)
        ops, registers = sass_histogram(ro.compile_replay_output(cfg, keep_ptx=True).__ptx__)
        per_lane = cfg.heads_per_group // (cfg.warps * cfg.head_splits) * cfg.headdim \
            * cfg.dstate // 32
        rows.append((lo_format, sum(ops.values()) / per_lane, registers))
    return rows


QWEN3_NEXT = dict(nheads=32, dv=128, dk=128, window=16)  # the Gated DeltaNet layer


def gdn_nonflush_config(lo_format: str):
    """The GDN non-flush kernel's configuration at the Qwen3-Next layer (bf16 activations; the
    read path compiles with RN and no debug output whatever the store's rounding, as
    `gdn_replay_output.launch_gdn_output` does)."""
    from cute_kernels.gdn_replay_flush import GDNConfig

    return GDNConfig(**QWEN3_NEXT, hi_format="fp16" if lo_format == "nvfp4" else "fp32",
                     hi_rounding="rn", lo_format=lo_format, act="bf16")


def _per_thread_element(kernel, cfg, threads: int | None = None
                        ) -> tuple[float, int, collections.Counter]:
    """(SASS instructions per state element a thread, registers per thread, the opcodes per
    element) of a compiled GDN kernel whose `threads` (None: the flush's cfg.threads) hold
    dv dk / threads elements each."""
    ops, registers = sass_histogram(kernel.__ptx__)
    per = cfg.dv * cfg.dk // (threads or cfg.threads)
    return sum(ops.values()) / per, registers, collections.Counter(
        {op: n / per for op, n in ops.items()})


def count_gdn_nonflush(forms=(("nvfp4", "ffma"), ("nvfp4", "mma"), ("none", "ffma"))
                       ) -> list[tuple[str, str, float, int]]:
    """Per read copy (nvfp4, or 'none': the fp32 single copy) and form of the dot products
    (`gdn_replay_output.DOTS`): (format, form, SASS instructions per state element a thread,
    registers per thread) of the GDN non-flush kernel at its default heads a CTA. The kernel
    is unrolled over a thread's elements (dv dk / threads), prologue and epilogue included."""
    from cute_kernels import gdn_replay_output as go

    rows = []
    for lo_format, dots in forms:
        cfg = gdn_nonflush_config(lo_format)
        per_element, registers, _ = _per_thread_element(
            go.compile_gdn_output(cfg, keep_ptx=True, dots=dots), cfg, go.cta_threads(cfg, dots))
        rows.append((lo_format, dots, per_element, registers))
    return rows


def gdn_flush_config(lo_format: str = "nvfp4"):
    """The GDN flush kernel's configuration at the Qwen3-Next layer, bf16 activations, no debug
    output: fp16 SR (the default bits and rounds) + nvfp4, or ('none') the fp32 single copy."""
    from cute_kernels.gdn_replay_flush import GDNConfig

    two_copy = lo_format == "nvfp4"
    return GDNConfig(**QWEN3_NEXT, hi_format="fp16" if two_copy else "fp32",
                     hi_rounding="sr" if two_copy else "rn", lo_format=lo_format, act="bf16")


def count_gdn_flush(formats=("nvfp4", "none"), with_fallbacks: bool = False,
                    staged_window: bool = True
                    ) -> list[tuple[str, float, int, collections.Counter]]:
    """Per read copy format: (format, SASS instructions per state element a thread, registers
    per thread, the opcodes per element) of the GDN flush kernel, its stores
    included, its window staged in shared memory or not; without fallbacks, what a thread
    runs (as `count`)."""
    from cute_kernels import gdn_replay_flush as gf

    rows = []
    with compiled_fallbacks(with_fallbacks):
        for lo_format in formats:
            cfg = gdn_flush_config(lo_format)
            per_element, registers, ops = _per_thread_element(
                gf.compile_gdn_flush(cfg, keep_ptx=True, staged_window=staged_window), cfg)
            rows.append((lo_format, per_element, registers, ops))
    return rows


# --------------------------------------------------------------------------------------------
# Issue floors: which pipe bounds an instruction mix on the H200 (--pipes)
#
# Per SM sub-partition (4 a SM) on Hopper, from NVIDIA's descriptions of the GH100 pipes: one
# warp instruction issues a cycle; the ALU pipe (logic, shifts, integer add/compare/min/max,
# fp32 compare/min/max/select, fast fp32 -> fp16 packing) and each of the two FMA halves
# (`heavy`: IMAD and fp32; `lite`: fp32 only) take 16 lanes a cycle, so a warp instruction
# holds the pipe 2 cycles; fp32 arithmetic goes to whichever half is free, so heavy-only work
# plus fp32 work share one warp instruction a cycle; MUFU (XU) takes 4. The half-rate ALU is
# measured: ncu counts 1.50 ALU instructions an element executed by the non-flush step
# (`--ncu` on `scripts/gpu.sh profile`'s report of cute:nonflush:nvfp4), its SASS 1.51.
# VIADD, new in sm_90, is placed on the heavy half; ncu does not settle it. Static counts leave
# out the ring staging loop's repeats and count each rare path once.
PIPES = {
    "alu": (
        "LOP3",
        "LOP",
        "IADD3",
        "IADD",
        "ISETP",
        "FSETP",
        "FMNMX",
        "IMNMX",
        "VIMNMX",
        "VIADDMNMX",
        "SEL",
        "FSEL",
        "SHF",
        "SHL",
        "SHR",
        "PRMT",
        "LEA",
        "PLOP3",
        "MOV",
        "F2FP",
        "I2FP",
        "P2R",
        "R2P",
        "BMSK",
        "SGXT",
        "ISCADD",
        "IABS",
        "FLO",
        "POPC",
        "BREV",
        "VOTE",
    ),
    "heavy": ("IMAD", "IMUL", "IDP", "VIADD"),
    "fp32": ("FFMA", "FMUL", "FADD", "HADD2", "HMUL2", "HFMA2", "FMNMX2"),
    "xu": ("MUFU", "F2F", "F2I", "I2F", "FRND"),
}
_PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops}
H200_SMS, H200_CLOCK_GHZ = _compile.H200_SM_COUNT, 1.98  # the boost clock they ran at (nvidia-smi)


def pipe_counts(ops: collections.Counter, per: float) -> dict:
    """Instructions per element (`per` elements a thread) by pipe (PIPES), with 'total' and
    'other' (loads, stores, shuffles, tensor cores, uniform and control instructions)."""
    out = {pipe: 0.0 for pipe in PIPES}
    for op, n in ops.items():
        pipe = _PIPE_OF.get(op, "other")
        out[pipe] = out.get(pipe, 0.0) + n / per
    out["total"] = sum(ops.values()) / per
    return out


def issue_floor_cycles(pipes: dict) -> tuple[float, str]:
    """(cycles a sub-partition spends per warp instruction's worth of elements, the binding
    limit) if every pipe ran flat out: the largest of total issue, 2 x ALU, 2 x heavy-only,
    heavy-only + fp32 (the two FMA halves) and 4 x XU."""
    limits = {
        "issue": pipes["total"],
        "ALU pipe": 2 * pipes["alu"],
        "FMA heavy": 2 * pipes["heavy"],
        "FMA halves": pipes["heavy"] + pipes["fp32"],
        "XU": 4 * pipes["xu"],
    }
    name = max(limits, key=limits.get)
    return limits[name], name


def floor_us(
    cycles_per_element: float, elements: int, sms: int = H200_SMS, clock_ghz: float = H200_CLOCK_GHZ
) -> float:
    """Microseconds for `elements` state elements at `cycles_per_element` a sub-partition per
    32 elements (one a lane), every sub-partition busy."""
    return elements / (sms * 4 * 32) * cycles_per_element / (clock_ghz * 1e3)


# the kernel_bench CSV columns flush_budgets reads
BUDGET_COLUMNS = ("run", "kernel", "step", "scheme", "shape", "batch", "window", "status",
                  "time_us", "bytes", "copy_gbps")
# the per-token goals of each layer: (name, the token schemes whose fastest is the reference,
# the factor); the Gated DeltaNet goals name the fastest peer's conventional decode
GOALS = {
    "nemotron3-super": (("4x FP32 ReplaySSM", ("fp32-replay",), 4.0),
                        ("7.5x conventional FP32", ("conventional-fp32",), 7.5)),
    "qwen3-next-80b": (
        ("5x the fastest peer's FP32-state decode",
         ("vllm-conventional-fp32", "fla-conventional-fp32"), 5.0),
        ("2.5x the fastest peer's bf16-state decode",
         ("vllm-conventional-bf16", "fla-conventional-bf16"), 2.5)),
}


def flush_budgets(
    csv_path: str, shape: str = "nemotron3-super", batch: int = 256, window: int = 16
) -> list[dict]:
    """From a kernel_bench CSV, per run and per-token goal of the shape (`GOALS`: at the
    Nemotron-3-Super layer 4x FP32 ReplaySSM and 7.5x the conventional FP32 update; at the
    Qwen3-Next layer 5x and 2.5x the fastest peer's FP32- and bf16-state decode), what the goal
    asks of the two kernels.

    A window is L - 1 non-flush steps and one flush, so with a token time T and a flush time F
    the non-flush part takes L T - F, and a goal g against a reference token time R leaves
    L R / g for the whole window. Returned per (run, target): the flush's measured time
    (`flush_us`), the flush time that meets the goal with the run's own non-flush steps
    (`budget_us`), the flush's bytes at the run's copy bandwidth (`flush_at_copy_us`), the
    non-flush steps' fraction of copy now (`nonflush_frac`), and the fraction they would need
    with the flush at its bytes' copy time (`nonflush_frac_needed_at_copy`)."""
    import csv

    with open(csv_path, newline="") as f:
        rows = [r for r in csv.DictReader(f)
                if r["shape"] == shape and r["batch"] == str(batch)
                and r["window"] == str(window) and r["status"] == "ok"]  # fmt: skip
    out = []
    for run in sorted({r["run"] for r in rows}):
        mine = {(r["step"], r["scheme"] or r["kernel"]): r for r in rows if r["run"] == run}
        token = mine.get(("token", "two-precision"))
        flush = mine.get(("flush", "cute:flush:fp16sr+nvfp4"))
        if token is None or flush is None:
            continue
        copy_bytes_per_us = float(flush["copy_gbps"]) * 1e3
        flush_us = float(flush["time_us"])
        nonflush_us = window * float(token["time_us"]) - flush_us
        nonflush_bytes = window * float(token["bytes"]) - float(flush["bytes"])
        at_copy = float(flush["bytes"]) / copy_bytes_per_us
        for target, references, goal in GOALS[shape]:
            times = [float(mine[("token", r)]["time_us"]) for r in references
                     if ("token", r) in mine]
            if not times:
                continue
            window_us = window * min(times) / goal
            budget = dict(
                run=run, target=target, goal=goal, window_budget_us=window_us,
                flush_us=flush_us, budget_us=window_us - nonflush_us,
                flush_at_copy_us=at_copy,
                nonflush_bytes=nonflush_bytes, copy_bytes_per_us=copy_bytes_per_us,
                nonflush_frac=nonflush_bytes / nonflush_us / copy_bytes_per_us,
            )  # fmt: skip
            budget["nonflush_frac_needed_at_copy"] = nonflush_frac_needed(budget, at_copy)
            out.append(budget)
    return out


def _pipe_row(name: str, ops: collections.Counter, per: float, elements: int) -> float:
    """Print one flush variant's instructions per element by pipe and its floor; returns the
    floor (microseconds for `elements` at the binding pipe's rate)."""
    p = pipe_counts(ops, per)
    cycles, limit = issue_floor_cycles(p)
    floor = floor_us(cycles, elements)
    print(
        f"  {name:24s} {p['total']:6.1f} {p['alu']:6.1f} {p['heavy']:6.1f} "
        f"{p['fp32']:6.1f} {p['xu']:5.2f} {p['other']:6.1f}  {floor:6.1f} us ({limit})"
    )
    return floor


def gdn_flush_pipes(elements: int) -> dict:
    """The GDN flush's rows (fp16 SR + nvfp4, the fp32 single copy; window staged) and two
    floors below them: the fold's arithmetic alone (per record and element one FMUL, the
    decay, one FFMA, the row's dot, and one FFMA, the update, in the order the contract fixes:
    3 L fp32 instructions an element), a floor of any flush that keeps the contract's fold; and
    the fold with the roundings (plus the instructions by which the two-copy flush exceeds the
    fp32 single copy: SR, the NVFP4 encode and their stores in software). Returns {name:
    microseconds} of the two-copy flush's issue floor and these two."""
    floors, totals = {}, {}
    for lo_format, per_element, _, ops in count_gdn_flush():  # fast paths, window staged
        name = "fp16 sr hi + nvfp4" if lo_format == "nvfp4" else "fp32 rn hi + none"
        floors[lo_format] = _pipe_row(name, ops, 1, elements)  # ops are already per element
        totals[lo_format] = per_element
    fold = 3 * QWEN3_NEXT["window"]
    rounding = totals["nvfp4"] - totals["none"]
    below = {"the fold's arithmetic alone": fold,
             "the fold and the roundings": fold + rounding}
    out = {"its issue floor": floors["nvfp4"]}
    for name, per in below.items():
        out[name] = floor_us(per, elements)
        print(f"  {name} ({per:.1f} instructions an element): {out[name]:.1f} us")
    return out


def print_pipes(csv_path: str | None, batch: int = 256, ncu_floor_us: float | None = None,
                formats=FLUSH_FORMATS, layer: str = "nemotron3-super") -> None:
    """The flush format pairs' instructions per element by pipe (default configuration, fast
    paths), the time each would take at `batch` if its binding pipe never idled, and, with a
    kernel_bench CSV, what the per-token goals ask of the flush and the non-flush steps (with
    `ncu_floor_us`, also at the floor of the executed count). `layer` qwen3-next-80b: the
    Gated DeltaNet flush (`formats` unused) and its goals."""
    elements = batch * LAYER_ELEMENTS[layer]
    print(
        f"flush by pipe, per element (floor: {layer} layer, batch {batch}, {H200_SMS} SMs at "
        f"{H200_CLOCK_GHZ} GHz, every pipe flat out):"
    )
    print(
        f"  {'variant':24s} {'total':>6s} {'ALU':>6s} {'heavy':>6s} {'fp32':>6s} {'XU':>5s} "
        f"{'other':>6s}  floor"
    )
    lower = {}
    if layer == "qwen3-next-80b":
        lower = gdn_flush_pipes(elements)
        floor = lower.pop("its issue floor")
    else:
        floors = {variant: _pipe_row(variant_name(variant), ops, per, elements)
                  for variant, ops, _, per in histograms(False, formats)}
        floor = floors[("fp16", "sr", "nvfp4")]
    if not csv_path:
        return
    print(
        f"what the per-token goals ask ({csv_path}, batch {batch}, L = 16, each run's own "
        "kernels):"
    )
    for b in flush_budgets(csv_path, shape=layer, batch=batch):
        at_floor = f"at {nonflush_frac_needed(b, floor):.3f} with the flush at its issue floor "
        at_floor += f"({floor:.1f} us)"
        for name, us in lower.items():
            at_floor += f", at {nonflush_frac_needed(b, us):.3f} with it at {name} ({us:.1f} us)"
        if ncu_floor_us is not None:
            at_floor += (
                f", at {nonflush_frac_needed(b, ncu_floor_us):.3f} with it at the executed "
                f"count's ({ncu_floor_us:.1f} us)"
            )
        print(
            f"  run {b['run']}, {b['target']}:\n"
            f"    with the run's non-flush steps the flush at <= {b['budget_us']:.1f} us "
            f"(measured {b['flush_us']:.1f}; its bytes take {b['flush_at_copy_us']:.1f} at "
            f"the run's copy bandwidth)\n"
            f"    the non-flush steps (now {b['nonflush_frac']:.3f} of copy) at "
            f"{b['nonflush_frac_needed_at_copy']:.3f} with the flush at copy speed, {at_floor}"
        )


def nonflush_frac_needed(budget: dict, flush_us: float) -> float:
    """The non-flush steps' fraction of copy that meets a flush_budgets() target when the
    flush takes `flush_us` (inf when the flush alone spends the window's budget)."""
    left = budget["window_budget_us"] - flush_us
    if left <= 0:
        return float("inf")
    return budget["nonflush_bytes"] / left / budget["copy_bytes_per_us"]


# Metrics that `--ncu` reads from ncu's raw page; `scripts/gpu.sh profile` keeps their lines
# (and the kernel headers) in its .trim.txt files, which a test checks. A report may give the
# issue rate as `smsp__issue_active.avg.per_cycle_active` instead (ISSUE_METRICS): the reader
# takes either, and prints "-" for a pipe a report lacks.
NCU_METRICS = (
    "gpu__time_duration.sum",
    "smsp__inst_executed.sum",
    "sm__inst_executed.avg.per_cycle_active",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
)
# Occupancy, printed where a report has it (`scripts/gpu.sh profile` collects the Occupancy,
# Scheduler Statistics and Launch Statistics sections): warps an SM active, the CTAs an SM
# each resource allows, and warps a scheduler active and eligible to issue
OCCUPANCY_METRICS = (
    "sm__warps_active.avg.per_cycle_active",
    "sm__maximum_warps_avg_per_active_cycle",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "smsp__warps_active.avg.per_cycle_active",
    "smsp__warps_eligible.avg.per_cycle_active",
)
# Warp instructions issued a cycle, and the factor that makes each a sub-partition's rate: an
# SM's executed rate over its 4 sub-partitions, or the fraction of a sub-partition's cycles
# that issue (one instruction an issue on Hopper: the same flush read 2.60 an SM and 0.65 a
# sub-partition).
ISSUE_METRICS = (
    ("sm__inst_executed.avg.per_cycle_active", 0.25),
    ("smsp__issue_active.avg.per_cycle_active", 1.0),
)
# ncu prints a duration in the unit that suits its size; the reader keeps microseconds
_TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
               "msecond": 1e3, "s": 1e6, "second": 1e6}  # fmt: skip


def _open_text(path: str):
    """A report as text, gzip'd (.gz) or not."""
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", errors="replace")
    return open(path, errors="replace")


def read_ncu_raw(path: str) -> list[dict]:
    """Kernels of an `ncu --page raw` report (plain or .gz): [{'kernel', 'grid', metric:
    value, ...}] in launch order, single-valued metrics only (instanced values dropped),
    durations in microseconds whatever unit ncu printed them in."""
    kernels: list[dict] = []
    # names may hold spaces and template arguments (torch's "void at::...<4, ...>(...)")
    header = re.compile(r"^  (.+?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
    # a launch-wide metric may repeat its one instance in parentheses: "block  4 (4)"
    metric = re.compile(r"^  ([a-z][\w.]+)\s+(?:(\S+)\s+)?([-\d,.]+)(?:\s+\([-\d,.]+\))?\s*$")
    with _open_text(path) as f:
        for line in f:
            m = header.match(line)
            if m:
                kernels.append({"kernel": m[1], "grid": tuple(int(g) for g in m.groups()[1:4])})
                continue
            m = metric.match(line)
            if m and kernels:
                try:
                    value = float(m[3].replace(",", ""))
                except ValueError:
                    continue
                if m[1] == "gpu__time_duration.sum":
                    if m[2] not in _TIME_UNITS:
                        raise ValueError(f"{path}: gpu__time_duration.sum in {m[2]!r}, not a time "
                                         f"unit ({', '.join(_TIME_UNITS)})")
                    value *= _TIME_UNITS[m[2]]
                kernels[-1][m[1]] = value
    return kernels


def ncu_per_element(k: dict, elements: int) -> dict:
    """One profiled launch's executed instructions per element and lane (`elements` state
    elements, 32 a warp instruction), by pipe: ALU (a half-rate pipe, so its share of the
    instructions is 0.5 x its % of peak over the warp instructions issued a cycle and
    sub-partition), FMA (both halves: 1 a cycle), LSU and XU (the share at their % of peak
    over the issue rate: 0.5 and 0.25 a cycle), and the issue rate itself. A pipe the report
    lacks is None; a launch without the executed count or an issue rate is a ValueError."""
    missing = [name for name in ("gpu__time_duration.sum", "smsp__inst_executed.sum")
               if name not in k]  # fmt: skip
    rates = [(k[name], scale) for name, scale in ISSUE_METRICS if name in k]
    if missing or not rates:
        missing += [] if rates else [" or ".join(name for name, _ in ISSUE_METRICS)]
        raise ValueError(f"launch {k['kernel'][:48]}: no {'; no '.join(missing)}")
    per = k["smsp__inst_executed.sum"] * 32 / elements
    issue = rates[0][0] * rates[0][1]  # a sub-partition
    share = {"alu": 0.5, "fma": 1.0, "lsu": 0.5, "xu": 0.25}
    out = {"total": per, "issue_per_cycle": issue, "time_us": k["gpu__time_duration.sum"]}
    for pipe, rate in share.items():
        pct = k.get(f"sm__inst_executed_pipe_{pipe}.avg.pct_of_peak_sustained_active")
        out[pipe] = None if pct is None or issue <= 0 else per * pct / 100 * rate / issue
    return out


def ncu_launches(path: str) -> list[dict]:
    """The profiled launches over 10 us of an ncu raw-page report (`scripts/gpu.sh profile`'s
    .trim.txt; the helpers between them, such as the cursors' advance, are shorter); a
    ValueError says why a file is not such a report."""
    try:
        kernels = read_ncu_raw(path)
    except (OSError, EOFError, UnicodeDecodeError) as error:  # gzip's errors included
        reason = getattr(error, "strerror", None) or error
        raise ValueError(f"{path}: cannot be read ({reason})") from None
    if not kernels:
        raise ValueError(f"{path}: no kernel header (\"name (grid)x(block), Context ...\"): "
                         "not an ncu raw-page report")
    launches = [k for k in kernels if k.get("gpu__time_duration.sum", 0) > 10]
    if not launches:
        raise ValueError(f"{path}: no profiled launch over 10 us")
    return launches


# state elements a slot of each layer kernel_bench profiles (heads x head size)
LAYER_ELEMENTS = {"nemotron3-super": 128 * 64 * 128, "qwen3-next-80b": 32 * 128 * 128}


def print_ncu(path: str, batch: int = 256, layer: str = "nemotron3-super") -> float:
    """Per profiled launch of an ncu raw-page report (`layer` at `batch`): the executed
    instructions per element by pipe and the floor they set on the issue rate. Returns the
    first launch's floor."""
    elements = batch * LAYER_ELEMENTS[layer]
    launches = ncu_launches(path)
    rows = [(k, ncu_per_element(k, elements)) for k in launches]  # all checked before printing
    print(
        f"{path}: per element, executed ({layer} layer, batch {batch}; floor at "
        f"{H200_SMS} SMs, {H200_CLOCK_GHZ} GHz)"
    )
    floors = []
    for k, d in rows:
        floors.append(floor_us(max(d["total"], 2 * (d["alu"] or 0.0)), elements))
        pipes = "  ".join(f"{name} " + ("    -" if d[key] is None else f"{d[key]:5.2f}")
                          for name, key in (("ALU", "alu"), ("FMA", "fma"), ("LSU", "lsu")))
        print(
            f"  {k['kernel'][:48]:48s} {d['time_us']:7.1f} us  total {d['total']:5.2f}  "
            f"{pipes}  issued {d['issue_per_cycle']:.3f} a cycle  floor {floors[-1]:6.1f} us"
        )
        occupancy = occupancy_line(k)
        if occupancy:
            print(f"    {occupancy}")
    return floors[0]


def occupancy_line(k: dict) -> str | None:
    """One launch's occupancy in words, from OCCUPANCY_METRICS (None where the report has
    none of them): e.g. "30.5 of 32 warps an SM active (CTAs an SM: registers 4, shared
    memory 4); a scheduler 7.57 active, 1.74 eligible"."""
    get = k.get
    if not any(name in k for name in OCCUPANCY_METRICS):
        return None
    parts = []
    active, most = get("sm__warps_active.avg.per_cycle_active"), get(
        "sm__maximum_warps_avg_per_active_cycle")
    if active is not None:
        parts.append(f"{active:.1f}" + ("" if most is None else f" of {most:g}")
                     + " warps an SM active")
    elif most is not None:
        parts.append(f"at most {most:g} warps an SM")
    limits = [f"{what} {get(name):g}" for what, name in (
        ("registers", "launch__occupancy_limit_registers"),
        ("shared memory", "launch__occupancy_limit_shared_mem")) if name in k]
    if limits:
        parts.append(f"(CTAs an SM: {', '.join(limits)})" if parts
                     else f"CTAs an SM: {', '.join(limits)}")
    text = " ".join(parts)
    sched = [f"{get(name):.2f} {what}" for what, name in (
        ("active", "smsp__warps_active.avg.per_cycle_active"),
        ("eligible", "smsp__warps_eligible.avg.per_cycle_active")) if name in k]
    if sched:
        text += ("; " if text else "") + "a scheduler " + ", ".join(sched)
    return text


def _sr_settings(text: str) -> tuple[tuple[int, int], ...]:
    """'16:7,8:4' as ((16, 7), (8, 4)): settings the flush's fp16 SR takes."""
    settings = []
    for item in text.split(","):
        bits, _, rounds = item.strip().partition(":")
        try:
            setting = (int(bits), int(rounds))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected BITS:ROUNDS items such as 16:7, got {item!r}") from None
        if setting[0] not in nm.SR_BITS or not 1 <= setting[1] <= 10:
            raise argparse.ArgumentTypeError(
                f"expected bits in {list(nm.SR_BITS)} and rounds in 1..10, got {item!r}")
        settings.append(setting)
    return tuple(settings)


# the committed benchmark CSVs of each layer, found from any working folder
_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
DEFAULT_CSVS = {"nemotron3-super": os.path.join(_RESULTS, "kernel_bench.csv"),
                "qwen3-next-80b": os.path.join(_RESULTS, "kernel_bench_gdn",
                                               "kernel_bench_gdn.csv")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.instruction_count",
        allow_abbrev=False,  # a flag reads the same in a results file as in --help
        description="SASS instructions per state element and registers per thread of the "
        "flush and non-flush kernels in their default configurations (sm_90a, compiled on the "
        "CPU). Without --with-fallbacks the flush's rare general-path bodies "
        "are compiled out, so the count is what a thread issues.",
    )
    parser.add_argument("--with-fallbacks", action="store_true", help="count the kernel as shipped")
    parser.add_argument(
        "--sr",
        type=_sr_settings,
        default=(),
        metavar="BITS:ROUNDS,...",
        help="also count the fp16 SR + nvfp4 flush with these SR settings (random bits an "
        "element in 8, 13, 16, 32; Philox rounds 1..10; the default is 16:7), e.g. 32:10,8:4",
    )
    parser.add_argument(
        "--pipes",
        action="store_true",
        help="instead: the flush's instructions by Hopper pipe (ALU, FMA halves, XU) "
        "and the time each takes at batch 256 if its busiest pipe never idled",
    )
    parser.add_argument(
        "--csv",
        default=None,
        help="with --pipes: a kernel_bench CSV from which to derive the flush time that each "
        "per-token goal allows (default: the repository's results/kernel_bench.csv; "
        "skipped if absent)",
    )
    parser.add_argument(
        "--ncu",
        metavar="REPORT",
        help="instead: executed instructions per element by pipe, from a report of "
        "`scripts/gpu.sh profile` (ncu's raw page at batch 256, trimmed; "
        "plain or .gz), and the floor they set on the issue rate; with --pipes and a report "
        "whose first launch is the flush, the goals at that floor too",
    )
    parser.add_argument(
        "--layer",
        choices=sorted(LAYER_ELEMENTS),
        default="nemotron3-super",
        help="with --ncu: the layer the report profiled (default nemotron3-super; "
        "`scripts/gpu.sh profile --shape`); with --pipes: the layer whose flush and goals "
        "are priced (qwen3-next-80b: the Gated DeltaNet flush, its goals read from "
        "results/kernel_bench_gdn/kernel_bench_gdn.csv unless --csv names another)",
    )
    args = parser.parse_args(argv)
    if args.layer != "nemotron3-super" and not (args.ncu or args.pipes):
        parser.error("--layer: only with --ncu or --pipes")
    if args.layer != "nemotron3-super" and args.sr:
        parser.error("--sr: only for the Mamba-2 flush (--layer nemotron3-super)")
    if args.csv is not None and not args.pipes:
        parser.error("--csv: only with --pipes")
    if args.csv is not None and not os.path.isfile(args.csv):
        parser.error(f"--csv: no such file: {args.csv}")
    if args.csv is not None:
        with open(args.csv, newline="", errors="replace") as f:
            header = f.readline().strip().split(",")
        missing = [c for c in BUDGET_COLUMNS if c not in header]
        if missing:
            parser.error(f"--csv: {args.csv} is not a kernel_bench CSV (no column "
                         f"{', '.join(missing)})")
    if args.with_fallbacks and (args.pipes or args.ncu):
        parser.error("--with-fallbacks: only for the default count (--pipes and --ncu price "
                     "the fast paths)")
    if args.ncu and os.path.isdir(args.ncu):
        parser.error(f"--ncu: {args.ncu} is a folder; give one report file")
    if args.ncu and not os.path.isfile(args.ncu):
        parser.error(f"--ncu: no such file: {args.ncu}")
    if args.ncu:
        try:  # every launch checked before anything is printed or compiled
            launches = ncu_launches(args.ncu)
            for k in launches:
                ncu_per_element(k, 1)
        except ValueError as error:
            parser.error(f"--ncu: {error} (see scripts/gpu.sh profile)")
        first = launches[0]
        flush_class = "GDNFlush" if args.layer == "qwen3-next-80b" else "ReplayFlush"
        if args.pipes and flush_class not in first["kernel"]:  # its floor prices the flush
            parser.error(f"--ncu with --pipes: the report's first launch is not the flush "
                         f"({first['kernel'][:60]}); give the two-precision flush's report "
                         "or leave out --pipes")
    if not args.ncu or args.pipes:  # what compiles needs ptxas 12.9+ and cuobjdump
        if problem := tools_problem():
            parser.exit(2, f"instruction_count: {problem}\n")
    csv_path = args.csv or DEFAULT_CSVS[args.layer]
    ncu_floor = None
    if args.ncu:
        ncu_floor = print_ncu(args.ncu, layer=args.layer)
        if not args.pipes:
            return 0
    formats = FLUSH_FORMATS + tuple(("fp16", "sr", "nvfp4", sr) for sr in args.sr)
    if args.pipes:
        print_pipes(csv_path if os.path.isfile(csv_path) else None, ncu_floor_us=ncu_floor,
                    formats=formats, layer=args.layer)
        return 0
    print("flush, per element (elements per thread: the default):")
    for pair, per_element, registers, top in count(args.with_fallbacks, formats):
        ops = ", ".join(f"{op} {n:.1f}" for op, n in top)
        print(f"  {variant_name(pair):26s} {per_element:6.1f} per element, {registers:3d} "
              f"registers ({ops})")
    print("non-flush (replay_output), per element and lane:")
    for lo, per_element, registers in count_nonflush():
        print(f"  {lo:9s} {per_element:5.2f} per element, {registers} registers")
    print("Gated DeltaNet non-flush (gdn_replay_output, Qwen3-Next), per element and thread, by "
          "form of the dot products:")
    for lo, dots, per_element, registers in count_gdn_nonflush():
        print(f"  {lo:5s} {dots:4s} {per_element:5.2f} per element, {registers} registers")
    print("Gated DeltaNet flush (gdn_replay_flush, Qwen3-Next; nvfp4: fp16 SR + nvfp4, none: "
          "the fp32 single copy), per element and thread:")
    from cute_kernels import gdn_replay_flush as gf

    for staged in (True, False):
        for lo, per_element, registers, per_op in count_gdn_flush(
                with_fallbacks=args.with_fallbacks, staged_window=staged):
            ops = ", ".join(f"{op} {n:.1f}" for op, n in per_op.most_common(4))
            form = ("window staged in shared memory" if staged else
                    "records loaded in the fold, the form of windows over "
                    f"{gf.STAGED_WINDOW_BYTES // 1024} KiB")
            print(f"  {lo:5s} {per_element:6.2f} per element, {registers} registers ({ops}); "
                  f"{form}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
