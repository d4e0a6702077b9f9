"""Mamba-2 ReplaySSM non-flush decode step (output only), reading the packed read copy.

Contract (lowprec/mamba2.py, ../shared/DESIGN.md). For every slot ``s`` whose step is not a
flush (``h = cursors[s] + 1 < window``), and every head:

    append the record at ring position cursors[s]:  ring_x <- x (bit copy), ring_dt <- dt_proc,
                                                    ring_B <- B (once per group)
    y = g_{0:h} (S_lo C) + sum_{j<h} g_{j+1:h} dt_j (B_j . C) x_j + D x   [* silu(z)]
    cursors[s] <- h

with ``dt_proc = softplus(dt + dt_bias)`` (or ``dt + dt_bias``), ``g_{i:h} = exp(A * sum_{l=i..h-1}
dt_l)``, ``S_lo`` the dequantised read copy, record ``h-1`` this step's own ``(x, dt_proc, B)``.
This is `lowprec.mamba2.mamba2_replay_output` on the ring after the append. Flush slots
(``cursors[s] + 1 == window``) are left entirely alone (outputs, ring and cursor): the flush
kernel (replay_flush.py) handles them, and must run AFTER this kernel in a decode step.
Accumulation is fp32; outputs differ from the reference only by summation order.

Read-copy formats (``lo`` dicts, cache layout of DESIGN.md):

    nvfp4     codes uint8 [S, H, P, N/2] (low nibble = even k), scales uint8 E4M3
              [S, H, P, N/16], global fp32 [S, H]; value = (code * s_b) * s_g
    fp8_e4m3  codes uint8 [S, H, P, N] (OCP E4M3FN bits, no scale)
    fp16      values fp16 [S, H, P, N]
    fp32      values fp32 [S, H, P, N]  (the single-copy FP32 ReplaySSM baseline)

Work decomposition (drawn in README.md, "Read path"): one CTA per (group, slot), ``warps``
warps, each warp owns ``heads_per_group / warps`` heads, one at a time. The CTA computes the
group's ``h`` dot products ``B_j . C`` once (shared memory) and appends ``B``; each warp
works out the decay weights of all its heads at once (a segment of lanes per head,
`_warp_decay_weights`) and stores their ring coefficients in shared memory (nvfp4: beside its
first head's ``S_lo C``, `ReplayOutputConfig.weights_at`); per head it forms ``S_lo C`` into
shared memory, and every lane finishes two output rows (ring term, D, gate). The ring records
``x_j`` a head reads come with its read copy, or (nvfp4, two heads a warp or more, window 16
or more: `default_ring_stage`) from a shared-memory stage that ``cp.async`` filled while the
warp's previous head was computed. With ``stage="bulk"`` lane 0 hands each head's read copy and
ring records to the bulk copy engine instead, one request a piece into an mbarrier-guarded
stage (`_bulk_head`); with the eager loads as well, the first heads' read copies go out before
the cursor is read (`_bulk_read_copy`). That pair is the default (nvfp4) on grids of 3 waves
or more where 4 CTAs of it fit an SM (`default_stage`; with `ReplayOutputConfig.late_dots`
there), the registers stage elsewhere.

Checkpoint term, fp8/fp16/nvfp4 (``decode='mma'``): the state is the A operand of
``mma.sync.m16n8k16`` (f16 in, fp32 accumulate); C (fp32) is split into f16 ``hi + lo`` placed
in B's columns 0 and 1 (columns 2..7 are zero), so ``D[:,0] + D[:,1] = S C`` to about 2^-22.
Each quad of lanes owns two state rows (``g`` and ``g+8`` of a 16-row stripe) and loads them
16 bytes per lane (``ld.global.nc.v4``); the k index of each A register is chosen to match the
bytes a lane loaded, and B is laid out with the same permutation. E2M1 nibbles are re-packed
as E4M3 bytes (``s 0 0 e1 e0 m 0 0`` is E2M1 * 2^-6; 7 integer ops per 8 values), which the
hardware converts to f16 pairs; the tensor cores do the multiply-adds per 16-element block
(B's columns 2t, 2t+1 carry C on lane t's k only), and each lane multiplies its blocks' sums
by their E4M3 scales in fp32: no f16 multiply per element (`_nvfp4_term`). fp32
(``decode='simt'``): octets of lanes read one row with 128-bit loads, FFMA against C in
registers, then a 3-step butterfly.

Cursor update without a second launch: every CTA of a slot reads ``cursors[s]`` (low 16 bits),
then adds 1 << 16 to it atomically; the CTA that sees ``ngroups * head_splits - 1`` earlier
arrivals (all others have read the cursor) stores ``h``. Between launches the cursors are
plain counts. With ``head_splits > 1`` every CTA of a group computes the group's ``B_j . C``
products (a few hundred FMAs) and the first appends B.
"""

from __future__ import annotations  # noqa: I001  (_compile must precede cutlass)

import dataclasses
import inspect
from dataclasses import dataclass

import numpy as np
import torch

from cute_kernels import _compile

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from cute_kernels.numerics import bits_f32, f32_bits, inline_ptx, silu, softplus
from cute_kernels.tensor_core import mma_m16n8k16, pack_16x2
from cute_kernels.tensor_core import reg as _ir
from cute_kernels.tensor_core import unpack_struct as _unpack_struct

__all__ = [
    "ReplayOutputConfig", "ReplayOutput", "replay_output", "compile_replay_output",
    "default_warps", "default_head_splits", "default_ring_stage", "default_eager_loads",
    "default_stage", "cta_shared_bytes", "check_options",
]

LO_FORMATS = ("nvfp4", "fp8_e4m3", "fp16", "fp32")
ACT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ACT_CUTE = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
_ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Elements of one state row that one lane loads with one 16-byte access, per format. A quad
# of lanes covers 4 * E consecutive k of a row (one "chunk"); dstate must be a multiple.
_ELEMENTS_PER_LOAD = {"nvfp4": 32, "fp8_e4m3": 16, "fp16": 8, "fp32": 4}
_BYTES_PER_ELEMENT = {"nvfp4": 0.5, "fp8_e4m3": 1, "fp16": 2, "fp32": 4}
_DSTATE_MULTIPLE = {"nvfp4": 128, "fp8_e4m3": 64, "fp16": 32, "fp32": 32}

# nvfp4: nibbles are re-packed as E4M3 bytes (E2M1 * 2^-6 exactly, never subnormal in f16)
# and converted to f16 by the hardware; the tensor cores sum codes times C per block and the
# block scale multiplies those sums in fp32, so y = sum_blocks s_b (D0 + D1) * 2^6 * s_g.
_NVFP4_UNDO = 2.0**6


# --------------------------------------------------------------------------------------------
# PTX helpers (inline_ptx: pure register operations are side-effect free so LLVM may
# schedule them)


def _addr(addr, loc=None, ip=None):
    return Int64(addr).ir_value(loc=loc, ip=ip)


@dsl_user_op
def _ld_words(addr, n: int, state: bool = False, pinned: bool = False, *, loc=None,
              ip=None) -> list:
    """``n`` 32-bit words (n = 1, 2 or 4) from a global byte address aligned to 4n bytes.
    State reads use the read-only path and skip L1 (each byte is read once). ``pinned``:
    volatile, so that the compiler issues the load where the code does (a side-effect-free
    load is otherwise free to sink to its first use, past barriers and other work)."""
    hint = "global.nc.L1::no_allocate" if state else "global"
    if pinned:  # ptxas moves read-only (.nc) loads past a barrier too, coherent ones not
        hint = "global.L1::no_allocate" if state else "global"
    if n == 1:
        r = inline_ptx(T.i32(), [_addr(addr, loc, ip)], f"ld.{hint}.u32 $0, [$1];", "=r,l",
                       side_effects=pinned, loc=loc, ip=ip)
        return [Uint32(r)]
    outs = ",".join(f"${i}" for i in range(n))
    st = llvm.StructType.get_literal([T.i32()] * n)
    r = inline_ptx(
        st,
        [_addr(addr, loc, ip)],
        f"ld.{hint}.v{n}.u32 {{{outs}}}, [${n}];",
        ",".join(["=r"] * n) + ",l",
        side_effects=pinned,
        loc=loc,
        ip=ip,
    )
    return _unpack_struct(r, n, T.i32(), Uint32, loc, ip)


@dsl_user_op
def _ld_words_if(addr, n: int, pred, *, loc=None, ip=None) -> list:
    """``n`` (1 or 2) words at ``addr`` if ``pred``, else zeros; no access when false."""
    outs = ",".join(f"${i}" for i in range(n))
    zero = " ".join(f"mov.b32 ${i}, 0;" for i in range(n))
    vec = f"v{n}." if n > 1 else ""
    dst = f"{{{outs}}}" if n > 1 else "$0"
    code = (
        f"{{.reg .pred p; setp.ne.b32 p, ${n + 1}, 0; {zero} "
        f"@p ld.global.{vec}u32 {dst}, [${n}];}}"
    )
    args = [_addr(addr, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)]
    if n == 1:
        return [Uint32(inline_ptx(T.i32(), args, code, "=r,l,r", loc=loc, ip=ip))]
    st = llvm.StructType.get_literal([T.i32()] * n)
    r = inline_ptx(st, args, code, ",".join(["=r"] * n) + ",l,r", loc=loc, ip=ip)
    return _unpack_struct(r, n, T.i32(), Uint32, loc, ip)


def _fold_words(obj) -> Uint32:
    """Every 32-bit value in ``obj`` (nested lists, tuples and dicts of Uint32 and Float32;
    anything else skipped) XORed together."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        acc = Uint32(0)
        for item in obj:
            acc = acc ^ _fold_words(item)
        return acc
    if isinstance(obj, Float32):
        return f32_bits(obj)
    if isinstance(obj, Uint32):
        return obj
    return Uint32(0)


def _load_words(addr, n: int, state: bool = False, pinned: bool = False) -> list:
    """``n`` consecutive words at byte address ``addr`` with the widest accesses the count
    allows (``addr`` aligned to 16 bytes when n is a multiple of 4, to 8 when even)."""
    width = 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)
    words = []
    for i in range(0, n, width):
        words += _ld_words(addr + 4 * i, width, state, pinned)
    return words


@dsl_user_op
def _ld_u16(addr, pinned: bool = False, *, loc=None, ip=None) -> Uint32:
    r = inline_ptx(
        T.i32(),
        [_addr(addr, loc, ip)],
        "{.reg .b16 t; ld.global%s.L1::no_allocate.u16 t, [$1]; cvt.u32.u16 $0, t;}"
        % ("" if pinned else ".nc"),
        "=r,l",
        side_effects=pinned,
        loc=loc,
        ip=ip,
    )
    return Uint32(r)


@dsl_user_op
def _cp_async_16(smem_addr, gmem_addr, *, loc=None, ip=None) -> None:
    """16 bytes global -> shared, asynchronously (L2 only: the state is read once)."""
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), _addr(gmem_addr, loc, ip)],
               "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", side_effects=True,
               loc=loc, ip=ip)


@dsl_user_op
def _cp_async_16_zfill(smem_addr, gmem_addr, src_bytes, *, loc=None, ip=None) -> None:
    """As _cp_async_16, but only the first ``src_bytes`` (0 or 16) are read from global
    memory; the rest of the 16 bytes are zero-filled (no traffic when 0)."""
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), _addr(gmem_addr, loc, ip),
                      Int32(src_bytes).ir_value(loc=loc, ip=ip)],
               "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", side_effects=True,
               loc=loc, ip=ip)


@dsl_user_op
def _cp_async_commit(*, loc=None, ip=None) -> None:
    inline_ptx(None, [], "cp.async.commit_group;", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
    """Until at most ``pending`` of this thread's newest copy groups are still in flight."""
    inline_ptx(None, [], f"cp.async.wait_group {pending};", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _prefetch_l2(gmem_addr, nbytes, *, loc=None, ip=None) -> None:
    """Bring ``nbytes`` (a multiple of 16; none if 0) at a 16-byte aligned global address into
    L2 with one bulk request (sm_90): no register waits for it, and the loads that follow hit
    L2."""
    inline_ptx(None, [_addr(gmem_addr, loc, ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
               "{.reg .pred p; setp.ne.b32 p, $1, 0; "
               "@p cp.async.bulk.prefetch.L2.global [$0], $1;}",
               "l,r", side_effects=True, loc=loc, ip=ip)


# One bulk copy engine request per head (stage="bulk"): lane 0 arms the stage's mbarrier with
# the bytes it expects and issues the copies; every lane waits on the barrier's phase. No
# register holds the bytes in flight, and a head costs a handful of instructions instead of
# nine 16-byte cp.async a lane.


@dsl_user_op
def _mbar_init(bar, *, loc=None, ip=None) -> None:
    """An mbarrier at shared byte address ``bar`` that one arrival (with its bytes) completes."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip)],
               "mbarrier.init.shared::cta.b64 [$0], 1;", "r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _mbar_init_fence(*, loc=None, ip=None) -> None:
    """Makes the initialised barriers visible to the bulk copy engine (the async proxy)."""
    inline_ptx(None, [], "fence.mbarrier_init.release.cluster;", "", side_effects=True,
               loc=loc, ip=ip)


@dsl_user_op
def _mbar_expect(bar, nbytes, *, loc=None, ip=None) -> None:
    """Arrive on ``bar`` and tell it ``nbytes`` more are on their way: its phase completes
    when the copies that name it have written them."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
               "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r",
               side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _bulk_copy(smem_addr, gmem_addr, nbytes, bar, *, loc=None, ip=None) -> None:
    """``nbytes`` (a multiple of 16; nothing if 0) from a 16-byte aligned global address to
    shared memory by the bulk copy engine, completing their bytes on ``bar``."""
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), _addr(gmem_addr, loc, ip),
                      Int32(nbytes).ir_value(loc=loc, ip=ip), Int32(bar).ir_value(loc=loc, ip=ip)],
               "{.reg .pred p; setp.ne.b32 p, $2, 0; "
               "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[$0], [$1], $2, [$3];}",
               "r,l,r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _mbar_wait(bar, parity: int, *, loc=None, ip=None) -> None:
    """Until the phase of ``bar`` with this parity has completed (acquire: the copied bytes
    are then visible to this thread's shared-memory reads)."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip)],
               "{.reg .pred p; WAIT_PHASE: "
               f"mbarrier.try_wait.parity.shared::cta.b64 p, [$0], {parity}; "
               "@!p bra WAIT_PHASE;}",
               "r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _sts_zero16_if(smem_addr, flag, *, loc=None, ip=None) -> None:
    """16 zero bytes at a 16-byte aligned shared address where ``flag`` (an Int32) is not 0."""
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip),
                      Int32(flag).ir_value(loc=loc, ip=ip)],
               "{.reg .pred p; setp.ne.b32 p, $1, 0; @p st.shared.v4.u32 [$0], {0, 0, 0, 0};}",
               "r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _lds_v4(smem_addr, *, loc=None, ip=None) -> list:
    """4 32-bit words at a 16-byte aligned shared-memory byte address. Volatile: a stage's
    address repeats every other head with new contents, so these reads must neither merge
    nor move across the cp.async waits and warp barriers."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = inline_ptx(st, [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                   "ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r", side_effects=True,
                   loc=loc, ip=ip)
    return _unpack_struct(r, 4, T.i32(), Uint32, loc, ip)


@dsl_user_op
def _lds_words(smem_addr, n: int, *, loc=None, ip=None) -> list:
    """1 or 2 32-bit words at a shared-memory byte address (aligned to their size); volatile,
    as _lds_v4 (a ring stage is refilled every other head)."""
    if n == 1:
        r = inline_ptx(T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                       "ld.shared.u32 $0, [$1];", "=r,r", side_effects=True, loc=loc, ip=ip)
        return [Uint32(r)]
    st = llvm.StructType.get_literal([T.i32()] * 2)
    r = inline_ptx(st, [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                   "ld.shared.v2.u32 {$0,$1}, [$2];", "=r,=r,r", side_effects=True,
                   loc=loc, ip=ip)
    return _unpack_struct(r, 2, T.i32(), Uint32, loc, ip)


@dsl_user_op
def _lds_u16(smem_addr, *, loc=None, ip=None) -> Uint32:
    r = inline_ptx(T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                   "{.reg .b16 t; ld.shared.u16 t, [$1]; cvt.u32.u16 $0, t;}", "=r,r",
                   side_effects=True, loc=loc, ip=ip)  # volatile, as _lds_v4
    return Uint32(r)


@dsl_user_op
def _st_words(addr, words: list, *, loc=None, ip=None) -> None:
    n = len(words)
    args = [_addr(addr, loc, ip)] + [_ir(w, loc, ip) for w in words]
    if n == 1:
        code = "st.global.u32 [$0], $1;"
    else:
        code = f"st.global.v{n}.u32 [$0], {{{','.join(f'${i + 1}' for i in range(n))}}};"
    inline_ptx(None, args, code, "l," + ",".join(["r"] * n), side_effects=True, loc=loc, ip=ip)


def _store_words(addr, words: list) -> None:
    n = len(words)
    width = 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)
    for i in range(0, n, width):
        _st_words(addr + 4 * i, words[i : i + width])


