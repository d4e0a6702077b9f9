"""cute_kernels/replay_flush.py (and replay_decode.py): the flush kernel against lowprec.

CPU: every variant compiles for sm_90a, the PTX holds the 128-bit state accesses the design
relies on, and bad arguments raise ValueErrors naming them. GPU (marker `gpu`): for the slots
that flush, the stored recurrence copy (fp16 bits), read copy (nibbles, scale bytes, second
level scale) equal lowprec applied to the kernel's own unrounded state (`debug_state`) bit for
bit, that state matches lowprec.mamba2.mamba2_replay_flush (fp64) to a derived fp32 bound,
outputs match, the record is appended and the counters move; every other slot is untouched.
A multi-window run drives mamba2_replay_decode (non-flush + flush kernels) with slots at
random ring positions. Each SR setting (random bits an element, Philox rounds) compiles on the
CPU calling Philox only as often as it needs, and stores lowprec's and the emulation's bits on
the GPU. `replay_flush` and `decode_step` below pack the test's tensors into a
`cute_kernels.cache.ReplayCache` and call the public functions.
"""

import dataclasses
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cute_kernels import cache as kv  # noqa: E402
from cute_kernels import replay_decode as rd  # noqa: E402
from cute_kernels import replay_flush as rf  # noqa: E402
from cute_kernels import replay_flush_config as rfc  # noqa: E402
from cute_kernels import replay_flush_fold as rff  # noqa: E402
from lowprec import contract, mamba2, philox  # noqa: E402
from lowprec import quantize as q  # noqa: E402
from lowprec.formats import FP16  # noqa: E402

DEVICE = torch.device("cuda")
EPS = 2.0**-24  # fp32 unit roundoff
SEED = 0x5EED_1234_ABCD

NEMOTRON = dict(nheads=128, headdim=64, dstate=128, ngroups=8)
ODD = dict(nheads=6, headdim=24, dstate=64, ngroups=3)  # 2 heads per group, 32 threads
# replay_output needs headdim % 16 == 0 and, for nvfp4, dstate % 128 == 0
DECODE = dict(nheads=6, headdim=32, dstate=128, ngroups=3)
WIDE = dict(nheads=4, headdim=64, dstate=256, ngroups=2)  # a row is a whole warp's chunks
NARROW = dict(nheads=6, headdim=24, dstate=128, ngroups=2)  # 96 threads, 3 heads per group
VARIANTS = [
    (hi, rnd, lo)
    for hi, rnd in (("fp16", "sr"), ("fp16", "rn"), ("fp32", "rn"))
    for lo in rfc.LO_FORMATS
]
# (random bits an element, Philox rounds) of the recurrence copy's SR: the default (16, 7)
DEFAULT_SR = (philox.DEFAULT_SR_BITS, philox.DEFAULT_PHILOX_ROUNDS)
# and besides it: whole Philox-4x32-10 words (the reference), lanes of 16 bits (13 of them),
# bytes (half a counter for a piece of 8), whole words in 7 rounds
SR_SETTINGS = [(32, 10), (13, 10), (8, 4), (32, 7)]


def sr_id(sr):
    return f"sr{sr[0]}r{sr[1]}"


def replay_cache(hi, lo, ring_x, ring_dt, ring_B, cursors, flushes, *, window=16,
                 hi_format="fp16", hi_rounding="sr", lo_format="nvfp4", seed=0,
                 sr_bits=DEFAULT_SR[0], philox_rounds=DEFAULT_SR[1]):
    """The test's tensors as a ReplayCache (shared: the kernels update them in place); an
    fp32 recurrence copy is stored exactly, so its rounding is 'rn'."""
    lo_t = scales = global_scale = None
    if lo_format == "nvfp4":
        lo_t, scales = lo["codes"], lo["scales"]
        global_scale = lo.get("global_scale", lo.get("global"))
    elif lo_format != "none":
        lo_t = lo.get("values", lo.get("codes")) if isinstance(lo, dict) else lo
    return kv.ReplayCache(hi=hi, lo=lo_t, lo_scales=scales, lo_global=global_scale,
                          ring_x=ring_x, ring_dt=ring_dt, ring_B=ring_B, cursors=cursors,
                          flushes=flushes, hi_format=hi_format,
                          hi_rounding=hi_rounding if hi_format == "fp16" else "rn",
                          lo_format=lo_format, window=window, seed=seed, sr_bits=sr_bits,
                          philox_rounds=philox_rounds)


def _split(kwargs):
    names = ("hi", "lo", "ring_x", "ring_dt", "ring_B", "cursors", "flushes")
    config = ("window", "hi_format", "hi_rounding", "lo_format", "seed", "sr_bits",
              "philox_rounds")
    cache = replay_cache(**{k: kwargs.pop(k) for k in names},
                         **{k: kwargs.pop(k) for k in config if k in kwargs})
    return cache, kwargs


def replay_flush(elements_per_thread=None, fold=None, chunk=None, **kwargs):
    """rf.mamba2_replay_flush on the test's tensors, with the tuning knobs given (None: the
    default)."""
    cache, args = _split(kwargs)
    config = None
    if (elements_per_thread, fold, chunk) != (None, None, None):
        base = rf.flush_config(cache, kv.check_replay_cache(cache), args["x"], args["dt"],
                               args.get("D"), args.get("z"), args.get("dt_bias"),
                               dt_softplus=args.get("dt_softplus", True),
                               has_debug=args.get("debug_state") is not None)
        config = dataclasses.replace(
            base, elements_per_thread=elements_per_thread or base.elements_per_thread,
            fold=fold, chunk=chunk, min_ctas_per_sm=None)
    return rf.mamba2_replay_flush(cache, **args, config=config)


def decode_step(**kwargs):
    """rd.mamba2_replay_decode on the test's tensors."""
    cache, args = _split(kwargs)
    return rd.mamba2_replay_decode(cache, **args)


def variant_id(v):
    return "-".join(v)


def config(shape, hi, rounding, lo, window=16, act="bf16", debug=True, **knobs):
    return rf.FlushConfig(
        **knobs,
        **shape,
        window=window,
        ring_len=window,
        act=act,
        dt_dtype="fp32",
        hi_format=hi,
        hi_rounding=rounding,
        lo_format=lo,
        has_D=True,
        has_z=True,
        has_dt_bias=True,
        dt_softplus=True,
        has_debug=debug,
    )


# --------------------------------------------------------------------------------------------
# CPU: compile, PTX, validation


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_every_variant_compiles_for_sm90a(variant):
    """Each (hi format, hi rounding, lo format) compiles at the Nemotron head shape."""
    rf.compile_flush(config(NEMOTRON, *variant, debug=False))


