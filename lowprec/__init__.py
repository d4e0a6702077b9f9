"""lowprec: the definition of the kit's numerics, in plain PyTorch on the CPU.

The public API, at package level:

    import torch, lowprec

    state = torch.randn(8, 64, 128, dtype=torch.bfloat16)        # [..., d_v, d_k]
    q = lowprec.quantize(state, "nvfp4")                           # E2M1 codes, E4M3 scales
    stored = lowprec.pack(q)                                       # {codes, scales, global_scale}
    back = lowprec.dequantize(lowprec.unpack(stored, "nvfp4", state.shape, state.dtype))
    assert torch.equal(back, lowprec.fake_quantize(state, "nvfp4"))   # fp32: result_dtype
    hi = lowprec.round_to(state.float(), "fp16", rounding="sr", seed=0)   # Philox words, seed 0
    policy = lowprec.make_policy("separate_fp16sr", "nvfp4", window=16, seed=0)

- ``quantize(x, fmt, rounding="rn", rand=None, *, seed=None, slot=None, flush=None)``,
  ``dequantize(q)``, ``fake_quantize(...)``, ``round_to(x, element, ...)``, ``pack(q)``,
  ``unpack(packed, fmt, shape, dtype)``, ``result_dtype(fmt, dtype)``, ``Quantized``: the
  rounding and storage rules (``lowprec.quantize`` is also that module: calling it quantises)
- ``Policy``, ``make_policy``: where a decode state is rounded (``lowprec.policies``)
- ``formats`` (``names()``, ``get(name)``), ``philox`` (counter-based random words, equal to
  Triton's ``tl.randint4x``), ``metrics`` (``rel_err``)
- ``mamba2``, ``gdn``, ``kda``: reference recurrences and their replay forms; ``replay``:
  ReplaySSM bookkeeping (``Mamba2Replay``, ``GDNReplay``, ``KDAReplay``); ``models``,
  ``traffic``: model shapes and the memory-traffic model (import these submodules directly)

The bit-level contract is in ``lowprec/README.md``.
"""

from lowprec import formats, metrics, philox, quantize  # noqa: F401  (the core, cheap to import)
from lowprec.policies import Policy, make_policy
from lowprec.quantize import (
    Quantized,
    dequantize,
    fake_quantize,
    pack,
    result_dtype,
    round_to,
    unpack,
)

__all__ = [
    "Policy",
    "Quantized",
    "dequantize",
    "fake_quantize",
    "formats",
    "make_policy",
    "metrics",
    "pack",
    "philox",
    "quantize",
    "result_dtype",
    "round_to",
    "unpack",
]


def __getattr__(name):
    """The reference modules load on first use (``lowprec.mamba2`` works without an import)."""
    if name in ("mamba2", "gdn", "kda", "replay", "policies", "models", "traffic", "contract"):
        import importlib

        return importlib.import_module(f"lowprec.{name}")
    raise AttributeError(f"module 'lowprec' has no attribute {name!r}")
