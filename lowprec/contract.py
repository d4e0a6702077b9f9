"""Check a kernel's stored checkpoint against the numerics contract, byte for byte.

The contract (docs/design.md, "What is compared bit for bit"): the copies a flush stores are a
fixed function of the unrounded fp32 state ``S_new``, the seed, the counters and the SR
setting (random bits per element, Philox rounds). So a kernel that can also write its
``S_new`` (a debug output; every kernel of this kit has one, ``debug_state``) is checked without
knowing how it summed:

    from lowprec import contract

    want = contract.flush_copies(s_new, seed=seed, flushes=flushes_before)   # on the CPU
    problems = contract.mismatches({"hi": hi, "lo.codes": lo["codes"],
                                    "lo.scales": lo["scales"],
                                    "lo.global_scale": lo["global_scale"]}, want)
    assert not problems, "\\n".join(problems)

``flush_copies`` is `lowprec.quantize` and `lowprec.philox` applied as a flush applies them
(docs/design.md): the recurrence copy rounded (SR draws ``random_words(seed, slot, flush,
[h, d_v, d_k], sr_bits=, philox_rounds=)``, ``flush`` the slot's counter *before* this flush),
the read copy RN, both packed as `lowprec.quantize.pack` lays them out (nvfp4: two E2M1 codes a
byte, low nibble the even column; E4M3 block scales; an fp32 scale per head). A conventional
step's every-token store in an element format (fp16, fp32) is the recurrence copy alone:
``lo_format=None``, ``flushes`` the tokens stored before.
``mismatches`` compares stored tensors of any dtype by their bits and names the first elements
that differ.
"""

from __future__ import annotations

import torch

from lowprec import formats, philox
from lowprec import quantize as q

__all__ = ["flush_copies", "mismatches"]

# bits compared as signed integers of the element's width (torch compares few unsigned dtypes)
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_counter(name: str, value, rows: int, every_row: bool, limit: int) -> torch.Tensor:
    """An integer sequence or tensor [rows], each in [0, limit) (its Philox field); with
    `every_row`, also an int for all rows (a slot index is each row's own: an int there would
    give every row one slot's words)."""
    if every_row and isinstance(value, int) and not isinstance(value, bool):
        value = [value] * rows
    if isinstance(value, (list, tuple)):
        value = (torch.tensor(value, dtype=torch.int64)
                 if all(isinstance(v, int) and not isinstance(v, bool) for v in value) else None)
    if (not isinstance(value, torch.Tensor) or value.dtype.is_floating_point
            or value.dtype == torch.bool or tuple(value.shape) != (rows,)):
        got = (f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor)
               else repr(value))
        kinds = "an int or integers" if every_row else "integers"
        raise ValueError(f"{name}: expected {kinds} [{rows}] (a list or tensor), got {got}")
    # the range: philox's own check of its slot and flush fields
    return philox._counter(value.detach().cpu(), limit, name)


