"""The memory-traffic model (`lowprec.traffic`, `lowprec.models`, `experiments.traffic`).

Every rule is checked against a small case computed by hand, with deliberately odd sizes
(6 heads, d_v 5, d_k 96, 3 groups), and against the numbers DESIGN.md quotes for
Nemotron-3-Super; the GDN and KDA records against the rings of the emulation and the byte
counts of the CuTe kernels. All arithmetic is on integers, so equalities are exact unless a
comment says why a tolerance is needed.
"""

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest

from experiments import traffic as experiment
from lowprec import models
from lowprec import traffic as tr

NEMOTRON = models.get("nemotron3-super")
QWEN = models.get("qwen3-next-80b")
KIMI = models.get("kimi-linear-48b")
TOY = models.SSMLayerShape(kind="mamba2", nheads=6, d_v=5, d_k=96, ngroups=3)
TOY_GDN = models.SSMLayerShape(kind="gdn", nheads=6, d_v=5, d_k=96, ngroups=3)
TOY_KDA = models.SSMLayerShape(kind="kda", nheads=6, d_v=5, d_k=96, ngroups=3)

# Hand counts for TOY: 6 * 5 * 96 = 2880 elements.
TOY_FP32 = 2880 * 4  # 11520
TOY_FP16 = 2880 * 2  # 5760
TOY_NVFP4 = 1440 + 2880 // 16 + 6 * 4  # nibbles + E4M3 per 16 + fp32 per head = 1644
TOY_RECORD = 6 * (5 * 2 + 4) + 3 * 96 * 2  # x bf16 + dt fp32 per head, B bf16 per group = 660
# GDN, bf16, per head: u 20 (fp32) + v 10 + k 192 + g 4 + beta 4 written; a non-flush step
# reads u, k, g (216), the flush v, k, g, beta (210). KDA's g is 96 fp32 (384 B).
TOY_GDN_RECORD = tr.RecordBytes(6 * 230, 6 * 216, 6 * 210)  # 1380, 1296, 1260
TOY_KDA_RECORD = tr.RecordBytes(6 * 610, 6 * 596, 6 * 590)  # 3660, 3576, 3540


# ---------------------------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------------------------


def test_unknown_model_name_raises_and_lists_the_known_ones():
    with pytest.raises(ValueError, match="nemotron3-super") as info:
        models.get("mamba-9000")
    assert "qwen3-next-80b" in str(info.value) and "mamba-9000" in str(info.value)


def test_model_shape_rejects_groups_that_do_not_divide_heads():
    with pytest.raises(ValueError, match="ngroups"):
        models.SSMLayerShape(kind="mamba2", nheads=6, d_v=5, d_k=96, ngroups=4)
    with pytest.raises(ValueError, match="kind"):
        models.SSMLayerShape(kind="rwkv", nheads=6, d_v=5, d_k=96, ngroups=3)


def test_mamba2_2_7b_is_a_registered_pure_mamba2_model_with_its_provenance():
    """The kernel benchmarks' second shape lives here beside Nemotron's: 64 Mamba-2 layers of
    80 heads x 64 x 128 in one group, no attention layers (so no KV shape), with the source
    the benchmark gave it."""
    m2 = models.get("mamba2-2.7b")
    assert models.names() == ["nemotron3-super", "qwen3-next-80b", "mamba2-2.7b",
                              "kimi-linear-48b"]
    assert (m2.ssm.kind, m2.ssm.state_shape, m2.ssm.ngroups) == ("mamba2", (80, 64, 128), 1)
    assert (m2.n_ssm_layers, m2.n_attention_layers, m2.attention) == (64, 0, None)
    assert (m2.ssm.state_format, m2.act_format) == ("fp32", "bf16")
    assert "state-spaces/mamba2-2.7b" in m2.source and "headdim 64 (80 heads)" in m2.source
    assert models.MAMBA2_2_7B is m2


def test_model_shape_has_a_kv_shape_exactly_when_it_has_attention_layers():
    """attention is None for a model without attention layers and an AttentionShape for one
    with them: a KV shape beside 0 layers would be priced nowhere, None beside 8 failed in the
    first KV count (an AttributeError)."""
    ssm = models.SSMLayerShape(kind="mamba2", nheads=6, d_v=5, d_k=96, ngroups=3)
    kv = models.AttentionShape(n_kv_heads=3, head_dim=7)
    with pytest.raises(ValueError, match=r"attention: expected an AttentionShape for "
                                         r"n_attention_layers=5, got None"):
        models.ModelShape("toy", "test", 3, ssm, 5, None)
    with pytest.raises(ValueError, match=r"attention: expected an AttentionShape .*got 'bf16'"):
        models.ModelShape("toy", "test", 3, ssm, 5, "bf16")
    with pytest.raises(ValueError, match=r"attention: expected None for n_attention_layers=0, "
                                         r"got AttentionShape\(n_kv_heads=3"):
        models.ModelShape("toy", "test", 3, ssm, 0, kv)
    assert models.ModelShape("toy", "test", 3, ssm, 0, None).attention is None


@pytest.mark.parametrize("state_format, message", [
    ("fp6", r"state_format: expected one of \['fp64', 'fp32', .*'fp4_e2m1_b32'\], got 'fp6'"),
    ("FP32", r"state_format: expected one of \[.*\], got 'FP32'"),
    ("e4m3", r"state_format: expected one of \[.*\], got 'e4m3'"),  # an element, not a format
    (None, r"state_format: expected one of \[.*\], got None"),
    ("mxfp4", r"state_format: expected a format whose block divides d_k=48, got 'mxfp4' "
              r"\(blocks of 32\)"),
], ids=["misspelt", "upper-case", "element-name", "None", "block-not-dividing-d_k"])
def test_ssm_shape_refuses_a_state_format_the_traffic_model_cannot_price(state_format, message):
    """state_format is a lowprec.formats name (the names lowprec.traffic prices) whose block
    divides d_k, checked when the shape is made (naming the shape's field), not later by
    state_bytes."""
    with pytest.raises(ValueError, match=message):
        models.SSMLayerShape(kind="mamba2", nheads=6, d_v=5, d_k=48, ngroups=3,
                             state_format=state_format)


def test_ssm_shape_takes_every_format_the_traffic_model_prices():
    """Every name lowprec.formats and lowprec.traffic share is a state_format, fp64 included,
    and each prices: nvfp4 at d_k 48 (three blocks of 16), a per-row scale at any d_k."""
    for name in tr.STORAGE:
        d_k = 96 if name in ("mxfp4", "fp4_e2m1_b32") else 48
        ssm = models.SSMLayerShape(kind="gdn", nheads=6, d_v=5, d_k=d_k, ngroups=3,
                                   state_format=name)
        assert tr.state_bytes(ssm, ssm.state_format) > 0
    fp64 = models.SSMLayerShape(kind="mamba2", nheads=6, d_v=5, d_k=7, ngroups=2,
                                state_format="fp64")
    assert tr.state_bytes(fp64, fp64.state_format) == 6 * 5 * 7 * 8


