"""The packed caches of the CuTe Gated DeltaNet kernels, and the checks every public entry makes.

`GDNReplayCache` holds a ReplaySSM cache of ``slots`` sequences in the kernels' storage formats
(the emulation's `emulation.gdn_replay_decode.GDNReplayCache` holds the same values in fp32
containers; same field names and order). The state follows `lowprec.gdn`: ``S [dv, dk]`` per
(slot, head), one key per value head (lowprec's layout has no separate key heads: a model with
fewer key heads, such as Qwen3-Next's 16 for 32 value heads, repeats each key for its value
heads before the call):

    hi         fp16 | fp32  [slots, nheads, dv, dk]          recurrence copy (hi_format)
    lo         nvfp4: uint8 [slots, nheads, dv, dk // 2]     E2M1 codes, two a byte, low
                                                             nibble = even k
               none:  None (one copy: the non-flush step reads hi)
    lo_scales  nvfp4: uint8 E4M3 [slots, nheads, dv, dk // 16], else None
    lo_global  nvfp4: fp32 [slots, nheads] (value = (code * s_b) * s_g), else None
    ring_u     fp32      [slots, nheads, Lcap, dv]   u of each record (read-copy based)
    ring_v     act dtype [slots, nheads, Lcap, dv]   raw v (the flush recomputes u from it)
    ring_k     act dtype [slots, nheads, Lcap, dk]
    ring_g     fp32      [slots, nheads, Lcap]       log-decay
    ring_beta  fp32      [slots, nheads, Lcap]
    cursors    int32 [slots]   records held before this step
    flushes    int32 [slots]   checkpoint writes so far (the Philox flush counter)

Config: ``hi_format`` / ``hi_rounding`` and ``lo_format`` in one of the kernels' two
pairings, ('fp16', 'sr' | 'rn', 'nvfp4') (two-precision) or ('fp32', 'rn', 'none') (the
single-copy FP32 ReplaySSM baseline); ``window`` L = Lcap (standard decoding: no draft rows)
the Philox ``seed`` and SR's ``sr_bits`` and ``philox_rounds`` (as `cute_kernels.cache`'s
ReplayCache: the defaults (16, 7) for an RN copy). Shapes: dk one of 128, 256, 512 (a row's
NVFP4 blocks on the lanes of one warp), dv a multiple of 16 with dv * dk <= 65536 (64 state
elements a thread, at most 1024 threads).

`GDNStateCache` holds a conventional GDN decode state (``state`` fp32 | bf16, stored RN), the
baseline's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cute_kernels import _compile  # noqa: F401  (sets the sm_90a target before cutlass)
from cute_kernels.cache import (
    _is_int,
    check_apart,
    check_cache_apart,
    check_read_copy,
    check_seed,
    check_sizes,
    check_sr_settings,
    check_switch,
    check_tensor,
    empty_nvfp4,
    fail,
)
from lowprec import philox
from lowprec.philox import ELEMENT_LIMIT, SLOT_LIMIT

__all__ = ["GDNReplayCache", "GDNStateCache", "GDNView", "check_gdn_cache",
           "check_gdn_state_cache", "check_gdn_step", "PAIRINGS", "STATE_FORMATS"]

# (hi_format, hi_rounding, lo_format) the kernels have
PAIRINGS = (("fp16", "sr", "nvfp4"), ("fp16", "rn", "nvfp4"), ("fp32", "rn", "none"))
HI_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
STATE_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DK_CHOICES = (128, 256, 512)
ELEMENTS_PER_THREAD = 64
MAX_WINDOW = 32


def check_head_shape(dv: int, dk: int, prefix: str = "") -> None:
    """ValueError unless (dv, dk) is a head the kernels' thread layout covers."""
    if dk not in DK_CHOICES:
        fail(f"{prefix}dk", f"one of {DK_CHOICES} (a row's 16-element blocks on the lanes of "
             "one warp)", dk)
    if dv % 16 or dv < 16:
        fail(f"{prefix}dv", "a positive multiple of 16", dv)
    if dv * dk > 1024 * ELEMENTS_PER_THREAD:
        fail(f"{prefix}dv * dk", f"at most {1024 * ELEMENTS_PER_THREAD} (64 elements a thread, "
             "at most 1024 threads)", dv * dk)


