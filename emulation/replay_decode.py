"""ReplaySSM standard decode for Mamba-2 in Triton, with the checkpoint copies emulated in fp32.

One call of `mamba2_replay_decode(cache, x, dt, A, B, C, D, z, dt_bias)` advances every slot
of the batch by one token, each slot at its own ring position `h - 1 = cursors[s]`:

    non-flush (h < L)   y = g_{0:h} (S_lo C) + sum_{j<h} g_{j+1:h} dt_j (B_j . C) x_j + D x
                        no state is formed or written
    flush     (h = L)   S_new = g_{0:L} S_hi + sum_{j<L} g_{j+1:L} dt_j x_j B_j^T     (fp32)
                        y = S_new C + D x                   (from the unrounded new state)
                        hi <- ROUND_hi(S_new)   fp32 exact, or e.g. fp16 SR with the draws
                                                random_words(seed, s, flushes[s], element,
                                                sr_bits, philox_rounds)
                        lo <- RN_lo(S_new)      any lowprec format, scales as lowprec computes
                        the ring restarts (cursors[s] = 0), flushes[s] += 1

`y` is then multiplied by `silu(z)` if `z` is given; `g_{i:h} = exp(A * sum_{l=i..h-1} dt_l)`
uses cumulative sums of the ring's `dt` (`lowprec.mamba2`'s order of operations). The slot's
index in the batch is its Philox slot id.

The copies live in fp32 containers holding values exactly representable in their format (the
hi copy may instead be a tensor of the format's own dtype, e.g. float16): `lo` holds the
dequantised read copy `(code * s_b) * s_g`, `lo_scales` the block scales and `lo_global` nvfp4's
second-level scale, so `emulation.numerics.codes_of` + `lowprec.quantize.pack` give the bytes a
packed kernel stores. The ring and cursors follow DESIGN.md (`emulation/README.md` has the
layouts).

Two launches on the current stream, so that no program reads what another writes:

    _mamba2_replay_decode_kernel   grid (nheads, slots): reads the copies and the ring (the
                                   current record comes from the inputs), writes y and, on flush
                                   rows, the copies (and `debug_state`, the unrounded S_new)
    _mamba2_append_kernel          grid (slots,): appends the records to the ring and moves
                                   `cursors` / `flushes`
"""

# emulation.numerics comes first: without CUDA it switches Triton's interpreter on, which has to
# happen before triton is first imported.
from emulation.numerics import check_kernel_format, format_spec, quantize_tile, random_words  # noqa: I001
import contextlib
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from lowprec import formats, philox
from lowprec._checks import bytes_overlap
from lowprec import quantize as lq
from lowprec.replay import check_counter_ranges

__all__ = ["ReplayCache", "mamba2_replay_decode"]

HI_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUNDINGS = ("rn", "sr")


# --------------------------------------------------------------------------------------------
# config