# ---------------------------------------------------------------------------------------------
# Storage bytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, expected",
    [
        ("fp64", 23040),  # the reference's exact arm: 8 bytes an element, no scales
        ("fp32", 11520),
        ("fp16", 5760),
        ("bf16", 5760),
        ("fp8_e4m3", 2880),
        ("nvfp4", 1644),  # 1440 nibble bytes + 180 E4M3 block scales + 6 fp32 head scales
        ("mxfp4", 1530),  # 1440 + 90 E8M0 scales per 32
        ("fp8_e4m3_row", 3000),  # 2880 + 30 rows * 4 B
        ("fp4_e2m1_b16", 2160),  # 1440 + 180 blocks * 4 B
    ],
)
def test_state_bytes_of_a_toy_shape_match_hand_counts(fmt, expected):
    assert tr.state_bytes(TOY, fmt) == expected


def test_nemotron_state_and_record_bytes_match_design_md():
    """DESIGN.md: 4 MiB fp32 state, "576 KiB" NVFP4 read copy, 18,944-byte record. The exact
    NVFP4 figure is 576 KiB of codes and E4M3 scales plus 128 fp32 head scales (512 B)."""
    assert tr.state_bytes(NEMOTRON.ssm, "fp32") == 4 * tr.MIB
    assert tr.state_bytes(NEMOTRON.ssm, "nvfp4") == 576 * tr.KIB + 512
    assert tr.record_bytes(NEMOTRON.ssm, "kernel") == 128 * (64 * 2 + 4) + 8 * 128 * 2 == 18944
    assert tr.record_bytes(NEMOTRON.ssm, "conservative") == 128 * (2 * 64 + 2 * 128 + 4) == 49664


def test_record_bytes_of_toy_shapes_match_hand_counts():
    assert tr.record_bytes(TOY, "kernel") == TOY_RECORD
    assert tr.record_bytes(TOY, "conservative") == 6 * (2 * 5 + 2 * 96 + 4)  # 1236
    # every Mamba-2 step reads the whole record
    assert tr.ring_record(TOY) == tr.RecordBytes(TOY_RECORD, TOY_RECORD, TOY_RECORD)
    # fp32 activations double the x and B fields, not dt.
    assert tr.record_bytes(TOY, "kernel", "fp32") == 6 * (5 * 4 + 4) + 3 * 96 * 4  # 1296


@pytest.mark.parametrize("layout", tr.RECORD_LAYOUT_NAMES)
def test_gdn_and_kda_records_split_into_what_each_step_reads(layout):
    """u fp32 [d_v], v and k in the activations, g fp32 (GDN one a head, KDA one a channel of
    d_k), beta fp32, every field per value head in both layouts (the groups play no part);
    a non-flush step reads u, k, g, the flush v, k, g, beta. fp32 activations: GDN v 20 and
    k 384 a head, so 6 * (20 + 20 + 384 + 8) written, 6 * (20 + 384 + 4) and 6 * (20 + 384 +
    8) read."""
    assert tr.ring_record(TOY_GDN, layout) == TOY_GDN_RECORD
    assert tr.ring_record(TOY_KDA, layout) == TOY_KDA_RECORD
    assert tr.record_bytes(TOY_KDA, layout) == 3660
    assert tr.ring_record(TOY_GDN, layout, "fp32") == tr.RecordBytes(2592, 2448, 2472)
    one_group = models.SSMLayerShape(kind="gdn", nheads=6, d_v=5, d_k=96, ngroups=1)
    assert tr.ring_record(one_group, layout) == TOY_GDN_RECORD


def test_record_functions_refuse_what_they_cannot_price():
    with pytest.raises(TypeError, match="ssm: expected an SSMLayerShape, got tuple"):
        tr.ring_record((6, 5, 96))
    with pytest.raises(ValueError, match=r"record.flush_read: expected an integer >= 0, got -1"):
        tr.replay(4, tr.RecordBytes(10, 10, -1), TOY_FP32)
    with pytest.raises(ValueError, match=r"record.nonflush_read: expected an integer >= 1, "
                                         r"got 0"):
        tr.optimal_window(TOY_FP32, tr.RecordBytes(10, 0, 10))


def test_qwen3_next_shape_bytes():
    """32 heads of u 512 + v 256 + k 256 + g 4 + beta 4 = 1,032 B a head; the non-flush step
    reads 772 of them, the flush 520."""
    assert tr.state_bytes(QWEN.ssm, "fp32") == 32 * 128 * 128 * 4 == 2 * tr.MIB
    assert tr.ring_record(QWEN.ssm) == tr.RecordBytes(32 * 1032, 32 * 772, 32 * 520)
    assert tr.record_bytes(QWEN.ssm, "kernel") == 33024
    assert tr.kv_bytes_per_token(QWEN.attention) == 2 * 2 * 256 * 2


def test_kimi_linear_is_a_registered_kda_model_with_its_provenance():
    """Kimi-Linear-48B-A3B: 20 KDA layers of 32 heads, d_k = d_v = 128 (one key a head, the
    decay per channel), 7 MLA layers caching one 576-wide bf16 latent a token (1,152 B);
    a record is 32 * (512 + 256 + 256 + 512 + 4) = 49,280 B."""
    ssm = KIMI.ssm
    assert (ssm.kind, ssm.state_shape, ssm.ngroups, ssm.state_format) == (
        "kda", (32, 128, 128), 32, "fp32")
    assert (KIMI.n_ssm_layers, KIMI.n_attention_layers, KIMI.act_format) == (20, 7, "bf16")
    assert "Kimi-Linear-48B-A3B" in KIMI.source and "num_heads 32, head_dim 128" in KIMI.source
    assert tr.kv_bytes_per_token(KIMI.attention) == 1 * 576 * 2
    assert tr.ring_record(ssm) == tr.RecordBytes(32 * 1540, 32 * 1280, 32 * 1028)
    # 20 * 4 MiB / (7 * 1,152 B) tokens of MLA reads weigh as much as conventional decoding
    assert tr.crossover_context(KIMI, 4 * tr.MIB) == pytest.approx(20 * 4 * tr.MIB / (7 * 1152))
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match=r"kv_tensors: expected 1 \(MLA\) or 2"):
            models.AttentionShape(n_kv_heads=1, head_dim=576, kv_tensors=bad)


def test_error_growth_layer_presets_are_the_registered_layer_shapes():
    """The emulation's GPU presets run the whole GDN and KDA layers (and Nemotron's Mamba-2
    layer) at the shapes this model registers."""
    from experiments.error_growth_cli import PRESETS

    for preset, model in (("gdn-gpu", QWEN), ("kda-gpu", KIMI), ("emulation-gpu", NEMOTRON)):
        p = PRESETS[preset]
        assert p["recurrence"] == model.ssm.kind, preset
        assert (p["heads"], p["dv"], p["dk"]) == model.ssm.state_shape, preset


def test_storage_table_agrees_with_lowprec_formats():
    """The local table must give the bytes `lowprec.formats.Format.nbytes` gives, scales
    included, for every format and shape used here."""
    from lowprec import formats

    for name in tr.STORAGE:
        for ssm in (TOY, TOY_GDN, TOY_KDA, NEMOTRON.ssm, QWEN.ssm, KIMI.ssm):
            assert tr.state_bytes(ssm, name) == formats.get(name).nbytes(ssm.state_shape), name


