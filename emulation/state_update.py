"""Conventional Mamba-2 decode step in Triton: the state is stored in a format every token.

The baseline that ReplaySSM is measured against (the `every_step` arm of the experiments,
`lowprec.policies` kind 'conventional'). One call advances every slot by one token:

    dt = softplus(dt + dt_bias)
    S  = ROUND(exp(dt A) S + dt x B^T)      any lowprec format, RN or SR, in registers (fp32)
    y  = S C + D x   [* silu(z)]            from the stored (rounded) state, as lowprec.policies
                                            defines the conventional arm (output_from='stored'),
                                            or from the unrounded one, as cute_kernels'
                                            state_update and mamba_ssm do ('unrounded')

SR draws are `random_words(seed, slot, tokens[slot], element, sr_bits, philox_rounds)`: the
per-slot token counter plays the flush counter's part, so each token's store uses fresh draws;
the call increments `tokens`.
The state lives in an fp32 container holding exactly representable values (or in the format's
own dtype, e.g. float16), with block scales and nvfp4's second-level scale in fp32 containers
beside it, as the ReplaySSM read copy in `replay_decode.py`.

One program per (head, slot) holds the whole state tile (nvfp4 needs the state's amax); the
token counter moves in a second launch (a tensor add) once every program has read it.
"""

# emulation.numerics comes first: without CUDA it switches Triton's interpreter on, which has to
# happen before triton is first imported.
from emulation.numerics import check_kernel_format, format_spec  # noqa: I001
import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from emulation.replay_decode import (
    ACT_DTYPES,
    HI_DTYPES,
    ROUNDINGS,
    _expect,
    _expect_int,
    check_cache_apart,
    check_inputs_apart,
    check_outputs,
    check_switch,
    gate_output,
    launch_config,
    process_dt,
    empty_scales,
    store_tile,
)
from lowprec import philox
from lowprec.replay import check_flush_field

__all__ = ["StateCache", "mamba2_state_update"]

OUTPUT_FROM = ("stored", "unrounded")


@dataclass
class StateCache:
    """A conventional decode state per slot, in emulation containers.

        state         fp32 (or format's dtype)  [slots, nheads, headdim, dstate]
        scales        fp32 [slots, nheads, headdim, dstate // block]   block formats, else None
        global_scale  fp32 [slots, nheads]                              nvfp4, else None
        tokens        int32 [slots]   tokens stored so far (the Philox counter of the next store)

    Config: `format` (any lowprec format but fp64), `rounding` ('rn' or 'sr'), Philox `seed`,
    and SR's `sr_bits` (8, 13, 16, 32) and `philox_rounds` (1..10), the defaults (16, 7) for RN.
    """

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
    def empty(
        cls,
        slots: int,
        nheads: int,
        headdim: int,
        dstate: int,
        *,
        format: str = "fp16",
        rounding: str = "rn",
        seed: int = 0,
        state_dtype: torch.dtype = torch.float32,
        device=None,
        sr_bits: int = philox.DEFAULT_SR_BITS,
        philox_rounds: int = philox.DEFAULT_PHILOX_ROUNDS,
    ) -> "StateCache":
        """A zero state with its token counters at 0."""
        for name, value, low in (("slots", slots, 0), ("nheads", nheads, 1),
                                 ("headdim", headdim, 1), ("dstate", dstate, 1)):
            _expect_int(name, value, low)  # before anything is allocated
        sr_bits, philox_rounds = philox.check_sr_settings(sr_bits, philox_rounds, rounding,
                                                          "rounding")
        fmt = check_kernel_format("format", format, dstate)
        scales, global_scale = empty_scales(fmt, slots, nheads, headdim, dstate, device)
        cache = cls(
            state=torch.zeros(slots, nheads, headdim, dstate, dtype=state_dtype, device=device),
            scales=scales,
            global_scale=global_scale,
            tokens=torch.zeros(slots, dtype=torch.int32, device=device),
            format=fmt.name,
            rounding=rounding,
            seed=seed,
            sr_bits=sr_bits,
            philox_rounds=philox_rounds,
        )
        check_state_cache(cache)
        return cache