@dataclass
class GDNReplayCache:
    """A GDN ReplaySSM cache in the CuTe kernels' packed formats (module docstring)."""

    hi: torch.Tensor
    lo: torch.Tensor | None
    lo_scales: torch.Tensor | None
    lo_global: torch.Tensor | None
    ring_u: torch.Tensor
    ring_v: torch.Tensor
    ring_k: torch.Tensor
    ring_g: torch.Tensor
    ring_beta: torch.Tensor
    cursors: torch.Tensor
    flushes: torch.Tensor
    hi_format: str = "fp16"
    hi_rounding: str = "sr"
    lo_format: str = "nvfp4"
    window: int = 16
    draft: int = 0
    seed: int = 0
    per_channel: bool = False
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS

    @classmethod
    def empty(
        cls,
        slots: int,
        nheads: int,
        dv: int,
        dk: int,
        *,
        per_channel: bool = False,
        window: int = 16,
        draft: int = 0,
        hi_format: str = "fp16",
        hi_rounding: str = "sr",
        lo_format: str = "nvfp4",
        seed: int = 0,
        hi_dtype: torch.dtype | None = None,
        act_dtype: torch.dtype = torch.bfloat16,
        device=None,
        sr_bits: int = philox.DEFAULT_SR_BITS,
        philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
    ) -> GDNReplayCache:
        """A cache at the zero state with empty rings (ring entries NaN, so that a read of an
        unwritten record shows). The emulation's signature; ``per_channel`` must be False and
        ``draft`` 0 (no KDA or speculative kernels here), ``hi_dtype`` None or hi_format's."""
        check_sizes(("slots", slots, 0), ("nheads", nheads, 1), ("dv", dv, 1), ("dk", dk, 1),
                    ("window", window, 1), ("draft", draft, 0))
        sr_bits, philox_rounds = check_sr_settings(sr_bits, philox_rounds, hi_rounding,
                                                   "hi_rounding")
        if (hi_format, hi_rounding, lo_format) not in PAIRINGS:
            fail("(hi_format, hi_rounding, lo_format)", f"one of {PAIRINGS}",
                 (hi_format, hi_rounding, lo_format))
        if hi_dtype is not None and hi_dtype != HI_DTYPES[hi_format]:
            fail("hi_dtype", f"None or {HI_DTYPES[hi_format]} (hi_format={hi_format!r})",
                 hi_dtype)
        if act_dtype not in ACT_DTYPES:
            fail("act_dtype", f"one of {list(ACT_DTYPES)}", act_dtype)
        check_head_shape(dv, dk)
        state = (slots, nheads, dv, dk)
        lo = scales = global_scale = None
        if lo_format == "nvfp4":
            lo, scales, global_scale = empty_nvfp4(slots, nheads, dv, dk, device)
        lcap = window + draft
        nan = float("nan")
        f32 = dict(dtype=torch.float32, device=device)
        act = dict(dtype=act_dtype, device=device)
        cache = cls(
            hi=torch.zeros(state, dtype=HI_DTYPES[hi_format], device=device),
            lo=lo, lo_scales=scales, lo_global=global_scale,
            ring_u=torch.full((slots, nheads, lcap, dv), nan, **f32),
            ring_v=torch.full((slots, nheads, lcap, dv), nan, **act),
            ring_k=torch.full((slots, nheads, lcap, dk), nan, **act),
            ring_g=torch.full((slots, nheads, lcap), nan, **f32),
            ring_beta=torch.full((slots, nheads, lcap), nan, **f32),
            cursors=torch.zeros(slots, dtype=torch.int32, device=device),
            flushes=torch.zeros(slots, dtype=torch.int32, device=device),
            hi_format=hi_format, hi_rounding=hi_rounding, lo_format=lo_format,
            window=window, draft=draft, seed=seed, per_channel=per_channel, sr_bits=sr_bits,
            philox_rounds=philox_rounds,
        )
        check_gdn_cache(cache)
        return cache

    @property
    def shape(self):
        """(slots, nheads, dv, dk, Lcap)."""
        slots, nheads, dv, dk = self.hi.shape
        return slots, nheads, dv, dk, self.ring_v.shape[2]


