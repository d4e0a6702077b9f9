"""Gated DeltaNet ReplaySSM non-flush kernel (CuTe DSL): one pass over the read copy yields both
S k and S q, the record's corrected value u and the output y; no state is formed or written.

For every slot `s` with `c = cursors[s] < window - 1` (records 0 .. c-1 in the ring, record c
the call's inputs; other slots exit at once), per head `h`, in the order of operations of
`lowprec.gdn._read` (the emulation's `replay_record`):

    cum_j   = g_0 + ... + g_j  (sequential fp32, records 0 .. c)
    w_j     = exp(cum_c - cum_j)            G_c = exp(cum_c)
    kk_j    = sum_d (k_j[d] w_j) k_c[d]     kq_j = sum_d (k_j[d] w_j) q[d]     (j <= c)
    u_c     = beta_c (v_c - [S_lo (G_c k_c) + sum_{j<c} u_j kk_j])
    y       = S_lo (G_c q) + sum_{j<c} u_j kq_j + u_c kq_c
    ring    u_c, v_c, k_c, g_c, beta_c at position c

S_lo is the read copy. NVFP4: each block's 16 codes enter exactly as E2M1 x 2^-6 in fp32 (a
nibble re-packed as the E4M3 byte of `2^-6 code`, two a hardware conversion to f16x2, f16 to
fp32), the products with `G_c k_c` and `G_c q` are summed over the block, and the block's sums
are multiplied by `(2^6 s_b) s_g` (one rounding): lowprec's values `(code s_b) s_g` carry
that rounding per element instead, so a term differs by at most 3 roundings from lowprec's,
and a row's sums here have 16 + log2(dk / 16) + c + 3 sequential roundings a term, far fewer
than the d_k + L the emulation's bound (`emulation.gdn_replay_decode`) allows. With lo_format
'none', the fp32 recurrence copy itself (the single-copy FP32 ReplaySSM baseline).

Two forms of the read copy's dot products (`dots`, fixed by the head: `dots_of`). 'mma', the
NVFP4 read copy at d_k = 128 (faster than the FFMA form at the Qwen3-Next layer,
docs/performance.md): T = `cta_threads` threads a CTA (dv: a warp two of the dv / 16 row
stripes; 2 dv, a warp one, where dv / 16 is odd), warp w the 16-row stripes w, w + T / 32,
... in turn, lane (g, t) = (lane // 4, lane % 4) of stripe r rows 16 r + g and 16 r + g + 8,
columns 32 t .. 32 t + 31 (blocks 2 t, 2 t + 1, two 128-bit shared loads); the re-packed
codes (E2M1 x 2^-6 in f16, exact) are the A operand of `mma.sync.m16n8k16`, and B's column
2 t (2 t + 1) holds f16 hi (lo) of k, or of q, on lane t's k indices only, so that D's columns
2 t, 2 t + 1 are the lane's own block sums (Mamba-2's `replay_output` trick), which it scales
by its E4M3 bytes in fp32; the threads write each element's hi and lo into shared memory
first (`b_fragment_half`). The decay G_c and 2^6 s_g
multiply a row's sums once; the quad of lanes adds its four sums and the ring terms of
records t + 4 m. hi + lo is k within 2^-22 |k| for |k| in f16's normal range (elements under
2^-24 drop, over 65504 overflow: GDN keys and queries are L2-normalised), and the tensor
cores' sums are within a few fp32 ulps of the largest term, well inside the d_k + L roundings.
'ffma', every other head (the FP32 read copy, wider keys): the thread ownership below, each
thread's 64 elements converted to fp32 and two FFMA an element.

Work: one CTA a slot and `heads_per_cta` consecutive heads (grid nheads / heads_per_cta x
slots), which it takes in turn; it reads the slot's cursor once. The default is one head a
CTA: at the Qwen3-Next layer 2, 4, 8 and 16 heads a CTA measured slower at batch 1 and 256
(docs/performance.md); the stages still put the bulk copies ahead of each head's chain.

Thread ownership of the ffma form, per head: the flush kernel's (`gdn_replay_flush`), T = dv
dk / 64 threads, each the 16-column chunk `t % R` (R = dk / 16) of rows `t // R + (T / R) i`:
its chunk of a row is one NVFP4 block (8 code bytes, 1 scale byte: one 64-bit and one 8-bit
shared load), or 64 B of fp32. Its rows' two dot products meet in shuffle sums over the row's
R lanes, each lane adding the ring terms of records `t % R + R m` first (so the ring's u are
spread over the row's lanes). In both forms every warp forms the cumulative decays itself
(lane t: w_t; the same sequential sums in each warp); the per-record dots kk_j, kq_j are warp
sums (warp w: records w, w + T/32, ..., a lane the dk / 32 columns from lane dk / 32) meet in
shared memory.

Where the bytes wait: two shared-memory stages (one at one head a CTA, or where two do not
fit: `stage_count`); thread 0 fills a head's stage with the bulk copy engine (`cp.async.bulk`,
one copy a piece, completing on the stage's mbarrier) while the head before it computes: the
NVFP4 codes (dv dk / 2 B) and block scales (dv dk / 16 B), the ring's records 0 .. c-1 of u
(c dv fp32) and k (c dk act), k, q (dk act) and v (dv act), each piece laid out as its global
rows. The first heads' codes and scales do not depend on the cursor: they go out as the CTA
starts, announced to the barrier without its arrival (`mbar_expect_tx`), so that their round
trip overlaps the cursor's; the other pieces follow once it is read, with the arrival. A slot
past the window waits for them before it exits (its shared memory must outlive the copies),
so a decode step whose slots flush reads their codes once more than it needs.
Every piece's size and global offset is a multiple of 16 bytes for each head shape the cache
allows (dv a multiple of 16, dk >= 128; `stage_bytes`). Head i waits for phase i // S (mod 2)
of stage i % S's barrier (S stages); after a CTA barrier that ends its last read of the
stage, head i + S's copies go into it. The heads' scalars (the ring's g row, L * 4 B, not a
multiple of 16 for every window; g, beta, the NVFP4 global scale) are loaded into shared
memory once, with the cursor. The record is appended from the stage (v, k) and the scalars
as each head starts; u goes to ring_u[c] with y. lo_format 'none': the fp32 read copy
(64 KiB a head at dv = dk = 128: two stages would leave one CTA an SM) goes to registers at
the head's start, the rest through the stages.

Shared memory a CTA (`cta_shared_bytes`), dv = dk = 128, L = 16, bf16 activations: nvfp4 a
stage of 20,736 B (codes 8,192, scales 1,024, ring u 7,168, ring k 3,584, k, q, v 256 each)
and the scalars, dots, barriers and the mma form's B operands: 22,176 B at one head a CTA
(two stages, 43,440 B, at 8); 'none' at one head a CTA 11,864 B.

Bytes per non-flush (slot, head) (`traffic_bytes`): the read copy (dv dk / 2 codes + dv dk / 16
scales + 4 global for nvfp4; 4 dv dk for fp32), the ring's c records (u fp32, k in the
activation dtype, g), q, k, v, g, beta read, y written, the record appended (u, v, k, g, beta).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass  # noqa: I001
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32
from cutlass.memory import SmemAllocator

from cute_kernels import _compile, ptx
from cute_kernels import numerics as nm
from cute_kernels.cache import fail
from cute_kernels.gdn_replay_flush import (
    ACT_BYTES,
    CUTE_DTYPES,
    GDNConfig,
    W,
    add,
    chunk_of,
    load_vector_chunk,
    optional_ptr,
)
from cute_kernels.numerics import e2m1_as_e4m3
from cute_kernels.tensor_core import mma_m16n8k16

__all__ = ["GDNOutputConfig", "compile_gdn_output", "launch_gdn_output", "stage_bytes",
           "cta_shared_bytes", "traffic_bytes"]

E2M1_AS_E4M3 = 64.0  # the re-packed codes are E2M1 x 2^-6
# one head a CTA: 2, 4, 8 and 16 measured slower at batch 1 and 256 (docs/performance.md;
# `python -m tools.heads_per_cta` times each)
DEFAULT_HEADS_PER_CTA = 1
DOTS = ("ffma", "mma")  # the read copy's two dot products: FFMA a thread, or tensor cores
MMA_DK = 128  # the mma form: a 16-row stripe spans the whole key width
# the mma form's B operands of a head: (k, q) x (f16 hi, f16 lo) x 4 lanes' columns x 8 mmas x
# two registers, then 64 zero bytes for the lanes whose B column is not their own
B_FRAGMENT_BYTES = 2 * 2 * (MMA_DK // 32) * 8 * 8 + 64
REGISTER_CAP = 64  # nvfp4: registers a thread, so that 65,536 / (64 T) CTAs fit an SM
REGISTERS_PER_SM = 65536
MMA_STRIPES_PER_WARP = 2  # the mma form: a warp two 16-row stripes, half the flush's threads
MAX_HEADS_PER_CTA = 16
STAGES = 2  # a head computes while the next one's bytes arrive
CTA_SHARED_LIMIT = 227 * 1024  # an H100 / H200 CTA's shared memory (opt-in)


def _nvfp4_codes(frag, words):
    """The 16 E2M1 values x 2^-6 of one block into `frag` (fp32, exact): codes re-packed as
    E4M3 (e2m1_as_e4m3), two a `cvt.rn.f16x2.e4m3x2`, f16 -> fp32."""
    for w in range(W // 8):
        for first, packed in enumerate(e2m1_as_e4m3(words[w])):
            for half in range(2):
                a, b = ptx.f16x2_to_f32x2(ptx.e4m3x2_to_f16x2(packed, half))
                e = 8 * w + 4 * half + first  # bytes 2 half, 2 half + 1: elements e, e + 2
                frag[e] = a
                frag[e + 2] = b


def b_fragment_half(vec, part, col, N: int):
    """Where the mma form keeps element `col` of k (vec 0) or q (vec 1), f16 hi (part 0) or
    lo (part 1), in 16-bit units of its B operands: lane t = col // 32 reads the four halves
    4 j .. 4 j + 3 of its row ((2 vec + part) N / 32 + t) as mma j's two registers, which
    hold elements (e, e + 2) and (e + 1, e + 3), e = 8 (j // 2) + 4 (j % 2) of its 32: the A
    operand's order (`e2m1_as_e4m3` pairs elements e, e + 2). Plain ints or DSL Int32."""
    j = 2 * (col % 32 // 8) + col % 8 // 4
    o = col % 4
    return ((2 * vec + part) * (N // 32) + col // 32) * 32 + j * 4 + (o % 2) * 2 + o // 2


@cute.jit
def _stage_b_fragments(cfg: cutlass.Constexpr, T: cutlass.Constexpr, tidx, k_stage, q_stage,
                       frag_words):
    """The mma form's B operands of a head into shared memory: f16 hi = RN(x) and lo =
    RN(x - hi) of every k and q element x (hi + lo = x within 2^-22 |x| for |x| in f16's
    normal range), each where `_mma_row_sums` reads it (`b_fragment_half`)."""
    N = cfg.dk
    halves = cute.make_tensor(cute.recast_ptr(frag_words.iterator, dtype=cutlass.Float16),
                              cute.make_layout(B_FRAGMENT_BYTES // 2))
    for m in cutlass.range_constexpr((2 * N + T - 1) // T):
        e = tidx + T * m
        if e < 2 * N:
            vec = e // N  # 0: k, 1: q
            col = e % N
            x = nm._sel(vec == 0, k_stage[col].to(Float32), q_stage[col].to(Float32))
            hi = x.to(cutlass.Float16)
            lo = (x - hi.to(Float32)).to(cutlass.Float16)
            halves[b_fragment_half(vec, 0, col, N)] = hi
            halves[b_fragment_half(vec, 1, col, N)] = lo


def _mma_row_sums(N: int, codes_addr, scales_addr, frag_addr, row, lane):
    """Tensor cores: the block-scaled sums of codes x k and codes x q over lane (g, t)'s 32
    columns (32 t .. 32 t + 31: blocks 2 t and 2 t + 1) of rows `row` = 16 w + g and row + 8,
    as ((k row, k row + 8), (q row, q row + 8)); the caller multiplies them by 2^6 s_g and
    adds the quad's four. Each A operand is two rows' re-packed codes (E2M1 x 2^-6 in f16,
    exact); B's column n holds f16 hi (n = 2 t) or lo (n = 2 t + 1) of k (or q) on lane t's
    k indices only, zero elsewhere (Mamba-2's `replay_output._c_fragments` trick), so D's
    columns 2 t, 2 t + 1 are this lane's own block sums, which it scales by its E4M3 bytes in
    fp32. Shared-memory byte addresses: the stage's codes and scales, the B operands."""
    g, t = lane // 4, lane % 4
    codes = [ptx.lds_v4(codes_addr + (row + 8 * r) * (N // 2) + 16 * t) for r in range(2)]
    part = nm._sel(g == 2 * t, Int32(0), Int32(1))
    own = g // 2 == t
    zeros = frag_addr + B_FRAGMENT_BYTES - 64
    b_addr = [nm._sel(own, frag_addr + ((2 * vec + part) * (N // 32) + t) * 64, zeros)
              for vec in range(2)]
    acc = [[[Float32(0.0)] * 4 for _ in range(2)] for _ in range(2)]  # [vec][block]
    for i in range(4):  # word i: elements 8 i .. 8 i + 7, block 2 t + i // 2
        ev0, od0 = e2m1_as_e4m3(codes[0][i])
        ev1, od1 = e2m1_as_e4m3(codes[1][i])
        for half in range(2):  # mma j = 2 i + half: elements (e, e + 2), (e + 1, e + 3)
            a = [ptx.e4m3x2_to_f16x2(ev0, half), ptx.e4m3x2_to_f16x2(ev1, half),
                 ptx.e4m3x2_to_f16x2(od0, half), ptx.e4m3x2_to_f16x2(od1, half)]
            for vec in range(2):
                b = ptx.lds_words(b_addr[vec] + 8 * (2 * i + half), 2)
                acc[vec][i // 2] = mma_m16n8k16(a, b, acc[vec][i // 2])
    sums = [[], []]
    for r in range(2):
        scale_pair = ptx.lds_u16(scales_addr + (row + 8 * r) * (N // W) + 2 * t)
        s_even, s_odd = ptx.f16x2_to_f32x2(ptx.e4m3x2_to_f16x2(scale_pair))  # exact
        for vec in range(2):
            blocks = acc[vec]
            sums[vec].append(s_even * (blocks[0][2 * r] + blocks[0][2 * r + 1])
                             + s_odd * (blocks[1][2 * r] + blocks[1][2 * r + 1]))
    return sums[0], sums[1]


def _block_scale(scale_byte, global_scale):
    """(2^6 s_b) s_g: the factor of a block's partial sums of E2M1 x 2^-6 (2^6 s_b exact)."""
    return (nm.e4m3_value(Uint32(scale_byte)) * Float32(E2M1_AS_E4M3)) * global_scale


@dataclass(frozen=True)
class GDNOutputConfig:
    """Static parameters of the non-flush kernel (its compile-cache key): the step's
    `GDNConfig`, the heads each CTA takes in turn and the form of the read copy's dot
    products (`DOTS`; 'mma' for the NVFP4 read copy at d_k = 128 only)."""

    gdn: GDNConfig
    heads_per_cta: int
    dots: str = "ffma"

    def __post_init__(self):
        H, n = self.gdn.nheads, self.heads_per_cta
        if (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_HEADS_PER_CTA
                or H % n):
            fail("heads_per_cta", f"a divisor of nheads = {H} in [1, {MAX_HEADS_PER_CTA}]",
                 repr(n))
        if self.dots not in DOTS:
            fail("dots", f"one of {list(DOTS)}", repr(self.dots))
        if self.dots == "mma" and not mma_applies(self.gdn):
            fail("dots", f"'ffma' for lo_format {self.gdn.lo_format!r} at d_k = {self.gdn.dk} "
                 f"(the mma form: nvfp4 at d_k = {MMA_DK})", "'mma'")


def mma_applies(cfg: GDNConfig) -> bool:
    """Whether the tensor-core dot products apply: the NVFP4 read copy at d_k = 128 (a warp
    then owns a 16-row stripe of whole rows)."""
    return cfg.lo_format == "nvfp4" and cfg.dk == MMA_DK


def dots_of(cfg: GDNConfig) -> str:
    """The form a launch uses: 'mma' where it applies, else 'ffma'."""
    return "mma" if mma_applies(cfg) else "ffma"


def cta_threads(cfg: GDNConfig, dots: str) -> int:
    """Threads a CTA: the flush's dv dk / 64 for the ffma form; for the mma form a warp
    MMA_STRIPES_PER_WARP of the head's dv / 16 row stripes (one where dv / 16 is odd)."""
    if dots != "mma":
        return cfg.threads
    stripes = cfg.dv // 16
    per_warp = MMA_STRIPES_PER_WARP if stripes % MMA_STRIPES_PER_WARP == 0 else 1
    return 32 * (stripes // per_warp)


def min_ctas_per_sm(cfg: GDNConfig, dots: str) -> int:
    """The launch bound's CTAs an SM: the nvfp4 read copy at REGISTER_CAP registers a thread
    (four 256-thread CTAs, eight 128-thread); 0 (no bound) for the fp32 copy."""
    if cfg.lo_format != "nvfp4":
        return 0
    return REGISTERS_PER_SM // (REGISTER_CAP * cta_threads(cfg, dots))


def ring_rows(cfg: GDNConfig) -> int:
    """Ring records a stage holds: a non-flush step has c <= window - 2 of them."""
    return max(cfg.window - 2, 1)


def stage_bytes(cfg: GDNConfig) -> dict:
    """Bytes of each piece of a stage (the most one head copies into it), in their order in
    the stage; each a multiple of 16, as are the pieces' global offsets (a head row's bytes),
    for every head shape the cache allows (dv a multiple of 16, dk >= 128): the bulk copy
    engine's sizes and addresses."""
    a, P, N, rows = ACT_BYTES[cfg.act], cfg.dv, cfg.dk, ring_rows(cfg)
    pieces = {"codes": P * N // 2, "scales": P * N // W} if cfg.lo_format == "nvfp4" else {}
    pieces.update(ring_u=rows * P * 4, ring_k=rows * N * a, k=N * a, q=N * a, v=P * a)
    return pieces


def stage_offsets(cfg: GDNConfig) -> tuple[dict, int]:
    """(each piece's byte offset in a stage, the stride between stages: 128-byte aligned)."""
    offsets, end = {}, 0
    for name, size in stage_bytes(cfg).items():
        offsets[name] = end
        end += size
    return offsets, -(-end // 128) * 128


def cta_shared_bytes(cfg: GDNConfig, heads_per_cta: int = 1, stages: int | None = None,
                     dots: str = "ffma") -> int:
    """Shared memory of one CTA, allocation by allocation as the kernel makes them (each at
    its alignment): 42,352 B for nvfp4 at dv = dk = 128, L = 16, bf16 activations, 8 heads a
    CTA (the mma form: B_FRAGMENT_BYTES more). `stages` None: the kernel's (`stage_count`)."""
    n = heads_per_cta
    stages = stage_count(cfg, n, dots) if stages is None else stages
    pieces = [(stages * stage_offsets(cfg)[1], 128),
              (4 * 32, 16), (4 * 32, 16),  # kk_j, kq_j
              (4 * n * cfg.window, 16), (4 * 3 * n, 16),  # the heads' scalars
              (8 * stages, 8)]  # the barriers
    if dots == "mma":
        pieces.append((B_FRAGMENT_BYTES, 16))
    offset = 0
    for size, align in pieces:
        offset = -(-offset // align) * align + size
    return offset


def stage_count(cfg: GDNConfig, heads_per_cta: int = 1, dots: str = "ffma") -> int:
    """STAGES where they fit a CTA's shared memory and it takes more than one head, else 1 (a
    head's bytes then go in once the head before it is done): nvfp4 with fp32 activations at
    dv dk = 65,536 and a window of 31 or 32 (dv = 128, dk = 512; 32 for dv = 512, dk = 128)
    needs more than 227 KiB for two."""
    fits = cta_shared_bytes(cfg, heads_per_cta, STAGES, dots) <= CTA_SHARED_LIMIT
    return min(STAGES, heads_per_cta) if fits else 1


def _row_major(shape):
    strides, step = [], 1
    for extent in reversed(shape):
        strides.insert(0, step)
        step *= extent
    return cute.make_layout(shape, stride=tuple(strides))


def _lane_values(vec1d, lane, E: int):
    """Elements lane E .. lane E + E - 1 of a 1-d tensor as an fp32 register fragment."""
    frag = cute.make_rmem_tensor((E,), vec1d.element_type)
    cute.autovec_copy(cute.local_tile(vec1d, (E,), (lane,)), frag)
    values = cute.make_rmem_tensor((E,), Float32)
    values.store(frag.load().to(Float32))
    return values


class GDNOutput:
    def __init__(self, config: GDNOutputConfig):
        self.ocfg = config
        self.cfg = config.gdn

    @cute.jit
    def __call__(
        self,
        p_hi: cute.Pointer,
        p_lo: cute.Pointer,
        p_lo_scales: cute.Pointer,
        p_lo_global: cute.Pointer,
        p_ring_u: cute.Pointer,
        p_ring_v: cute.Pointer,
        p_ring_k: cute.Pointer,
        p_ring_g: cute.Pointer,
        p_ring_beta: cute.Pointer,
        p_cursors: cute.Pointer,
        p_q: cute.Pointer,
        p_k: cute.Pointer,
        p_v: cute.Pointer,
        p_g: cute.Pointer,
        p_beta: cute.Pointer,
        p_out: cute.Pointer,
        batch: Int32,
        stream,
    ):
        cfg = self.cfg
        H, P, N, L = cfg.nheads, cfg.dv, cfg.dk, cfg.window
        hi = cute.make_tensor(p_hi, cute.make_layout((batch, H, P, N),
                                                     stride=(H * P * N, P * N, N, 1)))
        codes = cute.make_tensor(p_lo, cute.make_layout(
            (batch, H, P, N // 8), stride=(H * P * N // 8, P * N // 8, N // 8, 1)))
        scales = cute.make_tensor(p_lo_scales, cute.make_layout(
            (batch, H, P, N // W), stride=(H * P * N // W, P * N // W, N // W, 1)))
        per_head = cute.make_layout((batch, H), stride=(H, 1))
        lo_global = cute.make_tensor(p_lo_global, per_head)
        value_ring = cute.make_layout((batch, H, L, P), stride=(H * L * P, L * P, P, 1))
        ring_u = cute.make_tensor(p_ring_u, value_ring)
        ring_v = cute.make_tensor(p_ring_v, value_ring)
        ring_k = cute.make_tensor(p_ring_k, cute.make_layout(
            (batch, H, L, N), stride=(H * L * N, L * N, N, 1)))
        ring_rows_ = cute.make_layout((batch, H, L), stride=(H * L, L, 1))
        ring_g = cute.make_tensor(p_ring_g, ring_rows_)
        ring_beta = cute.make_tensor(p_ring_beta, ring_rows_)
        cursors = cute.make_tensor(p_cursors, cute.make_layout(batch))
        keys_rows = cute.make_layout((batch, H, N), stride=(H * N, N, 1))
        q = cute.make_tensor(p_q, keys_rows)
        k = cute.make_tensor(p_k, keys_rows)
        value_rows = cute.make_layout((batch, H, P), stride=(H * P, P, 1))
        v = cute.make_tensor(p_v, value_rows)
        out = cute.make_tensor(p_out, value_rows)
        g = cute.make_tensor(p_g, per_head)
        beta = cute.make_tensor(p_beta, per_head)
        self.kernel(hi, codes, scales, lo_global, ring_u, ring_v, ring_k, ring_g, ring_beta,
                    cursors, q, k, v, g, beta, out).launch(
            grid=[H // self.ocfg.heads_per_cta, batch, 1],
            block=[cta_threads(cfg, self.ocfg.dots), 1, 1], stream=stream,
            min_blocks_per_mp=min_ctas_per_sm(cfg, self.ocfg.dots),
            preferred_smem_carveout=-1)  # the driver's choice, named: compiles without a GPU

    @cute.kernel
    def kernel(
        self,
        hi: cute.Tensor,
        codes: cute.Tensor,
        scales: cute.Tensor,
        lo_global: cute.Tensor,
        ring_u: cute.Tensor,
        ring_v: cute.Tensor,
        ring_k: cute.Tensor,
        ring_g: cute.Tensor,
        ring_beta: cute.Tensor,
        cursors: cute.Tensor,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        out: cute.Tensor,
    ):
        cfg = self.cfg
        n = self.ocfg.heads_per_cta
        H, P, N, L = cfg.nheads, cfg.dv, cfg.dk, cfg.window
        T = cta_threads(cfg, self.ocfg.dots)
        R, step = cfg.lanes_per_row, cfg.rows_per_pass
        nvfp4 = cfg.lo_format == "nvfp4"
        act = k.element_type
        rows_held = ring_rows(cfg)
        tidx, _, _ = cute.arch.thread_idx()
        group, s, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        col = tidx % R
        row0 = tidx // R
        rows = [row0 + step * r for r in range(cfg.passes)]

        # two stages, each a head's pieces at the same offsets (one register addresses a
        # stage), each piece laid out as its global rows
        smem = SmemAllocator()
        offsets, stride = stage_offsets(cfg)
        S = stage_count(cfg, n, self.ocfg.dots)
        sStages = smem.allocate_tensor(Uint8, cute.make_layout(S * stride), 128)

        def staged(name, dtype, shape):
            ptr = cute.recast_ptr(sStages.iterator + offsets[name], dtype=dtype)
            per_stage = _row_major((S,) + shape)
            layout = cute.make_layout(per_stage.shape,
                                      stride=(stride // (dtype.width // 8),) + per_stage.stride[1:])
            return cute.make_tensor(ptr, layout)

        sCodes = staged("codes", Uint32, (P, N // 8)) if nvfp4 else None
        sScales = staged("scales", Uint8, (P, N // W)) if nvfp4 else None
        sRingU = staged("ring_u", Float32, (rows_held, P))
        sRingK = staged("ring_k", act, (rows_held, N))
        sK = staged("k", act, (N,))
        sQ = staged("q", act, (N,))
        sV = staged("v", act, (P,))
        sKK = smem.allocate_tensor(Float32, cute.make_layout(32), 16)  # kk_j
        sKQ = smem.allocate_tensor(Float32, cute.make_layout(32), 16)  # kq_j
        # every head's scalars: the ring's g row, the call's g, beta, the global scale
        sRingG = smem.allocate_tensor(Float32, _row_major((n, L)), 16)
        sScalars = smem.allocate_tensor(Float32, _row_major((3, n)), 16)
        sBar = smem.allocate_tensor(Int64, cute.make_layout(S), 8)
        bar = sBar.iterator.toint()
        mma = self.ocfg.dots == "mma"
        sFrag = None
        if cutlass.const_expr(mma):
            sFrag = smem.allocate_tensor(Uint32, cute.make_layout(B_FRAGMENT_BYTES // 4), 16)

        # (offset in a stage, global tensor, bytes a head row in global memory, bytes copied
        # a head, bytes more per ring record held)
        a = ACT_BYTES[cfg.act]
        # the read copy's pieces do not depend on the cursor: the first heads' go out before
        # it is read, and the rest of their bytes once it is
        read_copy = []
        if cutlass.const_expr(nvfp4):
            read_copy = [(offsets["codes"], codes, P * N // 2, P * N // 2, 0),
                         (offsets["scales"], scales, P * N // W, P * N // W, 0)]
        rest = [(offsets["ring_u"], ring_u, L * P * 4, 0, P * 4),
                (offsets["ring_k"], ring_k, L * N * a, 0, N * a),
                (offsets["k"], k, N * a, N * a, 0),
                (offsets["q"], q, N * a, N * a, 0),
                (offsets["v"], v, P * a, P * a, 0)]
        pieces = read_copy + rest
        stages = (sStages.iterator.toint(), stride)
        h0 = group * n
        if tidx == 0:
            for b in cutlass.range_constexpr(S):
                ptx.mbar_init(bar + 8 * b)
            ptx.mbar_init_fence()
            for b in cutlass.range_constexpr(min(S, n)):
                _issue_pieces(read_copy, stages, bar, b, Int64(s) * H + (h0 + b), 0, False)
        if cutlass.const_expr(mma):
            if tidx < 16:  # the zero B operands
                sFrag[(B_FRAGMENT_BYTES - 64) // 4 + tidx] = Uint32(0)
        c = cursors[s]
        _stage_scalars(cfg, T, n, tidx, s, h0, ring_g, g, beta, lo_global, sRingG, sScalars)
        cute.arch.sync_threads()  # the barriers are set up before any thread waits on them
        if (c >= 0) & (c < L - 1):
            s64 = Int64(s)
            if tidx == 0:  # the rest of the first heads' bytes
                for b in cutlass.range_constexpr(min(S, n)):
                    _issue_pieces(rest, stages, bar, b, s64 * H + (h0 + b), c, True)
            # the ring's u: a row's lane row_lane adds records row_lane + row_lanes m
            row_lane, row_lanes = col, R
            if cutlass.const_expr(mma):  # a quad of lanes a row pair
                row_lane, row_lanes = lane % 4, 4
            ring_terms = (L - 1 + row_lanes - 1) // row_lanes
            held = [row_lane + row_lanes * m < c for m in range(ring_terms)]
            for i in cutlass.range(n, unroll=1):
                h = ptx.opaque_i32(h0 + i)  # no per-address induction variables
                st = i % S
                word_frags = []
                if cutlass.const_expr(not nvfp4):
                    hi_h = hi[s, h, None, None]
                    for r in cutlass.range_constexpr(cfg.passes):
                        frag = cute.make_rmem_tensor((W,), Float32)
                        cute.autovec_copy(chunk_of(hi_h, rows[r], col), frag)
                        word_frags.append(frag)
                ptx.mbar_wait(bar + 8 * st, (i // S) % 2)  # this head's bytes landed

                # lane j < c: the ring's g_j, lane c: the call's g, 0 past it
                g_c = sScalars[0, i]
                g_lane = nm._sel(lane < c, sRingG[i, cutlass.min(lane, L - 1)],
                                 nm._sel(lane == c, g_c, Float32(0.0)))
                beta_c = sScalars[1, i]
                # the record: nothing in this kernel reads ring position c
                _append_record(cfg, T, tidx, s, h, c, sK[st, None], sV[st, None], g_c, beta_c,
                               ring_k, ring_v, ring_g, ring_beta)

                # cumulative log-decays, in every warp: lane t cum_t -> w_t; G_c
                cum_c = Float32(0.0)
                cum_t = Float32(0.0)
                for t in cutlass.range_constexpr(L):
                    g_t = cute.arch.shuffle_sync(g_lane, t)
                    cum_c = cum_c + g_t
                    cum_t = cum_t + nm._sel(Int32(t) <= lane, g_t, Float32(0.0))
                w_lane = cute.math.exp(cum_c - cum_t)
                decay_c = cute.math.exp(cum_c)

                # kk_j, kq_j: warp w takes records w, w + T/32, ...; a lane dk / 32 columns
                E = N // 32
                k_lane = _lane_values(sK[st, None], lane, E)
                q_lane = _lane_values(sQ[st, None], lane, E)
                for m in cutlass.range_constexpr((L + T // 32 - 1) // (T // 32)):
                    j = warp + (T // 32) * m
                    if j <= c:
                        w_j = cute.arch.shuffle_sync(w_lane, j)
                        k_ring = _lane_values(sRingK[st, nm._sel(j < c, j, Int32(0)), None],
                                              lane, E)
                        kk = Float32(0.0)
                        kq = Float32(0.0)
                        for e in cutlass.range_constexpr(E):
                            k_je = nm._sel(j < c, k_ring[e], k_lane[e])
                            kw = k_je * w_j
                            kk = kk + kw * k_lane[e]
                            kq = kq + kw * q_lane[e]
                        kk = cute.arch.warp_reduction(kk, add)
                        kq = cute.arch.warp_reduction(kq, add)
                        if lane == 0:
                            sKK[j] = kk
                            sKQ[j] = kq
                if cutlass.const_expr(mma):
                    _stage_b_fragments(cfg, T, tidx, sK[st, None], sQ[st, None], sFrag)
                cute.arch.sync_threads()

                # one pass over the read copy, two products, plus the ring's terms
                if cutlass.const_expr(mma):
                    factor = (Float32(E2M1_AS_E4M3) * sScalars[2, i]) * decay_c
                else:
                    k_vec = load_vector_chunk(sK[st, None], col) * decay_c
                    q_vec = load_vector_chunk(sQ[st, None], col) * decay_c
                kq_c = sKQ[c]
                groups = P // 16 // (T // 32) if mma else 1  # a warp's stripes
                for grp in cutlass.range_constexpr(groups):
                    my_rows = rows
                    if cutlass.const_expr(mma):
                        # tensor cores: warp w the 16-row stripes w + (T / 32) grp, lane (g, t)
                        # rows 16 stripe + g and 16 stripe + g + 8, columns 32 t .. 32 t + 31
                        stripe = warp + (T // 32) * grp
                        my_rows = [16 * stripe + lane // 4, 16 * stripe + lane // 4 + 8]
                        stage = stages[0] + stride * st
                        mma_k, mma_q = _mma_row_sums(N, stage + offsets["codes"],
                                                     stage + offsets["scales"],
                                                     sFrag.iterator.toint(), my_rows[0], lane)
                    for r in cutlass.range_constexpr(len(my_rows)):
                        p = my_rows[r]
                        writer = col == 0
                        if cutlass.const_expr(mma):
                            part_k = mma_k[r] * factor
                            part_q = mma_q[r] * factor
                            writer = lane % 4 == r
                        else:
                            if cutlass.const_expr(nvfp4):
                                words = cute.make_rmem_tensor((W // 8,), Uint32)
                                cute.autovec_copy(chunk_of(sCodes[st, None, None], p, col, W // 8),
                                                  words)
                                vals = cute.make_rmem_tensor((W,), Float32)
                                _nvfp4_codes(vals, words)
                                values = vals.load()
                            else:
                                values = word_frags[r].load()
                            part_k = (values * k_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                            part_q = (values * q_vec).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                            if cutlass.const_expr(nvfp4):
                                scale = _block_scale(sScales[st, p, col], sScalars[2, i])
                                part_k = part_k * scale
                                part_q = part_q * scale
                        for m in cutlass.range_constexpr(ring_terms):
                            j_ring = nm._sel(held[m], row_lane + row_lanes * m, Int32(0))
                            u_j = sRingU[st, j_ring, p]
                            part_k = part_k + nm._sel(held[m], u_j * sKK[j_ring], Float32(0.0))
                            part_q = part_q + nm._sel(held[m], u_j * sKQ[j_ring], Float32(0.0))
                        total_k = cute.arch.warp_reduction(part_k, add, threads_in_group=row_lanes)
                        total_q = cute.arch.warp_reduction(part_q, add, threads_in_group=row_lanes)
                        u = beta_c * (sV[st, p].to(Float32) - total_k)
                        if writer:
                            ring_u[s, h, c, p] = u
                            out[s, h, p] = (total_q + u * kq_c).to(out.element_type)

                # every read of this stage (and of kk_j, kq_j) is done: head i + S goes in
                cute.arch.sync_threads()
                if (tidx == 0) & (i + S < n):
                    _issue_pieces(pieces, stages, bar, st, s64 * H + (h + S), c, True)
        if cutlass.const_expr(len(read_copy) > 0):
            # a slot past the window: the shared memory outlives the read copy's bulk copies
            # (after the head loop: a wait loop before it makes ptxas fence every shuffle)
            if (tidx == 0) & ((c < 0) | (c >= L - 1)):
                for b in cutlass.range_constexpr(min(S, n)):
                    ptx.mbar_expect(bar + 8 * b, 0)
                    ptx.mbar_wait(bar + 8 * b, 0)


def _issue_pieces(pieces, stages, bar, st, sh, c, arrive):
    """One thread: `pieces` of head row `sh` (slot nheads + head) into stage `st` (`stages`:
    the first stage's shared address and the stride), each one bulk copy (the ring's: records
    0 .. c-1), completing on the stage's barrier. `arrive`: this is the phase's one arrival
    (its last pieces); else their bytes are announced without it, so that the phase cannot
    complete before the rest are."""
    if not pieces:
        return
    total = sum(fixed for _, _, _, fixed, _ in pieces)
    per_record = sum(record for _, _, _, _, record in pieces)
    stage = stages[0] + stages[1] * st
    stage_bar = bar + 8 * st
    if arrive:
        ptx.mbar_expect(stage_bar, total + per_record * c)
    else:
        ptx.mbar_expect_tx(stage_bar, total + per_record * c)
    for offset, gmem_t, row, fixed, record in pieces:
        ptx.bulk_copy(stage + offset, gmem_t.iterator.toint() + sh * row, fixed + record * c,
                      stage_bar)


@cute.jit
def _stage_scalars(cfg: cutlass.Constexpr, T: cutlass.Constexpr, n: cutlass.Constexpr, tidx, s,
                   h0, ring_g, g, beta, lo_global, sRingG, sScalars):
    """The scalars of heads h0 .. h0 + n - 1 into shared memory, every load issued before the
    first store (one round trip, with the cursor's): the ring's g rows (whole: past the
    cursor unused), g, beta and the NVFP4 global scale."""
    L = cfg.window
    rounds = (n * L + T - 1) // T
    loaded = []
    for m in cutlass.range_constexpr(rounds):
        e = cutlass.min(tidx + T * m, n * L - 1)
        loaded.append(ring_g[s, h0 + e // L, e % L])
    head = cutlass.min(tidx, n - 1)
    scalars = [g[s, h0 + head], beta[s, h0 + head]]
    if cutlass.const_expr(cfg.lo_format == "nvfp4"):
        scalars.append(lo_global[s, h0 + head])
    for m in cutlass.range_constexpr(rounds):
        e = tidx + T * m
        if e < n * L:
            sRingG[e // L, e % L] = loaded[m]
    if tidx < n:
        for r in cutlass.range_constexpr(len(scalars)):
            sScalars[r, tidx] = scalars[r]


@cute.jit
def _append_record(cfg: cutlass.Constexpr, T: cutlass.Constexpr, tidx, s, h, c, k_stage,
                   v_stage, g_c, beta_c, ring_k, ring_v, ring_g, ring_beta):
    """Record (v, k from the stage, g, beta) of (s, h) to ring position `c` (u is the
    caller's)."""
    for m in cutlass.range_constexpr((cfg.dv + T - 1) // T):
        e = tidx + T * m
        if e < cfg.dv:
            ring_v[s, h, c, e] = v_stage[e]
    for m in cutlass.range_constexpr((cfg.dk + T - 1) // T):
        e = tidx + T * m
        if e < cfg.dk:
            ring_k[s, h, c, e] = k_stage[e]
    if tidx == 0:
        ring_g[s, h, c] = g_c
        ring_beta[s, h, c] = beta_c


def compile_gdn_output(cfg: GDNConfig, keep_ptx: bool = False,
                       heads_per_cta: int | None = None, dots: str | None = None):
    """The compiled non-flush kernel of `cfg` taking `heads_per_cta` heads a CTA (None:
    DEFAULT_HEADS_PER_CTA) with `dots` (None: `dots_of`, the launch's; 'ffma' at an mma head
    only to count the two forms; cached); `keep_ptx` keeps its PTX text."""
    ocfg = GDNOutputConfig(cfg, DEFAULT_HEADS_PER_CTA if heads_per_cta is None
                           else heads_per_cta, dots_of(cfg) if dots is None else dots)

    def build():
        f = _compile.fake_ptr
        act = CUTE_DTYPES[cfg.act]
        hi_t = Float32 if cfg.hi_format == "fp32" else cutlass.Float16
        args = (f(hi_t), f(Uint32), f(Uint8), f(Float32),
                f(Float32), f(act), f(act), f(Float32), f(Float32), f(Int32),
                f(act), f(act), f(act), f(Float32), f(Float32), f(act),
                Int32(1), _compile.fake_stream())
        return cute.compile(GDNOutput(ocfg), *args, options=_compile.compile_options(keep_ptx))

    return _compile.compile_cached(("gdn_output", ocfg, keep_ptx), build)


def launch_gdn_output(cfg: GDNConfig, cache, q, k, v, g, beta, out,
                      heads_per_cta: int | None = None):
    """Launch the non-flush kernel on torch's current stream (everything already validated):
    slots whose cursor is below window - 1 advance their output and record, the others are
    left alone. Reads the cursors, never writes them. `heads_per_cta` None:
    DEFAULT_HEADS_PER_CTA."""
    batch = cache.hi.shape[0]
    # the read path does not depend on the store's rounding or the debug output: one kernel
    kernel = compile_gdn_output(dataclasses.replace(cfg, hi_rounding="rn", has_debug=False),
                                heads_per_cta=heads_per_cta)
    gp = _compile.gmem_ptr
    kernel(gp(cache.hi), optional_ptr(cache.lo, Uint32),
           optional_ptr(cache.lo_scales, Uint8), optional_ptr(cache.lo_global, Float32),
           gp(cache.ring_u), gp(cache.ring_v), gp(cache.ring_k), gp(cache.ring_g),
           gp(cache.ring_beta), gp(cache.cursors), gp(q), gp(k), gp(v), gp(g), gp(beta),
           gp(out), Int32(batch), _compile.current_stream())


def traffic_bytes(lo_format: str, act: str, slots: int, nheads: int, dv: int, dk: int,
                  records: int) -> int:
    """Bytes one non-flush step moves for `slots` slots holding `records` ring records each
    (the cursor c), each read once and each write once: the read copy; the ring's u (fp32),
    k (act) and g; q, k, v, g, beta read; y written; the record (u, v, k, g, beta)
    appended."""
    a = ACT_BYTES[act]
    copy = dv * dk // 2 + dv * dk // W + 4 if lo_format == "nvfp4" else 4 * dv * dk
    ring = records * (4 * dv + a * dk + 4)
    inputs = (2 * dk + dv) * a + 8
    record = 4 * dv + (dv + dk) * a + 8
    return slots * nheads * (copy + ring + inputs + dv * a + record)
