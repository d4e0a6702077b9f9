"""experiments/error_growth.py: the error-growth experiment's numbers, files and command line.

Sizes are small and odd where the format allows (dv = 7, dk = 33 for element formats; dk a
multiple of 32 for the block formats). Each reference simulation here takes well under a
second; the emulation backend's comparison runs the Triton kernels (interpreted on a CPU) once
for the module, about 30 s, and is marked slow.
"""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torchrun import torchrun

from experiments import error_growth as eg
from experiments.sharding import assign_cells
from lowprec import mamba2
from lowprec.metrics import rel_err
from lowprec.policies import Simulator, make_policy

REPO = Path(__file__).resolve().parent.parent
FP16_U = 2.0**-11  # unit roundoff of FP16: half an ulp relative to a value in [1, 2)


def _config(tmp_path, **overrides):
    base = dict(
        recurrence="mamba2",
        dv=7,
        dk=33,
        heads=3,
        seeds=3,
        steps=100,
        window=16,
        memory=(eg.parse_memory("long"), eg.parse_memory("short")),
        arms=eg.parse_arms("every_step,shared,separate_exact", "fp16", "sr"),
        out=str(tmp_path / "eg.csv"),
        plot=None,
        progress=False,
    )
    base.update(overrides)
    return eg.Config(**base)


# --------------------------------------------------------------------------------------------
# numbers


@pytest.mark.parametrize("recurrence", ["mamba2", "gdn", "kda"])
def test_fp64_format_gives_zero_error_in_every_arm(tmp_path, recurrence):
    """Storing the state (or the read copy) in FP64 rounds nothing, so every arm reproduces
    the exact run bit for bit: rel_err is exactly 0 at every step, RN and SR alike.
    (separate_fp16sr is left out: its recurrence copy is FP16 by definition of the arm.)"""
    arms = eg.parse_arms("every_step,shared,separate_exact", "fp64", "rn,sr")
    frame = eg.run(_config(tmp_path, recurrence=recurrence, arms=arms, steps=70))
    assert len(frame) == 5 * 2 * 3 * 70
    assert (frame["rel_err"] == 0.0).all()


@pytest.mark.parametrize("recurrence", ["mamba2", "gdn", "kda"])
def test_separate_exact_is_exact_before_the_first_flush_and_at_every_flush(tmp_path, recurrence):
    """separate_exact's recurrence copy is exact FP64 and a flush step's output reads the
    unrounded new state, so its error is exactly 0 on steps 1..L and on every flush step
    (t % L == 0), whatever the read copy's format; between flushes it is not 0."""
    arms = eg.parse_arms("separate_exact", "fp8_e4m3_row,nvfp4", "rn")
    c = _config(tmp_path, recurrence=recurrence, arms=arms, dk=32, steps=80, window=16)
    frame = eg.run(c)
    exact_steps = (frame["step"] <= c.window[0]) | (frame["step"] % c.window[0] == 0)
    assert (frame.loc[exact_steps, "rel_err"] == 0.0).all()
    assert (frame.loc[~exact_steps, "rel_err"] > 0.0).all()


@pytest.mark.parametrize("recurrence", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3_row", "nvfp4"])
def test_separate_exact_error_never_exceeds_one_checkpoint_rounding(recurrence, fmt):
    """The bound, per sequence, head and step t of a window opened by the flush at step f:

        ||y_hat_t - y_t||_2 <= ||E_f||_F ||q_t||_2,     E_f = Q(S_f) - S_f

    The read trajectory and the exact one obey the same linear update, so their difference
    evolves as E <- a E (Mamba-2), a E (I - beta k k^T) (GDN) or E diag(a) (I - beta k k^T)
    (KDA), each a contraction (a < 1, beta in [0, 1), ||k|| = 1): the error at t is at most the
    one rounding E_f, seen through q_t. For Mamba-2 it is exactly E_f decayed,
    y_hat_t - y_t = g_{f+1:t} E_f q_t, so the sharper ||E_f q_t|| bounds it too. Slack: the
    two trajectories are summed in FP64 separately, 1e-12 * ||S_t|| ||q_t|| covers that."""
    c = eg.Config(
        recurrence=recurrence,
        dv=7,
        dk=32,
        heads=3,
        seeds=2,
        steps=90,
        window=16,
        memory=(eg.parse_memory("long"), eg.parse_memory("short")),
        arms=(eg.ArmSpec.separate("fp64", "rn", fmt),),
        progress=False,
    )
    batch = len(c.memory) * c.seeds
    exact = Simulator(recurrence, make_policy("exact", "fp64"), batch, c.heads, c.dv, c.dk)
    sim = Simulator(
        recurrence, make_policy("separate_exact", fmt, window=c.window[0]), batch, c.heads,
        c.dv, c.dk,
    )
    rounding_error = torch.zeros(batch, c.heads, c.dv, c.dk, dtype=torch.float64)
    checked = 0
    for a, v, k, q, beta in eg.make_inputs(c, c.steps):
        y = exact.step(a, v, k, q, beta)
        err = torch.linalg.vector_norm(sim.step(a, v, k, q, beta) - y, dim=-1)  # [b, h]
        q_norm = torch.linalg.vector_norm(q, dim=-1)
        slack = 1e-12 * torch.linalg.matrix_norm(exact.hi) * q_norm
        bound = torch.linalg.matrix_norm(rounding_error) * q_norm + slack
        assert (err <= bound).all(), f"step {exact.tokens}: worst err/bound {(err / bound).max()}"
        if recurrence == "mamba2":
            sharp = torch.linalg.vector_norm(rounding_error @ q[..., None], dim=(-2, -1))
            assert (err <= sharp + slack).all()
        if sim.last_was_flush:
            assert (err == 0).all()
            rounding_error = sim.lo - exact.hi
        else:
            checked += int((err > 0).all())
    assert checked > 60  # the bound was exercised on the non-flush steps after the first flush


def test_every_step_rn_fp16_short_memory_stays_near_unit_roundoff(tmp_path):
    """Conventional FP16 RN state, short memory (a in [0.9, 0.95)): each token adds one RN
    error of at most u = 2^-11 relative to each state entry, and an entry remembers about
    1 / (1 - a^2) <= 10.3 of them, which add in quadrature with an RMS of about u / sqrt(3)
    each: about sqrt(10.3 / 3) u = 1.9 u. Measured median 1.1 u, max 3.5 u over 3 x 2000
    steps. Checked: median below 3 u, max below 20 u (the coherent worst case u / (1 - 0.95)),
    and no growth (the last quarter's mean within 1.25x the second quarter's)."""
    c = _config(
        tmp_path,
        memory=(eg.parse_memory("short"),),
        arms=(eg.ArmSpec.single("every_step", "fp16", "rn"),),
        steps=2000,
    )
    err = eg.run(c).set_index(["seed", "step"])["rel_err"] / FP16_U
    assert err.median() < 3.0
    assert err.max() < 20.0
    steps = err.index.get_level_values("step")
    second, last = err[(steps > 500) & (steps <= 1000)], err[steps > 1500]
    assert last.mean() < 1.25 * second.mean()


def test_long_memory_orders_the_arms_as_the_design_says(tmp_path):
    """DESIGN.md's claim in miniature (mamba2, FP8 with a row scale, long memory, 1,024
    steps): the conventional state's error grows with length (measured 3x from the window of
    step 80 to the last; checked 2x), separate_exact's does not (checked under 2x), and at the
    end every_step > shared > separate_exact (median window means over seeds)."""
    arms = eg.parse_arms("every_step,shared,separate_exact", "fp8_e4m3_row", "sr")
    c = _config(tmp_path, memory=(eg.parse_memory("long"),), arms=arms, dk=32, steps=1024)
    means = eg.window_means(eg.run(c)).set_index(["arm", "window_index"])["median"]
    first, last = 4, 63  # windows of steps 65..80 and 1009..1024
    every, shared, separate = (a.label for a in arms)
    assert means[(every, last)] > 2 * means[(every, first)]
    assert means[(separate, last)] < 2 * means[(separate, first)]
    assert means[(every, last)] > means[(shared, last)] > means[(separate, last)]


def test_inputs_of_a_seed_do_not_depend_on_other_seeds_or_memory(tmp_path):
    """Slot (memory m, seed s) = m * seeds + s; seed s draws the same v, k, q whichever seeds
    run beside it, every memory profile sees them, and the decays fall in each range."""
    small = eg.make_inputs(_config(tmp_path, seeds=2), 300)
    large = eg.make_inputs(_config(tmp_path, seeds=4), 300)
    for (a2, v2, k2, q2, _), (a4, v4, k4, q4, _) in zip(small, large, strict=True):
        torch.testing.assert_close(v2[:2], v4[:2], rtol=0, atol=0)
        torch.testing.assert_close(v2[:2], v2[2:], rtol=0, atol=0)  # long and short share
        torch.testing.assert_close(k2[:2], k4[:2], rtol=0, atol=0)
        torch.testing.assert_close(q2[:2], q4[:2], rtol=0, atol=0)
        torch.testing.assert_close(a2[2:], a4[4:6], rtol=0, atol=0)
    decays = torch.stack([step[0] for step in small])  # [steps, slots, heads]
    assert decays[:, :2].min() >= 0.9995 and decays[:, :2].max() < 0.99999
    assert decays[:, 2:].min() >= 0.9 and decays[:, 2:].max() < 0.95


def test_gdn_and_kda_inputs_have_unit_keys_and_per_channel_kda_decays(tmp_path):
    """GDN and KDA L2-normalise k and q and draw beta in [0, 1); KDA's decay is [b, h, dk]."""
    (a, v, k, q, beta), *_ = eg.make_inputs(_config(tmp_path, recurrence="kda"), 2)
    assert a.shape == (6, 3, 33) and beta.shape == (6, 3)
    ones = torch.ones(6, 3, dtype=torch.float64)
    torch.testing.assert_close(torch.linalg.vector_norm(k, dim=-1), ones)
    torch.testing.assert_close(torch.linalg.vector_norm(q, dim=-1), ones)
    assert 0 <= beta.min() and beta.max() < 1


def test_rel_err_is_the_norm_over_heads_and_dv_of_one_sequence():
    """The CSV's rel_err is lowprec.metrics.rel_err over [heads, dv]: worked example with two
    heads, y = [[3, 4], [0, 0]], y_hat = [[3, 4], [0, 1]]: ||diff|| 1 / ||y|| 5 = 0.2."""
    y = torch.tensor([[[3.0, 4.0], [0.0, 0.0]]], dtype=torch.float64)
    y_hat = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]], dtype=torch.float64)
    assert rel_err(y_hat, y).tolist() == [0.2]