def test_storage_table_prices_every_format_of_the_kit_and_fp64_elements_are_8_bytes():
    """The table names exactly lowprec.formats' formats, in its order, fp64 (the reference's
    exact arm) included: the traffic model prices every state lowprec.formats and the
    policies take."""
    from lowprec import formats

    assert list(tr.STORAGE) == formats.names()
    assert tr.element_bytes("fp64") == 8
    assert tr.state_bytes((7, 3, 5), "fp64") == 7 * 3 * 5 * 8
    assert tr.state_bytes(NEMOTRON.ssm, "fp64") == 8 * tr.MIB


def test_bad_format_layout_and_shape_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match="format"):
        tr.state_bytes(TOY, "fp6")
    # the names listed, fp64 among them; not a string is the same error
    for bad in ("FP32", ["fp32"], None):
        listed = r"format: expected one of \['fp64', 'fp32', 'fp16', .*'fp4_e2m1_b32'\], got "
        with pytest.raises(ValueError, match=listed + re.escape(repr(bad))):
            tr.state_bytes(TOY, bad)
        with pytest.raises(ValueError, match=r"format: expected one of \['fp64', "):
            tr.element_bytes(bad)
    with pytest.raises(ValueError, match="layout"):
        tr.record_bytes(TOY, "compact")
    with pytest.raises(ValueError, match="d_k"):
        tr.state_bytes((6, 5, 40), "mxfp4")  # 40 is not a multiple of 32


# ---------------------------------------------------------------------------------------------
# Standard decoding
# ---------------------------------------------------------------------------------------------


def test_conventional_reads_and_writes_the_whole_state_each_token():
    traffic = tr.conventional(TOY_FP32)
    assert (traffic.state_read, traffic.state_write, traffic.tokens) == (11520, 11520, 1)
    assert traffic.per_token == 2 * 11520


def test_replay_window_of_three_matches_a_hand_count():
    """L = 3, shared fp32 checkpoint: steps read the checkpoint 3 times and 0 + 1 + 2 records;
    the flush writes the checkpoint once; steps 1 and 2 write a record each."""
    traffic = tr.replay(3, TOY_RECORD, TOY_FP32)
    assert traffic.state_read == 3 * 11520
    assert traffic.state_write == 11520
    assert traffic.record_read == 3 * 660
    assert traffic.record_write == 2 * 660
    assert traffic.per_token == (34560 + 11520 + 1980 + 1320) / 3  # 16460


def test_two_precision_window_reads_the_read_copy_except_at_the_flush():
    """L = 3, fp16 hi + nvfp4 lo: two non-flush steps read lo (1644 B), the flush reads hi
    (5760 B) and writes hi and lo; L = 1 flushes every step and touches no record."""
    traffic = tr.replay(3, TOY_RECORD, TOY_NVFP4, TOY_FP16)
    assert traffic.state_read == 2 * 1644 + 5760
    assert traffic.state_write == 5760 + 1644
    assert (traffic.record_read, traffic.record_write) == (3 * 660, 2 * 660)
    every_step = tr.replay(1, TOY_RECORD, TOY_NVFP4, TOY_FP16)
    assert every_step.total == 5760 + 5760 + 1644
    assert (every_step.record_read, every_step.record_write) == (0, 0)


def test_a_gdn_window_reads_of_each_record_what_its_step_needs():
    """L = 4, fp16 hi + nvfp4 lo, GDN records (w 1380, s 1296, f 1260): the non-flush steps
    read 0 + 1 + 2 records' u, k, g (3 s), the flush the whole ring's v, k, g, beta (3 f);
    3 records written. A plain int prices every read as a whole record."""
    traffic = tr.replay(4, TOY_GDN_RECORD, TOY_NVFP4, TOY_FP16)
    assert traffic.state_read == 3 * 1644 + 5760 and traffic.state_write == 5760 + 1644
    assert traffic.record_read == 3 * 1296 + 3 * 1260  # 7668
    assert traffic.record_write == 3 * 1380
    whole = tr.replay(4, 1380, TOY_NVFP4, TOY_FP16)
    assert whole.record_read == 6 * 1380 and whole.record_write == traffic.record_write


@pytest.mark.parametrize("record", [TOY_GDN_RECORD, TOY_KDA_RECORD], ids=["gdn", "kda"])
@pytest.mark.parametrize("window", [1, 2, 7, 16, 33])
def test_replay_with_split_records_equals_its_closed_form(record, window):
    """Per window L lo + F + s (L-1)(L-2)/2 + (f + w)(L - 1), F = flush_overhead."""
    L, s, f, w = window, record.nonflush_read, record.flush_read, record.write
    F = tr.flush_overhead(TOY_NVFP4, TOY_FP16)
    expected = L * TOY_NVFP4 + F + s * (L - 1) * (L - 2) // 2 + (f + w) * (L - 1)
    assert tr.replay(L, record, TOY_NVFP4, TOY_FP16).total == expected


@pytest.mark.parametrize("window", [1, 2, 7, 16, 33])
def test_replay_per_token_equals_the_closed_form(window):
    """(L+1)/L * M_S + r (L-1)(L+2) / (2L), in exact fractions."""
    M, r, L = TOY_FP32, TOY_RECORD, window
    expected = Fraction(L + 1, L) * M + Fraction(r * (L - 1) * (L + 2), 2 * L)
    assert Fraction(tr.replay(L, r, M).total, L) == expected


@pytest.mark.parametrize("window", [1, 3, 16, 61])
def test_replay_ratio_tends_to_half_plus_half_over_L_as_records_vanish(window):
    """Over conventional decoding the ratio is (L+1)/(2L) + r (L-1)(L+2) / (4 L M_S): exactly
    the limit at r = 0, and the excess shrinks in proportion to r."""
    M, L = tr.state_bytes(NEMOTRON.ssm, "fp32"), window
    limit = Fraction(L + 1, 2 * L)
    conventional = tr.conventional(M).total
    assert Fraction(tr.replay(L, 0, M).total, L * conventional) == limit
    excesses = []
    for record in (18944, 1894, 189, 19, 2, 1):
        ratio = Fraction(tr.replay(L, record, M).total, L * conventional)
        excess = ratio - limit
        assert excess == Fraction(record * (L - 1) * (L + 2), 4 * L * M)
        excesses.append(excess)
    assert excesses == sorted(excesses, reverse=True)
    assert excesses[-1] < Fraction(1, 10**5)


def test_nemotron_replay_at_L16_moves_the_numbers_the_summary_reports():
    """L = 16, fp32, conservative records: (17/16) 4 MiB + 49,664 (15 * 18) / 32 over 8 MiB."""
    M = 4 * tr.MIB
    ratio = tr.replay(16, 49664, M).per_token / tr.conventional(M).per_token
    assert ratio == pytest.approx((17 / 16 * M + 49664 * 270 / 32) / (8 * tr.MIB), rel=1e-15)
    assert ratio == pytest.approx(0.58120346, abs=1e-8)


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------


def test_snapshot_step_reads_one_state_and_writes_T():
    traffic = tr.snapshot_spec(TOY_FP32, verified=3, committed=2)
    assert (traffic.state_read, traffic.state_write, traffic.tokens) == (11520, 3 * 11520, 2)
    assert tr.snapshot_spec(TOY_FP32, 1, 1) == tr.conventional(TOY_FP32)