@dataclass
class ReplayCache:
    """The ReplaySSM cache of a batch of slots, in emulation containers.

    Tensors (all on one device, contiguous):
        hi         fp32 (or hi_format's dtype)  [slots, nheads, headdim, dstate]  recurrence copy
        lo         fp32                         [slots, nheads, headdim, dstate]  read copy
        lo_scales  fp32 [slots, nheads, headdim, dstate // block]   block formats, else None
        lo_global  fp32 [slots, nheads]                              nvfp4, else None
        ring_x     act dtype [slots, nheads, Lcap, headdim]
        ring_dt    fp32      [slots, nheads, Lcap]          dt after dt_bias and softplus
        ring_B     act dtype [slots, ngroups, Lcap, dstate]
        cursors    int32 [slots]   records held before this step (committed records, h)
        flushes    int32 [slots]   checkpoint writes so far (the Philox flush counter)

    Config: `hi_format` / `hi_rounding` (an element format of at most 32 bits, 'rn' or 'sr'),
    `lo_format` (any lowprec format but fp64; always RN), `window` L, `draft` T (speculative
    decoding; Lcap = L + T), the Philox `seed`, and SR's `sr_bits` (random bits per element,
    8, 13, 16 or 32) and `philox_rounds` (1..10), both left at the defaults (16, 7) for an RN copy
    (docs/design.md, "Stochastic rounding: random bits and Philox rounds").
    """

    hi: torch.Tensor
    lo: torch.Tensor
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
    draft: int = 0
    seed: int = 0
    sr_bits: int = philox.DEFAULT_SR_BITS
    philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS
    # speculative decoding (host side): a mamba2_replay_verify awaits its mamba2_replay_commit
    pending: bool = False

    @classmethod
    def empty(
        cls,
        slots: int,
        nheads: int,
        headdim: int,
        dstate: int,
        *,
        ngroups: int = 1,
        window: int = 16,
        draft: int = 0,
        hi_format: str = "fp16",
        hi_rounding: str = "sr",
        lo_format: str = "nvfp4",
        seed: int = 0,
        hi_dtype: torch.dtype = torch.float32,
        act_dtype: torch.dtype = torch.bfloat16,
        device=None,
        sr_bits: int = philox.DEFAULT_SR_BITS,
        philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
    ) -> "ReplayCache":
        """A cache at the zero state with empty rings (ring entries NaN, so that a read of an
        unwritten record shows)."""
        sr_bits, philox_rounds = check_empty_args(
            (("slots", slots, 0), ("nheads", nheads, 1), ("headdim", headdim, 1),
             ("dstate", dstate, 1), ("ngroups", ngroups, 1), ("window", window, 1),
             ("draft", draft, 0)), hi_rounding, sr_bits, philox_rounds, act_dtype)
        shared = empty_fields(slots, nheads, headdim, dstate, hi_dtype, device,
                              hi_format=hi_format, hi_rounding=hi_rounding, lo_format=lo_format,
                              window=window, draft=draft, seed=seed, sr_bits=sr_bits,
                              philox_rounds=philox_rounds)
        lcap = window + draft
        nan = float("nan")
        cache = cls(
            ring_x=torch.full((slots, nheads, lcap, headdim), nan, dtype=act_dtype, device=device),
            ring_dt=torch.full((slots, nheads, lcap), nan, dtype=torch.float32, device=device),
            ring_B=torch.full((slots, ngroups, lcap, dstate), nan, dtype=act_dtype, device=device),
            **shared,
        )
        check_cache(cache)
        return cache

    @property
    def shape(self):
        """(slots, nheads, headdim, dstate, ngroups, Lcap)."""
        slots, nheads, headdim, dstate = self.hi.shape
        return slots, nheads, headdim, dstate, self.ring_B.shape[1], self.ring_x.shape[2]


def check_empty_args(sizes, hi_rounding, sr_bits, philox_rounds, act_dtype) -> tuple[int, int]:
    """The checks of a cache's `empty` before anything is allocated: `sizes` (name, value,
    least value) are ints, the SR parameters fit `hi_rounding` (returned as ints), `act_dtype`
    is an activation dtype."""
    for name, value, low in sizes:
        _expect_int(name, value, low)
    sr_bits, philox_rounds = philox.check_sr_settings(sr_bits, philox_rounds, hi_rounding,
                                                      "hi_rounding")
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"act_dtype: expected one of {list(ACT_DTYPES)}, got {act_dtype}")
    return sr_bits, philox_rounds


def zero_block_scale(fmt) -> float:
    """The block scale lowprec stores for an all-zero block of block format `fmt`: 0, except
    mxfp4's 2^-127 (E8M0 byte 0x00; a 0 there packs as byte 126, the scale 0.5)."""
    return lq.quantize(torch.zeros(1, fmt.block_length((1, 1 << 10))), fmt).scales.item()