@dataclass
class GDNStateCache:
    """A conventional GDN decode state [slots, nheads, dv, dk] in ``format`` 'fp32' or 'bf16'
    (stored RN: the fp32 state exactly)."""

    state: torch.Tensor
    format: str = "fp32"

    @classmethod
    def empty(cls, slots: int, nheads: int, dv: int, dk: int, *, format: str = "fp32",
              device=None) -> GDNStateCache:
        """A zero state."""
        check_sizes(("slots", slots, 0), ("nheads", nheads, 1), ("dv", dv, 1), ("dk", dk, 1))
        if format not in STATE_FORMATS:
            fail("format", f"one of {list(STATE_FORMATS)}", repr(format))
        cache = cls(torch.zeros(slots, nheads, dv, dk, dtype=STATE_FORMATS[format],
                                device=device), format)
        check_gdn_state_cache(cache)
        return cache


@dataclass(frozen=True)
class GDNView:
    """A checked cache: its sizes, device, activation dtype and named tensors."""

    slots: int
    nheads: int
    dv: int
    dk: int
    ring_len: int
    device: torch.device
    act: torch.dtype | None
    tensors: dict  # cache field name -> tensor


def _check_state_tensor(name, t):
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        fail(name, "a 4-d tensor [slots, nheads, dv, dk]",
             list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__)
    if t.device.type == "meta":
        fail(name, "a tensor with storage (a CUDA tensor)", "a meta tensor")
    slots, nheads, dv, dk = t.shape
    if nheads < 1:
        fail(f"{name}.shape[1] (nheads)", ">= 1", nheads)
    check_head_shape(dv, dk, f"{name}.shape: ")
    if slots >= SLOT_LIMIT:
        fail(f"{name}.shape[0] (slots)", "fewer than 2^20 (Philox slot field)", slots)
    return t.shape


def check_gdn_cache(cache) -> GDNView:
    """Validate ``cache`` (a `GDNReplayCache`: every tensor of the module docstring's layout,
    one device, no two tensors sharing bytes, a pairing the kernels have) and return its
    view."""
    if not isinstance(cache, GDNReplayCache):
        fail("cache", "a cute_kernels.gdn_cache.GDNReplayCache", type(cache).__name__)
    pairing = (cache.hi_format, cache.hi_rounding, cache.lo_format)
    if pairing not in PAIRINGS:
        fail("cache.(hi_format, hi_rounding, lo_format)", f"one of {PAIRINGS}", pairing)
    check_switch("cache.per_channel", cache.per_channel)
    if cache.per_channel:
        fail("cache.per_channel", "False (GDN's per-head decay; the KDA variant is not built: "
             "cute_kernels/gdn_replay_decode.py says what it would take)", True)
    if not _is_int(cache.window) or not 1 <= cache.window <= MAX_WINDOW:
        fail("cache.window", f"an int in [1, {MAX_WINDOW}]", repr(cache.window))
    if cache.draft != 0:
        fail("cache.draft", "0 (standard decoding; no speculative kernels here)",
             repr(cache.draft))
    check_seed(cache.seed)
    check_sr_settings(cache.sr_bits, cache.philox_rounds, cache.hi_rounding, "hi_rounding",
                      "cache.")
    S, H, P, N = _check_state_tensor("cache.hi", cache.hi)
    device = cache.hi.device
    check_tensor("cache.hi", cache.hi, HI_DTYPES[cache.hi_format], (S, H, P, N), device)
    if H * P * N > ELEMENT_LIMIT and cache.hi_rounding == "sr":
        fail("cache.hi.shape[1:] (nheads x dv x dk)",
             "at most 2^24 elements a slot (Philox element field, with SR)", H * P * N)
    rv = cache.ring_v
    if not isinstance(rv, torch.Tensor) or rv.dim() != 4 or rv.dtype not in ACT_DTYPES:
        fail("cache.ring_v", f"a 4-d tensor [slots, nheads, Lcap, dv] of {list(ACT_DTYPES)}",
             getattr(rv, "shape", type(rv).__name__))
    L = cache.window
    act = rv.dtype
    check_tensor("cache.ring_v", rv, act, (S, H, L, P), device)
    check_tensor("cache.ring_k", cache.ring_k, act, (S, H, L, N), device)
    check_tensor("cache.ring_u", cache.ring_u, torch.float32, (S, H, L, P), device)
    check_tensor("cache.ring_g", cache.ring_g, torch.float32, (S, H, L), device)
    check_tensor("cache.ring_beta", cache.ring_beta, torch.float32, (S, H, L), device)
    check_tensor("cache.cursors", cache.cursors, torch.int32, (S,), device)
    check_tensor("cache.flushes", cache.flushes, torch.int32, (S,), device)
    check_read_copy(cache, (S, H, P, N), device)
    tensors = check_cache_apart(cache)
    return GDNView(S, H, P, N, L, device, act, {f"cache.{k}": v for k, v in tensors.items()})


