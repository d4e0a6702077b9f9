"""Inline PTX helpers shared by the CuTe DSL kernels (sm_90a).

Every instruction the kernels issue through inline assembly is here, each a DSL user op that
traces into the calling kernel:

    inline_ptx                  one statement; pure register operations are side-effect free
                                (LLVM may schedule them), memory operations are not
    reg, unpack_struct          an operand, and the results of a multi-output statement
    ld_words, load_words        1, 2 or 4 global 32-bit words (``state``: the read-only path,
                                no L1 allocation: the read copy is read once); load_words takes
                                any count with the widest accesses it allows
    ld_words_if, ld_u16         a predicated load (zeros, and no access, when false); 16 bits
    st_words, store_words       global stores of 1, 2 or 4 words
    cp_async_16_zfill, cp_async_commit, cp_async_wait
                                16-byte global -> shared copies (zero-filled past a byte count)
    mbar_init, mbar_init_fence, mbar_expect, mbar_wait, bulk_copy
                                the bulk copy engine (cp.async.bulk) and its mbarriers
    lds_v4, lds_words, lds_u16  volatile shared-memory reads (a stage is refilled between uses)
    sts_zero16_if               16 zero bytes to shared memory where a flag is set
    e4m3x2_to_f16x2, f16x2_to_f32x2
                                exact hardware conversions of packed pairs
    opaque_i32                  a value the compiler cannot see through (no induction
                                variables derived from it)
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_kernels import _compile  # noqa: F401  (sets the sm_90a target before cutlass)

__all__ = [
    "inline_ptx", "reg", "unpack_struct", "ld_words", "ld_words_if", "load_words", "ld_u16",
    "st_words", "store_words", "cp_async_16_zfill", "cp_async_commit", "cp_async_wait",
    "mbar_init", "mbar_init_fence", "mbar_expect", "mbar_expect_tx", "mbar_wait", "bulk_copy",
    "lds_v4", "lds_words", "lds_u16", "sts_zero16_if", "e4m3x2_to_f16x2", "f16x2_to_f32x2",
    "opaque_i32",
]


def inline_ptx(res, args, code, constraints, side_effects=False, loc=None, ip=None):
    """One inline PTX statement (AT&T operand numbering). Pure register operations are
    side-effect free, so LLVM may schedule them; loads and stores say otherwise."""
    return llvm.inline_asm(
        res,
        args,
        code,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def reg(v, loc=None, ip=None):
    """An inline-PTX operand: fp32 values as they are, anything else as a 32-bit word."""
    return Uint32(v).ir_value(loc=loc, ip=ip) if not isinstance(v, Float32) else v.ir_value()


def unpack_struct(res, n, ty, wrap, loc=None, ip=None):
    """The ``n`` results of a multi-output inline-PTX statement, each wrapped in ``wrap``."""
    return [wrap(llvm.extractvalue(ty, res, [i], loc=loc, ip=ip)) for i in range(n)]


def _addr(addr, loc=None, ip=None):
    return Int64(addr).ir_value(loc=loc, ip=ip)


@dsl_user_op
def ld_words(addr, n: int, state: bool = False, *, loc=None, ip=None) -> list:
    """``n`` 32-bit words (n = 1, 2 or 4) from a global byte address aligned to 4n bytes.
    State reads use the read-only path and skip L1 (each byte is read once)."""
    hint = "global.nc.L1::no_allocate" if state else "global"
    if n == 1:
        r = inline_ptx(T.i32(), [_addr(addr, loc, ip)], f"ld.{hint}.u32 $0, [$1];", "=r,l",
                       side_effects=False, loc=loc, ip=ip)
        return [Uint32(r)]
    outs = ",".join(f"${i}" for i in range(n))
    st = llvm.StructType.get_literal([T.i32()] * n)
    r = inline_ptx(
        st,
        [_addr(addr, loc, ip)],
        f"ld.{hint}.v{n}.u32 {{{outs}}}, [${n}];",
        ",".join(["=r"] * n) + ",l",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return unpack_struct(r, n, T.i32(), Uint32, loc, ip)


@dsl_user_op
def ld_words_if(addr, n: int, pred, *, loc=None, ip=None) -> list:
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
    return unpack_struct(r, n, T.i32(), Uint32, loc, ip)


def load_words(addr, n: int, state: bool = False) -> list:
    """``n`` consecutive words at byte address ``addr`` with the widest accesses the count
    allows (``addr`` aligned to 16 bytes when n is a multiple of 4, to 8 when even)."""
    width = 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)
    words = []
    for i in range(0, n, width):
        words += ld_words(addr + 4 * i, width, state)
    return words


@dsl_user_op
def ld_u16(addr, *, loc=None, ip=None) -> Uint32:
    """16 bits of read-only global memory (no L1 allocation), zero-extended."""
    r = inline_ptx(
        T.i32(),
        [_addr(addr, loc, ip)],
        "{.reg .b16 t; ld.global.nc.L1::no_allocate.u16 t, [$1]; cvt.u32.u16 $0, t;}",
        "=r,l",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return Uint32(r)


@dsl_user_op
def st_words(addr, words: list, *, loc=None, ip=None) -> None:
    n = len(words)
    args = [_addr(addr, loc, ip)] + [reg(w, loc, ip) for w in words]
    if n == 1:
        code = "st.global.u32 [$0], $1;"
    else:
        code = f"st.global.v{n}.u32 [$0], {{{','.join(f'${i + 1}' for i in range(n))}}};"
    inline_ptx(None, args, code, "l," + ",".join(["r"] * n), side_effects=True, loc=loc, ip=ip)


def store_words(addr, words: list) -> None:
    """Consecutive words to a global byte address, with the widest stores the count allows."""
    n = len(words)
    width = 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)
    for i in range(0, n, width):
        st_words(addr + 4 * i, words[i : i + width])


@dsl_user_op
def cp_async_16_zfill(smem_addr, gmem_addr, src_bytes, *, loc=None, ip=None) -> None:
    """16 bytes global -> shared, asynchronously (L2 only), of which only the first
    ``src_bytes`` (0 or 16) are read; the rest are zero-filled (no traffic when 0)."""
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), _addr(gmem_addr, loc, ip),
                      Int32(src_bytes).ir_value(loc=loc, ip=ip)],
               "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", side_effects=True,
               loc=loc, ip=ip)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    inline_ptx(None, [], "cp.async.commit_group;", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
    """Until at most ``pending`` of this thread's newest copy groups are still in flight."""
    inline_ptx(None, [], f"cp.async.wait_group {pending};", "", side_effects=True, loc=loc, ip=ip)


