"""cute_kernels/replay_output.py: the non-flush ReplaySSM step over a packed read copy.

CPU (CI): every configuration class compiles for sm_90a, its PTX reads the state with 128-bit
loads (and uses mma.sync where the design says so), the defaults pick what was measured
fastest, the E2M1 bit trick is exact for every nibble, and the public function rejects bad
arguments (the cache's included) with ValueErrors naming them.
GPU (marker ``gpu``): outputs against lowprec.mamba2.mamba2_replay_output in fp64 on the
dequantised read copy, ring records and cursors exactly, flush slots untouched, several
consecutive steps.
"""

import dataclasses
import re
import sys

import pytest
import torch

from cute_kernels import _compile
from cute_kernels import replay_output as ro
from cute_kernels import replay_output_config as roc
from cute_kernels.cache import ReplayCache
from lowprec.mamba2 import mamba2_process_dt, mamba2_replay_output
from lowprec.quantize import dequantize, pack, quantize

# name: (slots, nheads, headdim, dstate, ngroups, ring capacity, window)
SHAPES = {
    "nemotron": (6, 128, 64, 128, 8, 16, 16),
    "odd": (5, 12, 48, 256, 3, 9, 7),
}
# many slots: a grid of many waves when the GPU is taken to have 2 SMs
MANY_SLOTS = {"nemotron40": (40, 128, 64, 128, 8, 16, 16)}
FORMATS = roc.LO_FORMATS
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _config(fmt, shape, act="bf16", dt_dtype="fp32"):
    S, H, P, N, G, Lc, L = SHAPES[shape]
    return ro.ReplayOutputConfig(
        lo_format=fmt, act=act, dt_dtype=dt_dtype, nheads=H, headdim=P, dstate=N, ngroups=G,
        ring_capacity=Lc, window=L, has_D=True, has_z=True, has_dt_bias=True,
        dt_softplus=True, warps=ro.default_warps(H // G, fmt),
    )


# --------------------------------------------------------------------------------------------
# CPU: compilation and PTX


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_variant_compiles_for_sm90a_with_128bit_state_loads(fmt, shape):
    """The PTX targets sm_90a; the state is read only with ld.global.nc.v4 (16 bytes per lane),
    exactly once per element; the mma variants issue one m16n8k16 per 16 x 16 tile."""
    cfg = _config(fmt, shape)
    ptx = ro.compile_replay_output(cfg, keep_ptx=True).__ptx__
    assert ".target sm_90a" in ptx
    _, H, P, N, G, _, _ = SHAPES[shape]
    heads_per_warp = H // G // cfg.warps
    state_bytes = P * N * roc._BYTES_PER_ELEMENT[fmt] * heads_per_warp
    wide = ptx.count("ld.global.nc.L1::no_allocate.v4.u32")
    assert wide * 16 * 32 == state_bytes  # per warp: every state byte once, 16 per access
    assert "ld.local" not in ptx and "st.local" not in ptx
    mma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    if fmt == "fp32":
        assert mma == 0
    else:
        assert mma == P * N // 256 * heads_per_warp
    if fmt == "nvfp4":  # two E4M3 scale bytes per lane and row
        assert ptx.count("ld.global.nc.L1::no_allocate.u16") * 2 * 32 == state_bytes // 8


@pytest.mark.parametrize("fmt", ["nvfp4", "fp32"])
def test_head_splits_compile_with_a_share_of_the_heads_per_cta(fmt):
    """head_splits = 4 at the Nemotron shape: each CTA (4 warps for nvfp4, 2 for fp32) reads
    a quarter of its group's heads, still every state byte once with 16-byte loads."""
    warps = 4 if fmt == "nvfp4" else 2
    cfg = dataclasses.replace(_config(fmt, "nemotron"), warps=warps, head_splits=4)
    ptx = ro.compile_replay_output(cfg, keep_ptx=True).__ptx__
    _, H, P, N, G, _, _ = SHAPES["nemotron"]
    heads_per_warp = H // G // 4 // warps
    state_bytes = P * N * roc._BYTES_PER_ELEMENT[fmt] * heads_per_warp
    assert ptx.count("ld.global.nc.L1::no_allocate.v4.u32") * 16 * 32 == state_bytes
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_default_head_splits_pick_the_measured_fastest_grids():
    """The splits the H200 sweeps found fastest (default_head_splits' tables): Nemotron-3-Super
    one CTA per group from batch 64, two at 32, four (one head a warp) below; Mamba-2 2.7B
    (one group of 80 heads) 20 CTAs at batch 1, 2 at batch 512 (10 heads a warp, not 20).
    fp32: one head per warp at every batch."""
    sms = 132
    nemotron = {1: 4, 8: 4, 32: 2, 64: 1, 128: 1, 256: 1, 512: 1}
    for batch, splits in nemotron.items():
        assert ro.default_head_splits(batch, 8, 16, 4, sms) == splits, batch
    mamba = {1: 20, 8: 20, 32: 10, 128: 4, 256: 2, 512: 2}
    for batch, splits in mamba.items():
        assert ro.default_head_splits(batch, 1, 80, 4, sms) == splits, batch
    for batch in (1, 256, 512):
        assert ro.default_head_splits(batch, 8, 16, 8, sms, "fp32") == 2
        assert ro.default_head_splits(batch, 1, 80, 8, sms, "fp32") == 10


def test_default_head_splits_minimise_waves_times_heads_a_warp():
    """For every shape, batch and warps: the split divides the warp's heads, leaves at most
    MAX_HEADS_PER_WARP of them, and no other allowed split has fewer (waves x (heads a warp +
    1)); ties go to the fewer CTAs."""
    sms = 132
    for hpg, groups in ((16, 8), (80, 1), (24, 2), (48, 4), (40, 1)):
        for batch in [1, 2, 5, 8, 17, 32, 33, 64, 100, 128, 256, 512, 1000]:
            for warps in (1, 2, 4, 8):
                if hpg % warps:
                    continue
                per_warp = hpg // warps
                k = ro.default_head_splits(batch, groups, hpg, warps, sms)
                assert per_warp % k == 0 and per_warp // k <= roc.MAX_HEADS_PER_WARP

                resident = sms * max(1, 16 // warps)
                allowed = [s for s in range(1, per_warp + 1)
                           if per_warp % s == 0 and per_warp // s <= roc.MAX_HEADS_PER_WARP]
                cost = {s: -(-batch * groups * s // resident) * (per_warp // s + 1)
                        for s in allowed}
                assert cost[k] == min(cost.values())
                assert all(cost[s] > cost[k] for s in allowed if s < k)


def test_eager_loads_go_out_before_the_cursor_is_known():
    """eager_loads: the first head's read copy is loaded before the kernel's first branch
    (the cursor test), and no ring load is predicated on the cursor; without it the state
    loads wait for the cursor."""
    base = dataclasses.replace(_config("nvfp4", "nemotron"), head_splits=4)
    state = "ld.global.nc.L1::no_allocate.v4.u32"

    def before_first_branch(ptx):
        body = ptx[ptx.index(".entry"):]
        return body[:body.index(" bra")]

    eager = ro.compile_replay_output(dataclasses.replace(base, eager_loads=True),
                                     keep_ptx=True).__ptx__
    lazy = ro.compile_replay_output(base, keep_ptx=True).__ptx__
    assert before_first_branch(eager).count(state) == eager.count(state) > 0
    assert before_first_branch(lazy).count(state) == 0
    assert "@p ld.global" not in eager and "@p ld.global" in lazy


@pytest.mark.parametrize("argv, seen", [
    (["prog", "--h", "9"], ["prog"]),  # argparse would read --h as --help and exit
    (["prog", "--he", "-diagnostic", "fail", "--x"], ["prog", "-diagnostic", "fail"]),
    (["prog", "-diagnostic"], ["prog", "-diagnostic"]),
])
def test_the_callers_arguments_never_reach_cutes_parser(monkeypatch, argv, seen):
    """CuTe DSL parses sys.argv on every compile: a compile under the caller's `--h 9` printed
    CuTe's usage and exited. Through compile_cached the build sees only the program name and
    CuTe's own -diagnostic, a real compile finishes, and sys.argv is the caller's again."""
    monkeypatch.setattr("sys.argv", list(argv))
    observed = []
    _compile.compile_cached(("argv probe", tuple(argv)), lambda: observed.append(list(sys.argv)))
    assert observed == [seen] and sys.argv == argv
    if argv[1] == "--h":
        cfg = dataclasses.replace(_config("fp32", "odd"), window=5)  # not compiled before
        assert ro.compile_replay_output(cfg) is not None and sys.argv == argv
    _compile._CACHE.pop(("argv probe", tuple(argv)), None)


@pytest.mark.parametrize("fmt, with_decode", [("nvfp4", True), ("fp8_e4m3", False)])
def test_decay_weights_sit_beside_the_decode_for_nvfp4_only(fmt, with_decode):
    """nvfp4 works out a warp's decay weights after its first checkpoint term's tensor-core
    products (ptxas interleaves the chains); the other formats before them: the first exp
    comes after the first mma in the PTX exactly for nvfp4."""
    cfg = _config(fmt, "nemotron")
    assert (cfg.weights_placement == "with_decode") == with_decode
    ptx = ro.compile_replay_output(cfg, keep_ptx=True).__ptx__
    assert (ptx.index("ex2.approx") > ptx.index("mma.sync")) == with_decode


@pytest.mark.parametrize("shape, head_splits", [("nemotron", 1), ("nemotron", 4), ("odd", 1)])
def test_ring_stage_smem_copies_the_records_instead_of_loading_them(shape, head_splits):
    """ring_stage="smem" stages each head's ring records with zero-filling cp.async, 16 bytes
    a lane (ceil(pieces / 32) copies a head), and loads none of them into registers; the
    default ("registers") is the other way round."""
    S, H, P, N, G, Lc, L = SHAPES[shape]
    base = dataclasses.replace(_config("nvfp4", shape), head_splits=head_splits)
    assert base.ring_stage == "registers"
    staged = ro.compile_replay_output(dataclasses.replace(base, ring_stage="smem"),
                                      keep_ptx=True).__ptx__
    loaded = ro.compile_replay_output(base, keep_ptx=True).__ptx__
    zfill, ring_load = "cp.async.cg.shared.global [%r", "@p ld.global.u32"
    heads_a_warp = H // G // head_splits // base.warps
    pieces = (L - 2) * P * 2 // 16
    assert staged.count(zfill) == heads_a_warp * -(-pieces // 32)
    assert loaded.count(zfill) == 0
    # the prologue's ring B rows are predicated v2 loads; the records are one word a lane
    assert staged.count(ring_load) == 0 < loaded.count(ring_load)


@pytest.mark.parametrize("knobs, expected", [
    (dict(), "smem"),  # 16 heads a group, 4 warps: 4 heads a warp
    (dict(head_splits=2), "smem"), (dict(head_splits=4), "registers"),  # 2, then 1 a warp
    (dict(warps=2, head_splits=4), "smem"), (dict(lo_format="fp8_e4m3"), "registers"),
    (dict(lo_format="fp32", warps=8), "registers"), (dict(window=2), "registers"),
    (dict(window=8), "registers"), (dict(window=15), "registers"), (dict(window=32), "smem"),
    (dict(eager_loads=True), "smem"),
    (dict(window=32, warps=8), "registers"),  # 2 heads a warp, but 8 x 2 x 3,840 B > 32 KiB
    (dict(stage="bulk"), "smem"), (dict(stage="bulk", head_splits=4), "registers"),
    (dict(stage="bulk", window=32), "smem"),  # 4 warps x 2 stages x 8,448 B <= 96 KiB
    (dict(stage="bulk", window=32, warps=8), "registers"),  # 8 x 2 x 8,448 B > 96 KiB
])
def test_ring_stage_default_is_smem_where_a_warp_walks_several_nvfp4_heads(knobs, expected):
    """default_ring_stage stages the ring records through shared memory only for nvfp4, where
    a warp walks two heads or more (measured faster there, slower at one head a warp), and
    with a window of RING_STAGE_MIN_WINDOW or more, and only where the stages fit; the
    choice is a pure function of the configuration."""
    knobs = dict(knobs)
    cfg = _config(knobs.pop("lo_format", "nvfp4"), "nemotron")
    cfg = roc._with(cfg, **knobs)
    assert ro.default_ring_stage(cfg) == expected


def test_decay_weights_are_computed_for_a_warps_heads_at_once():
    """A warp's heads' decay weights come from one pass per 32 // segment heads (window 16:
    two heads a pass, a four-step suffix sum each; window 8: four heads, three steps), not
    one five-step scan per head; the epilogue reads each head's coefficients from shared
    memory (four 16-byte reads for 14 ring records), with no shuffle per record."""
    for window, steps, heads_a_pass in ((16, 4, 2), (8, 3, 4)):
        cfg = dataclasses.replace(_config("nvfp4", "nemotron"), warps=4, head_splits=1,
                                  window=window, ring_capacity=16)
        assert ro.ReplayOutput(cfg).segment == 32 // heads_a_pass
        ptx = ro.compile_replay_output(cfg, keep_ptx=True).__ptx__
        passes = -(-4 // heads_a_pass)  # 4 heads a warp
        assert ptx.count("shfl.sync.down.b32") == passes * (steps + 1)
        # each segment's total, and the DSL's broadcast of the shared-memory base
        assert ptx.count("shfl.sync.idx.b32") == passes + 1


@pytest.mark.parametrize("shape, warps", [("nemotron", 4), ("odd", 2), ("odd", 1)])
def test_bulk_stage_compiles_to_one_bulk_copy_per_piece_of_a_head(shape, warps):
    """stage='bulk': a head's codes, scales and ring records come in one bulk copy each, on
    one mbarrier a stage (BULK_STAGES a warp) and, for the first heads, their records on a
    barrier of their own (their read copies go out before the cursor is known); each head
    waits on its stage once (parity k // stages % 2), and nothing of the read copy or the
    records is loaded by the lanes or with cp.async."""
    _, H, P, N, G, _, _ = SHAPES[shape]
    cfg = dataclasses.replace(_config("nvfp4", shape), warps=warps, stage="bulk",
                              ring_stage="smem", eager_loads=True)
    ptx = ro.compile_replay_output(cfg, keep_ptx=True).__ptx__
    heads = H // G // warps
    stages = ro.BULK_STAGES
    first = min(stages, heads)
    assert ptx.count("cp.async.bulk.shared::cluster.global") == 3 * heads
    assert ptx.count("mbarrier.init") == 2 * stages
    assert ptx.count("mbarrier.arrive.expect_tx") == heads + first
    # a wait a head, one a first head's records, and a flush slot's on each first read copy
    assert ptx.count("mbarrier.try_wait.parity") == heads + 2 * first
    parities = re.findall(r"mbarrier\.try_wait\.parity\.shared::cta\.b64 p, \[%r\d+\], (\d)", ptx)
    assert parities.count("1") == sum(k // stages % 2 for k in range(heads))
    assert "ld.global.nc.L1::no_allocate.v4.u32" not in ptx
    assert "cp.async.cg.shared.global" not in ptx
    assert "@p ld.global.u32" not in ptx


def _model_config(nheads, ngroups, window, batch, **knobs):
    """The config replay_output builds at a model shape (64 x 128 heads, 4 warps) and batch
    on 132 SMs, before its stage default."""
    splits = ro.default_head_splits(batch, ngroups, nheads // ngroups, 4, 132)
    cfg = ro.ReplayOutputConfig(
        lo_format="nvfp4", act="bf16", dt_dtype="bf16", nheads=nheads, headdim=64, dstate=128,
        ngroups=ngroups, ring_capacity=window, window=window, has_D=True, has_z=True,
        has_dt_bias=True, dt_softplus=True, warps=4, head_splits=splits)
    return roc._with(cfg, **knobs)


def test_cta_shared_bytes_match_what_ncu_read():
    """The shared-memory model adds the kernel's allocations at their alignments; ncu read
    19.7 KB for the registers stage at the Nemotron layer (L = 16, the ring records staged)
    and 58.3 KB for a bulk stage at Mamba-2 2.7B's 10 heads a warp (58,304 bytes: the form
    without the first heads' ring barriers, 64 bytes fewer); the bulk stage at the Nemotron
    layer keeps 4 CTAs an SM, and at L = 32 does not."""
    default = _model_config(128, 8, 16, 256, ring_stage="smem")
    assert ro.cta_shared_bytes(default) == 19_648
    mamba_bulk = _model_config(80, 1, 16, 256, stage="bulk", ring_stage="smem", eager_loads=True)
    assert mamba_bulk.head_splits == 2 and ro.cta_shared_bytes(mamba_bulk) - 64 == 58_304
    per_sm = roc.SM_SHARED_BYTES // 4 - roc.CTA_RESERVED_BYTES
    for window, fits in ((16, True), (32, False)):
        bulk = _model_config(128, 8, window, 256, stage="bulk", ring_stage="smem",
                             eager_loads=True)
        assert (ro.cta_shared_bytes(bulk) <= per_sm) == fits


@pytest.mark.parametrize("nheads, ngroups, window, batch, knobs, expected", [
    (128, 8, 16, 256, {}, "bulk"), (128, 8, 16, 512, {}, "bulk"),  # 3.9 and 7.8 waves
    (128, 8, 16, 128, {}, "registers"),  # 1.9 waves
    (128, 8, 16, 1, {}, "registers"),
    (128, 8, 32, 512, {}, "registers"),  # 3 CTAs an SM
    (128, 8, 8, 512, {}, "registers"),  # ring records through registers at L = 8
    (80, 1, 16, 512, {}, "registers"),  # 10 heads a warp: 58.4 KB, 3 CTAs an SM
    (128, 8, 16, 256, dict(lo_format="fp8_e4m3"), "registers"),
])
def test_default_stage_is_bulk_on_grids_of_three_waves_where_four_ctas_fit(
        nheads, ngroups, window, batch, knobs, expected):
    """default_stage: the bulk stage with the eager loads where it was measured faster (the
    Nemotron layer at L = 16, batch 256 and 512), registers where it was not or is not
    allowed."""
    cfg = _model_config(nheads, ngroups, window, batch, **knobs)
    assert ro.default_stage(cfg, batch, 132) == expected


def test_fp32_activations_compile():
    """fp32 x/B/C/z (the exact-arm activations) compile too, with the same wide state loads."""
    cfg = _config("nvfp4", "odd", act="fp32")
    ptx = ro.compile_replay_output(cfg, keep_ptx=True).__ptx__
    assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx


@pytest.mark.parametrize("dt_dtype", ["bf16", "fp16"])
def test_half_precision_dt_compiles(dt_dtype):
    """A bf16 or fp16 raw dt (as serving stacks pass it) compiles: bf16 is loaded as 16 bits
    and shifted into an fp32, since nvvm has no scalar bf16 load."""
    cfg = _config("nvfp4", "nemotron", dt_dtype=dt_dtype)
    ptx = ro.compile_replay_output(cfg, keep_ptx=True).__ptx__
    assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx


def test_kappa_covers_each_lanes_elements_once():
    """Per chunk, the k offsets fed to the mma slots are a permutation of the lane's E
    loaded elements: every state element meets exactly one C value."""
    for fmt in ("nvfp4", "fp8_e4m3", "fp16"):
        k = ro.ReplayOutput(_config(fmt, "nemotron"))
        offsets = sorted(o for j in range(k.E // 4) for o in k._kappa(j))
        assert offsets == list(range(k.E))


def test_traffic_bytes_worked_example():
    """nvfp4, Nemotron layer, one slot, h = 8 (7 older records), bf16 activations, no z:
    per head 4096 + 512 + 4 (state) + 7 * 132 (ring x, dt) + 3 * 128 (x, out, append) + 8;
    per group 7 * 256 (ring B) + 3 * 256 (B, C, append); plus 8 bytes of cursor."""
    per_head = 4096 + 512 + 4 + 7 * 132 + 3 * 128 + 8
    expected = 128 * per_head + 8 * (7 * 256 + 3 * 256) + 8
    assert ro.traffic_bytes("nvfp4", 1, 128, 64, 128, 8, h=8) == expected
    fp32_state = 64 * 128 * 4
    assert ro.traffic_bytes("fp32", 1, 128, 64, 128, 8, h=8) == expected + 128 * (
        fp32_state - 4612
    )


def _cpu_cache(S=3, H=4, P=16, N=128, G=2, Lc=8, **changes):
    """A small nvfp4 cache on the CPU (the checks run there; the device check comes last)."""
    cache = ReplayCache.empty(S, H, P, N, ngroups=G, window=min(Lc, 8))
    for name, value in changes.items():
        setattr(cache, name, value)
    return cache


def _cpu_inputs(cache):
    S, H, P, N, G, _ = cache.shape
    gen = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    return dict(x=torch.randn(S, H, P, generator=gen).to(bf), dt=torch.randn(S, H, generator=gen),
                A=-torch.rand(H, generator=gen), B=torch.randn(S, G, N, generator=gen).to(bf),
                C=torch.randn(S, G, N, generator=gen).to(bf))


@pytest.mark.parametrize(
    "cache_change, input_change, message",
    [
        (dict(lo_format="nvfp8"), {}, "cache.lo_format"),
        (dict(ring_dt=torch.zeros(3, 4, 8, dtype=torch.bfloat16)), {},
         "cache.ring_dt: expected dtype"),
        (dict(ring_B=torch.zeros(3, 2, 7, 128, dtype=torch.bfloat16)), {},
         "cache.ring_B: expected shape"),
        (dict(window=9), {}, "window"),
        (dict(window=1), {}, "window"),
        (dict(cursors=torch.zeros(3, dtype=torch.int64)), {}, "cache.cursors: expected dtype"),
        (dict(lo=torch.zeros(3, 4, 16, 128, dtype=torch.uint8)), {}, "cache.lo: expected shape"),
        (dict(lo_scales=None), {}, "cache.lo_scales: expected a torch.Tensor"),
        (dict(lo_format="fp16"), {}, "cache.lo: expected dtype torch.float16"),
        (dict(hi=torch.zeros(3, 4, 8, 128, dtype=torch.float16)), {},
         "cache.ring_x: expected shape"),
        ({}, dict(A=torch.zeros(5)), "A: expected shape"),
        ({}, dict(C=torch.zeros(3, 3, 128, dtype=torch.bfloat16)), "C: expected shape"),
        ({}, dict(z=torch.zeros(3, 4, 16)), "z: expected dtype"),
        ({}, dict(x=torch.zeros(3, 4, 16, dtype=torch.float16)),
         "x: expected dtype torch.bfloat16"),
        ({}, dict(dt=torch.zeros(3, 4, device="meta")), "dt: expected device cpu"),
    ],
)
def test_invalid_arguments_raise_value_errors_naming_them(cache_change, input_change, message):
    """Each bad argument, the cache's fields included, is named with what was expected and
    what came (checked on CPU tensors: shape and dtype checks come before the device check)."""
    cache = _cpu_cache(**cache_change)
    args = {**_cpu_inputs(_cpu_cache()), **input_change}
    with pytest.raises(ValueError, match=re.escape(message)):
        ro.mamba2_replay_output(cache, **args)


def test_cpu_and_meta_caches_are_refused_by_name():
    """Every other check passes on the CPU and the device check names the cache; a meta
    cache is refused by name once its shapes pass, and tensors on two devices name the one
    off the cache's device."""
    cache = _cpu_cache()
    with pytest.raises(ValueError, match="cache.hi: expected a CUDA tensor"):
        ro.mamba2_replay_output(cache, **_cpu_inputs(cache))
    with pytest.raises(ValueError, match="cache.hi: expected a tensor with storage"):
        ReplayCache.empty(3, 4, 16, 128, ngroups=2, window=8, device="meta")
    mixed = _cpu_cache(hi=torch.empty(3, 4, 16, 128, dtype=torch.float16, device="meta"))
    with pytest.raises(ValueError, match="cache.ring_x: expected device meta"):
        ro.mamba2_replay_output(mixed, **_cpu_inputs(cache))


@pytest.mark.parametrize("knob, value, message", [
    ("head_splits", 3, r"warps \* head_splits"), ("stage", "smem", "stage"),
    ("ring_stage", "bogus", "ring_stage"), ("eager_loads", 1, "eager_loads"),
    ("dstate", 256, "config.dstate"),
])
def test_a_config_that_does_not_fit_the_arguments_is_refused(knob, value, message):
    """``config`` may change only the tuning knobs, to values the kernel has."""
    cache = _cpu_cache()
    args = _cpu_inputs(cache)
    cfg = ro.output_config(cache, args["x"], args["dt"])
    with pytest.raises(ValueError, match=message):
        bad = roc._with(cfg, **{knob: value})
        if knob != "dstate":
            bad = dataclasses.replace(bad)  # the config's own checks
        ro.mamba2_replay_output(cache, **args, config=bad)


def test_output_config_is_the_default_config_of_the_grid():
    """output_config gives default_config's choice for the cache's shape and SMs."""
    cache = _cpu_cache(S=3)
    args = _cpu_inputs(cache)
    cfg = ro.output_config(cache, args["x"], args["dt"], sm_count=132)
    assert cfg.lo_format == "nvfp4" and cfg.head_splits >= 1 and cfg.stage == "registers"
    problem = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if f.name not in ro.TUNING_FIELDS}
    assert ro.default_config(problem, 3, 132) == cfg


# --------------------------------------------------------------------------------------------
# GPU: against the lowprec reference


def _state(S, H, P, N, gen):
    """Random fp32 states with rows of different magnitude, a block 2^-14 below its row
    (NVFP4 scales 2^-9..2^-5: mostly f16-subnormal A operands) and a zero block."""
    st = torch.randn(S, H, P, N, generator=gen) * torch.exp(torch.randn(S, H, P, 1, generator=gen))
    st[:, :, 1, 16:32] *= 2.0**-14
    st[:, :, 3, 32:48] = 0.0
    return st


def _read_copy(fmt, st):
    """(lo dict for the kernel, dequantised read copy in fp64)."""
    if fmt == "fp32":
        return {"values": st.clone()}, st.double()
    if fmt == "fp16":
        return {"values": st.half()}, st.half().double()
    if fmt == "fp8_e4m3":
        q = quantize(st * 16.0, "fp8_e4m3")
        return pack(q), dequantize(q).double()
    q = quantize(st, "nvfp4")
    packed = pack(q)
    return {"codes": packed["codes"], "scales": packed["scales"],
            "global": packed["global_scale"]}, dequantize(q).double()


def _inputs(fmt, shape, act, seed):
    S, H, P, N, G, Lc, L = SHAPES[shape] if shape in SHAPES else MANY_SLOTS[shape]
    gen = torch.Generator().manual_seed(seed)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[act]
    lo, lo64 = _read_copy(fmt, _state(S, H, P, N, gen))
    cursors = torch.randint(0, L, (S,), generator=gen, dtype=torch.int32)
    cursors[0], cursors[-1] = 0, L - 1  # an empty ring and a flush slot at least
    if S > 2:
        cursors[1] = L - 2  # the last non-flush step
    held = torch.arange(Lc)[None, :] < cursors[:, None].long()  # [S, Lc]
    nan = float("nan")

    def ring(shape_, mask):  # records before the cursor, NaN after (never read)
        t = torch.randn(*shape_, generator=gen)
        return torch.where(mask, t, nan)

    t = dict(
        ring_x=ring((S, H, Lc, P), held[:, None, :, None]).to(dtype),
        ring_dt=ring((S, H, Lc), held[:, None, :]).abs() * 0.5,
        ring_B=ring((S, G, Lc, N), held[:, None, :, None]).to(dtype),
        cursors=cursors,
        x=torch.randn(S, H, P, generator=gen).to(dtype),
        dt=torch.randn(S, H, generator=gen) - 1.0,
        A=-torch.exp(torch.randn(H, generator=gen) * 0.5),
        B=torch.randn(S, G, N, generator=gen).to(dtype),
        C=torch.randn(S, G, N, generator=gen).to(dtype),
        D=torch.randn(H, generator=gen),
        z=torch.randn(S, H, P, generator=gen).to(dtype),
        dt_bias=torch.randn(H, generator=gen) * 0.1,
    )
    return lo, lo64, t


def _reference(lo64, t, window):
    """(y, magnitude, appended ring) in fp64; magnitude is the same sum over |terms|."""
    d = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    S = d["x"].shape[0]
    rows = torch.arange(S)
    cur = d["cursors"].long()
    dt_proc = mamba2_process_dt(d["dt"], d["dt_bias"], True)
    rx, rdt, rB = d["ring_x"].clone(), d["ring_dt"].clone(), d["ring_B"].clone()
    rx[rows, :, cur] = d["x"]
    rdt[rows, :, cur] = dt_proc
    rB[rows, :, cur] = d["B"]
    count = cur + 1
    y = mamba2_replay_output(lo64, rx, rdt, rB, count, d["C"], d["x"], d["A"], d["D"], d["z"])
    silu_abs = torch.nn.functional.silu(d["z"]).abs()
    mag = mamba2_replay_output(
        lo64.abs(), rx.abs(), rdt, rB.abs(), count, d["C"].abs(), d["x"].abs(), d["A"],
        d["D"].abs(), None,
    ) * silu_abs
    return y, mag, (rx, rdt, rB), dt_proc


def _report(name, got, want, tol):
    err = (got - want).abs()
    bad = ~(err <= tol)
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} outside tolerance "
            f"({int(torch.isnan(got).sum())} NaN); first at {idx}: got {float(got[idx])!r}, "
            f"want {float(want[idx])!r}, tol {float(tol[idx]):.3g}; worst error / tol "
            f"{float((err / tol).nan_to_num(float('inf')).max()):.3g}"
        )


def _check_step(lo64, t_before, t_after, out, window, act):
    """Outputs, ring records and cursors of one call against the reference."""
    y, mag, (rx, rdt, rB), dt_proc = _reference(lo64, t_before, window)
    cur = t_before["cursors"].long()
    live = cur + 1 < window
    # Tolerance. The kernel sums fp32 products (tensor-core products of f16 operands are
    # exact; C = f16 hi + lo is exact for bf16 C, within 2^-22 |C| for fp32 C) over at most
    # n = dstate + window terms: recursive fp32 summation errs by at most (n-1) 2^-24 sum|terms|
    # <= 2^-16 mag for n <= 272; tensor cores align and truncate, so allow 4x, plus exp and
    # softplus in fp32 (a few ulps on each decay, < 2^-20 relative): 2^-14 mag. The output is
    # then rounded to the activation dtype: half an ulp, at most 2^-8 (bf16: 7 stored
    # mantissa bits) or 2^-24 (fp32) of |y|; 2^-23 for fp32 leaves room for the fp32 sum.
    rel = {"bf16": 2.0**-8, "fp32": 2.0**-23}[act]
    tol = rel * y.abs() + 2.0**-14 * mag
    _report("out (non-flush slots)", out[live].double(), y[live], tol[live])
    if act == "fp32":
        # statistically the error is far below the bound: RMS relative error < 2^-16
        diff = out[live].double() - y[live]
        assert float(diff.norm() / y[live].norm()) < 2.0**-16
    assert torch.isnan(out[~live].float()).all(), "flush slots' outputs must not be written"
    # ring records: x and B bit for bit, dt to the fp32 softplus accuracy (a few ulps: 2^-19)
    rows = torch.nonzero(live).flatten()
    c = cur[rows]
    assert torch.equal(t_after["ring_x"][rows, :, c], t_before["x"][rows])
    assert torch.equal(t_after["ring_B"][rows, :, c], t_before["B"][rows])
    got_dt = t_after["ring_dt"][rows, :, c].double()
    _report("ring_dt", got_dt, dt_proc[rows], 2.0**-19 * dt_proc[rows].abs())
    # nothing else in the ring moved, flush slots included
    for name in ("ring_x", "ring_dt", "ring_B"):
        keep = torch.ones(t_after[name].shape[:3], dtype=torch.bool)
        keep[rows, :, c] = False
        a, b = t_after[name][keep], t_before[name][keep]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
    assert torch.equal(t_after["cursors"], torch.where(live, cur + 1, cur).int())


def _to_cuda(lo, t):
    return {k: v.cuda() for k, v in lo.items()}, {k: v.cuda() for k, v in t.items()}


def _cache(lo, t, fmt, window):
    """A ReplayCache over the test's tensors (shared: the step updates them in place); hi is
    a zero fp16 copy, which a non-flush step never reads."""
    S, H, Lc, P = t["ring_x"].shape
    N = t["ring_B"].shape[-1]
    device = t["x"].device
    values = lo.get("codes", lo.get("values"))
    if fmt == "fp8_e4m3" and values.dtype != torch.uint8:
        values = values.view(torch.uint8)
    return ReplayCache(
        hi=torch.zeros(S, H, P, N, dtype=torch.float16, device=device), lo=values,
        lo_scales=lo.get("scales"), lo_global=lo.get("global"), ring_x=t["ring_x"],
        ring_dt=t["ring_dt"], ring_B=t["ring_B"], cursors=t["cursors"],
        flushes=torch.zeros_like(t["cursors"]), lo_format=fmt, window=window)


def _call(lo, t, fmt, window, out, **knobs):
    """One step with the tuning knobs ``knobs`` (None: the default) on top of the defaults."""
    cache = _cache(lo, t, fmt, window)
    knobs = {k: v for k, v in knobs.items() if v is not None}
    config = None
    if knobs:
        config = dataclasses.replace(
            ro.output_config(cache, t["x"], t["dt"], t["D"], t["z"], t["dt_bias"]), **knobs)
    return ro.mamba2_replay_output(cache, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"],
                                   t["z"], t["dt_bias"], out=out, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_step_matches_reference_at_random_ring_positions(fmt, shape):
    """One call: outputs within the derived tolerance of the fp64 reference on the
    dequantised read copy, records appended bit for bit, cursors advanced, flush slots and
    every other ring entry untouched (outputs start as NaN)."""
    window = SHAPES[shape][-1]
    lo, lo64, t = _inputs(fmt, shape, "bf16", seed=hash((fmt, shape)) % 1000)
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    _call(lo_d, t_d, fmt, window, out)
    torch.cuda.synchronize()
    after = {k: v.cpu() for k, v in t_d.items()}
    _check_step(lo64, t, after, out.cpu(), window, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, warps, head_splits, shape", [
    ("nvfp4", 4, 1, "nemotron"), ("nvfp4", 4, 2, "nemotron"), ("nvfp4", 1, 16, "nemotron"),
    ("fp32", 8, 1, "nemotron"), ("fp32", 2, 4, "nemotron"), ("fp8_e4m3", 1, 4, "odd"),
])
def test_head_splits_keep_the_results(fmt, warps, head_splits, shape):
    """Spreading a group's heads over several CTAs changes only the schedule: outputs, the
    appended records (B once per group) and the cursors (one arrival per CTA) as with one CTA
    per group; a head_splits that does not divide the group's heads is refused."""
    window = SHAPES[shape][-1]
    lo, lo64, t = _inputs(fmt, shape, "bf16", seed=23)
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    _call(lo_d, t_d, fmt, window, out, warps=warps, head_splits=head_splits)
    torch.cuda.synchronize()
    _check_step(lo64, t, {k: v.cpu() for k, v in t_d.items()}, out.cpu(), window, "bf16")
    with pytest.raises(ValueError, match="head_splits"):
        _call(lo_d, t_d, fmt, window, out, warps=warps, head_splits=7)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp32"])
@pytest.mark.parametrize("shape", [
    (4, 16, 32, 128, 2, 32, 32),  # window 32: a head a pass, 2 passes a warp
    (5, 24, 32, 128, 2, 5, 3),  # window 3: 8 heads a pass, 3 of them real
    (3, 40, 16, 128, 1, 12, 11),  # window 11: 2 heads a pass, 10 (nvfp4) or 5 heads a warp
], ids=["window32", "window3", "window11"])
def test_decay_weights_of_a_warps_heads_at_other_windows(fmt, shape, monkeypatch):
    """The decay weights worked out for a warp's heads together (segments of 32, 4 and 16
    lanes; passes with lanes past the warp's last head) give the reference's step: outputs,
    records (this step's dt appended once) and cursors."""
    monkeypatch.setitem(SHAPES, "extra", shape)
    window = shape[-1]
    lo, lo64, t = _inputs(fmt, "extra", "bf16", seed=43)
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    _call(lo_d, t_d, fmt, window, out, head_splits=1)
    torch.cuda.synchronize()
    _check_step(lo64, t, {k: v.cpu() for k, v in t_d.items()}, out.cpu(), window, "bf16")


def _step_per_knob_value(lo, t, fmt, window, knob, values, knobs) -> dict:
    """value -> (tensors after, out) of one step from the same inputs with `knob` = value."""
    results = {}
    for value in values:
        lo_d, t_d = _to_cuda(lo, t)
        out = torch.full_like(t_d["x"], float("nan"))
        _call(lo_d, t_d, fmt, window, out, **{knob: value}, **knobs)
        torch.cuda.synchronize()
        results[value] = ({k: v.cpu() for k, v in t_d.items()}, out.cpu())
    return results


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bits as integers of its width (NaN compares equal to itself)."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_same_records(a: dict, b: dict) -> None:
    """The ring records and cursors two steps stored are bit for bit the same (unread
    entries hold NaN)."""
    for k in ("ring_x", "ring_dt", "ring_B", "cursors"):
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, shape, act, knobs", [
    ("nvfp4", "nemotron", "bf16", dict(head_splits=1)),  # 4 heads a warp: stages refilled
    ("nvfp4", "nemotron", "bf16", dict(head_splits=4)),  # one head a warp
    ("nvfp4", "odd", "bf16", dict(warps=1)),  # 4 heads a warp, 48-wide rows
    ("nvfp4", "odd", "fp32", dict(warps=1)),  # fp32 records: two words a lane and record
    ("fp8_e4m3", "odd", "bf16", dict(warps=1)), ("fp32", "nemotron", "bf16", dict(head_splits=1)),
])
def test_ring_stage_keeps_the_results(fmt, shape, act, knobs):
    """The ring records staged through shared memory or loaded into registers: both steps'
    outputs, records and cursors are the reference's, and the records and cursors they store
    are bit for bit the same. (The outputs are not compared bit for bit: in 2 of these 6
    builds they came out up to 5e-6 relative apart, 2026-11-30, cause not pinned down.)"""
    window = SHAPES[shape][-1]
    lo, lo64, t = _inputs(fmt, shape, act, seed=59)
    results = _step_per_knob_value(lo, t, fmt, window, "ring_stage", roc.RING_STAGES, knobs)
    (t_new, out_new), (t_old, out_old) = results["smem"], results["registers"]
    _check_step(lo64, t, t_new, out_new, window, act)
    _check_step(lo64, t, t_old, out_old, window, act)
    _assert_same_records(t_new, t_old)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    (4, 16, 32, 128, 2, 32, 32),  # window 32: 30 records a head, 30 KB of stages a CTA
    (5, 24, 32, 128, 2, 5, 3),  # window 3: one record a head
], ids=["window32", "window3"])
def test_ring_stage_at_other_windows(shape, monkeypatch):
    """Staged ring records at the longest and shortest windows give the reference's step."""
    monkeypatch.setitem(SHAPES, "extra", shape)
    window = shape[-1]
    lo, lo64, t = _inputs("nvfp4", "extra", "bf16", seed=61)
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    _call(lo_d, t_d, "nvfp4", window, out, ring_stage="smem", head_splits=1)
    torch.cuda.synchronize()
    _check_step(lo64, t, {k: v.cpu() for k, v in t_d.items()}, out.cpu(), window, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, act, knobs", [
    ("nemotron", "bf16", dict(head_splits=1)),  # 4 heads a warp: each stage refilled
    ("nemotron", "bf16", dict(warps=1, head_splits=4)),  # 4 heads a warp, 2 stages
    ("nemotron", "bf16", dict(head_splits=4)),  # one head a warp
    ("odd", "bf16", dict(warps=1)),  # 4 heads a warp, 48-wide rows, 7,424-byte stages
    ("odd", "fp32", dict(warps=2, head_splits=1)),  # fp32 records
])
def test_bulk_stage_keeps_the_results(shape, act, knobs):
    """The read copy (and ring records) brought in by the bulk copy engine give the same
    step as loading them into registers: both are the reference's, and the records and
    cursors they store are bit for bit the same. The test's ring holds NaN past each slot's
    cursor and its first slot has an empty ring, so a stage tail that is not zeroed, or a
    stale stage read before its copy landed, shows."""
    window = SHAPES[shape][-1]
    lo, lo64, t = _inputs("nvfp4", shape, act, seed=67)
    (t_new, out_new), = _step_per_knob_value(
        lo, t, "nvfp4", window, "stage", ("bulk",),
        dict(knobs, ring_stage="smem", eager_loads=True)).values()
    (t_old, out_old), = _step_per_knob_value(
        lo, t, "nvfp4", window, "stage", ("registers",),
        dict(knobs, ring_stage="registers", eager_loads=False)).values()
    _check_step(lo64, t, t_new, out_new, window, act)
    _check_step(lo64, t, t_old, out_old, window, act)
    _assert_same_records(t_new, t_old)


@pytest.mark.gpu
def test_default_bulk_stage_on_a_many_wave_grid_keeps_the_results(monkeypatch):
    """Where default_stage picks the bulk stage with the eager loads and late_dots (here: the
    Nemotron layer on a GPU taken to have 2 SMs, so that 40 slots make 320 CTAs, 40 waves),
    replay_output runs it when no stage is asked for, and the step is the reference's, with
    the records and cursors of the registers stage bit for bit."""
    monkeypatch.setitem(roc._SM_COUNT, torch.cuda.current_device(), 2)
    shape = "nemotron40"
    S, H, _, _, G, _, window = MANY_SLOTS[shape]
    monkeypatch.setitem(SHAPES, shape, MANY_SLOTS[shape])
    assert ro.default_stage(_model_config(H, G, window, S), S, 2) == "bulk"
    lo, lo64, t = _inputs("nvfp4", shape, "bf16", seed=73)
    monkeypatch.setattr(_compile, "_CACHE", {})  # to see which kernel the default call built
    (t_new, out_new), = _step_per_knob_value(lo, t, "nvfp4", window, "stage", (None,),
                                             {}).values()
    built = [key[1] for key in _compile._CACHE if key[0] == "replay_output"]
    assert [(c.stage, c.eager_loads, c.ring_stage, c.late_dots) for c in built] == [
        ("bulk", True, "smem", True)]
    (t_old, out_old), = _step_per_knob_value(lo, t, "nvfp4", window, "stage", ("registers",),
                                             dict(eager_loads=False)).values()
    _check_step(lo64, t, t_new, out_new, window, "bf16")
    _check_step(lo64, t, t_old, out_old, window, "bf16")
    _assert_same_records(t_new, t_old)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    (4, 16, 32, 128, 2, 32, 32),  # window 32: 30 records a head, 8,448-byte stages
    (5, 24, 32, 128, 2, 5, 3),  # window 3: one record a head
], ids=["window32", "window3"])
def test_bulk_stage_at_other_windows(shape, monkeypatch):
    """Bulk-staged read copy and ring records at the longest and shortest windows give the
    reference's step."""
    monkeypatch.setitem(SHAPES, "extra", shape)
    window = shape[-1]
    lo, lo64, t = _inputs("nvfp4", "extra", "bf16", seed=71)
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    _call(lo_d, t_d, "nvfp4", window, out, stage="bulk", ring_stage="smem", head_splits=1)
    torch.cuda.synchronize()
    _check_step(lo64, t, {k: v.cpu() for k, v in t_d.items()}, out.cpu(), window, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp32"])
def test_fp32_activations_match_reference_tightly(fmt):
    """With fp32 x, B, C, z the output keeps fp32 precision (C split into f16 hi + lo)."""
    window = SHAPES["odd"][-1]
    lo, lo64, t = _inputs(fmt, "odd", "fp32", seed=7)
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    _call(lo_d, t_d, fmt, window, out)
    torch.cuda.synchronize()
    _check_step(lo64, t, {k: v.cpu() for k, v in t_d.items()}, out.cpu(), window, "fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_consecutive_steps_fill_the_ring(fmt):
    """window + 1 consecutive calls with fresh x, dt, B, C, z: each matches the reference on
    the ring the previous calls wrote; slots reaching a flush stop there (cursor window-1)."""
    shape = "odd"
    window = SHAPES[shape][-1]
    lo, lo64, t = _inputs(fmt, shape, "bf16", seed=11)
    lo_d, t_d = _to_cuda(lo, t)
    gen = torch.Generator().manual_seed(12)
    for _ in range(window + 1):
        for k in ("x", "B", "C", "z"):
            t_d[k] = torch.randn(t_d[k].shape, generator=gen).to(t_d[k].dtype).cuda()
        t_d["dt"] = (torch.randn(t_d["dt"].shape, generator=gen) - 1.0).cuda()
        before = {k: v.cpu().clone() for k, v in t_d.items()}
        out = torch.full_like(t_d["x"], float("nan"))
        _call(lo_d, t_d, fmt, window, out)
        torch.cuda.synchronize()
        _check_step(lo64, before, {k: v.cpu() for k, v in t_d.items()}, out.cpu(), window,
                    "bf16")


@pytest.mark.gpu
def test_step_replays_in_a_cuda_graph():
    """The launch uses torch's current stream: a captured step replays with the same result."""
    fmt, shape = "nvfp4", "nemotron"
    window = SHAPES[shape][-1]
    lo, lo64, t = _inputs(fmt, shape, "bf16", seed=3)
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    _call(lo_d, t_d, fmt, window, out)  # compile outside the capture
    torch.cuda.synchronize()
    start = {k: v.clone() for k, v in t_d.items()}
    for k, v in start.items():
        t_d[k].copy_(v)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            _call(lo_d, t_d, fmt, window, out)
    for k, v in start.items():
        t_d[k].copy_(v)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check_step(lo64, {k: v.cpu() for k, v in start.items()},
                {k: v.cpu() for k, v in t_d.items()}, out.cpu(), window, "bf16")


@pytest.mark.gpu
def test_tiny_nvfp4_blocks_reach_the_output():
    """A block 2^-14 below its row (E4M3 scales 2^-9..2^-5, so most f16 A operands are
    subnormal) is not flushed by the tensor cores: with C non-zero only on that block, B = 0,
    an empty ring and no D or z, row 1's output is g * (S_lo C) of that block alone."""
    fmt, shape = "nvfp4", "nemotron"
    window = SHAPES[shape][-1]
    lo, lo64, t = _inputs(fmt, shape, "bf16", seed=5)
    t["cursors"].zero_()
    t["B"].zero_()
    mask = torch.zeros(t["C"].shape[-1], dtype=torch.bool)
    mask[16:32] = True
    t["C"] = torch.where(mask, t["C"], torch.zeros((), dtype=t["C"].dtype))
    lo_d, t_d = _to_cuda(lo, t)
    out = torch.full_like(t_d["x"], float("nan"))
    ro.mamba2_replay_output(_cache(lo_d, t_d, fmt, window), t_d["x"], t_d["dt"], t_d["A"],
                            t_d["B"], t_d["C"], None, None, t_d["dt_bias"], out=out)
    torch.cuda.synchronize()
    d = {k: v.double() for k, v in t.items() if v.is_floating_point()}
    dt_proc = mamba2_process_dt(d["dt"], d["dt_bias"], True)
    g = torch.exp(d["A"] * dt_proc)  # [S, H]
    C_h = d["C"].repeat_interleave(t["x"].shape[1] // t["C"].shape[1], dim=1)
    y1 = g * torch.einsum("shk,shk->sh", lo64[:, :, 1], C_h)
    assert float((y1 != 0).double().mean()) > 0.5 and float(y1.abs().max()) < 1e-2
    got = out[:, :, 1].double().cpu()
    # bf16 output: half an ulp (<= 2^-8 |y|) plus fp32 summation (2^-14 of the magnitude)
    mag = g * torch.einsum("shk,shk->sh", lo64[:, :, 1].abs(), C_h.abs())
    _report("row 1", got, y1, 2.0**-8 * y1.abs() + 2.0**-14 * mag)


def test_default_warps_follow_the_measured_best_per_format():
    """4 warps for the tensor-core read copies (nvfp4, fp8), 8 for fp16 and the fp32 SIMT
    decode (measured on the H200, see default_warps); a divisor of the group's heads."""
    assert [ro.default_warps(16, f) for f in ("nvfp4", "fp8_e4m3", "fp16", "fp32")] == [4, 4, 8, 8]
    assert ro.default_warps(80, "fp32") == 8 and ro.default_warps(6, "fp32") == 2
    assert ro.default_warps(6, "nvfp4") == 2 and ro.default_warps(5, "nvfp4") == 1


@pytest.mark.parametrize("batch, fmt, knobs, expected", [
    (1, "nvfp4", dict(head_splits=4), True), (32, "nvfp4", dict(head_splits=2), True),  # 512
    # CTAs: one wave; with the ring records through registers at most 2 heads a warp
    (32, "nvfp4", dict(head_splits=1), False),
    (32, "nvfp4", dict(head_splits=1, ring_stage="smem"), True),
    (33, "nvfp4", dict(head_splits=2), True),  # 528 CTAs: 132 SMs x 4, exactly one wave
    (34, "nvfp4", dict(head_splits=2), False), (256, "nvfp4", {}, False),
    (1, "fp32", {}, True), (64, "fp32", dict(head_splits=2), False),
    (1, "fp8_e4m3", {}, False), (1, "fp16", {}, False),
    (1, "nvfp4", dict(stage="bulk"), False),
])
def test_eager_loads_default_on_one_wave_grids_of_nvfp4_and_fp32(batch, fmt, knobs, expected):
    """default_eager_loads turns the eager loads on where they were measured faster: nvfp4 and
    fp32 read copies on a grid of at most one wave of resident CTAs (132 SMs here, 16 warps an
    SM), not where a warp walks more than 2 heads with the ring records through registers
    (Mamba-2 2.7B at L = 8, batch 256: 10 heads a warp, 35% slower), and only where the other
    knobs allow them."""
    cfg = roc._with(_config(fmt, "nemotron"), **knobs)
    assert ro.default_eager_loads(cfg, batch, 132) is expected


def test_window_two_compiles():
    """At the shortest window (2: no ring record is ever read) the epilogue's record loop is
    empty and the step still compiles for sm_90a."""
    cfg = ro.ReplayOutputConfig(
        lo_format="nvfp4", act="bf16", dt_dtype="fp32", nheads=24, headdim=32, dstate=128,
        ngroups=2, ring_capacity=5, window=2, has_D=True, has_z=True, has_dt_bias=True,
        dt_softplus=True, warps=4)
    assert ro.compile_replay_output(cfg) is not None


@pytest.mark.parametrize("output, message", [
    (lambda c, a: a["x"], "out: expected a tensor apart from x, got one sharing x's memory"),
    (lambda c, a: c.ring_x.view(-1)[: a["x"].numel()].view(a["x"].shape),
     "out: expected a tensor apart from cache.ring_x"),
    (lambda c, a: c.lo.view(-1)[: 2 * a["x"].numel()].view(torch.bfloat16).view(a["x"].shape),
     "out: expected a tensor apart from cache.lo"),
    (lambda c, a: torch.zeros_like(a["x"]), "cache.hi: expected a CUDA tensor"),  # apart
])
def test_out_sharing_an_input_s_memory_is_refused(output, message):
    """The step appends x to the ring after storing y: `out=x` would store y as the record
    (the emulation refuses the same); `out` over the ring or the read copy would be read back
    changed by later CTAs. A separate buffer reaches the device check (CPU tensors)."""
    cache = _cpu_cache()
    args = _cpu_inputs(cache)
    with pytest.raises(ValueError, match=re.escape(message)):
        ro.mamba2_replay_output(cache, **args, out=output(cache, args))


@pytest.mark.parametrize("name", ["x", "B"])
def test_an_input_inside_the_cache_is_refused_naming_both(name):
    """An input that is a view of a cache tensor (here of cache.hi) would be overwritten by
    the step before it is read: refused, naming the input and the cache tensor."""
    cache = _cpu_cache()
    args = _cpu_inputs(cache)
    args[name] = cache.hi.view(-1)[: args[name].numel()].view(torch.bfloat16)[
        : args[name].numel()].view(args[name].shape)
    with pytest.raises(ValueError, match=re.escape(f"{name}: expected a tensor apart from "
                                                   "cache.hi")):
        ro.mamba2_replay_output(cache, **args)
