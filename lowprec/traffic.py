"""Memory traffic and capacity of SSM decoding: bytes per committed token, pure arithmetic.

This is the speed side of every precision choice: a decode step of a recurrent layer is a
memory copy with a little arithmetic, so the bytes it moves set its time. The functions below
count those bytes for conventional decoding, ReplaySSM (`../shared/DESIGN.md`) with one shared
checkpoint or two copies, and speculative decoding, and the bytes each scheme keeps per request.

Units and scope. Bytes, per layer and per sequence, unless a name says otherwise. Only the
state cache is counted (states, checkpoints, ring records, KV entries): the current token's
inputs (`x, B, C, dt` or `q, k, v, g, beta`), the outputs and the weights cost every scheme the
same and are left out. MiB = 2^20 bytes.

Notation (as in DESIGN.md):

    M_S   bytes of one state in its format, scales included (`state_bytes`)
    r     bytes of one ReplaySSM record (`record_bytes`); where a step reads only some of a
          held record's fields (GDN, KDA), `RecordBytes` splits r into w (written and kept),
          s (what a non-flush step reads) and f (what the flush reads)
    L     window: a flush every L committed tokens in standard decoding
    T     tokens verified per speculative step (T = 1: plain decoding)
    c     tokens committed by a step, 1..T (the first verified token is always committed)
    h     committed records held in the ring when a step starts

The rules, one per function, each documented where it is implemented:

- `conventional`: each token reads and writes the whole state.
- `replay`: standard ReplaySSM decoding, one window of L steps.
- `snapshot_spec`, `replay_spec`: speculative decoding, one step / one steady cycle.
- `snapshot_memory`, `replay_memory`, `requests_fit`: bytes kept per request and capacity.
- `optimal_window`, `best_window`: the window that minimises traffic, closed form and brute force.
- `kv_bytes_per_token`, `state_equivalent_kv_tokens`, `crossover_context`: attention comparison.

Format bytes come from a small local table (`STORAGE`, read off DESIGN.md and
`lowprec/README.md`) rather than from `lowprec.formats`, so this module is stdlib-only;
`tests/test_traffic.py` checks that the two agree and name the same formats (fp64, the
reference's exact arm, included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from lowprec import models
from lowprec.models import AttentionShape, ModelShape, SSMLayerShape

__all__ = [
    "MIB",
    "KIB",
    "STORAGE",
    "RECORD_LAYOUTS",
    "RECORD_LAYOUT_NAMES",
    "StorageRule",
    "RecordField",
    "RecordBytes",
    "Traffic",
    "state_bytes",
    "element_bytes",
    "record_bytes",
    "ring_record",
    "conventional",
    "replay",
    "flush_overhead",
    "snapshot_spec",
    "replay_spec",
    "replay_spec_trace",
    "snapshot_memory",
    "replay_memory",
    "request_bytes",
    "requests_fit",
    "optimal_window",
    "best_window",
    "kv_bytes_per_token",
    "state_equivalent_kv_tokens",
    "crossover_context",
]

KIB = 2**10
MIB = 2**20
ROW = -1  # a block that spans the whole last dim (one scale per state row), as in lowprec.formats


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Storage bytes of a state and of a record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageRule:
    """How many bytes a tensor `[..., d_v, d_k]` takes in a format.

    element_bits: bits per element. block: elements per block scale along d_k (None: no block
    scale; ROW: one per row of d_k). block_scale_bytes: bytes of one block scale.
    state_scale_bytes: bytes of the second-level scale kept once per `(sequence, head)` state.
    """

    name: str
    element_bits: int
    block: int | None = None
    block_scale_bytes: int = 0
    state_scale_bytes: int = 0


STORAGE = {
    rule.name: rule
    for rule in (
        # the reference's exact arms keep their state in fp64 (lowprec/README.md, "The exact
        # arms"); it is priced like any other format, so a table of the kit's formats has it
        StorageRule("fp64", 64),
        StorageRule("fp32", 32),
        StorageRule("fp16", 16),
        StorageRule("bf16", 16),
        StorageRule("fp8_e4m3", 8),
        StorageRule("fp8_e5m2", 8),
        # E2M1 nibbles, one E4M3 byte per 16 along d_k, one fp32 per (sequence, head).
        StorageRule("nvfp4", 4, block=16, block_scale_bytes=1, state_scale_bytes=4),
        # E2M1 nibbles, one E8M0 byte per 32 along d_k.
        StorageRule("mxfp4", 4, block=32, block_scale_bytes=1),
        # Ideal-scale toy formats: their scales are kept in fp32.
        StorageRule("fp8_e4m3_row", 8, block=ROW, block_scale_bytes=4),
        StorageRule("fp4_e2m1_b16", 4, block=16, block_scale_bytes=4),
        StorageRule("fp4_e2m1_b32", 4, block=32, block_scale_bytes=4),
    )
}


def _rule(fmt: str) -> StorageRule:
    if not isinstance(fmt, str) or fmt not in STORAGE:  # a list is no key: refuse it by name
        raise ValueError(f"format: expected one of {list(STORAGE)}, got {fmt!r}")
    return STORAGE[fmt]


def state_bytes(shape: SSMLayerShape | tuple[int, int, int], fmt: str) -> int:
    """Bytes of one sequence's state `[nheads, d_v, d_k]` in `fmt`, all scales included.

    elements * bits / 8 + (elements / block) * block-scale bytes + nheads * state-scale bytes.
    Nemotron-3-Super (128 x 64 x 128): fp32 4 MiB; nvfp4 512 KiB of nibbles + 64 KiB of E4M3
    scales + 512 B of fp32 scales = 590,336 B (576.5 KiB).
    """
    nheads, d_v, d_k = shape.state_shape if isinstance(shape, SSMLayerShape) else tuple(shape)
    for name, value in (("nheads", nheads), ("d_v", d_v), ("d_k", d_k)):
        _check_int(name, value)
    rule = _rule(fmt)
    elements = nheads * d_v * d_k
    if elements * rule.element_bits % 8:
        raise ValueError(
            f"shape: expected a whole number of bytes of {fmt} elements, got {elements} elements"
        )
    total = elements * rule.element_bits // 8
    if rule.block is not None:
        block = d_k if rule.block == ROW else rule.block
        if d_k % block:
            raise ValueError(f"d_k: expected a multiple of {fmt}'s block {block}, got {d_k}")
        total += elements // block * rule.block_scale_bytes
    return total + nheads * rule.state_scale_bytes


def element_bytes(fmt: str) -> int:
    """Bytes of one element of an unscaled whole-byte format (activations, KV entries)."""
    rule = _rule(fmt)
    if rule.element_bits % 8 or rule.block is not None or rule.state_scale_bytes:
        raise ValueError(f"format: expected a plain whole-byte element format, got {fmt!r}")
    return rule.element_bits // 8


BOTH = ("nonflush", "flush")


@dataclass(frozen=True)
class RecordField:
    """One quantity of a ReplaySSM record: `length` ("d_v", "d_k" or "1") elements stored in
    `dtype` ("act" for the activation format, or a format name), once per head or per group;
    `reads`: the steps that read it from the ring ("nonflush", "flush")."""

    name: str
    length: str
    dtype: str
    per: str
    reads: tuple[str, ...] = BOTH


def _delta_rule_record(decay: str) -> tuple[RecordField, ...]:
    """A GDN (`decay` "1") or KDA (`decay` "d_k") record, as the kit's ring keeps it
    (`emulation.gdn_replay_decode.GDNReplayCache`, `cute_kernels.gdn_cache`): every field per
    value head (a model with fewer key heads repeats each key for its value heads). A non-flush
    step reads the cached `u` with `k, g`; the flush recomputes every `u` from `v, k, g, beta`."""
    return (
        RecordField("u", "d_v", "fp32", "head", ("nonflush",)),
        RecordField("v", "d_v", "act", "head", ("flush",)),
        RecordField("k", "d_k", "act", "head"),
        RecordField("g", decay, "fp32", "head"),
        RecordField("beta", "1", "fp32", "head", ("flush",)),
    )


# What a record must hold (DESIGN.md): Mamba-2 `(x, dt, B)`, read whole by every step; GDN and
# KDA the corrected `u`, the raw `v`, `k`, the log-decay `g` (KDA: one per channel of d_k) and
# `beta`. The *kernel* layout stores a group-shared tensor once per group, as the cache layout
# does (`ring B [slots, ngroups, L, dstate]`). The *conservative* layout prices every tensor per
# head, which for Mamba-2 is DESIGN.md's `2*d_v + 2*d_k + 4` bytes per head with bf16
# activations; the GDN and KDA kernels already keep every tensor per head, so their two layouts
# are the same.
RECORD_LAYOUTS = {
    ("mamba2", "kernel"): (
        RecordField("x", "d_v", "act", "head"),
        RecordField("dt", "1", "fp32", "head"),
        RecordField("B", "d_k", "act", "group"),
    ),
    ("mamba2", "conservative"): (
        RecordField("x", "d_v", "act", "head"),
        RecordField("B", "d_k", "act", "head"),
        RecordField("dt", "1", "fp32", "head"),
    ),
    ("gdn", "kernel"): _delta_rule_record("1"),
    ("gdn", "conservative"): _delta_rule_record("1"),
    ("kda", "kernel"): _delta_rule_record("d_k"),
    ("kda", "conservative"): _delta_rule_record("d_k"),
}

RECORD_LAYOUT_NAMES = ("kernel", "conservative")


@dataclass(frozen=True)
class RecordBytes:
    """Bytes of one ReplaySSM record: `write` as appended (and kept in the ring); of each held
    record, `nonflush_read` what a non-flush step reads and `flush_read` what the flush reads.
    The traffic functions take one or a plain int r (every step reads the whole record)."""

    write: int
    nonflush_read: int
    flush_read: int


def _record(record: int | RecordBytes) -> RecordBytes:
    if isinstance(record, RecordBytes):
        for f in fields(record):
            _check_int(f"record.{f.name}", getattr(record, f.name), 0)
        return record
    _check_int("record", record, 0)
    return RecordBytes(record, record, record)


def ring_record(ssm: SSMLayerShape, layout: str = "kernel", act_format: str = "bf16"
                ) -> RecordBytes:
    """One ReplaySSM record (one token, one sequence, one layer) in `layout`: its bytes and
    what each step reads of it (`RECORD_LAYOUTS`).

    Qwen3-Next (32 heads, d_v = d_k = 128), bf16 activations, per head: u 512 + v 256 + k 256
    + g 4 + beta 4 = 1,032 B written; a non-flush step reads u, k, g (772 B), the flush v, k, g,
    beta (520 B). KDA's g is 512 B (fp32 per channel of d_k): 1,540 / 1,280 / 1,028 B a head.
    """
    if not isinstance(ssm, SSMLayerShape):
        raise TypeError(f"ssm: expected an SSMLayerShape, got {type(ssm).__name__}")
    if layout not in RECORD_LAYOUT_NAMES:
        raise ValueError(f"layout: expected one of {RECORD_LAYOUT_NAMES}, got {layout!r}")
    lengths = {"d_v": ssm.d_v, "d_k": ssm.d_k, "1": 1}
    copies = {"head": ssm.nheads, "group": ssm.ngroups}
    total = {"write": 0, "nonflush": 0, "flush": 0}
    for field in RECORD_LAYOUTS[(ssm.kind, layout)]:
        dtype = act_format if field.dtype == "act" else field.dtype
        nbytes = copies[field.per] * lengths[field.length] * element_bytes(dtype)
        for step in ("write", *field.reads):
            total[step] += nbytes
    return RecordBytes(total["write"], total["nonflush"], total["flush"])


def record_bytes(ssm: SSMLayerShape, layout: str = "kernel", act_format: str = "bf16") -> int:
    """Bytes of one ReplaySSM record (one token, one sequence, one layer) in `layout`, as
    written and kept (`ring_record(...).write`).

    Nemotron-3-Super, bf16 activations: kernel 128 * (64*2 + 4) + 8 * 128*2 = 18,944 B;
    conservative 128 * (2*64 + 2*128 + 4) = 49,664 B.
    """
    return ring_record(ssm, layout, act_format).write


# --------------------------------------------------------------------------------------------
# Traffic of each decoding scheme
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Bytes moved while `tokens` tokens are committed, over `steps` steps. `flushes` counts
    whole-state writes (ReplaySSM checkpoint writes; every token's write in conventional
    decoding; one per snapshot). State bytes count states, checkpoints (both copies) and
    snapshots; record bytes count ring records."""

    tokens: int
    steps: int
    flushes: int
    state_read: int
    state_write: int
    record_read: int
    record_write: int

    @property
    def total(self) -> int:
        return self.state_read + self.state_write + self.record_read + self.record_write

    @property
    def per_token(self) -> float:
        """Bytes per committed token."""
        return self.total / self.tokens

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def conventional(state: int) -> Traffic:
    """Conventional decoding, one token: the step reads the whole state and writes it back.

    Bytes per token `2 * M_S` (Nemotron-3-Super, fp32: 8 MiB per layer).
    """
    _check_int("state", state)
    return Traffic(tokens=1, steps=1, flushes=1, state_read=state, state_write=state,
                   record_read=0, record_write=0)


