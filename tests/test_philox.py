"""Philox-4x32 words (docs/design.md, "Random words"): known answers, Triton equality, offsets.
Fewer rounds and fewer bits per element: tests/test_sr_bits.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lowprec import philox

MASK32 = 0xFFFFFFFF
# whole Philox-4x32-10 words an element: tl.randint's words, the setting the word rules state
REFERENCE = {"sr_bits": philox.REFERENCE_SR_BITS, "philox_rounds": philox.REFERENCE_PHILOX_ROUNDS}
REPO = Path(__file__).resolve().parents[1]

# Random123 kat_vectors, "philox4x32 10" lines: counter[4], key[2] -> output[4]
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def philox_scalar(counter, key, rounds=10):
    """An independent Philox-4x32 on Python ints (Salmon et al. 2011, Figure 2)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def as_int64(pattern: int) -> int:
    """A 64-bit pattern as the int64 holding it (two's complement)."""
    return pattern - (1 << 64) if pattern >= 1 << 63 else pattern


@pytest.mark.parametrize("path", ["numpy", "torch"])
@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_philox4x32_10_matches_the_random123_known_answers(counter, key, expected, path):
    """Both of philox4x32's paths: numpy (CPU tensors) and torch ops (GPU tensors, with 16-bit
    split products), which no CPU call reaches, so it is called by name here."""
    assert philox_scalar(counter, key) == expected
    if path == "numpy":
        words = philox.philox4x32(*counter, *key)
    else:
        counter = [torch.tensor(c, dtype=torch.int64) for c in counter]
        words = philox._rounds_torch(counter, *key, torch.Size(), 10)
    assert tuple(int(w) for w in words) == expected


def test_philox4x32_is_vectorised_over_broadcast_tensors():
    counters = torch.tensor(
        [[0, 0, 0, 0], [MASK32] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]]
    )
    keys = torch.tensor([[0, 0], [MASK32, MASK32], [0xA4093822, 0x299F31D0]])
    words = philox.philox4x32(*counters.T, *keys.T)
    assert torch.stack(words, dim=1).tolist() == [list(e) for _, _, e in KNOWN_ANSWERS]
    keys_only = philox.philox4x32(0, 0, 0, 0, torch.tensor([0, MASK32]), 7)[0].tolist()
    assert keys_only == [philox_scalar((0, 0, 0, 0), (k, 7))[0] for k in (0, MASK32)]


def test_randint_uses_seed_as_key_and_offset_as_the_low_counter_words():
    """key (seed lo, seed hi), counter (offset lo, offset hi, 0, 0), first word: checked
    against the scalar reference for seeds and offsets with non-zero high words."""
    g = torch.Generator().manual_seed(71)
    seeds = [0, 1, 2**31 - 1, 2**32 + 7, 0xDEADBEEF_12345678, 2**64 - 1]
    offsets = torch.randint(-(2**63), 2**63 - 1, (37,), generator=g)
    offsets[:3] = torch.tensor([0, 2**32 - 1, -1])
    for seed in seeds:
        ours = philox.randint(seed, offsets).tolist()
        pattern = [o & ((1 << 64) - 1) for o in offsets.tolist()]
        expected = [
            philox_scalar((p & MASK32, p >> 32, 0, 0), (seed & MASK32, seed >> 32))[0]
            for p in pattern
        ]
        assert ours == expected, seed


def test_random_words_have_balanced_bits():
    """2^16 whole Philox-4x32-10 words (sr_bits=32): each bit is set with frequency 1/2 within
    5 binomial std (1/512)."""
    words = philox.random_words(5, 3, 11, (256, 256), **REFERENCE)
    bits = (words[..., None] >> torch.arange(32)) & 1
    assert bool(((bits.double().mean(dim=(0, 1)) - 0.5).abs() < 5 / 512).all())


TRITON_SCRIPT = r"""
import json, sys
import torch
import triton
import triton.language as tl

@triton.jit
def words_kernel(offset_ptr, out_ptr, n, seed, BLOCK: tl.constexpr, N_ROUNDS: tl.constexpr):
    o = tl.arange(0, BLOCK)
    mask = o < n
    offset = tl.load(offset_ptr + o, mask=mask, other=0)
    word = tl.randint(seed, offset, N_ROUNDS)
    tl.store(out_ptr + o, word.to(tl.int32, bitcast=True), mask=mask)
    w0, w1, w2, w3 = tl.randint4x(seed, offset, N_ROUNDS)
    tl.store(out_ptr + n + 4 * o, w0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + n + 4 * o + 1, w1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + n + 4 * o + 2, w2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + n + 4 * o + 3, w3.to(tl.int32, bitcast=True), mask=mask)

request = json.loads(sys.stdin.read())
offsets = torch.tensor(request["offsets"], dtype=torch.int64)
result = {}
for rounds in request["rounds"]:
    for seed in request["seeds"]:
        n = offsets.numel()
        out = torch.empty(5 * n, dtype=torch.int32)
        words_kernel[(1,)](offsets, out, n, seed, BLOCK=triton.next_power_of_2(n),
                           N_ROUNDS=rounds)
        words = (out.to(torch.int64) & 0xFFFFFFFF).tolist()
        result[f"{rounds} {seed}"] = {"randint": words[:n], "randint4x": words[n:]}
print(json.dumps(result))
"""