@pytest.mark.parametrize(
    "variant", [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none")], ids=variant_id
)
def test_ptx_uses_128_bit_state_accesses(variant):
    """fp16 SR + nvfp4 (64 elements a thread, 16-element chunks): 8 x 128-bit hi loads and 8
    x 128-bit hi stores per thread (plus the ring's), a block's nvfp4 codes as one 64-bit
    store, correctly rounded divisions only; fp32 single copy (8-element chunks): 16 + 16 hi
    accesses of 128 bits. No local memory (no spills)."""
    cfg = config(NEMOTRON, *variant, debug=False)
    assert cfg.chunk == (16 if variant[0] == "fp16" else 8)
    ptx = rf.compile_flush(cfg, keep_ptx=True).__ptx__
    assert ".target sm_90a" in ptx
    loads = ptx.count("ld.global.v4.b32")
    stores = ptx.count("st.global.v4.b32")
    per_thread = 8 if variant[0] == "fp16" else 16
    assert loads >= per_thread and stores >= per_thread, (loads, stores)
    assert ".local" not in ptx
    assert "div.approx" not in ptx and "div.full" not in ptx
    if variant[2] == "nvfp4":
        assert ptx.count("div.rn.f32") >= 64 + 4  # one per element, one per block, s_g
        assert ptx.count("st.global.v2.b32") >= 4  # 16 nibbles per thread per chunk
        assert ptx.count("st.global.b8") >= 4  # the scale byte of each block


@pytest.mark.parametrize(
    "variant", [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none")], ids=variant_id
)
def test_32_elements_per_thread_compile_with_128_bit_state_accesses(variant):
    """elements_per_thread = 32: 256 threads, half the hi accesses per thread, still 128-bit."""
    cfg = dataclasses.replace(config(NEMOTRON, *variant, debug=False), elements_per_thread=32)
    assert cfg.threads == 256
    ptx = rf.compile_flush(cfg, keep_ptx=True).__ptx__
    per_thread = 4 if variant[0] == "fp16" else 8
    assert ptx.count("ld.global.v4.b32") >= per_thread
    assert ptx.count("st.global.v4.b32") >= per_thread
    assert ".local" not in ptx


@pytest.mark.parametrize("window, elements_per_thread", [(16, 32), (16, 64), (8, 32), (32, 64)])
def test_mma_fold_compiles_to_three_mmas_per_tile_and_k_step(window, elements_per_thread):
    """fold = 'mma' at the Nemotron head: each warp's 8 (32 elements a thread) or 16 rows
    times the 16 n-tiles of 8 columns, three mmas (the bf16 parts of w_j x_j) per tile and
    k-step of 16 ring records (window 32: two), one ldmatrix.x4.trans per two tiles and
    k-step; no spills, and no FFMA fold left (its shared-memory B_j reads are gone)."""
    cfg = dataclasses.replace(config(NEMOTRON, "fp16", "sr", "nvfp4", window=window, debug=False),
                              elements_per_thread=elements_per_thread, fold="mma")
    assert rf.mma_fold_problem(cfg) is None and cfg.rows_per_warp == 1024 // cfg.threads * 2
    ptx = rf.compile_flush(cfg, keep_ptx=True).__ptx__
    k_steps = -(-window // 16)
    tiles = NEMOTRON["dstate"] // 8
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 3 * tiles * k_steps
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == tiles // 2 * k_steps
    assert ".local" not in ptx


@pytest.mark.parametrize("window", [16, 3, 32])
def test_direct_fold_compiles_to_three_mmas_per_column_tile_and_no_shared_round_trip(window):
    """fold = 'direct' (16-element chunks, 32 elements a thread): per warp the eight 16-column
    tiles, three mmas each (the bf16 parts of w_j x_j) and one ldmatrix.x4.trans per tile
    and k-step; the state is loaded and stored in 128-bit pieces, the NVFP4 codes of a block
    in one 64-bit store; no shared-memory fold result (no 8-byte shared stores), no spills."""
    cfg = dataclasses.replace(config(NEMOTRON, "fp16", "sr", "nvfp4", window=window, debug=False),
                              elements_per_thread=32, chunk=16, fold="direct")
    assert rf.direct_fold_problem(cfg) is None and cfg.pieces == 2
    ptx = rf.compile_flush(cfg, keep_ptx=True).__ptx__
    k_steps = -(-window // 16)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 3 * 8 * k_steps
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 8 * k_steps
    assert "st.shared.v2.f32" not in ptx
    assert ptx.count("ld.global.v4.b32") >= 4 and ptx.count("st.global.v4.b32") >= 4
    assert ptx.count("st.global.v2.b32") >= 2
    assert ".local" not in ptx


def test_direct_fold_column_order_puts_each_lane_group_on_16_whole_columns():
    """_direct_position is a permutation of the 128 columns, and lane group q's accumulator
    of m-tile mt (m = q + 8 e) is state column 16 q + 2 mt + e; per chunk of 8 it is a base
    plus a constant."""
    position = [rff._direct_position(c) for c in range(128)]
    assert sorted(position) == list(range(128))
    for group in range(8):
        for mt in range(8):
            for e in range(2):
                assert position[16 * group + 2 * mt + e] == 16 * mt + group + 8 * e
    for b in range(16):
        for v in range(8):
            assert position[8 * b + v] == position[8 * b] + rff._direct_position(v)


def test_default_knobs_are_the_measured_fastest_where_they_apply():
    """FlushConfig's defaults: an fp16 recurrence copy takes 16-element chunks where the head
    splits into them, and the direct fold where it applies (bf16, dstate 128, 32 elements a
    thread) with registers for 4 CTAs an SM; else the mma fold where its operands are exact
    (8 or 16 whole rows a warp), else FFMAs. The fp32 copy defaults to 64 elements a thread
    and so to the mma fold, with 8-element chunks (the direct fold is its fold only at 32);
    the FFMA fold always keeps 8-element chunks (16 measured 1,715 against 1,011 us)."""
    nemotron = config(NEMOTRON, "fp16", "sr", "nvfp4", elements_per_thread=32)
    assert (nemotron.chunk, nemotron.fold, nemotron.min_ctas_per_sm) == (16, "direct", 4)
    at64 = config(NEMOTRON, "fp16", "sr", "nvfp4")  # 64 elements a thread: 16 rows a warp
    assert (at64.chunk, at64.fold, at64.min_ctas_per_sm) == (16, "mma", 0)
    fp32 = config(NEMOTRON, "fp32", "rn", "none")
    assert (fp32.chunk, fp32.fold, fp32.min_ctas_per_sm) == (8, "mma", 0)
    for act in ("fp16", "fp32"):
        assert config(NEMOTRON, "fp16", "sr", "nvfp4", act=act, elements_per_thread=32).fold \
            == "fma"
    wide = config(WIDE, "fp16", "sr", "nvfp4")  # dstate 256: no direct fold
    assert (wide.chunk, wide.fold) == (16, "mma")
    assert "8 or 16" in rf.mma_fold_problem(
        config(WIDE, "fp16", "sr", "nvfp4", elements_per_thread=32, chunk=8, fold="fma"))
    odd = config(ODD, "fp16", "sr", "nvfp4")  # one warp of 24 rows: FFMAs, 8-element chunks
    assert (odd.chunk, odd.fold) == (8, "fma")
    assert config(ODD, "fp16", "sr", "nvfp4", chunk=16).chunk == 16  # 3 chunks of 16 a thread
    with pytest.raises(ValueError, match="chunk: expected 8 here"):  # 80 16s over 32 threads
        config(dict(NARROW, headdim=40, dstate=32), "fp16", "sr", "nvfp4", chunk=16)
    fp32_direct = config(NEMOTRON, "fp32", "rn", "none", elements_per_thread=32)
    assert (fp32_direct.chunk, fp32_direct.fold, fp32_direct.min_ctas_per_sm) == (16, "direct", 4)
    for headdim, ctas in ((24, 10), (128, 2), (256, 1)):  # registers for 64 a thread
        wide_rows = config(dict(NEMOTRON, headdim=headdim), "fp16", "sr", "nvfp4",
                           elements_per_thread=32)
        assert (wide_rows.fold, wide_rows.min_ctas_per_sm) == ("direct", ctas)
    with pytest.raises(ValueError, match="'mma' needs bf16"):
        config(NEMOTRON, "fp16", "sr", "nvfp4", act="fp32", fold="mma")
    with pytest.raises(ValueError, match="'direct' needs dstate 128"):
        config(WIDE, "fp16", "sr", "nvfp4", elements_per_thread=32, chunk=16, fold="direct")


@pytest.mark.parametrize("elements_per_thread", [32, 64])
def test_every_element_enters_the_e2m1_pairs_margin_test(elements_per_thread):
    """With the E2M1 codes two at a time, each state element a thread holds gets its own
    margin against the decision points (one multiply-add a value in the PTX), and the
    margins meet in unsigned minima: a signed minimum, or one folded against a
    constant, would drop some (each block's first pair)."""
    from cute_kernels import numerics as nm

    cfg = config(NEMOTRON, "fp16", "sr", "nvfp4", elements_per_thread=elements_per_thread)
    ptx = rf.compile_flush(cfg, keep_ptx=True).__ptx__
    offset = (nm.E2M1_PAIR_NEAR + 0x200000) << nm.E2M1_MARGIN_SHIFT
    assert ptx.count(f", {1 << nm.E2M1_MARGIN_SHIFT}, {offset};") == elements_per_thread
    assert "min.s32" not in ptx


def test_bf16_three_way_split_algorithm_is_exact():
    """The algorithm of tensor_core.split_bf16x3, in torch on the CPU: three round-to-nearest
    bf16 parts of an fp32 value, each of what the previous ones left, add up to it exactly (so
    the mma fold's products are those of the fp32 weights), over random values of every
    exponent and sign, for |v| >= 2^-100 (below, a part can be subnormal: error < 2^-133).
    That the device function computes these parts bit for bit is checked on the GPU by the
    numerics probe (tests/test_cute_numerics.py, outputs bf16x3_*)."""
    gen = torch.Generator().manual_seed(11)
    v = (torch.randn(100_000, generator=gen) * torch.exp2(
        torch.randint(-100, 100, (100_000,), generator=gen).float())).float()
    parts, rest = [], v.clone()
    for _ in range(3):
        p = rest.to(torch.bfloat16).float()
        parts.append(p)
        rest = rest - p
    normal = v.abs() >= 2.0**-100  # the parts stay normal (>= 2^-126) down to the last
    assert normal.float().mean() > 0.9
    assert torch.equal(rest[normal], torch.zeros_like(rest[normal]))
    total = (parts[0].double() + parts[1].double() + parts[2].double()).float()
    assert torch.equal(total[normal], v[normal])
    assert (rest.abs() <= 2.0**-133).all()  # below that, bf16 subnormals: absolutely tiny


def test_state_shapes_that_need_a_partial_warp_are_refused():
    """A 24 x 128 head would take 48 threads (64 elements each): one and a half warps, which
    the warp shuffles cannot serve; 24 x 64 takes one whole warp (32 threads, fewer elements
    each) and passes; with 32 elements per thread 24 x 64 would need 48 and is refused."""
    def view(P, N):
        return kv.CacheView(1, 2, P, N, 1, 8, torch.device("cpu"), None, {})

    with pytest.raises(ValueError, match="multiple of 32"):
        rf.check_flush_shape(view(24, 128), 64)
    assert rf.check_flush_shape(view(24, 64), 64) is None
    with pytest.raises(ValueError, match="multiple of 32"):
        rf.check_flush_shape(view(24, 64), 32)


@pytest.mark.parametrize("hi, rounding, lo, changes, message", [
    ("bf16", "sr", "nvfp4", {}, "hi_format: expected one of"),  # compiled the fp16 kernel
    ("fp16", "up", "nvfp4", {}, "hi_rounding: expected one of"),  # compiled RN
    ("fp32", "sr", "none", {}, "hi_rounding: expected 'rn' for an fp32"),
    ("fp16", "sr", "mxfp4", {}, "lo_format: expected one of"),  # compiled fp8_e4m3's stores
    ("fp16", "sr", "nvfp4", dict(act="fp64"), "act: expected one of"),
    ("fp16", "sr", "nvfp4", dict(dt_dtype="int8"), "dt_dtype: expected one of"),
    ("fp16", "sr", "nvfp4", dict(window=0), "window: expected an int in"),
    ("fp16", "sr", "nvfp4", dict(window=33), "window: expected an int in"),
    ("fp16", "sr", "nvfp4", dict(ring_len=8), "ring_len: expected an int >= window=16"),
    ("fp16", "sr", "nvfp4", dict(ngroups=5), "ngroups: expected a divisor of nheads=6"),
    ("fp16", "sr", "nvfp4", dict(elements_per_thread=48), "elements_per_thread: expected 32"),
    ("fp16", "sr", "nvfp4", dict(dstate=48), "dstate: expected a power of two"),
    ("fp16", "sr", "nvfp4", dict(headdim=24, dstate=128),
     r"headdim x dstate at 64 elements a thread: expected .*multiple of 32.*, got 24 x 128"),
    ("fp16", "sr", "nvfp4", dict(slot_loop="yes"), "slot_loop: expected a bool"),
    ("fp16", "sr", "nvfp4", dict(min_ctas_per_sm=-1), "min_ctas_per_sm: expected None or"),
    ("fp16", "sr", "nvfp4", dict(sr_bits=12), r"sr_bits: expected random bits .* got 12"),
    ("fp16", "sr", "nvfp4", dict(philox_rounds=11), r"philox_rounds: expected Philox rounds"),
    ("fp16", "rn", "nvfp4", dict(sr_bits=32),
     r"sr_bits: expected the default 16 with hi_rounding='rn' .*got 32"),
    ("fp32", "rn", "none", dict(philox_rounds=10),
     r"philox_rounds: expected the default 7 with hi_rounding='rn' .*got 10"),
])
def test_flush_config_refuses_what_replay_flush_refuses(hi, rounding, lo, changes, message):
    """FlushConfig (compile_flush's key, which tools build directly) refuses a format name,
    window, group count or head it has no kernel for with a ValueError naming the field,
    before a compile, instead of compiling some other kernel or failing in the trace."""
    changes = {"window": 16, **changes}
    shape = {**ODD, **{k: changes.pop(k) for k in ("ngroups", "dstate", "headdim")
                       if k in changes}}
    window = changes.pop("window")
    with pytest.raises(ValueError, match=message):
        if {"ring_len", "dt_dtype"} & set(changes):  # fields config() sets itself
            dataclasses.replace(config(shape, hi, rounding, lo, window=window), **changes)
        config(shape, hi, rounding, lo, window=window, **changes)


@pytest.mark.parametrize("slots, shape, changes, message", [
    (1 << 20, ODD, {}, r"cache.hi.shape\[0\] \(slots\): expected fewer than 2\^20"),
    (2, dict(nheads=1032, headdim=64, dstate=256, ngroups=8), {},
     r"cache.hi.shape\[1:\] \(nheads x headdim x dstate\): expected at most 2\^24 elements"),
    (2, dict(nheads=1032, headdim=64, dstate=256, ngroups=8), dict(hi_rounding="rn"),
     "cache.hi: expected a tensor with storage"),  # no words drawn: no element field
    (2, dict(nheads=1024, headdim=64, dstate=256, ngroups=8), {},
     "cache.hi: expected a tensor with storage"),
])
def test_flush_refuses_states_past_the_philox_fields(slots, shape, changes, message):
    """Slot s's SR words come from the counter (s << 44 | flush << 24 | e / E): 2^20 slots or
    more than 2^24 elements a slot would overlap its fields and silently share words (the
    emulation, lowprec.philox, refuses the same shapes). Meta tensors: nothing allocated, and
    the cache refused as one once its shapes pass."""
    args, window = cpu_args(slots=slots, shape=shape, device="meta")
    args["lo"] = None
    with pytest.raises(ValueError, match=message):
        replay_flush(**args, window=window, lo_format="none", **changes)


def _mul_hi(ptx: str) -> int:
    return ptx.count("mul.hi.u32")


@pytest.mark.parametrize("sr", [(32, 10), (8, 4), (13, 10)], ids=sr_id)
def test_each_sr_setting_compiles_calling_philox_only_as_often_as_it_needs(sr):
    """The decode step's flush at the Nemotron head (direct fold, two 16-element pieces a
    thread) with k random bits an element in R rounds compiles for sm_90a without spills,
    and Philox runs once a counter: 8 counters a thread at 32 bits, 4 at 16 and 13, 2 at 8.
    Each round after the first is two mul.hi.u32 (the first, with c2 = c3 = 0, one
    mul.wide.u32), so the kernel's mul.hi count differs from the default's (16 bits in 7
    rounds: 4 counters x 6) by exactly 2 (counters x (R - 1) - 24)."""
    base = config(NEMOTRON, "fp16", "sr", "nvfp4", debug=False, elements_per_thread=32)
    assert base.fold == "direct" and base.pieces == 2 and base.chunk == 16
    assert (base.sr_bits, base.philox_rounds) == (16, 7)
    cfg = dataclasses.replace(base, sr_bits=sr[0], philox_rounds=sr[1])
    ptx = rf.compile_flush(cfg, keep_ptx=True).__ptx__
    default = rf.compile_flush(base, keep_ptx=True).__ptx__
    assert ".local" not in ptx and "cvt.rz.satfinite.f16x2.f32" in ptx
    counters = base.pieces * {32: 4, 16: 2, 13: 2, 8: 1}[sr[0]]
    assert _mul_hi(ptx) - _mul_hi(default) == 2 * (counters * (sr[1] - 1) - 4 * 6)


def test_eight_bit_draws_in_eight_element_pieces_take_half_a_counter():
    """With 8-element pieces (the FFMA fold at an odd head: 6 pieces a thread) 8-bit draws
    need half of a 16-element counter: still one Philox call a piece (as the default 16 bits
    in 7 rounds, 6 x 6 rounds after the first; not two, as 32 bits need), whose upper or lower
    two words the piece selects."""
    base = config(ODD, "fp16", "sr", "nvfp4", act="fp32", debug=False)
    assert base.chunk == 8 and base.pieces == 6
    ptx = rf.compile_flush(dataclasses.replace(base, sr_bits=8, philox_rounds=4),
                           keep_ptx=True).__ptx__
    default = rf.compile_flush(base, keep_ptx=True).__ptx__
    reference = rf.compile_flush(dataclasses.replace(base, sr_bits=32, philox_rounds=10),
                                 keep_ptx=True).__ptx__
    assert ".local" not in ptx
    assert _mul_hi(ptx) - _mul_hi(default) == 2 * (6 * 3 - 6 * 6)
    assert _mul_hi(reference) - _mul_hi(default) == 2 * (12 * 9 - 6 * 6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sr_bits=12), r"sr_bits: expected random bits per element in \[8, 13, 16, 32\], got 12"),
    (dict(sr_bits=16.0), "sr_bits: expected random bits"),
    (dict(philox_rounds=0), r"philox_rounds: expected Philox rounds in \[1, 10\], got 0"),
    (dict(hi_rounding="rn", sr_bits=8),
     r"sr_bits: expected the default 16 with hi_rounding='rn' .*got 8"),
    (dict(hi_format="fp32", hi_rounding="rn", philox_rounds=4),
     r"philox_rounds: expected the default 7 with hi_rounding='rn' .*got 4"),
])
def test_replay_cache_takes_the_emulations_sr_settings_and_refuses_others(kwargs, message):
    """ReplayCache.empty takes sr_bits and philox_rounds under the emulation's names, with its
    checks: bits in (8, 13, 16, 32), rounds in 1..10, the defaults for an RN copy; a cache
    whose fields are changed afterwards is refused by the flush by the field's name."""
    with pytest.raises(ValueError, match=message):
        kv.ReplayCache.empty(2, 4, 16, 128, ngroups=2, window=8, **kwargs)
    cache = kv.ReplayCache.empty(2, 4, 16, 128, ngroups=2, window=8, sr_bits=13, philox_rounds=7)
    assert (cache.sr_bits, cache.philox_rounds) == (13, 7)
    args, window = cpu_args()
    with pytest.raises(ValueError, match="cache.sr_bits: expected random bits"):
        replay_flush(**args, window=window, sr_bits=24)
    with pytest.raises(ValueError, match="cache.philox_rounds: expected the default 7 with "
                                         "cache.hi_rounding='rn'"):
        replay_flush(**args, window=window, hi_rounding="rn", philox_rounds=10)
    with pytest.raises(ValueError, match="cache.hi: expected a CUDA tensor"):  # accepted
        replay_flush(**args, window=window, sr_bits=8, philox_rounds=1)


def test_flush_config_carries_the_caches_sr_setting():
    """flush_config copies the cache's setting into the compile key (two settings, two
    kernels), and a tuned config may not change it: the reference 32/10 and the default."""
    args, window = cpu_args()
    cache, step = _split(dict(args, window=window, sr_bits=32, philox_rounds=10))
    view = kv.check_replay_cache(cache)
    cfg = rf.flush_config(cache, view, step["x"], step["dt"])
    assert (cfg.sr_bits, cfg.philox_rounds) == (32, 10)
    with pytest.raises(ValueError, match="config.sr_bits: expected 32"):
        rfc._tuned(cfg, dataclasses.replace(cfg, sr_bits=16))
    cache, step = _split(dict(cpu_args()[0], window=window))
    cfg = rf.flush_config(cache, kv.check_replay_cache(cache), step["x"], step["dt"])
    assert (cfg.sr_bits, cfg.philox_rounds) == (16, 7)


def test_advance_kernel_compiles():
    """The counter kernel (reset a flushing slot's cursor, advance its flush count)."""
    assert ".target sm_90a" in rf.compile_advance(16, keep_ptx=True).__ptx__


def cpu_args(slots=3, shape=ODD, window=8, act=torch.float32, device="cpu"):
    """Valid arguments on the CPU (validation runs before any launch); on "meta" for shapes
    too large to allocate."""
    H, P, N, G = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]
    f32 = torch.float32
    args = dict(
        hi=torch.zeros(slots, H, P, N, dtype=torch.float16, device=device),
        lo=dict(
            codes=torch.zeros(slots, H, P, N // 2, dtype=torch.uint8, device=device),
            scales=torch.zeros(slots, H, P, N // 16, dtype=torch.uint8, device=device),
            global_scale=torch.zeros(slots, H, dtype=f32, device=device),
        ),
        ring_x=torch.zeros(slots, H, window, P, dtype=act, device=device),
        ring_dt=torch.zeros(slots, H, window, dtype=f32, device=device),
        ring_B=torch.zeros(slots, G, window, N, dtype=act, device=device),
        cursors=torch.zeros(slots, dtype=torch.int32, device=device),
        flushes=torch.zeros(slots, dtype=torch.int32, device=device),
        x=torch.zeros(slots, H, P, dtype=act, device=device),
        dt=torch.zeros(slots, H, dtype=act, device=device),
        A=torch.zeros(H, dtype=f32, device=device),
        B=torch.zeros(slots, G, N, dtype=act, device=device),
        C=torch.zeros(slots, G, N, dtype=act, device=device),
    )
    return args, window


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("hi", lambda a: a["hi"].float(), "cache.hi: expected dtype torch.float16"),
        ("ring_x", lambda a: a["ring_x"][:, :, :4],
         "cache.ring_x.shape[2] (Lcap): expected >= window"),
        ("A", lambda a: a["A"].double(), "A: expected dtype torch.float32"),
        ("cursors", lambda a: a["cursors"].long(), "cache.cursors: expected dtype torch.int32"),
        (
            "B",
            lambda a: torch.zeros(3, 4, 64, dtype=a["B"].dtype),
            "B: expected shape [3, 3, 64]",
        ),
        (
            "x",
            lambda a: a["x"].transpose(1, 2).contiguous().transpose(1, 2),
            "x: expected a contig",
        ),
        ("lo", lambda a: {**a["lo"], "codes": a["lo"]["codes"][..., :8].contiguous()},
         "cache.lo: expected shape"),
        # the counter kernel would reset the cursor and then add one to it: cursor 1, and the
        # flush counter never advanced
        ("flushes", lambda a: a["cursors"],
         "cache.cursors: expected a tensor apart from cache.flushes"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(name, bad, message):
    args, window = cpu_args()
    args[name] = bad(args)
    with pytest.raises(
        ValueError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        replay_flush(**args, window=window)


@pytest.mark.parametrize(
    "cursors, flushes, message",
    [
        ([0, 7, 3], [0, (1 << 20) - 2, 5], None),  # the largest counter that still fits
        ([0, 7, 3], [0, (1 << 20) - 1, 5], r"flushes: expected values in \[0, 2\^20 - 1\)"),
        ([0, 7, 3], [0, -1, 5], r"flushes: expected .* got range \[-1, 5\]"),
        ([0, 8, 3], [0, 1, 5], r"cursors: expected values in \[0, 7\] \(window 8\)"),
        ([-2, 1, 3], [0, 1, 5], r"cursors: expected .* got range \[-2, 3\]"),
    ],
)
def test_check_counters_refuses_counters_outside_the_philox_fields(cursors, flushes, message):
    """check_counters=True reads the counters once (a sync) and refuses a flush counter that
    would leave the Philox counter's 20-bit flush field (at 2^20 slot s would take the words
    of flush 0 of slot s | 1) or a cursor outside the window, in replay_flush and
    replay_decode_step, before any launch."""

    args, window = cpu_args()
    args["cursors"] = torch.tensor(cursors, dtype=torch.int32)
    args["flushes"] = torch.tensor(flushes, dtype=torch.int32)
    if message is None:
        assert kv.check_counter_values(args["cursors"], args["flushes"], window) is None
        return
    for entry in (replay_flush, decode_step):
        with pytest.raises(ValueError, match=message):
            entry(**args, window=window, check_counters=True)


def test_flush_counter_limit_keeps_every_flush_in_its_own_counter_field():
    """What check_counters protects: the kernels' Philox counter words of (slot, flush) for
    the last accepted counter (FLUSH_COUNTER_LIMIT - 1) and the one it leaves (the limit)
    are none of slot s's or slot s | 1's at flush 0, while one more (2^20) overflows into
    the slot field and repeats slot s | 1's flush 0, for even and odd slots."""
    import numpy as np

    from cute_kernels import numerics as nm
    from lowprec.replay import FLUSH_COUNTER_LIMIT

    assert FLUSH_COUNTER_LIMIT == (1 << 20) - 1
    for slot in (4, 5, 1234):
        for counter in (0, 3, (1 << 22) - 1):
            def words(s, f, c=counter):
                return tuple(int(w) for w in nm.state_counter(np.uint32(s), np.uint32(f),
                                                              np.uint32(c)))
            flush_zero = {words(slot, 0), words(slot | 1, 0)}
            for f in (FLUSH_COUNTER_LIMIT - 1, FLUSH_COUNTER_LIMIT):
                assert words(slot, f) not in flush_zero, (slot, f, counter)
            assert words(slot, 1 << 20) == words(slot | 1, 0), (slot, counter)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hi_format="bf16"), "hi_format: expected one of"),
        (dict(lo_format="mxfp4"), "lo_format: expected one of"),
        (dict(seed=-1), "seed: expected an int in"),
        (dict(window=33), "window: expected an int in"),
        (dict(fold="wmma"), "fold: expected one of"),
        # fp32 activations: not exact bf16 mma operands
        (dict(fold="mma"), "fold: expected another fold here .'mma' needs bf16 activations"),
        (dict(fold="direct"), "fold: expected another fold here .'direct' needs bf16"),
        (dict(chunk=12), "chunk: expected one of"),
        # a word read with bool() would turn the counter check (a sync) on
        (dict(check_counters="no"), "check_counters: expected a bool, got 'no'"),
    ],
)
def test_bad_options_raise_value_errors(kwargs, message):
    args, window = cpu_args()
    kwargs = {"window": window, **kwargs}
    with pytest.raises(ValueError, match=message):
        replay_flush(**args, **kwargs)