def _copies(read_copy: int, recurrence_copy: int | None) -> tuple[int, int, int]:
    """(bytes a non-flush step reads, a flush reads, a flush writes) for one shared checkpoint
    (`recurrence_copy` None) or two copies: the flush reads the recurrence copy and writes both."""
    _check_int("read_copy", read_copy)
    if recurrence_copy is None:
        return read_copy, read_copy, read_copy
    _check_int("recurrence_copy", recurrence_copy)
    return read_copy, recurrence_copy, recurrence_copy + read_copy


def flush_overhead(read_copy: int, recurrence_copy: int | None = None) -> int:
    """What one flush moves beyond a non-flush step's checkpoint read: `M_S` for a shared
    checkpoint (its write), `2 * M_hi` for two copies (the hi read replaces a lo read, plus
    both writes). This is the `M_S` of `optimal_window`."""
    non_flush_read, flush_read, flush_write = _copies(read_copy, recurrence_copy)
    return flush_read - non_flush_read + flush_write


def replay(window: int, record: int | RecordBytes, read_copy: int,
           recurrence_copy: int | None = None) -> Traffic:
    """Standard ReplaySSM decoding (T = 1), one window of `L = window` tokens.

    Steps `i = 1..L`. Every step reads the checkpoint once: a non-flush step (`i < L`) reads
    the read copy, the flush (`i = L`) reads the recurrence copy (the same copy when shared).
    Step `i` reads the `i - 1` records before it (the flush: the whole ring). Steps `1..L-1`
    append their record (`L - 1` record writes); the flush folds those and its own token into
    the new checkpoint and writes it once (both copies when there are two). Per window:

        state:   (L - 1) * lo + hi read,   hi + lo written      (shared: L*M + M)
        records: (L-1)(L-2)/2 s + (L-1) f read,   (L - 1) w written

    With `s = f = w = r`, shared, per token: `(L+1)/L * M_S + r (L-1)(L+2)/(2L)`; over
    conventional `2 M_S` this tends to `(L+1)/(2L)` as `r -> 0`.
    """
    _check_int("window", window)
    record = _record(record)
    non_flush_read, flush_read, flush_write = _copies(read_copy, recurrence_copy)
    return Traffic(
        tokens=window,
        steps=window,
        flushes=1,
        state_read=(window - 1) * non_flush_read + flush_read,
        state_write=flush_write,
        record_read=(record.nonflush_read * (window - 1) * (window - 2) // 2
                     + record.flush_read * (window - 1)),
        record_write=record.write * (window - 1),
    )


