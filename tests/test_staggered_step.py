"""experiments.staggered_step: its batch layout and byte accounting and its CSV summary and
plot on the CPU; on the GPU, that its three ways of launching one staggered step agree (the
overlapped launch bit for bit with the grouped one: no race between the two streams)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments import cases as kb
from experiments import staggered_step as st
from lowprec import traffic

REPO = Path(__file__).resolve().parent.parent
NEMOTRON = kb.SHAPES["nemotron3-super"]
# replay_output needs headdim % 16 == 0 and dstate % 128 == 0 for nvfp4; odd head count
DECODE = kb.BenchShape("decode", nheads=6, headdim=32, dstate=128, ngroups=3, source="test")


@pytest.mark.parametrize("batch, window", [(16, 16), (48, 16), (40, 8), (96, 32)])
def test_every_cursor_holds_the_same_number_of_slots_and_flush_slots_come_last(batch, window):
    cursors = st.cursor_layout(batch, window)
    assert len(cursors) == batch
    assert cursors == sorted(cursors)
    for cursor in range(window):
        assert cursors.count(cursor) == batch // window
    assert cursors[-(batch // window):] == [window - 1] * (batch // window)


def test_a_synchronized_batch_holds_one_non_flush_cursor_everywhere():
    assert st.cursor_layout(5, 16, cursor=8) == [8] * 5
    for cursor in (-1, 15, 16):
        with pytest.raises(ValueError, match="--cursor"):
            st.cursor_layout(32, 16, cursor=cursor)
    per_slot = kb.kernel_bytes("cute:nonflush:nvfp4", NEMOTRON, 1, 8)
    assert st.step_bytes("two-precision", NEMOTRON, 7, 16, cursor=8) == 7 * per_slot


@pytest.mark.parametrize("batch, window", [(24, 16), (8, 16), (17, 1), (0, 4)])
def test_a_batch_that_does_not_fill_every_cursor_is_refused(batch, window):
    with pytest.raises(ValueError, match="multiple of the window|windows >= 2"):
        st.cursor_layout(batch, window)


@pytest.mark.parametrize("shape", [NEMOTRON, DECODE], ids=lambda s: s.name)
def test_step_bytes_are_a_window_of_each_slot_group(shape):
    """A staggered step over B = k L slots moves what k slots move over a whole window: k
    flushes (both copies read or written, one record, the token) and k non-flush steps at
    each cursor 0..L-2 (the read copy, `cursor` records read, one appended, the token),
    written out here from the traffic model's parts."""
    window, k = 16, 3
    ssm = shape.ssm
    record = traffic.record_bytes(ssm, "kernel", "bf16")
    token = kb.token_bytes(shape, 4)  # the kit's kernels take fp32 dt
    cases = {
        "two-precision": (traffic.state_bytes(ssm, "nvfp4"),
                          2 * traffic.state_bytes(ssm, "fp16") + traffic.state_bytes(ssm,
                                                                                     "nvfp4")),
        "fp32-replay": (traffic.state_bytes(ssm, "fp32"), 2 * traffic.state_bytes(ssm, "fp32")),
    }
    for scheme, (read_copy, flush_state) in cases.items():
        nonflush = sum(read_copy + (c + 1) * record + token for c in range(window - 1))
        flush = flush_state + window * record + token
        assert st.step_bytes(scheme, shape, k * window, window) == k * (nonflush + flush)
    update = 2 * traffic.state_bytes(ssm, "fp32") + token
    assert st.step_bytes("conventional-fp32", shape, k * window, window) == k * window * update


