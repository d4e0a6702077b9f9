"""Mamba-2 ReplaySSM non-flush decode step (output only), reading the packed read copy.

Contract (`lowprec.mamba2.mamba2_replay_output` on the ring after the append; docs/design.md).
For every slot ``s`` whose step is not a flush (``h = cursors[s] + 1 < window``), and every
head:

    append the record at ring position cursors[s]:  ring_x <- x (bit copy), ring_dt <- dt_proc,
                                                    ring_B <- B (once per group)
    y = g_{0:h} (S_lo C) + sum_{j<h} g_{j+1:h} dt_j (B_j . C) x_j + D x   [* silu(z)]
    cursors[s] <- h

with ``dt_proc = softplus(dt + dt_bias)`` (or ``dt + dt_bias``), ``g_{i:h} = exp(A * sum_{l=i..h-1}
dt_l)``, ``S_lo`` the dequantised read copy, record ``h-1`` this step's own ``(x, dt_proc, B)``.
Flush slots (``cursors[s] + 1 == window``) are left entirely alone (outputs, ring and cursor):
the flush kernel (replay_flush.py) handles them. Accumulation is fp32; outputs differ from the
reference only by summation order. The cache layout is `cute_kernels.cache.ReplayCache`'s.

Thread ownership (docs/kernels.md draws it): one CTA per (group, slot, head split), ``warps``
warps, each warp owns ``heads_per_group / (warps * head_splits)`` heads, one at a time. The CTA
computes the group's ``h`` dot products ``B_j . C`` once (shared memory) and appends ``B``; each
warp works out the decay weights of all its heads at once (a segment of lanes per head,
`_warp_decay_weights`) and stores their ring coefficients in shared memory; per head it forms
``S_lo C`` into shared memory, and every lane finishes two output rows (ring term, D, gate).

Checkpoint term, fp8/fp16/nvfp4 (``decode='mma'``): the state is the A operand of
``mma.sync.m16n8k16`` (f16 in, fp32 accumulate); C (fp32) is split into f16 ``hi + lo`` placed
in B's columns 0 and 1, so ``D[:,0] + D[:,1] = S C`` to about 2^-22. Each quad of lanes owns
two state rows (``g`` and ``g+8`` of a 16-row stripe) and loads them 16 bytes per lane; the k
index of each A register matches the bytes a lane loaded, and B is laid out with the same
permutation. E2M1 nibbles are re-packed as E4M3 bytes (E2M1 * 2^-6, `numerics.e2m1_as_e4m3`), which
the hardware converts to f16 pairs; the tensor cores sum codes times C per 16-element block and
each lane multiplies its blocks' sums by their E4M3 scales in fp32 (`_nvfp4_term`). fp32
(``decode='simt'``): octets of lanes read one row with 128-bit loads, FFMA against C in
registers, then a 3-step butterfly.

Where the bytes wait (`ReplayOutputConfig`): the read copy in registers, or (``stage='bulk'``,
nvfp4 on large grids) in shared-memory stages that lane 0 fills with the bulk copy engine one
head ahead, ring records included; the ring records in registers or (``ring_stage='smem'``) in
cp.async stages; ``eager_loads`` issues the prologue's loads before the cursor arrives.

Cursor update without a second launch: every CTA of a slot reads ``cursors[s]`` (low 16 bits),
then adds 1 << 16 to it atomically after its heads; the CTA that sees ``ngroups * head_splits -
1`` earlier arrivals stores ``h``. Between launches the cursors are plain counts.

Measurements behind every default: docs/performance.md.
"""

from __future__ import annotations  # noqa: I001  (_compile must precede cutlass)

import torch

from cute_kernels import _compile

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from cute_kernels import ptx
from cute_kernels import cache as kv
from cute_kernels.numerics import bits_f32, e2m1_as_e4m3
from cute_kernels.replay_output_config import (
    BULK_STAGES, DSTATE_MULTIPLE, TUNING_FIELDS, ReplayOutputConfig, _ACT_BYTES,
    _BYTES_PER_ELEMENT, _ELEMENTS_PER_LOAD, _config, _sm_count, _tuned, cta_shared_bytes,
    default_config, default_eager_loads, default_head_splits, default_ring_stage, default_stage,
    default_warps, output_config, read_copy,
)
from cute_kernels.replay_output_warp import (
    _ACT_CUTE, _f32_to_words, _f32x2_to_f16x2, _fold_words, _output_finish,
    _ring_dots, _ring_records, _sel, _step_dot, _store_warp_coefs, _warp_decay_loads,
    _warp_decay_weights, _words_to_f32,
)
from cute_kernels.tensor_core import mma_m16n8k16

__all__ = [
    "ReplayOutputConfig", "ReplayOutput", "mamba2_replay_output", "compile_replay_output",
    "launch_replay_output", "output_config", "default_config", "default_warps",
    "default_head_splits", "default_ring_stage", "default_eager_loads", "default_stage",
    "cta_shared_bytes", "read_copy", "traffic_bytes", "DSTATE_MULTIPLE", "TUNING_FIELDS",
]

# nvfp4: nibbles are re-packed as E4M3 bytes (E2M1 * 2^-6 exactly, never subnormal in f16)
# and converted to f16 by the hardware; the tensor cores sum codes times C per block and the
# block scale multiplies those sums in fp32, so y = sum_blocks s_b (D0 + D1) * 2^6 * s_g.
_NVFP4_UNDO = 2.0**6


# --------------------------------------------------------------------------------------------
# Kernel