def test_replay_spec_trace_matches_a_hand_count_with_every_draft_rejected():
    """L = 4, T = 2, c = 1, from an empty ring: h = 0, 1, 2 are non-flush (h + 2 <= 4); h = 3
    flushes (3 + 2 > 4) and leaves h = c = 1, so the steady cycle is h = 1, 2, 3: three steps,
    three tokens, 3 checkpoint reads, 1 write, 1 + 2 + 3 records read, 3 * 2 drafts written."""
    steps, start = tr.replay_spec_trace(4, 2, 1, TOY_RECORD, TOY_FP32)
    assert [s.record_read // TOY_RECORD for s in steps] == [0, 1, 2, 3]
    assert [s.flushes for s in steps] == [0, 0, 0, 1]
    assert start == 1
    cycle = tr.replay_spec(4, 2, 1, TOY_RECORD, TOY_FP32)
    assert (cycle.tokens, cycle.steps, cycle.flushes) == (3, 3, 1)
    assert cycle.state_read == 3 * 11520 and cycle.state_write == 11520
    assert cycle.record_read == 6 * 660 and cycle.record_write == 6 * 660
    assert cycle.per_token == (4 * 11520 + 12 * 660) / 3  # 18000


def test_replay_spec_with_every_draft_accepted_matches_a_hand_count():
    """L = 4, T = 2, c = 2: h = 0 -> 2 -> 4, and h = 4 flushes (6 > 4) back to h = 2. Cycle
    h = 2 (non-flush), h = 4 (flush): 4 tokens, 3 state transfers, 2 + 4 records read,
    2 * 2 written."""
    cycle = tr.replay_spec(4, 2, 2, TOY_RECORD, TOY_FP32)
    assert (cycle.tokens, cycle.steps, cycle.flushes) == (4, 2, 1)
    assert cycle.total == 3 * 11520 + 10 * 660
    assert cycle.per_token == 10290


def test_replay_spec_with_two_copies_reads_hi_only_on_flush_steps():
    """Same cycle as the hand count above (h = 1, 2, 3; the last flushes), two copies:
    lo read twice, hi read once, hi + lo written once."""
    cycle = tr.replay_spec(4, 2, 1, TOY_RECORD, TOY_NVFP4, TOY_FP16)
    assert cycle.state_read == 2 * 1644 + 5760
    assert cycle.state_write == 5760 + 1644


@pytest.mark.parametrize("window", [1, 2, 5, 16, 40])
def test_replay_spec_at_T1_costs_one_record_per_token_more_than_standard_decoding(window):
    """At T = 1 the speculative flush folds only records committed before it (h = L of them)
    and writes its own record; the standard flush folds its own token too. Per window that is
    L more record reads and one more record write: r (L + 1) / L per token."""
    M, r, L = TOY_FP32, TOY_RECORD, window
    spec = tr.replay_spec(L, 1, 1, r, M)
    standard = tr.replay(L, r, M)
    assert spec.tokens == standard.tokens == L
    assert spec.total - standard.total == r * (L + 1)


def test_replay_spec_trace_of_gdn_records_reads_what_each_step_needs():
    """The hand count above with GDN records: the non-flush steps of the cycle (h = 1, 2) read
    3 s, the flush (h = 3) reads 3 f; 3 steps write 2 drafts each."""
    cycle = tr.replay_spec(4, 2, 1, TOY_GDN_RECORD, TOY_FP32)
    assert (cycle.tokens, cycle.steps, cycle.flushes) == (3, 3, 1)
    assert cycle.record_read == 3 * 1296 + 3 * 1260
    assert cycle.record_write == 6 * 1380
    assert tr.replay_memory(16, 4, TOY_KDA_RECORD, TOY_FP32) == 11520 + 20 * 3660


# an odd KDA head whose state outweighs 8 records' fixed cost (TOY_KDA's does not)
ODD_KDA = models.SSMLayerShape(kind="kda", nheads=3, d_v=37, d_k=48, ngroups=1)
SPEC_SHAPES = [TOY, NEMOTRON.ssm, ODD_KDA, QWEN.ssm]
SPEC_IDS = ["toy", "nemotron", "odd-kda", "qwen"]


@pytest.mark.parametrize("ssm", SPEC_SHAPES, ids=SPEC_IDS)
@pytest.mark.parametrize("verified, committed", [(2, 1), (2, 2), (3, 2), (5, 1), (5, 3), (8, 8)])
def test_replay_spec_cycle_equals_its_closed_form(ssm, verified, committed):
    """With c = a every step, the cycle holds h = a, 2a, ..., N a, the last flushing, with
    N = floor((L - T) / a) + 1 for L >= T; per committed token
    M_S / a + M_S / (a N) + s (N - 1) / 2 + f + w T / a (`r (N + 1) / 2 + r T / a` for
    Mamba-2, whose steps read whole records)."""
    M, T, a = tr.state_bytes(ssm, "fp32"), verified, committed
    r = tr.ring_record(ssm)
    s, f, w = r.nonflush_read, r.flush_read, r.write
    for L in range(T, T + 3 * a + 20):
        N = (L - T) // a + 1
        expected = (Fraction(M, a) + Fraction(M, a * N) + Fraction(s * (N - 1), 2) + f
                    + Fraction(w * T, a))
        cycle = tr.replay_spec(L, T, a, r, M)
        assert cycle.steps == N
        assert Fraction(cycle.total, cycle.tokens) == expected


def test_nemotron_spec_T4_numbers():
    """L = 16, T = 4, fp32, kernel records. All accepted: h = 4, 8, 12, 16 (flush), 16 tokens,
    (5 M + 56 r) / 16. All rejected: h = 1..13 (13 flushes), (14 M + 143 r) / 13. Snapshots:
    5 M / 4 and 5 M."""
    M, r = 4 * tr.MIB, 18944
    assert tr.replay_spec(16, 4, 4, r, M).per_token == (5 * M + 56 * r) / 16
    assert tr.replay_spec(16, 4, 1, r, M).per_token == (14 * M + 143 * r) / 13
    assert tr.snapshot_spec(M, 4, 4).per_token == 5 * M / 4
    assert tr.snapshot_spec(M, 4, 1).per_token == 5 * M


def test_spec_arguments_are_validated():
    with pytest.raises(ValueError, match="committed"):
        tr.replay_spec(16, 2, 3, TOY_RECORD, TOY_FP32)
    with pytest.raises(ValueError, match="committed"):
        tr.snapshot_spec(TOY_FP32, 4, 0)
    with pytest.raises(ValueError, match="window"):
        tr.replay(0, TOY_RECORD, TOY_FP32)
    with pytest.raises(ValueError, match="verified"):
        tr.replay_spec(16, 0, 1, TOY_RECORD, TOY_FP32)


# ---------------------------------------------------------------------------------------------
# Optimal window
# ---------------------------------------------------------------------------------------------


def _standard_cases():
    nemo = NEMOTRON.ssm
    M, kernel = tr.state_bytes(nemo, "fp32"), tr.record_bytes(nemo, "kernel")
    conservative = tr.record_bytes(nemo, "conservative")
    hi, lo = tr.state_bytes(nemo, "fp16"), tr.state_bytes(nemo, "nvfp4")
    return [
        ("nemotron fp32 kernel", kernel, M, None),
        ("nemotron fp32 conservative", conservative, M, None),
        ("nemotron fp16+nvfp4", kernel, lo, hi),
        ("nemotron nvfp4 shared", kernel, lo, None),
        ("toy fp32", TOY_RECORD, TOY_FP32, None),
        ("toy fp16+nvfp4", TOY_RECORD, TOY_NVFP4, TOY_FP16),
        ("qwen fp32", tr.ring_record(QWEN.ssm), tr.state_bytes(QWEN.ssm, "fp32"), None),
        ("kimi fp16+nvfp4", tr.ring_record(KIMI.ssm), tr.state_bytes(KIMI.ssm, "nvfp4"),
         tr.state_bytes(KIMI.ssm, "fp16")),
        ("toy gdn fp32", TOY_GDN_RECORD, TOY_FP32, None),
        ("toy kda fp16+nvfp4", TOY_KDA_RECORD, TOY_NVFP4, TOY_FP16),
    ]


@pytest.mark.parametrize("name, record, read_copy, recurrence_copy", _standard_cases(),
                         ids=[case[0] for case in _standard_cases()])
def test_optimal_window_is_the_brute_force_minimum_in_standard_decoding(
        name, record, read_copy, recurrence_copy):
    """Per token `replay` is const + (F + s - f - w) / L + s L / 2 (F = flush_overhead), a
    convex function of L least at L* = sqrt(2 (F + s - f - w) / s) (sqrt(2 (F / r - 1)) when
    every step reads whole records): the best integer window is floor(L*) or ceil(L*)."""
    flush = tr.flush_overhead(read_copy, recurrence_copy)
    L_star = tr.optimal_window(flush, record)
    best = tr.best_window(
        lambda L: Fraction(tr.replay(L, record, read_copy, recurrence_copy).total, L),
        range(1, 4 * math.ceil(L_star) + 10))
    assert best in (math.floor(L_star), math.ceil(L_star)), (name, L_star, best)


def test_nemotron_optimal_window_is_21():
    """sqrt(2 (4 MiB / 18,944 - 1)) = 20.995."""
    assert tr.optimal_window(4 * tr.MIB, 18944) == pytest.approx(20.99549501, abs=1e-8)


@pytest.mark.parametrize("ssm", SPEC_SHAPES, ids=SPEC_IDS)
@pytest.mark.parametrize("verified, committed", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4),
                                                 (8, 1), (8, 4), (8, 8)])