def _synthetic_frame() -> pd.DataFrame:
    """A run's CSV: three modes of each replay scheme and the update at batches 32 and 256,
    and a point whose check failed (not timed)."""
    rows = []
    for batch, (two, fp32, upd) in {32: (20.0, 50.0, 70.0), 256: (80.0, 300.0, 540.0)}.items():
        for scheme, base in (("two-precision", two), ("fp32-replay", fp32)):
            for mode, factor in (("decode-step", 1.1), ("grouped", 1.0), ("overlapped", 0.8)):
                rows.append(dict(scheme=scheme, mode=mode, shape="nemotron3-super",
                                 batch=batch, window=16, time_us=base * factor, status="ok"))
        rows.append(dict(scheme="conventional-fp32", mode="update", shape="nemotron3-super",
                         batch=batch, window=16, time_us=upd, status="ok"))
    rows.append(dict(scheme="two-precision", mode="overlapped", shape="nemotron3-super",
                     batch=64, window=16, time_us=float("nan"), status="check failed: x"))
    full = dict(run="r", layout="staggered", flush_slots=2, time_us_p10=1.0, time_us_p90=2.0,
                bytes=1000, gbps=1.0, frac_copy=0.5, copy_gbps=4000.0, sets=4, timing="graph",
                note="")
    return pd.DataFrame([{**full, **row} for row in rows], columns=list(st.COLUMN_TYPES))


def test_summary_takes_each_schemes_fastest_mode_and_same_mode_ratios():
    table = st.summarize(_synthetic_frame()).set_index("batch")
    assert list(table.index) == [32, 256]  # the failed point is not summarised
    row = table.loc[256]
    assert row["two-precision_mode"] == "overlapped"
    assert row["two-precision_us"] == pytest.approx(64.0)
    assert row["fp32-replay/two-precision (best)"] == pytest.approx(240.0 / 64.0)
    assert row["conventional-fp32/two-precision (best)"] == pytest.approx(540.0 / 64.0)
    assert row["fp32-replay/two-precision (grouped)"] == pytest.approx(300.0 / 80.0)


