"""Mamba-2 ReplaySSM non-flush step, persistent and software-pipelined (nvfp4 read copy).

The same contract as `cute_kernels.replay_output` (its module docstring; the reference is
`lowprec.mamba2.mamba2_replay_output`), reached with ``replay_output(..., persistent=True)``.
What differs is the schedule.

Why. ncu's warp sampling of the one-CTA-per-(group, slot) step (results/README.md,
"Fourteenth session") found its warps waiting on two chains in turn: each CTA's prologue (the
cursor, then the dt inputs, the ring's B rows and C, one dependent round trip after another)
and each head's read copy. Hiding one exposed the other, and a warp has no registers to hold
its next head early. Here a CTA outlives its work items and brings item ``i + 1`` in while it
computes item ``i``: every byte an item reads (read copies, ring records, ring B rows, B, C,
x, z, dt, the ring's dt, the global scales, A, D, dt_bias) comes in by the bulk copy engine
into one of two shared-memory stages, so no register holds bytes in flight and no warp waits
on global memory except for the appends and outputs it stores.

Work decomposition::

    item   = (slot, group, chunk): ``warps`` consecutive heads of one group, one a warp
    CTA b  : items b, b + grid, b + 2 grid, ...   (grid = SMs x CTAs an SM, at most the items)
    stage  : [head 0: codes | scales | ring x_j, j < cursor] ... [head W-1: ...]
             [ring B_j, j < cursor | B | C | x | z | ring dt | dt | s_g | A | D | dt_bias]
    warps  : ``warps`` consumers and one producer (lane 0 works)

    producer, item i:   load item i + 1's cursor; wait until the consumers released stage
                        i % stages; item i's bulk copies into it; item i's arrival at its
                        slot's cursor (the last to arrive stores the new count)
    consumers, item i:  wait for stage i % stages; the group's B_j . C (a record a warp); each
                        warp its head's decay weights; named barrier; each warp its head's
                        S_lo C (mma, replay_output's nvfp4 path) and epilogue; named barrier;
                        release the stage

The cursor protocol is replay_output's: every item of a slot adds ``1 << 16`` to the slot's
cursor after reading it, and the item that sees all the others' arrivals stores ``h``. A
flush slot's items copy nothing and leave everything alone, its cursor included (the forms
measured in calls 3-6 took the cursor by the arrival atomic and took a flush slot's arrival
back, which a counter kernel resetting that cursor at the same time would have raced).

The small per-head vectors (ring dt, dt, s_g, A, D, dt_bias) are copied as the 16-byte
aligned windows that hold them (the bulk copy engine wants 16-byte addresses and sizes), and
read at their offset in the window.
"""

from __future__ import annotations  # noqa: I001  (_compile must precede cutlass)

from cute_kernels import _compile  # noqa: F401  (sets the target before cutlass loads)

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator

from cute_kernels.numerics import bits_f32, inline_ptx
from cute_kernels.replay_output import (
    _ACT_BYTES, _NVFP4_UNDO, CTA_RESERVED_BYTES, SM_SHARED_BYTES, ReplayOutput,
    ReplayOutputConfig, _bulk_copy, _dot_warp,
    _f16x2_to_f32x2, _f32_to_words, _lds_u16, _lds_v4, _lds_words, _mbar_expect, _mbar_init,
    _mbar_init_fence, _output_pair, _sel, _store_warp_coefs, _store_words, _warp_decay_weights,
    _words_to_f32,
)

__all__ = ["PersistentReplayOutput", "stage_layout", "smem_bytes", "ctas_per_sm",
           "persistent_refusal"]

