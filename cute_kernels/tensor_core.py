"""Warp-level tensor-core and shared-memory helpers shared by the kernels (inline PTX, sm_80+).

    mma_m16n8k16        D = A B + C, mma.sync m16n8k16 row.col with f16 or bf16 operands and
                        fp32 accumulators: A four registers, B two, C and D four fp32
    ldmatrix_x4_trans   four 8 x 8 tiles of 16-bit values from shared memory, transposed: lane
                        l gives the address of row l % 8 of tile l // 8; lane (g, t) = (l // 4,
                        l % 4) receives rows 2t, 2t + 1 of column g of each tile, which is the
                        B-operand fragment of an mma when the tile is stored k-major ([k][n])
    pack_16x2           two fp32 values rounded to nearest f16 or bf16, packed (first in the
                        low half): one A or B register
    split_bf16x3        an fp32 pair as three bf16 pairs whose sum is the pair exactly
                        (for |v| >= 2^-100; below, within 2^-133)
    st_shared_v2_f32    two fp32 values to a shared-memory byte address (8-byte aligned)

The inline-PTX plumbing (operands, multi-output statements) is cute_kernels/ptx.py's.

Fragment layout of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane (g, t):
A registers hold A[g][2t..2t+1], A[g+8][2t..2t+1], A[g][2t+8..2t+9], A[g+8][2t+8..2t+9];
B registers B[2t..2t+1][g], B[2t+8..2t+9][g]; C/D D[g][2t], D[g][2t+1], D[g+8][2t],
D[g+8][2t+1]. Products of f16/bf16 operands are exact in fp32; the sums are the tensor cores'
(aligned and truncated, within a few fp32 ulps of the largest term).
"""

from __future__ import annotations

from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_kernels.numerics import bits_f32
from cute_kernels.ptx import inline_ptx, reg, unpack_struct

__all__ = ["mma_m16n8k16", "ldmatrix_x4_trans", "pack_16x2", "split_bf16x3", "st_shared_v2_f32"]


@dsl_user_op
def mma_m16n8k16(a: list, b: list, c: list, kind: str = "f16", *, loc=None, ip=None) -> list:
    """mma.sync m16n8k16, ``kind`` (f16 or bf16) A (4 regs) and B (2 regs), fp32 C/D (4)."""
    st = llvm.StructType.get_literal([T.f32()] * 4)
    args = [reg(v, loc, ip) for v in a + b] + [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    r = inline_ptx(
        st,
        args,
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        loc=loc,
        ip=ip,
    )
    return unpack_struct(r, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def ldmatrix_x4_trans(smem_addr, *, loc=None, ip=None) -> list:
    """Four transposed 8 x 8 tiles of 16-bit values (one register each, tile i in register
    i); ``smem_addr`` is this lane's row address (16-byte aligned). Volatile: the tiles are
    rewritten between uses, so the reads must stay behind the barriers."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = inline_ptx(st, [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                   "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0,$1,$2,$3}, [$4];",
                   "=r,=r,=r,=r,r", side_effects=True, loc=loc, ip=ip)
    return unpack_struct(r, 4, T.i32(), Uint32, loc, ip)


@dsl_user_op
def pack_16x2(lo, hi, kind: str = "f16", *, loc=None, ip=None) -> Uint32:
    """RN to ``kind`` (f16 or bf16) of two fp32 values, packed (``lo`` -> bits 0-15)."""
    args = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    r = inline_ptx(T.i32(), args, f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip)
    return Uint32(r)


def split_bf16x3(v0, v1) -> list:
    """Three bf16x2 registers (hi, mid, lo) with hi + mid + lo = (v0, v1) exactly, elementwise:
    each part is the RN bf16 of what the previous parts left, and an fp32 significand (24
    bits) minus two RN bf16 roundings (8 bits each, the remainder exact in fp32) leaves at
    most 8 significant bits, which bf16 holds (bf16 has fp32's exponent range; only where a
    part falls below 2^-126, |v| < 2^-100, can bf16 subnormals lose bits, less than 2^-133)."""
    parts = []
    r0, r1 = v0, v1
    for _ in range(3):
        p = pack_16x2(r0, r1, "bf16")
        parts.append(p)
        r0 = r0 - bits_f32(p << Uint32(16))
        r1 = r1 - bits_f32(p & Uint32(0xFFFF0000))
    return parts


@dsl_user_op
def st_shared_v2_f32(smem_addr, a, b, *, loc=None, ip=None) -> None:
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip),
                      Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
               "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f", side_effects=True, loc=loc, ip=ip)