# --------------------------------------------------------------------------------------------
# GPU: one flush against lowprec


def random_cache(slots, shape, window, act, hi_format, lo_format, gen, flush_slots):
    """A cache with random contents (never zeros): states ~N(0, 1) per element, ring dt
    positive; `cursors` random in [0, window - 2] except `flush_slots` at window - 1;
    `flushes` random in [0, 700) so the flush field crosses its low byte."""
    H, P, N, G = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]
    hi_dtype = torch.float16 if hi_format == "fp16" else torch.float32
    dev = DEVICE

    def randn(*size, dtype=torch.float32, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(dtype).to(dev)

    cursors = torch.randint(0, window - 1, (slots,), generator=gen, dtype=torch.int32)
    cursors[flush_slots] = window - 1
    lo = None
    if lo_format == "nvfp4":
        lo = dict(
            codes=torch.full((slots, H, P, N // 2), 0xAB, dtype=torch.uint8, device=dev),
            scales=torch.full((slots, H, P, N // 16), 0x3C, dtype=torch.uint8, device=dev),
            global_scale=torch.full((slots, H), float("nan"), device=dev),
        )
    elif lo_format != "none":
        dtype = {"fp8_e4m3": torch.uint8, "fp16": torch.float16, "fp32": torch.float32}
        lo = {
            "values": torch.full(
                (slots, H, P, N),
                0x5A if lo_format == "fp8_e4m3" else float("nan"),
                dtype=dtype[lo_format],
                device=dev,
            )
        }
    return dict(
        hi=randn(slots, H, P, N, dtype=hi_dtype),
        lo=lo,
        ring_x=randn(slots, H, window, P, dtype=act),
        ring_dt=torch.nn.functional.softplus(randn(slots, H, window) - 1.0),
        ring_B=randn(slots, G, window, N, dtype=act),
        cursors=cursors.to(dev),
        flushes=torch.randint(0, 700, (slots,), generator=gen, dtype=torch.int32).to(dev),
    )


def random_token(slots, shape, act, gen):
    H, P, N, G = shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"]
    dev = DEVICE

    def randn(*size, dtype=act):
        return torch.randn(*size, generator=gen).to(dtype).to(dev)

    return dict(
        x=randn(slots, H, P),
        dt=randn(slots, H, dtype=torch.float32),
        A=-(0.2 + 1.8 * torch.rand(H, generator=gen)).to(dev),
        B=randn(slots, G, N),
        C=randn(slots, G, N),
        D=randn(H, dtype=torch.float32),
        z=randn(slots, H, P),
        dt_bias=randn(H, dtype=torch.float32) * 0.5,
    )


def clone(d):
    if isinstance(d, dict):
        return {k: clone(v) for k, v in d.items()}
    return None if d is None else d.clone()


def expected_lo_bytes(state, lo_format):
    """lowprec's storage of the read copy of an fp32 state, as flat bytes per tensor."""
    packed = q.pack(q.quantize(state, lo_format, "rn"))
    return {k: v.contiguous().view(torch.uint8) for k, v in packed.items()}


def kernel_lo_bytes(lo, lo_format):
    if lo_format == "nvfp4":
        return {k: lo[k].cpu().contiguous().view(torch.uint8) for k in lo}
    return {"codes": lo["values"].cpu().contiguous().view(torch.uint8)}


def _emulation_stores_the_same_codes(state, cpu, fs, b, seed, hi_format, hi_rounding,
                                     lo_format, sr_bits=DEFAULT_SR[0],
                                     philox_rounds=DEFAULT_SR[1]):
    """The third implementation, directly: the Triton emulation's quantiser and Philox draws
    (emulation.numerics, on the GPU; `sr_bits` an element in `philox_rounds` rounds) applied
    to the CuTe kernel's own unrounded state give the CuTe kernel's stored bits. (The rest of
    this test ties both to lowprec.)"""
    from emulation import numerics as em

    H, P, N = state.shape[1:]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    dev_state = state.to(device)
    if hi_format == "fp16":
        rand = None
        if hi_rounding == "sr":
            rand = torch.stack([
                em.random_words_host(seed, int(s), int(b["flushes"][s]), H * P * N, device,
                                     sr_bits=sr_bits, philox_rounds=philox_rounds)
                for s in fs
            ]).reshape(state.shape)
        rounded = em.round_to(dev_state, "fp16", hi_rounding, rand,
                              sr_bits=sr_bits if hi_rounding == "sr" else DEFAULT_SR[0]).cpu()
        want = q.encode_bits(rounded, FP16)
        got = cpu["hi"][fs].view(torch.int16).long() & 0xFFFF
        assert torch.equal(want, got), "emulation and CuTe fp16 recurrence copies differ"
    if lo_format not in ("none", "fp32"):
        quantized = em.quantize(dev_state, lo_format, "rn")
        quantized = q.Quantized(
            quantized.fmt,
            quantized.elements.cpu(),
            None if quantized.scales is None else quantized.scales.cpu(),
            None if quantized.global_scale is None else quantized.global_scale.cpu(),
        )
        want = {k: v.contiguous().view(torch.uint8) for k, v in q.pack(quantized).items()}
        got = kernel_lo_bytes({k: v[fs] for k, v in cpu["lo"].items()}, lo_format)
        for key in want:
            assert torch.equal(want[key], got[key]), f"emulation and CuTe lo[{key}] differ"


def state_bound(hi, ring_x, ring_dt, ring_B, A, window, heads_per_group):
    """Elementwise fp32 error bound of the kernel's S_new: EPS * (16 + 2 L |A| cum) times the
    sum of the magnitudes of its terms, g |S| + sum_j |w_j x_j B_j|. 16: the exps (libdevice,
    2 ulp), the products and the fp32 accumulation of L + 1 terms; 2 L |A| cum: the cumulative
    sums of dt differ from the reference's by up to L ulp of cum, which the exp amplifies by
    |A| (relative error of each decay weight)."""
    count = torch.full((hi.shape[0],), window, dtype=torch.int64)
    A = A.double()
    cum = ring_dt[..., :window].double().sum(-1)  # [b, h]
    mag = mamba2.mamba2_replay_flush(
        hi.double().abs(),
        ring_x.double().abs(),
        ring_dt.double(),
        ring_B.double().abs(),
        count,
        torch.zeros_like(A),
    )
    # with A = 0 every decay is 1: the sum of magnitudes of terms before their decay, an
    # upper bound of the decayed sum
    factor = EPS * (16 + 2 * window * A.abs()[None, :] * cum)
    return mag * factor[..., None, None]


def check_flush(
    shape, slots, window, act, hi_format, hi_rounding, lo_format, seed=SEED, gen_seed=0,
    elements_per_thread=None, fold=None, chunk=None, sr=DEFAULT_SR,
):
    gen = torch.Generator().manual_seed(gen_seed)
    flush_slots = list(range(0, slots, 2))
    cache = random_cache(slots, shape, window, act, hi_format, lo_format, gen, flush_slots)
    tok = random_token(slots, shape, act, gen)
    H, P, N = shape["nheads"], shape["headdim"], shape["dstate"]
    before = clone(cache)
    out = torch.full((slots, H, P), float("nan"), dtype=act, device=DEVICE)
    debug = torch.full((slots, H, P, N), float("nan"), device=DEVICE)
    replay_flush(
        **cache,
        **tok,
        out=out,
        window=window,
        hi_format=hi_format,
        hi_rounding=hi_rounding,
        lo_format=lo_format,
        seed=seed,
        debug_state=debug,
        elements_per_thread=elements_per_thread,
        fold=fold,
        chunk=chunk,
        sr_bits=sr[0],
        philox_rounds=sr[1],
    )
    torch.cuda.synchronize()
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in cache.items()}
    b = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in before.items()}
    t = {k: v.cpu() for k, v in tok.items()}
    fs = torch.tensor(flush_slots)
    keep = torch.tensor([s for s in range(slots) if s not in flush_slots])

    # counters
    assert cpu["cursors"][fs].eq(0).all() and cpu["cursors"][keep].eq(b["cursors"][keep]).all()
    assert cpu["flushes"].eq(b["flushes"] + torch.isin(torch.arange(slots), fs).int()).all()

    # the record: x and B copied bit for bit, dt processed (fp32 against fp64)
    L1 = window - 1
    assert torch.equal(cpu["ring_x"][fs, :, L1], t["x"][fs])
    hpg = H // shape["ngroups"]
    assert torch.equal(cpu["ring_B"][fs, :, L1], t["B"][fs])
    dt_ref = mamba2.mamba2_process_dt(t["dt"].double(), t["dt_bias"].double())
    assert torch.allclose(cpu["ring_dt"][fs, :, L1].double(), dt_ref[fs], rtol=1e-5, atol=0)
    ring_x, ring_dt, ring_B = b["ring_x"].clone(), b["ring_dt"].clone(), b["ring_B"].clone()
    ring_x[fs, :, L1], ring_B[fs, :, L1] = t["x"][fs], t["B"][fs]
    ring_dt[fs, :, L1] = cpu["ring_dt"][fs, :, L1]

    # S_new against the fp64 replay of the same ring
    state = debug.cpu()[fs]
    assert not state.isnan().any(), "debug_state rows of flushing slots left unwritten"
    count = torch.full((len(fs),), window, dtype=torch.int64)
    ref = mamba2.mamba2_replay_flush(
        b["hi"][fs].double(),
        ring_x[fs].double(),
        ring_dt[fs].double(),
        ring_B[fs].double(),
        count,
        t["A"].double(),
    )
    bound = state_bound(b["hi"][fs], ring_x[fs], ring_dt[fs], ring_B[fs], t["A"], window, hpg)
    err = (state.double() - ref).abs()
    worst = (err / bound).flatten().argmax()
    assert (err <= bound).all(), (
        f"S_new error {err.flatten()[worst]:.3e} over bound {bound.flatten()[worst]:.3e} "
        f"at flat index {int(worst)}"
    )

    # stored codes: lowprec applied to the kernel's own state, bit for bit, through
    # lowprec.contract (the check its docstring gives a user for their own kernel)
    want = contract.flush_copies(state, hi_format=hi_format, hi_rounding=hi_rounding,
                                 lo_format=lo_format, seed=seed, slots=fs,
                                 flushes=b["flushes"][fs], sr_bits=sr[0], philox_rounds=sr[1])
    got = {"hi": cpu["hi"][fs]}
    if lo_format != "none":
        got.update({f"lo.{'codes' if k == 'values' else k}": v[fs] for k, v in cpu["lo"].items()})
    problems = contract.mismatches(got, want)
    assert not problems, "\n".join(problems)
    _emulation_stores_the_same_codes(state, cpu, fs, b, seed, hi_format, hi_rounding, lo_format,
                                     *sr)

    # outputs from the kernel's state: y = S C + D x, times silu(z)
    g = torch.arange(H) // hpg
    C = t["C"].double()[fs][:, g]  # [f, H, N]
    x, z = t["x"].double()[fs], t["z"].double()[fs]
    sc = state.double() * C[:, :, None, :]
    y = sc.sum(-1) + t["D"].double()[None, :, None] * x
    gate = torch.nn.functional.silu(z)
    y_ref = y * gate
    y_bound = EPS * (N + 16) * (sc.abs().sum(-1) + (t["D"].double()[None, :, None] * x).abs())
    y_bound = y_bound * gate.abs().clamp(min=1)
    if act != torch.float32:
        y_bound = y_bound + 2.0**-8 * y_ref.abs()
    got_y = out.cpu()[fs].double()
    assert ((got_y - y_ref).abs() <= y_bound).all(), (got_y - y_ref).abs().max()

    # everything of the other slots is untouched
    if len(keep):
        assert out.cpu()[keep].isnan().all()
        assert debug.cpu()[keep].isnan().all()
        assert torch.equal(cpu["hi"][keep], b["hi"][keep])
        for name in ("ring_x", "ring_dt", "ring_B"):
            assert torch.equal(cpu[name][keep], b[name][keep]), name
        if lo_format != "none":
            for k in cpu["lo"]:
                assert torch.equal(
                    cpu["lo"][k][keep].view(torch.uint8).flatten(),
                    b["lo"][k][keep].view(torch.uint8).flatten(),
                ), k


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_flush_codes_equal_lowprec_at_an_odd_shape(variant):
    """7 slots (4 flush), 6 heads in 3 groups, 24 x 64 states, window 16, fp32 activations."""
    check_flush(ODD, 7, 16, torch.float32, *variant)


@pytest.mark.gpu
@pytest.mark.parametrize("sr", SR_SETTINGS, ids=sr_id)
@pytest.mark.parametrize("case", ["nemotron-direct", "nemotron-fma64", "odd-fma"])
def test_flush_codes_with_each_sr_setting(sr, case):
    """With k random bits an element in R Philox rounds, the flush's fp16 bits, NVFP4 codes,
    block scales and global scales equal lowprec's and the emulation's of the kernel's own
    state, bit for bit: the default layout at the Nemotron head (two 16-element pieces a
    thread, direct fold), the FFMA fold with 8-element pieces (8 bits: half a counter a
    piece), and an odd head with fp32 activations."""
    shape, act, knobs = {
        "nemotron-direct": (NEMOTRON, torch.bfloat16, {}),
        "nemotron-fma64": (NEMOTRON, torch.bfloat16, dict(elements_per_thread=64, fold="fma")),
        "odd-fma": (ODD, torch.float32, {}),
    }[case]
    check_flush(shape, 5, 16, act, "fp16", "sr", "nvfp4", gen_seed=20 + sr[0] + sr[1],
                sr=sr, **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant", [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none")], ids=variant_id
)
def test_flush_at_the_nemotron_shape_with_bf16_activations(variant):
    """3 slots of the Nemotron-3-Super layer (128 heads, 64 x 128, 8 groups), window 16."""
    check_flush(NEMOTRON, 3, 16, torch.bfloat16, *variant, gen_seed=1)


def test_default_layout_is_32_elements_per_thread_where_whole_warps_fit():
    """fp16 hi: 32 elements a thread (the faster layout on the H200) wherever the head splits
    into whole warps and at most 1024 threads; 64 otherwise (24 x 128: 96 threads at 32 is
    fine, but 8 x 16 would be 4 threads). fp32 hi: 64."""
    assert rf.default_elements_per_thread(64, 128) == 32  # Nemotron-3-Super: 256 threads
    assert rf.default_elements_per_thread(24, 128) == 32  # 96 threads
    assert rf.default_elements_per_thread(8, 16) == 64  # 128 elements: one warp either way
    assert rf.default_elements_per_thread(256, 256) == 64  # 2048 threads at 32
    assert rf.default_elements_per_thread(64, 128, "fp32") == 64  # measured faster
    for headdim in range(8, 257, 8):
        for dstate in (16, 32, 64, 128, 256):
            ept = rf.default_elements_per_thread(headdim, dstate)
            threads = rf.thread_count(headdim, dstate, ept)
            if ept == 32:
                assert threads % 32 == 0 and threads <= 1024


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant", [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none")], ids=variant_id
)
@pytest.mark.parametrize("elements_per_thread", [32, 64])
def test_flush_with_either_thread_layout(variant, elements_per_thread):
    """Both layouts (32 elements a thread, the default at this shape, and 64) store the same
    codes as lowprec."""
    check_flush(NEMOTRON, 3, 16, torch.bfloat16, *variant, gen_seed=2,
                elements_per_thread=elements_per_thread)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant", [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none"), ("fp16", "rn", "fp8_e4m3")],
    ids=variant_id,
)
@pytest.mark.parametrize("fold, window, elements_per_thread", [
    ("fma", 16, 32), ("fma", 16, 64), ("mma", 16, 64), ("mma", 8, 32), ("mma", 32, 64),
    ("mma", 3, 32),
])
def test_flush_with_either_fold(variant, fold, window, elements_per_thread):
    """The ring folded with FFMAs or on the tensor cores (bf16 activations; windows padded
    to 16 or two k-steps, 8 or 16 rows a warp): S_new within the fp32 bound of the fp64
    replay, and the stored codes lowprec's of it, bit for bit."""
    check_flush(NEMOTRON, 3, window, torch.bfloat16, *variant, gen_seed=5 + window,
                elements_per_thread=elements_per_thread, fold=fold)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant",
    [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none"), ("fp16", "rn", "fp8_e4m3"),
     ("fp16", "sr", "fp16")],
    ids=variant_id,
)
@pytest.mark.parametrize("fold, window", [("direct", 16), ("direct", 3), ("direct", 32),
                                          ("mma", 16), ("fma", 8)])