# A CTA may have at most 227 KiB.
CTA_SMEM_MAX = 227 * 1024
# At most this many CTAs (None: SMs times the resident CTAs). Tests lower it so that every
# CTA walks many items and the pipeline's stage reuse, parities and cursor look-ahead run.
MAX_CTAS: int | None = None
WINDOW_SLACK = 32  # bytes a 16-byte aligned window may add to a small vector (15 each side)


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def stage_layout(cfg: ReplayOutputConfig) -> tuple[dict, int]:
    """({piece: byte offset in a stage}, bytes a stage) of the persistent step: ``warps``
    heads of "head" bytes each (its codes, block scales, then ring records j <= window - 3,
    the bulk stage's layout), then the item's shared pieces; every piece at a 16-byte
    boundary, a stage a multiple of 128 bytes."""
    P, N, L, Lc, W = cfg.headdim, cfg.dstate, cfg.window, cfg.ring_capacity, cfg.warps
    ab, dtb = _ACT_BYTES[cfg.act], _ACT_BYTES[cfg.dt_dtype]
    lay = {"head": cfg.bulk_stride(True)}
    off = W * lay["head"]
    pieces = [("ring_B", (L - 2) * N * ab), ("B", N * ab), ("C", N * ab), ("x", W * P * ab)]
    if cfg.has_z:
        pieces.append(("z", W * P * ab))
    pieces += [("ring_dt", W * Lc * 4 + WINDOW_SLACK), ("dt", W * dtb + WINDOW_SLACK),
               ("s_g", W * 4 + WINDOW_SLACK), ("A", W * 4 + WINDOW_SLACK)]
    if cfg.has_D:
        pieces.append(("D", W * 4 + WINDOW_SLACK))
    if cfg.has_dt_bias:
        pieces.append(("dt_bias", W * 4 + WINDOW_SLACK))
    for name, size in pieces:
        lay[name] = off
        off += _round(size, 16)
    return lay, _round(off, 128)


def smem_bytes(cfg: ReplayOutputConfig) -> int:
    """Shared memory of one CTA: ``bulk_stages`` stages, their barriers and cursors, B . C,
    the partial sums and the coefficients (as the kernel allocates them, alignment
    included)."""
    _, stage = stage_layout(cfg)
    P, W = cfg.headdim, cfg.warps
    coef_row = ReplayOutput(cfg).coef_row
    return (cfg.bulk_stages * stage + 16 * cfg.bulk_stages + 16 + 128
            + _round(P * W * 4 * 4, 16) + _round(W * coef_row * 4, 16) + _round(W * 4, 16) + 128)