# --------------------------------------------------------------------------------------------
# the emulation backend

FP32_U = 2.0**-24  # unit roundoff of fp32
# Arms of the backend comparison; a tiny case, because the interpreter costs ~0.1-0.25 s per
# kernel call (5 arms x 48 steps = 240 calls).
BACKEND_ARMS = (
    "every_step:fp16:rn,every_step:nvfp4:sr,separate_exact:nvfp4,separate_fp16sr:nvfp4,"
    "separate_fp16sr:fp8_e4m3"
)
# The fp32 floor of the emulation's rel_err, where the reference's is exactly 0 (steps before
# the first flush, separate_exact's flush steps): y is an fp32 sum of n <= dk + L = 36 products
# (records or state times C), each factor within a few u of its FP64 value (the mapping's dt
# and x, exp), and separate_exact's fp32 recurrence copy gains about (L + 2) u per flush.
# Rounding errors of random sign add in quadrature: about sqrt(n) u = 6 u per row relative to
# sum|terms|, which is about sqrt(dk) = 5.7 times |y| for Gaussian C, i.e. ~2e-6, plus the
# copy's ~sqrt(11 flushes) * 6 u = 1.2e-6. (Higham's worst case, n u instead of sqrt(n) u, is
# ~2e-5 and never approached.) Measured: 2.1e-7; allowed 1e-5.
FP32_FLOOR = 1e-5
# Rows whose error is set by a coarse format (nvfp4 E2M1, fp8 E4M3 read copies; nvfp4 SR
# state) agree pointwise: a rounding decision differs between the backends only where the
# fp32 and FP64 unrounded values straddle a threshold (RN midpoint or SR draw), probability
# about 2 |dx| / spacing <= 2 * 4 u * (|x| / spacing <= 16 for E4M3) = 3e-6 per rounding,
# ~1e5 roundings per arm here: expected <= 0.3 flips, none in this case. Without a flip the
# rel_err values agree to the fp32 floor, plus the fp16 SR flips of separate_fp16sr's
# recurrence copy (below) seen through the read copy: measured 7.5e-4 relative, allowed 1e-2.
COARSE_RTOL = 1e-2
# Rows whose error is set by FP16 roundings (every_step fp16 at every step; separate_fp16sr's
# flush steps, which read the FP16-SR recurrence copy) do see flips: |x| / spacing is up to
# 2^11, so about 2 * 4 u * 2^11 = 1e-3 of the roundings, ~25 flips per arm here, each moving
# one element by one FP16 ulp: single values differ by up to 12% (measured). Compared
# statistically: the mean rel_err of each (arm, format, memory) over these rows within 5%
# (measured: at most 0.55%).
FP16_MEAN_RTOL = 0.05


def _backend_config(out, **overrides):
    base = dict(
        recurrence="mamba2",
        dv=8,
        dk=32,
        heads=2,
        seeds=2,
        steps=48,
        window=4,
        memory=(eg.parse_memory("long"), eg.parse_memory("short")),
        arms=eg.parse_arms(BACKEND_ARMS, "nvfp4", "rn"),
        out=str(out),
        plot=None,
        progress=False,
    )
    base.update(overrides)
    return eg.Config(**base)


@pytest.fixture(scope="module")
def backend_csvs(tmp_path_factory):
    """The CSVs of the same run on both backends, read back: (reference, emulation, config)."""
    folder = tmp_path_factory.mktemp("backends")
    reference = _backend_config(folder / "reference.csv")
    emulation = dataclasses.replace(
        reference, backend="emulation", out=str(folder / "emulation.csv")
    )
    eg.run(reference)
    eg.run(emulation)
    return eg.read_csv(reference.out), eg.read_csv(emulation.out), reference


def _compare(reference, emulation, window):
    """The reference's rows with the emulation's rel_err beside them and each row's class."""
    frame = reference.assign(emulated=emulation["rel_err"])
    flush = frame["step"] % window == 0
    fp16_limited = (frame["arm"] == "every_step:fp16:rn") | (
        frame["arm"].str.startswith("separate:fp16:sr:") & flush
    )
    return frame.assign(exact=frame["rel_err"] == 0, fp16_limited=fp16_limited)


def test_kernel_inputs_map_the_generic_mamba2_step_exactly(tmp_path):
    """dt = -log(a), A = -1, x = v / dt, B = k, C = q: in FP64, lowprec.mamba2.mamba2_step
    (dt_softplus off) on the mapped inputs follows the Simulator's exact run to a few FP64
    ulps over 60 steps (allowed 1e-12 of max |y|). In fp32 the mapping rounds dt and x once:
    exp(dt A) = a exp(log(a) d) and dt x = v (1 + d') with |d|, |d'| <= u, so both are
    within u of a and v when evaluated exactly (in FP64 here)."""
    c = _config(tmp_path, heads=3, seeds=2, steps=60)
    batch = len(c.memory) * c.seeds
    exact = Simulator("mamba2", make_policy("exact", "fp64"), batch, c.heads, c.dv, c.dk)
    state = torch.zeros(batch, c.heads, c.dv, c.dk, dtype=torch.float64)
    for a, v, k, q, _ in eg.make_inputs(c, c.steps):
        x, dt, A, B, C = eg.mamba2_kernel_inputs(a, v, k, q, dtype=torch.float64)
        y, state = mamba2.mamba2_step(state, x, dt, A, B, C, dt_softplus=False)
        y_exact = exact.step(a, v, k, q)
        torch.testing.assert_close(y, y_exact, rtol=0, atol=1e-12 * y_exact.abs().max().item())
        x32, dt32, A32, B32, C32 = eg.mamba2_kernel_inputs(a, v, k, q)
        assert {t.dtype for t in (x32, dt32, A32, B32, C32)} == {torch.float32}
        assert (A32 == -1).all() and B32.shape == k.shape and C32.shape == q.shape
        decay = torch.exp(dt32.double() * A32.double())
        assert ((decay - a).abs() <= FP32_U * a).all()
        update = dt32.double()[..., None] * x32.double()
        assert ((update - v).abs() <= FP32_U * v.abs()).all()
    with pytest.raises(ValueError, match="q: expected shape"):
        eg.mamba2_kernel_inputs(a, v, k, q[..., :-1])


@pytest.mark.slow
def test_emulation_backend_writes_the_reference_rows_and_columns(backend_csvs):
    """Same header (CSV_COLUMNS), same rows in the same order (arm, format, rounding, memory,
    window, seed, step), a finite rel_err everywhere."""
    reference, emulation, _ = backend_csvs
    assert tuple(emulation.columns) == eg.CSV_COLUMNS
    keys = [name for name in eg.CSV_COLUMNS if name != "rel_err"]
    pd.testing.assert_frame_equal(emulation[keys], reference[keys])
    assert len(emulation) == 5 * 2 * 2 * 48
    assert emulation["rel_err"].notna().all() and (emulation["rel_err"] >= 0).all()