def test_words_equal_triton_randint_under_the_interpreter():
    """tl.randint(seed, offset, n_rounds) and all four words of tl.randint4x(seed, offset,
    n_rounds) (the four words of one counter) for int64 offsets with high words (slots >= 2^19
    set the top bit) and 10, 7 and 4 rounds, run by a tiny kernel with TRITON_INTERPRET=1 in a
    subprocess so that the variable does not leak into other tests. random_words with 32 bits
    and 10 rounds gives element e word e % 4 of tl.randint4x at its counter's offset."""
    pytest.importorskip("triton")
    slots = torch.tensor([0, 1, 2**19 - 1, 2**19, 2**20 - 1])
    flushes = torch.tensor([0, 7, 2**20 - 1, 3, 2**20 - 1])
    offsets = philox.state_offsets(slots, flushes, (2, 3, 5), sr_bits=32).flatten()
    g = torch.Generator().manual_seed(73)
    extra = torch.randint(-(2**63), 2**63 - 1, (46,), generator=g)
    offsets = torch.cat([offsets, extra, torch.tensor([0, 1, -1, 2**32])])
    seeds = [0, 1234, 2**32 + 99, 0x0123_4567_89AB_CDEF, 2**64 - 3]
    rounds = [10, 7, 4]
    request = json.dumps({"offsets": offsets.tolist(), "seeds": seeds, "rounds": rounds})
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT],
        input=request,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    triton_words = json.loads(run.stdout)
    for n_rounds in rounds:
        for seed in seeds:
            want = triton_words[f"{n_rounds} {seed}"]
            if n_rounds == 10:  # the default is Triton's default
                assert philox.randint(seed, offsets).tolist() == want["randint"], seed
            assert philox.randint(seed, offsets, n_rounds).tolist() == want["randint"], seed
            four = torch.stack(philox.randint4x(seed, offsets, n_rounds), -1).flatten().tolist()
            assert four == want["randint4x"], (n_rounds, seed)
        # the state's 5 x 30 elements: element e of a slot, word e % 4 of its counter's four
        triton_four = torch.tensor(triton_words[f"10 {seed}"]["randint4x"]).reshape(-1, 4)
        e = torch.arange(30)
        want = triton_four[:150].gather(1, (e % 4).repeat(5)[:, None])[:, 0]
        words = philox.random_words(seed, slots, flushes, (2, 3, 5), **REFERENCE)
        assert torch.equal(words.flatten(), want), seed


# --------------------------------------------------------------------------------------------
# offsets of state elements


