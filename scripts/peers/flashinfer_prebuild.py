"""Build FlashInfer's Mamba JIT modules for sm_90a on this (CPU) machine, for the peer pack.

Run by `scripts/peers/prepare.sh flashinfer` with the staged (trimmed) flashinfer package and a
local apache-tvm-ffi on PYTHONPATH. For every FlashInfer kernel that `experiments.kernel_bench`
times by default, at every benchmark shape and window it supports, it builds the module the
kernel will ask for (the same JIT keys FlashInfer derives from the call's dtypes and shapes),
copies the library to `<aot>/<uri>/<uri>.so` (FlashInfer's AOT location, loaded without
compiling), and writes the union of the headers the builds read (from ninja's dependency log)
to `--deps`, so the pack carries exactly those for a JIT fallback on the GPU machine.
`--report` lists each module with `ok` or `failed: <reason>`; the benchmark records a failed
one as unavailable instead of spending GPU time on a build that cannot succeed.

    python scripts/peers/flashinfer_prebuild.py --aot DIR --deps FILE --report FILE
                                                 [--windows 8,16]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from experiments._common import OneLineParser  # noqa: E402
from experiments.kernel_bench import KERNELS, SHAPES  # noqa: E402

MAX_WINDOW = min(spec.max_window for spec in KERNELS.values()  # the checkpointing kernels
                 if spec.impl == "flashinfer" and spec.step != "update")


def module_specs(windows: tuple[int, ...]) -> list:
    """FlashInfer JitSpecs of the benchmark's default FlashInfer kernels."""
    from flashinfer.jit.mamba.checkpointing_ssu import gen_checkpointing_ssu_module
    from flashinfer.jit.mamba.selective_state_update import gen_selective_state_update_sm90_module

    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    bf16, f32, i32, i64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
    specs = {}
    for spec in KERNELS.values():
        if spec.impl != "flashinfer" or not spec.default:
            continue
        state = dtypes[spec.variant]
        for shape in SHAPES.values():
            if spec.step == "update":
                # dt is fp32 for this kernel (its D/dt_bias dtype must equal dt's)
                jit = gen_selective_state_update_sm90_module(
                    state, bf16, f32, f32, i32, None, shape.headdim, shape.dstate, 1, i32, i64, 0)
                specs[jit.name] = jit
                continue
            for window in windows:
                if window > spec.max_window:
                    continue
                jit = gen_checkpointing_ssu_module(
                    state, bf16, bf16, f32, f32, i32, None, shape.headdim, shape.dstate, 1,
                    window, shape.nheads // shape.ngroups, shape.ngroups, 0, False)
                specs[jit.name] = jit
    return list(specs.values())


def header_deps(build_dir: Path) -> set[str]:
    """Headers under the package's data/ that ninja recorded for the objects in `build_dir`,
    as paths relative to data/."""
    text = subprocess.run(["ninja", "-t", "deps"], cwd=build_dir, capture_output=True,
                          text=True, check=True).stdout
    deps = set()
    for line in text.splitlines():
        path = line.strip()
        if line.startswith("    ") and "/flashinfer/data/" in path:
            deps.add(path.split("/flashinfer/data/", 1)[1])
    return deps


def _windows(text: str) -> tuple[int, ...]:
    """Comma-separated windows 1 .. MAX_WINDOW: 'x' was a traceback, and a window past the
    kernels' limit was left out without a word."""
    try:
        windows = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not all(1 <= w <= MAX_WINDOW for w in windows):
        raise argparse.ArgumentTypeError(f"expected windows 1..{MAX_WINDOW} (checkpointing_ssu's "
                                         f"limit), got {text!r}")
    return windows


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aot", required=True, type=Path, help="the staged data/aot folder")
    parser.add_argument("--deps", required=True, type=Path, help="file for the header list")
    parser.add_argument("--report", required=True, type=Path, help="file for the build report")
    parser.add_argument("--windows", type=_windows, default="8,16",
                        help=f"windows to build for (<= {MAX_WINDOW})")
    args = parser.parse_args()
    windows = args.windows
    try:  # run on its own, without prepare.sh's staged package, it was a traceback
        import flashinfer.jit.mamba  # noqa: F401
    except ImportError as error:
        parser.error(f"flashinfer is not importable ({error}): run this through "
                     "scripts/peers/prepare.sh flashinfer, which stages it on PYTHONPATH")
    deps: set[str] = set()
    failed = []
    report = []
    for jit in module_specs(windows):
        start = time.perf_counter()
        try:
            if not jit.jit_library_path.exists():
                jit.build()
            note = f"{time.perf_counter() - start:.0f} s"
        except Exception as error:  # report and go on: the benchmark will JIT it or record why
            failed.append(jit.name)
            reason = " ".join(f"{type(error).__name__}: {error}".split())[-300:]
            report.append(f"{jit.name}\tfailed: {reason}")
            print(f"prebuild FAILED {jit.name}: {reason}", flush=True)
            continue
        target = args.aot / jit.name / f"{jit.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(jit.jit_library_path, target)
        deps |= header_deps(jit.build_dir)
        report.append(f"{jit.name}\tok")
        print(f"prebuilt {jit.name} ({note})", flush=True)
    args.deps.write_text("\n".join(sorted(deps)) + "\n")
    args.report.write_text("\n".join(report) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
