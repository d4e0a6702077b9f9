"""lowprec: the definition of the kit's numerics, in plain PyTorch on the CPU.

Submodules (import them directly, e.g. ``from lowprec.quantize import fake_quantize``):

- ``formats``   number formats as data (``names()``, ``get(name)``)
- ``quantize``  RN / SR rounding, block formats, quantize / dequantize / pack / unpack
- ``philox``    counter-based random words (Philox-4x32-10, equal to Triton's ``tl.randint4x``)
- ``mamba2``, ``gdn``, ``kda``   reference recurrences and their replay forms
- ``replay``    ReplaySSM bookkeeping (standard and speculative decoding)
- ``policies``  precision policies and the vectorised simulator the experiments drive
- ``metrics``   relative output error against an FP64 run
- ``models``, ``traffic``   model shapes and the memory-traffic model

The bit-level contract is in ``lowprec/README.md``.
"""

from lowprec import formats, metrics, philox, quantize  # noqa: F401  (the core, cheap to import)