def snapshot_spec(state: int, verified: int, committed: int) -> Traffic:
    """Speculative decoding with vLLM-style state snapshots, one step.

    The step reads the committed state once and writes the state after each of the
    `T = verified` tokens (one snapshot per position); accepting `c = committed` of them selects
    snapshot `c`. Bytes per committed token `(1 + T) * M_S / c`; T = 1 is conventional decoding.
    """
    _check_int("state", state)
    _check_int("verified", verified)
    _check_committed(committed, verified)
    return Traffic(tokens=committed, steps=1, flushes=verified, state_read=state,
                   state_write=verified * state, record_read=0, record_write=0)


def _check_window_holds(window: int, verified: int) -> None:
    """T <= L, as lowprec.replay's caches require (a step verifies at most a window)."""
    if verified > window:
        raise ValueError(f"verified: expected T <= the window L = {window}, got {verified}")


def _check_committed(committed: int, verified: int) -> None:
    _check_int("committed", committed)
    if committed > verified:
        raise ValueError(f"committed: expected 1..verified={verified}, got {committed}")


def replay_spec_trace(window: int, verified: int, committed: int, record: int | RecordBytes,
                      read_copy: int, recurrence_copy: int | None = None
                      ) -> tuple[list[Traffic], int]:
    """The steps of ReplaySSM speculative decoding from an empty ring, up to the first repeat.

    Returns `(steps, cycle_start)`: one `Traffic` per step, and the index of the first step of
    the steady cycle (the steps from there on repeat for ever). See `replay_spec` for the rule.
    """
    _check_int("window", window)
    _check_int("verified", verified)
    _check_window_holds(window, verified)
    _check_committed(committed, verified)
    record = _record(record)
    non_flush_read, flush_read, flush_write = _copies(read_copy, recurrence_copy)
    steps: list[Traffic] = []
    first_seen: dict[int, int] = {}
    held = 0
    # The step is a function of `held` alone, which lives in 0..window, so a repeat comes
    # within window + 2 steps.
    while held not in first_seen:
        first_seen[held] = len(steps)
        flush = held + verified > window
        steps.append(Traffic(
            tokens=committed,
            steps=1,
            flushes=int(flush),
            state_read=flush_read if flush else non_flush_read,
            state_write=flush_write if flush else 0,
            record_read=held * (record.flush_read if flush else record.nonflush_read),
            record_write=verified * record.write,
        ))
        held = committed if flush else held + committed
    return steps, first_seen[held]