def test_spec_optimal_window_formula_is_near_the_brute_force_minimum(ssm, verified, committed):
    """The speculative cycle costs const + M_S / (a N) + s N / 2 per token (N steps per cycle;
    s the bytes a non-flush step reads of a record), so (1) the brute-force best window has N
    in {floor(N*), ceil(N*)}, N* = sqrt(2 M_S / (a s)); (2) the formula's window, whose cycle
    has N_f steps, costs s (N_f - N*)^2 / (2 N_f) more than the continuous optimum, out of at
    least M_S / a = s N*^2 / 2: a relative excess over the brute-force minimum of at most
    (N_f - N*)^2 / (N_f N*^2); for Nemotron that is < 1%."""
    M, r, T, a = tr.state_bytes(ssm, "fp32"), tr.ring_record(ssm), verified, committed
    if M <= T * (r.flush_read + r.write - r.nonflush_read):
        pytest.skip("records as large as the state: the formula is undefined")

    def cost(L):
        return tr.replay_spec(L, T, a, r, M).per_token

    best = tr.best_window(cost, range(T, 400))  # T <= L
    N_star = math.sqrt(2 * M / (a * r.nonflush_read))
    assert tr.replay_spec(best, T, a, r, M).steps in (math.floor(N_star), math.ceil(N_star))
    L_formula = max(T, round(tr.optimal_window(M, r, T, a)))
    N_formula = tr.replay_spec(L_formula, T, a, r, M).steps
    excess = cost(L_formula) / cost(best) - 1
    assert excess <= (N_formula - N_star) ** 2 / (N_formula * N_star**2) + 1e-12
    if ssm is NEMOTRON.ssm:
        assert excess < 0.01


def test_optimal_window_rejects_records_as_large_as_the_state():
    with pytest.raises(ValueError, match="state"):
        tr.optimal_window(4 * 372, 372, verified=4)
    with pytest.raises(ValueError, match="mean_committed"):
        tr.optimal_window(TOY_FP32, TOY_RECORD, verified=2, mean_committed=3)


# ---------------------------------------------------------------------------------------------
# The GDN and KDA records against the kit's rings and kernels
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_delta_rule_records_are_the_emulation_rings_and_what_its_steps_load(kind):
    """A record is one position of the emulation's five rings (bf16 activations, an odd head:
    3 heads of d_v 5, d_k 48); a non-flush step's bytes are those of the rings `load_ring`
    takes, the flush's those `fold_ring` takes (their pointer arguments, p_r*)."""
    import torch

    from emulation import gdn_replay_decode as emu

    cache = emu.GDNReplayCache.empty(2, 3, 5, 48, per_channel=kind == "kda", window=4,
                                     act_dtype=torch.bfloat16)
    rings = {"p_ru": cache.ring_u, "p_rv": cache.ring_v, "p_rk": cache.ring_k,
             "p_rg": cache.ring_g, "p_rbeta": cache.ring_beta}

    def position_bytes(pointers):  # one slot, every head, ring position 0
        return sum(rings[p][0, :, 0].numel() * rings[p].element_size() for p in pointers)

    def ring_args(fn):
        return [name for name in fn.arg_names if name in rings]

    ssm = models.SSMLayerShape(kind=kind, nheads=3, d_v=5, d_k=48, ngroups=1)
    assert tr.ring_record(ssm) == tr.RecordBytes(position_bytes(rings),
                                                 position_bytes(ring_args(emu.load_ring)),
                                                 position_bytes(ring_args(emu.fold_ring)))


@pytest.mark.parametrize("pairing, act", [(("fp16", "nvfp4"), "bf16"), (("fp32", "none"), "bf16"),
                                          (("fp16", "nvfp4"), "fp32")],
                         ids=["fp16-nvfp4-bf16", "fp32-bf16", "fp16-nvfp4-fp32-act"])
def test_gdn_window_moves_what_the_cute_kernels_count(pairing, act):
    """An odd GDN layer (5 slots, 3 heads of d_v 48, d_k 256, L = 13): every non-flush step
    (cursor c = 0..L-2) and the flush move, by `cute_kernels.gdn_replay_{output,flush}.
    traffic_bytes`, this model's state and record bytes plus what both leave to the caller:
    the token's q, k, v (act), g, beta (fp32) read and y written; and the flush's append of
    v, k, g, beta (no u) at position L-1, kept so the rings of both implementations agree but
    never read, so not priced by `replay`. Summed over the window: `replay`'s total."""
    from cute_kernels import gdn_replay_flush as gf
    from cute_kernels import gdn_replay_output as go

    hi_format, lo_format = pairing
    slots, nheads, dv, dk, L = 5, 3, 48, 256, 13
    ssm = models.SSMLayerShape(kind="gdn", nheads=nheads, d_v=dv, d_k=dk, ngroups=1)
    a = tr.element_bytes(act)
    record = tr.ring_record(ssm, "kernel", act)
    hi = tr.state_bytes(ssm, hi_format)
    lo = None if lo_format == "none" else tr.state_bytes(ssm, lo_format)
    token = nheads * ((2 * dk + dv) * a + 8 + dv * a)
    flush_append = record.write - nheads * dv * 4  # the record without its fp32 u
    read_copy = hi if lo is None else lo
    for c in range(L - 1):
        expected = slots * (read_copy + c * record.nonflush_read + record.write + token)
        assert go.traffic_bytes(lo_format, act, slots, nheads, dv, dk, c) == expected, c
    state = hi + hi + (lo or 0)  # hi read, both copies written
    flush = gf.traffic_bytes(hi_format, lo_format, act, slots, nheads, dv, dk, L)
    assert flush == slots * (state + (L - 1) * record.flush_read + token + flush_append)
    window = tr.replay(L, record, read_copy, None if lo is None else hi)
    kernels = flush + sum(go.traffic_bytes(lo_format, act, slots, nheads, dv, dk, c)
                          for c in range(L - 1))
    assert kernels == slots * (window.total + L * token + flush_append)