@pytest.mark.slow
def test_emulation_is_exact_to_fp32_where_the_reference_is_exact(backend_csvs):
    """Before the first flush every windowed arm reads exact records, and separate_exact's
    flush steps read the exact recurrence copy: the reference's error is exactly 0 there
    (4 windowed arms x 2 memories x 2 seeds x L steps, plus separate_exact's 11 later flushes
    x 4 sequences); the emulation's is fp32 arithmetic (and an fp32 recurrence copy), below
    FP32_FLOOR."""
    reference, emulation, c = backend_csvs
    frame = _compare(reference, emulation, c.window[0])
    exact = frame[frame["exact"]]
    assert len(exact) == 3 * 4 * c.window[0] + 11 * 4
    assert exact["emulated"].max() <= FP32_FLOOR, exact.nlargest(3, "emulated")


@pytest.mark.slow
def test_emulation_matches_coarse_format_errors_step_by_step(backend_csvs):
    """Where a coarse format sets the error (nvfp4 and fp8 read copies, the nvfp4 SR state),
    every row agrees: |emulated - reference| <= COARSE_RTOL * reference + FP32_FLOOR."""
    reference, emulation, c = backend_csvs
    frame = _compare(reference, emulation, c.window[0])
    coarse = frame[~frame["exact"] & ~frame["fp16_limited"]]
    assert len(coarse) == 4 * 48 + 3 * 4 * 33  # every_step nvfp4; non-flush steps after L
    gap = (coarse["emulated"] - coarse["rel_err"]).abs()
    bad = coarse[gap > COARSE_RTOL * coarse["rel_err"] + FP32_FLOOR]
    assert bad.empty, bad.head()


@pytest.mark.slow
def test_emulation_matches_fp16_limited_errors_on_average(backend_csvs):
    """Where FP16 roundings set the error (every_step fp16 RN; separate_fp16sr's flush steps)
    single values may differ by a flipped rounding, so the mean rel_err of each arm, format
    and memory agrees within FP16_MEAN_RTOL."""
    reference, emulation, c = backend_csvs
    frame = _compare(reference, emulation, c.window[0])
    limited = frame[~frame["exact"] & frame["fp16_limited"]]
    means = limited.groupby(["arm", "memory"])[["rel_err", "emulated"]].mean()
    assert len(means) == 3 * 2
    ratio = means["emulated"] / means["rel_err"]
    assert ((ratio - 1).abs() <= FP16_MEAN_RTOL).all(), ratio


@pytest.mark.slow
@pytest.mark.parametrize("recurrence", ["gdn", "kda"])
def test_tiny_delta_presets_follow_the_reference_through_the_emulation(tmp_path, capsys,
                                                                       recurrence):
    """--preset gdn-tiny / kda-tiny run the emulation interpreted on the CPU (about 15 s
    each) and write the reference backend's rows: where the reference is exact (windowed arms
    before their first flush) the emulation's error is fp32's (below 1e-5); elsewhere the two
    differ by fp32 arithmetic, which moves the median row by well under 1%."""
    preset = f"{recurrence}-tiny"
    emulated, reference = tmp_path / "e.csv", tmp_path / "r.csv"
    assert eg.main(["--preset", preset, "--no-progress", "--plot", "none", "--out",
                    str(emulated)]) == 0
    assert eg.main(["--preset", preset, "--backend", "reference", "--no-progress", "--plot",
                    "none", "--out", str(reference)]) == 0
    e, r = eg.read_csv(emulated), eg.read_csv(reference)
    assert e[list(eg.KEYS)].equals(r[list(eg.KEYS)])
    assert (e["recurrence"] == recurrence).all()
    exact = r["rel_err"] == 0
    assert exact.any() and (e.loc[exact, "rel_err"] < 1e-5).all()
    ratio = e.loc[~exact, "rel_err"] / r.loc[~exact, "rel_err"]
    assert abs(ratio.median() - 1) < 1e-2
    assert "growth" in capsys.readouterr().out


def test_sr_settings_are_one_cell_each_and_16_7_is_the_default_run(tmp_path):
    """--sr-bits 32,16 --philox-rounds 10,7: four cells of the SR arm (one per pair), one of
    the RN arm (its columns at the defaults 16/7); the 16/7 rows are the bytes of a run
    without the flags, and the reference 32/10 draws other words (other errors)."""
    arms = eg.parse_arms("separate_fp16sr:fp16,every_step:fp16:rn", "fp16", "rn")
    c = _config(tmp_path, arms=arms, steps=48, sr_bits=(32, 16), philox_rounds=(10, 7))
    grid = eg.cells(c)
    assert [(cell.arm.label, cell.sr_bits, cell.philox_rounds) for cell in grid] == [
        ("separate:fp16:sr:fp16", 32, 10), ("separate:fp16:sr:fp16", 32, 7),
        ("separate:fp16:sr:fp16", 16, 10), ("separate:fp16:sr:fp16", 16, 7),
        ("every_step:fp16:rn", 16, 7)]
    assert len({cell.key for cell in grid}) == 5
    frame = eg.run(c)
    plain = eg.run(_config(tmp_path, arms=arms, steps=48, out=str(tmp_path / "plain.csv")))
    default = frame[(frame["sr_bits"] == 16) & (frame["philox_rounds"] == 7)]
    assert default.reset_index(drop=True).equals(plain)
    sr = frame[frame["arm"] == "separate:fp16:sr:fp16"].set_index(
        ["sr_bits", "philox_rounds", "memory", "seed", "step"])["rel_err"]
    assert not np.array_equal(sr.loc[(16, 7)].to_numpy(), sr.loc[(32, 10)].to_numpy())
    with pytest.raises(ValueError, match="sr_bits"):
        _config(tmp_path, sr_bits=(7,))
    with pytest.raises(ValueError, match="philox_rounds"):
        _config(tmp_path, philox_rounds=(10, 10))


def test_sr_table_finds_a_setting_whose_error_departs_and_not_one_that_does_not():
    """Constructed rows: 16 bits draws the 32/10 errors of other seeds (ratio near 1, the
    interval holds 1), 8 bits twice them (ratio 2, the interval excludes 1)."""
    gen = np.random.default_rng(3)
    rows = []
    for bits, scale in ((32, 1.0), (16, 1.0), (8, 2.0)):
        for seed in range(12):
            level = scale * (1 + 0.1 * gen.standard_normal())
            for t in range(1, 65):
                rows.append(dict(recurrence="mamba2", arm="shared:fp16:sr", **{
                    **FP16_SR, "sr_bits": bits}, memory="long", window=16, seed=seed, step=t,
                    rel_err=1e-3 * level))
    table = eg.sr_table(pd.DataFrame(rows, columns=list(eg.CSV_COLUMNS))).set_index("sr_bits")
    assert table.loc[32, "ratio"] == 1 and not table.loc[32, "departs"]
    assert not table.loc[16, "departs"] and table.loc[16, "low"] < 1 < table.loc[16, "high"]
    assert table.loc[8, "departs"] and table.loc[8, "ratio"] == pytest.approx(2, rel=0.1)
    one = eg.sr_table(pd.DataFrame([r for r in rows if r["seed"] == 5],
                                   columns=list(eg.CSV_COLUMNS))).set_index("sr_bits")
    assert one.loc[8, "ratio"] > 1.2 and one["departs"].isna().all()  # one seed: no interval
    assert one[["low", "high"]].isna().all().all()


@pytest.mark.slow
def test_emulation_takes_the_sr_setting_of_the_reference(tmp_path):
    """--sr-bits 8 --philox-rounds 4 on the emulation backend: the caches draw the same
    words as lowprec, so the errors follow the reference's (median ratio within 1%)."""
    if missing := eg._emulation_without_sr_settings():
        pytest.skip(f"the installed emulation's {missing} takes no sr_bits/philox_rounds")
    arms = eg.parse_arms("separate_fp16sr:fp16", "fp16", "rn")
    c = _config(tmp_path, arms=arms, steps=24, window=8, sr_bits=(8,), philox_rounds=(4,))
    reference = eg.run(c)
    eg._EXACT_CACHE.clear()
    emulated = eg.run(dataclasses.replace(c, backend="emulation",
                                          out=str(tmp_path / "e.csv")))
    moved = reference["rel_err"] > 0
    ratio = emulated.loc[moved, "rel_err"] / reference.loc[moved, "rel_err"]
    assert abs(ratio.median() - 1) < 1e-2


# --------------------------------------------------------------------------------------------
# files