def replay_spec(window: int, verified: int, committed: int, record: int | RecordBytes,
                read_copy: int, recurrence_copy: int | None = None) -> Traffic:
    """ReplaySSM speculative decoding, one steady cycle (per committed token: `.per_token`).

    A step starts with `h` committed records behind the checkpoint. It reads the checkpoint
    once (read copy; recurrence copy on a flush), reads the `h` records, and appends the
    `T = verified` draft records (the ring holds `L + T`); accepting `c = committed` moves the
    committed pointer by `c`, rejected records are overwritten later (rollback is free).
    A step flushes when `h + T > L`, known before it runs: it folds the `h` committed records
    (only those: the drafts' fate is unknown) into the new checkpoint and writes it; its drafts
    are then the first records of the next window, so `h` becomes `c`. Otherwise `h += c`.

    The run is stepped from an empty ring until `h` repeats; the cycle is the steady state.
    At T = 1 this costs `((L - 1) s + f + w) / L` per token more than `replay` (`r (L + 1) / L`
    where every step reads whole records), whose flush also folds its own token (committed
    before the step, with no draft to wait for).
    """
    steps, cycle_start = replay_spec_trace(window, verified, committed, record, read_copy,
                                           recurrence_copy)
    cycle = steps[cycle_start]
    for step in steps[cycle_start + 1:]:
        cycle = cycle + step
    return cycle