def _expect(name, t, shape, dtypes, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor {list(shape)}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {list(dtypes)}, got {t.dtype}")
    check_device(name, t, device)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_device(name, t, device) -> None:
    """ValueError unless tensor `t` is on `device` and holds data: a meta tensor (no storage;
    Triton would read nothing and the ring's records would be lost) and a tensor on another
    device than the cache are refused by name."""
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")


def check_switch(name, value) -> None:
    """ValueError unless `value` is a bool (a word such as "false" read with bool() is on)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def check_out_apart(output, name="out", /, **inputs) -> None:
    """ValueError if `output` (named `name`) shares bytes with an input (None entries skipped): the
    kernels read inputs after writing their outputs (decode and verify append x to the ring
    after y is stored, a flush reads the state it rewrites), so `out=x` stored y as the record.
    Byte ranges are compared, as cute_kernels._compile.check_apart does, so two disjoint
    slices of one buffer are accepted (every tensor here is checked contiguous first)."""
    for other_name, other in inputs.items():
        if isinstance(other, torch.Tensor) and bytes_overlap(output, other):
            raise ValueError(f"{name}: expected a tensor that shares no memory with the inputs, "
                             f"got one that shares {other_name}'s")


def check_inputs_apart(cache, /, **inputs) -> None:
    """ValueError if an input (None entries skipped) shares bytes with a tensor of `cache`: a
    call writes the cache (the ring's append, a flush's copies, the counters) while its
    programs still read the inputs, so an input over the cache's bytes reads what another
    program wrote (`x` over `cache.hi` on a flush step would change y and the ring)."""
    tensors = cache_tensors(cache)
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            continue
        for cache_name, other in tensors.items():
            if bytes_overlap(t, other):
                raise ValueError(f"{name}: expected a tensor that shares no memory with the "
                                 f"cache, got one that shares {cache_name}'s")


def check_cache_apart(cache) -> None:
    """ValueError if two tensors of `cache` share bytes (a flush writes one copy while it reads
    the other, a ring's append would overwrite a copy)."""
    tensors = list(cache_tensors(cache).items())
    for i, (name, t) in enumerate(tensors):
        for other_name, other in tensors[i + 1:]:
            if bytes_overlap(t, other):
                raise ValueError(f"{name}: expected a tensor that shares no memory with the "
                                 f"cache's other tensors, got one that shares {other_name}'s")


def cache_tensors(cache) -> dict:
    """The named tensors of a cache dataclass (ReplayCache, StateCache, GDNReplayCache), for
    the checks of aliasing."""
    return {f"cache.{field.name}": getattr(cache, field.name)
            for field in fields(cache)
            if isinstance(getattr(cache, field.name), torch.Tensor)}


def _expect_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
        high is not None and value >= high
    ):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected an int {bound}, got {value!r}")


def check_copies(cache, rows: str, cols: str) -> tuple:
    """ValueError unless the checkpoint copies of `cache` (hi, lo, lo_scales, lo_global) and
    its window, draft, seed, formats and SR parameters have the layout of its docstring, the
    state [slots, nheads, `rows`, `cols`]; returns (slots, nheads, rows, cols, device)."""
    hi = cache.hi
    if not isinstance(hi, torch.Tensor) or hi.dim() != 4:
        got = list(hi.shape) if isinstance(hi, torch.Tensor) else type(hi).__name__
        raise ValueError(f"cache.hi: expected shape [slots, nheads, {rows}, {cols}], got {got}")
    slots, nheads, n_rows, n_cols = hi.shape
    device = hi.device
    if min(nheads, n_rows, n_cols) < 1:
        raise ValueError(f"cache.hi: expected nheads, {rows} and {cols} >= 1, got "
                         f"{list(hi.shape)}")
    _expect_int("cache.window", cache.window, 1)
    _expect_int("cache.draft", cache.draft, 0, cache.window + 1)
    _expect_int("cache.seed", cache.seed, 0, 1 << 64)
    if slots >= 1 << 20:
        raise ValueError(f"cache.hi: expected fewer than 2^20 slots (Philox slot id), got {slots}")
    if nheads * n_rows * n_cols > 1 << 24:
        raise ValueError(
            f"cache.hi: expected at most 2^24 state elements per slot (Philox element index), "
            f"got {nheads * n_rows * n_cols}"
        )
    hi_fmt = check_kernel_format("cache.hi_format", cache.hi_format)
    if hi_fmt.block is not None:
        raise ValueError(
            f"cache.hi_format: expected an element format (no block scales), got {hi_fmt.name!r}"
        )
    if cache.hi_rounding not in ROUNDINGS:
        raise ValueError(f"cache.hi_rounding: expected 'rn' or 'sr', got {cache.hi_rounding!r}")
    philox.check_sr_settings(cache.sr_bits, cache.philox_rounds, cache.hi_rounding,
                             "hi_rounding", "cache.")
    hi_dtypes = {torch.float32, HI_DTYPES.get(hi_fmt.name, torch.float32)}
    _expect("cache.hi", hi, hi.shape, hi_dtypes, device)
    lo_fmt = check_kernel_format("cache.lo_format", cache.lo_format, n_cols)
    _expect("cache.lo", cache.lo, hi.shape, (torch.float32,), device)
    if lo_fmt.block is not None:
        n_blocks = n_cols // lo_fmt.block_length((n_rows, n_cols))
        _expect("cache.lo_scales", cache.lo_scales, (slots, nheads, n_rows, n_blocks),
                (torch.float32,), device)
    elif cache.lo_scales is not None:
        raise ValueError(f"cache.lo_scales: expected None for {lo_fmt.name!r}, got a tensor")
    if lo_fmt.two_level:
        _expect("cache.lo_global", cache.lo_global, (slots, nheads), (torch.float32,), device)
    elif cache.lo_global is not None:
        raise ValueError(f"cache.lo_global: expected None for {lo_fmt.name!r}, got a tensor")
    return slots, nheads, n_rows, n_cols, device


def empty_fields(slots, nheads, rows, cols, hi_dtype, device, **config) -> dict:
    """The fields every replay cache has, at the zero state: the copies (fp32 containers, hi in
    `hi_dtype`, the block scales lowprec stores for a zero block), zero cursors and flush
    counters, and `config` (hi_format, hi_rounding, lo_format (stored as the format's name),
    window, draft, seed, sr_bits, philox_rounds)."""
    lo_fmt = check_kernel_format("lo_format", config["lo_format"], cols)
    scales, global_scale = empty_scales(lo_fmt, slots, nheads, rows, cols, device)
    counters = dict(dtype=torch.int32, device=device)
    return dict(
        config,
        hi=torch.zeros(slots, nheads, rows, cols, dtype=hi_dtype, device=device),
        lo=torch.zeros(slots, nheads, rows, cols, dtype=torch.float32, device=device),
        lo_scales=scales,
        lo_global=global_scale,
        cursors=torch.zeros(slots, **counters),
        flushes=torch.zeros(slots, **counters),
        lo_format=lo_fmt.name,
    )


def empty_scales(fmt, slots, nheads, rows, cols, device) -> tuple:
    """(block scales, global scales) of a zero state stored in `fmt`, fp32 (None where `fmt`
    has none)."""
    f32 = dict(dtype=torch.float32, device=device)
    scales = global_scale = None
    if fmt.block is not None:
        n_blocks = cols // fmt.block_length((rows, cols))
        scales = torch.full((slots, nheads, rows, n_blocks), zero_block_scale(fmt), **f32)
    if fmt.two_level:
        global_scale = torch.zeros(slots, nheads, **f32)
    return scales, global_scale


def check_cache(cache: ReplayCache) -> None:
    """ValueError unless every tensor of `cache` has the layout of its docstring."""
    if not isinstance(cache, ReplayCache):
        raise ValueError(f"cache: expected a ReplayCache, got {type(cache).__name__}")
    slots, nheads, headdim, dstate, device = check_copies(cache, "headdim", "dstate")
    rx = cache.ring_x
    if not isinstance(rx, torch.Tensor) or rx.dim() != 4:
        raise ValueError("cache.ring_x: expected shape [slots, nheads, Lcap, headdim]")
    lcap = cache.window + cache.draft
    _expect("cache.ring_x", rx, (slots, nheads, lcap, headdim), ACT_DTYPES, device)
    _expect("cache.ring_dt", cache.ring_dt, (slots, nheads, lcap), (torch.float32,), device)
    rb = cache.ring_B
    if not isinstance(rb, torch.Tensor) or rb.dim() != 4:
        raise ValueError("cache.ring_B: expected shape [slots, ngroups, Lcap, dstate]")
    ngroups = rb.shape[1]
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"cache.ring_B: expected ngroups dividing nheads={nheads}, got {ngroups}")
    _expect("cache.ring_B", rb, (slots, ngroups, lcap, dstate), (rx.dtype,), device)
    check_counters_apart(cache, slots, device)