def test_flush_with_16_element_chunks(variant, fold, window):
    """A thread handling 16 state elements as one piece (a whole NVFP4 block), with each
    fold; 'direct' keeps the transposed fold's accumulators as the thread's elements: S_new
    within the fp32 bound of the fp64 replay, the stored codes lowprec's of it, bit for bit."""
    check_flush(NEMOTRON, 3, window, torch.bfloat16, *variant, gen_seed=11 + window,
                elements_per_thread=32, chunk=16, fold=fold)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", ["direct", "mma"])
def test_nvfp4_codes_at_and_near_every_e2m1_decision_point(fold):
    """With no ring (every dt 0: the decay is 1 and every weight 0) the flush's state is the
    recurrence copy itself, which is built here so that each block's quotients x / divisor
    land on E2M1's decision points (0.25, 0.75, ..., 5: ties, where the fast paths must hand
    over to the division), 2^-6 beside them and on grid values (0 and 6 included), with
    both signs, in blocks of several scales. The stored codes, scales and global scale are
    lowprec's of that state, bit for bit, with the codes taken two at a time or one."""
    slots, shape, window = 3, dict(nheads=4, headdim=64, dstate=128, ngroups=2), 16
    gen = torch.Generator().manual_seed(31)
    cache = random_cache(slots, shape, window, torch.bfloat16, "fp16", "nvfp4", gen, [0, 1, 2])
    tok = random_token(slots, shape, torch.bfloat16, gen)
    H, P, N = shape["nheads"], shape["headdim"], shape["dstate"]
    cache["ring_dt"].zero_()
    tok["dt"] = -tok["dt_bias"].expand(slots, H).clone()  # dt + dt_bias = 0 (no softplus)
    # quotients per block: the head's amax is 2688 * 2^-10 (s_g = 2^-10); a block's amax
    # 6 * 2^-10 * s_b (its scale s_b, an E4M3 value of two significant bits, so that every
    # value below is an fp16 value) makes the divisor s_b 2^-10 exactly
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1, 1.5, 2, 3, 4])
    step = torch.tensor([0.0, 1.0, -1.0])[torch.randint(0, 3, (slots, H, P, N), generator=gen)]
    quotient = points[torch.randint(0, points.numel(), (slots, H, P, N), generator=gen)]
    quotient = quotient * (1 + step * 2.0**-6)  # on, or a little beside
    quotient[..., ::16] = 6.0  # each block's amax
    s_b = torch.tensor([1.0, 0.5, 0.75, 2.0, 1.5, 0.25, 3.0, 6.0])
    block_scale = s_b[torch.randint(0, s_b.numel(), (slots, H, P, N // 16), generator=gen)]
    block_scale[..., 0, 0] = 448.0  # the head's amax: 6 * 448 * 2^-10
    quotient[..., 0, :16] = 6.0
    sign = torch.where(torch.rand(slots, H, P, N, generator=gen) < 0.5, -1.0, 1.0)
    state = sign * quotient * block_scale.repeat_interleave(16, dim=-1) * 2.0**-10
    cache["hi"] = state.to(torch.float16).to(DEVICE)
    assert torch.equal(cache["hi"].float().cpu(), state)  # every value is an fp16 value
    cache_hi = cache["hi"].clone()
    debug = torch.full((slots, H, P, N), float("nan"), device=DEVICE)
    replay_flush(**cache, **tok, dt_softplus=False, window=window, seed=SEED,
                    debug_state=debug, fold=fold)
    torch.cuda.synchronize()
    state = debug.cpu()  # the kernel's own state: its zeros may have lost their signs
    assert torch.equal(state, cache_hi.float().cpu())  # the recurrence copy
    want = expected_lo_bytes(state, "nvfp4")
    got = kernel_lo_bytes({k: v.cpu() for k, v in cache["lo"].items()}, "nvfp4")
    for key in want:
        mism = (want[key] != got[key]).nonzero()
        if len(mism) and key == "codes":  # the two elements of the first bytes that differ
            s, h, p, b = mism[0].tolist()
            scale = q.quantize(state, "nvfp4", "rn")
            divisor = scale.scales[s, h, p, b // 8] * scale.global_scale[s, h]
            values = state[s, h, p, 2 * b: 2 * b + 2]
            detail = (f"values {values.tolist()} / {divisor.item()!r} = "
                      f"{(values / divisor).tolist()}: want {want[key][s, h, p, b]:#04x}, "
                      f"got {got[key][s, h, p, b]:#04x}")
        else:
            detail = ""
        assert len(mism) == 0, f"lo[{key}]: {len(mism)} byte mismatches, first {mism[:3]} {detail}"


def nvfp4_tie_states(slots=3, nheads=4, headdim=64, dstate=128):
    """fp32 states [slots, nheads, headdim, dstate] on the nvfp4 encode's knife edges.

    Slot 0 and 1: block amaxes within 3 fp32 ulps of (an E4M3 midpoint) * 6 s_g, every
    midpoint, where one ulp of amax_b / den decides the block scale (s_g = 1000 / 2688 from
    each head's first value, 1000); a second value of amax_b / 3 a block. The rest of slot 2:
    for every positive E4M3 scale s_b, blocks whose quotients x / (s_b s_g) lie on E2M1's
    decision points, 2^-6 beside them and on grid values, both signs (s_g = 2^-10). Filler
    blocks repeat the list."""
    from lowprec.formats import E4M3

    blocks_per_head = headdim * dstate // 16
    grid = q.decode_bits(torch.arange(0x7F), E4M3).double()
    midpoints = ((grid[:-1] + grid[1:]) / 2)[1:]
    s_g = torch.tensor(1000.0) / 2688.0
    centre = (midpoints * (torch.tensor(6.0) * s_g).double()).float()
    amax = torch.cat([centre + k * torch.finfo().eps * centre for k in range(-3, 4)])
    amax = amax[amax < 1000]
    ties = torch.zeros(2 * nheads * blocks_per_head, 16)
    ties[:, 0] = amax.repeat(-(-len(ties) // len(amax)))[: len(ties)]
    ties[:, 7] = -ties[:, 0] / 3
    ties = ties.reshape(2, nheads, headdim, dstate)
    ties[..., 0, 0] = 1000.0

    s_b = q.decode_bits(torch.arange(1, 0x7F), E4M3)
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1, 1.5, 2, 3, 4])
    quotients = (points[:, None] * (1 + torch.tensor([0.0, 1.0, -1.0]) * 2.0**-6)).flatten()
    per_scale = torch.full((3, 16), 6.0)  # 3 blocks a scale: 45 places for the 42 quotients
    per_scale[:, 1:] = quotients.repeat(2)[:45].reshape(3, 15)
    blocks = (per_scale[None] * s_b[:, None, None]).reshape(-1, 16)  # [3 * 126, 16]
    blocks = blocks.repeat(-(-nheads * blocks_per_head // len(blocks)), 1)
    blocks = blocks[: nheads * blocks_per_head].reshape(nheads, headdim, dstate)
    blocks[:, 0, :16] = 6.0 * 448.0  # each head's amax: s_g = 2^-10
    sign = torch.where(torch.arange(headdim * dstate).reshape(headdim, dstate) % 3 == 1, -1.0,
                       1.0)
    points_state = sign * blocks * 2.0**-10
    state = torch.cat([ties, points_state[None]])[:slots]
    return state


def test_nvfp4_tie_states_reach_the_knife_edges():
    """The states of the GPU test below do what it needs (CPU, lowprec only): the block
    scales of slots 0-1 change if amax_b is divided by 6 and s_g in turn, the codes of slot
    2 if x is multiplied by 1 / divisor, and every value is exactly what was meant."""
    from lowprec.formats import E2M1, E4M3

    state = nvfp4_tie_states()
    quant = q.quantize(state, "nvfp4", "rn")
    amax_b = state[:2].abs().reshape(2, 4, 64, 8, 16).amax(-1)
    s_g = quant.global_scale[:2, :, None, None]
    assert bool((s_g == torch.tensor(1000.0) / 2688.0).all())
    assert not torch.equal(quant.scales[:2], q.round_to(amax_b / 6.0 / s_g, E4M3))
    assert bool((quant.global_scale[2] == 2.0**-10).all())
    divisor = (quant.scales[2] * quant.global_scale[2, :, None, None]).repeat_interleave(16, -1)
    assert not torch.equal(q.round_to(state[2] * (1.0 / divisor), E2M1), quant.elements[2])
    positive = q.decode_bits(torch.arange(1, 0x7F), E4M3)
    assert set(quant.scales[2].unique().tolist()) >= set(positive.tolist()) - {0.0}


@pytest.mark.gpu
def test_nvfp4_encode_at_e4m3_ties_and_every_scale_s_decision_points():
    """The flush (hi fp32, so that any fp32 state is its own recurrence copy; no ring, every
    dt 0) stores lowprec's nvfp4 bytes, bit for bit, for states whose block amaxes sit within
    an ulp of every E4M3 midpoint and whose quotients sit on E2M1's decision points at every
    E4M3 block scale (`nvfp4_tie_states`): the division order of the block scale and the
    division of each code, where random states never decide anything."""
    slots, shape, window = 3, dict(nheads=4, headdim=64, dstate=128, ngroups=2), 16
    gen = torch.Generator().manual_seed(37)
    cache = random_cache(slots, shape, window, torch.bfloat16, "fp32", "nvfp4", gen, [0, 1, 2])
    tok = random_token(slots, shape, torch.bfloat16, gen)
    cache["ring_dt"].zero_()
    tok["dt"] = -tok["dt_bias"].expand(slots, shape["nheads"]).clone()  # dt + dt_bias = 0
    state = nvfp4_tie_states()
    cache["hi"] = state.to(DEVICE)
    debug = torch.full(state.shape, float("nan"), device=DEVICE)
    replay_flush(**cache, **tok, dt_softplus=False, window=window, seed=SEED,
                    hi_format="fp32", hi_rounding="rn", lo_format="nvfp4", debug_state=debug)
    torch.cuda.synchronize()
    kernel_state = debug.cpu()  # the kernel's own state: 1 * (-0) + 0 is +0, so its zeros
    assert torch.equal(kernel_state, state)  # lose their signs; nothing else was folded in
    want = expected_lo_bytes(kernel_state, "nvfp4")
    got = kernel_lo_bytes({k: v.cpu() for k, v in cache["lo"].items()}, "nvfp4")
    for key in want:
        mism = (want[key] != got[key]).nonzero()
        assert len(mism) == 0, f"lo[{key}]: {len(mism)} byte mismatches, first {mism[:3]}"


@pytest.mark.gpu
def test_nvfp4_scales_of_states_whose_divisor_underflows_are_lowprecs():
    """A decay of about 2^-130 to 2^-144 (dt up to 100, A = -1, no ring, x = 0) takes the
    state into fp32's subnormals: in slot 0 the global scale s_g underflows to 0 (lowprec:
    amax_b / 0 = inf, scale byte 0x7E, codes +0), in slot 1 s_g is subnormal and small
    blocks' s_b * s_g underflow (s_b's byte kept, codes +0), slot 2 is normal. The stored
    codes, scales and global scale are lowprec's of the kernel's own state, bit for bit."""
    slots, shape, window = 3, dict(nheads=4, headdim=64, dstate=128, ngroups=2), 16
    gen = torch.Generator().manual_seed(37)
    cache = random_cache(slots, shape, window, torch.bfloat16, "fp16", "nvfp4", gen, [0, 1, 2])
    tok = random_token(slots, shape, torch.bfloat16, gen)
    H = shape["nheads"]
    cache["ring_dt"].zero_()
    tok["x"].zero_()  # the fold adds nothing: S_new = exp(A dt) S_hi
    tok["A"] = torch.full((H,), -1.0, device=DEVICE)
    total = torch.tensor([99.8, 95.0, 90.1])[:, None] + 0.3 * torch.arange(H)[None, :]
    tok["dt"] = (total.to(DEVICE) - tok["dt_bias"]).contiguous()  # no softplus
    debug = torch.full(cache["hi"].shape, float("nan"), device=DEVICE)
    replay_flush(**cache, **tok, dt_softplus=False, window=window, seed=SEED,
                    debug_state=debug, check_counters=True)
    torch.cuda.synchronize()
    state = debug.cpu()
    amax = state.abs().amax(dim=(-2, -1))
    assert bool((amax[0] > 0).all()) and bool((amax[0] < 2688 * 2.0**-150).all()), amax[0]
    assert bool((amax[1] > 2688 * 2.0**-150).all()) and bool((amax[1] < 2.0**-126).all())
    want = expected_lo_bytes(state, "nvfp4")
    got = kernel_lo_bytes({k: v.cpu() for k, v in cache["lo"].items()}, "nvfp4")
    for key in want:
        mism = (want[key] != got[key]).nonzero()
        assert len(mism) == 0, f"lo[{key}]: {len(mism)} byte mismatches, first {mism[:3]}"
    assert bool((got["scales"][0] == 0x7E).any()) and not got["codes"][0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [NARROW, dict(nheads=4, headdim=128, dstate=128, ngroups=2)],
                         ids=["headdim24", "headdim128"])
def test_direct_fold_at_other_head_sizes(shape):
    """headdim 24 (three warps of 8 rows, registers capped for 10 CTAs an SM) and 128 (16
    warps, capped for 2), direct fold by default: codes lowprec's of the kernel's state."""
    check_flush(shape, 5, 16, torch.bfloat16, "fp16", "sr", "nvfp4", gen_seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", ["fma", "mma"])
def test_flush_of_256_column_heads_with_either_fold(fold):
    """dstate 256 at 64 elements a thread: a warp holds 8 rows, one a pass, 32 chunks each."""
    check_flush(WIDE, 3, 16, torch.bfloat16, "fp16", "sr", "nvfp4", gen_seed=9,
                elements_per_thread=64, fold=fold)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [2, 5])
def test_flush_at_short_windows(window):
    check_flush(ODD, 5, window, torch.float32, "fp16", "sr", "nvfp4", gen_seed=window)


# --------------------------------------------------------------------------------------------
# GPU: several windows through replay_decode_step


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant", [("fp16", "sr", "nvfp4"), ("fp32", "rn", "none")], ids=variant_id
)
def test_decode_steps_over_several_windows(variant):
    """40 steps (2.5 windows of 16) of 9 slots starting at random ring positions: at every
    step the slots with cursor 15 flush (codes bit for bit against lowprec of debug_state,
    S_new against the fp64 replay of the previous hi and the ring), the others produce
    lowprec.mamba2_replay_output's output from the read copy, and cursors and flush counters
    advance exactly once per step."""
    check_decode_windows(variant)


@pytest.mark.gpu
@pytest.mark.parametrize("sr", SR_SETTINGS, ids=sr_id)
def test_decode_steps_over_several_windows_with_each_sr_setting(sr):
    """The same 40 steps with the recurrence copy rounded with k random bits an element in R
    Philox rounds: every flush's fp16 bits are lowprec's and the emulation's (its Philox
    draws and rounding on the GPU) of the kernel's own state, its NVFP4 codes and scales
    too, over windows whose flush counters advance from random values."""
    check_decode_windows(("fp16", "sr", "nvfp4"), sr, gen_seed=6 + sr[0])


def check_decode_windows(variant, sr=DEFAULT_SR, gen_seed=5):
    hi_format, hi_rounding, lo_format = variant
    shape, slots, window, act = DECODE, 9, 16, torch.float32
    H, P, N = shape["nheads"], shape["headdim"], shape["dstate"]
    gen = torch.Generator().manual_seed(gen_seed)
    cache = random_cache(slots, shape, window, act, hi_format, lo_format, gen, [])
    cache["cursors"] = torch.randint(0, window, (slots,), generator=gen, dtype=torch.int32).to(
        DEVICE
    )
    # a consistent start: every slot's read copy is lowprec's copy of its hi
    hi0 = cache["hi"].float().cpu()
    if lo_format == "nvfp4":
        packed = q.pack(q.quantize(hi0, "nvfp4", "rn"))
        for k in ("codes", "scales", "global_scale"):
            cache["lo"][k].copy_(packed[k].to(DEVICE))
    steps_seen_flush = 0
    for _ in range(40):
        tok = random_token(slots, shape, act, gen)
        b = {
            k: (clone(v).cpu() if isinstance(v, torch.Tensor) else clone(v))
            for k, v in cache.items()
        }
        debug = torch.full((slots, H, P, N), float("nan"), device=DEVICE)
        out = torch.full((slots, H, P), float("nan"), dtype=act, device=DEVICE)
        decode_step(
            **cache,
            **tok,
            out=out,
            window=window,
            hi_format=hi_format,
            hi_rounding=hi_rounding,
            lo_format=lo_format,
            seed=SEED,
            debug_state=debug,
            sr_bits=sr[0],
            philox_rounds=sr[1],
        )
        torch.cuda.synchronize()
        flushing = b["cursors"] == window - 1
        cur = cache["cursors"].cpu()
        assert torch.equal(cur, torch.where(flushing, 0, b["cursors"] + 1))
        assert torch.equal(cache["flushes"].cpu(), b["flushes"] + flushing.int())
        assert not out.cpu().isnan().any(), "an output row was left unwritten"
        t = {k: v.cpu() for k, v in tok.items()}
        fs = flushing.nonzero().flatten()
        if len(fs):
            steps_seen_flush += 1
            state = debug.cpu()[fs]
            ring_x, ring_dt, ring_B = (cache[k].cpu()[fs] for k in ("ring_x", "ring_dt", "ring_B"))
            count = torch.full((len(fs),), window, dtype=torch.int64)
            ref = mamba2.mamba2_replay_flush(
                b["hi"][fs].double(),
                ring_x.double(),
                ring_dt.double(),
                ring_B.double(),
                count,
                t["A"].double(),
            )
            bound = state_bound(
                b["hi"][fs], ring_x, ring_dt, ring_B, t["A"], window, H // shape["ngroups"]
            )
            assert ((state.double() - ref).abs() <= bound).all()
            if hi_format == "fp16":
                rand = (philox.random_words(SEED, fs, b["flushes"][fs].long(), (H, P, N),
                                            sr_bits=sr[0], philox_rounds=sr[1])
                        if hi_rounding == "sr" else None)
                want = q.encode_bits(q.round_to(state, FP16, hi_rounding, rand, sr_bits=sr[0]),
                                     FP16)
                assert torch.equal(cache["hi"].cpu()[fs].view(torch.int16).long() & 0xFFFF, want)
                stored = {"hi": cache["hi"].cpu(),
                          "lo": {k: v.cpu() for k, v in (cache["lo"] or {}).items()}}
                _emulation_stores_the_same_codes(state, stored, fs, b, SEED, hi_format,
                                                 hi_rounding, lo_format, *sr)
            else:  # the fp32 recurrence copy: the unrounded state, as check_flush asserts
                assert torch.equal(cache["hi"].cpu()[fs], q.round_to(state, q.formats.FP32))
            if lo_format == "nvfp4":
                want = expected_lo_bytes(state, "nvfp4")
                got = kernel_lo_bytes({k: v.cpu()[fs] for k, v in cache["lo"].items()}, "nvfp4")
                for key in want:
                    assert torch.equal(want[key], got[key]), key
        ns = (~flushing).nonzero().flatten()
        if len(ns):
            if lo_format == "nvfp4":
                ckpt = q.dequantize(
                    q.unpack(
                        {k: v.cpu()[ns] for k, v in b["lo"].items()}, "nvfp4", (len(ns), H, P, N)
                    )
                ).double()
            else:
                ckpt = b["hi"][ns].double()
            count = (b["cursors"][ns] + 1).long()
            ring = {k: cache[k].cpu()[ns].double() for k in ("ring_x", "ring_dt", "ring_B")}
            y_ref = mamba2.mamba2_replay_output(
                ckpt,
                ring["ring_x"],
                ring["ring_dt"],
                ring["ring_B"],
                count,
                t["C"][ns].double(),
                t["x"][ns].double(),
                t["A"].double(),
                t["D"].double(),
                t["z"][ns].double(),
            )
            err = (out.cpu()[ns].double() - y_ref).abs()
            assert (err <= 1e-4 * (1 + y_ref.abs())).all(), err.max()
    assert steps_seen_flush >= 3


@pytest.mark.parametrize("lo_format, sr", [("nvfp4", (32, 10)), ("fp8_e4m3", DEFAULT_SR),
                                           ("nvfp4", (8, 4)), ("nvfp4", (13, 7))])
def test_emulation_comparison_accepts_lowprec_stores(lo_format, sr):
    """The direct CuTe-vs-emulation check of the GPU test, run here on stores made by lowprec
    (which the kernel must equal), with each SR setting's draws: it passes, fails on one
    flipped code byte, and (SR settings other than the default) on the default's draws."""
    gen = torch.Generator().manual_seed(4)
    slots, H, P, N, seed = 3, 2, 16, 32, 77
    state = torch.randn(slots, H, P, N, generator=gen) * torch.exp2(
        torch.randint(-6, 6, (slots, H, 1, 1), generator=gen).float()
    )
    fs = torch.tensor([0, 2])
    b = {"flushes": torch.tensor([5, 9, 11], dtype=torch.int32)}
    rand = philox.random_words(seed, fs, b["flushes"][fs].long(), (H, P, N), sr_bits=sr[0],
                               philox_rounds=sr[1])
    hi = q.encode_bits(q.round_to(state[fs], FP16, "sr", rand, sr_bits=sr[0]),
                       FP16).to(torch.int16)
    packed = q.pack(q.quantize(state[fs], lo_format, "rn"))
    lo = packed if lo_format == "nvfp4" else {"values": packed["codes"]}
    cpu = {
        "hi": torch.zeros(slots, H, P, N, dtype=torch.int16).index_copy(0, fs, hi)
        .view(torch.float16),
        "lo": {k: torch.zeros((slots, *v.shape[1:]), dtype=v.dtype).index_copy(0, fs, v)
               for k, v in lo.items()},
    }
    _emulation_stores_the_same_codes(state[fs], cpu, fs, b, seed, "fp16", "sr", lo_format, *sr)
    if sr != DEFAULT_SR:
        with pytest.raises(AssertionError, match="fp16 recurrence copies differ"):
            _emulation_stores_the_same_codes(state[fs], cpu, fs, b, seed, "fp16", "sr",
                                             lo_format)
    key = "codes" if lo_format == "nvfp4" else "values"
    cpu["lo"][key].view(torch.uint8).view(-1)[fs[1] * 7 + 3] ^= 1
    with pytest.raises(AssertionError, match="emulation and CuTe lo"):
        _emulation_stores_the_same_codes(state[fs], cpu, fs, b, seed, "fp16", "sr", lo_format,
                                         *sr)


# --------------------------------------------------------------------------------------------
# The decode step's launch: CTAs that loop over slots (slot_loop)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, sms", [(256, 132), (1, 132), (3, 132), (512, 132), (5000, 7)])
def test_decode_step_flush_fills_at_most_one_wave_and_never_overfills_a_cta(batch, sms):
    """decode_slot_ctas: at most one wave of CTAs (heads x slot CTAs <= resident) unless a
    CTA would then hold more slots than it has threads to load their decisions; never more
    slot CTAs than slots."""
    cfg = config(NEMOTRON, "fp16", "sr", "nvfp4", debug=False, elements_per_thread=32,
                 slot_loop=True)  # the decode step's flush (direct fold, 4 CTAs an SM)
    assert rf.resident_ctas_per_sm(cfg) == 4
    slot_ctas = rf.decode_slot_ctas(cfg, batch, sms)
    assert 1 <= slot_ctas <= batch
    assert -(-batch // slot_ctas) <= cfg.threads
    resident = sms * rf.resident_ctas_per_sm(cfg)
    if resident >= cfg.nheads and -(-batch // (resident // cfg.nheads)) <= cfg.threads:
        assert cfg.nheads * slot_ctas <= resident
    if batch == 256 and sms == 132:
        assert slot_ctas == 4  # 512 of 528 resident CTAs on the H200


class _HiOnly:
    """A stand-in cache for launch_flush's argument checks (they read hi's slot count)."""

    def __init__(self, hi):
        self.hi = hi


def test_slot_loop_compiles_and_leaves_the_one_slot_kernel_alone():
    """The looping kernel compiles for sm_90a with the slots' decisions staged in shared
    memory (one more barrier); the default kernel (one CTA a slot) reads its decision from
    global memory as before and has no loop; a kernel without the loop refuses fewer slot
    CTAs than slots."""
    base = config(NEMOTRON, "fp16", "sr", "nvfp4", window=16, debug=False)
    looped = rf.compile_flush(dataclasses.replace(base, slot_loop=True), keep_ptx=True).__ptx__
    plain = rf.compile_flush(base, keep_ptx=True).__ptx__
    assert looped.count("bar.sync") == plain.count("bar.sync") + 2  # decisions; between slots
    assert looped.count("st.shared.u32") + looped.count("st.shared.b32") > plain.count(
        "st.shared.u32") + plain.count("st.shared.b32")
    hi = torch.empty(8, 128, 64, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="one CTA a slot"):
        rf.launch_flush(base, _HiOnly(hi), *([None] * 11), slot_ctas=2)


def test_slot_table_kernel_compiles_like_the_one_slot_kernel_and_refuses_misuse():
    """slot_table: the CTA's slot is read from the caller's table (one more global load before
    the decision's), no loop and no extra barrier; it cannot be combined with slot_loop, and
    launch_flush wants the table exactly when the kernel takes one."""
    base = config(NEMOTRON, "fp16", "sr", "nvfp4", window=16, debug=False)
    tabled = dataclasses.replace(base, slot_table=True)
    plain_ptx = rf.compile_flush(base, keep_ptx=True).__ptx__
    table_ptx = rf.compile_flush(tabled, keep_ptx=True).__ptx__
    assert table_ptx.count("bar.sync") == plain_ptx.count("bar.sync")
    assert table_ptx.count("ld.global") == plain_ptx.count("ld.global") + 1
    with pytest.raises(ValueError, match="slot_table"):
        dataclasses.replace(base, slot_table=True, slot_loop=True)
    hi = torch.empty(8, 128, 64, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="takes the table"):
        rf.launch_flush(tabled, _HiOnly(hi), *([None] * 11))
    with pytest.raises(ValueError, match="needs FlushConfig.slot_table"):
        rf.launch_flush(base, _HiOnly(hi), *([None] * 11),
                        slot_table=torch.zeros(2, dtype=torch.int32))
    # an empty table launches nothing (and so needs no GPU)
    rf.launch_flush(tabled, _HiOnly(hi), *([None] * 11),
                    slot_table=torch.zeros(0, dtype=torch.int32))


def test_cpu_tensors_pass_every_check_but_the_device_one():
    """The flush and the decode step on CPU tensors: every argument check passes and the last
    one names the device (a CPU tensor must never reach torch.cuda or the kernel)."""

    args, window = cpu_args(shape=dict(nheads=4, headdim=16, dstate=128, ngroups=2))
    for entry in (replay_flush, decode_step):
        with pytest.raises(ValueError, match="cache.hi: expected a CUDA tensor"):
            entry(**args, window=window)


@pytest.mark.parametrize("shape, window, message", [
    (ODD, 8, r"cache.hi.shape\[2\] \(headdim\): expected a multiple of 16, got 24"),
    (dict(nheads=4, headdim=16, dstate=64, ngroups=2), 8,
     r"cache.hi.shape\[3\] \(dstate\): expected a multiple of 128"),
    (dict(nheads=4, headdim=16, dstate=128, ngroups=2), 1, "cache.window: expected an int in"),
])
def test_decode_step_checks_both_kernels_before_launching_either(monkeypatch, shape, window,
                                                                  message):
    """What only the non-flush kernel refuses (its headdim, dstate and window limits are
    narrower than the flush's) is refused before the flush is launched (else flushed slots
    would keep cursors that were never reset). Stand-ins for the device check and the
    launches show nothing was launched."""
    launched = []
    monkeypatch.setattr(kv, "require_cuda", lambda name, tensor: None)
    monkeypatch.setattr(rf, "launch_flush", lambda *a, **k: launched.append("flush"))
    monkeypatch.setattr(rf, "launch_advance_counters", lambda *a, **k: launched.append("adv"))
    args, _ = cpu_args(shape=shape, window=max(window, 2))
    with pytest.raises(ValueError, match=message):
        decode_step(**args, window=window)  # overlap_flush: the flush goes first
    assert launched == []


@pytest.mark.parametrize("table, message", [
    (torch.zeros(2, 2, dtype=torch.int32), "flush_slots: expected a 1-D int32 tensor"),
    ([0], "flush_slots: expected a 1-D int32 tensor"),
    (torch.zeros(1, dtype=torch.int64), "flush_slots: expected int32 on cpu, got torch.int64"),
    (torch.zeros(4, dtype=torch.int32), "flush_slots: expected at most 3 entries"),
    (torch.tensor([1], dtype=torch.int32),
     r"flush_slots: expected the slots at cursor 7: \[\], got \[1\]"),
])
def test_decode_step_checks_the_flush_table_before_the_device(table, message):
    """A bad `flush_slots` is named on CPU tensors, before the device check; with
    check_counters the table is compared with the cursors too."""

    args, window = cpu_args(shape=dict(nheads=4, headdim=16, dstate=128, ngroups=2))
    with pytest.raises(ValueError, match=message):
        decode_step(**args, window=window, flush_slots=table, check_counters=True)
    with pytest.raises(ValueError, match="cache.hi: expected a CUDA tensor"):
        decode_step(**args, window=window, flush_slots=torch.zeros(0, dtype=torch.int32),
                    check_counters=True)


def test_flush_of_no_slots_launches_nothing(monkeypatch):
    """replay_flush with zero slots returns its (empty) output without a compile or a launch,
    as the other entries do (a (nheads, 0) grid is refused by CUDA). Stand-ins for the device
    check and the launches show what would have run."""
    launched = []
    monkeypatch.setattr(kv, "require_cuda", lambda name, tensor: None)
    monkeypatch.setattr(rf, "launch_flush", lambda *a, **k: launched.append("flush"))
    monkeypatch.setattr(rf, "launch_advance_counters", lambda *a, **k: launched.append("adv"))
    args, window = cpu_args(slots=0)
    out = replay_flush(**args, window=window)
    assert launched == [] and out.shape == args["x"].shape


@pytest.mark.parametrize("flag", ["overlap_flush", "check_counters"])
def test_decode_step_switches_are_bools(flag):
    """A switch given as a word ("no") is refused, not read with bool()."""

    args, window = cpu_args(shape=dict(nheads=4, headdim=16, dstate=128, ngroups=2))
    with pytest.raises(ValueError, match=f"{flag}: expected a bool, got 'no'"):
        decode_step(**args, window=window, **{flag: "no"})


@pytest.mark.parametrize("name, output, message", [
    ("out", lambda a: a["x"], "out: expected a tensor apart from x, got one sharing x's memory"),
    ("out", lambda a: a["ring_x"][:, :, 0].contiguous(), None),  # a copy: apart
    ("out", lambda a: a["ring_x"].view(-1)[: a["x"].numel()].view(a["x"].shape),
     "out: expected a tensor apart from cache.ring_x"),
    ("debug_state", lambda a: a["hi"], "debug_state: expected a tensor apart from cache.hi"),
])
def test_an_output_sharing_an_input_s_memory_is_refused(name, output, message):
    """The flush appends x to the ring after storing y, and rewrites the state it reads: an
    output over an input's bytes would be read back changed (`out=x` stored y as the record;
    the emulation refuses the same). A separate buffer reaches the device check (CPU)."""
    args, window = cpu_args()
    formats = {}
    if name == "debug_state":  # the single-copy FP32 flush: its state is debug_state's dtype
        args["hi"], args["lo"] = args["hi"].float(), None
        formats = dict(hi_format="fp32", hi_rounding="rn", lo_format="none")
    args[name] = output(args)
    with pytest.raises(ValueError, match=re.escape(message or "cache.hi: expected a CUDA")):
        replay_flush(**args, window=window, **formats)