def test_csv_has_exactly_the_tidy_columns_and_one_row_per_step(tmp_path):
    """Header line exactly CSV_COLUMNS; one row per (arm, memory, window, seed, step); the
    arm column is canonical and the hi/lo columns spell it out (a separate arm's read copy
    'rn'); memory 'LO,HI' is written 'LO..HI'."""
    arms = eg.parse_arms("every_step,separate_fp16sr", "fp16,mxfp4", "rn,sr")
    memory = (eg.parse_memory("short"), eg.parse_memory("0.99,0.999"))
    c = _config(tmp_path, arms=arms, memory=memory, dk=64, steps=37, seed0=5)
    eg.run(c)
    text = Path(c.out).read_text()
    assert text.splitlines()[0] == ",".join(eg.CSV_COLUMNS)
    assert text.splitlines()[0] == ("recurrence,arm,hi_format,hi_rounding,lo_format,lo_rounding,"
                                    "sr_bits,philox_rounds,memory,window,seed,step,rel_err")
    frame = pd.read_csv(c.out)
    assert len(frame) == 6 * 2 * 3 * 37  # 6 arms: every_step x 2 formats x 2 roundings + 2
    keys = ["arm", "memory", "window", "seed", "step"]
    assert not frame.duplicated(keys).any()
    assert set(frame["arm"]) == {"every_step:fp16:rn", "every_step:fp16:sr", "every_step:mxfp4:rn",
                                 "every_step:mxfp4:sr", "separate:fp16:sr:fp16",
                                 "separate:fp16:sr:mxfp4"}
    sep = frame[frame["arm"] == "separate:fp16:sr:mxfp4"]
    assert set(zip(sep["hi_format"], sep["hi_rounding"], sep["lo_format"], sep["lo_rounding"],
                   strict=True)) == {("fp16", "sr", "mxfp4", "rn")}
    assert set(frame["memory"]) == {"short", "0.99..0.999"}
    assert set(frame["seed"]) == {5, 6, 7}
    assert frame["step"].min() == 1 and frame["step"].max() == 37
    assert (frame["recurrence"] == "mamba2").all() and (frame["window"] == 16).all()
    assert frame["rel_err"].dtype == float and frame["rel_err"].notna().all()


def test_a_rerun_reproduces_the_csv_byte_for_byte(tmp_path):
    """Same config, same seeds -> identical bytes (SR arms included: Philox words are a
    function of seed, slot, counter and element)."""
    arms = eg.parse_arms("every_step,shared,separate_fp16sr", "nvfp4", "sr")
    first = _config(tmp_path, arms=arms, dk=32, steps=50, log_grid=3)
    second = _config(tmp_path, arms=arms, dk=32, steps=50, log_grid=3, out=str(tmp_path / "b.csv"))
    eg.run(first)
    eg.run(second)
    assert Path(first.out).read_bytes() == Path(second.out).read_bytes()


def test_recorded_steps_are_whole_windows_holding_the_summary_steps():
    """--log-grid G keeps whole windows (so a window mean is exact) and always the windows of
    steps 64, 1,024, 4,096 and the last step; 0 keeps every step."""
    steps = eg.recorded_steps(10_000, 16, 12)
    assert list(eg.recorded_steps(40, 16, 0)) == list(range(1, 41))
    kept = set(steps.tolist())
    for t in (1, 64, 1024, 4096, 10_000):
        window = (t - 1) // 16
        assert set(range(window * 16 + 1, min(window * 16 + 16, 10_000) + 1)) <= kept
    assert len(kept) == len(steps) and sorted(kept) == steps.tolist()
    assert len(steps) < 40 * 16


def test_plot_and_summary_read_the_csv(tmp_path):
    """plot() writes a PNG from the CSV alone; summarize() gives one row per series and the
    window means at t = 64 and the last whole window (steps < 1,024): 100 steps at L = 16
    end in a partial window (97-100), which the CSV keeps and the means leave out."""
    c = _config(tmp_path, steps=100)
    frame = eg.run(c)
    assert frame["step"].max() == 100
    png = tmp_path / "eg.png"
    eg.plot(c.out, png)
    assert png.stat().st_size > 10_000
    assert eg.window_means(frame)["last_step"].max() == 96
    table = eg.summarize(frame)
    assert list(table.columns) == ["t=64", "t=96 (last)"]
    assert len(table) == 3 * 2
    means = eg.window_means(frame)
    at64 = means[(means["arm"] == "every_step:fp16:sr") & (means["memory"] == "long")]
    at64 = at64[at64["window_index"] == 3]["median"].item()
    assert table.loc[("every_step:fp16:sr", "long"), "t=64"] == at64


def test_short_runs_keep_labelled_ticks_on_both_log_axes():
    """A log axis of the plot keeps at least two labelled ticks inside its range however short
    the run (decades alone left a run of 48 steps, windows ending at 16 to 48, without a single
    label on the step axis), and keeps the coarser labels wherever they already gave two, so
    the committed figures do not change."""
    from matplotlib.ticker import LogLocator

    for low, high, coarsest in ((16, 40, eg.DECADES), (3.1e-4, 9.7e-4, eg.ONE_TWO_FIVE),
                                (1, 37, eg.DECADES), (16, 4096, eg.DECADES),
                                (2e-7, 3e-2, eg.DECADES), (17, 23, eg.DECADES)):
        ticks = LogLocator(base=10, subs=eg.log_subs(low, high, coarsest)).tick_values(low, high)
        inside = [t for t in ticks if low <= t <= high]
        assert 2 <= len(inside) <= 10, (low, high, inside)
    # within a decade matplotlib labels 1-2-5 linearly (15, 20, ..., 40)
    assert eg.log_subs(16, 40) == eg.ONE_TWO_FIVE
    assert eg.log_subs(16, 150) == eg.ONE_TWO_FIVE
    assert eg.log_subs(16, 4096) == eg.DECADES  # the presets' step axes, as committed
    assert eg.log_subs(1e-5, 1e-3, eg.ONE_TWO_FIVE) == eg.ONE_TWO_FIVE


def test_presets_hold_their_documented_shapes():
    """toy: one Mamba-2 head, 8 x 32 state, 4,096 steps, L = 16, fp8_e4m3_row, every_step RN
    and SR, shared SR, separate_exact, both memories. default: 64 x 128, four formats x four
    arms, 16,384 steps, more than one head and seed."""
    parser = eg.build_parser()
    toy = eg.config_from_args(parser.parse_args(["--preset", "toy"]))
    assert (toy.recurrence, toy.heads, toy.dv, toy.dk, toy.steps, toy.window) == (
        "mamba2",
        1,
        8,
        32,
        4096,
        (16,),
    )
    assert [m.name for m in toy.memory] == ["long", "short"]
    assert [a.label for a in toy.arms] == [
        "every_step:fp8_e4m3_row:rn",
        "every_step:fp8_e4m3_row:sr",
        "shared:fp8_e4m3_row:sr",
        "separate:fp64:rn:fp8_e4m3_row",
    ]
    assert toy.out == "results/error_growth_toy.csv" and toy.plot == "results/error_growth_toy.png"
    default = eg.config_from_args(parser.parse_args(["--preset", "default", "--steps", "99"]))
    assert (default.dv, default.dk, default.steps) == (64, 128, 99)
    assert default.heads > 1 and default.seeds > 1
    assert {a.scheme for a in default.arms} == set(eg.SCHEMES)
    assert {(a.hi_format, a.hi_rounding) for a in default.arms if a.scheme == "separate"} == {
        ("fp64", "rn"), ("fp16", "sr")}
    assert {a.lo_format for a in default.arms} == {"fp16", "fp8_e4m3", "nvfp4", "mxfp4"}
    assert len(default.arms) == 16


# --------------------------------------------------------------------------------------------
# command line

BAD_ARGUMENTS = {
    "zero steps": ["--steps", "0"],
    "too many steps": ["--steps", str(eg.MAX_STEPS + 1)],
    "not a number": ["--steps", "many"],
    "zero window": ["--window", "0"],
    "reversed memory": ["--memory", "0.95,0.9"],
    "memory past one": ["--memory", "0.9,1.0"],
    "unknown memory": ["--memory", "medium"],
    "repeated memory": ["--memory", "long", "long"],
    "a profile named twice": ["--memory", "short", "0.9,0.95"],
    "unknown arm": ["--arms", "every_token"],
    "unknown format": ["--formats", "fp7"],
    "sr read copy": ["--arms", "separate_exact:fp16:sr"],
    "unknown rounding": ["--rounding", "rz"],
    "unknown format, unused": ["--arms", "shared:fp16:rn", "--formats", "fp7"],
    "unknown rounding, unused": ["--arms", "shared:fp16:rn", "--rounding", "rz"],
    "block misfit": ["--formats", "nvfp4", "--dk", "40"],
    "unknown recurrence": ["--recurrence", "lstm"],
    "empty arm item": ["--arms", "shared,,every_step"],
    "no such device": ["--device", "tpu"],
    "unknown backend": ["--backend", "cutlass"],
    "sr bits 7": ["--sr-bits", "7"],
    "philox rounds 11": ["--philox-rounds", "4,11"],
    "sr bits twice": ["--sr-bits", "8,8"],
    "emulation shared sr": ["--backend", "emulation", "--arms", "shared:fp16:sr"],
    "emulation shared block": ["--backend", "emulation", "--arms", "shared:nvfp4:rn"],
    "emulation fp64": ["--backend", "emulation", "--arms", "separate_exact:fp64"],
}


