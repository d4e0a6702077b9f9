"""cute_kernels/gdn_replay_{output,flush,decode}.py: the GDN ReplaySSM kernels against lowprec
and the emulation.

CPU: each kernel (non-flush `gdn_output`, `gdn_flush`, the counter kernel) compiles for sm_90a
in both pairings (fp16 SR + nvfp4, fp32 + none) with the state accesses the design relies on;
bad arguments raise ValueErrors naming them; the byte counts are the ones stated.

GPU (marker `gpu`): every step of several windows, from slots at random ring positions (so
flushes happen at different steps), is checked against lowprec on the CuTe cache it started
from by the emulation tests' own checker (`gdn_emulation_cases.run_and_check_step`, the
packed cache mirrored into an emulation-shaped twin): u and y within the emulation's derived
fp32 bounds, the unrounded new state within the flush bound, and at flush slots the stored
fp16 hi bits, NVFP4 codes, scale bytes and s_g equal lowprec's from the kernel's own
unrounded state (`debug_state`); the record at the slot's own ring position, counters moved.
The emulation's quantiser and Philox words (Triton, on the GPU) give the same bytes from that
state, and the emulation's own step stores the same codes wherever its unrounded state has
the same bits.
"""

import math
import os
import re

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cute_kernels import gdn_cache as gc  # noqa: E402
from cute_kernels import gdn_replay_decode as gd  # noqa: E402
from cute_kernels import gdn_replay_flush as gf  # noqa: E402
from cute_kernels import gdn_replay_output as go  # noqa: E402
from cute_kernels import numerics as nm  # noqa: E402
from lowprec import quantize as lq  # noqa: E402
from lowprec.formats import E2M1, E4M3, FP16  # noqa: E402

DEVICE = torch.device("cuda")
TWO_COPY = ("fp16", "sr", "nvfp4")
PAIRINGS = [pytest.param(TWO_COPY, id="fp16sr-nvfp4"),
            pytest.param(("fp16", "rn", "nvfp4"), id="fp16rn-nvfp4"),
            pytest.param(("fp32", "rn", "none"), id="fp32-single-copy")]
QWEN = dict(nheads=32, dv=128, dk=128)  # Qwen3-Next GDN layer (one key per value head)
ODD = dict(nheads=3, dv=48, dk=128)  # 96 threads, 12 rows a pass
WIDE = dict(nheads=2, dv=32, dk=256)  # a row is 16 lanes
ACTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config(shape, pairing, window=16, act="bf16", debug=False):
    hi, rounding, lo = pairing
    return gf.GDNConfig(nheads=shape["nheads"], dv=shape["dv"], dk=shape["dk"], window=window,
                        hi_format=hi, hi_rounding=rounding, lo_format=lo, act=act,
                        has_debug=debug)