# The bulk copy engine: lane 0 arms a stage's mbarrier with the bytes it expects and issues
# the copies; every lane waits on the barrier's phase. No register holds the bytes in flight.


@dsl_user_op
def mbar_init(bar, *, loc=None, ip=None) -> None:
    """An mbarrier at shared byte address ``bar`` that one arrival (with its bytes) completes."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip)],
               "mbarrier.init.shared::cta.b64 [$0], 1;", "r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbar_init_fence(*, loc=None, ip=None) -> None:
    """Makes the initialised barriers visible to the bulk copy engine (the async proxy)."""
    inline_ptx(None, [], "fence.mbarrier_init.release.cluster;", "", side_effects=True,
               loc=loc, ip=ip)


@dsl_user_op
def mbar_expect(bar, nbytes, *, loc=None, ip=None) -> None:
    """Arrive on ``bar`` and tell it ``nbytes`` more are on their way: its phase completes
    when the copies that name it have written them."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
               "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r",
               side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbar_expect_tx(bar, nbytes, *, loc=None, ip=None) -> None:
    """Tell ``bar`` that ``nbytes`` more are on their way, without arriving: copies issued
    before the one arrival the phase needs (``mbar_expect``) cannot complete it early."""
    inline_ptx(None, [Int32(bar).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
               "mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$0], $1;", "r,r",
               side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_copy(smem_addr, gmem_addr, nbytes, bar, *, loc=None, ip=None) -> None:
    """``nbytes`` (a multiple of 16; nothing if 0) from a 16-byte aligned global address to
    shared memory by the bulk copy engine, completing their bytes on ``bar``."""
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), _addr(gmem_addr, loc, ip),
                      Int32(nbytes).ir_value(loc=loc, ip=ip), Int32(bar).ir_value(loc=loc, ip=ip)],
               "{.reg .pred p; setp.ne.b32 p, $2, 0; "
               "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[$0], [$1], $2, [$3];}",
               "r,l,r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbar_wait(bar, parity, *, loc=None, ip=None) -> None:
    """Until the phase of ``bar`` with this parity (a Python int, or an Int32 0 or 1 where
    the phase is only known at run time) has completed (acquire: the copied bytes are then
    visible to this thread's shared-memory reads)."""
    args = [Int32(bar).ir_value(loc=loc, ip=ip)]
    if isinstance(parity, int):
        operand, constraints = str(parity), "r"
    else:
        args.append(Int32(parity).ir_value(loc=loc, ip=ip))
        operand, constraints = "$1", "r,r"
    inline_ptx(None, args,
               "{.reg .pred p; WAIT_PHASE: "
               f"mbarrier.try_wait.parity.shared::cta.b64 p, [$0], {operand}; "
               "@!p bra WAIT_PHASE;}",
               constraints, side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def sts_zero16_if(smem_addr, flag, *, loc=None, ip=None) -> None:
    """16 zero bytes at a 16-byte aligned shared address where ``flag`` (an Int32) is not 0."""
    inline_ptx(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip),
                      Int32(flag).ir_value(loc=loc, ip=ip)],
               "{.reg .pred p; setp.ne.b32 p, $1, 0; @p st.shared.v4.u32 [$0], {0, 0, 0, 0};}",
               "r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def lds_v4(smem_addr, *, loc=None, ip=None) -> list:
    """4 32-bit words at a 16-byte aligned shared-memory byte address. Volatile: a stage's
    address repeats every other head with new contents, so these reads must neither merge
    nor move across the copy waits and warp barriers."""
    st = llvm.StructType.get_literal([T.i32()] * 4)
    r = inline_ptx(st, [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                   "ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r", side_effects=True,
                   loc=loc, ip=ip)
    return unpack_struct(r, 4, T.i32(), Uint32, loc, ip)


@dsl_user_op
def lds_words(smem_addr, n: int, *, loc=None, ip=None) -> list:
    """1 or 2 32-bit words at a shared-memory byte address (aligned to their size); volatile,
    as lds_v4 (a ring stage is refilled every other head)."""
    if n == 1:
        r = inline_ptx(T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                       "ld.shared.u32 $0, [$1];", "=r,r", side_effects=True, loc=loc, ip=ip)
        return [Uint32(r)]
    st = llvm.StructType.get_literal([T.i32()] * 2)
    r = inline_ptx(st, [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                   "ld.shared.v2.u32 {$0,$1}, [$2];", "=r,=r,r", side_effects=True,
                   loc=loc, ip=ip)
    return unpack_struct(r, 2, T.i32(), Uint32, loc, ip)


@dsl_user_op
def lds_u16(smem_addr, *, loc=None, ip=None) -> Uint32:
    """16 bits of shared memory, zero-extended; volatile, as lds_v4."""
    r = inline_ptx(T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
                   "{.reg .b16 t; ld.shared.u16 t, [$1]; cvt.u32.u16 $0, t;}", "=r,r",
                   side_effects=True, loc=loc, ip=ip)
    return Uint32(r)


@dsl_user_op
def e4m3x2_to_f16x2(x, half: int = 0, *, loc=None, ip=None) -> Uint32:
    """Two E4M3 bytes of ``x`` to f16x2, exactly: bytes 0, 1 (``half`` 0) or 2, 3 (``half``
    1); the lower byte goes to the low half."""
    r = inline_ptx(T.i32(), [reg(x, loc, ip)],
                   "{.reg .b16 l, h; mov.b32 {l, h}, $1; "
                   f"cvt.rn.f16x2.e4m3x2 $0, {'lh'[half]};}}",
                   "=r,r", loc=loc, ip=ip)
    return Uint32(r)


@dsl_user_op
def f16x2_to_f32x2(x, *, loc=None, ip=None) -> list:
    """The two f16 halves of ``x`` as fp32 (low half first), exactly."""
    st = llvm.StructType.get_literal([T.f32()] * 2)
    r = inline_ptx(st, [reg(x, loc, ip)],
                   "{.reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;}",
                   "=f,=f,r", loc=loc, ip=ip)
    return unpack_struct(r, 2, T.f32(), Float32, loc, ip)


@dsl_user_op
def opaque_i32(x, *, loc=None, ip=None) -> Int32:
    """``x`` through a register move the compiler cannot see through: addresses derived from
    it are computed where used instead of carried across a loop as induction variables (one
    register each)."""
    return Int32(inline_ptx(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;",
                            "=r,r", loc=loc, ip=ip))