def test_plot_only_redraws_from_the_csv_without_a_gpu(tmp_path):
    csv = tmp_path / "staggered.csv"
    _synthetic_frame().to_csv(csv, index=False)
    result = subprocess.run(
        [sys.executable, "-m", "experiments.staggered_step", "--plot-only", str(csv),
         "--plot-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    png = tmp_path / "staggered_step_nemotron3-super_L16.png"
    assert png.exists() and png.stat().st_size > 10_000
    assert "b=256" in result.stdout and "3.75x" in result.stdout
    # --plot-dir none (kernel_bench's spelling) draws nothing, as '' does; no folder 'none'
    result = subprocess.run(
        [sys.executable, "-m", "experiments.staggered_step", "--plot-only", str(csv),
         "--plot-dir", "none"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "wrote" not in result.stderr and not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--batches", "24"], "--batches: batch 24 is not a multiple of the window 16"),
        (["--cursor", "8", "--modes", "overlapped"], "--modes: with --cursor"),  # nothing timed
        (["--plot-only", "results/staggered_step.csv", "--plot-dir", "README.md/x"], "--plot-dir"),
        (["--out", "README.md/s.csv"], "--out"),
        (["--batches", "32,x"], "comma-separated integers"),
        (["--batches", "32,,64"], "comma-separated integers"),  # an empty item: not dropped
        (["--schemes", "two-precision,"], "two-precision"),
        (["--modes", "grouped,fast"], "decode-step-serial"),
        (["--schemes", "fp64"], "two-precision"),
        (["--cursor", "15"], "--cursor: expected 0..14"),
        (["--reps", "0"], "--reps: expected an integer >= 1"),  # before the GPU is asked
        (["--lead-cycles", "-1"], "--lead-cycles: expected an integer >= 0"),
        (["--plot-only", "README.md"], "README.md (staggered_step CSV)"),
        (["--plot-only", "results/traffic_window_nemotron3-super.csv"],
         "(staggered_step CSV): expected the columns"),
        # a value given twice would be timed twice, its rows a repeated point of the CSV
        (["--batches", "48,16,48"], "--batches: expected each once, got 48 twice"),
        (["--windows", "8,16,8,16"], "--windows: expected each once, got 8, 16 twice"),
        (["--schemes", "fp32-replay,two-precision,fp32-replay"], "got fp32-replay twice"),
        (["--modes", "grouped,decode-step,grouped"], "--modes: expected each once"),
        # the conventional update has no modes: refused, not ignored
        (["--schemes", "conventional-fp32", "--modes", "overlapped"],
         "--modes: applies to the replay schemes"),
        (["--schemes=conventional-fp32", "--modes=grouped"], "conventional-fp32 is timed as one"),
        # a window of 1 has no non-flush cursor
        (["--cursor", "0", "--windows", "1"], "--windows: expected windows >= 2"),
        # a run's flags with --plot-only are refused, not ignored
        (["--plot-only", "results/staggered_step.csv", "--batches", "64", "--reps=5"],
         "--plot-only: redraws the CSV as it is; --batches, --reps are for a run"),
        (["--plot-only", "results/staggered_step.csv", "--out", "x.csv"], "--out is for a run"),
    ],
)
def test_bad_arguments_get_one_line_not_a_traceback(argv, words):
    result = subprocess.run([sys.executable, "-m", "experiments.staggered_step", *argv],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "defect, words",
    [
        (lambda f: f.drop(columns="shape"), "expected the columns"),
        (lambda f: f.assign(time_us=f["time_us"].astype(object).where(f.index != 3, "slow")),
         "line 5: column time_us: expected a float, got 'slow'"),
        (lambda f: f.assign(time_us=f["time_us"].where(f.index != 5, 0.0)),
         "line 7: column time_us: expected a time > 0 (µs) in an ok row, got 0"),
        (lambda f: f.assign(time_us=f["time_us"].where(f.index != 2, -37.5)),
         "line 4: column time_us"),  # it would print a negative speedup
        (lambda f: f.assign(batch=f["batch"].astype(object).where(f.index != 7, "6x")),
         "line 9: column batch: expected an integer, got '6x'"),
        (lambda f: f.assign(window=f["window"].where(f.index != 1, 12.5)),
         "line 3: column window: expected an integer"),
        (lambda f: f.assign(scheme=f["scheme"].where(f.index != 4, "fp8-replay")),
         "line 6: column scheme: expected one of two-precision, fp32-replay, "
         "conventional-fp32, got 'fp8-replay'"),
        (lambda f: f.assign(mode=f["mode"].where(f.index != 0, "fused")), "got 'fused'"),
        (lambda f: pd.concat([f, f.iloc[[5]].assign(time_us=123.0)]),
         "line 17: repeats the point of line 7"),
    ],
)
def test_plot_only_refuses_a_csv_it_cannot_summarise_in_one_line(tmp_path, defect, words):
    """Each defect of an otherwise good CSV is named in one line with the file and its line
    (exit status 2) before anything is drawn; a point that was not timed has an empty time,
    as the synthetic frame's failed point does."""
    csv = tmp_path / "bad.csv"
    defect(_synthetic_frame()).to_csv(csv, index=False)
    result = subprocess.run(
        [sys.executable, "-m", "experiments.staggered_step", "--plot-only", str(csv),
         "--plot-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.png"))
    good = tmp_path / "good.csv"
    _synthetic_frame().to_csv(good, index=False)
    assert len(st.read_csv(good)) == len(_synthetic_frame())


def test_batches_help_says_the_multiple_rule_does_not_hold_with_cursor():
    """The README's --cursor 8 --batches 1,8,... is allowed, and --help says so."""
    text = " ".join(st.build_parser().format_help().split())
    assert "each a multiple of every window" in text
    assert "except with --cursor, where any batch size is allowed" in text
    assert st.cursor_layout(1, 16, cursor=8) == [8]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU machine")
def test_a_cpu_machine_is_told_the_run_needs_a_gpu(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.staggered_step", "--batches", "32",
         "--out", str(tmp_path / "s.csv")], cwd=REPO, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a run refused for want of a GPU")
def test_a_run_refused_for_want_of_a_gpu_leaves_no_folders(tmp_path):
    """Nothing is made before the GPU is looked for: --out's folders neither."""
    out = tmp_path / "new" / "deeper" / "s.csv"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.staggered_step", "--batches", "32", "--out",
         str(out), "--plot-dir", str(tmp_path / "plots")], cwd=REPO, capture_output=True,
        text=True, timeout=120)
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["two-precision", "fp32-replay"])
@pytest.mark.parametrize("shape, batch, window", [(DECODE, 48, 16), (DECODE, 40, 8),
                                                  (NEMOTRON, 32, 16)],
                         ids=["decode-48-16", "decode-40-8", "nemotron-32-16"])