def check_counters_apart(cache, slots, device) -> None:
    """ValueError unless `cache.cursors` and `cache.flushes` are int32 [slots] on `device` and
    no two tensors of `cache` share bytes (the last checks of a replay cache)."""
    _expect("cache.cursors", cache.cursors, (slots,), (torch.int32,), device)
    _expect("cache.flushes", cache.flushes, (slots,), (torch.int32,), device)
    check_cache_apart(cache)


def check_step_inputs(cache, x, dt, A, B, C, D, z, dt_bias, ndraft=None):
    """ValueError unless the token inputs match the cache (`ndraft`: a T dim after heads)."""
    check_cache(cache)
    slots, nheads, headdim, dstate, ngroups, _ = cache.shape
    device = cache.hi.device
    act = (cache.ring_x.dtype,)
    f32 = (torch.float32,)
    t = () if ndraft is None else (ndraft,)
    _expect("x", x, (slots, nheads, *t, headdim), act, device)
    _expect("dt", dt, (slots, nheads, *t), f32, device)
    _expect("A", A, (nheads,), f32, device)
    _expect("B", B, (slots, ngroups, *t, dstate), act, device)
    _expect("C", C, (slots, ngroups, *t, dstate), act, device)
    for name, tensor, shape in (
        ("D", D, (nheads,)),
        ("z", z, (slots, nheads, *t, headdim)),
        ("dt_bias", dt_bias, (nheads,)),
    ):
        if tensor is not None:
            _expect(name, tensor, shape, act if name == "z" else f32, device)
    check_inputs_apart(cache, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)