@pytest.mark.parametrize("argv", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_give_one_line_and_exit_status_2(tmp_path, capsys, argv):
    """An invalid argument ends with one line on stderr naming the problem, exit status 2,
    and nothing simulated or written (the CSV went to /nonexistent/never.csv, which root may
    create: an argument let through ran and wrote there)."""
    with pytest.raises(SystemExit) as exit_info:
        eg.main([*argv, "--out", str(tmp_path / "never.csv")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "error:" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("where", ["out folder", "plot folder", "plot txt", "plot no suffix",
                                   "out under a file", "plot under a file"])
def test_bad_output_paths_are_one_line_errors_before_the_run(tmp_path, capsys, where):
    """--out naming a folder or a path under a file (like /dev/null/x.csv), or --plot naming a
    folder, a path under a file or a file type matplotlib cannot write, is an argument error
    before anything is simulated."""
    (tmp_path / "file").write_text("")
    paths = {
        "out folder": ["--out", str(tmp_path)],
        "plot folder": ["--out", str(tmp_path / "a.csv"), "--plot", str(tmp_path)],
        "plot txt": ["--out", str(tmp_path / "a.csv"), "--plot", str(tmp_path / "a.txt")],
        "plot no suffix": ["--out", str(tmp_path / "a.csv"), "--plot", str(tmp_path / "a")],
        "out under a file": ["--out", str(tmp_path / "file" / "a.csv")],
        "plot under a file": ["--out", str(tmp_path / "a.csv"), "--plot",
                              str(tmp_path / "file" / "x" / "a.png")],
    }[where]
    with pytest.raises(SystemExit) as exit_info:
        eg.main(["--steps", "4", "--seeds", "1", "--no-progress", *paths])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert ("out:" if where.startswith("out") else "plot:") in err and "Traceback" not in err
    if "under a file" in where:
        assert f"{tmp_path / 'file'} is not a folder" in err
    assert not (tmp_path / "a.csv").exists()


def test_exact_arms_are_plotted_and_a_window_past_the_run_is_noted(tmp_path, capsys):
    """An arm at rel_err 0 everywhere is a result (fp64 rounds nothing; separate_exact never
    flushes when L > steps): the plot draws it on a linear zero line."""
    out = tmp_path / "exact.csv"
    argv = ["--arms", "every_step:fp64:sr,every_step:fp16:rn,separate_exact:fp16", "--steps",
            "23", "--window", "37", "--seeds", "2", "--dv", "3", "--dk", "5", "--memory", "short",
            "--no-progress", "--out", str(out)]
    assert eg.main(argv) == 0
    frame = eg.read_csv(out)
    exact = frame["lo_format"].eq("fp64") | frame["arm"].eq("separate:fp64:rn:fp16")
    assert (frame.loc[exact, "rel_err"] == 0).all() and (frame.loc[~exact, "rel_err"] > 0).all()
    assert (tmp_path / "exact.png").stat().st_size > 10_000
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "--window 37 is longer than --steps 23" in notes[0]


def test_bad_arguments_from_the_shell_give_no_traceback():
    """The module entry point (python -m experiments.error_growth) behaves the same."""
    result = subprocess.run(
        [sys.executable, "-m", "experiments.error_growth", "--memory", "0.5,0.2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "memory" in result.stderr and "Traceback" not in result.stderr


def test_main_writes_csv_meta_png_and_prints_the_summary(tmp_path, capsys):
    """A tiny run through main(): CSV, .meta.json (with the command), PNG, summary table;
    --replot redraws the PNG and reprints the same summary from the CSV without touching it."""
    out = tmp_path / "run.csv"
    argv = ["--steps", "48", "--seeds", "2", "--arms", "shared:fp16", "--out", str(out)]
    assert eg.main([*argv, "--no-progress"]) == 0
    meta = (tmp_path / "run.meta.json").read_text()
    assert "python -m experiments.error_growth --steps 48" in meta and '"commit"' in meta
    assert (tmp_path / "run.png").exists()
    printed = capsys.readouterr().out
    assert "shared" in printed and "t=48 (last)" in printed
    csv_bytes = out.read_bytes()
    (tmp_path / "run.png").unlink()
    assert eg.main(["--replot", "--out", str(out)]) == 0  # redraws from the CSV alone
    assert (tmp_path / "run.png").exists() and out.read_bytes() == csv_bytes
    assert capsys.readouterr().out == printed


def test_prefetched_inputs_are_the_inputs_drawn_in_line():
    """The worker thread that draws the next input chunk on a GPU run gives the same inputs
    in the same order as drawing in line (checked over two chunk boundaries, odd sizes)."""
    config = eg.Config(dv=3, dk=5, heads=2, seeds=3, steps=10)
    in_line, ahead = eg._Inputs(config, prefetch=False), eg._Inputs(config, prefetch=True)
    try:
        for _ in range(2 * eg.INPUT_CHUNK + 7):
            for a, b in zip(in_line.next(), ahead.next(), strict=True):
                assert (a is None and b is None) or torch.equal(a, b)
    finally:
        ahead.close()


def test_meta_commit_can_be_named_by_the_environment(monkeypatch):
    """A GPU run names the commit it was started from (LOWPREC_COMMIT): the device's copy of
    the tree has a .git that is not the checkout's."""
    from experiments import _common

    monkeypatch.setenv("LOWPREC_COMMIT", "abc1234")
    assert _common.git_commit() == "abc1234 (LOWPREC_COMMIT)"
    monkeypatch.delenv("LOWPREC_COMMIT")
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty \(tree [0-9a-f]{40}\))?|unknown",
                        _common.git_commit())


def test_a_dirty_tree_is_named_by_its_content_without_writing_to_the_repository(tmp_path,
                                                                                monkeypatch):
    """The device's .git is stale, so its runs are '+dirty' against an old commit; the tree
    hash of the files as they are names the content, and is the tree of the commit that has
    them (found here with git log's %T). Computing it writes no object into the repository."""
    from experiments import _common

    monkeypatch.delenv("LOWPREC_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]

    def sh(*argv):
        return subprocess.run([*git, *argv], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    sh("init", "-q")
    (tmp_path / ".gitignore").write_text("*.log\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    sh("add", "-A")
    sh("commit", "-q", "-m", "one")
    first = sh("rev-parse", "HEAD")
    assert _common.git_commit(tmp_path) == first  # clean: the commit alone
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("y = 3\n")  # untracked: carried to the device, counted
    (tmp_path / "run.log").write_text("ignored\n")  # ignored: not counted
    objects = sorted(p.name for p in (tmp_path / ".git" / "objects").rglob("*") if p.is_file())
    named = _common.git_commit(tmp_path)
    assert sorted(p.name for p in (tmp_path / ".git" / "objects").rglob("*")
                  if p.is_file()) == objects
    sh("add", "-A")
    sh("commit", "-q", "-m", "two")
    assert named == f"{first}+dirty (tree {sh('rev-parse', 'HEAD^{tree}')})"


def _one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        eg.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_plot_path_that_would_overwrite_the_csv_is_refused(tmp_path, capsys):
    """--out x.png (the plot then defaults to the same path) or --plot naming the CSV would
    leave an image where the CSV was: refused before the run, nothing written."""
    for argv in (["--out", str(tmp_path / "same.png")],
                 ["--out", str(tmp_path / "a.svg"), "--plot", str(tmp_path / "a.svg")]):
        err = _one_line_error(["--steps", "4", "--no-progress", *argv], capsys)
        assert "the CSV's own path" in err
    assert not list(tmp_path.iterdir())


def test_custom_memory_ranges_keep_their_exact_bounds():
    """A range's name is its bounds exactly (%g kept six digits: 0.9999995 read as 1, and two
    distinct ranges were refused as the same); one range given twice, under any names, is
    refused (short and 0.9,0.95 ran the same decays twice)."""
    assert eg.parse_memory("0.99999,0.9999995").name == "0.99999..0.9999995"
    config = eg.Config(memory=(eg.parse_memory("0.9999991,0.9999999"),
                               eg.parse_memory("0.9999992,0.9999999")), steps=4)
    assert len({m.name for m in config.memory}) == 2
    for ranges in (("long", "long"), ("short", "0.9,0.95"), ("0.5,0.6", "0.50,0.6")):
        with pytest.raises(ValueError, match="memory: expected distinct ranges"):
            eg.Config(memory=tuple(map(eg.parse_memory, ranges)), steps=4)


def test_runs_too_large_for_the_machine_are_refused_before_they_start(capsys):
    """A run whose states or errors cannot fit in memory is refused up front, before the
    progress bar starts; a huge --log-grid is capped by the windows there are."""
    err = _one_line_error(["--seeds", "524288", "--heads", "2", "--dv", "64", "--dk", "128",
                           "--steps", "1", "--no-progress"], capsys)
    assert "size: this run needs about" in err and "GiB of host memory" in err
    steps = eg.recorded_steps(100, 16, 10**9)  # a grid point a window at most: no 30 GB array
    assert steps.tolist() == sorted(set(steps.tolist())) and steps[0] == 1 and steps[-1] == 100


FP16_SR = dict(hi_format="fp16", hi_rounding="sr", lo_format="fp16", lo_rounding="sr",
               sr_bits=32, philox_rounds=10)


def test_summary_columns_name_distinct_windows():
    """A summary step in the last window would repeat its column: with L = 1000 and 5,000
    steps, t = 4,096 lies in the window of step 5,000, so only t = 64, 1,024 and the last."""
    rows = [dict(recurrence="mamba2", arm="shared:fp16:sr", **FP16_SR, memory="short",
                 window=1000, seed=0, step=t, rel_err=1e-3 * (1 + t / 5000))
            for t in range(1, 5001)]
    table = eg.summarize(pd.DataFrame(rows, columns=list(eg.CSV_COLUMNS)))
    assert list(table.columns) == ["t=64", "t=1024", "t=5000 (last)"]


def test_at_prints_the_windows_holding_the_steps_asked_for(capsys):
    """--at 112,192 gives the window means of those windows (the medians over seeds that
    window_means computes), in the order asked; a step the log grid did not record reads
    '-'; a step past the last whole window, 0, or a repeat is a one-line error."""
    rows = [dict(recurrence="mamba2", arm="shared:fp16:sr", **FP16_SR, memory="long",
                 window=16, seed=seed, step=t, rel_err=1e-3 * (1 + seed) * (1 + t / 7))
            for seed in range(3) for t in [*range(1, 33), *range(97, 113), *range(177, 209)]]
    frame = pd.DataFrame(rows, columns=list(eg.CSV_COLUMNS))
    table = eg.summarize(frame, [192, 112, 40])
    assert list(table.columns) == ["t=192", "t=112", "t=40"]
    for t in (192, 112):  # window 11 holds steps 177..192; its seed-1 mean is the median
        expected = 2e-3 * sum(1 + s / 7 for s in range(t - 15, t + 1)) / 16
        assert table[f"t={t}"].iloc[0] == pytest.approx(expected)
    assert pd.isna(table["t=40"].iloc[0])  # window 2 (steps 33..48) was not recorded
    assert eg.parse_steps("7,3") == [7, 3]
    for text, message in (("0", "expected steps >= 1"), ("5,5", "step 5 given twice"),
                          ("4,,5", "without empty items"), ("x", "expected steps >= 1")):
        with pytest.raises(ValueError, match=message):
            eg.parse_steps(text)


def test_at_past_the_csv_is_refused(tmp_path, capsys):
    out = tmp_path / "r.csv"
    argv = ["--steps", "32", "--seeds", "2", "--arms", "shared:fp16", "--memory", "short",
            "--no-progress", "--plot", "none", "--out", str(out)]
    assert "--at: step 40 is past --steps 32" in _one_line_error([*argv, "--at", "40"], capsys)
    assert not out.exists()  # refused before the run
    assert eg.main([*argv, "--at", "16,32"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.split()[-2:] == ["t=16", "t=32"]
    err = _one_line_error(["--replot", "--out", str(out), "--plot", "none", "--at", "48"], capsys)
    assert "--at: step 48 is past the last whole window of" in err and "(step 32)" in err


def test_seeds_past_int64_are_written_and_read_back(tmp_path, capsys):
    """--seed0 takes any Philox key below 2^64: seeds past 2^63 - 1 are written as uint64 and
    read back."""
    out = tmp_path / "big.csv"
    argv = ["--seed0", str(2**64 - 2), "--seeds", "2", "--steps", "16", "--arms", "shared:fp16",
            "--memory", "short", "--no-progress", "--plot", "none", "--out", str(out)]
    assert eg.main(argv) == 0
    printed = capsys.readouterr().out
    seeds = {int(line.split(",")[10]) for line in out.read_text().splitlines()[1:]}
    assert seeds == {2**64 - 2, 2**64 - 1}
    assert eg.main(["--replot", "--out", str(out), "--plot", "none"]) == 0
    assert capsys.readouterr().out == printed
    err = _one_line_error([*argv[:1], str(2**64 - 1), *argv[2:]], capsys)
    assert "seed0: expected seed0 + seeds <= 2^64" in err


def test_help_says_that_inputs_repeat_every_2_to_the_32_seeds(capsys):
    """torch's CPU generator keeps a seed's low 32 bits: --seed0 2^32 draws the inputs of
    --seed0 0 (the SR words differ), which --help says instead of calling them independent."""
    config = eg.Config(dv=3, dk=5, seeds=1, steps=4)
    far = dataclasses.replace(config, seed0=2**32)
    for ours, theirs in zip(eg.make_inputs(config, 3), eg.make_inputs(far, 3), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours[:4], theirs[:4], strict=True))
    with pytest.raises(SystemExit):
        eg.main(["--help"])
    assert "modulo 2^32" in " ".join(capsys.readouterr().out.split())


def test_an_empty_output_path_is_refused(tmp_path, capsys, monkeypatch):
    """--out "" or --plot "" (an unset shell variable) took the default path silently: with
    --preset toy, a run that overwrote the committed results/error_growth_toy.csv."""
    monkeypatch.chdir(tmp_path)
    for argv in (["--out", ""], ["--out", str(tmp_path / "a.csv"), "--plot", " "]):
        err = _one_line_error(["--preset", "toy", "--steps", "4", "--no-progress", *argv], capsys)
        assert f"--{argv[-2][2:]}: expected a path, got" in err
    assert not list(tmp_path.iterdir())


def test_replot_refuses_the_settings_of_a_run(capsys):
    """--replot draws the CSV as its run wrote it: --steps, --memory, --arms ... given with it
    are refused rather than ignored."""
    for flag, value in (("--steps", "100"), ("--memory", "short"), ("--log-grid", "3")):
        err = _one_line_error(["--preset", "toy", "--replot", "--plot", "none", flag, value],
                              capsys)
        assert f"--replot: {flag} sets up a run" in err


# --------------------------------------------------------------------------------------------
# arms grammar, window lists, cells


def test_arm_grammar_spells_every_recurrence_copy_and_keeps_the_aliases():
    """separate:HI[:R]:READ pairs any recurrence copy with any read copy (RN); the aliases
    are the same arms, dropped as duplicates; a missing read format expands over --formats."""
    arms = eg.parse_arms("separate:bf16:sr:nvfp4,separate:fp8_e4m3:sr:nvfp4,separate:fp32:nvfp4,"
                         "separate_fp16sr:nvfp4,separate:fp16:sr:nvfp4,separate_exact,"
                         "separate:bf16:rn", "nvfp4,fp16", "sr")
    assert [a.label for a in arms] == [
        "separate:bf16:sr:nvfp4", "separate:fp8_e4m3:sr:nvfp4", "separate:fp32:rn:nvfp4",
        "separate:fp16:sr:nvfp4", "separate:fp64:rn:nvfp4", "separate:fp64:rn:fp16",
        "separate:bf16:rn:nvfp4", "separate:bf16:rn:fp16"]
    policy = arms[0].policy(window=8, seed=3)
    assert (policy.kind, policy.hi_fmt, policy.hi_rounding, policy.fmt, policy.rounding,
            policy.window, policy.seed) == ("separate", "bf16", "sr", "nvfp4", "rn", 8, 3)
    assert arms[2].policy(window=8, seed=3).seed == 0  # an RN recurrence copy draws no words
    for item, message in (("separate", "HI_FORMAT"), ("separate:fp16:sr:nvfp4:x", "HI_FORMAT"),
                          ("separate:fp16:xx:nvfp4", "not a rounding"),
                          ("separate_fp16sr:nvfp4:sr", "RN"), ("every_step:fp16:rn:x", "FORMAT"),
                          ("separate:fp7:sr:nvfp4", "fp7")):
        with pytest.raises(ValueError, match=message):
            eg.parse_arms(item, "nvfp4", "sr")


def test_three_windows_run_into_one_csv_with_a_summary_each(tmp_path, capsys):
    """--arms separate:bf16:sr:nvfp4,separate:fp8_e4m3:sr:nvfp4 --window 8,16,32: one CSV
    with a window column, each window on its own recorded grid, a summary per window."""
    out = tmp_path / "w.csv"
    assert eg.main(["--arms", "separate:bf16:sr:nvfp4,separate:fp8_e4m3:sr:nvfp4", "--window",
                    "8,16,32", "--steps", "40", "--seeds", "2", "--memory", "long",
                    "--no-progress", "--out", str(out)]) == 0
    frame = eg.read_csv(out)
    assert sorted(frame["window"].unique()) == [8, 16, 32]
    assert len(frame) == 3 * 2 * 2 * 40
    assert set(frame["hi_format"]) == {"bf16", "fp8_e4m3"} and set(frame["lo_format"]) == {
        "nvfp4"}
    printed = capsys.readouterr().out
    assert all(f"mean over the {w}-step window" in printed for w in (8, 16, 32))
    assert (tmp_path / "w.png").stat().st_size > 10_000


def test_cells_computed_apart_and_merged_give_the_same_bytes(tmp_path):
    """run_cell of each cell of cells(config), computed in reverse order with the exact
    outputs recomputed, and merged by merge_cells, writes the CSV run() writes, byte for
    byte (the sharding contract)."""
    arms = eg.parse_arms("every_step:nvfp4:sr,shared:fp16:sr,separate_fp16sr:nvfp4", "nvfp4",
                         "sr")
    c = _config(tmp_path, arms=arms, dk=32, steps=37, window=(8, 16), log_grid=2)
    eg.run(c)
    grid = eg.cells(c)
    assert [(cell.window, cell.arm.label) for cell in grid] == [
        (w, a.label) for w in (8, 16) for a in arms]
    frames = {}
    for cell in reversed(grid):
        eg._EXACT_CACHE.clear()
        frames[cell.index] = eg.run_cell(c, cell)
    eg.write_csv(eg.merge_cells(c, frames), tmp_path / "merged.csv")
    assert (tmp_path / "merged.csv").read_bytes() == Path(c.out).read_bytes()


# --------------------------------------------------------------------------------------------
# reliability: atomic files, checked readers, output places


def _good_run(tmp_path, *extra):
    out = tmp_path / "good.csv"
    assert eg.main(["--steps", "48", "--seeds", "2", "--arms", "shared:fp16:sr", "--memory",
                    "short", "--log-grid", "2", "--no-progress", "--plot", "none", "--out",
                    str(out), *extra]) == 0
    return out


CORRUPTIONS = {
    # name: (edit of the CSV text, what the one-line error says)
    "cut mid-number": (lambda t: t[:-6], "incomplete"),
    "negative error": (lambda t: _edit_field(t, 2, -1, "-1.000000e-02"), "line 2: rel_err"),
    "step past the run": (lambda t: _edit_field(t, 3, 11, "999"), "line 3: step"),
    # --steps 48 --log-grid 2 records windows 1 and 3: step 20 lies in window 2
    "step off the grid": (lambda t: _edit_field(t, 3, 11, "20"), "recorded grid"),
    "row twice": (lambda t: t + t.splitlines()[1] + "\n", "repeats the point of line 2"),
    "exponent rewritten": (lambda t: _edit_field(t, 2, -1, "0.1019935"), "line 2: rel_err"),
    "column missing": (lambda t: "\n".join(",".join(r.split(",")[:-1]) for r in
                                           t.splitlines()) + "\n", "line 1: expected"),
    "a word for a number": (lambda t: _edit_field(t, 4, 10, "five"), "line 4: seed"),
    "arm and columns disagree": (lambda t: _edit_field(t, 2, 2, "bf16"), "line 2: hi_format"),
    "a value changed": (lambda t: _edit_field(t, 2, -1, "9.999999e-01"), "differ"),
    "empty": (lambda t: "", "empty"),
}


def _edit_field(text, line, column, value):
    rows = text.splitlines()
    fields = rows[line - 1].split(",")
    fields[column] = value
    rows[line - 1] = ",".join(fields)
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize("name", CORRUPTIONS, ids=CORRUPTIONS)
def test_replot_refuses_each_corruption_in_one_line_naming_file_and_line(tmp_path, capsys,
                                                                          name):
    """Each corruption of a good CSV is refused by --replot with exit status 2 and one line
    that names the file (and the line where there is one); the good CSV replots."""
    out = _good_run(tmp_path)
    capsys.readouterr()
    assert eg.main(["--replot", "--out", str(out), "--plot", "none"]) == 0
    edit, message = CORRUPTIONS[name]
    out.write_text(edit(out.read_text()))
    capsys.readouterr()
    err = _one_line_error(["--replot", "--out", str(out), "--plot", "none"], capsys)
    assert str(out) in err and message in err, err


def test_replot_refuses_a_stopped_run_and_a_csv_without_its_meta(tmp_path, capsys):
    """A CSV whose meta.json says the run stopped, or that has no meta.json, is refused."""
    out = _good_run(tmp_path)
    capsys.readouterr()
    meta = out.with_name("good.meta.json")
    meta.write_text(meta.read_text().replace('"status": "complete"', '"status": "stopped"'))
    assert "a stopped run" in _one_line_error(["--replot", "--out", str(out), "--plot", "none"],
                                              capsys)
    meta.unlink()
    assert "not found" in _one_line_error(["--replot", "--out", str(out), "--plot", "none"],
                                          capsys)


def test_a_write_error_mid_write_leaves_the_previous_file_whole(tmp_path, capsys, monkeypatch):
    """A write that fails after half its bytes (a full disk) leaves the final name as it was
    (here: the previous complete CSV) and no temporary file; the command says so in one
    line."""
    from experiments import _common

    out = _good_run(tmp_path)
    capsys.readouterr()
    before = out.read_bytes()
    real_open = open

    class HalfWriter:
        def __init__(self, handle):
            self.handle = handle

        def write(self, text):
            self.handle.write(text[: len(text) // 2])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(_common, "open", lambda *a, **k: HalfWriter(real_open(*a, **k)),
                        raising=False)
    err = _one_line_error(["--steps", "48", "--seeds", "2", "--arms", "shared:fp16:sr",
                           "--memory", "short", "--no-progress", "--plot", "none", "--out",
                           str(out), "--seed0", "7"], capsys)
    assert "No space left" in err
    assert out.read_bytes() == before
    # the finished cells stay in the store (the same command resumes), nothing else is left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.csv", "good.csv.cells",
                                                          "good.meta.json"]


def test_a_stopped_run_writes_a_partial_csv_and_the_rerun_resumes(tmp_path, capsys,
                                                                  monkeypatch):
    """Ctrl-C (SIGTERM reads the same) in the second cell: the first cell and the whole windows
    done of the second go to <stem>.partial.csv with a meta that says the run stopped, the
    final name is untouched, the exit status is 130; the same command then skips the finished
    cell and writes the bytes of an uninterrupted run."""
    calls = {"n": 0}
    real_next = eg._Inputs.next

    def next_or_stop(self):
        calls["n"] += 1
        if calls["n"] == 64 + 64 + 21:  # the exact run, the first cell, 20 steps of the second
            raise KeyboardInterrupt
        return real_next(self)

    argv = ["--steps", "64", "--seeds", "2", "--arms", "shared:fp16,every_step:fp16",
            "--memory", "short", "--no-progress", "--plot", "none"]
    out = tmp_path / "s.csv"
    monkeypatch.setattr(eg._Inputs, "next", next_or_stop)
    assert eg.main([*argv, "--out", str(out)]) == eg.STOPPED_STATUS == 130
    assert "stopped after 1 of 2 cells" in capsys.readouterr().err
    assert not out.exists()
    partial = eg.read_table(tmp_path / "s.partial.csv", eg.SCHEMA)
    last = partial.groupby("arm")["step"].max()
    assert last["shared:fp16:sr"] == 64  # the first cell whole
    assert last["every_step:fp16:sr"] == 16  # the second cell's whole windows: 16 of 20 steps
    assert '"status": "stopped' in (tmp_path / "s.partial.meta.json").read_text()
    monkeypatch.setattr(eg._Inputs, "next", real_next)
    assert eg.main([*argv, "--out", str(out)]) == 0
    assert "resuming: skipping 1 of 2 cells" in capsys.readouterr().err
    assert not (tmp_path / "s.partial.csv").exists()
    eg._EXACT_CACHE.clear()
    assert eg.main([*argv, "--out", str(tmp_path / "whole.csv")]) == 0
    assert out.read_bytes() == (tmp_path / "whole.csv").read_bytes()


def _python(code_or_args, cwd, **kwargs):
    return subprocess.Popen([sys.executable, *code_or_args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)}, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["imports", "run"])
def test_ctrl_c_at_any_point_exits_130_with_one_line(tmp_path, when):
    """SIGINT while torch is being imported, or during the run: exit status 130, no traceback
    and no file under the final name. In the imports: one line. In the run: the whole windows
    done go to <stem>.partial.csv (as the README says), and the last line says so."""
    import signal
    import time as clock

    out = tmp_path / "c.csv"
    proc = _python(["-m", "experiments.error_growth", "--steps", "4096", "--seeds", "8",
                    "--no-progress", "--out", str(out)], tmp_path)
    # 0.3 s: inside `import torch`; 8 s: in the run on a loaded 2-core machine (a signal
    # that still lands in the imports must give the same answer)
    clock.sleep(0.3 if when == "imports" else 8)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert not out.exists()
    lines = err.strip().splitlines()
    partial = tmp_path / "c.partial.csv"
    if partial.exists():  # the signal landed in the run
        assert f"wrote the whole windows done to {partial}" in lines[-1], err
        assert '"status": "stopped' in (tmp_path / "c.partial.meta.json").read_text()
    else:  # in the imports (a loaded machine may still be there at 8 s)
        assert lines == ["python -m experiments.error_growth: interrupted (Ctrl-C); no file "
                         "was left half-written"], err


def test_a_custom_run_leaves_the_committed_results_alone(tmp_path, capsys, monkeypatch):
    """--preset toy --recurrence gdn writes under runs/<name by what ran>/, not over
    results/error_growth_toy.*; the output line says where."""
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    for name in ("error_growth_toy.csv", "error_growth_toy.meta.json", "error_growth_toy.png"):
        (results / name).write_bytes((REPO / "results" / name).read_bytes())
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    assert eg.main(["--preset", "toy", "--recurrence", "gdn", "--steps", "32", "--seeds", "2",
                    "--no-progress"]) == 0
    assert {p.name: p.read_bytes() for p in results.iterdir()} == before
    folder = tmp_path / "runs" / "error_growth_toy_recurrence-gdn_steps-32_seeds-2"
    assert sorted(p.name for p in folder.iterdir()) == [
        "error_growth.csv", "error_growth.meta.json", "error_growth.png"]
    assert str(Path("runs") / folder.name / "error_growth.csv") in capsys.readouterr().err


def test_out_puts_every_artefact_in_its_folder_whatever_the_current_one(tmp_path, monkeypatch):
    """--out elsewhere/x.csv: x.csv, x.meta.json and x.png there, nothing in the current
    folder."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    monkeypatch.chdir(here)
    assert eg.main(["--steps", "16", "--seeds", "1", "--arms", "shared:fp16", "--memory",
                    "short", "--no-progress", "--out", str(there / "x.csv")]) == 0
    assert sorted(p.name for p in there.iterdir()) == ["x.csv", "x.meta.json", "x.png"]
    assert not list(here.iterdir())


@pytest.mark.parametrize("foreign", ["x.csv", "x.meta.json", "x.png"])
def test_a_foreign_file_is_replaced_only_with_force(tmp_path, capsys, foreign):
    """A file at an output path that is not this experiment's (another header, another JSON,
    a PNG of nobody's) is refused in one line, left as it was; --force replaces it."""
    (tmp_path / foreign).write_bytes(b"not ours\n")
    argv = ["--steps", "16", "--seeds", "1", "--arms", "shared:fp16", "--memory", "short",
            "--no-progress", "--out", str(tmp_path / "x.csv")]
    err = _one_line_error(argv, capsys)
    assert "is not an output of experiments.error_growth" in err and "--force" in err
    assert (tmp_path / foreign).read_bytes() == b"not ours\n"
    assert eg.main([*argv, "--force"]) == 0
    assert eg.main(argv) == 0  # now its own: a rerun needs no --force


@pytest.mark.slow
def test_the_toy_run_needs_neither_triton_nor_cutlass(tmp_path):
    """`pip install .` without extras: a toy-sized reference run with triton and cutlass
    unimportable (sys.modules entries None) writes its CSV and plot."""
    code = ("import sys, runpy; sys.modules['triton'] = None; sys.modules['cutlass'] = None; "
            f"sys.argv = ['eg', '--preset', 'toy', '--steps', '64', '--no-progress', '--out', "
            f"{str(tmp_path / 't.csv')!r}]; "
            "runpy.run_module('experiments.error_growth', run_name='__main__')")
    proc = _python(["-c", code], tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (tmp_path / "t.csv").is_file() and (tmp_path / "t.png").is_file()


# --------------------------------------------------------------------------------------------
# several ranks (torchrun, gloo on the CPU)

SWEEP_ARGS = ["--steps", "32", "--seeds", "2", "--memory", "short", "--arms",
              "shared:fp16:rn,every_step:fp16:rn,separate_fp16sr:fp16", "--sr-bits", "32,8",
              "--no-progress", "--plot", "none"]
# ends the process at once (a killed rank) when the cell named by the environment starts
KILLER = """import os, sys
from experiments import error_growth as eg
real = eg.run_cell
def run_cell(config, cell, **kwargs):
    if cell.key == os.environ.get("KILL_CELL"):
        os._exit(3)
    return real(config, cell, **kwargs)
eg.run_cell = run_cell
sys.exit(eg.main(sys.argv[1:]))
"""


def _torchrun(tmp_path, out, **env):
    """The command under torchrun (tests/torchrun.py); a hang fails the test through the
    timeout."""
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    return torchrun(script, [*SWEEP_ARGS, "--out", str(out)], cwd=tmp_path, pythonpath=REPO,
                    timeout=180, **env)


@pytest.mark.slow
def test_two_ranks_write_the_one_process_bytes_and_a_killed_rank_resumes(tmp_path, capsys):
    """torchrun --nproc-per-node 2 (gloo): the merged CSV is the single process's bytes and its
    meta.json records world size 2 and the cells of each rank; a rank killed in its second
    cell leaves the finished cells in the store, and the same command skips them and writes
    the same bytes."""
    single = tmp_path / "single.csv"
    assert eg.main([*SWEEP_ARGS, "--out", str(single)]) == 0
    sharded = tmp_path / "sharded.csv"
    done = _torchrun(tmp_path, sharded)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sharded.read_bytes() == single.read_bytes()
    record = __import__("json").loads((tmp_path / "sharded.meta.json").read_text())["sharding"]
    assert record["world_size"] == 2 and sum(r["cells"] for r in record["ranks"]) == 4
    resumed = tmp_path / "resumed.csv"
    # rank 1's second cell: its first is stored before it starts, whenever torchrun stops rank 0
    keys = [cell.key for cell in eg.cells(eg.config_from_args(eg.build_parser().parse_args(
        [*SWEEP_ARGS, "--out", str(resumed)])))]
    second_of_rank_1 = keys[assign_cells(len(keys), 2)[1][1]]
    killed = _torchrun(tmp_path, resumed, KILL_CELL=second_of_rank_1)
    assert killed.returncode != 0 and not resumed.exists()
    rerun = _torchrun(tmp_path, resumed)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resuming: skipping" in rerun.stderr
    assert resumed.read_bytes() == single.read_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("recurrence, dv, dk", [("mamba2", 8, 32), ("gdn", 8, 16), ("kda", 16, 16)])
def test_cuda_graph_chunks_give_the_rows_of_the_step_by_step_loop(monkeypatch, recurrence, dv,
                                                                   dk):
    """On a GPU the emulation's cells and the exact run replay CUDA graphs of whole input
    chunks: the rows (exact outputs, every arm's errors) are those of stepping one token at a
    time, over two graphed chunks and a partial one."""
    from experiments import error_growth_backends as backends

    steps = 2 * backends.INPUT_CHUNK + 37
    c = eg.Config(recurrence=recurrence, dv=dv, dk=dk, heads=3, seeds=2, steps=steps,
                  window=(8,), arms=eg.parse_arms(
                      "separate_fp16sr:nvfp4,every_step:bf16:rn,shared:fp16:rn", "nvfp4", "rn"),
                  memory=(eg.Memory("long", 0.9995, 0.99999), eg.Memory("short", 0.9, 0.95)),
                  log_grid=0, device="cuda", backend="emulation", progress=False)
    cells = eg.cells(c)

    def rows(graphs: bool):
        monkeypatch.setattr(backends, "CUDA_GRAPHS", graphs)
        backends._EXACT_CACHE.clear()
        y = backends.exact_outputs(c, 8)[1].cpu()
        return y, [backends.run_cell(c, cell) for cell in cells]

    y_graph, graphed = rows(True)
    y_step, stepped = rows(False)
    assert torch.equal(y_graph, y_step)
    for g, s in zip(graphed, stepped, strict=True):
        pd.testing.assert_frame_equal(g, s)
        assert g.rel_err.between(0, 1).all()  # finite errors, each arm's own


@pytest.mark.parametrize("dof,want", [(1, 12.7062), (2, 4.3027), (7, 2.3646), (30, 2.0423)])
def test_student_t_quantile_matches_the_tables(dof, want):
    """The SR table's interval uses Student t quantiles computed without scipy: the two-sided
    95% points of the printed tables to four decimals."""
    assert eg.student_t_quantile(0.975, dof) == pytest.approx(want, abs=1e-4)