def test_the_three_launches_of_a_staggered_step_agree(scheme, shape, batch, window):
    """grouped and overlapped: every bit of every buffer equal (outputs, both copies, rings,
    counters); decode-step: equal but for summation order and the flush slots' SR bits; no
    output row left unwritten (the check poisons them)."""
    step = st.build_step(scheme, shape, batch, window, sets=2, device=torch.device("cuda"),
                         seed=7)
    before = {name: views[0].clone() for name, views in step.bufs.views.items()}
    problem, note = st.check_modes(step)
    assert problem == "", problem
    # the check restores the state it ran from, so timing starts from the same buffers
    for name, views in step.bufs.views.items():
        assert torch.equal(views[0].view(torch.uint8), before[name].view(torch.uint8)), name
    # one step of each launch really ran: cursors advanced (flush slots back to 0), and the
    # flush slots' checkpoints were written
    side = torch.cuda.Stream()
    expected = [(c + 1) % window for c in st.cursor_layout(batch, window)]
    views = step.bufs.views
    st.launcher(step, 0, "overlapped", side)()
    st.launcher(step, 0, "decode-step", side)()
    torch.cuda.synchronize()
    grouped = torch.cat([views["nf:cursors"][0], views["fl:cursors"][0]]).tolist()
    assert grouped == expected and views["cursors"][0].tolist() == expected
    assert not torch.equal(views["fl:hi"][0], before["fl:hi"])
    assert not torch.equal(views["hi"][0], before["hi"])


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["two-precision", "fp32-replay"])
def test_a_synchronized_step_through_the_decode_step_equals_the_non_flush_kernel(scheme):
    """Every slot at cursor 5 of 16: mamba2_replay_decode (which launches the flush kernel too,
    and whose CTAs then find no slot to flush) leaves every buffer as the non-flush kernel
    alone does, outputs included, and advances every cursor by one."""
    step = st.build_step(scheme, DECODE, 13, 16, sets=2, device=torch.device("cuda"), seed=3,
                         cursor=5)
    assert step.flush_slots == 0 and "fl:hi" not in step.bufs.views
    problem, _ = st.check_modes(step, ("decode-step", "decode-step-serial",
                                       "decode-step-indexed", "grouped"))
    assert problem == "", problem
    st.launcher(step, 0, "decode-step")()
    torch.cuda.synchronize()
    assert step.bufs.views["cursors"][0].tolist() == [6] * 13


@pytest.mark.gpu
def test_a_wrong_flush_slot_table_is_refused_when_checked():
    """mamba2_replay_decode(flush_slots=..., check_counters=True) compares the table with the
    cursors: a table that leaves a flushing slot out, or names one that does not flush, is a
    ValueError; a right one (any order) runs."""
    from cute_kernels.replay_decode import mamba2_replay_decode

    step = st.build_step("two-precision", DECODE, 32, 16, sets=1, device=torch.device("cuda"),
                         seed=5)
    t, p = step.bufs.at(0), step.params
    cache = st._cache(step, t)

    def run(table):
        mamba2_replay_decode(cache, t["x"], t["dt"], p["A"], t["B"], t["C"], p["D"], None,
                             p["dt_bias"], dt_softplus=True, out=t["out"],
                             flush_slots=torch.tensor(table, dtype=torch.int32, device="cuda"),
                             check_counters=True)

    for wrong in ([30], [29, 30, 31], [31, 31], [[30, 31]]):
        with pytest.raises(ValueError, match="flush_slots"):
            run(wrong)
    run([31, 30])
    torch.cuda.synchronize()
    assert t["cursors"][30:].tolist() == [0, 0]