def check_gdn_state_cache(cache) -> GDNView:
    """Validate ``cache`` (a `GDNStateCache`) and return its view."""
    if not isinstance(cache, GDNStateCache):
        fail("cache", "a cute_kernels.gdn_cache.GDNStateCache", type(cache).__name__)
    if cache.format not in STATE_FORMATS:
        fail("cache.format", f"one of {list(STATE_FORMATS)}", repr(cache.format))
    S, H, P, N = _check_state_tensor("cache.state", cache.state)
    check_tensor("cache.state", cache.state, STATE_FORMATS[cache.format], (S, H, P, N),
                 cache.state.device)
    return GDNView(S, H, P, N, 0, cache.state.device, None, {"cache.state": cache.state})


def check_gdn_step(view: GDNView, q, k, v, g, beta, *, out=None, debug_state=None) -> str:
    """Validate one step's token inputs and outputs against ``view``: q, k [slots, nheads, dk]
    and v [slots, nheads, dv] in one activation dtype (the ring's), g and beta [slots, nheads]
    fp32; out [slots, nheads, dv] in the activation dtype; debug_state fp32 state-shaped. No
    input or output may share bytes with a cache tensor, no output with an input or the other
    output. Returns the activation dtype's name."""
    S, H, P, N = view.slots, view.nheads, view.dv, view.dk
    device = view.device
    if not isinstance(v, torch.Tensor) or v.dtype not in ACT_DTYPES:
        fail("v", f"a tensor of dtype {' or '.join(map(str, ACT_DTYPES))}",
             getattr(v, "dtype", type(v).__name__))
    act = v.dtype
    if view.act is not None and act != view.act:
        fail("v", f"dtype {view.act} (the ring's)", act)
    check_tensor("q", q, act, (S, H, N), device)
    check_tensor("k", k, act, (S, H, N), device)
    check_tensor("v", v, act, (S, H, P), device)
    check_tensor("g", g, torch.float32, (S, H), device)
    check_tensor("beta", beta, torch.float32, (S, H), device)
    if out is not None:
        check_tensor("out", out, act, (S, H, P), device)
    if debug_state is not None:
        check_tensor("debug_state", debug_state, torch.float32, (S, H, P, N), device)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    for name, t in inputs.items():
        check_apart(name, t, **view.tensors)
    check_apart("out", out, **inputs, **view.tensors)
    check_apart("debug_state", debug_state, out=out, **inputs, **view.tensors)
    return ACT_DTYPES[act]