# ---------------------------------------------------------------------------------------------
# Memory and the attention comparison
# ---------------------------------------------------------------------------------------------


def test_memory_per_request_counts_states_or_one_checkpoint_and_L_plus_T_records():
    assert tr.snapshot_memory(TOY_FP32, 1) == 11520
    assert tr.snapshot_memory(TOY_FP32, 4) == 4 * 11520
    assert tr.replay_memory(16, 4, TOY_RECORD, TOY_FP32) == 11520 + 20 * 660
    assert tr.replay_memory(16, 4, TOY_RECORD, TOY_NVFP4, TOY_FP16) == 1644 + 5760 + 20 * 660


def test_requests_that_fit_in_memory():
    """Nemotron, conventional fp32: 40 layers * 4 MiB = 160 MiB a request; at 32,768 tokens
    the 8 attention layers add 8 * 512 B * 32768 = 128 MiB."""
    per_request = tr.request_bytes(NEMOTRON, 4 * tr.MIB)
    assert per_request == 160 * tr.MIB
    assert tr.requests_fit(140 * 2**30, per_request) == 896
    with_kv = tr.request_bytes(NEMOTRON, 4 * tr.MIB, context=32768)
    assert with_kv == 288 * tr.MIB
    assert tr.requests_fit(288 * tr.MIB - 1, with_kv) == 0


def test_attention_comparison_for_nemotron_and_qwen():
    """Nemotron: 512 B of fp8 KV a token, 4 MiB / 512 B = 8192 tokens a state, and the KV reads
    of 8 layers equal 40 layers' 8 MiB at 40 * 8 MiB / (8 * 512 B) = 81,920 tokens.
    Qwen3-Next: 2 KiB of bf16 KV, 1024 tokens a state, 36 * 4 MiB / (12 * 2 KiB) = 6144."""
    assert tr.kv_bytes_per_token(NEMOTRON.attention) == 512
    assert tr.state_equivalent_kv_tokens(4 * tr.MIB, 512) == 8192
    assert tr.crossover_context(NEMOTRON, 8 * tr.MIB) == 81920
    qwen_state = tr.state_bytes(QWEN.ssm, "fp32")
    assert tr.state_equivalent_kv_tokens(qwen_state, 2048) == 1024
    assert tr.crossover_context(QWEN, tr.conventional(qwen_state).per_token) == 6144


# ---------------------------------------------------------------------------------------------
# The experiment script
# ---------------------------------------------------------------------------------------------

SUMMARY_KEYS = {
    "state_mib", "kv_kib_per_token", "state_equiv_kv_tokens", "crossover_context_tokens",
    "record_bytes_kernel", "record_bytes_conservative", "replay_ratio_conservative",
    "conventional_mib_per_token", "replay_mib_per_token", "optimal_window",
    "two_precision_mib_per_token", "spec",
}