# --------------------------------------------------------------------------------------------
# Memory per request and capacity
# --------------------------------------------------------------------------------------------


def snapshot_memory(state: int, verified: int = 1) -> int:
    """Bytes kept per request and layer by conventional / snapshot decoding: `T` states.

    The step reads the committed state and writes `T` snapshots; the first verified token is
    always committed, so its snapshot may overwrite the state it was read from, and `T` slots
    suffice (vLLM keeps `1 + num_speculative_tokens = T`). T = 1: the one state.
    """
    _check_int("state", state)
    _check_int("verified", verified)
    return verified * state


def replay_memory(window: int, verified: int, record: int | RecordBytes, read_copy: int,
                  recurrence_copy: int | None = None) -> int:
    """Bytes kept per request and layer by ReplaySSM: one checkpoint (both copies when there
    are two) and a ring of `L + T` records."""
    _check_int("window", window)
    _check_int("verified", verified)
    _check_window_holds(window, verified)
    record = _record(record)
    _check_int("read_copy", read_copy)
    checkpoint = read_copy if recurrence_copy is None else read_copy + recurrence_copy
    return checkpoint + (window + verified) * record.write


def request_bytes(model: ModelShape, ssm_layer_bytes: int, context: int = 0) -> int:
    """Bytes one request keeps in the whole model: every SSM layer's `ssm_layer_bytes` plus
    every attention layer's KV cache for `context` tokens. `model`: a ModelShape or a name of
    lowprec.models."""
    model = models.get(model)
    _check_int("ssm_layer_bytes", ssm_layer_bytes)
    _check_int("context", context, 0)
    kv = 0  # a model without attention layers (its `attention` is None) keeps no KV cache
    if model.n_attention_layers:
        kv = model.n_attention_layers * kv_bytes_per_token(model.attention) * context
    return model.n_ssm_layers * ssm_layer_bytes + kv


def requests_fit(memory: int, per_request: int) -> int:
    """How many whole requests of `per_request` bytes fit in `memory` bytes."""
    _check_int("memory", memory, 0)
    _check_int("per_request", per_request)
    return memory // per_request


# --------------------------------------------------------------------------------------------
# Optimal window
# --------------------------------------------------------------------------------------------


