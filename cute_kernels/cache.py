"""The packed caches the CuTe kernels read and write, and the checks every public entry makes.

`ReplayCache` holds a ReplaySSM cache of ``slots`` sequences in the kernels' storage formats
(the emulation's `emulation.replay_decode.ReplayCache` holds the same values in fp32
containers; same field names and order):

    hi         fp16 | fp32  [slots, nheads, headdim, dstate]   recurrence copy (hi_format)
    lo         read copy in lo_format:
                 nvfp4     uint8 [slots, nheads, headdim, dstate // 2]  E2M1 codes, two a byte,
                           low nibble = even k
                 fp8_e4m3  uint8 [slots, nheads, headdim, dstate]       OCP E4M3FN bits
                 fp16      fp16  [slots, nheads, headdim, dstate]
                 fp32      fp32  [slots, nheads, headdim, dstate]
                 none      None (one copy: the non-flush step reads hi)
    lo_scales  nvfp4: uint8 E4M3 [slots, nheads, headdim, dstate // 16], else None
    lo_global  nvfp4: fp32 [slots, nheads] (value = (code * s_b) * s_g), else None
    ring_x     act dtype [slots, nheads, Lcap, headdim]
    ring_dt    fp32      [slots, nheads, Lcap]       dt after dt_bias and softplus
    ring_B     act dtype [slots, ngroups, Lcap, dstate]
    cursors    int32 [slots]   records held before this step
    flushes    int32 [slots]   checkpoint writes so far (the Philox flush counter)

Config: ``hi_format`` ('fp16' | 'fp32'), ``hi_rounding`` ('sr' | 'rn'; 'rn' for fp32),
``lo_format``, ``window`` L (Lcap >= L), the Philox ``seed``, and SR's ``sr_bits`` (random bits
an element: 32, 16, 13 or 8) and ``philox_rounds`` (1..10), left at the defaults (16, 7) for
an RN copy
(docs/design.md, "Stochastic rounding: random bits and Philox rounds"; the names and checks of
the emulation's caches).

`StateCache` holds a conventional decode state (``state`` fp32 | fp16, ``tokens`` int32: the
Philox counter of SR stores; ``scales`` and ``global_scale`` None: the CuTe kernel stores
element formats only), with ``sr_bits`` and ``philox_rounds`` as above.

`check_replay_cache` / `check_state_cache` validate a cache once at each public entry and
return a `CacheView` of it; `check_step` validates a step's token inputs and outputs against
it: dtypes and shapes, one device for everything (meta tensors refused by name, a CUDA device
required last, so that the other checks run on the CPU), and no input or output sharing bytes
with a cache tensor (`check_apart`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from cute_kernels import _compile
from lowprec import philox
from lowprec._checks import bytes_overlap
from lowprec.philox import ELEMENT_LIMIT, SLOT_LIMIT, check_sr_settings
from lowprec.replay import check_counter_ranges

__all__ = ["ReplayCache", "StateCache", "CacheView", "check_replay_cache", "check_state_cache",
           "check_step", "check_apart", "check_counter_values", "require_cuda",
           "check_sr_settings"]

HI_FORMATS = {"fp16": torch.float16, "fp32": torch.float32}
HI_ROUNDINGS = ("sr", "rn")
LO_FORMATS = ("nvfp4", "fp8_e4m3", "fp16", "fp32", "none")
LO_DTYPES = {"nvfp4": torch.uint8, "fp8_e4m3": torch.uint8, "fp16": torch.float16,
             "fp32": torch.float32}
ACT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
NVFP4_BLOCK = 16
E4M3_ONE = 0x38  # the E4M3 code of 1.0: an empty cache's block scales


def fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sizes(*sizes) -> None:
    """ValueError unless every (name, value, least value) of ``sizes`` is an int at least that
    (an ``empty``'s sizes, before anything is allocated)."""
    for name, value, low in sizes:
        if not _is_int(value) or value < low:
            fail(name, f"an int >= {low}", repr(value))


def empty_nvfp4(slots, nheads, rows, cols, device) -> tuple:
    """(codes, block scales, global scales) of an NVFP4 read copy at the zero state: codes 0,
    block scales 1.0, global scales 0."""
    codes = torch.zeros(slots, nheads, rows, cols // 2, dtype=torch.uint8, device=device)
    scales = torch.full((slots, nheads, rows, cols // NVFP4_BLOCK), E4M3_ONE, dtype=torch.uint8,
                        device=device)
    return codes, scales, torch.zeros(slots, nheads, dtype=torch.float32, device=device)


@dataclass
class ReplayCache:
    """A ReplaySSM cache in the CuTe kernels' packed formats (module docstring)."""

    hi: torch.Tensor
    lo: torch.Tensor | None
    lo_scales: torch.Tensor | None
    lo_global: torch.Tensor | None
    ring_x: torch.Tensor
    ring_dt: torch.Tensor
    ring_B: torch.Tensor
    cursors: torch.Tensor
    flushes: torch.Tensor
    hi_format: str = "fp16"
    hi_rounding: str = "sr"
    lo_format: str = "nvfp4"
    window: int = 16
    seed: int = 0
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS

    @classmethod
    def empty(cls, slots: int, nheads: int, headdim: int, dstate: int, *, ngroups: int = 1,
              window: int = 16, hi_format: str = "fp16", hi_rounding: str = "sr",
              lo_format: str = "nvfp4", seed: int = 0, act_dtype: torch.dtype = torch.bfloat16,
              device=None, sr_bits: int = philox.DEFAULT_SR_BITS,
              philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS) -> ReplayCache:
        """A cache at the zero state with empty rings (ring entries NaN, so that a read of an
        unwritten record shows)."""
        check_sizes(("slots", slots, 0), ("nheads", nheads, 1), ("headdim", headdim, 1),
                    ("dstate", dstate, 1), ("ngroups", ngroups, 1), ("window", window, 1))
        sr_bits, philox_rounds = check_sr_settings(sr_bits, philox_rounds, hi_rounding,
                                                   "hi_rounding")
        if hi_format not in HI_FORMATS:
            fail("hi_format", f"one of {list(HI_FORMATS)}", repr(hi_format))
        if lo_format not in LO_FORMATS:
            fail("lo_format", f"one of {list(LO_FORMATS)}", repr(lo_format))
        if act_dtype not in ACT_DTYPES:
            fail("act_dtype", f"one of {list(ACT_DTYPES)}", act_dtype)
        state = (slots, nheads, headdim, dstate)
        lo = scales = global_scale = None
        if lo_format == "nvfp4":
            lo, scales, global_scale = empty_nvfp4(slots, nheads, headdim, dstate, device)
        elif lo_format != "none":
            lo = torch.zeros(state, dtype=LO_DTYPES[lo_format], device=device)
        nan = float("nan")
        cache = cls(
            hi=torch.zeros(state, dtype=HI_FORMATS[hi_format], device=device),
            lo=lo, lo_scales=scales, lo_global=global_scale,
            ring_x=torch.full((slots, nheads, window, headdim), nan, dtype=act_dtype,
                              device=device),
            ring_dt=torch.full((slots, nheads, window), nan, dtype=torch.float32, device=device),
            ring_B=torch.full((slots, ngroups, window, dstate), nan, dtype=act_dtype,
                              device=device),
            cursors=torch.zeros(slots, dtype=torch.int32, device=device),
            flushes=torch.zeros(slots, dtype=torch.int32, device=device),
            hi_format=hi_format, hi_rounding=hi_rounding, lo_format=lo_format, window=window,
            seed=seed, sr_bits=sr_bits, philox_rounds=philox_rounds,
        )
        check_replay_cache(cache)
        return cache

    @property
    def shape(self):
        """(slots, nheads, headdim, dstate, ngroups, Lcap)."""
        S, H, P, N = self.hi.shape
        return S, H, P, N, self.ring_B.shape[1], self.ring_x.shape[2]


@dataclass
class StateCache:
    """A conventional decode state in the CuTe kernel's formats (module docstring): ``format``
    'fp32' or 'fp16' (the state's dtype), ``rounding`` 'rn' or 'sr' (fp16 only), ``seed``,
    and SR's ``sr_bits`` and ``philox_rounds`` (the defaults (16, 7) for RN)."""

    state: torch.Tensor
    scales: torch.Tensor | None
    global_scale: torch.Tensor | None
    tokens: torch.Tensor
    format: str = "fp16"
    rounding: str = "rn"
    seed: int = 0
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS

    @classmethod
    def empty(cls, slots: int, nheads: int, headdim: int, dstate: int, *, format: str = "fp16",
              rounding: str = "rn", seed: int = 0, device=None,
              sr_bits: int = philox.DEFAULT_SR_BITS,
              philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS) -> StateCache:
        """A zero state with its token counters at 0."""
        check_sizes(("slots", slots, 0), ("nheads", nheads, 1), ("headdim", headdim, 1),
                    ("dstate", dstate, 1))
        sr_bits, philox_rounds = check_sr_settings(sr_bits, philox_rounds, rounding, "rounding")
        if format not in HI_FORMATS:
            fail("format", f"one of {list(HI_FORMATS)}", repr(format))
        cache = cls(state=torch.zeros(slots, nheads, headdim, dstate, dtype=HI_FORMATS[format],
                                      device=device),
                    scales=None, global_scale=None,
                    tokens=torch.zeros(slots, dtype=torch.int32, device=device),
                    format=format, rounding=rounding, seed=seed, sr_bits=sr_bits,
                    philox_rounds=philox_rounds)
        check_state_cache(cache)
        return cache


@dataclass(frozen=True)
class CacheView:
    """A checked cache: its sizes, device, and named tensors (None where absent)."""

    slots: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    ring_len: int
    device: torch.device
    act: torch.dtype | None
    tensors: dict  # cache field name -> tensor, every one the kernels touch


def check_tensor(name, t, dtype, shape, device=None):
    """``t`` is a contiguous, 16-byte-aligned tensor of ``dtype`` (or one of a tuple) and
    ``shape`` on ``device``."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        fail(name, f"dtype {' or '.join(str(d) for d in dtypes)}", t.dtype)
    if tuple(t.shape) != tuple(shape):
        fail(name, f"shape {list(shape)}", list(t.shape))
    if device is not None and t.device != device:
        fail(name, f"device {device} (every tensor on the cache's device)", t.device)
    if not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")
    if t.data_ptr() % _compile.ALIGN:
        fail(name, f"a {_compile.ALIGN}-byte-aligned data pointer", hex(t.data_ptr()))


def check_apart(name, tensor, **others) -> None:
    """ValueError if ``tensor`` shares bytes with one of ``others`` (None entries skipped):
    the kernels read inputs after writing outputs (the append reads x after y is stored, the
    flush reads the state it rewrites), and an input inside the cache would be overwritten
    before it is read."""
    if tensor is None:
        return
    for other_name, other in others.items():
        if isinstance(other, torch.Tensor) and bytes_overlap(tensor, other):
            fail(name, f"a tensor apart from {other_name}", f"one sharing {other_name}'s memory")


def _check_device(name, t) -> None:
    if t.device.type == "meta":
        fail(name, "a tensor with storage (a CUDA tensor)", "a meta tensor")


def require_cuda(name, tensor) -> None:
    """ValueError unless ``tensor`` (on the arguments' one device, as checked before) is on a
    GPU: after every other check, so that those run on the CPU."""
    if tensor.device.type != "cuda":
        fail(name, "a CUDA tensor (every argument on one GPU)", tensor.device)


def check_seed(seed):
    if not _is_int(seed) or not 0 <= seed < 1 << 64:
        fail("seed", "an int in [0, 2^64)", repr(seed))


def check_philox_fields(name, slots, slot_elements, draws_words=True):
    """The slots within the Philox counter's slot field (fewer than 2^20) and, where SR draws
    words, a slot's elements within its element field (at most 2^24): past them the
    counter's fields overlap and elements silently share words."""
    if slots >= SLOT_LIMIT:
        fail(f"{name}.shape[0] (slots)", "fewer than 2^20 (Philox slot field)", slots)
    if draws_words and slot_elements > ELEMENT_LIMIT:
        fail(f"{name}.shape[1:] (nheads x headdim x dstate)",
             "at most 2^24 elements a slot (Philox element field, with SR)", slot_elements)


def check_read_copy(cache, state: tuple, device) -> None:
    """The read copy's tensors (``cache.lo``, ``lo_scales``, ``lo_global``) as
    ``cache.lo_format`` stores a ``state``-shaped copy: NVFP4 codes and scales, one tensor of
    the format's dtype, or none."""
    S, H, P, N = state
    fmt = cache.lo_format
    expected = {"lo": None, "lo_scales": None, "lo_global": None}
    if fmt == "nvfp4":
        expected = {"lo": (torch.uint8, (S, H, P, N // 2)),
                    "lo_scales": (torch.uint8, (S, H, P, N // NVFP4_BLOCK)),
                    "lo_global": (torch.float32, (S, H))}
    elif fmt != "none":
        expected["lo"] = (LO_DTYPES[fmt], state)
    for name, spec in expected.items():
        t = getattr(cache, name)
        if spec is None:
            if t is not None:
                fail(f"cache.{name}", f"None for lo_format={fmt!r}", type(t).__name__)
        else:
            check_tensor(f"cache.{name}", t, spec[0], spec[1], device)


def check_cache_apart(cache) -> dict:
    """ValueError if two tensors of the cache dataclass ``cache`` share bytes (e.g. cursors and
    flushes: the counter kernel needs both); returns its tensors by field name."""
    tensors = {f.name: getattr(cache, f.name) for f in fields(cache)
               if isinstance(getattr(cache, f.name), torch.Tensor)}
    names = list(tensors)
    for i, a in enumerate(names):
        check_apart(f"cache.{a}", tensors[a],
                    **{f"cache.{b}": tensors[b] for b in names[i + 1:]})
    return tensors


def check_replay_cache(cache) -> CacheView:
    """Validate ``cache`` (a `ReplayCache`: every tensor of its docstring's layout, one
    device, no two tensors sharing bytes, a valid config) and return its view."""
    if not isinstance(cache, ReplayCache):
        fail("cache", "a cute_kernels.cache.ReplayCache", type(cache).__name__)
    if cache.hi_format not in HI_FORMATS:
        fail("cache.hi_format", f"one of {list(HI_FORMATS)}", repr(cache.hi_format))
    if cache.hi_rounding not in HI_ROUNDINGS:
        fail("cache.hi_rounding", f"one of {list(HI_ROUNDINGS)}", repr(cache.hi_rounding))
    if cache.hi_format == "fp32" and cache.hi_rounding != "rn":
        fail("cache.hi_rounding", "'rn' for an fp32 recurrence copy (its store is exact)",
             repr(cache.hi_rounding))
    if cache.lo_format not in LO_FORMATS:
        fail("cache.lo_format", f"one of {list(LO_FORMATS)}", repr(cache.lo_format))
    if not _is_int(cache.window) or not 1 <= cache.window <= 32:
        fail("cache.window", "an int in [1, 32]", repr(cache.window))
    check_seed(cache.seed)
    check_sr_settings(cache.sr_bits, cache.philox_rounds, cache.hi_rounding, "hi_rounding",
                      "cache.")
    hi = cache.hi
    if not isinstance(hi, torch.Tensor) or hi.dim() != 4:
        fail("cache.hi", "a 4-d tensor [slots, nheads, headdim, dstate]",
             list(hi.shape) if isinstance(hi, torch.Tensor) else type(hi).__name__)
    S, H, P, N = hi.shape
    device = hi.device
    check_tensor("cache.hi", hi, HI_FORMATS[cache.hi_format], hi.shape, device)
    ring_x, ring_B = cache.ring_x, cache.ring_B
    if not isinstance(ring_x, torch.Tensor) or ring_x.dim() != 4:
        fail("cache.ring_x", "a 4-d tensor [slots, nheads, Lcap, headdim]",
             getattr(ring_x, "shape", type(ring_x).__name__))
    if not isinstance(ring_B, torch.Tensor) or ring_B.dim() != 4:
        fail("cache.ring_B", "a 4-d tensor [slots, ngroups, Lcap, dstate]",
             getattr(ring_B, "shape", type(ring_B).__name__))
    Lc, G = ring_x.shape[2], ring_B.shape[1]
    if Lc < cache.window:
        fail("cache.ring_x.shape[2] (Lcap)", f">= window={cache.window}", Lc)
    if G < 1 or H % G:
        fail("cache.ring_B.shape[1] (ngroups)", f"a divisor of nheads={H}", G)
    act = ring_x.dtype
    if act not in ACT_DTYPES:
        fail("cache.ring_x", f"dtype in {list(ACT_DTYPES)}", act)
    check_tensor("cache.ring_x", ring_x, act, (S, H, Lc, P), device)
    check_tensor("cache.ring_dt", cache.ring_dt, torch.float32, (S, H, Lc), device)
    check_tensor("cache.ring_B", ring_B, act, (S, G, Lc, N), device)
    check_tensor("cache.cursors", cache.cursors, torch.int32, (S,), device)
    check_tensor("cache.flushes", cache.flushes, torch.int32, (S,), device)
    check_read_copy(cache, (S, H, P, N), device)
    tensors = check_cache_apart(cache)
    check_philox_fields("cache.hi", S, H * P * N,
                        cache.hi_format == "fp16" and cache.hi_rounding == "sr")
    _check_device("cache.hi", hi)  # (last: the checks above run on meta tensors)
    return CacheView(S, H, P, N, G, Lc, device, act,
                     {f"cache.{k}": v for k, v in tensors.items()})


def check_state_cache(cache) -> CacheView:
    """Validate ``cache`` (a `StateCache`) and return its view."""
    if not isinstance(cache, StateCache):
        fail("cache", "a cute_kernels.cache.StateCache", type(cache).__name__)
    if cache.format not in HI_FORMATS:
        fail("cache.format", f"one of {list(HI_FORMATS)}", repr(cache.format))
    if cache.rounding not in HI_ROUNDINGS or (cache.format == "fp32" and cache.rounding != "rn"):
        fail("cache.rounding", f"one of {list(HI_ROUNDINGS)} ('rn' for fp32: its store is "
             "exact)", repr(cache.rounding))
    check_seed(cache.seed)
    check_sr_settings(cache.sr_bits, cache.philox_rounds, cache.rounding, "rounding", "cache.")
    for name in ("scales", "global_scale"):
        if getattr(cache, name) is not None:
            fail(f"cache.{name}", "None (element formats only)",
                 type(getattr(cache, name)).__name__)
    state = cache.state
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        fail("cache.state", "a 4-d tensor [slots, nheads, headdim, dstate]",
             list(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__)
    S, H, P, N = state.shape
    check_tensor("cache.state", state, HI_FORMATS[cache.format], state.shape, state.device)
    check_tensor("cache.tokens", cache.tokens, torch.int32, (S,), state.device)
    check_apart("cache.tokens", cache.tokens, **{"cache.state": state})
    if cache.rounding == "sr":  # RN draws no words: neither field applies
        check_philox_fields("cache.state", S, H * P * N)
    _check_device("cache.state", state)  # (last: the checks above run on meta tensors)
    return CacheView(S, H, P, N, 0, 0, state.device, None,
                     {"cache.state": state, "cache.tokens": cache.tokens})


def check_step(view: CacheView, x, dt, A, B, C, D, z, dt_bias, *, out=None, debug_state=None):
    """Validate one step's token inputs and outputs against ``view``; returns (act name,
    dt name, ngroups). Every input and output is refused if it shares bytes with a cache
    tensor, and every output if it shares bytes with an input or the other output."""
    S, H, P, N = view.slots, view.nheads, view.headdim, view.dstate
    device = view.device
    if not isinstance(x, torch.Tensor) or x.dtype not in ACT_DTYPES:
        fail("x", f"a tensor of dtype {' or '.join(map(str, ACT_DTYPES))}",
             getattr(x, "dtype", type(x).__name__))
    act = x.dtype
    if view.act is not None and act != view.act:
        fail("x", f"dtype {view.act} (the ring's)", act)
    check_tensor("x", x, act, (S, H, P), device)
    check_tensor("dt", dt, tuple(ACT_DTYPES), (S, H), device)
    check_tensor("A", A, torch.float32, (H,), device)
    if not isinstance(B, torch.Tensor) or B.dim() != 3:
        fail("B", "a 3-d tensor [slots, ngroups, dstate]",
             list(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__)
    G = view.ngroups or B.shape[1]
    if G < 1 or H % G:
        fail("B.shape[1] (ngroups)", f"a divisor of nheads={H}", G)
    check_tensor("B", B, act, (S, G, N), device)
    check_tensor("C", C, act, (S, G, N), device)
    if D is not None:
        check_tensor("D", D, torch.float32, (H,), device)
    if z is not None:
        check_tensor("z", z, act, (S, H, P), device)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, torch.float32, (H,), device)
    if out is not None:
        check_tensor("out", out, act, (S, H, P), device)
    if debug_state is not None:
        check_tensor("debug_state", debug_state, torch.float32, (S, H, P, N), device)
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    for name, t in inputs.items():
        check_apart(name, t, **view.tensors)
    check_apart("out", out, **inputs, **view.tensors)
    check_apart("debug_state", debug_state, out=out, **inputs, **view.tensors)
    return ACT_DTYPES[act], ACT_DTYPES[dt.dtype], G


def check_counter_values(cursors, flushes, window: int) -> None:
    """ValueError unless every cursor lies in [0, window - 1] and every flush counter in
    [0, 2^20 - 1) (lowprec.replay.check_counter_ranges). One host read (a stream sync):
    opt-in, for tests and debugging."""
    check_counter_ranges(cursors, flushes, 0, window - 1, f"window {window}")


def check_switch(name, value) -> None:
    if not isinstance(value, bool):
        fail(name, "a bool", repr(value))
