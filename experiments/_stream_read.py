"""A streaming-read kernel (Triton) for the read-bandwidth ceiling of `experiments.kernel_bench`.

Every program walks the fp32 input with a grid stride, 4096 elements (16 KiB) per iteration
(ITERS iterations, counted on the host and compiled in), and writes one partial sum, so each
byte is read exactly once and nothing is optimised away.
Imported only on the GPU machine (Triton decides at decoration time whether to interpret).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["stream_read"]

BLOCK = 4096


@triton.jit
def _stream_read_kernel(src, partial, n, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for it in range(ITERS):
        offs = (it * programs + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    tl.store(partial + pid, tl.sum(acc, axis=0))


def stream_read(src: torch.Tensor, partial: torch.Tensor) -> None:
    """Read every element of the contiguous fp32 tensor `src` once; one partial sum per
    program lands in `partial` (its length is the grid size)."""
    programs = partial.numel()
    iters = -(-src.numel() // (programs * BLOCK))
    _stream_read_kernel[(programs,)](src, partial, src.numel(), ITERS=iters, BLOCK=BLOCK,
                                     num_warps=8)