def check_outputs(cache, out, debug_state, inputs, y_shape, out_dtype, state=None):
    """Allocate `out` if None and check `out` / `debug_state` (shape, dtype, device, apart from
    the `inputs` and the cache; `debug_state` shaped as `state`, default `cache.hi`); returns
    `out`."""
    state = cache.hi if state is None else state
    if out is None:
        out = torch.empty(y_shape, dtype=out_dtype, device=state.device)
    _expect("out", out, y_shape, ACT_DTYPES, state.device)
    inputs = dict(inputs, **cache_tensors(cache))
    check_out_apart(out, **inputs)
    if debug_state is not None:
        _expect("debug_state", debug_state, state.shape, (torch.float32,), state.device)
        check_out_apart(debug_state, "debug_state", out=out, **inputs)
    return out


def check_cursors(cache, low: int, high: int) -> None:
    """ValueError unless every slot's committed records `cursors` lie in [low, high] and the
    flush counters fit Philox's 20 bits (lowprec.replay.check_counter_ranges, shared with the
    CuTe kernels; one host read of four numbers: a stream sync)."""
    check_counter_ranges(cache.cursors, cache.flushes, low, high, "ring capacity", "cache.")


def launch_config(headdim: int, dstate: int, lcap: int) -> dict:
    """Tile sizes: the whole state of one (slot, head) per program, so that nvfp4's per-state
    amax is a register reduction. Every dim is padded to 16 at least, tl.dot's minimum."""
    bv = max(16, triton.next_power_of_2(headdim))
    bk = max(16, triton.next_power_of_2(dstate))
    return dict(
        BV=bv,
        BK=bk,
        BL=max(16, triton.next_power_of_2(lcap)),
        num_warps=4 if bv * bk <= 4096 else 8,
    )


# --------------------------------------------------------------------------------------------
# device functions shared with replay_spec.py and state_update.py


@triton.jit
def process_dt(dt, dt_bias, DT_SOFTPLUS: tl.constexpr):
    """softplus(dt + dt_bias) as torch computes it: x above 20, else log1p(exp(x)).

    log1p(u) = log(1 + u) * u / ((1 + u) - 1) (Goldberg's correction; the interpreter has no
    libdevice log1p) keeps the relative error at a few ulps for small u.
    """
    dt = dt + dt_bias
    if DT_SOFTPLUS:
        u = tl.exp(dt)
        w = 1.0 + u
        log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        dt = tl.where(dt > 20.0, dt, log1p)
    return dt


@triton.jit
def gate_output(b_y, b_x, D, b_z, HAS_Z: tl.constexpr):
    """y + D x, times silu(z) if HAS_Z (D is 0 when absent)."""
    b_y = b_y + D * b_x
    if HAS_Z:
        b_y = b_y * (b_z * tl.sigmoid(b_z))
    return b_y


@triton.jit
def tile_offsets(rows, cols, BV: tl.constexpr, BK: tl.constexpr):
    """`(o_v [BV], o_k [BK], m_v [BV], m_vk [BV, BK], o_vk [BV, BK])`: the row and column
    indices of a [rows, cols] state tile padded to [BV, BK], their masks and element offsets."""
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_v = o_v < rows
    return o_v, o_k, m_v, m_v[:, None] & (o_k[None, :] < cols), o_v[:, None] * cols + o_k[None, :]