def optimal_window(state: int, record: int | RecordBytes, verified: int = 1,
                   mean_committed: float = 1.0) -> float:
    """`L* = sqrt(2 a (M_S - T (f + w - s)) / s)`, with `M_S = state`, the record's bytes
    `w, s, f` (`RecordBytes`; an int r is `w = s = f = r`, and then `L* = sqrt(2 a (M_S / r -
    T))`), `T = verified` and `a = mean_committed` tokens per step.

    Derivation (standard decoding, a = T = 1): per token `replay` costs
    `const + (M_S + s - f - w) / L + s L / 2`, least at `L^2 = 2 (M_S + s - f - w) / s`. With
    `T` drafts the flush's fixed cost is spread over `a` tokens per step, giving the formula
    above; for the exact speculative cycle of `replay_spec` it is an approximation: a cycle of
    `N` steps costs `const + M_S / (a N) + s N / 2` per token, least at
    `N* = sqrt(2 M_S / (a s))`, i.e. near `L = T - a + a N*`, a little above the formula. The
    cost is flat there: a window whose cycle has `N` steps moves `s (N - N*)^2 / (2 N)` more
    per token than the continuous optimum, out of at least `M_S / a` (under 1% for
    Nemotron-3-Super up to T = 8; `tests/test_traffic.py` checks both statements by brute
    force). For two copies pass `state = flush_overhead(lo, hi) = 2 * M_hi`.
    """
    _check_int("state", state)
    name = "record.nonflush_read" if isinstance(record, RecordBytes) else "record"
    record = _record(record)
    _check_int(name, record.nonflush_read)  # the window grows as records are read
    _check_int("verified", verified)
    if not 1 <= mean_committed <= verified:
        raise ValueError(f"mean_committed: expected 1..verified={verified}, got {mean_committed}")
    fixed = verified * (record.flush_read + record.write - record.nonflush_read)
    if state <= fixed:
        raise ValueError(
            f"state: expected more than verified={verified} records' bytes "
            f"(T (f + w - s) = {fixed}), got {state}: then every step should flush"
        )
    return math.sqrt(2 * mean_committed * (state - fixed) / record.nonflush_read)


def best_window(cost: Callable[[int], float], windows: Iterable[int]) -> int:
    """Brute force: the window in `windows` with the least `cost(window)`, the smallest on a tie."""
    windows = list(windows)
    if not windows:
        raise ValueError("windows: expected at least one window, got none")
    return min(windows, key=lambda window: (cost(window), window))


# --------------------------------------------------------------------------------------------
# Attention comparison
# --------------------------------------------------------------------------------------------


def kv_bytes_per_token(attention: AttentionShape) -> int:
    """KV-cache bytes one token adds to one attention layer: `kv_tensors` vectors (K and V; MLA
    one latent) of `n_kv_heads * head_dim` elements (per-tensor fp8 scales are a few bytes per
    layer: ignored). Nemotron-3-Super, fp8: 2 * 2 * 128 * 1 = 512 B; Kimi Linear's MLA, bf16:
    1 * 1 * 576 * 2 = 1,152 B."""
    return (attention.kv_tensors * attention.n_kv_heads * attention.head_dim
            * element_bytes(attention.kv_format))


def state_equivalent_kv_tokens(state: int, kv_per_token: int) -> float:
    """Tokens whose KV entry (in one attention layer) weighs as much as one state (one SSM
    layer): `M_S / kv`. Nemotron-3-Super: 4 MiB / 512 B = 8192 tokens."""
    _check_int("state", state)
    _check_int("kv_per_token", kv_per_token)
    return state / kv_per_token


def crossover_context(model: ModelShape, ssm_bytes_per_token: float) -> float:
    """Context length at which one decode step's KV reads in all attention layers,
    `n_attn * kv * n`, equal the SSM layers' state traffic, `n_ssm * ssm_bytes_per_token`
    (`ssm_bytes_per_token` is per layer, e.g. `conventional(M_S).per_token`).
    Nemotron-3-Super, conventional fp32: 40 * 8 MiB / (8 * 512 B) = 81,920 tokens. `model`:
    a ModelShape or a name of lowprec.models."""
    model = models.get(model)
    if not ssm_bytes_per_token > 0:
        raise ValueError(f"ssm_bytes_per_token: expected > 0, got {ssm_bytes_per_token}")
    if model.n_attention_layers == 0:
        return math.inf
    kv_per_step_per_context_token = model.n_attention_layers * kv_bytes_per_token(model.attention)
    return model.n_ssm_layers * ssm_bytes_per_token / kv_per_step_per_context_token