def test_state_offsets_pack_slot_flush_and_counter_into_bit_fields():
    """With 32 bits an element, element e's counter is e // 4: four consecutive elements share
    one offset; with the default 16 bits, e // 8."""
    offsets = philox.state_offsets(3, 7, (2, 3, 5), sr_bits=32)
    expected = [(3 << 44) | (7 << 24) | (e // 4) for e in range(30)]
    assert offsets.shape == (2, 3, 5) and offsets.flatten().tolist() == expected
    default = philox.state_offsets(3, 7, (2, 3, 5))
    assert default.flatten().tolist() == [(3 << 44) | (7 << 24) | (e // 8) for e in range(30)]


def test_state_offsets_of_top_slots_are_the_64_bit_pattern_in_int64():
    top = (1 << 20) - 1
    offsets = philox.state_offsets(torch.tensor([2**19, top]), top, (9,), sr_bits=32)
    expected = [
        [as_int64((s << 44) | (top << 24) | e // 4) for e in range(9)] for s in (2**19, top)
    ]
    assert offsets.tolist() == expected
    assert offsets[1, 8] == -(2**24) + 2  # all ones above bit 24, element 8: counter 2


def test_state_offsets_broadcast_slot_and_flush_over_the_leading_dim():
    slots, flushes = torch.tensor([0, 4, 9]), torch.tensor([1, 1, 2])
    offsets = philox.state_offsets(slots, flushes, (5, 6))
    assert offsets.shape == (3, 5, 6)
    for i in range(3):
        assert torch.equal(offsets[i], philox.state_offsets(int(slots[i]), int(flushes[i]), (5, 6)))
    assert philox.state_offsets(slots, 0, (5, 6)).shape == (3, 5, 6)


def test_offsets_of_distinct_slots_flushes_and_counters_never_collide():
    """Each (slot, flush) has ceil(numel / E) distinct counters (E = 4 for 32 bits an element,
    8 for the default 16), none shared with another."""
    slots = torch.tensor([0, 1, 2**19, 2**20 - 1]).repeat_interleave(3)
    flushes = torch.tensor([0, 1, 2**20 - 1]).repeat(4)
    offsets = philox.state_offsets(slots, flushes, (7, 9), sr_bits=32)
    assert offsets.unique().numel() == slots.numel() * 16  # 63 elements: 16 counters
    offsets = philox.state_offsets(slots, flushes, (7, 9))
    assert offsets.unique().numel() == slots.numel() * 8  # 63 elements: 8 counters


def test_random_words_take_the_four_words_of_each_counter_in_order():
    """With 32 bits an element and 10 rounds, element e gets word e % 4 of randint4x at its
    counter's offset, for an odd-sized state (the last counter's unused words are dropped) and
    two slots."""
    shape = (3, 7)
    words = philox.random_words(13, torch.tensor([2, 9]), 4, shape, **REFERENCE)
    offsets = philox.state_offsets(torch.tensor([2, 9]), 4, shape, sr_bits=32)
    four = philox.randint4x(13, offsets)
    element = torch.arange(21).reshape(shape)
    for k in range(4):
        assert torch.equal(words[:, element % 4 == k], four[k][:, element % 4 == k])
    # randint4x against the independent scalar Philox: counter (offset lo, hi, 0, 0), key
    # (seed lo, seed hi); slot 9's counter 5 is element 20, the state's last
    offset = (9 << 44) | (4 << 24) | 5
    want = philox_scalar((offset & MASK32, offset >> 32, 0, 0), (13, 0))
    assert [int(w[1, 2, 6]) for w in four] == list(want)
    assert int(words[1, 2, 6]) == want[0]  # element 20: word 20 % 4 = 0
    assert words.unique().numel() == words.numel()  # 42 words, all different


def test_state_offsets_validate_the_field_ranges():
    with pytest.raises(ValueError, match=r"slot: expected values in \[0, 2\^20\), got range"):
        philox.state_offsets(2**20, 0, (4,))
    with pytest.raises(ValueError, match=r"flush: expected values in \[0, 2\^20\)"):
        philox.state_offsets(0, torch.tensor([3, -1]), (4,))
    with pytest.raises(ValueError, match="shape: expected at most 2\\^24 elements"):
        philox.state_offsets(0, 0, (4097, 4096))
    with pytest.raises(ValueError, match="slot: expected an int or integer tensor"):
        philox.state_offsets(torch.tensor([1.0]), 0, (4,))
    with pytest.raises(ValueError, match=r"seed: expected an int in \[0, 2\^64\)"):
        philox.random_words(-1, 0, 0, (4,))
    with pytest.raises(ValueError, match="offset: expected an int64 tensor"):
        philox.randint(0, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="c0: expected uint32 values"):
        philox.philox4x32(2**32, 0, 0, 0, 0, 0)


def test_a_0d_state_shape_is_one_element_with_element_0s_word_and_offset():
    """shape () is one element, element 0: its word is the first word of element 0's counter
    (what shape (1,) and a larger state give element 0; the default draw its low 16 bits in 7
    rounds), its offset the slot and flush fields alone; with a batch of slots the result has
    the batch's shape."""
    slots, flushes = torch.tensor([3, 5, 2**19 + 7]), torch.tensor([11, 0, 2**20 - 1])
    one = philox.random_words(41, 3, 11, (), **REFERENCE)
    assert one.shape == () and one.dtype == torch.int64
    assert int(one) == int(philox.random_words(41, 3, 11, (3, 5, 7), **REFERENCE)[0, 0, 0])
    assert int(one) == int(philox.randint4x(41, torch.tensor((3 << 44) | (11 << 24)))[0])
    default = philox.random_words(41, 3, 11, ())
    assert default.shape == () and int(default) == int(philox.random_words(41, 3, 11, (3, 5))[0, 0])
    first = philox.randint4x(41, torch.tensor((3 << 44) | (11 << 24)), 7)[0]
    assert int(default) == int(first) & 0xFFFF
    batch = philox.random_words(41, slots, flushes, ())
    assert batch.shape == (3,)
    assert torch.equal(batch, philox.random_words(41, slots, flushes, (1,))[:, 0])
    offset = philox.state_offsets(3, 11, ())
    assert offset.shape == () and int(offset) == (3 << 44) | (11 << 24)
    assert torch.equal(philox.state_offsets(slots, flushes, ()),
                       philox.state_offsets(slots, flushes, (1,))[:, 0])


@pytest.mark.parametrize("shape, message", [
    ((-1, 5), r"shape: expected dims >= 0, got \[-1, 5\]"),
    ((3, 0, -7), r"shape: expected dims >= 0, got \[3, 0, -7\]"),
    ((2.5, 3), r"shape: expected integer dims, got \[2.5, 3\]"),  # not truncated to (2, 3)
    (("3", 5), r"shape: expected integer dims, got \['3', 5\]"),  # not parsed as 3
    ((True, 5), r"shape: expected integer dims, got \[True, 5\]"),  # not read as 1
    ((torch.tensor(2.5), 3), r"shape: expected integer dims"),
    (7, r"shape: expected a sequence of ints .*, got int 7"),
    (None, r"shape: expected a sequence of ints .*, got NoneType None"),
    ((4097, 4096), r"shape: expected at most 2\^24 elements per slot .*, got \[4097, 4096\] "
                   r"\(16781312 elements\)"),
    ((philox.ELEMENT_LIMIT + 1,), r"shape: expected at most 2\^24 elements per slot"),
])
def test_state_shape_must_be_integer_dims_of_at_most_2_24_elements(shape, message):
    """state_offsets and random_words refuse a shape they cannot give words to, naming it,
    and never round a dim to an int (a float or a string dim would give another shape's
    words, a negative one the element-count message)."""
    with pytest.raises(ValueError, match=message):
        philox.state_offsets(1, 2, shape)
    with pytest.raises(ValueError, match=message):
        philox.random_words(9, torch.tensor([1, 4]), 2, shape)


def test_state_shape_of_exactly_2_24_elements_is_accepted_and_integer_likes_are_ints():
    """The last index the contract allows, e = 2^24 - 1, takes counter 2^22 - 1 with 32 bits an
    element (2^21 - 1 with the default 16); torch.Size, numpy and 0-d integer tensor dims are
    read as their ints."""
    offsets = philox.state_offsets(5, 3, (philox.ELEMENT_LIMIT,), sr_bits=32)
    assert int(offsets[-1]) == (5 << 44) | (3 << 24) | (philox.ELEMENT_LIMIT // 4 - 1)
    offsets = philox.state_offsets(5, 3, (philox.ELEMENT_LIMIT,))
    assert int(offsets[-1]) == (5 << 44) | (3 << 24) | (philox.ELEMENT_LIMIT // 8 - 1)
    del offsets
    want = philox.random_words(9, 1, 2, (3, 5))
    for shape in (torch.Size([3, 5]), (np.int64(3), torch.tensor(5)), [3, 5]):
        assert torch.equal(philox.random_words(9, 1, 2, shape), want)


@pytest.mark.parametrize("sr", [{}, REFERENCE], ids=["default", "32-bits-10-rounds"])
def test_random_words_replay_and_never_share_words_across_flushes(sr):
    """Element 0 of every counter takes the low lane of its counter's first word (all of it
    with 32 bits); the same arguments replay the draws, another flush, slot or seed does not."""
    shape = (3, 4, 8)
    sr_bits = sr.get("sr_bits", philox.DEFAULT_SR_BITS)
    rounds = sr.get("philox_rounds", philox.DEFAULT_PHILOX_ROUNDS)
    per_counter = philox.elements_per_counter(sr_bits)
    first = philox.random_words(77, torch.arange(2), torch.tensor([5, 5]), shape, **sr)
    offsets = philox.state_offsets(torch.arange(2), 5, shape, sr_bits=sr_bits)
    lane = philox.randint(77, offsets, rounds) & ((1 << sr_bits) - 1)
    assert torch.equal(first[..., ::per_counter], lane[..., ::per_counter])
    assert torch.equal(first, philox.random_words(77, torch.arange(2), 5, shape, **sr))  # replay
    later = philox.random_words(77, torch.arange(2), 6, shape, **sr)
    assert not bool((first == later).all(dim=(1, 2, 3)).any())
    assert not torch.equal(first[0], first[1])  # two slots, same flush
    assert not torch.equal(first, philox.random_words(78, torch.arange(2), 5, shape, **sr))