@dsl_user_op
def _e4m3x2_to_f16x2(x, half: int = 0, *, loc=None, ip=None) -> Uint32:
    """Two E4M3 bytes of ``x`` to f16x2, exactly: bytes 0, 1 (``half`` 0) or 2, 3 (``half``
    1); the lower byte goes to the low half."""
    r = inline_ptx(T.i32(), [_ir(x, loc, ip)],
                   "{.reg .b16 l, h; mov.b32 {l, h}, $1; "
                   f"cvt.rn.f16x2.e4m3x2 $0, {'lh'[half]};}}",
                   "=r,r", loc=loc, ip=ip)
    return Uint32(r)


def _f32x2_to_f16x2(lo, hi) -> Uint32:
    return pack_16x2(lo, hi, "f16")


def _f32x2_to_bf16x2(lo, hi) -> Uint32:
    return pack_16x2(lo, hi, "bf16")


@dsl_user_op
def _f16x2_to_f32x2(x, *, loc=None, ip=None) -> list:
    st = llvm.StructType.get_literal([T.f32()] * 2)
    r = inline_ptx(st, [_ir(x, loc, ip)],
                   "{.reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;}",
                   "=f,=f,r", loc=loc, ip=ip)
    return _unpack_struct(r, 2, T.f32(), Float32, loc, ip)


def _words_to_f32(words: list, act: str) -> list:
    """Activation values packed in 32-bit words, as fp32 (element order preserved)."""
    out = []
    for w in words:
        if act == "bf16":
            out += [bits_f32(w << Uint32(16)), bits_f32(w & Uint32(0xFFFF0000))]
        elif act == "fp16":
            out += _f16x2_to_f32x2(w)
        else:
            out.append(bits_f32(w))
    return out


def _f32_to_words(values: list, act: str) -> list:
    if act == "fp32":
        return [f32_bits(v) for v in values]
    pack = _f32x2_to_bf16x2 if act == "bf16" else _f32x2_to_f16x2
    return [pack(values[i], values[i + 1]) for i in range(0, len(values), 2)]


def _sel(cond, a, b):
    return type(a)(cutlass.select_(cond, a, b))


def _shfl(v, lane):
    return cute.arch.shuffle_sync(v, lane)


def _dot_warp(a: list, b: list) -> Float32:
    """sum_i a_i b_i over the whole warp (every lane gets the total)."""
    part = Float32(0.0)
    for e in range(len(a)):
        part = part + a[e] * b[e]
    for off in (16, 8, 4, 2, 1):
        part = part + cute.arch.shuffle_sync_bfly(part, off)
    return part


def _output_pair(act, records: int, ck_scale, ys, coefs, record, c_last, d_h, xv, z_words):
    """Output rows v, v + 1 of one head, in fp32 and in this order: ``ck_scale`` times the
    raw ``ys = S_lo C`` sums, plus ``coefs[j]`` times ring record j's two values (``record(j)``:
    their words) for j < ``records``, plus this step's ``(c_last + D) x`` as two products, times
    silu(z) where ``z_words`` are given. Both non-flush kernels finish a head with it (the
    default step in its three parts, so that it can skip records past the cursor)."""
    acc0, acc1 = _ring_records(act, range(records), coefs, record, ck_scale * ys[0],
                               ck_scale * ys[1])
    return _output_finish(act, acc0, acc1, c_last, d_h, xv, z_words)


def _ring_records(act, js, coefs, record, acc0, acc1):
    """``acc0, acc1`` plus ``coefs[j]`` times ring record j's two values, j in ``js`` in turn."""
    for j in js:
        xr = _words_to_f32(record(j), act)
        acc0 = acc0 + coefs[j] * xr[0]
        acc1 = acc1 + coefs[j] * xr[1]
    return acc0, acc1


def _output_finish(act, acc0, acc1, c_last, d_h, xv, z_words):
    """`_output_pair`'s last part: this step's ``(c_last + D) x``, then the gate."""
    acc0 = acc0 + c_last * xv[0] + d_h * xv[0]
    acc1 = acc1 + c_last * xv[1] + d_h * xv[1]
    if z_words is not None:
        zv = _words_to_f32(z_words, act)
        acc0 = acc0 * silu(zv[0])
        acc1 = acc1 * silu(zv[1])
    return acc0, acc1