def ctas_per_sm(cfg: ReplayOutputConfig) -> int:
    """Resident CTAs an SM: as many as shared memory holds and 128 registers a thread allow
    (the kernel is compiled for that many; asked for more, ptxas capped a 3-warp CTA at 96
    registers and spilled)."""
    threads = 32 * (cfg.warps + 1)  # + the producer warp
    fit = SM_SHARED_BYTES // (smem_bytes(cfg) + CTA_RESERVED_BYTES)
    return max(1, min(fit, 65536 // (threads * 128)))


def persistent_refusal(cfg: ReplayOutputConfig) -> str | None:
    """Why the persistent step cannot run ``cfg`` (None: it can)."""
    P, N = cfg.headdim, cfg.dstate
    ab = _ACT_BYTES[cfg.act]
    if cfg.lo_format != "nvfp4":
        return "the nvfp4 read copy only"
    if cfg.window < 3:
        return "a window of 3 or more"
    if (P * ab) % 16 or (N * ab) % 16:
        return "rows of x and B that are multiples of 16 bytes (bulk copies)"
    if (cfg.nheads // cfg.ngroups) % cfg.warps:
        return f"warps dividing the heads of a group ({cfg.nheads // cfg.ngroups})"
    if smem_bytes(cfg) > CTA_SMEM_MAX:
        return (f"{cfg.bulk_stages} stages within {CTA_SMEM_MAX // 1024} KiB of shared memory "
                f"({smem_bytes(cfg)} bytes at {cfg.warps} warps; fewer warps or stages)")
    return None


# --------------------------------------------------------------------------------------------
# PTX helpers


@dsl_user_op
def _mbar_wait_parity(bar, parity, *, loc=None, ip=None) -> None:
    """Until the phase of ``bar`` with the (run-time) ``parity`` has completed."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip), Int32(parity).ir_value(loc=loc, ip=ip)],
               "{.reg .pred p; WAIT_PARITY: "
               "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
               "@!p bra WAIT_PARITY;}",
               "r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _mbar_arrive(bar, *, loc=None, ip=None) -> None:
    """One arrival on ``bar`` (release: this CTA's shared-memory accesses before it are seen
    by whoever waits on the phase)."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip)],
               "mbarrier.arrive.shared::cta.b64 _, [$0];", "r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _fence_proxy_async(*, loc=None, ip=None) -> None:
    """Orders the executing thread's earlier shared-memory writes (the zeroed ring tails), and
    those ordered before it, before the bulk copies issued after it, which may write the same
    bytes."""
    inline_ptx(None, [], "fence.proxy.async.shared::cta;", "", side_effects=True, loc=loc, ip=ip)


def _lds_n(addr, n: int) -> list:
    """``n`` words at a shared address aligned to the widest access the count allows."""
    if n % 4 == 0:
        words = []
        for i in range(0, n, 4):
            words += _lds_v4(addr + 16 * i // 4)
        return words
    if n % 2 == 0:
        words = []
        for i in range(0, n, 2):
            words += _lds_words(addr + 4 * i, 2)
        return words
    return [w for i in range(n) for w in _lds_words(addr + 4 * i, 1)]


def _lds_f32(addr) -> Float32:
    return bits_f32(_lds_words(addr, 1)[0])


def _bulk_window(dst, gaddr, nbytes: int, bar, issue: bool):
    """The 16-byte aligned window of global memory holding ``nbytes`` at ``gaddr``: its size
    (a multiple of 16), and when ``issue`` its bulk copy to shared address ``dst``. The bytes
    sit at ``dst + (gaddr & 15)``."""
    start = gaddr & Int64(~15)
    size = Int32(((gaddr + (nbytes + 15)) & Int64(~15)) - start)
    if issue:
        _bulk_copy(dst, start, size, bar)
    return size


# --------------------------------------------------------------------------------------------
# Kernel


class PersistentReplayOutput(ReplayOutput):
    """Host side and device body of the persistent step (helpers from ReplayOutput)."""

    @cute.jit
    def __call__(self, lo0: cute.Pointer, lo1: cute.Pointer, lo2: cute.Pointer,
                 ring_x: cute.Pointer, ring_dt: cute.Pointer, ring_B: cute.Pointer,
                 cursors: cute.Pointer, x: cute.Pointer, dt: cute.Pointer, A: cute.Pointer,
                 B: cute.Pointer, C: cute.Pointer, D: cute.Pointer, z: cute.Pointer,
                 dt_bias: cute.Pointer, out: cute.Pointer, batch: Int32, ctas: Int32, stream):
        self.kernel(
            lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A, B, C, D, z, dt_bias, out,
            batch,
        ).launch(
            grid=[ctas, 1, 1],
            block=[32 * (self.cfg.warps + 1), 1, 1],  # + the producer warp
            stream=stream,
            # registers: as many as the resident CTAs (set by shared memory) leave
            min_blocks_per_mp=ctas_per_sm(self.cfg),
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(self, lo0: cute.Pointer, lo1: cute.Pointer, lo2: cute.Pointer,
               ring_x: cute.Pointer, ring_dt: cute.Pointer, ring_B: cute.Pointer,
               cursors: cute.Pointer, x: cute.Pointer, dt: cute.Pointer, A: cute.Pointer,
               B: cute.Pointer, C: cute.Pointer, D: cute.Pointer, z: cute.Pointer,
               dt_bias: cute.Pointer, out: cute.Pointer, batch: Int32):
        cfg = self.cfg
        H, P, G, L = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.window
        W = cfg.warps
        per_slot = G * (H // G // W)  # items a slot
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        ptrs = (lo0, lo1, lo2, ring_x, ring_dt, ring_B, x, dt, A, B, C, D, z, dt_bias, out)

        lay, stage_bytes = stage_layout(cfg)
        smem = SmemAllocator()
        NS = cfg.bulk_stages  # stages: items in flight while one is computed is this minus one
        st_smem = smem.allocate_tensor(Uint32, cute.make_layout(NS * stage_bytes // 4),
                                       byte_alignment=128)
        # full[k] (the producer's copies into stage k landed), then empty[k] (the consumers are
        # done with stage k)
        bar_smem = smem.allocate_tensor(Int64, cute.make_layout(2 * NS), byte_alignment=16)
        meta = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        bc_smem = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=128)
        ys_smem = smem.allocate_tensor(Float32, cute.make_layout((P, W, 4)), byte_alignment=16)
        coef_row = self.coef_row
        coef_smem = smem.allocate_tensor(
            Float32, cute.make_layout((W, 1, coef_row), stride=(coef_row, coef_row, 1)),
            byte_alignment=16)
        ck_smem = smem.allocate_tensor(Float32, cute.make_layout((W, 1)), byte_alignment=16)
        st0 = st_smem.iterator.toint()
        bar0 = bar_smem.iterator.toint()

        total = batch * per_slot
        mine = (total - bid + nctas - 1) // nctas  # this CTA's items (the grid <= total)
        if tid == 0:
            for k in cutlass.range_constexpr(2 * NS):  # full[0..NS), empty[0..NS)
                _mbar_init(bar0 + 8 * k)
            _mbar_init_fence()
        cute.arch.sync_threads()

        if warp == W:
            # the producer warp (lane 0): an item's cursor, loaded an item ahead; its bytes into
            # a stage once the consumers have released the stage's previous item
            if lane == 0:
                cur = self._cursor(cursors, bid)
                for i in cutlass.range(mine, unroll=1):
                    item = bid + i * nctas
                    st = i % NS
                    cur_next = Int32(0)
                    if i + 1 < mine:
                        cur_next = self._cursor(cursors, item + nctas)
                    if i >= NS:  # the consumers released this stage's previous item
                        _mbar_wait_parity(bar0 + 8 * NS + 8 * st, (i // NS + 1) % 2)
                    _fence_proxy_async()  # the consumers' zeroed ring tails, before the copies
                    self._issue_item(ptrs, cursors, meta, item, cur, st0 + st * stage_bytes,
                                     bar0 + 8 * st, st)
                    cur = cur_next
        else:
            for i in cutlass.range(mine, unroll=1):
                st = i % NS
                _mbar_wait_parity(bar0 + 8 * st, (i // NS) % 2)
                cursor = meta[st]
                if cursor + 1 < L:
                    self._compute_item(ptrs, bid + i * nctas, cursor, st0 + st * stage_bytes,
                                       bc_smem, ys_smem, coef_smem, ck_smem, warp, lane)
                # the zeroed ring tails (generic-proxy writes) ordered before the bulk
                # copies that may rewrite those bytes, fenced by the writing threads before
                # they synchronise, the usual idiom for shared memory that the async proxy
                # touches next (the producer fences again after its wait)
                _fence_proxy_async()
                # every consumer is done with stage i % NS, B . C and the partial sums
                cute.arch.barrier(barrier_id=1, number_of_threads=32 * W)
                if tid == 0:
                    _mbar_arrive(bar0 + 8 * NS + 8 * st)

    # ---- producer (lane 0 of the last warp) ---------------------------------------------------

    def _cursor(self, cursors, item):
        """The records ``item``'s slot holds (low 16 bits: other items may have arrived)."""
        per_slot = self.cfg.ngroups * (self.cfg.nheads // self.cfg.ngroups // self.cfg.warps)
        return cute.arch.load((cursors + item // per_slot).llvm_ptr, Int32) & 0xFFFF

    @cute.jit
    def _issue_item(self, ptrs, cursors, meta, item, cursor, stage, bar, meta_index):
        """The producer: ``item``'s ``cursor`` into ``meta``; for a non-flush slot every byte
        the item reads into ``stage`` by bulk copies completing on ``bar``, then its arrival at
        the slot's cursor (the last item to arrive stores the new count); for a flush slot
        only the stage's phase, completed with no bytes (its cursor is left alone: the
        counter kernel of a decode step resets it)."""
        cfg = self.cfg
        lo0, lo1, lo2, ring_x, ring_dt, ring_B, x, dt, A, B, C, D, z, dt_bias, out = ptrs
        H, P, N, G, Lc, L, W = (cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups,
                                cfg.ring_capacity, cfg.window, cfg.warps)
        ab, dtb = _ACT_BYTES[cfg.act], _ACT_BYTES[cfg.dt_dtype]
        cpg = H // G // W
        lay, _ = stage_layout(cfg)
        meta[meta_index] = cursor
        s = item // (G * cpg)
        if cursor + 1 < L:
            grp = (item % (G * cpg)) // cpg
            head0 = grp * (H // G) + (item % cpg) * W
            s64 = Int64(s)
            sh0 = s64 * H + head0
            sg = s64 * G + grp
            codes, scales = P * N // 2, P * N // 16
            ring = cursor * (P * ab)
            windows = [("ring_dt", ring_dt.toint() + sh0 * (Lc * 4), W * Lc * 4),
                       ("dt", dt.toint() + sh0 * dtb, W * dtb),
                       ("s_g", lo2.toint() + sh0 * 4, W * 4),
                       ("A", A.toint() + Int64(head0) * 4, W * 4)]
            if cutlass.const_expr(cfg.has_D):
                windows.append(("D", D.toint() + Int64(head0) * 4, W * 4))
            if cutlass.const_expr(cfg.has_dt_bias):
                windows.append(("dt_bias", dt_bias.toint() + Int64(head0) * 4, W * 4))
            nbytes = W * (codes + scales + ring) + cursor * (N * ab) + 2 * N * ab + W * P * ab
            if cutlass.const_expr(cfg.has_z):
                nbytes = nbytes + W * P * ab
            for _, gaddr, size in windows:
                nbytes = nbytes + _bulk_window(0, gaddr, size, bar, issue=False)
            _mbar_expect(bar, nbytes)
            # a copy a head's codes, scales and ring records. One copy of the item's codes and
            # one of its scales (its heads are consecutive) was slower at batch 256 (cursors
            # 0 / 8 / 14: 62.9 / 64.8 / 68.7 -> 63.5 / 68.1 / 71.6 us), and so were a head's
            # codes in 2 or 4 copies (63.3 / 65.5 / 69.5 -> 65.7 / 66.4 / 69.8 and 70.5 / 70.8
            # / 72.5; results/kernel_bench_runs/persistent_ab_15/)
            for k in cutlass.range_constexpr(W):
                sh = sh0 + k
                dst = stage + k * lay["head"]
                _bulk_copy(dst, lo0.toint() + sh * codes, codes, bar)
                _bulk_copy(dst + codes, lo1.toint() + sh * scales, scales, bar)
                _bulk_copy(dst + cfg.read_copy_bytes, ring_x.toint() + sh * (Lc * P * ab), ring,
                           bar)
            _bulk_copy(stage + lay["ring_B"], ring_B.toint() + sg * (Lc * N * ab),
                       cursor * (N * ab), bar)
            _bulk_copy(stage + lay["B"], B.toint() + sg * (N * ab), N * ab, bar)
            _bulk_copy(stage + lay["C"], C.toint() + sg * (N * ab), N * ab, bar)
            _bulk_copy(stage + lay["x"], x.toint() + sh0 * (P * ab), W * P * ab, bar)
            if cutlass.const_expr(cfg.has_z):
                _bulk_copy(stage + lay["z"], z.toint() + sh0 * (P * ab), W * P * ab, bar)
            for name, gaddr, size in windows:
                _bulk_window(stage + lay[name], gaddr, size, bar, issue=True)
            # this item has read its slot's cursor; the last of the slot's items stores h
            old = cute.arch.atomic_add((cursors + s).llvm_ptr, Int32(1 << 16))
            if (old >> 16) == G * cpg - 1:
                cute.arch.store((cursors + s).llvm_ptr, cursor + 1)
        else:  # a flush slot: nothing to copy, the phase completes
            _mbar_expect(bar, 0)

    # ---- consumers (every warp) --------------------------------------------------------------

    def _window_addr(self, stage, lay, name, gaddr):
        return stage + lay[name] + Int32(gaddr & Int64(15))

    @cute.jit
    def _compute_item(self, ptrs, item, cursor, stage, bc_smem, ys_smem, coef_smem, ck_smem,
                      warp, lane):
        """One item's outputs and appends from its stage (every warp, one head each)."""
        cfg = self.cfg
        lay, _ = stage_layout(cfg)
        lo0, lo1, lo2, ring_x, ring_dt, ring_B, x, dt, A, B, C, D, z, dt_bias, out = ptrs
        H, P, N, G, Lc, L, W = (cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups,
                                cfg.ring_capacity, cfg.window, cfg.warps)
        ab, dtb, act = _ACT_BYTES[cfg.act], _ACT_BYTES[cfg.dt_dtype], cfg.act
        cpg = H // G // W
        s = item // (G * cpg)
        grp = (item % (G * cpg)) // cpg
        chunk = item % cpg
        head0 = grp * (H // G) + chunk * W
        s64 = Int64(s)
        sh0 = s64 * H + head0
        sg = s64 * G + grp
        sh = sh0 + warp
        hstage = stage + warp * lay["head"]  # this head's codes, scales, ring records
        ring_base = hstage + cfg.read_copy_bytes

        # the records past the cursor were not copied (a stage is reused with other cursors)
        # and are read with coefficient 0: zeros, not stale bits
        self._zero_ring_tails(ring_base - cfg.read_copy_bytes, 0, 1, cursor, lane)

        # ---- the group's dot products B_j . C (j = cursor: this step's B) ---------------------
        nb = N // 32
        vb = nb * ab // 4
        c_vals = _words_to_f32(_lds_n(stage + lay["C"] + lane * nb * ab, vb), act)
        for jj in cutlass.range_constexpr((L - 1 + W - 1) // W):
            j = warp + W * jj  # records j <= cursor, a warp each in turn (j = cursor: this B)
            if j <= cursor:
                row = _sel(j < cursor, stage + lay["ring_B"] + j * (N * ab), stage + lay["B"])
                words = _lds_n(row + lane * nb * ab, vb)
                bc_smem[j] = _dot_warp(_words_to_f32(words, act), c_vals)
                if j == cursor:
                    if chunk == 0:  # one item of the group appends B
                        _store_words(ring_B.toint() + ((sg * Lc + cursor) * N + lane * nb) * ab,
                                     words)
        ck = self._c_fragments(lambda off, n: _lds_n(stage + lay["C"] + off, n), lane)

        # ---- this warp's head: decay weights (replay_output's, its inputs from the stage) ----
        S = self.segment
        j = lane % S
        rdt = self._window_addr(stage, lay, "ring_dt", ring_dt.toint() + sh0 * (Lc * 4))
        ring_j = _lds_f32(rdt + (warp * Lc + cutlass.min(j, Lc - 1)) * 4)
        dta = self._window_addr(stage, lay, "dt", dt.toint() + sh0 * dtb) + warp * dtb
        if cutlass.const_expr(cfg.dt_dtype == "bf16"):
            raw = bits_f32(_lds_u16(dta) << Uint32(16))
        elif cutlass.const_expr(cfg.dt_dtype == "fp16"):
            raw = _f16x2_to_f32x2(_lds_u16(dta))[0]
        else:
            raw = _lds_f32(dta)
        hw = Int64(head0) * 4
        if cutlass.const_expr(cfg.has_dt_bias):
            raw = raw + _lds_f32(self._window_addr(stage, lay, "dt_bias", dt_bias.toint() + hw)
                                 + warp * 4)
        a_h = _lds_f32(self._window_addr(stage, lay, "A", A.toint() + hw) + warp * 4)
        passes = [(lane < S, sh, ring_j, raw, a_h)]
        weights = _warp_decay_weights(cfg, S, (lo0, lo1, lo2, ring_x, ring_dt, x, dt, A, D, z,
                                               dt_bias), passes, cursor, lane)
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * W)  # B . C of every record
        _store_warp_coefs(S, weights, 1, warp, lane, cursor, bc_smem, coef_smem, ck_smem)

        # ---- S_lo C: replay_output's nvfp4 mma path on the staged read copy ------------------
        g, t = lane // 4, lane % 4
        rows = self._nvfp4_term(ck, self._staged_state(hstage, lane), g, t)
        for i in cutlass.range_constexpr(len(rows)):
            ys_smem[rows[i][0], warp, t] = rows[i][1]
        cute.arch.sync_warp()

        # ---- epilogue: rows v, v + 1 on each lane --------------------------------------------
        s_g = _lds_f32(self._window_addr(stage, lay, "s_g", lo2.toint() + sh0 * 4) + warp * 4)
        d_h = Float32(0.0)
        if cutlass.const_expr(cfg.has_D):
            d_h = _lds_f32(self._window_addr(stage, lay, "D", D.toint() + hw) + warp * 4)
        row = coef_smem.iterator.toint() + 4 * self.coef_row * warp
        coefs = []
        for i in cutlass.range_constexpr((L - 2 + 3) // 4):
            coefs += [bits_f32(w) for w in _lds_v4(row + 16 * i)]
        c_last = coef_smem[warp, 0, cursor]
        ck_scale = ck_smem[warp, 0] * (s_g * Float32(_NVFP4_UNDO))
        for r in cutlass.range_constexpr((P + 63) // 64):
            v_raw = 64 * r + 2 * lane
            v = cutlass.min(v_raw, P - 2)
            xw = _lds_words(stage + lay["x"] + (warp * P + v) * ab, ab // 2)
            xv = _words_to_f32(xw, act)
            ys0, ys1 = ys_smem[v, warp, 0], ys_smem[v + 1, warp, 0]
            for q in cutlass.range_constexpr(1, 4):
                ys0 = ys0 + ys_smem[v, warp, q]
                ys1 = ys1 + ys_smem[v + 1, warp, q]
            zw = None
            if cutlass.const_expr(cfg.has_z):
                zw = _lds_words(stage + lay["z"] + (warp * P + v) * ab, ab // 2)
            acc0, acc1 = _output_pair(
                act, L - 2, ck_scale, (ys0, ys1), coefs,
                lambda j, v=v: _lds_words(ring_base + (j * P + v) * ab, ab // 2),
                c_last, d_h, xv, zw)
            if v_raw < P:
                _store_words(out.toint() + (sh * P + v) * ab, _f32_to_words([acc0, acc1], act))
                _store_words(ring_x.toint() + ((sh * Lc + cursor) * P + v) * ab, xw)