def test_summary_prints_exactly_one_json_object_with_its_documented_keys(capsys, tmp_path):
    experiment.main(["--summary", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    summary = json.loads(out)  # fails on anything but exactly one JSON document
    assert SUMMARY_KEYS <= summary.keys()
    assert list(tmp_path.iterdir()) == []  # --summary writes nothing
    assert summary["state_mib"] == 4.0
    assert summary["kv_kib_per_token"] == 0.5
    assert summary["state_equiv_kv_tokens"] == 8192
    assert summary["crossover_context_tokens"] == 81920
    assert summary["record_bytes_kernel"] == 18944
    assert summary["record_bytes_conservative"] == 49664
    assert summary["conventional_mib_per_token"] == 8.0
    # (17/16) 4 MiB + 18,944 * 270 / 32 B = 4.402435 MiB
    assert summary["replay_mib_per_token"] == pytest.approx(4.402435, abs=1e-6)
    # 590,336 (nvfp4) + 2 * 2 MiB / 16 + 18,944 * 270 / 32 = 1,012,320 B
    assert summary["two_precision_mib_per_token"] == pytest.approx(1012320 / tr.MIB, abs=1e-6)
    assert summary["optimal_window_brute_force"] == 21
    spec = summary["spec"]
    assert spec["snapshot_all_accepted"] == 5.0 and spec["snapshot_all_rejected"] == 20.0
    assert spec["replay_all_accepted"] < spec["replay_all_rejected"] < spec["plain_conventional"]


def test_a_model_without_attention_is_priced_without_kv(capsys):
    """mamba2-2.7b (64 Mamba-2 layers, no attention) is a --model: its state and records are
    counted by hand, a request keeps no KV at any context, and the summary's KV entries are
    null (there is no KV to weigh a state against, and no crossover)."""
    m2 = models.get("mamba2-2.7b")
    assert tr.state_bytes(m2.ssm, "fp32") == 80 * 64 * 128 * 4 == 5 * tr.MIB // 2
    assert tr.record_bytes(m2.ssm, "kernel") == 80 * (64 * 2 + 4) + 1 * 128 * 2 == 10816
    assert tr.request_bytes(m2, 12345, context=32768) == 64 * 12345
    assert tr.request_bytes("mamba2-2.7b", 7, context=0) == 64 * 7
    assert tr.crossover_context(m2, 1.0) == math.inf
    experiment.main(["--summary", "--model", "mamba2-2.7b"])
    summary = json.loads(capsys.readouterr().out)
    assert SUMMARY_KEYS <= summary.keys() and summary["model"] == "mamba2-2.7b"
    assert summary["kv_kib_per_token"] is None
    assert summary["state_equiv_kv_tokens"] is None
    assert summary["crossover_context_tokens"] is None
    assert summary["state_mib"] == 2.5 and summary["record_bytes_kernel"] == 10816
    assert summary["conventional_mib_per_token"] == 5.0
    memory = experiment.memory_sweep(experiment.Config(model="mamba2-2.7b", memory_gib=(3.0,),
                                                       contexts=(0, 4097)))
    by_context = memory.groupby("context").per_request_bytes.apply(list)
    assert by_context[0] == by_context[4097]  # no KV: the context changes nothing


def test_the_kda_model_runs_as_the_others_do(capsys, tmp_path):
    """--model kimi-linear-48b: the summary prices its KDA records (49,280 B, read 40,960 by a
    non-flush step) and MLA latent (1.125 KiB a token), its formula window lies beside the
    brute-force one, and a run writes the three sweeps (its default folder is under runs/:
    its results are not committed)."""
    experiment.main(["--summary", "--model", "kimi-linear-48b"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == "kimi-linear-48b" and summary["kv_kib_per_token"] == 1.125
    assert summary["record_bytes_kernel"] == summary["record_bytes_conservative"] == 49280
    assert summary["state_equiv_kv_tokens"] == pytest.approx(2 * tr.MIB / 1152)
    window = summary["optimal_window"]  # sqrt(2 (2 MiB + 40,960 - 32,896 - 49,280) / 40,960)
    assert window == pytest.approx(math.sqrt(2 * (2 * tr.MIB - 41216) / 40960), abs=1e-3)
    assert summary["optimal_window_brute_force"] in (math.floor(window), math.ceil(window))
    # (17/16) 2 MiB + (15 * 14 / 2 * 40,960 + 15 * (32,896 + 49,280)) / 16 B
    replay = (17 * 2 * tr.MIB + 105 * 40960 + 15 * 82176) / 16
    assert summary["replay_mib_per_token"] == pytest.approx(replay / tr.MIB, abs=1e-6)
    assert experiment.default_folder("kimi-linear-48b", 16, 4) == Path(
        "runs/traffic_kimi-linear-48b")
    config = experiment.Config(model="kimi-linear-48b", out_dir=tmp_path, windows=(1, 7),
                               verified=(1, 2), memory_gib=(2.0,))
    frame = experiment.run(config)
    assert set(frame.sweep) == {"window", "spec", "memory"} and set(frame.model) == {
        "kimi-linear-48b"}
    rows = frame[(frame.sweep == "window") & (frame.scheme == "replay_shared")
                 & (frame.read_format == "fp32") & (frame.window == 7)]
    assert list(rows.bytes_per_token) == [tr.replay(7, tr.ring_record(KIMI.ssm),
                                                    2 * tr.MIB).per_token] * 2  # both layouts


def test_help_describes_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        experiment.main(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    for option in ("--model", "--summary", "--out", "--window"):
        assert option in help_text


def test_out_naming_a_file_is_a_one_line_error(tmp_path, capsys):
    """--out is a folder; a file there is a one-line error."""
    (tmp_path / "a.csv").write_text("x\n")
    with pytest.raises(SystemExit) as info:
        experiment.main(["--out", str(tmp_path / "a.csv"), "--no-plot"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --out: expected a folder" in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["T past L", "out under a file", "window too long",
                                  "name too long"])
def test_unusable_arguments_are_one_line_errors_naming_the_flag(tmp_path, capsys, case):
    """T > L (lowprec.replay refuses it), an --out under a file (like /dev/null/x), a window
    past MAX_WINDOW (10^9 would run for hours) and a folder name past the file system's
    limit are refused before
    anything is written."""
    (tmp_path / "file").write_text("")
    argv, flag = {
        "T past L": (["--window", "7", "--spec-verified", "8", "--out", str(tmp_path)],
                     "--spec-verified"),
        "out under a file": (["--out", str(tmp_path / "file" / "x")], "--out"),
        "window too long": (["--window", str(experiment.MAX_WINDOW + 1), "--out", str(tmp_path)],
                            "--window"),
        "name too long": (["--out", str(tmp_path / ("x" * 300))], "--out"),
    }[case]
    with pytest.raises(SystemExit) as info:
        experiment.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"error: {flag}:" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("window", [1, 3, 5, 16])
def test_speculative_sweeps_keep_T_within_the_window(window):
    """T = L is allowed; the spec sweep's T runs to min(8, L)."""
    config = experiment.parse_args(["--window", str(window), "--spec-verified", str(window)])
    assert config.verified == tuple(range(1, min(8, window) + 1))
    assert set(experiment.spec_sweep(config).verified) == set(config.verified)


def test_run_writes_tidy_csvs_that_plot_reads(tmp_path):
    config = experiment.Config(out_dir=tmp_path, windows=(1, 5, 16), verified=(1, 3, 4),
                               memory_gib=(1.0, 3.0))
    frame = experiment.run(config)
    assert {"window", "spec", "memory"} == set(frame.sweep)
    window = pd.read_csv(tmp_path / "traffic_window_nemotron3-super.csv")
    assert "git_commit" not in window.columns and "device" not in window.columns
    meta = json.loads((tmp_path / "traffic_nemotron3-super.meta.json").read_text())
    assert meta["commit"] and meta["experiment"] == "experiments.traffic"
    row = window[(window.scheme == "replay_shared") & (window.read_format == "fp32")
                 & (window.record_layout == "kernel") & (window.window == 16)]
    assert row.bytes_per_token.item() == pytest.approx(tr.replay(16, 18944, 4 * tr.MIB).per_token,
                                                       rel=1e-9)  # CSV keeps 10 digits
    spec = pd.read_csv(tmp_path / "traffic_spec_nemotron3-super.csv")
    assert len(spec) == 3 * (1 + 3 + 4)  # three schemes, every c in 1..T
    memory = pd.read_csv(tmp_path / "traffic_memory_nemotron3-super.csv")
    # 1 GiB / 160 MiB = 6 conventional requests with no KV.
    conventional = memory[(memory.scheme == "conventional") & (memory.context == 0)
                          & (memory.memory_gib == 1.0)]
    assert conventional.requests.item() == 6
    for name in ("window", "spec", "memory"):
        png = experiment.plot(tmp_path / f"traffic_{name}_nemotron3-super.csv")
        assert png.exists() and png.stat().st_size > 10_000


def test_speculative_traffic_keeps_t_within_the_window_and_models_go_by_name():
    """T > L is refused as lowprec.replay refuses it, and the model-wide functions take a
    model's name as lowprec.models.get does."""
    with pytest.raises(ValueError, match="verified: expected T <= the window L = 4, got 6"):
        tr.replay_spec(4, 6, 2, 100, 10_000)
    with pytest.raises(ValueError, match="verified: expected T <= the window L = 4"):
        tr.replay_memory(4, 6, 100, 10_000)
    assert tr.request_bytes("nemotron3-super", 1000, 5) == tr.request_bytes(NEMOTRON, 1000, 5)
    assert tr.crossover_context("nemotron3-super", 8 * tr.MIB) == pytest.approx(81920)


@pytest.mark.parametrize("make, message", [
    (lambda: models.AttentionShape(n_kv_heads=2, head_dim=8, kv_format="fp8"),
     r"kv_format: expected one of \['fp64', 'fp32', 'fp16', 'bf16', 'fp8_e4m3', 'fp8_e5m2'\] "
     r"\(unscaled formats\), got 'fp8'"),
    (lambda: models.AttentionShape(n_kv_heads=2, head_dim=8, kv_format="nvfp4"),
     r"kv_format: expected one of .*, got 'nvfp4'"),
    (lambda: models.ModelShape("toy", "test", 3, models.SSMLayerShape("mamba2", 6, 5, 48, 3),
                               0, None, act_format="BF16"),
     r"act_format: expected one of \[.*'bf16'.*\] \(unscaled formats\), got 'BF16'"),
    (lambda: models.ModelShape("toy", "test", 3, models.SSMLayerShape("mamba2", 6, 5, 48, 3),
                               0, None, act_format=None),
     r"act_format: expected one of .*, got None"),
], ids=["kv-misspelt", "kv-block-format", "act-upper-case", "act-None"])
def test_model_shapes_refuse_a_kv_or_activation_format_the_traffic_model_cannot_price(
        make, message):
    """kv_format and act_format are unscaled lowprec.formats names (what
    lowprec.traffic.element_bytes prices); they were not checked, so a misspelt name made a
    model whose first traffic sweep failed, naming 'format' and not the field."""
    with pytest.raises(ValueError, match=message):
        make()


def test_every_unscaled_format_is_a_kv_and_activation_format_and_prices():
    ssm = models.SSMLayerShape("mamba2", 6, 5, 48, 3)
    for name in ("fp64", "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        kv = models.AttentionShape(n_kv_heads=3, head_dim=7, kv_format=name)
        model = models.ModelShape("toy", "test", 3, ssm, 2, kv, act_format=name)
        assert tr.element_bytes(model.act_format) == tr.element_bytes(kv.kv_format) >= 1


def test_plot_refuses_a_csv_that_is_not_a_traffic_sweep(tmp_path):
    """plot() of another CSV (error_growth's, or a sweep's header alone) is a ValueError
    naming the file, and draws nothing."""
    other = tmp_path / "other.csv"
    other.write_text("recurrence,arm,step,rel_err\nmamba2,shared,1,0.5\n")
    empty = tmp_path / "traffic_window_x.csv"
    empty.write_text("sweep,model,window\n")
    for csv, message in ((other, "expected a traffic_{window,spec,memory}_<model>.csv"),
                         (empty, "line 1: expected the columns")):
        with pytest.raises(ValueError, match=re.escape(f"{csv}: {message}")):
            experiment.plot(csv)
    assert not list(tmp_path.glob("*.png"))


def test_an_empty_out_is_refused(tmp_path, capsys, monkeypatch):
    """--out "" (an unset shell variable) wrote the CSVs and plots into the current folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        experiment.main(["--out", "", "--no-plot"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--out: expected a folder, got ''" in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("model, title", [
    ("nemotron3-super", "SSM state + KV at 32,768 tokens"),
    ("mamba2-2.7b", "SSM state at 32,768 tokens (no attention: no KV)"),
])
def test_memory_plot_names_a_kv_cache_only_for_a_model_that_has_one(model, title):
    """mamba2-2.7b has no attention layers, and its right panel read 'SSM state + KV'."""
    import matplotlib.pyplot as plt

    frame = experiment.memory_sweep(experiment.Config(model=model))
    assert sorted(frame.context.unique()) == [0, 32768]
    fig, axes = plt.subplots(1, 2)
    try:
        experiment._plot_memory(frame, axes)
        assert [ax.get_title() for ax in axes] == ["SSM state only", title]
    finally:
        plt.close(fig)


def test_a_long_window_shows_the_speculative_sweeps_progress(capsys):
    """The speculative sweep traces each cycle in time linear in L (--window 65536: 15 s with
    nothing printed); from SPEC_BAR_WINDOW on it shows a bar on stderr, below it nothing."""
    for window, shown in ((16, False), (experiment.SPEC_BAR_WINDOW, True)):
        frame = experiment.spec_sweep(experiment.Config(window=window, verified=(1, 2)))
        assert set(frame.window) == {0, window} and len(frame) > 0
        assert ("speculative cycles" in capsys.readouterr().err) == shown


# --------------------------------------------------------------------------------------------
# outputs: provenance in meta.json, output places, checked --plot-only


def test_an_unchanged_tree_regenerates_the_csvs_byte_for_byte(tmp_path):
    """No commit or device in the rows: two runs write the same CSV and summary bytes."""
    config = experiment.Config(out_dir=tmp_path / "a", windows=(1, 7), verified=(1, 2),
                               memory_gib=(2.0,))
    experiment.run(config)
    experiment.run(experiment.Config(**{**config.__dict__, "out_dir": tmp_path / "b"}))
    for name in ("traffic_window_nemotron3-super.csv", "traffic_spec_nemotron3-super.csv",
                 "traffic_memory_nemotron3-super.csv", "traffic_summary_nemotron3-super.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_custom_run_writes_under_runs_and_the_default_run_under_results(tmp_path, capsys,
                                                                          monkeypatch):
    """--window 8 (not the committed setting) goes to runs/traffic_<model>_window-8/; the
    default run of a committed model to results/; a model without committed results to
    runs/. Paths are relative to the current folder."""
    monkeypatch.chdir(tmp_path)
    experiment.main(["--window", "8", "--spec-verified", "2", "--no-plot"])
    assert "runs/traffic_nemotron3-super_window-8_spec-verified-2" in capsys.readouterr().err
    assert (tmp_path / "runs" / "traffic_nemotron3-super_window-8_spec-verified-2" /
            "traffic_nemotron3-super.meta.json").is_file()
    assert not (tmp_path / "results").exists()
    assert experiment.default_folder("qwen3-next-80b", 16, 4) == Path("results")
    assert experiment.default_folder("mamba2-2.7b", 16, 4) == Path(
        "runs/traffic_mamba2-2.7b")


def test_plot_only_redraws_and_refuses_a_changed_csv_in_one_line(tmp_path, capsys):
    """--plot-only redraws the PNGs from the CSVs; a CSV changed after its run (a value, a
    row cut off) is refused with exit status 2 and one line naming the file."""
    experiment.main(["--out", str(tmp_path), "--window", "4", "--spec-verified", "2",
                     "--no-plot"])
    experiment.main(["--out", str(tmp_path), "--window", "4", "--spec-verified", "2",
                     "--plot-only"])
    assert len(list(tmp_path.glob("*.png"))) == 3
    capsys.readouterr()
    spec = tmp_path / "traffic_spec_nemotron3-super.csv"
    for edit, message in ((lambda t: t[:-3], "incomplete"),
                          (lambda t: t.replace("snapshot", "snapshoT", 1), "differ"),
                          (lambda t: t + t.splitlines()[1] + "\n", "repeats the point of line 2")):
        original = spec.read_text()
        spec.write_text(edit(original))
        with pytest.raises(SystemExit) as info:
            experiment.main(["--out", str(tmp_path), "--window", "4", "--spec-verified", "2",
                             "--plot-only"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(spec) in err and message in err, err
        spec.write_text(original)


def test_a_run_overwrites_its_own_outputs_without_force(tmp_path, capsys):
    """The second run of a command (the committed results' regenerate command) replaces the
    first run's files, the summary JSON included (its meta.json beside it says whose it is)."""
    argv = ["--out", str(tmp_path), "--window", "3", "--spec-verified", "2", "--no-plot"]
    experiment.main(argv)
    summary = tmp_path / "traffic_summary_nemotron3-super.json"
    summary.write_text(summary.read_text().replace('"window": 3', '"window": 99'))
    experiment.main(argv)
    assert json.loads(summary.read_text())["window"] == 3


def test_a_foreign_file_in_the_output_folder_needs_force(tmp_path, capsys):
    """A file named like an output but not written by this experiment is refused in one line
    and left alone; --force replaces it."""
    foreign = tmp_path / "traffic_summary_nemotron3-super.json"
    foreign.write_text('{"mine": true}\n')
    argv = ["--out", str(tmp_path), "--window", "4", "--spec-verified", "2", "--no-plot"]
    with pytest.raises(SystemExit) as info:
        experiment.main(argv)
    assert info.value.code == 2
    assert "not an output of experiments.traffic" in capsys.readouterr().err
    assert foreign.read_text() == '{"mine": true}\n'
    experiment.main([*argv, "--force"])
    assert "model" in json.loads(foreign.read_text())