def check_state_cache(cache: StateCache) -> None:
    """ValueError unless every tensor of `cache` has the layout of its docstring."""
    if not isinstance(cache, StateCache):
        raise ValueError(f"cache: expected a StateCache, got {type(cache).__name__}")
    state = cache.state
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        got = list(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(
            f"cache.state: expected shape [slots, nheads, headdim, dstate], got {got}"
        )
    slots, nheads, headdim, dstate = state.shape
    device = state.device
    if min(nheads, headdim, dstate) < 1:
        raise ValueError(f"cache.state: expected nheads, headdim and dstate >= 1, got "
                         f"{list(state.shape)}")
    fmt = check_kernel_format("cache.format", cache.format, dstate)
    if cache.rounding not in ROUNDINGS:
        raise ValueError(f"cache.rounding: expected 'rn' or 'sr', got {cache.rounding!r}")
    philox.check_sr_settings(cache.sr_bits, cache.philox_rounds, cache.rounding, "rounding",
                             "cache.")
    _expect_int("cache.seed", cache.seed, 0, 1 << 64)
    if slots >= 1 << 20 or nheads * headdim * dstate > 1 << 24:
        raise ValueError(
            f"cache.state: expected < 2^20 slots and <= 2^24 elements per slot (Philox "
            f"indexing), got shape {list(state.shape)}"
        )
    _expect("cache.state", state, state.shape,
            {torch.float32, HI_DTYPES.get(fmt.name, torch.float32)}, device)
    if fmt.block is not None:
        n_blocks = dstate // fmt.block_length((headdim, dstate))
        _expect("cache.scales", cache.scales, (slots, nheads, headdim, n_blocks),
                (torch.float32,), device)
    elif cache.scales is not None:
        raise ValueError(f"cache.scales: expected None for {fmt.name!r}, got a tensor")
    if fmt.two_level:
        _expect("cache.global_scale", cache.global_scale, (slots, nheads), (torch.float32,),
                device)
    elif cache.global_scale is not None:
        raise ValueError(f"cache.global_scale: expected None for {fmt.name!r}, got a tensor")
    _expect("cache.tokens", cache.tokens, (slots,), (torch.int32,), device)
    check_cache_apart(cache)


def check_state_outputs(cache, inputs, out, debug_state, y_shape, out_dtype, check_counters):
    """The last checks of a state update: `inputs` apart from the cache, the token counters'
    range (with `check_counters`), `out` (allocated if None) and `debug_state`; returns `out`."""
    check_inputs_apart(cache, **inputs)
    if check_counters:  # one host read (a stream sync) of the counters' range
        check_flush_field("cache.tokens", cache.tokens)
    return check_outputs(cache, out, debug_state, inputs, y_shape, out_dtype, cache.state)


@triton.jit
def _mamba2_state_update_kernel(
    p_state, p_scales, p_global, p_tokens,
    p_x, p_dt, p_A, p_B, p_C, p_D, p_z, p_dt_bias, p_y, p_debug,
    seed, nheads, headdim, dstate, ngroups, n_blocks,
    F: tl.constexpr, USE_SR: tl.constexpr, SR_BITS: tl.constexpr, ROUNDS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DEBUG: tl.constexpr, READ_STORED: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr,
):
    i_h = tl.program_id(0)
    i_s = tl.program_id(1).to(tl.int64)
    i_g = i_h // (nheads // ngroups)
    i_sh = i_s * nheads + i_h
    i_sg = i_s * ngroups + i_g
    token = tl.load(p_tokens + i_s)

    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_v = o_v < headdim
    m_k = o_k < dstate
    m_vk = m_v[:, None] & m_k[None, :]
    o_vk = o_v[:, None] * dstate + o_k[None, :]  # [BV, BK]
    p_S_base = p_state + i_sh * headdim * dstate

    b_x = tl.load(p_x + i_sh * headdim + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
    b_B = tl.load(p_B + i_sg * dstate + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    b_C = tl.load(p_C + i_sg * dstate + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    A = tl.load(p_A + i_h)
    dt_bias = tl.load(p_dt_bias + i_h) if HAS_DT_BIAS else 0.0
    dt = process_dt(tl.load(p_dt + i_sh), dt_bias, DT_SOFTPLUS)

    b_S = tl.load(p_S_base + o_vk, mask=m_vk, other=0.0).to(tl.float32)  # [BV, BK]
    b_S = tl.exp(dt * A) * b_S + (dt * b_x)[:, None] * b_B[None, :]
    b_q = store_tile(b_S, p_S_base, p_scales + i_sh * headdim * n_blocks, p_global + i_sh,
                     p_debug + i_sh * headdim * dstate, seed, i_s, i_h, token, headdim, dstate,
                     n_blocks, F, USE_SR, SR_BITS, ROUNDS, HAS_DEBUG, BV, BK)

    b_y = tl.sum((b_q if READ_STORED else b_S) * b_C[None, :], axis=1)  # [BV]
    D = tl.load(p_D + i_h) if HAS_D else 0.0
    b_z = tl.load(p_z + i_sh * headdim + o_v, mask=m_v, other=0.0).to(tl.float32) if HAS_Z else b_x
    b_y = gate_output(b_y, b_x, D, b_z, HAS_Z)
    tl.store(p_y + i_sh * headdim + o_v, b_y.to(p_y.dtype.element_ty), mask=m_v)


def mamba2_state_update(
    cache: StateCache,
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
    output_from: str = "stored",
    out: torch.Tensor | None = None,
    debug_state: torch.Tensor | None = None,
    check_counters: bool = True,
) -> torch.Tensor:
    """One conventional decode step of every slot (module docstring); returns y.

    Shapes: x, z [slots, nheads, headdim] and B, C [slots, ngroups, dstate] in one activation
    dtype (fp32, fp16 or bf16); dt [slots, nheads] (raw), A, D, dt_bias [nheads] in fp32.
    `out` [slots, nheads, headdim] (default x's dtype). `debug_state` fp32
    [slots, nheads, headdim, dstate] receives the unrounded new state. `output_from`: 'stored'
    or 'unrounded' (which state y reads). Launches on the current stream.
    `check_counters=False` skips the range check of `cache.tokens`, the one check that reads
    the device (a stream sync): for a loop that advances every slot in lockstep and knows the
    counters stay below 2^20 - 1 (experiments.error_growth on a GPU).
    """
    check_state_cache(cache)
    check_switch("dt_softplus", dt_softplus)
    check_switch("check_counters", check_counters)
    if output_from not in OUTPUT_FROM:
        raise ValueError(f"output_from: expected one of {OUTPUT_FROM}, got {output_from!r}")
    slots, nheads, headdim, dstate = cache.state.shape
    device = cache.state.device
    if not isinstance(B, torch.Tensor) or B.dim() != 3:
        raise ValueError("B: expected a tensor [slots, ngroups, dstate]")
    ngroups = B.shape[1]
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"B: expected ngroups dividing nheads={nheads}, got {ngroups}")
    _expect("x", x, (slots, nheads, headdim), ACT_DTYPES, device)
    act = (x.dtype,)
    f32 = (torch.float32,)
    _expect("dt", dt, (slots, nheads), f32, device)
    _expect("A", A, (nheads,), f32, device)
    _expect("B", B, (slots, ngroups, dstate), act, device)
    _expect("C", C, (slots, ngroups, dstate), act, device)
    for name, tensor, shape, dtypes in (
        ("D", D, (nheads,), f32),
        ("z", z, (slots, nheads, headdim), act),
        ("dt_bias", dt_bias, (nheads,), f32),
    ):
        if tensor is not None:
            _expect(name, tensor, shape, dtypes, device)
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    out = check_state_outputs(cache, inputs, out, debug_state, (slots, nheads, headdim),
                              x.dtype, check_counters)
    if slots == 0:
        return out

    cfg = launch_config(headdim, dstate, 1)
    del cfg["BL"]
    n_blocks = cache.scales.shape[-1] if cache.scales is not None else 1
    unused = cache.state
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _mamba2_state_update_kernel[(nheads, slots)](
            cache.state,
            cache.scales if cache.scales is not None else unused,
            cache.global_scale if cache.global_scale is not None else unused,
            cache.tokens,
            x, dt, A, B, C,
            D if D is not None else A, z if z is not None else x,
            dt_bias if dt_bias is not None else A, out,
            debug_state if debug_state is not None else unused,
            cache.seed, nheads, headdim, dstate, ngroups, n_blocks,
            F=format_spec(cache.format), USE_SR=cache.rounding == "sr",
            SR_BITS=cache.sr_bits, ROUNDS=cache.philox_rounds,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus), HAS_DEBUG=debug_state is not None,
            READ_STORED=output_from == "stored",
            **cfg,
        )
        cache.tokens.add_(1)
    return out
