"""Small helpers shared by the CuTe DSL kernels: target, compile cache, pointers, stream.

- Import this module before `cutlass` (every kernel module does): on a machine without a CUDA
  GPU it sets `CUTE_DSL_ARCH=sm_90a` (unless already set), so kernels compile for the H200 on a
  CPU-only machine, which is what CI checks.
- `compile_cached(key, build)`: one compiled kernel per static configuration (dtypes, shapes,
  formats, flags); `build()` returns the `cute.compile` result. Runtime values (pointers, batch
  size, seed, stream) are never part of a key. `build()` runs under `cute_argv()`.
- `cute_argv()`: a context in which `sys.argv` holds only the program name and any
  `-diagnostic` argument. CuTe DSL parses `sys.argv` on every compile (its `-diagnostic`
  switch), and argparse reads an argument such as `--h` or `--he` as `--help`: the process
  would print CuTe's usage and exit with status 0. Every compile of the kit goes through it.
- `compile_options(keep_ptx)`: the `cute.compile` options string. With `keep_ptx` the PTX text
  is kept (`compiled.__ptx__`) and its file goes to a private temporary directory, so tests can
  read it.
- `gmem_ptr(tensor, dtype)` / `fake_ptr(dtype)`: 16-byte-aligned global pointers (a torch
  tensor's storage, or a placeholder for compiling without a GPU). Kernels build their tensors
  from pointers and static shapes, so a launch converts no tensors (cheap enough to call every
  decode step, and nothing to re-validate per call).
- `current_stream()` / `fake_stream()`: torch's current CUDA stream as the launch stream, so
  decode steps follow torch's stream semantics and can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

H200_SM_COUNT = 132  # the target's SMs: for what is worked out without the GPU

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.runtime as cutlass_runtime  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402

__all__ = [
    "ALIGN",
    "TORCH_TO_CUTE",
    "compile_cached",
    "compile_options",
    "cute_argv",
    "gmem_ptr",
    "fake_ptr",
    "current_stream",
    "fake_stream",
    "on_gpu",
]

ALIGN = 16  # bytes: every tensor a kernel reads with 128-bit accesses starts 16-byte aligned

TORCH_TO_CUTE = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.int32: cutlass.Int32,
    torch.uint8: cutlass.Uint8,
}

_CACHE: dict = {}
_DUMP_DIR: str | None = None


def on_gpu() -> bool:
    return torch.cuda.is_available()


def compile_options(keep_ptx: bool = False) -> str:
    """Options for `cute.compile`: sm_90a when no GPU is present; PTX kept on request."""
    global _DUMP_DIR
    options = []
    if not on_gpu():
        options.append("--gpu-arch=sm_90a")
    if keep_ptx:
        if _DUMP_DIR is None:
            _DUMP_DIR = tempfile.mkdtemp(prefix="cute_kernels_ptx_")
        options += ["--keep-ptx", f"--dump-dir={_DUMP_DIR}"]
    return " ".join(options)


@contextlib.contextmanager
def cute_argv():
    """`sys.argv` reduced to the program name and CuTe DSL's own `-diagnostic [LEVEL]` for the
    duration (restored after): the caller's command-line arguments never reach CuTe's parser."""
    saved = sys.argv
    kept = saved[:1]
    for i, arg in enumerate(saved[1:], start=1):
        if arg == "-diagnostic" or arg.startswith("-diagnostic="):
            kept.append(arg)
            following = saved[i + 1] if i + 1 < len(saved) else ""
            if arg == "-diagnostic" and following and not following.startswith("-"):
                kept.append(following)
    sys.argv = kept
    try:
        yield
    finally:
        sys.argv = saved


def compile_cached(key, build):
    """The compiled kernel for the static configuration `key`, built once by `build()` (under
    `cute_argv()`)."""
    compiled = _CACHE.get(key)
    if compiled is None:
        with cute_argv():
            compiled = build()
        _CACHE[key] = compiled
    return compiled


def gmem_ptr(tensor: torch.Tensor, dtype=None):
    """A 16-byte-aligned global-memory pointer to `tensor`'s first element, typed `dtype`
    (default: the tensor's own element type)."""
    dtype = dtype or TORCH_TO_CUTE[tensor.dtype]
    return make_ptr(dtype, tensor.data_ptr(), cute.AddressSpace.gmem, assumed_align=ALIGN)


def fake_ptr(dtype):
    """A placeholder global pointer of element type `dtype`, for compiling without a GPU."""
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=ALIGN)


def current_stream():
    """torch's current CUDA stream as a launch stream."""
    from cuda.bindings import driver

    return driver.CUstream(torch.cuda.current_stream().cuda_stream)


def fake_stream():
    """A placeholder stream for compiling without a GPU."""
    return cutlass_runtime.make_fake_stream()