def ptx_counts(ptx: str) -> dict:
    counts = {}
    for m in re.finditer(r"^\s*(?:@!?%p\d+\s+)?([a-z]+\.[a-z0-9.]+)", ptx, re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


# --------------------------------------------------------------------------------------------
# CPU: compile checks


BULK_COPY = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"


@pytest.mark.parametrize("pairing, heads_per_cta", [
    pytest.param(TWO_COPY, 1, id="fp16sr-nvfp4-1head"),
    pytest.param(TWO_COPY, 4, id="fp16sr-nvfp4-4heads"),
    pytest.param(TWO_COPY, 16, id="fp16sr-nvfp4-16heads"),
    pytest.param(("fp32", "rn", "none"), 1, id="fp32-single-copy-1head"),
])
def test_gdn_output_kernel_compiles_for_sm90a_with_one_load_per_block(pairing, heads_per_cta):
    """Non-flush kernel at the Qwen3-Next head (the mma form: 128 threads, a warp two 16-row
    stripes; the fp32 copy's ffma form: 256 threads, 4 passes). Every head's pieces
    come by the bulk copy engine on an mbarrier, a stage and a barrier for each of the first
    min(2, heads): 7 copies (codes, scales, ring u, ring k, k, q, v; 5 without the codes and
    scales) where the first heads are issued (the codes and scales before the cursor is read)
    and in the loop past them; one wait a head in the loop, and with nvfp4 one more a first
    head where a slot past the window waits for its codes before it exits. nvfp4 (the mma
    form at this head) reads each lane's codes from
    shared memory as two 128-bit loads, no state from global memory; the fp32 single
    copy reads 64 B a pass as four 128-bit global loads (16); no state store."""
    cfg = config(QWEN, pairing)
    ptx = go.compile_gdn_output(cfg, keep_ptx=True, heads_per_cta=heads_per_cta).__ptx__
    n = ptx_counts(ptx)
    sites = min(2, heads_per_cta) + (1 if heads_per_cta > 2 else 0)
    pieces = 7 if pairing[2] == "nvfp4" else 5
    assert ptx.count(BULK_COPY) == pieces * sites, ptx.count(BULK_COPY)
    first = min(2, heads_per_cta)
    assert ptx.count("mbarrier.init.shared::cta.b64") == first
    waits = 1 + (first if pairing[2] == "nvfp4" else 0)
    assert ptx.count("mbarrier.try_wait.parity") == waits, ptx.count("mbarrier.try_wait.parity")
    assert ptx.count("mbarrier.expect_tx.relaxed") == (first if pairing[2] == "nvfp4" else 0)
    if go.dots_of(cfg) == "mma":  # a lane's two rows of codes a stripe: two 128-bit loads
        stripes = cfg.dv // 16 // (go.cta_threads(cfg, "mma") // 32)
        assert stripes == 2 and n.get("ld.shared.v4.u32", 0) == 2 * stripes, n
        assert n.get("ld.global.v2.b32", 0) == 0 and n.get("ld.global.v4.b32", 0) == 0, n
    elif pairing[2] == "nvfp4":
        assert n.get("ld.shared.v2.b32", 0) >= cfg.passes, n
        assert n.get("ld.shared.b8", 0) == cfg.passes, n
        assert n.get("ld.global.v2.b32", 0) == 0 and n.get("ld.global.v4.b32", 0) == 0, n
    else:
        assert n.get("ld.global.v4.b32", 0) >= 4 * cfg.passes, n
    assert n.get("st.global.v4.b32", 0) == 0, "the non-flush kernel stores no state"


def test_gdn_output_takes_one_stage_where_two_do_not_fit():
    """nvfp4 with fp32 activations at dv 128, dk 512, L = 32: two stages of 118,144 B would
    pass an H100's 227 KiB a CTA; one stage, one barrier, the head's bytes copied after the
    head before it (one issue site in the loop)."""
    cfg = config(dict(nheads=8, dv=128, dk=512), TWO_COPY, window=32, act="fp32")
    assert go.stage_count(cfg, 4) == 1 and go.cta_shared_bytes(cfg, 4, 2) > 227 * 1024
    assert go.cta_shared_bytes(cfg, 4) <= go.CTA_SHARED_LIMIT
    ptx = go.compile_gdn_output(cfg, keep_ptx=True, heads_per_cta=4).__ptx__
    assert ptx.count("mbarrier.init.shared::cta.b64") == 1
    assert ptx.count(BULK_COPY) == 7 * 2


def test_gdn_stage_pieces_are_bulk_copies_for_every_allowed_head():
    """Every piece of a stage (and so every head row's global offset of it) is a multiple of
    16 bytes, and a CTA's shared memory fits 227 KiB, for every head shape the cache takes
    (dv a multiple of 16, dk 128, 256, 512, dv dk <= 65,536), activation and window; at the
    Qwen3-Next head, bf16, L = 16: a stage of 20,736 B."""
    for dk in (128, 256, 512):
        for dv in range(16, 65536 // dk + 1, 16):
            for act in ("bf16", "fp32"):
                for window in (1, 2, 5, 16, 31, 32):
                    for pairing in (TWO_COPY, ("fp32", "rn", "none")):
                        cfg = config(dict(nheads=16, dv=dv, dk=dk), pairing, window, act)
                        pieces = go.stage_bytes(cfg)
                        assert all(b % 16 == 0 and b > 0 for b in pieces.values()), pieces
                        assert go.cta_shared_bytes(cfg, 16) <= go.CTA_SHARED_LIMIT, cfg
    offsets, stride = go.stage_offsets(config(QWEN, TWO_COPY, act="bf16"))
    assert stride == 20736 and offsets["scales"] == 8192 and offsets["v"] == 20480


@pytest.mark.parametrize("pairing", PAIRINGS[::2])
def test_gdn_flush_kernel_compiles_for_sm90a_with_128_bit_state_accesses(pairing):
    """Flush kernel at the Qwen3-Next head: hi read and written as 128-bit accesses (fp16: 2
    a pass each way, fp32: 4), nvfp4 codes one 64-bit store a block, correctly rounded
    divisions only (div.rn; the E2M1 quotients' exact fallback)."""
    cfg = config(QWEN, pairing, debug=True)
    ptx = gf.compile_gdn_flush(cfg, keep_ptx=True).__ptx__
    n = ptx_counts(ptx)
    per_pass = 2 if pairing[0] == "fp16" else 4
    debug_stores = 4 * cfg.passes
    assert n.get("st.global.v4.b32", 0) == per_pass * cfg.passes + debug_stores, n
    assert n.get("ld.global.v4.b32", 0) >= per_pass * cfg.passes, n
    if pairing[2] == "nvfp4":
        assert n.get("st.global.v2.b32", 0) == cfg.passes, n
        assert n.get("st.global.b8", 0) == cfg.passes, n
    assert "div.approx" not in ptx and "div.full" not in ptx


@pytest.mark.parametrize("shape, pairing", [(QWEN, TWO_COPY), (ODD, ("fp32", "rn", "none"))],
                         ids=["qwen-fp16sr-nvfp4", "dv48-fp32"])
def test_the_staged_window_takes_the_records_out_of_the_folds_global_loads(shape, pairing):
    """The staged window: the window's k, v, exp(g), beta go to shared memory before the first
    barrier; the fold then reads its records there (a shared load a record and pass at
    least), the global loads left being the state's, the staging's, q's and the record's:
    fewer than half the unstaged kernel's."""
    cfg = config(shape, pairing, window=16)
    plain = ptx_counts(gf.compile_gdn_flush(cfg, keep_ptx=True, staged_window=False).__ptx__)
    ptx = gf.compile_gdn_flush(cfg, keep_ptx=True, staged_window=True).__ptx__
    staged = ptx_counts(ptx)
    loads = lambda n: sum(c for op, c in n.items() if op.startswith("ld.global"))  # noqa: E731
    shared = sum(c for op, c in staged.items() if op.startswith("ld.shared"))
    assert shared >= cfg.window * cfg.passes, staged
    assert 2 * loads(staged) < loads(plain), (loads(staged), loads(plain))
    assert staged.get("bar.sync", 0) == plain.get("bar.sync", 0) + 1, staged
    # a window too large for 48 KiB of shared memory compiles unstaged
    wide = config(dict(nheads=1, dv=16, dk=512), pairing, window=32, act="fp32")
    assert gf.staged_window_bytes(wide) > gf.STAGED_WINDOW_BYTES
    big = gf.compile_gdn_flush(wide, keep_ptx=True, staged_window=True).__ptx__
    assert big == gf.compile_gdn_flush(wide, keep_ptx=True, staged_window=False).__ptx__


@pytest.mark.slow
@pytest.mark.parametrize("shape, window",
                         [(ODD, 5), (WIDE, 3), (dict(nheads=1, dv=16, dk=512), 32)],
                         ids=["dv48-dk128-L5", "dv32-dk256-L3", "dv16-dk512-L32"])
def test_gdn_kernels_compile_at_other_head_shapes_and_windows(shape, window):
    """Both kernels and both pairings compile where the thread layout changes: 96 threads,
    16 and 32 lanes a row, windows shorter and longer than a row's lanes."""
    for pairing in (TWO_COPY, ("fp32", "rn", "none")):
        cfg = config(shape, pairing, window=window, act="fp32", debug=True)
        go.compile_gdn_output(cfg)
        gf.compile_gdn_flush(cfg)
        gf.compile_gdn_flush(cfg, staged_window=False)


def test_gdn_counter_kernels_compile():
    """The decode step's counter kernel and the two halves' (non-flush only, flush only)."""
    for nonflush, flush in ((True, True), (True, False), (False, True)):
        gd.compile_advance(16, nonflush, flush)


def test_gdn_thread_layout_covers_the_head_once():
    """dv dk / 64 threads, each 4 passes of one 16-column chunk: every element exactly once."""
    for shape in (QWEN, ODD, WIDE):
        cfg = config(shape, TWO_COPY)
        owned = torch.zeros(cfg.dv, cfg.dk, dtype=torch.int32)
        for t in range(cfg.threads):
            col, row0 = t % cfg.lanes_per_row, t // cfg.lanes_per_row
            for i in range(cfg.passes):
                owned[row0 + cfg.rows_per_pass * i, 16 * col:16 * col + 16] += 1
        assert bool((owned == 1).all()), shape
        assert cfg.threads % 32 == 0 and 32 % cfg.lanes_per_row == 0


def test_nvfp4_repack_gives_every_code_as_e4m3_of_its_value_over_64():
    """Every nibble at every position of a word (the others random): the re-packed byte,
    decoded as E4M3 by lowprec, is the nibble's E2M1 value x 2^-6 exactly, signed zeros
    included (nibble 0b1011 = -1.5 -> byte 0b10001100 = -1.5 / 64)."""
    rng = np.random.default_rng(0)
    nibbles = np.arange(16, dtype=np.uint32)
    e2m1 = lq.decode_bits(torch.tensor(nibbles.astype(np.int64)), E2M1)
    for position in range(8):
        rest = rng.integers(0, 2**32, 16, dtype=np.uint64).astype(np.uint32)
        words = (rest & np.uint32(~(0xF << (4 * position)) & 0xFFFFFFFF)) | (
            nibbles << np.uint32(4 * position))
        even, odd = nm.e2m1_as_e4m3(words)
        packed = even if position % 2 == 0 else odd
        byte = (packed >> np.uint32(8 * (position // 2))) & np.uint32(0xFF)
        got = lq.decode_bits(torch.tensor(byte.astype(np.int64)), E4M3)
        want = e2m1 / 64.0
        assert torch.equal(got.double(), want.double()), position
        assert torch.equal(torch.signbit(got), torch.signbit(want)), position
    assert int(nm.e2m1_as_e4m3(np.uint32(0xB))[0]) == 0b10001100


def test_mma_operands_give_each_lane_its_own_block_sums():
    """The mma form's operands, modelled lane by lane in the PTX fragment layout of
    m16n8k16 (A: a0 = A[g][2t..2t+1], a1 = A[g+8][..], a2 = A[g][2t+8..2t+9], a3 =
    A[g+8][..]; B: b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; D: D[g][2t], D[g][2t+1],
    D[g+8][..]): the A registers as `_mma_row_sums` converts the re-packed codes, the B
    registers read from where `b_fragment_half` put k's and q's f16 hi and lo. Summing D's
    columns 2t, 2t+1 over a block's four mmas gives lane t exactly its own block's sum of
    code x 2^-6 x (hi + lo), rows g and g + 8, for k and for q."""
    rng = np.random.default_rng(7)
    N, B = go.MMA_DK, go.B_FRAGMENT_BYTES
    nibbles = rng.integers(0, 16, (16, N))
    values = lq.decode_bits(torch.tensor(nibbles), E2M1).double().numpy() / 64.0
    words = np.zeros((16, N // 8), dtype=np.uint32)  # nibble c % 8 of word c // 8 (low first)
    for c in range(N):
        words[:, c // 8] |= nibbles[:, c].astype(np.uint32) << np.uint32(4 * (c % 8))
    vectors = rng.standard_normal((2, N)).astype(np.float32) * np.float32(3.0)
    halves = np.zeros(B // 2, dtype=np.float16)
    split = {}
    for vec in range(2):
        hi = vectors[vec].astype(np.float16)
        lo = (vectors[vec] - hi.astype(np.float32)).astype(np.float16)
        split[vec] = hi.astype(np.float64) + lo.astype(np.float64)
        for col in range(N):
            halves[go.b_fragment_half(vec, 0, col, N)] = hi[col]
            halves[go.b_fragment_half(vec, 1, col, N)] = lo[col]
    assert not halves[-32:].any(), "the last 64 bytes are the zero operands"

    def e4m3_pair(word, half):  # cvt.rn.f16x2.e4m3x2 of bytes 2 half, 2 half + 1
        b = [(int(word) >> (8 * (2 * half + i))) & 0xFF for i in range(2)]
        return [float(lq.decode_bits(torch.tensor([v]), E4M3)[0]) for v in b]

    sums = np.zeros((2, 16, 4, 2))  # [vec, row, lane t, block of the lane]
    for j in range(8):
        i, half = j // 2, j % 2
        a_mat = np.zeros((16, 16))
        b_mat = np.zeros((2, 16, 8))
        for g in range(8):
            for t in range(4):
                ev_g, od_g = nm.e2m1_as_e4m3(words[g, 4 * t + i])
                ev_h, od_h = nm.e2m1_as_e4m3(words[g + 8, 4 * t + i])
                a_mat[g, 2 * t:2 * t + 2] = e4m3_pair(ev_g, half)
                a_mat[g + 8, 2 * t:2 * t + 2] = e4m3_pair(ev_h, half)
                a_mat[g, 2 * t + 8:2 * t + 10] = e4m3_pair(od_g, half)
                a_mat[g + 8, 2 * t + 8:2 * t + 10] = e4m3_pair(od_h, half)
                for vec in range(2):
                    if g // 2 == t:
                        part = 0 if g == 2 * t else 1
                        start = ((2 * vec + part) * (N // 32) + t) * 32 + 4 * j
                        b = halves[start:start + 4].astype(np.float64)
                    else:
                        b = halves[-4:].astype(np.float64)
                    b_mat[vec, 2 * t:2 * t + 2, g] = b[:2]
                    b_mat[vec, 2 * t + 8:2 * t + 10, g] = b[2:]
        for vec in range(2):
            d = a_mat @ b_mat[vec]
            for t in range(4):
                sums[vec, :, t, i // 2] += d[:, 2 * t] + d[:, 2 * t + 1]
    for vec in range(2):
        for t in range(4):
            for block in range(2):
                cols = slice(32 * t + 16 * block, 32 * t + 16 * block + 16)
                want = values[:, cols] @ split[vec][cols]
                np.testing.assert_allclose(sums[vec, :, t, block], want, rtol=1e-12,
                                           atol=1e-12)


def test_mma_form_compiles_where_it_applies_and_is_refused_by_name_elsewhere():
    """dots='mma' (NVFP4 read copy, d_k = 128): two mma.sync a 16-column step of a lane
    (k and q), 16 a stripe, each lane's codes of its two rows of a stripe as two 128-bit
    shared loads; a warp two stripes at the Qwen3-Next head (128 threads), one at d_v = 48
    (three stripes, 96 threads). Elsewhere the config refuses it, and a launch takes FFMA
    there."""
    for shape, threads in ((QWEN, 128), (ODD, 96)):
        cfg = config(shape, TWO_COPY)
        assert go.cta_threads(cfg, "mma") == threads
        stripes = cfg.dv // 16 // (threads // 32)
        ptx = go.compile_gdn_output(cfg, keep_ptx=True, dots="mma").__ptx__
        assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 16 * stripes
        assert ptx.count("ld.shared.v4.u32") == 2 * stripes, shape
        assert ptx.count("ld.global.v4") == 0, shape
    with pytest.raises(ValueError, match="dots: expected 'ffma' for lo_format 'none'"):
        go.GDNOutputConfig(config(QWEN, ("fp32", "rn", "none")), 1, "mma")
    with pytest.raises(ValueError, match="at d_k = 256"):
        go.GDNOutputConfig(config(WIDE, TWO_COPY), 1, "mma")
    with pytest.raises(ValueError, match=r"dots: expected one of \['ffma', 'mma'\]"):
        go.GDNOutputConfig(config(QWEN, TWO_COPY), 1, "wmma")
    assert go.dots_of(config(QWEN, TWO_COPY)) == "mma"
    assert go.dots_of(config(ODD, TWO_COPY)) == "mma"
    assert go.dots_of(config(WIDE, TWO_COPY)) == "ffma"
    assert go.dots_of(config(QWEN, ("fp32", "rn", "none"))) == "ffma"


# --------------------------------------------------------------------------------------------
# CPU: argument checks


def cpu_cache(pairing=TWO_COPY, slots=3, shape=ODD, window=8, act=torch.float32):
    hi, rounding, lo = pairing
    return gc.GDNReplayCache.empty(slots, shape["nheads"], shape["dv"], shape["dk"],
                                   window=window, hi_format=hi, hi_rounding=rounding,
                                   lo_format=lo, act_dtype=act, seed=5)


def cpu_token(slots=3, shape=ODD, act=torch.float32):
    gen = torch.Generator().manual_seed(1)
    S, H = slots, shape["nheads"]
    return dict(q=torch.randn(S, H, shape["dk"], generator=gen).to(act),
                k=torch.randn(S, H, shape["dk"], generator=gen).to(act),
                v=torch.randn(S, H, shape["dv"], generator=gen).to(act),
                g=-torch.rand(S, H, generator=gen), beta=torch.rand(S, H, generator=gen))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dk=96), "dk: expected one of (128, 256, 512)"),
    (dict(dk=384), "dk: expected one of (128, 256, 512)"),
    (dict(dv=40), "dv: expected a positive multiple of 16"),
    (dict(dv=256, dk=512), "dv * dk: expected at most 65536"),
    (dict(lo_format="fp8_e4m3"), "(hi_format, hi_rounding, lo_format): expected one of"),
    (dict(hi_format="fp32", hi_rounding="sr", lo_format="none"), "expected one of"),
    (dict(hi_dtype=torch.float32), "hi_dtype: expected None or torch.float16"),
    (dict(act_dtype=torch.int8), "act_dtype: expected one of"),
    (dict(slots=-1), "slots: expected an int >= 0"),
])
def test_gdn_cache_empty_refuses_shapes_and_formats_the_kernels_lack(kwargs, message):
    """Shapes outside the thread layout and pairings the kernels do not have, by name."""
    args = dict(slots=2, nheads=2, dv=32, dk=128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        gc.GDNReplayCache.empty(args.pop("slots"), args.pop("nheads"), args.pop("dv"),
                                args.pop("dk"), **args)


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c, "per_channel", True), "cache.per_channel: expected False"),
    (lambda c: setattr(c, "window", 33), "cache.window: expected an int in [1, 32]"),
    (lambda c: setattr(c, "draft", 2), "cache.draft: expected 0"),
    (lambda c: setattr(c, "seed", -1), "seed: expected an int in [0, 2^64)"),
    (lambda c: setattr(c, "lo", c.lo[..., :-1]), "cache.lo: expected shape"),
    (lambda c: setattr(c, "lo_scales", c.lo_scales.float()), "cache.lo_scales: expected dtype"),
    (lambda c: setattr(c, "ring_u", c.ring_u.to(torch.float16)), "cache.ring_u: expected dtype"),
    (lambda c: setattr(c, "ring_k", c.ring_k[:, :, :-1]), "cache.ring_k: expected shape"),
    (lambda c: setattr(c, "flushes", c.cursors), "cache.cursors: expected a tensor apart"),
    (lambda c: setattr(c, "cursors", c.cursors.long()), "cache.cursors: expected dtype"),
])
def test_gdn_cache_checks_name_the_bad_field(change, message):
    cache = cpu_cache()
    change(cache)
    with pytest.raises(ValueError, match=re.escape(message)):
        gd.gdn_replay_decode(cache, **cpu_token())


@pytest.mark.parametrize("name, bad, message", [
    ("q", lambda t: t["q"][..., :-16], "q: expected shape"),
    ("k", lambda t: t["k"].to(torch.float16), "k: expected dtype torch.float32"),
    ("v", lambda t: t["v"].to(torch.bfloat16), "v: expected dtype torch.float32 (the ring's)"),
    ("g", lambda t: t["g"].double(), "g: expected dtype torch.float32"),
    ("beta", lambda t: t["beta"][:, :1], "beta: expected shape"),
])
def test_gdn_step_inputs_are_checked_by_name(name, bad, message):
    token = cpu_token()
    token[name] = bad(token)
    with pytest.raises(ValueError, match=re.escape(message)):
        gd.gdn_replay_decode(cpu_cache(), **token)


def test_gdn_inputs_and_outputs_sharing_cache_memory_are_refused():
    """An input inside the cache, or an output inside an input, would be overwritten before
    it is read."""
    cache = cpu_cache()
    token = cpu_token()
    token["g"] = cache.ring_g[:, :, 0]
    with pytest.raises(ValueError, match=r"g: expected a tensor apart from cache.ring_g|g: "
                                         r"expected a contiguous"):
        gd.gdn_replay_decode(cache, **token)
    token = cpu_token()
    with pytest.raises(ValueError, match=re.escape("out: expected a tensor apart from v")):
        gd.gdn_replay_decode(cache, **token, out=token["v"])


@pytest.mark.parametrize("heads_per_cta, message", [
    (2, "heads_per_cta: expected a divisor of nheads = 3 in [1, 16], got 2"),
    (0, "heads_per_cta: expected a divisor of nheads = 3 in [1, 16], got 0"),
    (True, "heads_per_cta: expected a divisor of nheads = 3 in [1, 16], got True"),
])
def test_gdn_heads_per_cta_is_checked_before_any_launch(heads_per_cta, message):
    """A value the kernel cannot take is refused by name, before the CPU device check."""
    with pytest.raises(ValueError, match=re.escape(message)):
        gd.gdn_replay_decode(cpu_cache(), **cpu_token(), heads_per_cta=heads_per_cta)
    with pytest.raises(ValueError, match=re.escape("heads_per_cta: expected a divisor of "
                                                   "nheads = 32 in [1, 16], got 32")):
        go.GDNOutputConfig(config(QWEN, TWO_COPY), 32)


@pytest.mark.parametrize("fn", [gd.gdn_replay_decode, gd.gdn_replay_output,
                                gd.gdn_replay_flush])
def test_gdn_cpu_tensors_pass_every_check_but_the_device_one(fn):
    """Every check runs on CPU tensors; the last refuses the CPU device by name."""
    with pytest.raises(ValueError, match=re.escape("cache.hi: expected a CUDA tensor")):
        fn(cpu_cache(), **cpu_token())


def test_gdn_traffic_bytes_are_the_stated_counts():
    """Qwen3-Next head, bf16 activations, a slot and head. Non-flush nvfp4 with c records:
    8,192 code + 1,024 scale + 4 global B, c (512 u + 256 k + 4 g), inputs 776 (q, k, v, g,
    beta), y 256, record 1,032 (u 512, v 256, k 256, g, beta). Flush fp16 + nvfp4: hi 2 x
    32,768, lo 9,220, 15 ring records of 520, inputs 776, y 256, record 520."""
    assert go.traffic_bytes("nvfp4", "bf16", 1, 1, 128, 128, 0) == 9220 + 776 + 256 + 1032
    assert go.traffic_bytes("nvfp4", "bf16", 1, 1, 128, 128, 7) == 11284 + 7 * 772
    assert go.traffic_bytes("none", "bf16", 2, 3, 128, 128, 0) == 6 * (65536 + 2064)
    expected = 2 * 32768 + 9220 + 15 * 520 + 776 + 256 + 520
    assert gf.traffic_bytes("fp16", "nvfp4", "bf16", 1, 1, 128, 128, 16) == expected


# --------------------------------------------------------------------------------------------
# GPU: the packed cache mirrored into an emulation-shaped twin, checked by the emulation tests


class CuteStep:
    """Runs the CuTe step on a packed GPU cache and mirrors the result into an
    emulation-shaped CPU twin, so `gdn_emulation_cases.run_and_check_step` checks it."""

    def __init__(self, twin, pairing, act, half=None, heads_per_cta=None):
        self.pairing = pairing
        self.half = half  # None: gdn_replay_decode; 'output' or 'flush': that half alone
        self.heads_per_cta = heads_per_cta  # the non-flush kernel's (None: its default)
        hi, rounding, lo = pairing
        slots, nheads, dv, dk, window = twin.shape
        self.cache = gc.GDNReplayCache.empty(slots, nheads, dv, dk, window=window,
                                             hi_format=hi, hi_rounding=rounding, lo_format=lo,
                                             seed=twin.seed, act_dtype=act, device=DEVICE,
                                             sr_bits=twin.sr_bits,
                                             philox_rounds=twin.philox_rounds)
        c = self.cache
        c.hi.copy_(twin.hi.to(c.hi.dtype))
        if lo == "nvfp4":
            quant = lq.quantize(twin.lo, "nvfp4")
            twin.lo.copy_(lq.dequantize(quant))
            twin.lo_scales.copy_(quant.scales)
            twin.lo_global.copy_(quant.global_scale)
            packed = lq.pack(quant)
            c.lo.copy_(packed["codes"])
            c.lo_scales.copy_(packed["scales"])
            c.lo_global.copy_(packed["global_scale"])
        else:
            twin.lo.copy_(twin.hi)  # one copy: the read copy is the recurrence copy
        for name in ("ring_u", "ring_v", "ring_k", "ring_g", "ring_beta", "cursors",
                     "flushes"):
            getattr(c, name).copy_(getattr(twin, name))
        self.debug = None

    def mirror(self, twin):
        c = self.cache
        twin.hi.copy_(c.hi.float().cpu())
        if c.lo_format == "nvfp4":
            packed = {"codes": c.lo.cpu(), "scales": c.lo_scales.cpu(),
                      "global_scale": c.lo_global.cpu()}
            quant = lq.unpack(packed, "nvfp4", tuple(c.hi.shape))
            twin.lo.copy_(lq.dequantize(quant))
            twin.lo_scales.copy_(quant.scales)
            twin.lo_global.copy_(quant.global_scale)
        else:
            twin.lo.copy_(twin.hi)
        for name in ("ring_u", "ring_v", "ring_k", "ring_g", "ring_beta", "cursors",
                     "flushes"):
            getattr(twin, name).copy_(getattr(c, name).cpu())

    def __call__(self, twin, q, k, v, g, beta, out, debug_state):
        dev = {n: t.to(DEVICE) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
        y = torch.full(out.shape, math.nan, dtype=v.dtype, device=DEVICE)
        debug = torch.full(debug_state.shape, math.nan, dtype=torch.float32, device=DEVICE)
        self.before_lo = None if self.cache.lo is None else self.cache.lo.clone()
        if self.half == "output":
            gd.gdn_replay_output(self.cache, **dev, out=y, check_counters=True,
                                 heads_per_cta=self.heads_per_cta)
        elif self.half == "flush":
            gd.gdn_replay_flush(self.cache, **dev, out=y, debug_state=debug, check_counters=True)
        else:
            gd.gdn_replay_decode(self.cache, **dev, out=y, debug_state=debug,
                                 check_counters=True, heads_per_cta=self.heads_per_cta)
        out.copy_(y.float().cpu())
        debug_state.copy_(debug.cpu())
        self.debug = debug
        self.mirror(twin)


def clone_cache(cache, act=None):
    """A copy of a packed cache (its rings in `act`, default the cache's)."""
    fields = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in vars(cache).items()}
    if act is not None:
        fields["ring_v"] = fields["ring_v"].to(act)
        fields["ring_k"] = fields["ring_k"].to(act)
    return gc.GDNReplayCache(**fields)


def packed_codes_equal_lowprec(step, is_flush):
    """At flush slots the packed bytes (codes, scale bytes, s_g) equal lowprec.quantize.pack
    of the kernel's unrounded state."""
    c = step.cache
    fl = is_flush.nonzero()[:, 0]
    if c.lo_format != "nvfp4" or fl.numel() == 0:
        return
    want = lq.pack(lq.quantize(step.debug.cpu()[fl], "nvfp4"))
    assert torch.equal(c.lo.cpu()[fl], want["codes"]), "nvfp4 code bytes differ from lowprec"
    assert torch.equal(c.lo_scales.cpu()[fl], want["scales"]), "E4M3 scale bytes differ"
    assert torch.equal(c.lo_global.cpu()[fl].view(torch.int32),
                       want["global_scale"].view(torch.int32)), "s_g bits differ"


def emulation_quantiser_gives_the_same_bytes(step, is_flush):
    """The third implementation: the Triton emulation's Philox words and quantiser applied to
    the CuTe kernel's unrounded state give the CuTe kernel's stored bytes."""
    from emulation import numerics as em

    c = step.cache
    fl = is_flush.nonzero()[:, 0].tolist()
    if not fl or c.hi_format != "fp16":
        return
    H, P, N = c.hi.shape[1:]
    state = step.debug[fl]
    rand = None
    if c.hi_rounding == "sr":
        rand = torch.stack([em.random_words_host(c.seed, s, int(c.flushes[s]) - 1, H * P * N,
                                                 DEVICE, sr_bits=c.sr_bits,
                                                 philox_rounds=c.philox_rounds)
                            for s in fl]).reshape(state.shape)
    want = lq.encode_bits(em.round_to(state, "fp16", c.hi_rounding, rand,
                                      sr_bits=c.sr_bits).cpu(), FP16)
    got = c.hi[fl].cpu().view(torch.int16).long() & 0xFFFF
    assert torch.equal(want, got), "emulation and CuTe fp16 recurrence copies differ"
    quant = em.quantize(state, "nvfp4", "rn")
    quant = lq.Quantized(quant.fmt, quant.elements.cpu(), quant.scales.cpu(),
                         quant.global_scale.cpu())
    packed = lq.pack(quant)
    assert torch.equal(packed["codes"], c.lo[fl].cpu()), "emulation and CuTe codes differ"
    assert torch.equal(packed["scales"], c.lo_scales[fl].cpu()), "emulation scales differ"


def run_windows(pairing, shape, window, slots, tokens, seed, act=torch.float32,
                heads_per_cta=None):
    """`tokens` CuTe decode steps from slots at random ring positions (flush counters far
    apart), every one checked against lowprec on the cache it started from; returns the
    flushes done, the flushes expected and the worst error / bound. `heads_per_cta`: the
    non-flush kernel's (None: its default)."""
    from gdn_emulation_cases import filled_cache, make_token, run_and_check_step

    gen = torch.Generator().manual_seed(seed)
    cursors = torch.randint(0, window, (slots,), generator=gen).tolist()
    flushes = torch.randint(0, 1000, (slots,), generator=gen).tolist()
    hi, rounding, lo = pairing
    twin = filled_cache(gen, slots, shape["nheads"], shape["dv"], shape["dk"], (hi, rounding),
                        "fp32" if lo == "none" else lo, False, cursors=cursors,
                        flushes=flushes, window=window, act_dtype=act)
    step = CuteStep(twin, pairing, act, heads_per_cta=heads_per_cta)
    worst = 0.0
    for _ in range(tokens):
        before = step.cache.cursors.cpu().clone()
        token = make_token(gen, slots, shape["nheads"], shape["dv"], shape["dk"], False,
                           act_dtype=act)
        _, ratio = run_and_check_step(twin, token, step, y_dtype=act)
        is_flush = before == window - 1
        packed_codes_equal_lowprec(step, is_flush)
        emulation_quantiser_gives_the_same_bytes(step, is_flush)
        worst = max(worst, ratio)
    done = (step.cache.flushes.cpu() - torch.tensor(flushes, dtype=torch.int32)).tolist()
    return done, [(c + tokens) // window for c in cursors], worst


@pytest.mark.gpu
@pytest.mark.parametrize("pairing", PAIRINGS[::2])
@pytest.mark.parametrize("half, cursors", [("output", [0, 1, 4, 6]), ("flush", [7, 7, 7, 7])])
def test_gdn_kernel_alone_matches_lowprec_in_one_step(pairing, half, cursors):
    """One step of the non-flush kernel alone (`gdn_replay_output`: slots at cursors 0, 1, 4
    and 6 of L = 8, the first with an empty ring) or of the flush kernel alone
    (`gdn_replay_flush`, every slot at L - 1): u, y and the stored copies as lowprec's (the
    simplest cases, to tell the two kernels apart when the windows test fails)."""
    from gdn_emulation_cases import filled_cache, make_token, run_and_check_step

    gen = torch.Generator().manual_seed(21)
    hi, rounding, lo = pairing
    twin = filled_cache(gen, 4, 3, 48, 128, (hi, rounding), "fp32" if lo == "none" else lo,
                        False, cursors=cursors, flushes=[0, 1, 2, 3], window=8)
    step = CuteStep(twin, pairing, torch.float32, half=half)
    is_flush = torch.tensor(cursors) == 7
    run_and_check_step(twin, make_token(gen, 4, 3, 48, 128, False), step)
    packed_codes_equal_lowprec(step, is_flush)


@pytest.mark.gpu
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_gdn_decode_matches_lowprec_over_windows_from_random_ring_positions(pairing):
    """Odd head (dv 48, 96 threads), L = 8, 19 tokens, 5 slots at random ring positions: two
    or three flushes a slot at different steps; every step's u, y and unrounded state within
    the emulation's bounds of lowprec on the same cache, the stored copies lowprec's bit for
    bit."""
    done, expected, worst = run_windows(pairing, ODD, 8, 5, 19, seed=3)
    assert done == expected and min(done) >= 2
    assert worst <= 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("shape, window, act, heads_per_cta", [
    pytest.param(QWEN, 16, torch.bfloat16, 1, id="qwen-L16-bf16"),
    pytest.param(ODD, 8, torch.float32, 1, id="dv48-L8-fp32"),
    pytest.param(dict(nheads=4, dv=48, dk=128), 5, torch.bfloat16, 2, id="dv48-L5-2heads"),
])
def test_gdn_tensor_core_dots_match_lowprec_over_windows(shape, window, act, heads_per_cta):
    """The non-flush step's mma form (codes x k and codes x q on the tensor cores, B as f16
    hi + lo; every NVFP4 head at d_k = 128 takes it), bf16 and fp32 activations: 3 slots at
    random ring positions over two windows and more, every step's u and y within the
    emulation's bounds of lowprec on the same cache (y's rounding to bf16 added), the stored
    copies lowprec's bit for bit (the flush is the same kernel)."""
    done, expected, worst = run_windows(TWO_COPY, shape, window, 3, 2 * window + 2, seed=37,
                                        act=act, heads_per_cta=heads_per_cta)
    assert done == expected and min(done) >= 2
    assert worst <= 1.0


@pytest.mark.gpu
def test_gdn_decode_at_the_qwen3_next_head():
    """dv = dk = 128, 32 heads, L = 16, 3 slots, 18 tokens (each slot flushes once or twice)."""
    done, expected, worst = run_windows(TWO_COPY, QWEN, 16, 3, 18, seed=11)
    assert done == expected and min(done) >= 1
    assert worst <= 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("pairing, heads_per_cta", [
    pytest.param(TWO_COPY, 1, id="fp16sr-nvfp4-1head"),
    pytest.param(TWO_COPY, 2, id="fp16sr-nvfp4-2heads"),
    pytest.param(TWO_COPY, 8, id="fp16sr-nvfp4-8heads"),
    pytest.param(("fp32", "rn", "none"), 2, id="fp32-single-copy-2heads"),
])
def test_gdn_decode_with_several_heads_a_cta_matches_lowprec(pairing, heads_per_cta):
    """8 heads of dv 48 (96 threads), L = 8, 19 tokens, 5 slots at random ring positions,
    the non-flush kernel taking 1, 2 or 8 heads a CTA (8: each of the two stages refilled 3
    times, its barrier's phases 0 1 0 1): every step within the emulation's bounds of
    lowprec on the same cache, the stored copies lowprec's bit for bit."""
    shape = dict(nheads=8, dv=48, dk=128)
    done, expected, worst = run_windows(pairing, shape, 8, 5, 19, seed=17,
                                        heads_per_cta=heads_per_cta)
    assert done == expected and min(done) >= 2
    assert worst <= 1.0


@pytest.mark.gpu
def test_gdn_heads_per_cta_leaves_every_bit_as_one_head_a_cta():
    """Each head's arithmetic is the same whichever CTA takes it: bf16 activations, 16 heads
    of dv 32, dk 256 (16 lanes a row), L = 6 (a ring g row of 24 B), 4 slots, 8 tokens; at
    2, 4, 8 and 16 heads a CTA, y, the ring, both copies and the counters equal one head a
    CTA's bit for bit after every step."""
    from gdn_emulation_cases import filled_cache, make_token

    gen = torch.Generator().manual_seed(23)
    nheads, dv, dk, window, slots = 16, 32, 256, 6, 4
    twin = filled_cache(gen, slots, nheads, dv, dk, ("fp16", "sr"), "nvfp4", False,
                        cursors=[0, 2, 4, 5], flushes=[3, 1, 4, 1], window=window,
                        act_dtype=torch.bfloat16)
    one = CuteStep(twin, TWO_COPY, torch.bfloat16).cache
    caches = {n: clone_cache(one) for n in (2, 4, 8, 16)}
    for _ in range(8):
        token = {n: t.to(DEVICE) for n, t in make_token(gen, slots, nheads, dv, dk, False,
                                                         act_dtype=torch.bfloat16).items()}
        y_one = gd.gdn_replay_decode(one, **token, heads_per_cta=1)
        for n, cache in caches.items():
            y = gd.gdn_replay_decode(cache, **token, heads_per_cta=n)
            assert torch.equal(y.view(torch.int16), y_one.view(torch.int16)), n
            for name in ("hi", "lo", "lo_scales", "lo_global", "ring_u", "ring_v", "ring_k",
                         "ring_g", "ring_beta", "cursors", "flushes"):
                a, b = getattr(cache, name), getattr(one, name)
                assert torch.equal(a.nan_to_num(7.0) if a.is_floating_point() else a,
                                   b.nan_to_num(7.0) if b.is_floating_point() else b), (n, name)


@pytest.mark.gpu
@pytest.mark.parametrize("pairing, shape, window, act", [
    pytest.param(TWO_COPY, QWEN, 16, torch.bfloat16, id="fp16sr-nvfp4-qwen-L16-bf16"),
    pytest.param(("fp32", "rn", "none"), ODD, 8, torch.float32, id="fp32-dv48-L8"),
    pytest.param(TWO_COPY, WIDE, 3, torch.float32, id="fp16sr-nvfp4-dk256-L3"),
])
def test_the_staged_window_leaves_every_bit_of_the_flush(pairing, shape, window, act,
                                                          monkeypatch):
    """The flush with its window staged in shared memory does the arithmetic of the flush
    whose records load inside the fold (the form of windows too large to stage): from 3 slots
    at random ring positions over two windows, y, the ring, both copies and the counters equal
    bit for bit after every step, and both stay within the emulation's bounds of lowprec
    (run_windows)."""
    from gdn_emulation_cases import filled_cache, make_token

    unstaged = lambda: monkeypatch.setattr(gf, "STAGED_WINDOW_BYTES", 0)  # noqa: E731
    done, expected, worst = run_windows(pairing, shape, window, 3, 2 * window + 2, seed=43,
                                        act=act)
    unstaged()
    done_u, _, worst_u = run_windows(pairing, shape, window, 3, 2 * window + 2, seed=43,
                                     act=act)
    assert done == done_u == expected and worst_u <= 1.0 and worst <= 1.0
    monkeypatch.undo()
    gen = torch.Generator().manual_seed(47)
    hi, rounding, lo = pairing
    twin = filled_cache(gen, 3, shape["nheads"], shape["dv"], shape["dk"], (hi, rounding),
                        "fp32" if lo == "none" else lo, False, cursors=[window - 1] * 3,
                        flushes=[5, 9, 2], window=window, act_dtype=act)
    staged = CuteStep(twin, pairing, act).cache
    plain = clone_cache(staged)
    token = {n: t.to(DEVICE) for n, t in make_token(gen, 3, shape["nheads"], shape["dv"],
                                                     shape["dk"], False, act_dtype=act).items()}
    y_staged = gd.gdn_replay_decode(staged, **token)
    unstaged()
    y_plain = gd.gdn_replay_decode(plain, **token)
    bits = torch.int32 if act == torch.float32 else torch.int16
    assert torch.equal(y_staged.view(bits), y_plain.view(bits))
    for name in ("hi", "lo", "lo_scales", "lo_global", "ring_v", "ring_k", "ring_g",
                 "ring_beta", "cursors", "flushes"):
        a, b = getattr(staged, name), getattr(plain, name)
        if a is None:
            continue
        assert torch.equal(a.nan_to_num(7.0) if a.is_floating_point() else a,
                           b.nan_to_num(7.0) if b.is_floating_point() else b), name


@pytest.mark.gpu
def test_gdn_decode_with_256_column_keys_and_a_short_window():
    """dk = 256 (16 lanes a row), L = 3: the ring terms of records past a row's lanes."""
    done, expected, _ = run_windows(TWO_COPY, WIDE, 3, 4, 7, seed=5)
    assert done == expected


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_gdn_16_bit_activations_give_the_fp32_kernels_results(act):
    """With q, k, v (and the ring) holding 16-bit values, the 16-bit kernel computes in fp32
    exactly as the fp32 kernel on the same values: equal ring u, copies and counters, and y
    the fp32 kernel's y rounded to the 16-bit format."""
    from gdn_emulation_cases import filled_cache, make_token

    dtype = ACTS[act]
    gen = torch.Generator().manual_seed(7)
    window, slots = 6, 4
    cursors = [0, 3, 5, 5]
    twin = filled_cache(gen, slots, 2, 32, 128, ("fp16", "sr"), "nvfp4", False,
                        cursors=cursors, flushes=[1, 2, 3, 4], window=window, act_dtype=dtype)
    half = CuteStep(twin, TWO_COPY, dtype).cache
    wide = clone_cache(half, torch.float32)
    for _ in range(8):
        token = make_token(gen, slots, 2, 32, 128, False, act_dtype=dtype)
        y16 = gd.gdn_replay_decode(half, **{n: t.to(DEVICE) for n, t in token.items()})
        y32 = gd.gdn_replay_decode(wide, **{n: t.to(DEVICE).float() if t.dtype == dtype
                                            else t.to(DEVICE) for n, t in token.items()})
        assert torch.equal(y16, y32.to(dtype)), "y differs from the fp32 kernel's, rounded"
        for name in ("hi", "lo", "lo_scales", "lo_global", "ring_u", "cursors", "flushes"):
            a, b = getattr(half, name), getattr(wide, name)
            assert torch.equal(a.nan_to_num(7.0) if a.is_floating_point() else a,
                               b.nan_to_num(7.0) if b.is_floating_point() else b), name


@pytest.mark.gpu
def test_gdn_output_then_flush_is_one_decode_step():
    """gdn_replay_output then gdn_replay_flush leave the cache and out exactly as one
    gdn_replay_decode; each leaves the other's slots (and out rows) alone."""
    from gdn_emulation_cases import filled_cache, make_token

    gen = torch.Generator().manual_seed(9)
    twin = filled_cache(gen, 4, 3, 48, 128, ("fp16", "sr"), "nvfp4", False,
                        cursors=[7, 0, 7, 4], flushes=[0, 3, 9, 1], window=8)
    a = CuteStep(twin, TWO_COPY, torch.float32).cache
    b = clone_cache(a)
    token = {n: t.to(DEVICE) for n, t in make_token(gen, 4, 3, 48, 128, False).items()}
    y_a = torch.full((4, 3, 48), math.nan, device=DEVICE)
    y_b = y_a.clone()
    gd.gdn_replay_decode(a, **token, out=y_a)
    gd.gdn_replay_output(b, **token, out=y_b)
    flush_rows = torch.tensor([True, False, True, False], device=DEVICE)
    assert bool(y_b[flush_rows].isnan().all()), "the non-flush kernel wrote a flush slot's y"
    assert b.cursors.tolist() == [7, 1, 7, 5] and b.flushes.tolist() == [0, 3, 9, 1]
    gd.gdn_replay_flush(b, **token, out=y_b)
    assert torch.equal(y_a, y_b)
    for name in ("hi", "lo", "lo_scales", "lo_global", "ring_u", "ring_v", "ring_k", "ring_g",
                 "ring_beta", "cursors", "flushes"):
        x, z = getattr(a, name), getattr(b, name)
        if x.is_floating_point():
            x, z = x.nan_to_num(7.0), z.nan_to_num(7.0)
        assert torch.equal(x, z), name


@pytest.mark.gpu
def test_gdn_emulation_step_stores_the_same_codes_where_its_state_has_the_same_bits():
    """The Triton emulation's own step (on the GPU) from the same cache: the same ring and
    counters; y within twice the bound of each other's; at flush slots, wherever the two
    unrounded states hold the same fp32 bits, the same fp16 words (and, block by block, the
    same NVFP4 codes where a whole head agrees)."""
    from gdn_emulation_cases import filled_cache, make_token

    from emulation.gdn_replay_decode import gdn_replay_decode as emu_decode

    gen = torch.Generator().manual_seed(13)
    slots = 4
    twin = filled_cache(gen, slots, 3, 48, 128, ("fp16", "sr"), "nvfp4", False,
                        cursors=[7, 2, 7, 6], flushes=[5, 0, 77, 3], window=8)
    step = CuteStep(twin, TWO_COPY, torch.float32)
    emu = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t)
           for n, t in vars(twin).items()}
    emu = type(twin)(**emu)
    token = {n: t.to(DEVICE) for n, t in make_token(gen, slots, 3, 48, 128, False).items()}
    d_cute = torch.full(twin.hi.shape, math.nan, device=DEVICE)
    d_emu = d_cute.clone()
    y_c = gd.gdn_replay_decode(step.cache, **token, debug_state=d_cute)
    y_e = emu_decode(emu, **token, debug_state=d_emu)
    for name in ("ring_v", "ring_k", "ring_g", "ring_beta", "cursors", "flushes"):
        x, z = getattr(step.cache, name), getattr(emu, name)
        if x.is_floating_point():
            x, z = x.float().nan_to_num(7.0), z.float().nan_to_num(7.0)
        assert torch.equal(x, z), name
    scale = y_e.abs().amax() + 1e-30
    assert float((y_c - y_e).abs().amax() / scale) < 1e-4, "outputs disagree"
    fl = [0, 2]
    same = d_cute[fl].view(torch.int32) == d_emu[fl].view(torch.int32)
    hi_c = step.cache.hi[fl].view(torch.int16)
    hi_e = emu.hi[fl].to(torch.float16).view(torch.int16)
    assert torch.equal(hi_c[same], hi_e[same]), "fp16 words differ where the states agree"
    head_same = same.flatten(2).all(dim=2)  # [2, H]
    if bool(head_same.any()):
        got = step.cache.lo[fl][head_same]
        want = lq.pack(lq.quantize(d_emu[fl][head_same].cpu(), "nvfp4"))["codes"]
        assert torch.equal(got.cpu(), want), "codes differ where a whole head agrees"