class ReplayOutput:
    """Host side (launch) and device body of the non-flush step for one configuration."""

    def __init__(self, cfg: ReplayOutputConfig):
        self.cfg = cfg
        self.E = _ELEMENTS_PER_LOAD[cfg.lo_format]
        self.quads = cfg.quads  # partial sums per row that meet in shared memory

    @cute.jit
    def __call__(
        self,
        lo0: cute.Pointer,
        lo1: cute.Pointer,
        lo2: cute.Pointer,
        ring_x: cute.Pointer,
        ring_dt: cute.Pointer,
        ring_B: cute.Pointer,
        cursors: cute.Pointer,
        x: cute.Pointer,
        dt: cute.Pointer,
        A: cute.Pointer,
        B: cute.Pointer,
        C: cute.Pointer,
        D: cute.Pointer,
        z: cute.Pointer,
        dt_bias: cute.Pointer,
        out: cute.Pointer,
        batch: Int32,
        stream,
    ):
        self.kernel(
            lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A, B, C, D, z, dt_bias, out
        ).launch(
            grid=[self.cfg.ngroups * self.cfg.head_splits, batch, 1],
            block=[32 * self.cfg.warps, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.cfg.min_ctas,
            preferred_smem_carveout=-1,  # the driver's choice, named: compiles without a GPU
            use_pdl=False,
        )

    @cute.kernel
    def kernel(
        self,
        lo0: cute.Pointer,
        lo1: cute.Pointer,
        lo2: cute.Pointer,
        ring_x: cute.Pointer,
        ring_dt: cute.Pointer,
        ring_B: cute.Pointer,
        cursors: cute.Pointer,
        x: cute.Pointer,
        dt: cute.Pointer,
        A: cute.Pointer,
        B: cute.Pointer,
        C: cute.Pointer,
        D: cute.Pointer,
        z: cute.Pointer,
        dt_bias: cute.Pointer,
        out: cute.Pointer,
    ):
        cfg = self.cfg
        H, P, N, G, Lc, L = (
            cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups, cfg.ring_capacity, cfg.window
        )
        HPG, W, act = cfg.heads_per_group, cfg.warps, cfg.act
        SPL = cfg.head_splits
        HPS = HPG // SPL  # heads of this CTA
        ab = _ACT_BYTES[act]
        tid, _, _ = cute.arch.thread_idx()
        blk, s, _ = cute.arch.block_idx()
        grp = blk // SPL
        part = blk % SPL
        warp = tid // 32
        lane = tid % 32

        smem = SmemAllocator()
        bc_smem = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
        Q = self.quads  # partial sums per row (nvfp4: one per lane of a quad)
        ys_smem = smem.allocate_tensor(Float32, cute.make_layout((P, W, Q)), byte_alignment=16)
        # per warp and head: its ring coefficients g_{j+1:h} dt_j (B_j . C), one row of
        # self.coef_row floats (16-byte aligned for the epilogue's vector reads), and its
        # checkpoint factor g_{0:h}
        nh = HPS // W  # heads of a warp
        coef_smem = smem.allocate_tensor(
            Float32, cute.make_layout((W, nh, self.coef_row),
                                      stride=(nh * self.coef_row, self.coef_row, 1)),
            byte_alignment=16)
        ck_smem = smem.allocate_tensor(Float32, cute.make_layout((W, nh)), byte_alignment=16)
        bulk = cfg.stage == "bulk"
        NS = BULK_STAGES
        stride = cfg.bulk_stride()
        stage_base = Int32(0)
        bar_base = Int32(0)
        if cutlass.const_expr(bulk):
            st_smem = smem.allocate_tensor(
                Uint32, cute.make_layout(W * NS * stride // 4), byte_alignment=128
            )
            stage_base = st_smem.iterator.toint() + warp * (NS * stride)
            bar_smem = smem.allocate_tensor(Int64, cute.make_layout(W * NS), byte_alignment=8)
            bar_base = bar_smem.iterator.toint() + warp * (NS * 8)
        ring_bar_base = Int32(0)
        if cutlass.const_expr(bulk):
            # the first NS heads' ring records land on barriers of their own, so that a
            # head's decode waits only for its read copy and its epilogue for its records
            ring_bar_smem = smem.allocate_tensor(Int64, cute.make_layout(W * NS),
                                                 byte_alignment=8)
            ring_bar_base = ring_bar_smem.iterator.toint() + warp * (NS * 8)
        ring_staged = cfg.ring_stage == "smem"
        ring_cp = ring_staged and not bulk  # cp.async ring stages
        ring_base = Int32(0)
        RB = cfg.ring_stage_bytes
        if cutlass.const_expr(ring_cp):
            rs_smem = smem.allocate_tensor(Uint32, cute.make_layout(W * 2 * RB // 4),
                                           byte_alignment=16)
            ring_base = rs_smem.iterator.toint() + warp * (2 * RB)

        if cutlass.const_expr(bulk):
            # the first NS heads' read copies go to the copy engine before the cursor is read
            # (they do not depend on it); the ring records follow once the cursor is known,
            # on the stage's ring barrier
            if lane == 0:
                for k in cutlass.range_constexpr(NS):
                    ptx.mbar_init(bar_base + 8 * k)
                    ptx.mbar_init(ring_bar_base + 8 * k)
                ptx.mbar_init_fence()
                for k in cutlass.range_constexpr(min(NS, HPS // W)):
                    sh_k = Int64(s) * H + (grp * HPG + part * HPS + warp + W * k)
                    self._bulk_read_copy(lo0.toint(), lo1.toint(), sh_k,
                                         stage_base + k * stride, bar_base + 8 * k)
        raw_cursor = cute.arch.load((cursors + s).llvm_ptr, Int32)
        # eager_loads: the prologue's and the first head's loads go out with the cursor's
        eager = self._eager_loads(ptrs=(lo0, lo1, lo2, ring_x, ring_dt, x, dt, A, D, z, dt_bias),
                                  ring_B=ring_B, B=B, C=C, s=s, grp=grp, part=part, warp=warp,
                                  lane=lane) if cfg.eager_loads else {}
        cursor = Int32(raw_cursor) & 0xFFFF
        h = cursor + 1
        if cutlass.const_expr(cfg.eager_loads):
            if h >= L:
                # A flush slot's CTA folds every eager word into a shared-memory word it never
                # reads: with a use on both sides of the cursor's test, ptxas keeps the loads
                # ahead of it (it otherwise sinks them past the early exit, volatile ones too,
                # and they wait for the cursor after all). Such a CTA reads its slot's read
                # copy while a flush kernel on another stream may be rewriting it; the words
                # are dropped, so the race is harmless
                bc_smem[0] = bits_f32(_fold_words(eager))
                if cutlass.const_expr(bulk):
                    if lane == 0:  # no copy may still be writing this CTA's shared memory
                        for k in cutlass.range_constexpr(min(NS, HPS // W)):  # when it exits
                            ptx.mbar_wait(bar_base + 8 * k, 0)
        if h < L:
            s64 = Int64(s)
            sg = s64 * G + grp  # (slot, group) row of B, C, ring_B
            heads = [grp * HPG + part * HPS + warp + W * hh for hh in range(HPS // W)]
            ptrs = (lo0, lo1, lo2, ring_x, ring_dt, x, dt, A, D, z, dt_bias)
            # the decay weights of all of this warp's heads at once, a segment of lanes per
            # head: the loads here, in flight with the prologue's; the weights and their
            # products with B . C after the prologue's barrier
            decay_inputs = self._loaded(eager, "decay", lambda: _warp_decay_loads(
                cfg, self.segment, ptrs, heads[0], nh, s64, lane))
            loads = self._loaded(eager, "heads", lambda: [
                self._issue_head(ptrs, s64 * H + heads[k], heads[k], cursor, lane)
                for k in range(min(1, nh))])
            if cutlass.const_expr(bulk):
                # the records past the cursor are never copied (the same cursor for every
                # head of the slot) but are read with coefficient 0: zeros, not stale bits
                self._zero_ring_tails(stage_base, stride, NS, cursor, lane)
                if lane == 0:  # the first NS heads' records; their read copies are on the way
                    for k in cutlass.range_constexpr(min(NS, nh)):
                        self._bulk_ring(ring_x.toint(), s64 * H + heads[k],
                                        stage_base + k * stride, ring_bar_base + 8 * k,
                                        cursor)
                cute.arch.sync_warp()  # every lane waits on barriers lane 0 initialised
            if cutlass.const_expr(ring_cp):  # the first two heads' ring records
                for k in cutlass.range_constexpr(min(2, nh)):
                    self._stage_ring(ring_x.toint(), s64 * H + heads[k], ring_base + k * RB,
                                     cursor, lane)

            # ---- the group's dot products B_j . C, j < h (j = h-1: this step's B) ----------
            nb = N // 32  # consecutive elements of B and C per lane
            vb = nb * ab // 4
            c_vals = _words_to_f32(self._loaded(eager, "C", lambda: ptx.load_words(
                C.toint() + (sg * N + lane * nb) * ab, vb)), act)
            n_jj = (L - 1 + W - 1) // W  # ring records per warp
            # every load of the prologue goes out before any is used: one round trip (the
            # ring rows past the cursor are predicated off, no traffic)
            rb_words = self._loaded(eager, "ring_B", lambda: [
                self._ld_row_if(ring_B.toint() + ((sg * Lc + warp + W * jj) * N
                                                  + lane * nb) * ab, vb,
                                warp + W * jj < cursor)
                for jj in range(n_jj)])
            early = {"B": self._loaded(eager, "B", lambda: ptx.load_words(
                B.toint() + (sg * N + lane * nb) * ab, vb))}
            ck = self._loaded(eager, "ck", lambda: self._checkpoint_setup(C.toint(), sg, lane))
            if cutlass.const_expr(not cfg.late_dots):
                _ring_dots(cfg, rb_words, c_vals, cursor, warp, bc_smem)
                if warp == 0:
                    # this step's record: B . C, and B appended once per (slot, group)
                    _step_dot(cfg, early["B"], c_vals, cursor, part, bc_smem,
                              ring_B.toint() + ((sg * Lc + cursor) * N + lane * nb) * ab)
                cute.arch.sync_threads()
            # the weights after the barrier, beside the first checkpoint term for nvfp4
            with_decode = cfg.weights_placement == "with_decode"
            if cutlass.const_expr(not with_decode):
                weights = _warp_decay_weights(cfg, self.segment, ptrs, decay_inputs, cursor,
                                              lane)
                _store_warp_coefs(self.segment, weights, nh, warp, lane, cursor, bc_smem,
                                  coef_smem, ck_smem)
                cute.arch.sync_warp()
            # every thread of this CTA has read the cursor; the last CTA of the slot stores h
            # after this CTA's heads, so that no warp waits for the atomic
            arrivals = Int32(0)
            if tid == 0:
                arrivals = cute.arch.atomic_add((cursors + s).llvm_ptr, Int32(1 << 16))

            for hh in cutlass.range_constexpr(nh):
                head = heads[hh]
                sh = s64 * H + head  # (slot, head) row of every per-head tensor
                if cutlass.const_expr(bulk and hh + 1 < nh):  # one head ahead
                    loads.append(
                        self._issue_head(ptrs, s64 * H + heads[hh + 1], heads[hh + 1],
                                         cursor, lane)
                    )
                if cutlass.const_expr(not bulk and hh >= len(loads)):
                    loads.append(self._issue_head(ptrs, sh, head, cursor, lane))
                ld = loads[hh]
                stage = stage_base + (hh % NS) * stride if bulk else None
                if cutlass.const_expr(bulk):  # this head's bytes landed (use hh // NS of
                    ptx.mbar_wait(bar_base + 8 * (hh % NS), (hh // NS) % 2)  # its stage)
                    ld["state"] = self._staged_state(stage, lane)

                # ---- checkpoint term S_lo C -> ys_smem[:, warp] ----------------------------
                rows, writer = self._checkpoint_term(ck, ld["state"], lane)
                if writer:
                    for i in cutlass.range_constexpr(len(rows)):
                        ys_smem[rows[i][0], warp, (lane % 4) % Q] = rows[i][1]
                if cutlass.const_expr(cfg.late_dots and hh == 0):
                    # the group's B . C products now, and the barrier that publishes them
                    # before any warp reads them for its coefficients
                    _ring_dots(cfg, rb_words, c_vals, cursor, warp, bc_smem)
                    if warp == 0:
                        _step_dot(cfg, early["B"], c_vals, cursor, part, bc_smem,
                                  ring_B.toint() + ((sg * Lc + cursor) * N + lane * nb) * ab)
                    cute.arch.sync_threads()
                if cutlass.const_expr(with_decode and hh == 0):
                    # every head's coefficients, read after the warp barrier below
                    weights = _warp_decay_weights(cfg, self.segment, ptrs, decay_inputs,
                                                  cursor, lane)
                    _store_warp_coefs(self.segment, weights, nh, warp, lane, cursor, bc_smem,
                                      coef_smem, ck_smem)
                if cutlass.const_expr(ring_cp):  # this head's ring records landed
                    ptx.cp_async_wait(1 if hh + 1 < nh else 0)
                cute.arch.sync_warp()
                if cutlass.const_expr(bulk and hh < NS):
                    ptx.mbar_wait(ring_bar_base + 8 * hh, 0)  # this head's records

                # ---- epilogue: rows v, v+1 on each lane -----------------------------------
                # this head's ring coefficients and checkpoint factor
                row = coef_smem.iterator.toint() + 4 * self.coef_row * (warp * nh + hh)
                coefs = []
                for i in cutlass.range_constexpr((L - 2 + 3) // 4):
                    coefs += [bits_f32(w) for w in ptx.lds_v4(row + 16 * i)]
                c_last = coef_smem[warp, hh, cursor]  # this step's own record
                ck_scale = ck_smem[warp, hh] * ld["factor"]
                for r in cutlass.range_constexpr((P + 63) // 64):
                    v_raw = 64 * r + 2 * lane
                    v = cutlass.min(v_raw, P - 2)  # clamped: every lane joins the shuffles
                    xw = ld["x"][r]
                    xv = _words_to_f32(xw, act)
                    ys0, ys1 = ys_smem[v, warp, 0], ys_smem[v + 1, warp, 0]
                    for q in cutlass.range_constexpr(1, Q):
                        ys0 = ys0 + ys_smem[v, warp, q]
                        ys1 = ys1 + ys_smem[v + 1, warp, q]

                    def record(j, r=r, v=v, ld=ld, hh=hh, head_stage=stage):
                        # records j >= cursor were not loaded (zeros; eager_loads: loaded
                        # and zeroed here) and have coef 0; record L - 2 is never before
                        # the cursor (cursor <= L - 2 on a non-flush step)
                        if cutlass.const_expr(bulk):
                            words = ptx.lds_words(head_stage + cfg.read_copy_bytes
                                                  + (j * P + v) * ab, ab // 2)
                        elif cutlass.const_expr(ring_staged):
                            words = ptx.lds_words(ring_base + (hh % 2) * RB
                                                  + (j * P + v) * ab, ab // 2)
                        else:
                            words = ld["ring"][r][j]
                        if cutlass.const_expr(cfg.eager_loads and not ring_staged):
                            words = [_sel(j < cursor, w, Uint32(0)) for w in words]
                        return words

                    zw = ld["z"][r] if cfg.has_z else None
                    acc0, acc1 = ck_scale * ys0, ck_scale * ys1
                    acc0, acc1 = _ring_records(act, range(L - 2), coefs, record, acc0, acc1)
                    acc0, acc1 = _output_finish(act, acc0, acc1, c_last, ld["D"], xv, zw)
                    if v_raw < P:
                        out_words = _f32_to_words([acc0, acc1], act)
                        ptx.store_words(out.toint() + (sh * P + v) * ab, out_words)
                        ptx.store_words(ring_x.toint() + ((sh * Lc + cursor) * P + v) * ab, xw)
                cute.arch.sync_warp()
                if cutlass.const_expr(bulk and hh + NS < nh):
                    if lane == 0:  # every lane has read this stage: head hh + NS goes in
                        self._bulk_head(ptrs, s64 * H + heads[hh + NS], stage,
                                        bar_base + 8 * (hh % NS), cursor)
                if cutlass.const_expr(ring_cp and hh + 2 < nh):
                    # every lane has read this head's stage: the head after next goes into it
                    hn = hh + 2
                    self._stage_ring(ring_x.toint(), s64 * H + heads[hn],
                                     ring_base + (hn % 2) * RB, cursor, lane)
            if tid == 0:
                if (arrivals >> 16) == G * SPL - 1:
                    cute.arch.store((cursors + s).llvm_ptr, h)

    # ---- loads of one head -----------------------------------------------------------------

    def _eager_loads(self, ptrs, ring_B, B, C, s, grp, part, warp, lane) -> dict:
        """eager_loads: the loads that the prologue and a warp's first head need, issued
        while the cursor is still on its way: the first head (read copy, x, D; every ring
        record too unless they are staged), every ring B row (whatever the cursor, so none is
        predicated on it; those past it are zeroed or skipped where used), this step's B, C in
        both layouts and the decay weights' inputs. One dependent round trip instead of two;
        the unneeded rows cost bytes, which pays where the grid is latency-bound."""
        cfg = self.cfg
        H, N, G, Lc, L, W = (cfg.nheads, cfg.dstate, cfg.ngroups, cfg.ring_capacity,
                             cfg.window, cfg.warps)
        HPG, HPS, act = cfg.heads_per_group, cfg.heads_per_group // cfg.head_splits, cfg.act
        ab = _ACT_BYTES[act]
        s64 = Int64(s)
        sg = s64 * G + grp
        heads = [grp * HPG + part * HPS + warp + W * hh for hh in range(HPS // W)]
        nh = HPS // W
        nb = N // 32
        vb = nb * ab // 4
        n_jj = (L - 1 + W - 1) // W
        return {
            "heads": [self._issue_head(ptrs, s64 * H + heads[k], heads[k], None, lane)
                      for k in range(min(1, nh))],
            "ring_B": [ptx.load_words(ring_B.toint() + ((sg * Lc + warp + W * jj) * N
                                                        + lane * nb) * ab, vb)
                       for jj in range(n_jj)],
            "B": ptx.load_words(B.toint() + (sg * N + lane * nb) * ab, vb),
            "C": ptx.load_words(C.toint() + (sg * N + lane * nb) * ab, vb),
            "ck": self._checkpoint_setup(C.toint(), sg, lane),
            "decay": _warp_decay_loads(cfg, self.segment, ptrs, heads[0], nh, s64, lane),
        }

    @staticmethod
    def _loaded(early: dict, key: str, load):
        """``early[key]`` if the words were loaded ahead, else ``load()`` now. (A dict, not a
        name bound on one branch only: the DSL refuses a variable whose type differs between
        the paths of a dynamic ``if``.)"""
        return early[key] if key in early else load()

    @staticmethod
    def _ld_row_if(addr, n: int, pred) -> list:
        """``n`` consecutive words at ``addr`` (aligned to 4n bytes) if ``pred``, else
        zeros: pairs of predicated 8-byte loads (one 4-byte load for n = 1)."""
        if n == 1:
            return ptx.ld_words_if(addr, 1, pred)
        words = []
        for i in range(0, n, 2):
            words += ptx.ld_words_if(addr + 4 * i, 2, pred)
        return words

    @property
    def segment(self) -> int:
        return self.cfg.segment

    @property
    def coef_row(self) -> int:
        return self.cfg.coef_row

    def _issue_head(self, ptrs, sh, head, cursor, lane) -> dict:
        """Every global load one head needs, issued together (none depends on another):
        the read copy (registers stage), the ring records before the cursor (predicated:
        records past it cost no traffic; ``cursor`` None: every record, for the eager loads),
        D, x, z (dt and A: `_warp_decay_loads`)."""
        cfg = self.cfg
        lo0, lo1, lo2, ring_x, _, x, _, _, D, z, _ = ptrs
        P, Lc, L, act = cfg.headdim, cfg.ring_capacity, cfg.window, cfg.act
        ab = _ACT_BYTES[act]
        ld = {"state": None}
        if cfg.stage == "registers":
            ld["state"] = self._issue_state(lo0.toint(), lo1.toint(), sh, lane)
        ld["factor"] = Float32(1.0)
        if cfg.lo_format == "nvfp4":
            s_g = Float32(cute.arch.load((lo2 + sh).llvm_ptr, Float32))
            ld["factor"] = s_g * Float32(_NVFP4_UNDO)
        ld["D"] = Float32(0.0)
        if cfg.has_D:
            ld["D"] = Float32(cute.arch.load((D + head).llvm_ptr, Float32))
        ld["x"], ld["z"], ld["ring"] = [], [], []
        for r in range((P + 63) // 64):
            v = cutlass.min(64 * r + 2 * lane, P - 2)
            ld["x"].append(ptx.load_words(x.toint() + (sh * P + v) * ab, ab // 2))
            if cfg.has_z:
                ld["z"].append(ptx.load_words(z.toint() + (sh * P + v) * ab, ab // 2))
            if cfg.ring_stage == "smem":  # read from the warp's ring stage in the epilogue
                continue
            if cursor is None:  # eager_loads: every record, zeroed past the cursor when used
                ld["ring"].append([ptx.load_words(ring_x.toint() + ((sh * Lc + j) * P + v)
                                                  * ab, ab // 2) for j in range(L - 2)])
                continue
            ld["ring"].append([
                ptx.ld_words_if(ring_x.toint() + ((sh * Lc + j) * P + v) * ab, ab // 2,
                                j < cursor)
                for j in range(L - 2)
            ])
        return ld

    # ---- checkpoint term, per format -------------------------------------------------------

    def _checkpoint_setup(self, c_addr, sg, lane):
        """Per-warp registers that depend only on (slot, group): C in the B-fragment layout
        (mma) or the lane's slice of C (simt)."""
        cfg = self.cfg
        N, act = cfg.dstate, cfg.act
        ab = _ACT_BYTES[act]
        row = c_addr + sg * N * ab
        if cfg.decode == "simt":
            # lane l8 = lane % 8 owns k = 4*l8 + 32*m, m < N/32
            l8 = lane % 8
            vals = []
            for m in range(N // 32):
                vals += _words_to_f32(ptx.load_words(row + (32 * m + 4 * l8) * ab, ab), act)
            return vals
        return self._c_fragments(lambda off, n: ptx.load_words(row + off, n), lane)

    def _c_fragments(self, load, lane):
        """C in the mma's B-fragment layout, its words read by ``load(byte offset in C's row,
        words)`` (global memory)."""
        cfg, E = self.cfg, self.E
        N, act = cfg.dstate, cfg.act
        ab = _ACT_BYTES[act]
        # mma: lane (g, t) holds column g of B; g = 0 -> f16(C), g = 1 -> f16(C - f16(C)).
        # nvfp4: columns 2t' and 2t'+1 hold C's hi and lo on lane t''s k only (zero on the
        # other lanes' k), so D[r, 2t] + D[r, 2t+1] is row r's sum over lane t's block alone.
        g = lane // 4
        t = lane % 4
        hi_col, lo_col = (2 * t, 2 * t + 1) if self.quads == 4 else (0, 1)
        frags = []
        for c in range(N // (4 * E)):
            cv = _words_to_f32(load((4 * E * c + E * t) * ab, E * ab // 4), act)
            for j in range(E // 4):
                kap = self._kappa(j)
                pair = []
                for q in range(2):
                    c0, c1 = cv[kap[2 * q]], cv[kap[2 * q + 1]]
                    hi = _f32x2_to_f16x2(c0, c1)
                    h0, h1 = ptx.f16x2_to_f32x2(hi)
                    lo = _f32x2_to_f16x2(c0 - h0, c1 - h1)
                    pair.append(_sel(g == hi_col, hi, _sel(g == lo_col, lo, Uint32(0))))
                frags.append(pair)
        return frags

    def _kappa(self, j: int) -> tuple:
        """k offsets (within a lane's E loaded elements) of A-fragment slots (2t, 2t+1, 2t+8,
        2t+9) of mma j: they must be the elements that the lane's registers hold."""
        if self.cfg.lo_format == "nvfp4":
            # word j//2; bytes 0-1 (j even) or 2-3 (j odd) of its even and odd re-packs:
            # nibbles (0, 2), (1, 3) or (4, 6), (5, 7)
            base = 8 * (j // 2) + 4 * (j % 2)
            return (base, base + 2, base + 1, base + 3)
        return (4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3)

    def _issue_state(self, lo0, lo1, sh, lane) -> list:
        """The lane's share of one head's read copy (byte addresses ``lo0`` codes/values,
        ``lo1`` nvfp4 scales): 16-byte loads, issued before any is used (or, for formats
        without ``state_upfront``, a thunk the compute step calls)."""
        if not self.cfg.state_upfront:
            return lambda: self._issue_state_now(lo0, lo1, sh, lane)
        return self._issue_state_now(lo0, lo1, sh, lane)

    def _bulk_head(self, ptrs, sh, stage, bar, cursor) -> None:
        """stage="bulk", lane 0: one head's codes, block scales and ring records j < cursor
        (each contiguous in global memory) into the stage at shared address ``stage``,
        completing on the stage's barrier ``bar``."""
        cfg = self.cfg
        lo0, lo1, _, ring_x = ptrs[:4]
        ring = cursor * (cfg.headdim * _ACT_BYTES[cfg.act])
        self._bulk_read_copy(lo0.toint(), lo1.toint(), sh, stage, bar, ring)
        self._bulk_records(ring_x.toint(), sh, stage, bar, ring)

    def _bulk_read_copy(self, lo0, lo1, sh, stage, bar, more=0) -> None:
        """Lane 0: one head's codes and block scales into its stage, completing on ``bar``,
        which expects ``more`` bytes besides (the ring records `_bulk_head` sends with them);
        for the first heads, before the cursor is known."""
        P, N = self.cfg.headdim, self.cfg.dstate
        codes, scales = P * N // 2, P * N // 16
        ptx.mbar_expect(bar, more + self.cfg.read_copy_bytes)
        ptx.bulk_copy(stage, lo0 + sh * codes, codes, bar)
        ptx.bulk_copy(stage + codes, lo1 + sh * scales, scales, bar)

    def _bulk_records(self, ring_x, sh, stage, bar, nbytes) -> None:
        """Lane 0: the first ``nbytes`` of a head's ring records into its stage, behind the
        read copy, completing on ``bar``."""
        cfg = self.cfg
        P, Lc, ab = cfg.headdim, cfg.ring_capacity, _ACT_BYTES[cfg.act]
        ptx.bulk_copy(stage + cfg.read_copy_bytes, ring_x + sh * (Lc * P * ab), nbytes, bar)

    def _bulk_ring(self, ring_x, sh, stage, bar, cursor) -> None:
        """The ring records j < cursor of a head whose read copy `_bulk_read_copy` sent, once
        the cursor is known, completing on ``bar`` (the stage's ring barrier)."""
        ring = cursor * (self.cfg.headdim * _ACT_BYTES[self.cfg.act])
        ptx.mbar_expect(bar, ring)
        self._bulk_records(ring_x, sh, stage, bar, ring)

    def _zero_ring_tails(self, stage_base, stride, stages, cursor, lane) -> None:
        """Zeros in every bulk stage's ring records j >= cursor (16 bytes a lane and store)."""
        cfg = self.cfg
        pieces, per_record = cfg.ring_stage_bytes // 16, cfg.headdim * _ACT_BYTES[cfg.act] // 16
        for k in range(stages):
            for i in range((pieces + 31) // 32):
                piece = lane + 32 * i
                tail = _sel(piece >= cursor * per_record, Int32(1), Int32(0))
                if (i + 1) * 32 > pieces:  # lanes past the end store nothing
                    tail = _sel(piece < pieces, tail, Int32(0))
                ptx.sts_zero16_if(stage_base + k * stride + cfg.read_copy_bytes + piece * 16, tail)

    def _stage_ring(self, ring_x, sh, stage, cursor, lane) -> None:
        """cp.async one head's ring records j <= window - 3 (contiguous in global memory)
        into a warp's ring stage at shared address ``stage``, 16 bytes per lane and copy,
        records past the cursor zero-filled (no traffic); one group."""
        cfg = self.cfg
        P, Lc, ab = cfg.headdim, cfg.ring_capacity, _ACT_BYTES[cfg.act]
        pieces, per_record = cfg.ring_stage_bytes // 16, P * ab // 16
        for i in range((pieces + 31) // 32):
            piece = lane + 32 * i
            if (i + 1) * 32 > pieces:  # lanes past the end copy the last piece again (the
                piece = cutlass.min(piece, pieces - 1)  # same bytes: a harmless race)
            j = piece // per_record
            ptx.cp_async_16_zfill(stage + piece * 16, ring_x + (sh * Lc * P * ab + piece * 16),
                               _sel(j < cursor, Int32(16), Int32(0)))
        ptx.cp_async_commit()

    def _staged_state(self, stage, lane):
        """The lane's share of a staged head, in `_issue_state_now`'s layout, read from
        shared memory one 16-row stripe at a time (indexing issues the reads)."""
        P, N, E = self.cfg.headdim, self.cfg.dstate, self.E
        g, t = lane // 4, lane % 4
        row_bytes, sc_row, codes = N // 2, N // 16, P * N // 2

        class Stripes:
            def __getitem__(self, q):
                r1 = 16 * q + g
                chunks = []
                for c in range(N // (4 * E)):
                    a1 = ptx.lds_v4(stage + r1 * row_bytes + 64 * c + 16 * t)
                    a2 = ptx.lds_v4(stage + (r1 + 8) * row_bytes + 64 * c + 16 * t)
                    sc = (ptx.lds_u16(stage + codes + r1 * sc_row + 8 * c + 2 * t),
                          ptx.lds_u16(stage + codes + (r1 + 8) * sc_row + 8 * c + 2 * t))
                    chunks.append((a1, a2, sc))
                return chunks

        return Stripes()

    def _issue_state_now(self, lo0, lo1, sh, lane) -> list:
        cfg, E = self.cfg, self.E
        P, N = cfg.headdim, cfg.dstate
        fmt = cfg.lo_format
        if cfg.decode == "simt":
            # octet o = lane // 8 owns row 4p + o of pass p; lane l8 = lane % 8 the k in
            # [32m + 4 l8, 32m + 4 l8 + 4): each access is 16 bytes, each octet 128
            o, l8 = lane // 8, lane % 8
            return [
                [ptx.load_words(lo0 + ((sh * P + 4 * p + o) * N + 32 * m + 4 * l8) * 4, 4, True)
                 for m in range(N // 32)]
                for p in range(P // 4)
            ]
        g, t = lane // 4, lane % 4
        row_bytes = int(N * _BYTES_PER_ELEMENT[fmt])
        stripes = []
        for q in range(P // 16):
            r1 = 16 * q + g
            chunks = []
            for c in range(N // (4 * E)):
                a1 = ptx.load_words(lo0 + (sh * P + r1) * row_bytes + 64 * c + 16 * t, 4, True)
                a2 = ptx.load_words(lo0 + (sh * P + r1 + 8) * row_bytes + 64 * c + 16 * t, 4,
                                    True)
                sc = None
                if fmt == "nvfp4":
                    sc_row = N // 16
                    sc = (ptx.ld_u16(lo1 + (sh * P + r1) * sc_row + 8 * c + 2 * t),
                          ptx.ld_u16(lo1 + (sh * P + r1 + 8) * sc_row + 8 * c + 2 * t))
                chunks.append((a1, a2, sc))
            stripes.append(chunks)
        return stripes

    def _checkpoint_term(self, ck, state, lane):
        """The raw S_lo C sums of one head from its loaded ``state``: ``(rows, writer)``,
        (row, value) pairs held by the lanes with ``writer`` set (they still need the
        head's factor: nvfp4 2^7 s_g, others 1)."""
        cfg = self.cfg
        P, N = cfg.headdim, cfg.dstate
        fmt = cfg.lo_format
        if callable(state):
            state = state()
        rows = []
        if cfg.decode == "simt":
            o, l8 = lane // 8, lane % 8
            for p in range(P // 4):
                acc = Float32(0.0)
                for m in range(N // 32):
                    for e in range(4):
                        acc = acc + bits_f32(state[p][m][e]) * ck[4 * m + e]
                for off in (4, 2, 1):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, off)
                rows.append((4 * p + o, acc))
            return rows, l8 == 0

        g, t = lane // 4, lane % 4
        if fmt == "nvfp4":
            return self._nvfp4_term(ck, state, g, t), True
        for q in range(P // 16):
            r1 = 16 * q + g
            acc = [Float32(0.0)] * 4
            for c, (a1, a2, _) in enumerate(state[q]):
                if fmt == "fp8_e4m3":
                    for j in range(4):
                        a = [
                            ptx.e4m3x2_to_f16x2(a1[j]),
                            ptx.e4m3x2_to_f16x2(a2[j]),
                            ptx.e4m3x2_to_f16x2(a1[j], 1),
                            ptx.e4m3x2_to_f16x2(a2[j], 1),
                        ]
                        acc = mma_m16n8k16(a, ck[c * 4 + j], acc)
                else:  # fp16: the loaded words are the A registers
                    for j in range(2):
                        a = [a1[2 * j], a2[2 * j], a1[2 * j + 1], a2[2 * j + 1]]
                        acc = mma_m16n8k16(a, ck[c * 2 + j], acc)
            rows += [(r1, acc[0] + acc[1]), (r1 + 8, acc[2] + acc[3])]
        return rows, t == 0

    def _nvfp4_term(self, ck, state, g, t):
        """nvfp4: per 16-row stripe and chunk, the mmas of words 0-1 (block 2t of the lane's
        chunk) and of words 2-3 (block 2t + 1) accumulate apart, so that D's columns 2t, 2t+1
        hold each row's unscaled sums over this lane's two blocks; the lane multiplies them
        by its own block scales in fp32. Each lane's partial sums of rows g and g + 8 go to
        shared memory (the epilogue adds the quad's four). No f16 multiply per element."""
        P = self.cfg.headdim
        rows = []
        for q in range(P // 16):
            part = [Float32(0.0), Float32(0.0)]  # rows g, g + 8 of the stripe
            for c, (a1, a2, sc_raw) in enumerate(state[q]):
                acc = [[Float32(0.0)] * 4, [Float32(0.0)] * 4]  # blocks 2t, 2t + 1
                for i in range(4):  # word i: elements 8i..8i+7, block 2t + i // 2
                    ev1, od1 = e2m1_as_e4m3(a1[i])
                    ev2, od2 = e2m1_as_e4m3(a2[i])
                    for half in range(2):  # mma j = 2i + half (see _kappa)
                        a = [
                            ptx.e4m3x2_to_f16x2(ev1, half),
                            ptx.e4m3x2_to_f16x2(ev2, half),
                            ptx.e4m3x2_to_f16x2(od1, half),
                            ptx.e4m3x2_to_f16x2(od2, half),
                        ]
                        acc[i // 2] = mma_m16n8k16(a, ck[c * 8 + 2 * i + half], acc[i // 2])
                for r, sv in enumerate(sc_raw):  # scales of blocks 2t, 2t + 1, rows g, g + 8
                    s_even, s_odd = ptx.f16x2_to_f32x2(ptx.e4m3x2_to_f16x2(sv))  # exact
                    part[r] = (part[r] + s_even * (acc[0][2 * r] + acc[0][2 * r + 1])
                               + s_odd * (acc[1][2 * r] + acc[1][2 * r + 1]))
            rows += [(16 * q + g, part[0]), (16 * q + g + 8, part[1])]
        return rows


# --------------------------------------------------------------------------------------------
# Compile cache and public function


def _pointer_types(cfg: ReplayOutputConfig) -> list:
    act = _ACT_CUTE[cfg.act]
    lo = {
        "nvfp4": (cutlass.Uint8, cutlass.Uint8, Float32),
        "fp8_e4m3": (cutlass.Uint8, cutlass.Uint8, Float32),
        "fp16": (cutlass.Float16, cutlass.Uint8, Float32),
        "fp32": (Float32, cutlass.Uint8, Float32),
    }[cfg.lo_format]
    return [
        *lo, act, Float32, act, Int32, act, _ACT_CUTE[cfg.dt_dtype], Float32, act, act,
        Float32, act, Float32, act,
    ]


def compile_replay_output(cfg: ReplayOutputConfig, keep_ptx: bool = False):
    """The compiled kernel for ``cfg`` (cached); compiles for sm_90a without a GPU."""

    def build():
        ptrs = [_compile.fake_ptr(t) for t in _pointer_types(cfg)]
        return cute.compile(
            ReplayOutput(cfg),
            *ptrs,
            Int32(1),
            _compile.fake_stream(),
            options=_compile.compile_options(keep_ptx),
        )

    return _compile.compile_cached(("replay_output", cfg, keep_ptx), build)


def launch_replay_output(cfg: ReplayOutputConfig, cache: kv.ReplayCache, x, dt, A, B, C, D, z,
                         dt_bias, out) -> None:
    """Launch the kernel of ``cfg`` on torch's current stream (arguments already checked)."""
    _, (lo0, lo1, lo2) = read_copy(cache)
    tensors = [
        lo0,
        lo1 if lo1 is not None else lo0,
        lo2 if lo2 is not None else A,
        cache.ring_x, cache.ring_dt, cache.ring_B, cache.cursors, x, dt, A, B, C,
        D if D is not None else A,
        z if z is not None else x,
        dt_bias if dt_bias is not None else A,
        out,
    ]  # a tensor stands in (never read) for each optional one left out
    ptrs = [_compile.gmem_ptr(t, ty) for t, ty in zip(tensors, _pointer_types(cfg), strict=True)]
    compile_replay_output(cfg)(*ptrs, Int32(x.shape[0]), _compile.current_stream())


def mamba2_replay_output(cache: kv.ReplayCache, x, dt, A, B, C, D=None, z=None, dt_bias=None, *,
                         dt_softplus=True, out=None, config=None):
    """One non-flush decode step for every slot whose ``cursors[s] + 1 < window``; returns
    ``out`` [slots, nheads, headdim] (x's dtype; rows of flush slots are not written).

    ``cache``: a `cute_kernels.cache.ReplayCache` (lo_format 'none' reads hi). Token inputs
    as `emulation.replay_decode.mamba2_replay_decode`: x, z [slots, nheads, headdim] and B, C
    [slots, ngroups, dstate] in the ring's activation dtype, dt [slots, nheads] (raw; bf16,
    fp16 or fp32), A, D, dt_bias fp32 [nheads]. Limits: window >= 2, headdim a multiple of
    16, dstate a multiple of 128 (nvfp4), 64 (fp8_e4m3) or 32 (fp16, fp32). Launches on
    torch's current stream and does not synchronise (graph-capturable); cursor values must
    lie in [0, window - 1]. ``config``: None (`default_config` for this grid), or
    `output_config`'s result with its tuning fields (TUNING_FIELDS) changed.
    """
    view = kv.check_replay_cache(cache)
    kv.check_step(view, x, dt, A, B, C, D, z, dt_bias, out=out)
    fmt, _ = read_copy(cache)
    cfg = _tuned(_config(view, fmt, cache.window, x, dt, D, z, dt_bias, dt_softplus,
                         _sm_count(view.device)), config)
    kv.require_cuda("cache.hi", cache.hi)
    if out is None:
        out = torch.empty_like(x)
    if view.slots == 0:
        return out
    launch_replay_output(cfg, cache, x, dt, A, B, C, D, z, dt_bias, out)
    return out


def traffic_bytes(
    lo_format, batch, nheads, headdim, dstate, ngroups, h, act_bytes=2, has_z=False
) -> int:
    """Bytes one call must move, each read once and each write once, when every slot holds
    ``h`` records after the append: the state read in its format (block and second-level
    scales included), the ring reads of the ``h - 1`` older records (x and dt per head, B per
    group), this step's x, dt (fp32), z, B and C, the output, the record append (x, dt per
    head; B per group) and the cursor read and write. A, D and dt_bias (per head, shared by
    every slot) are left out."""
    state = headdim * dstate * _BYTES_PER_ELEMENT[lo_format]
    if lo_format == "nvfp4":
        state += headdim * dstate // 16 + 4
    row = headdim * act_bytes
    per_head = state + (h - 1) * (row + 4) + row * (3 + has_z) + 4 + 4
    per_group = (h - 1) * dstate * act_bytes + 3 * dstate * act_bytes
    return int(batch * (nheads * per_head + ngroups * per_group + 8))