def _nvfp4_as_e4m3(word):
    """The 8 E2M1 nibbles of ``word`` re-packed as E4M3 bytes of E2M1 * 2^-6, exactly:
    (even, odd), byte b of ``even`` from nibble 2b, of ``odd`` from nibble 2b + 1.

    A nibble ``s e1 e0 m`` becomes the byte ``s 0 0 e1 e0 m 0 0``: exponent field ``e1 e0``
    and mantissa ``m 0 0`` give ``2^(e-7) (1 + m/2)`` = E2M1 * 2^-6 for e >= 1, and the
    subnormal ``2^-6 m/2`` for e = 0. Odd nibbles already have their sign at bit 7 of their
    byte, so they take a shift and two logic ops, even ones two shifts and two logic ops:
    7 integer instructions per 8 elements (the f16 trick this replaces took about 15, and left
    code 1 subnormal). Also runs on numpy uint32 arrays (the CPU tests check it exhaustively).
    """
    u = np.uint32 if isinstance(word, (np.ndarray, np.generic)) else Uint32
    odd = (word & u(0x80808080)) | ((word >> u(2)) & u(0x1C1C1C1C))
    even = ((word << u(4)) & u(0x80808080)) | ((word << u(2)) & u(0x1C1C1C1C))
    return even, odd


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class ReplayOutputConfig:
    """Static parameters of one compiled kernel (the compile-cache key)."""

    lo_format: str
    act: str  # bf16 | fp16 | fp32: x, z, B, C, ring_x, ring_B, out
    dt_dtype: str  # bf16 | fp16 | fp32: raw dt
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    ring_capacity: int
    window: int
    has_D: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    warps: int
    # issue the next head's loads before computing the current one. Off: slower while the
    # ring records came through registers (nvfp4 batch 256: 71.2 against 70.5 us,
    # bench_read_3.csv); with them staged through shared memory it fits in 128 registers
    # without spills at 4 heads a warp, but pays only on the Nemotron layer at L = 16
    # (batch 256, cursor 8: 60.5 against 62.5 us) and costs 1-5% at L = 8 and 32 and on
    # Mamba-2 2.7B (spills there at 10 heads a warp); ninth session, two runs each, us,
    # registers ring / staged ring / staged ring + prefetch (results/kernel_bench_runs/
    # windows_ab_14/runs.csv.gz, files x_*):
    #     shape, batch (cursor L/2)    L = 8                 L = 16                L = 32
    #     Nemotron 256     56.6 / 56.2 / 57.6    64.7 / 62.5 / 60.5    74.1 / 73.3 / 77.1
    #     Nemotron 512    106.1 / 106.0 / 107.7 123.6 / 119.1 / 116.1 140.9 / 141.0 / 148.0
    #     Mamba-2 2.7B 256 36.2 / 36.9 / 37.3    40.5 / 40.5 / 40.4    79.5 / 62.7 / 69.7
    #     Mamba-2 2.7B 512 67.1 / 68.4 / 69.6    76.3 / 75.5 / 76.0   178.3 / 139.0 / 156.2
    prefetch: bool = False
    # nvfp4: where a head's read copy waits for the warp: "registers" (16-byte loads, the
    # whole head before its mmas), "smem" (cp.async into two shared-memory stages per warp,
    # the next head's copy in flight while this one is computed; the small per-head loads
    # then go out one head ahead) or "bulk" (as "smem", but lane 0 hands each head to the
    # bulk copy engine, cp.async.bulk, with one mbarrier a stage, `bulk_stages` stages a warp,
    # and with ring_stage="smem" the head's ring records come in the same copy)
    stage: str = "registers"
    # stage="bulk": shared-memory stages a warp, so heads in flight while one is computed is
    # this minus one. "bulk" alone was not made the default: measured on the H200 in the
    # benchmark's conditions (tenth session, results/kernel_bench_runs/bulk_ab_15/, two runs a
    # variant, time over the default's, mean of the three cursors; with the eager loads it is
    # the default where `default_stage` says, seventeenth session, table at SM_SHARED_BYTES):
    #     shape, window     batch 1   128     256     512
    #     Nemotron, L = 8    1.12    1.05    1.00    0.97
    #     Nemotron, L = 16   1.05    1.04    0.98    0.96   (b256 cursor 8: 61.6 / 63.0 us)
    #     Nemotron, L = 32   1.02    1.12    1.08    1.04
    #     Mamba-2 2.7B, 8    1.09    1.08    1.07    1.05
    #     Mamba-2 2.7B, 16   1.03    1.05    1.22    1.04
    #     Mamba-2 2.7B, 32   1.00    1.19    1.92    1.95
    # bulk_stages=3 was slower everywhere (1.04-2.55; its stages alone take 76.8 KB a CTA at
    # L = 16, so by that count 2 CTAs an SM fit),
    # the read copy alone by bulk copy (ring_stage="registers") too (0.98-1.08 at L = 16).
    # Where it loses most, ncu names occupancy (bulk_ab_15/ncu_stalls_*): with Mamba-2 2.7B's
    # 10 heads a warp a CTA takes 58.3 KB of shared memory at L = 16 (67.6 at L = 32 on
    # either shape), so 3 CTAs an SM fit instead of the default kernel's 4 (19.7 KB a CTA,
    # limited by registers), and at batch 256 the grid needs a second wave. At cursor 0,
    # where a head has no ring records, bulk is also 5-17% slower at batch 64-128, so the
    # bulk copy's bytes reach the lanes later than their own loads' would. So the idea of the
    # eighth and ninth sessions' notes (loads that go out early and hold no registers) pays
    # only where 4 CTAs still fit and the batch is large (Nemotron, L = 16, batch 256-512).
    bulk_stages: int = 2
    # the shared-memory carveout asked of the driver (percent of the unified L1 / shared
    # memory; -1: the driver's choice: 135 KB for the default kernel's 19.7 KB CTAs, 200.7 KB
    # for the bulk stage's 58.3 KB ones, by ncu). Asking for all of it (100) changed nothing:
    # at the 36 points of bulk_ab_15/third/ from 0.8% faster to 2.0% slower than the bulk
    # stage without it (0.3% slower on average; bulk's own two runs differ by up to 2.2%),
    # still 3 CTAs an SM, as 4 x (58.3 + 1 reserved) KB pass the SM's 228 KiB
    smem_carveout: int = -1
    upfront: bool | None = None  # load a head's whole read copy first (None: format default)
    # CTAs per (group, slot), each taking heads_per_group / head_splits of the group's heads:
    # for small batches, where one CTA per (group, slot) leaves most SMs idle (8 CTAs at
    # batch 1 on the Nemotron layer). replay_output picks it by batch (default_head_splits).
    head_splits: int = 1
    # resident CTAs per SM that ptxas must leave room for (it caps registers at 65536 /
    # (this * 32 * warps)); None: 16 warps' worth (128 registers) for the tensor-core
    # formats, no cap for fp32
    min_ctas_per_sm: int | None = None

    # heads ahead whose read copy (and ring records) lane 0 asks L2 for with one bulk
    # prefetch each (cp.async.bulk.prefetch.L2), so that a head's loads find it in L2; 0: off.
    # No faster on the H200 (nvfp4, batch 256: 69.2 us at 0 and 1, 73.1 at 2; with the small
    # inputs too 68.8 against 68.7; results/gpu_first_timing/bench_read_knobs_6.csv and
    # bench_read_knobs_small_6.csv): the step is not waiting on its loads (bench_read
    # --ablations: without any read-copy load it still takes 58 of its 70 us)
    l2_prefetch: int = 0
    # with l2_prefetch: also the head's small inputs (x, z, dt, its ring dt row, the nvfp4
    # global scale), whose DRAM latency each head otherwise waits out before its epilogue
    l2_prefetch_small: bool = False
    # where the quad's four nvfp4 partial sums of a row sit in shared memory: "rows" (one
    # (P, warps) plane per quad lane; a quad's stores hit one bank 4 ways) or "quads" (a row's
    # four side by side: conflict-free stores, one 16-byte read per row). No faster: 69.7
    # against 69.2 us at batch 256 (bench_read_knobs_6.csv)
    ys_layout: str = "rows"
    # timing only (the outputs are then wrong): stages left out to see where the time goes,
    # any of "state" (no read-copy loads: lane-dependent constants instead), "scales" (no
    # nvfp4 scale loads), "ring" (no ring-record loads), "decode" (the read copy's words are
    # XOR-folded instead of decoded and multiplied), "prologue" (no loads of the CTA's
    # prologue: C, B, the ring's B rows, C's mma fragments and the decay weights' inputs are
    # lane-dependent constants; with early_loads, the default), "cursor" (the cursor is not
    # read and no arrival is counted: it is taken as window / 2 - 1, bench_read's h = 8 at
    # L = 16, and the slot's cursor is never advanced); `bench_read --ablations`
    ablate: tuple = ()
    # issue every prologue load (C, B, the ring's B rows, C's mma fragments) before any is
    # used, and act on the cursor atomic's result after the heads: the prologue then costs
    # one dependent round trip after the cursor read instead of one per ring row a warp.
    # On the H200, nvfp4, h = 8, us (`bench_read --early-variants`, bench_read_early_7.csv;
    # `--pass-variants`, bench_read_pass_7.csv):
    #     batch      1     8     32    64    128   256   512
    #     off       4.9   5.5   11.6  20.6  37.5  68.8  133.4
    #     on        4.5   4.9   10.7  19.6  35.6  68.4  131.7
    # fp8, fp16 and fp32 within 3% either way; so on by default
    early_loads: bool = True
    # heads a warp works on at once (1 or 2): their loads go out together and their
    # dependency chains (dt scan, exp, mma, ring sum) interleave. Slower on the H200: two
    # heads' loads need 184 bytes of spills at 128 registers, or 168 registers and 3 CTAs an
    # SM (12 warps): nvfp4 at batch 256 76.0 and 75.9 us against 68.8 (bench_read_pass_7.csv);
    # one head a pass at 168 registers alone takes 76.2, so the step wants resident warps more
    # than registers
    heads_per_pass: int = 1
    # issue the prologue's and the first pass's loads before the cursor arrives (`_eager_loads`:
    # every ring B row, and with ring_stage "registers" every ring record, none predicated on
    # the cursor): needs early_loads, registers stage, no l2_prefetch. The fifth session's
    # form was slower at every batch (nvfp4 batch 1 5.0 against 4.5 us, 256 72.4 / 69.3;
    # bench_read_eager_7.csv) because ptxas had sunk every one of those loads past the
    # cursor's early exit, volatile ones too: they waited for the cursor after all and only
    # added bytes. A flush slot's CTA now folds the eager words into a shared-memory word, a
    # use on the exit's side, so the loads go out with the cursor's (SASS checked by
    # tests/test_cute_replay_output.py). Measured in the benchmark's conditions (fourteenth
    # session, kernel_bench --nonflush-knob eager_loads=True against the default, two runs
    # each, results/kernel_bench_runs/eager_ab_14/; us at cursors 0 / L/2 / L-2):
    #     nvfp4, Nemotron L = 16, batch 1:   3.68 / 4.72 / 5.44  ->  3.56 / 3.73 / 3.88
    #                             batch 32:  9.55 / 11.55 / 12.85 -> 10.08 / 10.90 / 11.24
    #                             batch 256: 55.8 / 61.9 / 68.0   ->  56.1 / 60.2 / 66.4
    #                      L = 32, batch 256: 61.0 / 72.8 / 87.5  ->  65.1 / 73.1 / 86.4
    #                      L = 8,  batch 512: 99.4 / 105.3 / 109.8 -> 102.6 / 106.8 / 109.5
    #     Mamba-2 2.7B L = 16, batch 1:      3.48 / 4.55 / 5.08  ->  3.56 / 3.74 / 3.87
    #                  L = 8,  batch 256:    32.8 / 35.7 / 37.1  ->  45.5 / 46.0 / 47.6 (spills)
    #     fp32, Nemotron L = 16, batch 1:    10.7 / 10.9 / 11.0  ->   9.1 / 9.1 / 9.2
    #     fp8, Nemotron L = 16, batch 8:     5.2 / 6.5 / 7.0     ->   6.3 / 6.5 / 6.7
    # So it pays where the grid is latency-bound (one wave of CTAs: a round trip less on the
    # one chain that sets the time), while on full grids the ring B rows past the cursor cost
    # their bytes (by count about 5% more at cursor 0) and the registers it holds spill at 10
    # heads a warp. replay_output's default (`default_eager_loads`): on for nvfp4 and fp32 where the
    # grid fits in one wave, off elsewhere; and on with the bulk stage where `default_stage`
    # picks it (there lane 0 also sends the first heads' read copies before the cursor)
    eager_loads: bool = False
    # the read copy's loads coherent (no .nc) and volatile, so that they go out where the code
    # issues them: ptxas sinks read-only loads towards their first use, past the prologue's
    # barrier, which put the first head's state loads after the B . C products whatever
    # the code's order (SASS at 4 warps; with prefetch, the next head's after the current
    # head's work); coherent loads stay on their side of a barrier. Slower on the H200
    # (bench_read_pin_9.csv, h = 8): nvfp4 batch 256 66.0 -> 69.0 us, 128 36.9 -> 37.0, 8
    # 6.3 -> 6.2; fp8 86.3 -> 88.5, fp32 282.7 -> 285.1 at 256; with prefetch 70.7 (70.0
    # unpinned). The head's state held in registers through the prologue costs more than
    # its round trip saves: off
    pin_state_loads: bool = False
    # where a warp works out its heads' decay weights and ring coefficients (after the
    # prologue's barrier either way): "with_decode" (in the first pass, beside its checkpoint
    # term, so that ptxas interleaves the weights' shuffle-and-exp chain with the decode and
    # one warp barrier serves both the partial sums and the coefficients) or "before_decode"
    # (the seventh session's form, 103005f: weights, coefficients and a warp barrier first).
    # None: with_decode for nvfp4, before_decode for the others. Measured on the H200, h = 8,
    # us with / before, two calls (`bench_read --weights-variants`, results/gpu_first_timing/
    # bench_read_weights_11.csv and _11b.csv):
    #     batch     256                       128                     8          1
    #     nvfp4     61.3 / 63.6, 60.9 / 63.6  34.8 / 33.6, 34.9 / 33.9  5.4 / 5.4  4.5 / 4.6
    #     fp8       86.6 / 86.3, 86.2 / 87.1  45.7 / 46.0, 45.9 / 46.1  6.1 / 5.4  5.1 / 4.2
    #     fp32     303.4 / 283.1, 303.5 / 283.3  156.3 / 147.5           15.4 / 15.5 7.2 / 6.9
    # (batch 8 and 1 moved by up to 1 us between the calls, either form)
    weights_at: str | None = None
    # where a head's ring records (x_j, j < cursor) wait for the epilogue: "registers" (each
    # lane's 4-byte loads, issued with the head's read copy) or "smem" (cp.async, 16 bytes a
    # lane, into one of two shared-memory stages a warp, the next head's in flight while
    # this one is computed; records past the cursor zero-filled without traffic). "smem"
    # needs the registers stage for the read copy, one head a pass, window
    # >= 3. Measured on the H200 in the benchmark's conditions (nvfp4, L = 16, us, smem /
    # registers; results/kernel_bench_runs/ring_ab_12/):
    #     batch          1            8            128            256
    #     cursor 8   4.80 / 4.66  6.24 / 6.11  34.66 / 35.41  62.61 / 64.44
    #     cursor 14  5.57 / 5.32  7.23 / 7.07  38.12 / 38.36  68.98 / 70.41
    # 2-3% faster where a warp walks several heads, 2-5% slower on small grids (one head a
    # warp). Ninth session (table at `prefetch` above; knobs_ab_13/ for the small batches):
    # from 0.8% slower to 3.6% faster at L = 16 (14 records a head), up to 32% faster at
    # L = 32 (the registers form spills there; 2.3% slower at one of 18 points), up to 2.3%
    # slower at L = 8 (6 records a head). So replay_output's default for nvfp4 where a warp
    # walks two heads or more and the window is 16 or more (`default_ring_stage`).
    # Outputs agree with the registers form to rounding (in 2 of 6 tested builds up to 5e-6
    # relative apart; the cause is not pinned down: both SASS have the same FFMA, FMUL and
    # FADD counts), the appended records and cursors bit for bit
    ring_stage: str = "registers"
    # programmatic dependent launch: the step is launched so that its CTAs may start while the
    # kernel before it on the stream finishes (once that kernel's CTAs trigger, or exit);
    # each CTA issues its first head's read copy (and nvfp4 global scale), waits for the
    # previous grid (griddepcontrol.wait), and only then lets the next kernel launch and reads
    # anything else. So the kernel just before it must not write the read copy of a slot
    # that takes a non-flush step (flush slots' copies are read and dropped); in a model that
    # kernel is the layer's input projection, and the read copy was written a flush ago.
    # Opt-in: faster only on small grids. On the H200 in the benchmark's conditions (graphs of
    # back-to-back steps, Nemotron layer, L = 16, cursors 0 / 8 / 14, us, default -> pdl, one
    # run each; results/kernel_bench_runs/pdl_ab_16/after_wait/):
    #     batch 1     3.68 / 4.71 / 5.42  ->  2.87 / 3.98 / 4.72
    #     batch 8     4.98 / 6.08 / 7.05  ->  4.03 / 5.49 / 6.35
    #     batch 128   29.2 / 34.0 / 37.2  ->  28.3 / 33.4 / 35.5
    #     batch 256   55.9 / 62.0 / 67.9  ->  56.0 / 61.8 / 69.7
    # (a first form that let the next grid launch before its wait: the same picture, batch 512
    # 118.8 -> 119.8 at cursor 8; pdl_ab_16/). So the step's time at large batches is not
    # launch gaps; what it saves on small grids is the launch and the first loads' latency
    pdl: bool = False
    # the persistent, software-pipelined step (cute_kernels/replay_output_persistent.py): a
    # few CTAs an SM that outlive their (slot, group, `warps` heads) items, a producer warp
    # bringing every byte of the next item in by bulk copy while `warps` warps compute this
    # one (nvfp4 only; bulk_stages items a CTA). Built to hide the prologue's round trips and
    # the read copy together (the fourteenth session's stall readings); correct (tests) but
    # slower, so opt-in. In the benchmark's conditions (fifteenth session, us at cursors
    # 0 / 8 / 14, two runs each; results/kernel_bench_runs/persistent_ab_15/):
    #     Nemotron L = 16   batch 1          128                 256
    #     default         3.6 / 3.8 / 3.9  29.0 / 33.1 / 36.3  55.7 / 62.0 / 68.0
    #     persistent      4.2 / 4.5 / 4.6  34.3 / 36.1 / 37.8  62.9 / 64.8 / 68.7
    #     (batch 512: 106.4 / 118.4 / 129.0 against 118.5 / 122.0 / 128.7)
    # in the form that read each cursor by the item's arrival atomic; the shipped form reads
    # it by a plain load (a flush slot's cursor is never touched) and took 65.9 / 70.3 / 72.4
    # at batch 256 (one run; 66.0 / 70.5 / 72.3 in two runs of the sixteenth session). At
    # L = 8 and 32 10-20% slower (Mamba-2 2.7B L = 32: even). Its warps wait on the bytes
    # (13% of samples at the stage's barrier: one item ahead is what 3 CTAs of 67 KB can
    # hold) and on their own chains: with one head a warp an item, each head pays the
    # group's B . C products, C's fragments and its decay chain, which the default step
    # shares over a warp's heads. Two items ahead (bulk_stages=3, 2 CTAs an SM) and other
    # copy granularities were slower still.
    persistent: bool = False
    # the epilogue adds a head's ring records in groups of this many, and a group that lies
    # wholly past the cursor is skipped by a branch (uniform: one cursor a CTA); 0: every
    # record of the window, those past the cursor adding zeros. Each record costs about 5.5
    # SASS instructions a lane a head (at L = 16, 780 a head with 14 records, 748 with 8, 702
    # with none), so at cursor 0 groups of 4 skip about 9% of a head's instructions. Slower on
    # the H200 all the same, so off (sixteenth session, kernel_bench --nonflush-knob, two
    # runs each, us at cursors 0 / L/2 / L-2; results/kernel_bench_runs/record_group_16/):
    #     point                    0 (every record)      4                     2
    #     Nemotron L16 b256        55.7 / 61.9 / 67.9    55.3 / 63.5 / 72.5    55.1 / 63.8 / 72.9
    #     Nemotron L8  b256        52.6 / 55.8 / 58.3    52.6 / 56.8 / 59.3    52.6 / 56.5 / 59.0
    #     Nemotron L32 b256        61.1 / 72.9 / 87.4    61.9 / 74.5 / 89.7    63.0 / 75.9 / 91.2
    #     Mamba-2 2.7B L16 b256    36.2 / 40.1 / 43.8    37.8 / 41.6 / 45.1    39.2 / 42.8 / 46.4
    #     Mamba-2 2.7B L32 b256    42.6 / 57.1 / 65.7    39.2 / 58.6 / 71.0    48.9 / 71.1 / 79.3
    # (2.5% slower on average over 54 points, batches 1, 128, 256; 8% faster at one). The
    # records past the cursor are off the step's critical path (cursor 0: about 9% fewer
    # instructions, 0.7% less time), and the branches cost where records remain
    record_group: int = 0
    # the group's B . C products and the CTA barrier that publishes them after the warps'
    # first checkpoint terms instead of before (early_loads, with_decode weights): a warp's
    # first decode then waits for its read copy and the cursor only, not for the ring B rows,
    # the products' shuffles and the slowest warp. On the Nemotron layer at L = 8 and 16 1-2%
    # faster at batch 256-512, even at 128 (seventeenth session, at the defaults of cb0b9b9:
    # the bulk stage at L = 16 batch 256-512,
    # registers elsewhere; two runs each, us at cursors 0 / L/2 / L-2;
    # results/kernel_bench_runs/bulk_eager_17/, files call7_*):
    #     Nemotron  batch   L = 8                          L = 16
    #     default    128    26.9 / 29.2 / 31.1             28.7 / 32.9 / 35.8
    #     late_dots  128    27.1 / 29.7 / 30.8             28.6 / 33.1 / 36.4
    #     default    256    52.7 / 55.5 / 58.4             54.1 / 60.2 / 65.5
    #     late_dots  256    52.0 / 55.6 / 57.3             53.4 / 59.3 / 65.3
    #     default    512    99.5 / 105.8 / 110.3           99.1 / 113.1 / 124.5
    #     late_dots  512    98.4 / 104.8 / 108.5           98.2 / 112.6 / 124.3
    # but slower elsewhere (call 8, files call8_*): at batch 1 3.5 / 3.7 / 3.9 -> 3.7 / 3.8 /
    # 4.0 (L = 16, either shape), and at L = 32, batch 256, Nemotron 60.9 / 73.2 / 88.5 ->
    # 63.0 / 75.5 / 90.6, Mamba-2 2.7B 42.9 / 57.3 / 65.8 -> 42.5 / 63.5 / 69.7 (at L = 16,
    # batch 256 it gains on Mamba-2 2.7B too: 36.4 / 40.2 / 44.3 -> 35.8 / 40.0 / 43.3). So
    # it is on only with the default bulk stage (replay_output: `default_stage`'s points,
    # the Nemotron layer at L = 16, batch 256-512), measured again there in the benchmark's
    # conditions (eighteenth session, 86ef4f7, two runs each, us at cursors 0 / 8 / 14;
    # results/kernel_bench_runs/late_dots_18/):
    #     batch 256   default 54.2 / 59.9 / 65.5   late_dots 53.4 / 59.2 / 65.1
    #     batch 512   default 99.1 / 113.0 / 124.5  late_dots 98.4 / 112.4 / 124.2
    # (batch 128, registers stage, even: 28.8 / 32.9 / 36.5 against 28.6 / 32.9 / 36.4);
    # off elsewhere
    late_dots: bool = False

    @property
    def ring_stage_bytes(self) -> int:
        """One head's ring records j <= window - 3 (the ones a non-flush step can read) in
        shared memory: a multiple of 16 bytes."""
        return (self.window - 2) * self.headdim * _ACT_BYTES[self.act]

    @property
    def ring_stage_allowed(self) -> bool:
        """Whether ring_stage="smem" can be built here: the registers or bulk stage for the read
        copy, one head a pass, no ring ablation, a window of 3 or more (replay_output refuses
        anything else on its arguments; default_ring_stage chooses within it); the
        shared-memory size is `ring_stage_fits`."""
        return (self.stage in ("registers", "bulk") and self.heads_per_pass == 1
                and "ring" not in self.ablate and self.window >= 3)

    @property
    def ring_stage_fits(self) -> bool:
        """Whether two ring stages a warp stay within RING_STAGE_LIMIT (stage="bulk": whether
        the bulk stages with the records in them stay within BULK_STAGE_LIMIT)."""
        if self.stage == "bulk":
            return self.warps * self.bulk_stages * self.bulk_stride(True) <= BULK_STAGE_LIMIT
        return self.warps * 2 * self.ring_stage_bytes <= RING_STAGE_LIMIT

    @property
    def read_copy_bytes(self) -> int:
        """One head's nvfp4 read copy: the codes, then the block scales (as staged)."""
        return self.headdim * self.dstate // 2 + self.headdim * self.dstate // 16

    def bulk_stride(self, ring_in_stage: bool) -> int:
        """Bytes of one bulk stage: the read copy, then (``ring_in_stage``) the ring records
        j <= window - 3, rounded up to 128 bytes."""
        size = self.read_copy_bytes + (self.ring_stage_bytes if ring_in_stage else 0)
        return -(-size // 128) * 128

    @property
    def ring_in_stage(self) -> bool:
        """Whether a head's ring records come in its bulk copy (stage="bulk", ring "smem")."""
        return self.stage == "bulk" and self.ring_stage == "smem"

    @property
    def weights_placement(self) -> str:
        if self.weights_at is not None:
            return self.weights_at
        return "with_decode" if self.lo_format == "nvfp4" else "before_decode"

    @property
    def min_ctas(self) -> int:
        if self.min_ctas_per_sm is not None:
            return self.min_ctas_per_sm
        return max(1, 16 // self.warps) if self.decode == "mma" else 0

    @property
    def state_upfront(self) -> bool:
        """Whether a head's whole read copy is loaded before any of it is used: by default
        nvfp4 and fp8 (8 or 16 registers of state per lane and stripe); fp16 and fp32 heads
        are 2-8x larger and are left to the compiler's schedule, which keeps registers low."""
        if self.upfront is not None:
            return self.upfront
        return self.lo_format in ("nvfp4", "fp8_e4m3")

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups

    @property
    def decode(self) -> str:
        return "simt" if self.lo_format == "fp32" else "mma"


def default_warps(heads_per_group: int, lo_format: str = "nvfp4") -> int:
    """Warps per CTA, by read-copy format, as measured on the H200 at batch 256, h = 8
    (2026-11-29; `python -m cute_kernels.bench_read --batch 256` and the kernel benchmark):

        nvfp4     4 warps 77.0 us, 8 warps 84.4 us, 16 warps 105.4 us (prefetching the next
                  head was slower: 4 warps 90.0 us, 8 warps 116.8 us)
        fp8_e4m3  4 warps 101.2 us, 8 warps 120.5 us
        fp16      4 warps 244.7 us, 8 warps 240.0 us
        fp32      4 warps 369.0 us, 8 warps 309.1 us (its SIMT decode wants the 8 warps)

    Registers are 128 per thread for the tensor-core formats, so fewer warps per CTA means
    more, smaller CTAs resident per SM, which start and finish out of step and keep loads in
    flight. Fewer warps where the group's head count is not a multiple."""
    preferred = 8 if lo_format in ("fp16", "fp32") else 4
    for w in (preferred, 4, 2, 1):
        if w <= preferred and heads_per_group % w == 0:
            return w
    return 1


# Where the read copy waits (ReplayOutputConfig.stage). The default is "registers": staging
# through shared memory was correct on the H200 but not faster (2026-11-29, `python -m
# cute_kernels.bench_read --batch 256 128`, h = 8, Nemotron layer;
# results/gpu_first_timing/bench_read_5.csv):
#
#     nvfp4, batch 256    registers 4 warps 69.7 us   smem 4 warps 71.7   2 warps 75.0
#     nvfp4, batch 128    registers 4 warps 38.3 us   smem 4 warps 40.8   2 warps 41.1
#
# so the step is not waiting on the next head's loads: ncu (results/ncu/) shows 44% of issue
# slots busy at 16 warps per SM, with no eligible warp in 52% of cycles.
STAGES = ("registers", "smem", "bulk")
RING_STAGES = ("registers", "smem")
YS_LAYOUTS = ("rows", "quads")
WEIGHTS_AT = ("with_decode", "before_decode")
RING_STAGE_LIMIT = 32 * 1024  # bytes of shared memory for a CTA's ring stages (ring_stage)
BULK_STAGE_LIMIT = 96 * 1024  # bytes of shared memory for a CTA's bulk stages (stage="bulk")
ABLATIONS = ("state", "scales", "ring", "decode", "prologue", "cursor")


# Heads one warp walks at most: the kernel is unrolled over a warp's heads, and 20 of them
# (Mamba-2 2.7B, one group of 80 heads, batch 512, one CTA per group) took 129.0 us where 10
# took 81.2 (table below): past ten or so the code outgrows the instruction cache.
MAX_HEADS_PER_WARP = 10


# The smallest window at which the ring records are staged by default: at L = 8 (6 records
# a head) the staging's copies and waits cost more than its loads save (ring_stage).
RING_STAGE_MIN_WINDOW = 16


def default_ring_stage(cfg: ReplayOutputConfig) -> str:
    """Where a head's ring records wait when none is asked for: "smem" for nvfp4 where each
    warp walks two heads or more (the next head's records then load while this one is
    computed), the window is RING_STAGE_MIN_WINDOW or more, and the staging is allowed
    (`ReplayOutputConfig.ring_stage_allowed`) and fits (`ring_stage_fits`); otherwise
    "registers". Measured at ReplayOutputConfig.ring_stage."""
    heads_per_warp = cfg.heads_per_group // (cfg.warps * cfg.head_splits)
    pays = cfg.lo_format == "nvfp4" and heads_per_warp >= 2 and cfg.window >= RING_STAGE_MIN_WINDOW
    return "smem" if pays and cfg.ring_stage_allowed and cfg.ring_stage_fits else "registers"


EAGER_FORMATS = ("nvfp4", "fp32")  # measured faster with eager_loads on one-wave grids
# With the ring records through registers, the eager loads only where a warp walks at most
# this many heads. Measured (fourteenth session, eager_ab_14/, us, cursors 0 / 4 / 6): Mamba-2
# 2.7B at L = 8, batch 256 (one wave of 512 CTAs, 10 heads a warp): 32.8 / 35.7 / 37.1 ->
# 45.4 / 46.9 / 47.1 with them, which the fourteenth session's rule (one wave alone) shipped
# (results/kernel_bench.csv: 44.8 / 46.6 / 47.5); ptxas reports no spills there (128
# registers either way; a CPU test checks it), so the cause is not pinned down. At 1 and 2
# heads a warp (batch 1 and 32) they gained on both shapes; with the records staged (L >= 16)
# 10 heads a warp were even (L = 16) or faster (L = 32). The fifteenth session's check of this
# rule: results/kernel_bench_runs/persistent_ab_15/NOTES.md (call 7).
EAGER_MAX_HEADS_REGISTERS_RING = 2


def default_eager_loads(cfg: ReplayOutputConfig, batch: int, sm_count: int) -> bool:
    """Whether the prologue's and the first head's loads go out before the cursor arrives
    when ``eager_loads`` is not given: for the formats of EAGER_FORMATS, where the knobs allow
    it (registers stage, early_loads, no l2_prefetch, pdl or ablation), and where the grid of
    ``batch * ngroups * head_splits`` CTAs fits in one wave of resident CTAs (``sm_count * 16
    / warps``, as `default_head_splits` counts them), and, with the ring records through
    registers, where a warp walks at most EAGER_MAX_HEADS_REGISTERS_RING heads (``cfg``'s
    ring_stage as it will run). Measured at ReplayOutputConfig.eager_loads."""
    allowed = (cfg.lo_format in EAGER_FORMATS and cfg.stage == "registers" and cfg.early_loads
               and not cfg.l2_prefetch and not cfg.pdl and not cfg.ablate)
    heads_per_warp = cfg.heads_per_group // (cfg.warps * cfg.head_splits)
    few_heads = cfg.ring_stage == "smem" or heads_per_warp <= EAGER_MAX_HEADS_REGISTERS_RING
    resident = sm_count * max(1, 16 // cfg.warps)
    return allowed and few_heads and batch * cfg.ngroups * cfg.head_splits <= resident


# The bulk stage with the eager loads (seventeenth session): a CTA's first heads' read copies
# go to the copy engine before its cursor is read, the prologue's loads with the cursor's,
# and every later head's bytes a stage ahead, so that the CTA's start waits out one round trip
# instead of two (`bench_read --prologue-variants`: with the prologue's loads and the cursor
# left out, timing only, the bulk stage took 52.5-53.1 us against the default's 58.6-59.0 at
# batch 256, h = 8; results/gpu_first_timing/bench_read_17.csv). Measured in the
# benchmark's conditions (kernel_bench --nonflush-knob stage=bulk eager_loads=True, two runs
# each, us at cursors 0 / L/2 / L-2; results/kernel_bench_runs/bulk_eager_17/):
#     Nemotron  batch   L = 8                          L = 16
#     default    128    27.0 / 29.7 / 31.2             29.0 / 33.5 / 36.2
#     bulk+eager 128    30.0 / 30.6 / 31.0             30.9 / 33.2 / 35.2
#     default    256    52.6 / 56.0 / 58.4             55.6 / 62.1 / 68.3
#     bulk+eager 256    53.4 / 55.8 / 56.8             54.0 / 60.0 / 65.7
#     default    512    99.3 / 105.7 / 110.1           106.3 / 118.7 / 129.7
#     bulk+eager 512    97.6 / 103.2 / 105.8           99.1 / 113.0 / 124.4
# (L = 32, where 3 CTAs of it fit an SM: 31.8 / 38.3 / 45.8 -> 35.8 / 39.2 / 44.3 at batch
# 128, 60.9 / 73.2 / 88.4 -> 63.9 / 71.9 / 85.3 at 256, 118.2 / 140.6 / 168.7 -> 118.8 /
# 136.0 / 163.0 at 512). So it is the default where it keeps BULK_MIN_CTAS CTAs an SM (its
# stages take shared memory: the default kernel's registers cap an SM at 4) and the grid is
# BULK_MIN_WAVES waves or more: on fewer, one wave's start sets the time, and there the
# lanes' own loads bring the first bytes sooner than the copy engine (the fifteenth session's
# reading of the bulk stage at cursor 0).
SM_SHARED_BYTES = 228 * 1024  # an H100 / H200 SM's shared memory
CTA_RESERVED_BYTES = 1024  # of it kept by the driver per resident CTA
BULK_MIN_CTAS = 4
BULK_MIN_WAVES = 3


def cta_shared_bytes(cfg: ReplayOutputConfig) -> int:
    """Shared memory of one CTA of ``cfg``'s kernel, allocation by allocation as the kernel
    makes them (each at its alignment). Checked against ncu's readings: 19,648 bytes for the
    default kernel at the Nemotron layer, L = 16 ("19.7 KB"), and 58,368 for the bulk stage
    with Mamba-2 2.7B's 10 heads a warp ("58.3 KB"; kernel_bench_runs/bulk_ab_15/)."""
    W, P, nh = cfg.warps, cfg.headdim, cfg.heads_per_group // (cfg.head_splits * cfg.warps)
    body = ReplayOutput(cfg)
    pieces = [(4 * 32, 16), (4 * P * W * cfg.heads_per_pass * body.quads, 16),
              (4 * W * nh * body.coef_row, 16), (4 * W * nh, 16)]
    if cfg.stage in ("smem", "bulk"):
        NS = cfg.bulk_stages if cfg.stage == "bulk" else 2
        stride = cfg.bulk_stride(cfg.ring_in_stage) if cfg.stage == "bulk" else cfg.read_copy_bytes
        pieces.append((W * NS * stride, 128))
    if cfg.stage == "bulk":
        pieces.append((8 * W * cfg.bulk_stages, 8))
        if cfg.eager_loads and cfg.ring_in_stage:  # the first heads' ring barriers
            pieces.append((8 * W * cfg.bulk_stages, 8))
    if cfg.ring_stage == "smem" and not cfg.ring_in_stage:
        pieces.append((W * 2 * cfg.ring_stage_bytes, 16))
    offset = 0
    for size, align in pieces:
        offset = -(-offset // align) * align + size
    return offset


def default_stage(cfg: ReplayOutputConfig, batch: int, sm_count: int) -> str:
    """Where the read copy waits when no ``stage`` is asked for: "bulk" (with the eager
    loads and the ring records in the stage) for nvfp4 where BULK_MIN_CTAS CTAs of it fit an
    SM's shared memory and the grid of ``batch * ngroups * head_splits`` CTAs is at least
    BULK_MIN_WAVES waves of ``sm_count * 16 / warps`` resident ones; otherwise "registers".
    ``cfg`` carries the other knobs as they will run; those that the bulk stage does not take
    (two heads a pass, prefetch, pdl, l2_prefetch, ablations, no early loads, the ring
    records through registers) keep "registers". Measured above."""
    if (cfg.lo_format != "nvfp4" or cfg.heads_per_pass != 1 or cfg.prefetch or cfg.pdl
            or cfg.l2_prefetch or cfg.ablate or not cfg.early_loads or cfg.persistent
            or cfg.min_ctas_per_sm is not None or cfg.upfront is not None):
        return "registers"
    bulk = dataclasses.replace(cfg, stage="bulk", bulk_stages=2, eager_loads=True)
    bulk = dataclasses.replace(bulk, ring_stage=default_ring_stage(bulk))
    if bulk.ring_stage != "smem":
        return "registers"
    fits = BULK_MIN_CTAS * (cta_shared_bytes(bulk) + CTA_RESERVED_BYTES) <= SM_SHARED_BYTES
    resident = sm_count * max(1, 16 // cfg.warps)
    waves = batch * cfg.ngroups * cfg.head_splits / resident
    return "bulk" if fits and waves >= BULK_MIN_WAVES else "registers"


def default_head_splits(batch: int, ngroups: int, heads_per_group: int, warps: int,
                        sm_count: int, lo_format: str = "nvfp4") -> int:
    """CTAs per (group, slot) when none is asked for: a divisor ``s`` of ``heads_per_group /
    warps`` (every warp then takes ``k = heads_per_group / (warps s)`` heads).

    Tensor-core formats: the ``s`` with the least ``waves * (k + 1)``, where ``waves`` is the
    grid of ``batch * ngroups * s`` CTAs over the resident ones (``sm_count * 16 / warps`` at
    128 registers) rounded up, and ``k + 1`` a CTA's heads a warp plus its prologue (about a
    head's worth: the group's B.C products); ``k <= MAX_HEADS_PER_WARP``, ties to the smaller
    ``s``. fp32 (SIMT decode): one head per warp at every batch. The model picked the fastest
    split, or one within 3%, at every point of two sweeps on the H200, h = 8, nvfp4 at 4 warps,
    in us (2026-11-29, `python -m cute_kernels.bench_read --splits-sweep ...`;
    results/gpu_first_timing/bench_read_splits_3.csv and bench_read_splits_mamba2_6.csv):

        Nemotron-3-Super (16 heads a group, 8 groups; model's pick in brackets)
        batch    1      8      32     64     128    256
        s1       8.7    9.4   13.6  [20.8] [38.3] [70.5]
        s2       6.5    6.2  [11.6]  21.6   39.3
        s4      [4.9]  [5.7]  13.1   25.5   47.1   87.1
        fp32 8 warps: s1 304.5, s2 275.7 us at batch 256

        Mamba-2 2.7B (80 heads, one group; --shape mamba2-2.7b --splits 1 2 4 5 10 20)
        batch    32     64     128    256    512
        s1      58.2   58.9   65.4   78.4  129.0
        s2      22.8   23.3   31.2  [42.5] [81.2]
        s4      13.2   15.5  [24.1]  44.0   82.0
        s5      12.5  [15.7]  29.7   47.6   83.3
        s10     [9.6]  15.3   26.7   46.2   85.6
        s20     11.0   16.2   31.1   56.2  105.0

    Small grids are latency-bound (a warp walks its heads one after another), so splitting
    pays until the grid fills the GPU; past that, a wave left part-empty costs as much as a
    full one. Earlier rules (powers of two until 2 CTAs an SM; then also at most 4 heads a
    warp) left Mamba-2 2.7B at 4 CTAs for batch 1, at 20 heads a warp for batch 512, and at
    1.2 waves for batch 128."""
    per_warp = heads_per_group // warps
    if lo_format == "fp32":
        return per_warp
    resident = sm_count * max(1, 16 // warps)
    best, best_cost = per_warp, None
    for splits in range(1, per_warp + 1):
        heads = per_warp // splits
        if per_warp % splits or heads > MAX_HEADS_PER_WARP:
            continue
        waves = -(-batch * ngroups * splits // resident)
        cost = waves * (heads + 1)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# --------------------------------------------------------------------------------------------
# Kernel


class ReplayOutput:
    """Host side (launch) and device body of the non-flush step for one configuration."""

    def __init__(self, cfg: ReplayOutputConfig):
        self.cfg = cfg
        self.E = _ELEMENTS_PER_LOAD[cfg.lo_format]
        # nvfp4 applies each block scale to the mma's per-block sums, which lane t of a quad
        # holds for its own blocks: four partial sums per row meet in shared memory
        self.quads = 4 if cfg.lo_format == "nvfp4" else 1

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
            # tensor-core formats: at most 128 registers a thread (16 warps an SM); the nvfp4
            # decode otherwise takes 134 and drops from 4 resident CTAs of 4 warps to 3. The
            # SIMT fp32 decode needs 79 and is left alone (a floor of 2 CTAs of 8 warps would
            # let it grow to 128). The carveout is the driver's default, named so that
            # compiling needs no GPU (smem_carveout).
            min_blocks_per_mp=self.cfg.min_ctas,
            preferred_smem_carveout=self.cfg.smem_carveout,
            use_pdl=self.cfg.pdl,
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
        blk, s, bz = cute.arch.block_idx()
        grp = blk // SPL
        part = blk % SPL
        warp = tid // 32
        lane = tid % 32

        smem = SmemAllocator()
        bc_smem = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
        Q = self.quads  # partial sums per row (nvfp4: one per lane of a quad)
        quads_inner = cfg.ys_layout == "quads" and Q == 4
        WC = W * cfg.heads_per_pass  # partial-sum columns: one per head of a warp's pass
        ys_layout = (cute.make_layout((P, WC, Q), stride=(Q, P * Q, 1)) if quads_inner
                     else cute.make_layout((P, WC, Q)))
        ys_smem = smem.allocate_tensor(Float32, ys_layout, byte_alignment=16)
        # per warp and head: its ring coefficients g_{j+1:h} dt_j (B_j . C), one row of
        # self.coef_row floats (16-byte aligned for the epilogue's vector reads), and its
        # checkpoint factor g_{0:h}
        nh = HPS // W  # heads of a warp
        coef_smem = smem.allocate_tensor(
            Float32, cute.make_layout((W, nh, self.coef_row),
                                      stride=(nh * self.coef_row, self.coef_row, 1)),
            byte_alignment=16)
        ck_smem = smem.allocate_tensor(Float32, cute.make_layout((W, nh)), byte_alignment=16)
        staged = cfg.stage in ("smem", "bulk")
        bulk = cfg.stage == "bulk"
        NS = cfg.bulk_stages if bulk else 2  # stages a warp
        stride = cfg.bulk_stride(cfg.ring_in_stage) if bulk else cfg.read_copy_bytes
        stage_base = Int32(0)
        bar_base = Int32(0)
        if cutlass.const_expr(staged):
            st_smem = smem.allocate_tensor(
                Uint32, cute.make_layout(W * NS * stride // 4), byte_alignment=128
            )
            stage_base = st_smem.iterator.toint() + warp * (NS * stride)
        if cutlass.const_expr(bulk):
            bar_smem = smem.allocate_tensor(Int64, cute.make_layout(W * NS), byte_alignment=8)
            bar_base = bar_smem.iterator.toint() + warp * (NS * 8)
        early_bulk = bulk and cfg.eager_loads
        split_ring = early_bulk and cfg.ring_in_stage
        ring_bar_base = Int32(0)
        if cutlass.const_expr(split_ring):
            # the first NS heads' ring records land on barriers of their own, so that a
            # head's decode waits only for its read copy and its epilogue for its records
            ring_bar_smem = smem.allocate_tensor(Int64, cute.make_layout(W * NS),
                                                 byte_alignment=8)
            ring_bar_base = ring_bar_smem.iterator.toint() + warp * (NS * 8)
        ring_staged = cfg.ring_stage == "smem"
        ring_cp = ring_staged and not cfg.ring_in_stage  # cp.async ring stages
        ring_base = Int32(0)
        RB = cfg.ring_stage_bytes
        if cutlass.const_expr(ring_cp):
            rs_smem = smem.allocate_tensor(Uint32, cute.make_layout(W * 2 * RB // 4),
                                           byte_alignment=16)
            ring_base = rs_smem.iterator.toint() + warp * (2 * RB)

        pre = {}  # pdl: the first head's read copy, loaded before the previous grid ends
        if cutlass.const_expr(cfg.pdl):
            sh0 = Int64(s) * H + (grp * HPG + part * HPS + warp)
            # pinned (volatile) loads: otherwise ptxas may sink them past the wait
            pre["state"] = self._issue_state_now(lo0.toint(), lo1.toint(), sh0, lane, pin=True)
            if cutlass.const_expr(cfg.lo_format == "nvfp4"):
                pre["s_g"] = Float32(cute.arch.load((lo2 + sh0).llvm_ptr, Float32))
            cute.arch.griddepcontrol_wait()
            # only now may the next grid launch: its early loads then come after every grid
            # before this one has finished (a trigger before the wait would let a chain of
            # pdl steps run ahead of a flush that writes their read copy)
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(early_bulk):
            # eager_loads with the bulk stage: the first NS heads' read copies go to the copy
            # engine before the cursor is read (they do not depend on it); the ring records
            # follow once the cursor is known, on the stage's ring barrier
            if lane == 0:
                for k in cutlass.range_constexpr(NS):
                    _mbar_init(bar_base + 8 * k)
                    if cutlass.const_expr(split_ring):
                        _mbar_init(ring_bar_base + 8 * k)
                _mbar_init_fence()
                for k in cutlass.range_constexpr(min(NS, HPS // W)):
                    sh_k = Int64(s) * H + (grp * HPG + part * HPS + warp + W * k)
                    self._bulk_read_copy(lo0.toint(), lo1.toint(), sh_k,
                                         stage_base + k * stride, bar_base + 8 * k)
        if cutlass.const_expr("cursor" in cfg.ablate):  # timing only: window / 2 - 1 (bz is 0
            raw_cursor = Int32(bz) + (L // 2 - 1)  # at launch; a value ptxas cannot fold)
        else:
            raw_cursor = cute.arch.load((cursors + s).llvm_ptr, Int32)
        # eager_loads: the prologue's and the first heads' loads go out with the cursor's
        eager = self._eager_loads(ptrs=(lo0, lo1, lo2, ring_x, ring_dt, x, dt, A, D, z, dt_bias),
                                  ring_B=ring_B, B=B, C=C, s=s, grp=grp, part=part, warp=warp,
                                  lane=lane) if cfg.eager_loads else {}
        if cutlass.const_expr("prologue" in cfg.ablate):  # timing only (eager is then off)
            eager = self._prologue_constants(s, grp, part, warp, lane)
        cursor = Int32(raw_cursor) & 0xFFFF
        h = cursor + 1
        if cutlass.const_expr(cfg.eager_loads):
            if h >= L:
                # A flush slot's CTA folds every eager word into a shared-memory word it never
                # reads: with a use on both sides of the cursor's test, ptxas keeps the loads
                # ahead of it (it otherwise sinks them past the early exit, volatile ones too,
                # and they wait for the cursor after all). Such a CTA reads its slot's read
                # copy while a flush kernel on another stream may be rewriting it; the words
                # are dropped, so the race is harmless (as with pdl's early loads)
                bc_smem[0] = bits_f32(_fold_words(eager))
                if cutlass.const_expr(early_bulk):
                    if lane == 0:  # no copy may still be writing this CTA's shared memory
                        for k in cutlass.range_constexpr(min(NS, HPS // W)):  # when it exits
                            _mbar_wait(bar_base + 8 * k, 0)
        if h < L:
            s64 = Int64(s)
            sg = s64 * G + grp  # (slot, group) row of B, C, ring_B
            heads = [grp * HPG + part * HPS + warp + W * hh for hh in range(HPS // W)]
            ptrs = (lo0, lo1, lo2, ring_x, ring_dt, x, dt, A, D, z, dt_bias)
            # The first head's loads are issued before the prologue's barrier (ptxas moves
            # the read copy's past it: see pin_state_loads), the next head's before the
            # current one is computed (cfg.prefetch); no load waits on another load.
            HPP = cfg.heads_per_pass
            # the decay weights of all of this warp's heads at once, a segment of lanes per
            # head: the loads here, in flight with the prologue's; the weights and their
            # products with B . C after the prologue's barrier
            decay_inputs = self._loaded(eager, "decay", lambda: _warp_decay_loads(
                cfg, self.segment, ptrs, heads[0], nh, s64, lane))
            loads = self._loaded(eager, "heads", lambda: [
                self._issue_head(ptrs, s64 * H + heads[k], heads[k], cursor, lane,
                                 pre if k == 0 else None)
                for k in range(min(HPP, nh))])
            if lane == 0:  # the next cfg.l2_prefetch heads' bytes, into L2
                for k in cutlass.range_constexpr(1, min(cfg.l2_prefetch + 1, nh)):
                    self._prefetch_head(ptrs, s64 * H + heads[k], cursor)
            if cutlass.const_expr(staged and not bulk):
                for k in cutlass.range_constexpr(min(2, nh)):
                    self._stage_head(lo0.toint(), lo1.toint(), s64 * H + heads[k],
                                     stage_base + k * stride, lane)
            if cutlass.const_expr(bulk):
                if cutlass.const_expr(cfg.ring_in_stage):
                    # the records past the cursor are never copied (the same cursor for every
                    # head of the slot) but are read with coefficient 0: zeros, not stale bits
                    self._zero_ring_tails(stage_base, stride, NS, cursor, lane)
                if lane == 0:  # the first NS heads, one bulk request each
                    if cutlass.const_expr(split_ring):  # their read copies are on their way
                        for k in cutlass.range_constexpr(min(NS, nh)):
                            self._bulk_ring(ring_x.toint(), s64 * H + heads[k],
                                            stage_base + k * stride, ring_bar_base + 8 * k,
                                            cursor)
                    elif cutlass.const_expr(not early_bulk):
                        for k in cutlass.range_constexpr(NS):
                            _mbar_init(bar_base + 8 * k)
                        _mbar_init_fence()
                        for k in cutlass.range_constexpr(min(NS, nh)):
                            self._bulk_head(ptrs, s64 * H + heads[k], stage_base + k * stride,
                                            bar_base + 8 * k, cursor)
                cute.arch.sync_warp()  # every lane waits on barriers lane 0 initialised
            if cutlass.const_expr(ring_cp):  # the first two heads' ring records
                for k in cutlass.range_constexpr(min(2, nh)):
                    self._stage_ring(ring_x.toint(), s64 * H + heads[k], ring_base + k * RB,
                                     cursor, lane)

            # ---- the group's dot products B_j . C, j < h (j = h-1: this step's B) ----------
            nb = N // 32  # consecutive elements of B and C per lane
            vb = nb * ab // 4
            c_vals = _words_to_f32(self._loaded(eager, "C", lambda: _load_words(
                C.toint() + (sg * N + lane * nb) * ab, vb)), act)
            n_jj = (L - 1 + W - 1) // W  # ring records per warp
            if cutlass.const_expr(cfg.early_loads):
                # every load of the prologue goes out before any is used: one round trip
                # (the ring rows past the cursor are predicated off, no traffic)
                rb_words = self._loaded(eager, "ring_B", lambda: [
                    self._ld_row_if(ring_B.toint() + ((sg * Lc + warp + W * jj) * N
                                                      + lane * nb) * ab, vb,
                                    warp + W * jj < cursor)
                    for jj in range(n_jj)])
                early = {"B": self._loaded(eager, "B", lambda: _load_words(
                    B.toint() + (sg * N + lane * nb) * ab, vb))}
                ck = self._loaded(eager, "ck", lambda: self._checkpoint_setup(C.toint(), sg, lane))
                if cutlass.const_expr(not cfg.late_dots):
                    _ring_dots(cfg, rb_words, c_vals, cursor, warp, bc_smem)
            else:
                for jj in cutlass.range_constexpr(n_jj):
                    j = warp + W * jj
                    if j < cursor:
                        addr = ring_B.toint() + ((sg * Lc + j) * N + lane * nb) * ab
                        bc_smem[j] = _dot_warp(_words_to_f32(_load_words(addr, vb), act),
                                               c_vals)
            if cutlass.const_expr(not cfg.late_dots):
                if warp == 0:
                    # this step's record: B . C, and B appended once per (slot, group)
                    b_words = self._loaded(early if cfg.early_loads else {}, "B",
                                           lambda: _load_words(B.toint() + (sg * N + lane * nb)
                                                               * ab, vb))
                    _step_dot(cfg, b_words, c_vals, cursor, part, bc_smem,
                              ring_B.toint() + ((sg * Lc + cursor) * N + lane * nb) * ab)
            if cutlass.const_expr(not cfg.early_loads):
                ck = self._checkpoint_setup(C.toint(), sg, lane)
            if cutlass.const_expr(not cfg.late_dots):
                cute.arch.sync_threads()
            # the weights after the barrier (before it in c852ff3, whose small grids read
            # slower: batch 8 6.3 -> 7.0 us, bench_read_10.csv), and by default beside the first
            # pass's checkpoint term (weights_at)
            with_decode = cfg.weights_placement == "with_decode"
            if cutlass.const_expr(not with_decode):
                weights = _warp_decay_weights(cfg, self.segment, ptrs, decay_inputs, cursor,
                                              lane)
                _store_warp_coefs(self.segment, weights, nh, warp, lane, cursor, bc_smem,
                                  coef_smem, ck_smem)
                cute.arch.sync_warp()
            # every thread of this CTA has read the cursor; the last CTA of the slot stores h
            # (early_loads: after this CTA's heads, so that no warp waits for the atomic)
            arrivals = Int32(0)
            if cutlass.const_expr("cursor" in cfg.ablate):
                pass  # timing only: no arrival, the cursor stays where it was
            elif cutlass.const_expr(cfg.early_loads):
                if tid == 0:
                    arrivals = cute.arch.atomic_add((cursors + s).llvm_ptr, Int32(1 << 16))
            elif tid == 0:
                old = cute.arch.atomic_add((cursors + s).llvm_ptr, Int32(1 << 16))
                if (old >> 16) == G * SPL - 1:
                    cute.arch.store((cursors + s).llvm_ptr, h)

            # A warp takes its heads cfg.heads_per_pass at a time: every load of the pass
            # goes out first, then the decay weights and checkpoint terms of all of them, then
            # their epilogues, so that one head's dependency chains fill the other's waits.
            for p0 in cutlass.range_constexpr(0, nh, HPP):
                pass_heads = list(range(p0, min(p0 + HPP, nh)))
                ctx = []
                for hh in pass_heads:
                    head = heads[hh]
                    sh = s64 * H + head  # (slot, head) row of every per-head tensor
                    ahead = cfg.prefetch or staged
                    if cutlass.const_expr(ahead and hh + 1 < nh):
                        loads.append(
                            self._issue_head(ptrs, s64 * H + heads[hh + 1], heads[hh + 1],
                                             cursor, lane)
                        )
                    if cutlass.const_expr(not ahead and hh >= len(loads)):
                        loads.append(self._issue_head(ptrs, sh, head, cursor, lane))
                for hh in pass_heads:
                    head = heads[hh]
                    sh = s64 * H + head
                    ld = loads[hh]
                    if cutlass.const_expr(cfg.l2_prefetch and hh > 0
                                          and hh + cfg.l2_prefetch < nh):
                        if lane == 0:  # heads hh + 1 .. hh + l2_prefetch asked for (the
                            # prologue asked for 1 .. l2_prefetch)
                            self._prefetch_head(ptrs, s64 * H + heads[hh + cfg.l2_prefetch],
                                                cursor)
                    stage = stage_base + (hh % NS) * stride if staged else None
                    if cutlass.const_expr(bulk):  # this head's bytes landed (use hh // NS of
                        _mbar_wait(bar_base + 8 * (hh % NS), (hh // NS) % 2)  # its stage)
                        ld["state"] = self._staged_state(stage, lane)
                    elif cutlass.const_expr(staged):
                        _cp_async_wait(1 if hh + 1 < nh else 0)  # this head's group landed
                        cute.arch.sync_warp()  # ... for every lane's copies
                        ld["state"] = self._staged_state(stage, lane)
                    ctx.append([ld, sh, stage])

                # ---- checkpoint terms S_lo C -> ys_smem[:, column of the warp's head] -----
                for k in cutlass.range_constexpr(len(pass_heads)):
                    ld = ctx[k][0]
                    col = warp if k == 0 else warp + W * k
                    rows, writer = self._checkpoint_term(ck, ld["state"], lane)
                    if writer:
                        for i in cutlass.range_constexpr(len(rows)):
                            ys_smem[rows[i][0], col, (lane % 4) % Q] = rows[i][1]
                if cutlass.const_expr(cfg.late_dots and p0 == 0):
                    # late_dots: the group's B . C products now, and the barrier that
                    # publishes them before any warp reads them for its coefficients
                    _ring_dots(cfg, rb_words, c_vals, cursor, warp, bc_smem)
                    if warp == 0:
                        _step_dot(cfg, early["B"], c_vals, cursor, part, bc_smem,
                                  ring_B.toint() + ((sg * Lc + cursor) * N + lane * nb) * ab)
                    cute.arch.sync_threads()
                if cutlass.const_expr(with_decode and p0 == 0):
                    # every head's coefficients, read after the warp barrier below
                    weights = _warp_decay_weights(cfg, self.segment, ptrs, decay_inputs,
                                                  cursor, lane)
                    _store_warp_coefs(self.segment, weights, nh, warp, lane, cursor, bc_smem,
                                      coef_smem, ck_smem)
                if cutlass.const_expr(ring_cp):  # this head's ring records landed
                    _cp_async_wait(1 if pass_heads[-1] + 1 < nh else 0)
                cute.arch.sync_warp()
                hh = pass_heads[-1]
                if cutlass.const_expr(bulk and not cfg.ring_in_stage and hh + NS < nh):
                    if lane == 0:  # every lane has read this stage: head hh + NS goes in
                        self._bulk_head(ptrs, s64 * H + heads[hh + NS], ctx[-1][2],
                                        bar_base + 8 * (hh % NS), cursor)
                if cutlass.const_expr(staged and not bulk and hh + 2 < nh):
                    # every lane has read this stage: the head after next goes into it
                    self._stage_head(lo0.toint(), lo1.toint(), s64 * H + heads[hh + 2],
                                     ctx[-1][2], lane)
                if cutlass.const_expr(split_ring and pass_heads[-1] < NS):
                    _mbar_wait(ring_bar_base + 8 * pass_heads[-1], 0)  # this head's records

                # ---- epilogue: rows v, v+1 on each lane -----------------------------------
                for k in cutlass.range_constexpr(len(pass_heads)):
                    ld, sh, _ = ctx[k]
                    hh = pass_heads[k]
                    col = warp if k == 0 else warp + W * k
                    # this head's ring coefficients and checkpoint factor
                    row = coef_smem.iterator.toint() + 4 * self.coef_row * (warp * nh + hh)
                    coefs = []
                    for i in cutlass.range_constexpr((L - 2 + 3) // 4):
                        coefs += [bits_f32(w) for w in _lds_v4(row + 16 * i)]
                    c_last = coef_smem[warp, hh, cursor]  # this step's own record
                    ck_scale = ck_smem[warp, hh] * ld["factor"]
                    for r in cutlass.range_constexpr((P + 63) // 64):
                        v_raw = 64 * r + 2 * lane
                        v = cutlass.min(v_raw, P - 2)  # clamped: every lane joins the shuffles
                        xw = ld["x"][r]
                        xv = _words_to_f32(xw, act)
                        if cutlass.const_expr(quads_inner):
                            # rows v, v + 1: eight consecutive words, two 16-byte reads
                            base = ys_smem.iterator.toint() + 4 * Q * (v + P * col)
                            q0 = [bits_f32(w) for w in _lds_v4(base)]
                            q1 = [bits_f32(w) for w in _lds_v4(base + 16)]
                            ys0 = ((q0[0] + q0[1]) + q0[2]) + q0[3]
                            ys1 = ((q1[0] + q1[1]) + q1[2]) + q1[3]
                        else:
                            ys0, ys1 = ys_smem[v, col, 0], ys_smem[v + 1, col, 0]
                            for q in cutlass.range_constexpr(1, Q):
                                ys0 = ys0 + ys_smem[v, col, q]
                                ys1 = ys1 + ys_smem[v + 1, col, q]
                        def record(j, r=r, v=v, ld=ld, hh=hh, head_stage=ctx[k][2]):
                            # records j >= cursor were not loaded (zeros; eager_loads: loaded
                            # and zeroed here) and have coef 0; record L - 2 is never before
                            # the cursor (cursor <= L - 2 on a non-flush step)
                            if cutlass.const_expr(cfg.ring_in_stage):
                                words = _lds_words(head_stage + cfg.read_copy_bytes
                                                   + (j * P + v) * ab, ab // 2)
                            elif cutlass.const_expr(ring_staged):
                                words = _lds_words(ring_base + (hh % 2) * RB
                                                   + (j * P + v) * ab, ab // 2)
                            else:
                                words = ld["ring"][r][j]
                            if cutlass.const_expr(cfg.eager_loads and not ring_staged):
                                words = [_sel(j < cursor, w, Uint32(0)) for w in words]
                            return words

                        zw = ld["z"][r] if cfg.has_z else None
                        # _output_pair in its parts: the records in groups of record_group,
                        # a group past the cursor skipped by a branch (uniform: one cursor a
                        # CTA); records past the cursor inside a group add zeros
                        acc0, acc1 = ck_scale * ys0, ck_scale * ys1
                        RG = cfg.record_group or max(L - 2, 1)
                        for g0 in cutlass.range_constexpr(0, L - 2, RG):
                            js = range(g0, min(g0 + RG, L - 2))
                            if cutlass.const_expr(cfg.record_group == 0):
                                acc0, acc1 = _ring_records(act, js, coefs, record, acc0, acc1)
                            elif cursor > g0:
                                acc0, acc1 = _ring_records(act, js, coefs, record, acc0, acc1)
                        acc0, acc1 = _output_finish(act, acc0, acc1, c_last, ld["D"], xv, zw)
                        if v_raw < P:
                            out_words = _f32_to_words([acc0, acc1], act)
                            _store_words(out.toint() + (sh * P + v) * ab, out_words)
                            _store_words(ring_x.toint() + ((sh * Lc + cursor) * P + v) * ab, xw)
                cute.arch.sync_warp()
                hh = pass_heads[-1]
                if cutlass.const_expr(cfg.ring_in_stage and hh + NS < nh):
                    if lane == 0:  # every lane has read this stage: head hh + NS goes in
                        self._bulk_head(ptrs, s64 * H + heads[hh + NS], ctx[-1][2],
                                        bar_base + 8 * (hh % NS), cursor)
                if cutlass.const_expr(ring_cp and hh + 2 < nh):
                    # every lane has read this head's stage: the head after next goes into it
                    hn = hh + 2
                    self._stage_ring(ring_x.toint(), s64 * H + heads[hn],
                                     ring_base + (hn % 2) * RB, cursor, lane)
            if cutlass.const_expr(cfg.early_loads and "cursor" not in cfg.ablate):
                if tid == 0:
                    if (arrivals >> 16) == G * SPL - 1:
                        cute.arch.store((cursors + s).llvm_ptr, h)

    # ---- loads of one head -----------------------------------------------------------------

    def _eager_loads(self, ptrs, ring_B, B, C, s, grp, part, warp, lane) -> dict:
        """eager_loads: the loads that the prologue and a warp's first pass need, issued
        while the cursor is still on its way: the first pass's heads (read copy, x, D; every
        ring record too unless they are staged), every ring B row (whatever the cursor, so
        none is predicated on it; those past it are zeroed or skipped where used), this step's
        B, C in both layouts and the decay weights' inputs. One dependent round trip instead of
        two; the unneeded rows cost bytes, which pays where the grid is latency-bound (at most
        a wave of CTAs: `default_eager_loads`)."""
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
                      for k in range(min(cfg.heads_per_pass, nh))],
            "ring_B": [_load_words(ring_B.toint() + ((sg * Lc + warp + W * jj) * N
                                                     + lane * nb) * ab, vb)
                       for jj in range(n_jj)],
            "B": _load_words(B.toint() + (sg * N + lane * nb) * ab, vb),
            "C": _load_words(C.toint() + (sg * N + lane * nb) * ab, vb),
            "ck": self._checkpoint_setup(C.toint(), sg, lane),
            "decay": _warp_decay_loads(cfg, self.segment, ptrs, heads[0], nh, s64, lane),
        }

    def _prologue_constants(self, s, grp, part, warp, lane) -> dict:
        """ablate "prologue" (timing only): the words the prologue would load, as
        lane-dependent constants in `_eager_loads`' keys (C, B, the ring's B rows, C's mma
        fragments, the decay weights' inputs), so that no prologue load is issued."""
        cfg = self.cfg
        H, N, L, W = cfg.nheads, cfg.dstate, cfg.window, cfg.warps
        HPS = cfg.heads_per_group // cfg.head_splits
        nh = HPS // W
        vb = (N // 32) * _ACT_BYTES[cfg.act] // 4
        n_jj = (L - 1 + W - 1) // W

        def words(salt, n):
            return [Uint32(lane) * Uint32(0x00010001) + Uint32(0x3C003C00 + salt + i)
                    for i in range(n)]

        first_head = grp * cfg.heads_per_group + part * HPS + warp
        decay = []
        for q in range(_decay_passes(self.segment, nh)):
            k_raw, head = _decay_pass_head(W, self.segment, first_head, nh, lane, q)
            small = Float32(lane) * Float32(1.0 / 64)
            decay.append((k_raw < nh, Int64(s) * H + head, small, small + Float32(0.25),
                          Float32(-0.5) - small))
        return {
            "C": words(0, vb), "B": words(16, vb),
            "ring_B": [words(32 + 8 * jj, vb) for jj in range(n_jj)],
            "ck": self._c_fragments(lambda off, n: words(off, n), lane),
            "decay": decay,
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
            return _ld_words_if(addr, 1, pred)
        words = []
        for i in range(0, n, 2):
            words += _ld_words_if(addr + 4 * i, 2, pred)
        return words

    def _prefetch_head(self, ptrs, sh, cursor) -> None:
        """One head's read copy and its ring records before ``cursor`` into L2 (lane 0);
        with ``l2_prefetch_small`` also its x, z, dt, ring dt row and nvfp4 global scale."""
        cfg = self.cfg
        lo0, lo1, _, ring_x = ptrs[:4]
        P, N, Lc = cfg.headdim, cfg.dstate, cfg.ring_capacity
        ab = _ACT_BYTES[cfg.act]
        nbytes = int(P * N * _BYTES_PER_ELEMENT[cfg.lo_format])
        _prefetch_l2(lo0.toint() + sh * nbytes, nbytes)
        if cutlass.const_expr(cfg.lo_format == "nvfp4"):
            _prefetch_l2(lo1.toint() + sh * (P * N // 16), P * N // 16)
        _prefetch_l2(ring_x.toint() + sh * (Lc * P * ab), cursor * (P * ab))  # none if 0
        if cutlass.const_expr(cfg.l2_prefetch_small):
            _, _, lo2, _, ring_dt, x, dt, _, _, z, _ = ptrs
            _prefetch_l2(x.toint() + sh * (P * ab), P * ab)
            if cutlass.const_expr(cfg.has_z):
                _prefetch_l2(z.toint() + sh * (P * ab), P * ab)
            # rows shorter than 16 bytes or off 16-byte boundaries: the aligned 16-byte
            # pieces that hold them (inside the allocation: torch rounds it up to 512 bytes)
            row = ring_dt.toint() + sh * (Lc * 4)
            first = row & Int64(~15)
            _prefetch_l2(first, Int32((row + Lc * 4 + 15 - first) & Int64(~15)))
            _prefetch_l2((dt.toint() + sh * _ACT_BYTES[cfg.dt_dtype]) & Int64(~15), 16)
            if cutlass.const_expr(cfg.lo_format == "nvfp4"):
                _prefetch_l2((lo2.toint() + sh * 4) & Int64(~15), 16)

    @property
    def segment(self) -> int:
        """Lanes that hold one head's window in `_warp_decay_weights`: the window rounded up to a
        power of two (records j < window - 1 of the ring and this step's)."""
        return 1 << (self.cfg.window - 1).bit_length()

    @property
    def coef_row(self) -> int:
        """Floats of one head's row of ring coefficients in shared memory (16-byte rows)."""
        return 4 * ((self.segment + 3) // 4)

    def _issue_head(self, ptrs, sh, head, cursor, lane, pre=None) -> dict:
        """Every global load one head needs, issued together (none depends on another):
        the read copy (per format), the ring records before the cursor (predicated: records
        past it cost no traffic), D, x, z (dt and A: `_warp_decay_loads`); the read copy and
        global scale from ``pre`` where they were loaded already (pdl)."""
        cfg = self.cfg
        lo0, lo1, lo2, ring_x, _, x, _, _, D, z, _ = ptrs
        P, Lc, L, act = cfg.headdim, cfg.ring_capacity, cfg.window, cfg.act
        ab = _ACT_BYTES[act]
        ld = {"state": None}
        if pre:
            ld["state"] = pre["state"]
        elif cfg.stage == "registers":
            ld["state"] = self._issue_state(lo0.toint(), lo1.toint(), sh, lane)
        ld["factor"] = Float32(1.0)
        if cfg.lo_format == "nvfp4":
            s_g = (pre["s_g"] if pre else
                   Float32(cute.arch.load((lo2 + sh).llvm_ptr, Float32)))
            ld["factor"] = s_g * Float32(_NVFP4_UNDO)
        ld["D"] = Float32(0.0)
        if cfg.has_D:
            ld["D"] = Float32(cute.arch.load((D + head).llvm_ptr, Float32))
        ld["x"], ld["z"], ld["ring"] = [], [], []
        for r in range((P + 63) // 64):
            v = cutlass.min(64 * r + 2 * lane, P - 2)
            ld["x"].append(_load_words(x.toint() + (sh * P + v) * ab, ab // 2))
            if cfg.has_z:
                ld["z"].append(_load_words(z.toint() + (sh * P + v) * ab, ab // 2))
            if cfg.ring_stage == "smem":  # read from the warp's ring stage in the epilogue
                continue
            if "ring" in cfg.ablate:  # timing only: the records' words without their loads
                ld["ring"].append([[Uint32(lane + j)] * (ab // 2) for j in range(L - 2)])
                continue
            if cursor is None:  # eager_loads: every record, zeroed past the cursor when used
                ld["ring"].append([_load_words(ring_x.toint() + ((sh * Lc + j) * P + v) * ab,
                                               ab // 2) for j in range(L - 2)])
                continue
            ld["ring"].append([
                _ld_words_if(ring_x.toint() + ((sh * Lc + j) * P + v) * ab, ab // 2, j < cursor)
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
                vals += _words_to_f32(_load_words(row + (32 * m + 4 * l8) * ab, ab), act)
            return vals
        return self._c_fragments(lambda off, n: _load_words(row + off, n), lane)

    def _c_fragments(self, load, lane):
        """C in the mma's B-fragment layout, its words read by ``load(byte offset in C's row,
        words)`` (global memory here; the persistent step's shared-memory stage there)."""
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
                    h0, h1 = _f16x2_to_f32x2(hi)
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

    def _stage_head(self, lo0, lo1, sh, stage, lane) -> None:
        """cp.async one head's codes and scales (contiguous in global memory) into the
        warp's stage at shared address ``stage``, 16 bytes per lane and copy; one group."""
        P, N = self.cfg.headdim, self.cfg.dstate
        codes16, scales16 = P * N // 32, P * N // 256  # 16-byte pieces
        for i in range((codes16 + 31) // 32):
            piece = lane + 32 * i
            _cp_async_16(stage + piece * 16, lo0 + (sh * (P * N // 2) + piece * 16))
        for i in range((scales16 + 31) // 32):
            piece = lane + 32 * i
            if (i + 1) * 32 > scales16:  # lanes past the end copy the last piece again
                piece = cutlass.min(piece, scales16 - 1)
            _cp_async_16(stage + codes16 * 16 + piece * 16,
                         lo1 + (sh * (P * N // 16) + piece * 16))
        _cp_async_commit()

    def _bulk_head(self, ptrs, sh, stage, bar, cursor) -> None:
        """stage="bulk", lane 0: one head's codes, block scales and (ring_in_stage) ring
        records j < cursor (each contiguous in global memory) into the stage at shared address
        ``stage``, completing on the stage's barrier ``bar``."""
        cfg = self.cfg
        lo0, lo1, _, ring_x = ptrs[:4]
        ring = cursor * (cfg.headdim * _ACT_BYTES[cfg.act]) if cfg.ring_in_stage else Int32(0)
        self._bulk_read_copy(lo0.toint(), lo1.toint(), sh, stage, bar, ring)
        if cutlass.const_expr(cfg.ring_in_stage):
            self._bulk_records(ring_x.toint(), sh, stage, bar, ring)

    def _bulk_read_copy(self, lo0, lo1, sh, stage, bar, more=0) -> None:
        """Lane 0: one head's codes and block scales into its stage, completing on ``bar``,
        which expects ``more`` bytes besides (the ring records `_bulk_head` sends with them);
        with eager_loads, before the cursor is known."""
        P, N = self.cfg.headdim, self.cfg.dstate
        codes, scales = P * N // 2, P * N // 16
        _mbar_expect(bar, more + self.cfg.read_copy_bytes)
        _bulk_copy(stage, lo0 + sh * codes, codes, bar)
        _bulk_copy(stage + codes, lo1 + sh * scales, scales, bar)

    def _bulk_records(self, ring_x, sh, stage, bar, nbytes) -> None:
        """Lane 0: the first ``nbytes`` of a head's ring records into its stage, behind the
        read copy, completing on ``bar``."""
        cfg = self.cfg
        P, Lc, ab = cfg.headdim, cfg.ring_capacity, _ACT_BYTES[cfg.act]
        _bulk_copy(stage + cfg.read_copy_bytes, ring_x + sh * (Lc * P * ab), nbytes, bar)

    def _bulk_ring(self, ring_x, sh, stage, bar, cursor) -> None:
        """The ring records j < cursor of a head whose read copy `_bulk_read_copy` sent, once
        the cursor is known, completing on ``bar`` (the stage's ring barrier)."""
        ring = cursor * (self.cfg.headdim * _ACT_BYTES[self.cfg.act])
        _mbar_expect(bar, ring)
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
                _sts_zero16_if(stage_base + k * stride + cfg.read_copy_bytes + piece * 16, tail)

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
            _cp_async_16_zfill(stage + piece * 16, ring_x + (sh * Lc * P * ab + piece * 16),
                               _sel(j < cursor, Int32(16), Int32(0)))
        _cp_async_commit()

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
                    a1 = _lds_v4(stage + r1 * row_bytes + 64 * c + 16 * t)
                    a2 = _lds_v4(stage + (r1 + 8) * row_bytes + 64 * c + 16 * t)
                    sc = (_lds_u16(stage + codes + r1 * sc_row + 8 * c + 2 * t),
                          _lds_u16(stage + codes + (r1 + 8) * sc_row + 8 * c + 2 * t))
                    chunks.append((a1, a2, sc))
                return chunks

        return Stripes()

    def _issue_state_now(self, lo0, lo1, sh, lane, pin=None) -> list:
        cfg, E = self.cfg, self.E
        P, N = cfg.headdim, cfg.dstate
        fmt = cfg.lo_format
        pin = cfg.pin_state_loads if pin is None else pin
        if cfg.decode == "simt":
            # octet o = lane // 8 owns row 4p + o of pass p; lane l8 = lane % 8 the k in
            # [32m + 4 l8, 32m + 4 l8 + 4): each access is 16 bytes, each octet 128
            o, l8 = lane // 8, lane % 8
            return [
                [_load_words(lo0 + ((sh * P + 4 * p + o) * N + 32 * m + 4 * l8) * 4, 4, True,
                             pin)
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
                if "state" in cfg.ablate:  # timing only: no read-copy traffic at all
                    # one multiply a word, each by its own odd constant and the head's row,
                    # so that no decode is shared between words or heads
                    salt = Uint32(lane + 1) + Uint32(Int32(sh)) * Uint32(0x10001)
                    word = [salt * Uint32(0x9E3779B1 + 0x2000 * (10 * (q * 8 + c) + i))
                            for i in range(10)]
                    a1, a2 = word[:4], word[4:8]
                    sc = (word[8] & Uint32(0x3F3F), word[9] & Uint32(0x3F3F))
                    chunks.append((a1, a2, sc if fmt == "nvfp4" else None))
                    continue
                a1 = _load_words(lo0 + (sh * P + r1) * row_bytes + 64 * c + 16 * t, 4, True,
                                 pin)
                a2 = _load_words(lo0 + (sh * P + r1 + 8) * row_bytes + 64 * c + 16 * t, 4,
                                 True, pin)
                sc = None
                if fmt == "nvfp4" and "scales" in cfg.ablate:  # timing only
                    sc = (a1[0] & Uint32(0x3F3F), a2[0] & Uint32(0x3F3F))
                elif fmt == "nvfp4":
                    sc_row = N // 16
                    sc = (_ld_u16(lo1 + (sh * P + r1) * sc_row + 8 * c + 2 * t, pin),
                          _ld_u16(lo1 + (sh * P + r1 + 8) * sc_row + 8 * c + 2 * t, pin))
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
        if "decode" in cfg.ablate:  # timing only: every loaded word folded, nothing decoded
            for q in range(P // 16):
                fold = Uint32(0)
                for a1, a2, sc in state[q]:
                    for w in a1 + a2 + (list(sc) if sc is not None else []):
                        fold = fold ^ w
                rows += [(16 * q + g, bits_f32(fold & Uint32(0x3FFFFFFF))),
                         (16 * q + g + 8, bits_f32(fold & Uint32(0x3E000000)))]
            return rows, True
        if fmt == "nvfp4":
            return self._nvfp4_term(ck, state, g, t), True
        for q in range(P // 16):
            r1 = 16 * q + g
            acc = [Float32(0.0)] * 4
            for c, (a1, a2, _) in enumerate(state[q]):
                if fmt == "fp8_e4m3":
                    for j in range(4):
                        a = [
                            _e4m3x2_to_f16x2(a1[j]),
                            _e4m3x2_to_f16x2(a2[j]),
                            _e4m3x2_to_f16x2(a1[j], 1),
                            _e4m3x2_to_f16x2(a2[j], 1),
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
        shared memory (the epilogue adds the quad's four). No f16 multiply per element:
        3.9 -> 3.4 SASS instructions per element (`python -m cute_kernels.instruction_count`)."""
        P = self.cfg.headdim
        rows = []
        for q in range(P // 16):
            part = [Float32(0.0), Float32(0.0)]  # rows g, g + 8 of the stripe
            for c, (a1, a2, sc_raw) in enumerate(state[q]):
                acc = [[Float32(0.0)] * 4, [Float32(0.0)] * 4]  # blocks 2t, 2t + 1
                for i in range(4):  # word i: elements 8i..8i+7, block 2t + i // 2
                    ev1, od1 = _nvfp4_as_e4m3(a1[i])
                    ev2, od2 = _nvfp4_as_e4m3(a2[i])
                    for half in range(2):  # mma j = 2i + half (see _kappa)
                        a = [
                            _e4m3x2_to_f16x2(ev1, half),
                            _e4m3x2_to_f16x2(ev2, half),
                            _e4m3x2_to_f16x2(od1, half),
                            _e4m3x2_to_f16x2(od2, half),
                        ]
                        acc[i // 2] = mma_m16n8k16(a, ck[c * 8 + 2 * i + half], acc[i // 2])
                for r, sv in enumerate(sc_raw):  # scales of blocks 2t, 2t + 1, rows g, g + 8
                    s_even, s_odd = _f16x2_to_f32x2(_e4m3x2_to_f16x2(sv))  # exact
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
        if cfg.persistent:  # its launch also takes the grid (CTAs)
            from cute_kernels.replay_output_persistent import PersistentReplayOutput
            return cute.compile(PersistentReplayOutput(cfg), *ptrs, Int32(1), Int32(1),
                                _compile.fake_stream(),
                                options=_compile.compile_options(keep_ptx))
        return cute.compile(
            ReplayOutput(cfg),
            *ptrs,
            Int32(1),
            _compile.fake_stream(),
            options=_compile.compile_options(keep_ptx),
        )

    return _compile.compile_cached(("replay_output", cfg, keep_ptx), build)


def _fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _check(name, t, dtype, shape, device=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    if isinstance(dtype, tuple):
        if t.dtype not in dtype:
            _fail(name, f"dtype in {list(dtype)}", t.dtype)
    elif t.dtype != dtype:
        _fail(name, f"dtype {dtype}", t.dtype)
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"shape {list(shape)}", list(t.shape))
    if not t.is_contiguous():
        _fail(name, "a contiguous tensor", f"strides {t.stride()}")
    if device is not None and t.device != device:
        _fail(name, f"device {device}", t.device)
    if t.data_ptr() % _compile.ALIGN:
        _fail(name, f"a {_compile.ALIGN}-byte aligned data pointer", hex(t.data_ptr()))


# the storage dtype of a one-tensor read copy's values
_RAW_DTYPES = {"fp8_e4m3": torch.uint8, "fp16": torch.float16, "fp32": torch.float32}


def _lo_tensors(lo, lo_format, S, H, P, N, device):
    """The read copy's tensors, as replay_flush.normalise_lo accepts them: nvfp4 a dict of
    codes, scales and global_scale (or global); an element format a dict with 'values' or
    'codes' (raw bits of the same width are viewed as the storage dtype), or a bare tensor."""
    if isinstance(lo, torch.Tensor) and lo_format != "nvfp4":
        lo = {"values": lo}
    if not isinstance(lo, dict):
        _fail("lo", "a dict of packed tensors (or a tensor for an element format)",
              type(lo).__name__)
    if lo_format == "nvfp4":
        g_key = "global" if "global" in lo else "global_scale"
        if set(lo) != {"codes", "scales", g_key}:  # (as normalise_lo: no key left unread)
            _fail("lo", "keys codes, scales, global (or global_scale)", sorted(lo))
        _check("lo['codes']", lo["codes"], torch.uint8, (S, H, P, N // 2), device)
        _check("lo['scales']", lo["scales"], torch.uint8, (S, H, P, N // 16), device)
        _check(f"lo[{g_key!r}]", lo[g_key], torch.float32, (S, H), device)
        return lo["codes"], lo["scales"], lo[g_key]
    key = "values" if "values" in lo else "codes"
    if set(lo) != {key}:
        _fail("lo", "key 'values' (or 'codes')", sorted(lo))
    t = lo[key]
    raw = _RAW_DTYPES[lo_format]
    if (isinstance(t, torch.Tensor) and t.dtype != raw and not t.dtype.is_floating_point
            and t.element_size() == raw.itemsize):
        t = t.view(raw)  # lowprec.quantize.pack stores raw bits as unsigned integers
    _check(f"lo[{key!r}]", t, raw, (S, H, P, N), device)
    return t, None, None


def replay_output(
    lo,
    ring_x,
    ring_dt,
    ring_B,
    cursors,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    out=None,
    *,
    window=16,
    lo_format="nvfp4",
    warps=None,
    prefetch=None,
    upfront=None,
    head_splits=None,
    min_ctas_per_sm=None,
    stage=None,
    l2_prefetch=None,
    ys_layout=None,
    ablate=(),
    l2_prefetch_small=None,
    early_loads=None,
    heads_per_pass=None,
    eager_loads=None,
    pin_state_loads=None,
    weights_at=None,
    ring_stage=None,
    bulk_stages=None,
    smem_carveout=None,
    pdl=None,
    persistent=None,
    record_group=None,
    late_dots=None,
    _options_only=False,
    _config_for_sms=None,
):
    """One non-flush decode step for every slot whose ``cursors[s] + 1 < window``; returns
    ``out`` [S, H, P] (x's dtype; rows of flush slots are not written).

    Shapes: ``ring_x [S, H, Lc, P]``, ``ring_dt fp32 [S, H, Lc]``, ``ring_B [S, G, Lc, N]``,
    ``cursors int32 [S]``, ``x, z [S, H, P]``, ``dt [S, H]``, ``A, D, dt_bias fp32 [H]``,
    ``B, C [S, G, N]``; ``lo`` as in the module doc. Launches on torch's current stream and
    does not synchronise (graph-capturable); cursor values must lie in [0, window - 1].
    ``warps`` (dividing nheads / ngroups), ``prefetch`` and ``upfront`` override the tuning
    defaults (`ReplayOutputConfig`); ``head_splits`` (with ``head_splits * warps`` dividing
    nheads / ngroups) spreads a group's heads over that many CTAs (default: by batch size,
    `default_head_splits`); ``min_ctas_per_sm`` caps registers and ``stage`` ("registers", or
    "smem" or "bulk" for nvfp4; default by grid, `default_stage`: "bulk" with the eager loads
    where measured faster) picks how the read copy is loaded. ``l2_prefetch`` (heads ahead,
    0 off), ``ys_layout`` ("rows" or "quads"), ``l2_prefetch_small``, ``early_loads`` (default
    on), ``heads_per_pass`` (1 or 2), ``eager_loads``, ``pin_state_loads``, ``weights_at``,
    ``ring_stage``, ``bulk_stages``, ``smem_carveout``, ``pdl``, ``record_group`` and
    ``late_dots`` are the tuning knobs of `ReplayOutputConfig`, each measured there (None:
    ``ring_stage`` by `default_ring_stage`, ``eager_loads`` by `default_eager_loads`,
    ``record_group`` 0, ``late_dots`` on with the default bulk stage only); ``ablate`` leaves
    stages out for timing (wrong outputs; `ReplayOutputConfig.ablate`). With ``pdl=True`` the
    step may start before the kernel launched just before it ends and reads the read copy
    early, so that kernel must not write the read copy of a slot taking a non-flush step
    (`ReplayOutputConfig.pdl`).
    ``persistent=True`` (nvfp4) runs the persistent, software-pipelined step
    (`cute_kernels.replay_output_persistent`) with ``warps`` heads an item (default
    PERSISTENT_WARPS) and ``bulk_stages`` (2 or 3) items a CTA; it takes none of the other
    tuning knobs (measured slower than the default step: `ReplayOutputConfig.persistent`).
    """
    if lo_format not in LO_FORMATS:
        _fail("lo_format", f"one of {list(LO_FORMATS)}", repr(lo_format))
    if not isinstance(dt_softplus, bool):  # as replay_flush and state_update
        _fail("dt_softplus", "a bool", repr(dt_softplus))
    if stage is not None and (stage not in STAGES or (stage != "registers"
                                                      and lo_format != "nvfp4")):
        _fail("stage", f"None or one of {list(STAGES)} ('smem' and 'bulk' for nvfp4 only)",
              repr(stage))
    if bulk_stages is not None and (isinstance(bulk_stages, bool) or bulk_stages not in (2, 3, 4)
                                    or (stage != "bulk" and not persistent)):
        _fail("bulk_stages", "None, or 2, 3 or 4 with stage 'bulk' (2 or 3 with persistent)",
              bulk_stages)
    if smem_carveout is not None and (isinstance(smem_carveout, bool)
                                      or not isinstance(smem_carveout, int)
                                      or not -1 <= smem_carveout <= 100):
        _fail("smem_carveout", "None, -1 (the driver's choice) or a percent in [0, 100]",
              smem_carveout)
    ablate = tuple(sorted(ablate)) if isinstance(ablate, (tuple, list, set)) else ablate
    if not isinstance(ablate, tuple) or not set(ablate) <= set(ABLATIONS) or (
        ablate and lo_format == "fp32") or (
        set(ablate) - {"prologue", "cursor"} and stage not in (None, "registers")
    ) or ("prologue" in ablate and early_loads is False):
        _fail("ablate", f"a subset of {list(ABLATIONS)} (tensor-core formats; stage "
              "'registers' but for 'prologue' and 'cursor'; 'prologue' with early_loads; "
              "timing only)", ablate)
    if eager_loads is not None and not isinstance(eager_loads, bool) or eager_loads and (
        early_loads is False or stage not in (None, "registers", "bulk") or l2_prefetch
    ):
        _fail("eager_loads", "None or a bool (True: with early_loads, stage 'registers' or "
              "'bulk', no l2_prefetch)", eager_loads)
    if pin_state_loads is not None and not isinstance(pin_state_loads, bool):
        _fail("pin_state_loads", "None or a bool", pin_state_loads)
    # on/off knobs read with bool(): a string such as "false" would turn them on
    for name, value in (("prefetch", prefetch), ("upfront", upfront),
                        ("early_loads", early_loads), ("l2_prefetch_small", l2_prefetch_small)):
        if not (value is None or isinstance(value, bool)
                or isinstance(value, int) and value in (0, 1)):
            _fail(name, "None, a bool, 0 or 1", repr(value))
    if pdl is not None and not isinstance(pdl, bool) or pdl and (
            stage not in (None, "registers") or eager_loads or heads_per_pass not in (None, 1)):
        _fail("pdl", "None or a bool (True: stage 'registers', no eager_loads, one head a "
              "pass)", pdl)
    if weights_at is not None and weights_at not in WEIGHTS_AT:
        _fail("weights_at", f"None or one of {list(WEIGHTS_AT)}", repr(weights_at))
    # ReplayOutputConfig.ring_stage_allowed on the arguments, before any tensor is used
    if ring_stage is not None and (ring_stage not in RING_STAGES or ring_stage == "smem" and (
            stage not in (None, "registers", "bulk") or heads_per_pass not in (None, 1)
            or "ring" in ablate or not isinstance(window, int) or window < 3)):
        _fail("ring_stage", f"None or one of {list(RING_STAGES)} ('smem': with the registers or "
              "bulk stage, one head a pass, no ring ablation, window >= 3)",
              repr(ring_stage))
    if late_dots is not None and not isinstance(late_dots, bool) or late_dots and (
            early_loads is False or weights_at == "before_decode"
            or (lo_format != "nvfp4" and weights_at is None) or persistent):
        _fail("late_dots", "None or a bool (True: with early_loads and the decay weights "
              "beside the first decode, weights_at 'with_decode', nvfp4's default)", late_dots)
    hp = 1 if heads_per_pass is None else heads_per_pass
    if isinstance(hp, bool) or hp not in (1, 2) or (
        hp == 2 and (stage not in (None, "registers") or prefetch or l2_prefetch)
    ):
        _fail("heads_per_pass", "None, 1 or 2 (2: stage 'registers', no prefetch or "
              "l2_prefetch)", heads_per_pass)
    if persistent is not None and not isinstance(persistent, bool) or persistent and (
            lo_format != "nvfp4" or stage not in (None, "bulk") or prefetch or upfront is not None
            or head_splits not in (None, 1) or min_ctas_per_sm is not None or l2_prefetch
            or ys_layout not in (None, "rows") or ablate or l2_prefetch_small or early_loads
            is False or heads_per_pass not in (None, 1) or eager_loads or pin_state_loads
            or weights_at is not None or ring_stage not in (None, "smem")
            or bulk_stages not in (None, 2, 3) or smem_carveout is not None or pdl
            or record_group is not None or late_dots):
        _fail("persistent", "None or a bool (True: nvfp4, and none of the other tuning knobs "
              "but warps and bulk_stages 2 or 3)", persistent)
    if record_group is not None and (isinstance(record_group, bool)
                                     or not isinstance(record_group, int) or record_group < 0):
        _fail("record_group", "None or an integer >= 0 (0: every record)", record_group)
    k = 0 if l2_prefetch is None else l2_prefetch
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 4:
        _fail("l2_prefetch", "None or an integer in [0, 4] (heads ahead)", l2_prefetch)
    if ys_layout is not None and ys_layout not in YS_LAYOUTS:
        _fail("ys_layout", f"None or one of {list(YS_LAYOUTS)}", repr(ys_layout))
    m = min_ctas_per_sm
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 32):
        _fail("min_ctas_per_sm", "None or an integer in [0, 32]", m)
    for name, value in (("warps", warps), ("head_splits", head_splits)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # (dividing a group's heads: at the call)
            _fail(name, "None or a positive integer", value)
    if _options_only:  # check_options: the checks above, no tensor looked at
        return ablate
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        _fail("x", "a tensor [S, H, P]", list(x.shape) if isinstance(x, torch.Tensor) else x)
    if x.dtype not in ACT_DTYPES:
        _fail("x", f"dtype in {list(ACT_DTYPES)}", x.dtype)
    device = x.device
    S, H, P = x.shape
    if not isinstance(C, torch.Tensor) or C.dim() != 3:
        _fail("C", "a tensor [S, G, N]", list(C.shape) if isinstance(C, torch.Tensor) else C)
    G, N = C.shape[1], C.shape[2]
    if G < 1 or H % G:
        _fail("C", f"ngroups dividing nheads={H}", G)
    if not isinstance(ring_x, torch.Tensor) or ring_x.dim() != 4:
        _fail("ring_x", "a tensor [S, H, Lc, P]", getattr(ring_x, "shape", ring_x))
    Lc = ring_x.shape[2]
    if isinstance(window, bool) or not isinstance(window, int) or not 2 <= window <= min(Lc, 32):
        _fail("window", f"an integer in [2, min(ring capacity {Lc}, 32)]", window)
    if P % 16:
        _fail("x", "headdim (last dim) a multiple of 16", P)
    if N % _DSTATE_MULTIPLE[lo_format]:
        _fail("C", f"dstate a multiple of {_DSTATE_MULTIPLE[lo_format]} for {lo_format}", N)
    act = x.dtype
    _check("x", x, act, (S, H, P), device)
    _check("C", C, act, (S, G, N), device)
    _check("B", B, act, (S, G, N), device)
    _check("dt", dt, tuple(ACT_DTYPES), (S, H), device)
    _check("A", A, torch.float32, (H,), device)
    _check("ring_x", ring_x, act, (S, H, Lc, P), device)
    _check("ring_dt", ring_dt, torch.float32, (S, H, Lc), device)
    _check("ring_B", ring_B, act, (S, G, Lc, N), device)
    _check("cursors", cursors, torch.int32, (S,), device)
    if D is not None:
        _check("D", D, torch.float32, (H,), device)
    if z is not None:
        _check("z", z, act, (S, H, P), device)
    if dt_bias is not None:
        _check("dt_bias", dt_bias, torch.float32, (H,), device)
    if out is None:
        out = torch.empty_like(x)
    _check("out", out, act, (S, H, P), device)
    lo0, lo1, lo2 = _lo_tensors(lo, lo_format, S, H, P, N, device)
    _compile.check_apart("out", out, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                         ring_x=ring_x, ring_dt=ring_dt, ring_B=ring_B, cursors=cursors,
                         lo=lo0, lo_scales=lo1, lo_global_scale=lo2)
    if warps is None:
        warps = PERSISTENT_WARPS if persistent else default_warps(H // G, lo_format)
        if persistent and (H // G) % warps:
            warps = default_warps(H // G, lo_format)
    if isinstance(warps, bool) or not isinstance(warps, int) or warps < 1 or (H // G) % warps:
        _fail("warps", f"a divisor of nheads / ngroups = {H // G}", warps)
    if persistent:
        cfg = _persistent_config(x, dt, C, ring_x, D, z, dt_bias, dt_softplus, window, warps,
                                 bulk_stages or 2)
        if _config_for_sms is not None:
            return cfg
        _compile.require_cuda("x", x)
        return _persistent_step(cfg, lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A,
                                B, C, D, z, dt_bias, out)

    # check_options(shape=...): the defaults below for that many SMs, on meta tensors; CPU
    # tensors: an H200's, so that the checks below run (and name their argument) before the
    # device check, which comes last
    if _config_for_sms is not None:
        sms = _config_for_sms
    else:
        sms = _sm_count(device) if x.is_cuda else _compile.H200_SM_COUNT
    if head_splits is None:
        head_splits = default_head_splits(S, G, H // G, warps, sms, lo_format)
    cfg = ReplayOutputConfig(
        lo_format=lo_format,
        act=ACT_DTYPES[act],
        dt_dtype=ACT_DTYPES[dt.dtype],
        nheads=H,
        headdim=P,
        dstate=N,
        ngroups=G,
        ring_capacity=Lc,
        window=window,
        has_D=D is not None,
        has_z=z is not None,
        has_dt_bias=dt_bias is not None,
        dt_softplus=bool(dt_softplus),
        warps=warps,
        prefetch=False if prefetch is None else bool(prefetch),
        upfront=None if upfront is None else bool(upfront),
        head_splits=head_splits,
        min_ctas_per_sm=min_ctas_per_sm,
        stage=STAGES[0] if stage is None else stage,
        l2_prefetch=0 if l2_prefetch is None else l2_prefetch,
        l2_prefetch_small=bool(l2_prefetch_small),
        ys_layout=YS_LAYOUTS[0] if ys_layout is None else ys_layout,
        ablate=ablate,
        early_loads=True if early_loads is None else bool(early_loads),
        heads_per_pass=hp,
    )
    cfg = dataclasses.replace(cfg, eager_loads=bool(eager_loads),
                              pin_state_loads=bool(pin_state_loads),
                              weights_at=weights_at, ring_stage=ring_stage or RING_STAGES[0],
                              bulk_stages=bulk_stages or 2,
                              smem_carveout=-1 if smem_carveout is None else smem_carveout,
                              pdl=bool(pdl),
                              record_group=record_group or 0,
                              late_dots=bool(late_dots))
    if cfg.stage == "smem" and cfg.warps * 2 * cfg.read_copy_bytes > 40 * 1024:
        _fail("stage", f"'registers' for this shape and warps ({cfg.warps}): two shared-memory "
              "stages per warp would pass 40 KiB", repr(stage))
    bulk_bytes = cfg.warps * cfg.bulk_stages * cfg.bulk_stride(False)
    if cfg.stage == "bulk" and bulk_bytes > BULK_STAGE_LIMIT:
        _fail("stage", f"'registers' for this shape and warps ({cfg.warps}): {cfg.bulk_stages} "
              f"bulk stages per warp would pass {BULK_STAGE_LIMIT // 1024} KiB", repr(stage))
    if cfg.ring_stage == "smem" and not cfg.ring_stage_fits:
        where, limit = (("the bulk stages", BULK_STAGE_LIMIT) if cfg.stage == "bulk"
                        else ("two ring stages", RING_STAGE_LIMIT))
        _fail("ring_stage", f"'registers' for this shape, window and warps ({cfg.warps}): "
              f"{where} per warp would pass {limit // 1024} KiB", repr(ring_stage))
    hs = cfg.head_splits
    if isinstance(hs, bool) or not isinstance(hs, int) or hs < 1 or (H // G) % (hs * cfg.warps):
        _fail("head_splits", f"a positive integer with head_splits * warps ({cfg.warps}) dividing "
              f"nheads / ngroups = {H // G}", head_splits)
    if (stage is None and eager_loads is not False and ring_stage in (None, "smem")
            and default_stage(cfg, S, sms) == "bulk"):
        # and late_dots, measured faster wherever this default applies (ReplayOutputConfig)
        late = cfg.weights_placement == "with_decode" if late_dots is None else cfg.late_dots
        cfg = dataclasses.replace(cfg, stage="bulk", ring_stage="smem", eager_loads=True,
                                  late_dots=late)
    if ring_stage is None:  # (before the eager loads' default, which depends on it)
        cfg = dataclasses.replace(cfg, ring_stage=default_ring_stage(cfg))
    if eager_loads is None and cfg.stage != "bulk":  # (the default bulk stage set them on)
        cfg = dataclasses.replace(cfg, eager_loads=default_eager_loads(cfg, S, sms))
    if _config_for_sms is not None:
        return cfg
    _compile.require_cuda("x", x)
    if S == 0:
        return out
    kernel = compile_replay_output(cfg)
    ptrs = _kernel_pointers(cfg, lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A, B,
                            C, D, z, dt_bias, out)
    kernel(*ptrs, Int32(S), _compile.current_stream())
    return out


H200_SM_COUNT = _compile.H200_SM_COUNT  # check_options' SMs for the grid's defaults


def check_options(*, lo_format="nvfp4", window=16, shape=None, sm_count=H200_SM_COUNT,
                  **knobs):
    """The checks of `replay_output`'s format and tuning knobs, made by replay_output itself
    without a GPU: raises its ValueError naming the first bad argument (or an unknown knob).

    Without ``shape`` only the checks that need no tensor run, and ``ablate`` comes back as a
    sorted tuple. With ``shape = (batch, nheads, headdim, dstate, ngroups)`` (bf16
    activations, a ring of ``window`` records, D and dt_bias given) replay_output also runs
    the checks that need the shape (``warps`` and ``head_splits`` dividing a group's heads,
    the stages' shared memory) on meta tensors, and returns the `ReplayOutputConfig` it would
    build, with the defaults that depend on the grid taken for ``sm_count`` SMs (an H200's by
    default). `experiments.kernel_bench` runs this before it asks for the GPU."""
    params = inspect.signature(replay_output).parameters.values()
    allowed = {p.name for p in params if p.kind is p.KEYWORD_ONLY
               and not p.name.startswith("_")} - {"window", "lo_format"}
    unknown = sorted(set(knobs) - allowed)
    if unknown:
        _fail("knobs", f"names from {sorted(allowed)}", unknown)
    tensors = [None] * sum(p.default is p.empty for p in params)  # lo .. C, never looked at
    ablate = replay_output(*tensors, lo_format=lo_format, window=window, _options_only=True,
                           **knobs)
    if shape is None:
        return ablate
    if (not isinstance(shape, (tuple, list)) or len(shape) != 5
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
        _fail("shape", "(batch, nheads, headdim, dstate, ngroups), positive integers", shape)
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        _fail("window", "an integer >= 2", window)
    S, H, P, N, G = shape

    def meta(*dims, dtype=torch.bfloat16):
        return torch.empty(dims, dtype=dtype, device="meta")

    f32 = torch.float32
    if lo_format == "nvfp4":
        lo = dict(codes=meta(S, H, P, N // 2, dtype=torch.uint8),
                  scales=meta(S, H, P, N // 16, dtype=torch.uint8),
                  global_scale=meta(S, H, dtype=f32))
    else:
        lo = dict(values=meta(S, H, P, N, dtype=_RAW_DTYPES[lo_format]))
    return replay_output(
        lo, meta(S, H, window, P), meta(S, H, window, dtype=f32), meta(S, G, window, N),
        meta(S, dtype=torch.int32), meta(S, H, P), meta(S, H, dtype=f32), meta(H, dtype=f32),
        meta(S, G, N), meta(S, G, N), meta(H, dtype=f32), None, meta(H, dtype=f32),
        window=window, lo_format=lo_format, _config_for_sms=sm_count, **knobs)


def _kernel_pointers(cfg, lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A, B, C, D,
                     z, dt_bias, out) -> list:
    """The kernels' pointer arguments in their order, a tensor standing in (never read) for
    each optional one left out."""
    tensors = [
        lo0,
        lo1 if lo1 is not None else lo0,
        lo2 if lo2 is not None else A,
        ring_x, ring_dt, ring_B, cursors, x, dt, A, B, C,
        D if D is not None else A,
        z if z is not None else x,
        dt_bias if dt_bias is not None else A,
        out,
    ]
    return [_compile.gmem_ptr(t, ty)
            for t, ty in zip(tensors, _pointer_types(cfg), strict=True)]


PERSISTENT_WARPS = 4  # heads an item of the persistent step (one a warp)


def _persistent_config(x, dt, C, ring_x, D, z, dt_bias, dt_softplus, window, warps, stages):
    """replay_output(persistent=True)'s config, or a ValueError saying why the shape cannot
    run."""
    from cute_kernels import replay_output_persistent as rp

    S, H, P = x.shape
    G, N = C.shape[1], C.shape[2]
    cfg = ReplayOutputConfig(
        lo_format="nvfp4", act=ACT_DTYPES[x.dtype], dt_dtype=ACT_DTYPES[dt.dtype], nheads=H,
        headdim=P, dstate=N, ngroups=G, ring_capacity=ring_x.shape[2], window=window,
        has_D=D is not None, has_z=z is not None, has_dt_bias=dt_bias is not None,
        dt_softplus=bool(dt_softplus), warps=warps, stage="bulk", ring_stage="smem",
        bulk_stages=stages, persistent=True,
    )
    why = rp.persistent_refusal(cfg)
    if why is not None:
        _fail("persistent", f"a shape it can run: it needs {why}", "this shape")
    return cfg


def _persistent_step(cfg, lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A, B, C, D,
                     z, dt_bias, out):
    """replay_output(persistent=True) after its argument checks: the grid (SMs times
    resident CTAs, at most an item a CTA) and the launch."""
    from cute_kernels import replay_output_persistent as rp

    S, H = x.shape[:2]
    warps = cfg.warps
    if S == 0:
        return out
    items = S * H // warps
    ctas = min(items, _sm_count(x.device) * rp.ctas_per_sm(cfg))
    if rp.MAX_CTAS is not None:  # tests: a small grid, so that each CTA walks many items
        ctas = min(ctas, rp.MAX_CTAS)
    kernel = compile_replay_output(cfg)
    ptrs = _kernel_pointers(cfg, lo0, lo1, lo2, ring_x, ring_dt, ring_B, cursors, x, dt, A, B,
                            C, D, z, dt_bias, out)
    kernel(*ptrs, Int32(S), Int32(ctas), _compile.current_stream())
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


@cute.jit
def _ring_dots(cfg: cutlass.Constexpr, rb_words, c_vals, cursor, warp, bc_smem):
    """The prologue's B_j . C for the ring records j = warp + warps * jj < cursor (this
    warp's share) into ``bc_smem``."""
    W, L, act = cfg.warps, cfg.window, cfg.act
    for jj in cutlass.range_constexpr((L - 1 + W - 1) // W):
        j = warp + W * jj
        if j < cursor:
            bc_smem[j] = _dot_warp(_words_to_f32(rb_words[jj], act), c_vals)


@cute.jit
def _step_dot(cfg: cutlass.Constexpr, b_words, c_vals, cursor, part, bc_smem, row):
    """Warp 0: this step's record's B . C into ``bc_smem[cursor]``, and its B appended (the
    lane's words at byte address ``row``) by one CTA of the group (``part`` 0)."""
    bc_smem[cursor] = _dot_warp(_words_to_f32(b_words, cfg.act), c_vals)
    if part == 0:
        _store_words(row, b_words)


def _decay_passes(S: int, nh: int) -> int:
    """Passes of a warp's decay weights over its nh heads, ``32 // S`` heads a pass."""
    return -(-nh // (32 // S))


def _decay_pass_head(W: int, S: int, first_head, nh: int, lane, q: int):
    """(k_raw, head) of pass q (head k's records on lanes ``k S .. k S + S - 1``): the lane's
    head index in the warp (``>= nh`` on a pass's spare lanes) and the head it loads for
    (clamped to the warp's last; heads ``first_head + W k``). One indexing for
    `_warp_decay_loads` and the timing-only `_prologue_constants`; a pass at a time, so that
    each pass's loads follow its indices as before (the register-stage step's SASS moved
    when the indices all came first)."""
    k_raw = q * (32 // S) + lane // S
    return k_raw, first_head + W * cutlass.min(k_raw, nh - 1)


@cute.jit
def _warp_decay_loads(cfg: cutlass.Constexpr, S: cutlass.Constexpr, ptrs, first_head,
                      nh: cutlass.Constexpr, s64, lane):
    """The loads of `_warp_decay_weights`, per pass of a warp's heads: (lane's head is real,
    its (slot, head) row, ring dt of record j = lane % S (index clamped), this step's raw dt
    plus bias, A)."""
    _, _, _, _, ring_dt, _, dt, A, _, _, dt_bias = ptrs
    H, Lc, W = cfg.nheads, cfg.ring_capacity, cfg.warps
    j = lane % S
    passes = []
    for q in cutlass.range_constexpr(_decay_passes(S, nh)):
        k_raw, head = _decay_pass_head(W, S, first_head, nh, lane, q)
        sh = s64 * H + head
        ring = Float32(cute.arch.load((ring_dt + sh * Lc + cutlass.min(j, Lc - 1)).llvm_ptr,
                                      Float32))
        if cutlass.const_expr(cfg.dt_dtype == "bf16"):
            # nvvm's scalar load has no 16-bit float form; bf16 is the top half of an fp32,
            # so load the 16 bits and shift them into place (exact).
            bits = Uint32(cute.arch.load((dt + sh).llvm_ptr, cutlass.Uint16))
            raw = bits_f32(bits << Uint32(16))
        elif cutlass.const_expr(cfg.dt_dtype == "fp16"):
            bits16 = cute.arch.load((dt + sh).llvm_ptr, cutlass.Uint16)
            raw = Float32(bits16.bitcast(cutlass.Float16))
        else:
            raw = Float32(cute.arch.load((dt + sh).llvm_ptr, _ACT_CUTE[cfg.dt_dtype]))
        if cutlass.const_expr(cfg.has_dt_bias):
            raw = raw + Float32(cute.arch.load((dt_bias + head).llvm_ptr, Float32))
        a_h = Float32(cute.arch.load((A + head).llvm_ptr, Float32))
        passes.append((k_raw < nh, sh, ring, raw, a_h))
    return passes


@cute.jit
def _warp_decay_weights(cfg: cutlass.Constexpr, S: cutlass.Constexpr, ptrs, passes, cursor,
                        lane):
    """The decay weights of all of a warp's heads from `_warp_decay_loads` (heads
    ``first_head + warps k``), ``32 // S`` heads a pass, record j of the pass's head k on
    lane ``k S + j`` (S: the window rounded up to a power of two): per pass ``(valid, w,
    ck)`` with ``w = g_{j+1:h} dt_j`` for j < h (0 after) and ``ck = g_{0:h}``; this step's
    processed dt is appended to the ring here (lane j = cursor).

    One head a warp at a time, these chains (the dt loads, softplus, the suffix-sum
    shuffles, two exps) took about 100 of a head's 745 SASS instructions a lane; a pass now
    does 2 heads (window 16) or 4 (window 8). The suffix sums run over the segment, whose
    lanes past the cursor hold zeros as the whole warp's did, so every value is the
    one-head-a-warp form's, bit for bit."""
    ring_dt = ptrs[4]
    Lc = cfg.ring_capacity
    j = lane % S
    h = cursor + 1
    out = []
    for q in cutlass.range_constexpr(len(passes)):
        valid, sh, ring, raw, a_h = passes[q]
        dt_cur = raw
        if cutlass.const_expr(cfg.dt_softplus):
            dt_cur = softplus(dt_cur)
        dt_j = _sel(j < cursor, ring, Float32(0.0))
        dt_j = _sel(j == cursor, dt_cur, dt_j)
        if valid:
            if j == cursor:  # this step's dt, appended
                cute.arch.store((ring_dt + sh * Lc + cursor).llvm_ptr, dt_cur)
        incl = dt_j  # suffix sums over the segment: incl[j] = sum_{l >= j} dt_l
        for i in cutlass.range_constexpr(S.bit_length() - 1):
            nxt = cute.arch.shuffle_sync_down(incl, 1 << i)
            incl = _sel(j + (1 << i) < S, incl + nxt, incl)
        excl = _sel(j < S - 1, cute.arch.shuffle_sync_down(incl, 1), Float32(0.0))
        total = _shfl(incl, lane - j)
        decay = cute.math.exp(cutlass.min(a_h * excl, Float32(0.0)))
        w = _sel(j < h, decay * dt_j, Float32(0.0))
        out.append((valid, w, cute.math.exp(a_h * total)))
    return out


@cute.jit
def _store_warp_coefs(S: cutlass.Constexpr, weights, nh: cutlass.Constexpr, warp, lane, cursor,
                      bc_smem, coef_smem, ck_smem):
    """After the prologue's barrier (B . C in ``bc_smem`` for records j <= cursor; the
    entries past it were never written): each of a warp's heads' ring coefficients ``w_j
    (B_j . C)`` (0 past the cursor) and its checkpoint factor into the warp's rows (row-major:
    a head's coefficients contiguous)."""
    per = 32 // S
    j = lane % S
    for q in cutlass.range_constexpr(len(weights)):
        valid, w, ck = weights[q]
        k = cutlass.min(q * per + lane // S, nh - 1)
        if valid:
            coef_smem[warp, k, j] = _sel(j <= cursor, w * bc_smem[j], Float32(0.0))
            if j == 0:
                ck_smem[warp, k] = ck