def flush_copies(
    state: torch.Tensor,
    *,
    hi_format: str = "fp16",
    hi_rounding: str = "sr",
    lo_format: str | None = "nvfp4",
    seed: int = 0,
    slots=None,
    flushes=0,
    sr_bits: int = philox.DEFAULT_SR_BITS,
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
) -> dict[str, torch.Tensor]:
    """The bytes a flush must store for the unrounded fp32 ``state [slots, h, d_v, d_k]``.

    Pass the rows a flush wrote (a kernel leaves the other slots' copies alone), with
    ``slots`` their slot indices (the Philox field; default ``0 .. rows - 1``) and ``flushes``
    their flush counters *before* this flush (an int for all of them, or integers [rows]; a
    kernel that advances the counters in place must be read before it runs). ``sr_bits``
    (8, 13, 16, 32) and ``philox_rounds`` (1..10) are the SR copy's random bits per element
    and Philox rounds (docs/design.md, "Stochastic rounding: random bits and Philox rounds");
    they keep their defaults with ``hi_rounding='rn'``. Returns
    ``{"hi": codes}`` (fp16: uint16 bits, fp32: uint32 bits) and, unless ``lo_format`` is None
    or "none", `lowprec.quantize.pack`'s tensors of the read copy: nvfp4 ``"lo.codes"``,
    ``"lo.scales"`` and ``"lo.global_scale"``; an element format (fp8_e4m3, fp16, fp32)
    ``"lo.codes"`` alone (a kernel's ``values`` tensor). All on the CPU. A step where no slot
    flushes passes ``state[:0]``: every tensor comes back with 0 rows.
    """
    if not isinstance(state, torch.Tensor) or state.dtype != torch.float32 or state.dim() != 4:
        got = (f"{state.dtype} {list(state.shape)}" if isinstance(state, torch.Tensor)
               else type(state).__name__)
        raise ValueError(f"state: expected an fp32 tensor [slots, h, d_v, d_k], got {got}")
    state = state.detach().cpu()
    hi_fmt = formats.get(hi_format)
    if lo_format not in (None, "none") and formats.get(lo_format).block is not None:
        finite = state.isfinite()
        if not bool(finite.all()):
            first = tuple((~finite).nonzero()[0].tolist())
            raise ValueError(f"state: expected finite values for the {lo_format} read copy (a "
                             f"block format stores finite states only), got "
                             f"{state[first].item()} at {first} ({int((~finite).sum())} "
                             f"non-finite)")
    if hi_fmt.block is not None:
        raise ValueError(f"hi_format: expected an element format (the recurrence copy is "
                         f"stored element by element), got {hi_format!r}")
    if hi_rounding not in ("rn", "sr"):
        raise ValueError(f"hi_rounding: expected 'rn' or 'sr', got {hi_rounding!r}")
    sr_bits, philox_rounds = philox.check_sr_settings(sr_bits, philox_rounds, hi_rounding,
                                                      "hi_rounding")
    philox._check_seed(seed)
    rows = state.shape[0]
    slots = _check_counter("slots", torch.arange(rows) if slots is None else slots, rows, False,
                           philox.SLOT_LIMIT)
    flushes = _check_counter("flushes", flushes, rows, True, philox.FLUSH_LIMIT)
    rand = None
    if hi_rounding == "sr":
        rand = philox.random_words(seed, slots, flushes, tuple(state.shape[1:]),
                                   sr_bits=sr_bits, philox_rounds=philox_rounds)
    hi = q.quantize(state, hi_fmt, hi_rounding, rand, sr_bits=sr_bits)
    copies = {"hi": q.pack(hi)["codes"]}
    if lo_format not in (None, "none"):
        packed = q.pack(q.quantize(state, formats.get(lo_format), "rn"))
        copies.update({f"lo.{key}": value for key, value in packed.items()})
    return copies


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(_SIGNED[t.element_size()])


def mismatches(got: dict, want: dict, limit: int = 5) -> list[str]:
    """Lines naming what differs between stored tensors ``got`` and ``want`` (dicts by name),
    compared bit for bit: a missing name, a width or shape that differs, and for each tensor
    the number of elements that differ and the first ``limit`` of them, index and bits in hex.
    An empty list: every tensor of ``want`` is stored bit for bit in ``got`` (extra names in
    ``got`` are not compared). An fp16 tensor compares with uint16 codes, and so on."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit: expected an int >= 1, got {limit!r}")
    problems = []
    for name, expected in want.items():
        if name not in got:
            problems.append(f"{name}: missing (got {sorted(got)})")
            continue
        actual = got[name]
        if not isinstance(actual, torch.Tensor):
            problems.append(f"{name}: expected a tensor, got {type(actual).__name__}")
            continue
        if actual.element_size() != expected.element_size():
            problems.append(f"{name}: {8 * actual.element_size()}-bit elements ({actual.dtype}) "
                            f"against {8 * expected.element_size()}-bit ({expected.dtype})")
            continue
        if actual.shape != expected.shape:
            problems.append(f"{name}: shape {list(actual.shape)} against {list(expected.shape)}")
            continue
        a, e = _bits(actual), _bits(expected)
        differ = (a != e).nonzero()
        if len(differ):
            digits = 2 * expected.element_size()
            mask = (1 << (8 * expected.element_size())) - 1
            first = ", ".join(
                f"{tuple(index.tolist())}: {int(a[tuple(index)]) & mask:0{digits}x} "
                f"against {int(e[tuple(index)]) & mask:0{digits}x}"
                for index in differ[:limit]
            )
            problems.append(f"{name}: {len(differ)} of {e.numel()} elements differ; {first}")
    return problems