@triton.jit
def store_tile(
    b_S, p_S, p_scales, p_global, p_debug, seed, i_s, i_h, counter, rows, cols, n_blocks,
    F: tl.constexpr, USE_SR: tl.constexpr, SR_BITS: tl.constexpr, ROUNDS: tl.constexpr,
    HAS_DEBUG: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
):
    """Round the fp32 state tile `b_S [BV, BK]` of (slot i_s, head i_h) to format F and store
    it with its block and second-level scales; returns the stored (dequantised) tile.

    SR draws SR_BITS bits from ROUNDS-round Philox at (seed, slot, `counter`, element); with
    HAS_DEBUG the unrounded tile goes to `p_debug` first. Pointers are the (slot, head) bases
    of [rows, cols] (scales [rows, n_blocks], the global scale one word).
    """
    o_v, _, m_v, m_vk, o_vk = tile_offsets(rows, cols, BV, BK)
    if HAS_DEBUG:
        tl.store(p_debug + o_vk, b_S, mask=m_vk)
    if USE_SR:
        b_r = random_words(seed, i_s, counter, i_h * rows * cols + o_vk, SR_BITS, ROUNDS)
    else:
        b_r = o_vk
    b_st, b_scale, s_g = quantize_tile(b_S, b_r, F, USE_SR, BV, BK, SR_BITS)
    tl.store(p_S + o_vk, b_st.to(p_S.dtype.element_ty), mask=m_vk)
    if F.block != 0:
        NB: tl.constexpr = BK // (BK if F.block == -1 else F.block)
        o_b = tl.arange(0, NB)
        m_b = m_v[:, None] & (o_b[None, :] < n_blocks)
        tl.store(p_scales + o_v[:, None] * n_blocks + o_b[None, :], b_scale, mask=m_b)
    if F.two_level:
        tl.store(p_global, s_g)
    return b_st


@triton.jit
def store_copies(
    b_S, p_hi, p_lo, p_lo_scales, p_lo_global, p_debug, i_sh,
    seed, i_s, i_h, flush, rows, cols, n_blocks,
    HI: tl.constexpr, HI_SR: tl.constexpr, SR_BITS: tl.constexpr, ROUNDS: tl.constexpr,
    LO: tl.constexpr, HAS_DEBUG: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
):
    """Write both copies of the state of (slot, head) row `i_sh` from the unrounded fp32
    `b_S [BV, BK]`: hi ROUND_hi (SR draws at flush counter `flush`), lo RN_lo with its scales.
    Pointers are the cache's bases ([slots, nheads, rows, cols] states)."""
    p_state = i_sh * rows * cols
    # hi is an element format: its scale pointers are never written
    store_tile(b_S, p_hi + p_state, p_lo_scales, p_lo_global, p_debug + p_state, seed, i_s, i_h,
               flush, rows, cols, n_blocks, HI, HI_SR, SR_BITS, ROUNDS, HAS_DEBUG, BV, BK)
    store_tile(b_S, p_lo + p_state, p_lo_scales + i_sh * rows * n_blocks, p_lo_global + i_sh,
               p_debug, seed, i_s, i_h, flush, rows, cols, n_blocks, LO, False, SR_BITS, ROUNDS,
               False, BV, BK)


# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _mamba2_replay_decode_kernel(
    p_hi, p_lo, p_lo_scales, p_lo_global,
    p_ring_x, p_ring_dt, p_ring_B, p_cursors, p_flushes,
    p_x, p_dt, p_A, p_B, p_C, p_D, p_z, p_dt_bias, p_y, p_debug,
    seed, nheads, headdim, dstate, ngroups, lcap, window, n_blocks,
    HI: tl.constexpr, HI_SR: tl.constexpr, SR_BITS: tl.constexpr, ROUNDS: tl.constexpr,
    LO: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DEBUG: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
):
    i_h = tl.program_id(0)
    i_s = tl.program_id(1).to(tl.int64)
    i_g = i_h // (nheads // ngroups)
    i_sh = i_s * nheads + i_h  # (slot, head) row
    i_sg = i_s * ngroups + i_g
    cursor = tl.load(p_cursors + i_s)  # this record's ring position; h = cursor + 1 held after
    flush = tl.load(p_flushes + i_s)

    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_l = tl.arange(0, BL)
    m_v = o_v < headdim
    m_k = o_k < dstate
    m_vk = m_v[:, None] & m_k[None, :]
    o_vk = o_v[:, None] * dstate + o_k[None, :]  # [BV, BK]

    # the current record and query, in fp32
    b_x = tl.load(p_x + i_sh * headdim + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
    b_B = tl.load(p_B + i_sg * dstate + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    b_C = tl.load(p_C + i_sg * dstate + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    A = tl.load(p_A + i_h)
    dt_bias = tl.load(p_dt_bias + i_h) if HAS_DT_BIAS else 0.0
    dt = process_dt(tl.load(p_dt + i_sh), dt_bias, DT_SOFTPLUS)

    # the ring: records 0..cursor-1 from memory, record `cursor` from the inputs (never past
    # the slot's ring: with check_counters=False a cursor out of range must not read others')
    m_l = (o_l < cursor) & (o_l < lcap)
    p_rx = p_ring_x + (i_sh * lcap + o_l[:, None]) * headdim + o_v[None, :]
    b_rx = tl.load(p_rx, mask=m_l[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BL, BV]
    p_rB = p_ring_B + (i_sg * lcap + o_l[:, None]) * dstate + o_k[None, :]
    b_rB = tl.load(p_rB, mask=m_l[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BL, BK]
    b_rdt = tl.load(p_ring_dt + i_sh * lcap + o_l, mask=m_l, other=0.0)  # [BL]
    is_now = o_l == cursor
    b_rx = tl.where(is_now[:, None], b_x[None, :], b_rx)
    b_rB = tl.where(is_now[:, None], b_B[None, :], b_rB)
    b_rdt = tl.where(is_now, dt, b_rdt)

    # decays: g_{j+1:h} dt_j from cumulative sums of dt (0 past the current record)
    b_cum = tl.cumsum(b_rdt, axis=0)  # [BL]
    cum_h = tl.sum(b_rdt, axis=0)
    g_ckpt = tl.exp(A * cum_h)
    b_w = tl.where(o_l <= cursor, tl.exp(A * (cum_h - b_cum)) * b_rdt, 0.0)  # [BL]

    if cursor == window - 1:
        # flush: fold the L records into the recurrence copy, read y from the new state
        b_hi = tl.load(p_hi + i_sh * headdim * dstate + o_vk, mask=m_vk, other=0.0)
        b_xw = tl.trans(b_rx * b_w[:, None])  # [BV, BL]
        b_S = g_ckpt * b_hi.to(tl.float32) + tl.dot(b_xw, b_rB, input_precision="ieee")
        b_y = tl.sum(b_S * b_C[None, :], axis=1)  # [BV]
        store_copies(b_S, p_hi, p_lo, p_lo_scales, p_lo_global, p_debug, i_sh, seed, i_s, i_h,
                     flush, headdim, dstate, n_blocks, HI, HI_SR, SR_BITS, ROUNDS, LO, HAS_DEBUG,
                     BV, BK)
    else:
        # non-flush: the read copy and the ring, no state
        b_lo = tl.load(p_lo + i_sh * headdim * dstate + o_vk, mask=m_vk, other=0.0)
        b_BC = tl.sum(b_rB * b_C[None, :], axis=1)  # [BL]
        b_y = g_ckpt * tl.sum(b_lo * b_C[None, :], axis=1)
        b_y += tl.sum(b_rx * (b_w * b_BC)[:, None], axis=0)  # [BV]

    D = tl.load(p_D + i_h) if HAS_D else 0.0
    b_z = tl.load(p_z + i_sh * headdim + o_v, mask=m_v, other=0.0).to(tl.float32) if HAS_Z else b_x
    b_y = gate_output(b_y, b_x, D, b_z, HAS_Z)
    tl.store(p_y + i_sh * headdim + o_v, b_y.to(p_y.dtype.element_ty), mask=m_v)


@triton.jit
def _mamba2_append_kernel(
    p_ring_x, p_ring_dt, p_ring_B, p_cursors, p_flushes,
    p_x, p_dt, p_B, p_dt_bias,
    nheads, headdim, dstate, ngroups, lcap, window,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    BH: tl.constexpr, BG: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
):
    """Append slot i_s's record at ring position cursors[i_s]; then h = cursor + 1 records
    are held, and the slot flushed iff h == L (cursor back to 0, one more checkpoint write)."""
    i_s = tl.program_id(0).to(tl.int64)
    cursor = tl.load(p_cursors + i_s)
    in_ring = (cursor >= 0) & (cursor < lcap)  # check_counters=False: stores stay in the ring
    o_h = tl.arange(0, BH)
    o_g = tl.arange(0, BG)
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_h = (o_h < nheads) & in_ring
    m_hv = m_h[:, None] & (o_v[None, :] < headdim)
    m_gk = (o_g[:, None] < ngroups) & (o_k[None, :] < dstate) & in_ring

    b_x = tl.load(p_x + (i_s * nheads + o_h[:, None]) * headdim + o_v[None, :], mask=m_hv)
    p_rx = p_ring_x + ((i_s * nheads + o_h[:, None]) * lcap + cursor) * headdim + o_v[None, :]
    tl.store(p_rx, b_x, mask=m_hv)  # [BH, BV]
    b_dt_bias = tl.load(p_dt_bias + o_h, mask=m_h, other=0.0) if HAS_DT_BIAS else 0.0
    b_dt = process_dt(tl.load(p_dt + i_s * nheads + o_h, mask=m_h, other=0.0), b_dt_bias,
                      DT_SOFTPLUS)
    tl.store(p_ring_dt + (i_s * nheads + o_h) * lcap + cursor, b_dt, mask=m_h)  # [BH]
    b_B = tl.load(p_B + (i_s * ngroups + o_g[:, None]) * dstate + o_k[None, :], mask=m_gk)
    p_rB = p_ring_B + ((i_s * ngroups + o_g[:, None]) * lcap + cursor) * dstate + o_k[None, :]
    tl.store(p_rB, b_B, mask=m_gk)  # [BG, BK]

    is_flush = cursor == window - 1
    tl.store(p_cursors + i_s, tl.where(is_flush, 0, cursor + 1))
    tl.store(p_flushes + i_s, tl.load(p_flushes + i_s) + is_flush.to(tl.int32))


# --------------------------------------------------------------------------------------------
# public function


def mamba2_replay_decode(
    cache: ReplayCache,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    *,
    dt_softplus: bool = True,
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
    check_counters: bool = True,
) -> torch.Tensor:
    """Advance every slot of `cache` by one token (module docstring); returns y.

    Shapes: x, z [slots, nheads, headdim] and B, C [slots, ngroups, dstate] in the ring's
    activation dtype; dt [slots, nheads], A, D, dt_bias [nheads] in fp32 (dt raw: dt_bias and
    softplus are applied here). `out` [slots, nheads, headdim] (fp32, fp16 or bf16; default
    x's dtype). `debug_state` fp32 [slots, nheads, headdim, dstate]: receives the unrounded new
    state at flush rows and is untouched elsewhere. Launches on the current stream.
    `check_counters=False` skips the range check of the cursors and flush counters, the one
    check that reads the device (a stream sync): for a loop that advances every slot in
    lockstep, whose cursors therefore stay in range by construction (a cursor out of range
    then gives meaningless outputs, but every ring access stays within its slot's ring).
    `out` must share no memory with the inputs (x is appended to the ring after y is
    written).
    """
    if isinstance(cache, ReplayCache) and cache.draft != 0:
        raise ValueError(
            f"cache.draft: expected 0 for standard decoding, got {cache.draft} (use replay_spec)"
        )
    check_step_inputs(cache, x, dt, A, B, C, D, z, dt_bias)
    check_switch("dt_softplus", dt_softplus)
    check_switch("check_counters", check_counters)
    slots, nheads, headdim, dstate, ngroups, lcap = cache.shape
    if check_counters:
        check_cursors(cache, 0, cache.window - 1)
    device = cache.hi.device
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    out = check_outputs(cache, out, debug_state, inputs, (slots, nheads, headdim), x.dtype)
    if slots == 0:
        return out

    cfg = launch_config(headdim, dstate, lcap)
    lo_fmt = formats.get(cache.lo_format)
    n_blocks = cache.lo_scales.shape[-1] if cache.lo_scales is not None else 1
    unused = cache.lo  # stands in for absent optional tensors (never read: flags are off)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _mamba2_replay_decode_kernel[(nheads, slots)](
            cache.hi, cache.lo,
            cache.lo_scales if cache.lo_scales is not None else unused,
            cache.lo_global if cache.lo_global is not None else unused,
            cache.ring_x, cache.ring_dt, cache.ring_B, cache.cursors, cache.flushes,
            x, dt, A, B, C,
            D if D is not None else A, z if z is not None else x,
            dt_bias if dt_bias is not None else A, out,
            debug_state if debug_state is not None else unused,
            cache.seed, nheads, headdim, dstate, ngroups, lcap, cache.window, n_blocks,
            HI=format_spec(cache.hi_format), HI_SR=cache.hi_rounding == "sr",
            SR_BITS=cache.sr_bits, ROUNDS=cache.philox_rounds, LO=format_spec(lo_fmt),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus), HAS_DEBUG=debug_state is not None,
            **cfg,
        )
        _mamba2_append_kernel[(slots,)](
            cache.ring_x, cache.ring_dt, cache.ring_B, cache.cursors, cache.flushes,
            x, dt, B, dt_bias if dt_bias is not None else A,
            nheads, headdim, dstate, ngroups, lcap, cache.window,
            HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
            BH=triton.next_power_of_2(nheads), BG=triton.next_power_of_2(ngroups),
            BV=triton.next_power_of_2(headdim), BK=triton.next_power_of_2(dstate),
        )
    return out

