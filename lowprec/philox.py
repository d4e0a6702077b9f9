"""Counter-based random bits for stochastic rounding: Philox-4x32, word for word equal to
Triton's `tl.randint4x(seed, offset, n_rounds)`.

Philox-4x32 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC 2011) maps a 128-bit counter `(c0, c1, c2, c3)` and a 64-bit key `(k0, k1)` to four 32-bit
words in `R` rounds (`R = 10` is Philox-4x32-10, the default) of

    (c0, c1, c2, c3) <- (hi(B*c2) ^ c1 ^ k0,  lo(B*c2),  hi(A*c0) ^ c3 ^ k1,  lo(A*c0))
    (k0, k1)         <- (k0 + 0x9E3779B9, k1 + 0xBB67AE85)        (mod 2^32)

with A = 0xD2511F53, B = 0xCD9E8D57. `tl.randint(seed, offset, n_rounds)` uses key
`(seed & 0xffffffff, seed >> 32)`, counter `(offset & 0xffffffff, offset >> 32, 0, 0)` and
returns the first word; `tl.randint4x` returns all four. `randint` and `randint4x` here do
the same for every `n_rounds` in [1, 10] (`PHILOX_ROUNDS`).

Words are uint32 values held in int64 tensors (PyTorch has no full uint32 arithmetic); a
32x32-bit product is formed from 16-bit halves so that nothing overflows int64.

Which bits go to element `e` (docs/design.md, "Stochastic rounding: random bits and Philox
rounds"). SR of one element takes `k = sr_bits` random bits, k in `SR_BITS` = (8, 13, 16, 32).
A word is split into lanes of `W` bits, W = 8 for k <= 8, 16 for k <= 16, else 32, so a word
has `n = 32 / W` lanes and a counter's four words serve `E = 4 n` consecutive elements
(4, 8, 8, 16 for k = 32, 16, 13, 8). Element `e` (flat index of [..., nheads, headdim, dstate]
inside one slot, e < 2^24) takes

    offset  = (slot << 44) | (flush << 24) | (e // E)        slot, flush < 2^20
    words   = tl.randint4x(seed, offset, philox_rounds)
    j, i    = (e % E) // n, e % n                            word j, lane i of that word
    r_k(e)  = (words[j] >> (W * i)) & (2^k - 1)              the lane's low k bits

that is, the counter's 128 bits read as `w0 | w1 << 32 | w2 << 64 | w3 << 96` and element
`e % E` of the counter takes bits `[W (e % E), W (e % E) + k)`. For k = 32 this is word
`e % 4` of the counter `e // 4`; for the default, k = 16 in 7 rounds (`DEFAULT_SR_BITS`,
`DEFAULT_PHILOX_ROUNDS`), the low or high half of word `(e % 8) // 2`. A 13-bit draw
(FP16's dropped width from FP32) is the low 13 bits of a 16-bit lane: 13 bits do not fit
three to a word, so it costs what 16 bits cost, and one mask takes it (and, with a
complement, the add form of SR; docs/design.md).

Using all bits of a counter is what a kernel can afford: Philox-4x32-10 costs about 40
integer instructions per counter, which at one word per element is a quarter of the H200
flush kernel's instructions (ptxas count, 2026-11-29).

Offsets are 64-bit patterns held in int64: with `slot >= 2^19` the top bit is set and the
int64 is negative. Triton reads an int64 offset the same way (its low and high 32-bit halves),
so a kernel that computes `slot.to(tl.int64) << 44 | ...` (a wrapping shift) gets the same
words. `random_words(seed, slot, flush, shape, sr_bits=, philox_rounds=)` is the one way SR
draws are produced.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

from lowprec._checks import as_int

MASK32 = 0xFFFFFFFF
ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85

SLOT_SHIFT = 44
FLUSH_SHIFT = 24
SLOT_LIMIT = 1 << 20
FLUSH_LIMIT = 1 << 20
ELEMENT_LIMIT = 1 << 24
SEED_LIMIT = 1 << 64
WORDS_PER_COUNTER = 4
# random bits per element that SR supports: lanes of 8, 16 (also for 13) and 32 bits
SR_BITS = (8, 13, 16, 32)
# Philox rounds accepted; 10 is Philox-4x32-10, Random123's default and Triton's
PHILOX_ROUNDS = tuple(range(1, 11))
# The setting other settings are measured against: a whole Philox-4x32-10 word an element
# (tl.randint's words; the generator's own default rounds below).
REFERENCE_SR_BITS, REFERENCE_PHILOX_ROUNDS = 32, 10
# SR's default: 16 bits (two elements a word) in 7 rounds, indistinguishable from 32/10 in the
# error of a recurrence copy or a conventional FP16 SR state over 131,072 steps (docs/design.md,
# "Stochastic rounding: random bits and Philox rounds") and half the Philox work of the flush.
DEFAULT_SR_BITS = 16
DEFAULT_PHILOX_ROUNDS = 7


def _plain_int(value) -> int | None:
    """``value`` as an int when it is an integer scalar (numpy's included; not a bool), else
    None."""
    try:
        return as_int("value", value)
    except ValueError:
        return None


def _check_choice(value, allowed, name: str, expected: str) -> int:
    """``value`` as an int in ``allowed``, else ValueError naming ``name`` and ``expected``."""
    number = _plain_int(value)
    if number not in allowed:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return number


def check_sr_bits(sr_bits, name: str = "sr_bits") -> int:
    """``sr_bits`` as an int in `SR_BITS`, else ValueError naming ``name``."""
    return _check_choice(sr_bits, SR_BITS, name,
                         f"random bits per element in {list(SR_BITS)}")


def check_philox_rounds(rounds, name: str = "philox_rounds") -> int:
    """``rounds`` as an int in [1, 10] (`PHILOX_ROUNDS`), else ValueError naming ``name``."""
    return _check_choice(rounds, PHILOX_ROUNDS, name,
                         f"Philox rounds in [{PHILOX_ROUNDS[0]}, {PHILOX_ROUNDS[-1]}]")


def check_sr_settings(sr_bits, philox_rounds, rounding, rounding_name: str = "rounding",
                      prefix: str = "") -> tuple[int, int]:
    """``(sr_bits, philox_rounds)`` as ints SR supports (`check_sr_bits`,
    `check_philox_rounds`), and the defaults (16, 7) unless ``rounding`` is 'sr' (only SR
    draws random bits); messages name ``prefix + 'sr_bits'`` and ``prefix + rounding_name``."""
    sr_bits = check_sr_bits(sr_bits, prefix + "sr_bits")
    philox_rounds = check_philox_rounds(philox_rounds, prefix + "philox_rounds")
    if rounding != "sr":
        for name, value, default in (("sr_bits", sr_bits, DEFAULT_SR_BITS),
                                     ("philox_rounds", philox_rounds, DEFAULT_PHILOX_ROUNDS)):
            if value != default:
                raise ValueError(f"{prefix}{name}: expected the default {default} with "
                                 f"{prefix}{rounding_name}={rounding!r} (only SR draws random "
                                 f"bits), got {value}")
    return sr_bits, philox_rounds


def lane_bits(sr_bits: int) -> int:
    """W, the width of the lane a `sr_bits`-bit draw is the low bits of: 8, 16 or 32."""
    sr_bits = check_sr_bits(sr_bits)
    return 8 if sr_bits <= 8 else 16 if sr_bits <= 16 else 32


def elements_per_counter(sr_bits: int) -> int:
    """E = 4 * (32 / W): the consecutive elements one counter's four words serve."""
    return WORDS_PER_COUNTER * (32 // lane_bits(sr_bits))


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of the 64-bit product of the constant `a` and words `b`.

    a*b = a_hi*b*2^16 + a_lo*b with both partial products below 2^48, so int64 never
    overflows (a plain int64 product would, and signed overflow is not something to rely on).
    """
    a_hi, a_lo = a >> 16, a & 0xFFFF
    partial_lo = b * a_lo
    partial_hi = b * a_hi
    lo = (partial_hi & 0xFFFF).bitwise_left_shift_(16).add_(partial_lo).bitwise_and_(MASK32)
    hi = partial_lo.bitwise_right_shift_(16).add_(partial_hi).bitwise_right_shift_(16)
    return hi, lo


def _rounds_numpy(counter, k0, k1, shape, rounds):
    """The same rounds on the CPU in numpy uint64, where the product of two 32-bit words is
    exact and wrap-free: one multiply, a shift and a mask instead of `_mul_hi_lo`'s split.
    Measured 2026-11-29 on the 2-core dev machine: about 3x faster than the torch path for
    half a million words."""
    c0, c1, c2, c3 = (t.expand(shape).numpy().astype(np.uint64) for t in counter)
    k0, k1 = (
        np.uint64(k) if isinstance(k, int) else k.expand(shape).numpy().astype(np.uint64)
        for k in (k0, k1)
    )
    mask, a_const, b_const = np.uint64(MASK32), np.uint64(ROUND_A), np.uint64(ROUND_B)
    shift = np.uint64(32)
    for _ in range(rounds):
        prod_b = b_const * c2
        prod_a = a_const * c0
        c0, c1, c2, c3 = (
            (prod_b >> shift) ^ c1 ^ k0,
            prod_b & mask,
            (prod_a >> shift) ^ c3 ^ k1,
            prod_a & mask,
        )
        k0 = (k0 + np.uint64(KEY_A)) & mask
        k1 = (k1 + np.uint64(KEY_B)) & mask
    return tuple(
        torch.from_numpy(np.asarray(c, dtype=np.int64).reshape(shape)) for c in (c0, c1, c2, c3)
    )


def _as_words(value, name: str) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.int64) if not isinstance(value, torch.Tensor) else value
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer or integer tensor, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > MASK32):
        raise ValueError(
            f"{name}: expected uint32 values in [0, 2^32), got range "
            f"[{int(t.min())}, {int(t.max())}]"
        )
    return t


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = REFERENCE_PHILOX_ROUNDS):
    """Philox-4x32 of counter (c0..c3) and key (k0, k1) in `rounds` rounds (1..10): four int64
    tensors of uint32 words.

    Arguments are ints or integer tensors of uint32 values, broadcast together (int keys stay
    Python ints, which is what makes the common scalar-seed case fast).
    """
    rounds = check_philox_rounds(rounds, "rounds")
    names = ("c0", "c1", "c2", "c3")
    counter = [_as_words(v, n) for v, n in zip((c0, c1, c2, c3), names, strict=True)]
    k0, k1 = (k if isinstance(k, int) else _as_words(k, n) for k, n in ((k0, "k0"), (k1, "k1")))
    for k, n in ((k0, "k0"), (k1, "k1")):
        if isinstance(k, int) and not 0 <= k <= MASK32:
            raise ValueError(f"{n}: expected a uint32 value in [0, 2^32), got {k}")
    tensors = counter + [k for k in (k0, k1) if isinstance(k, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    if all(t.device.type == "cpu" for t in tensors):
        return _rounds_numpy(counter, k0, k1, shape, rounds)
    return _rounds_torch(counter, k0, k1, shape, rounds)


def _rounds_torch(counter, k0, k1, shape, rounds):
    """philox4x32's rounds in torch ops (any device; the path GPU tensors take, with 16-bit
    split products: torch has no unsigned 32 x 32 -> 64 multiply)."""
    c0, c1, c2, c3 = (t.expand(shape) for t in counter)
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(ROUND_A, c0)
        c0, c1, c2, c3 = (
            hi_b.bitwise_xor_(c1).bitwise_xor_(k0),
            lo_b,
            hi_a.bitwise_xor_(c3).bitwise_xor_(k1),
            lo_a,
        )
        k0 = (k0 + KEY_A) & MASK32
        k1 = (k1 + KEY_B) & MASK32
    return torch.broadcast_tensors(c0, c1, c2, c3)


def _check_seed(seed) -> int:
    """``seed`` as an int in [0, 2^64): an int or any integer scalar (``np.int64``)."""
    number = _plain_int(seed)
    if number is None or not 0 <= number < SEED_LIMIT:
        raise ValueError(f"seed: expected an int in [0, 2^64), got {seed!r}")
    return number


def randint(seed: int, offset: torch.Tensor,
            n_rounds: int = REFERENCE_PHILOX_ROUNDS) -> torch.Tensor:
    """`tl.randint(seed, offset, n_rounds)` word for word: int64 tensor of uint32 words,
    offset's shape.

    offset: int64 tensor, read as a 64-bit pattern (a negative value has its top bit set).
    """
    seed = _check_seed(seed)
    n_rounds = check_philox_rounds(n_rounds, "n_rounds")
    if not isinstance(offset, torch.Tensor) or offset.dtype != torch.int64:
        got = offset.dtype if isinstance(offset, torch.Tensor) else type(offset).__name__
        raise ValueError(f"offset: expected an int64 tensor, got {got}")
    low, high = offset & MASK32, (offset >> 32) & MASK32  # two's complement halves
    word, _, _, _ = philox4x32(low, high, 0, 0, seed & MASK32, seed >> 32, n_rounds)
    return word


def randint4x(seed: int, offset: torch.Tensor,
              n_rounds: int = REFERENCE_PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """`tl.randint4x(seed, offset, n_rounds)` word for word: the four words of each offset's
    counter."""
    seed = _check_seed(seed)
    n_rounds = check_philox_rounds(n_rounds, "n_rounds")
    if not isinstance(offset, torch.Tensor) or offset.dtype != torch.int64:
        got = offset.dtype if isinstance(offset, torch.Tensor) else type(offset).__name__
        raise ValueError(f"offset: expected an int64 tensor, got {got}")
    low, high = offset & MASK32, (offset >> 32) & MASK32
    return philox4x32(low, high, 0, 0, seed & MASK32, seed >> 32, n_rounds)


def _counter(value, limit: int, name: str) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected an int or integer tensor, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= limit):
        raise ValueError(
            f"{name}: expected values in [0, 2^{limit.bit_length() - 1}), got range "
            f"[{int(t.min())}, {int(t.max())}]"
        )
    return t


def _slot_flush_base(slot, flush) -> torch.Tensor:
    """(slot << 44) | (flush << 24) as int64 64-bit patterns, shape of slot and flush broadcast."""
    slot = _counter(slot, SLOT_LIMIT, "slot")
    flush = _counter(flush, FLUSH_LIMIT, "flush")
    # slot << 44 as a 64-bit pattern without signed overflow: slots >= 2^19 set the top bit,
    # i.e. they are (slot - 2^20) * 2^44 in two's complement. The fields do not overlap, so
    # adding them is the same as or-ing them.
    signed_slot = torch.where(slot >= SLOT_LIMIT // 2, slot - SLOT_LIMIT, slot)
    return signed_slot * (1 << SLOT_SHIFT) + flush * (1 << FLUSH_SHIFT)


def _state_numel(shape) -> tuple[tuple[int, ...], int]:
    """`shape` as a tuple of ints and its element count; refused unless its dims are ints >= 0
    and every element index is below 2^24, the range the contract gives `e` (module doc)
    and the kernels check. `()` is one element, element 0."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(
            f"shape: expected a sequence of ints (one slot's state shape, () for one element), "
            f"got {type(shape).__name__} {shape!r}"
        ) from None
    # operator.index and not int(): int() would truncate 2.5 to 2 and parse "3", giving words
    # for a shape nobody asked for; a bool is an int to Python, but True is no dim
    try:
        ints = tuple(operator.index(n) for n in dims)
    except TypeError:
        ints = None
    if ints is None or any(isinstance(n, bool) for n in dims):
        raise ValueError(f"shape: expected integer dims, got {list(dims)}")
    dims = ints
    if any(n < 0 for n in dims):
        raise ValueError(f"shape: expected dims >= 0, got {list(dims)}")
    numel = math.prod(dims)
    if numel > ELEMENT_LIMIT:
        raise ValueError(
            f"shape: expected at most 2^24 elements per slot (element indices e < 2^24), got "
            f"{list(dims)} ({numel} elements)"
        )
    return dims, numel


def state_offsets(slot, flush, shape, *, sr_bits: int = DEFAULT_SR_BITS) -> torch.Tensor:
    """The Philox offset of every element's counter in a state of per-slot `shape` (e.g.
    [nheads, headdim, dstate]): `(slot << 44) | (flush << 24) | (element // E)`, with
    E = `elements_per_counter(sr_bits)` (4 for 32 bits, 8 for 16 and 13, 16 for 8).

    slot, flush: ints or integer tensors (broadcast together, shape `batch`); the result has
    shape `batch + shape`, e.g. slot = arange(slots), flush = counts[slots] gives
    [slots, nheads, headdim, dstate].
    """
    per_counter = elements_per_counter(sr_bits)
    shape, numel = _state_numel(shape)
    base = _slot_flush_base(slot, flush)
    counter = torch.arange(numel, dtype=torch.int64).reshape(shape) // per_counter
    # reshape takes the shapes as one tuple: unpacked, a 0-d base and shape () would call
    # reshape() with no size at all
    return base.reshape(tuple(base.shape) + (1,) * len(shape)) + counter


def random_words(seed: int, slot, flush, shape, *, sr_bits: int = DEFAULT_SR_BITS,
                 philox_rounds: int = DEFAULT_PHILOX_ROUNDS) -> torch.Tensor:
    """SR draws for a state of per-slot `shape`: int64 values in [0, 2^sr_bits), shape
    `batch + shape` (shape `()` is element 0 alone, one per slot).

    Element e (flat index within the slot) takes the low `sr_bits` bits of lane `e % n` of
    word `(e % E) // n` of `randint4x(seed, (slot << 44) | (flush << 24) | (e // E),
    philox_rounds)`, with n = 32 / W lanes a word and E = 4 n (module doc). With the defaults
    (16 bits, 7 rounds) element e takes half (e % 2) of word (e % 8) // 2 of counter e // 8;
    with 32 bits, word e % 4 of counter e // 4 whole.
    """
    sr_bits = check_sr_bits(sr_bits)
    philox_rounds = check_philox_rounds(philox_rounds)
    seed = _check_seed(seed)
    shape, numel = _state_numel(shape)
    base = _slot_flush_base(slot, flush)
    width = lane_bits(sr_bits)
    lanes = 32 // width
    per_counter = WORDS_PER_COUNTER * lanes
    counters = -(-numel // per_counter)
    offsets = base.reshape(*base.shape, 1) + torch.arange(counters, dtype=torch.int64)
    words = torch.stack(randint4x(seed, offsets, philox_rounds), dim=-1)  # batch + [counters, 4]
    if lanes > 1:
        shifts = torch.arange(lanes, dtype=torch.int64) * width
        words = words[..., None] >> shifts  # batch + [counters, 4, lanes]: lane i of word j
    if sr_bits < 32:
        words = words & ((1 << sr_bits) - 1)
    words = words.reshape(*base.shape, counters * per_counter)[..., :numel]
    return words.reshape(tuple(base.shape) + shape)  # one tuple: shape () with a 0-d base
