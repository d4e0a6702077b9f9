"""experiments.tail_overlap: its case parsing and argument checks, the summary and plot it draws
from a CSV (CPU), and on the GPU that its two-stream form really overlaps launches and that
both forms give a non-flush step's outputs bit for bit."""

import math

import pandas as pd
import pytest
import torch

from experiments import cases, harness
from experiments import tail_overlap as to


def test_kernels_are_distinct_names_of_the_kits_kernels():
    assert to._kernels("cute:nonflush:nvfp4, cute:flush:fp32") == ["cute:nonflush:nvfp4",
                                                                   "cute:flush:fp32"]
    for text in ("vllm:nonflush:fp32", "cute:nonflush:nvfp4,cute:nonflush:nvfp4",
                 "cute:nonflush:nvfp4,", "cute:nonflush:fp64"):
        with pytest.raises(ValueError, match="expected distinct names from cute:"):
            to._kernels(text)


def _csv(tmp_path):
    """Two kernels and a copy, each serial and on two streams, random times; with the optional
    knobs column, which names a kernel's configuration besides its name."""
    gen = torch.Generator().manual_seed(11)
    rows = []
    for kernel, knobs, nbytes in [("cute:nonflush:nvfp4", "", 204_300_000),
                                  ("cute:nonflush:nvfp4", "head_splits=2", 204_300_000),
                                  ("copy of 204.3 MB", "", 204_300_000)]:
        serial = 50 + 10 * float(torch.rand((), generator=gen))
        for form, streams, t in (("serial", 1, serial),
                                 ("2 streams", 2, serial - 3 * float(torch.rand((),
                                                                                generator=gen)))):
            gbps = nbytes / t / 1e3
            rows.append(dict(run="A", kernel=kernel, knobs=knobs, shape="nemotron3-super",
                             batch=256, window=16, cursor=8, form=form, streams=streams,
                             bytes=nbytes, sets=4, time_us=t, time_us_p10=0.99 * t,
                             time_us_p90=1.01 * t, gbps=gbps, frac_copy=gbps / 4236.0,
                             copy_gbps=4236.0, timing="graph"))
    path = tmp_path / "tail.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path, rows


def test_plot_only_prints_each_row_and_what_two_streams_hide(tmp_path, capsys):
    path, rows = _csv(tmp_path)
    png = tmp_path / "tail.png"
    assert to.main(["--plot-only", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(rows) + 3
    for line, row in zip(out[:len(rows)], rows, strict=True):
        assert row["form"] in line and f"{row['frac_copy']:.3f} of copy" in line
        assert f"{row['time_us']:8.2f} us" in line
    for line, (serial, streams) in zip(out[len(rows):], zip(rows[::2], rows[1::2],
                                                            strict=True), strict=True):
        lost = serial["time_us"] - streams["time_us"]
        assert serial["kernel"] in line
        assert f"= {lost:.2f} us ({lost / serial['time_us']:.1%} of the serial launch)" in line
    assert "head_splits=2: serial - two streams" in out[-2]
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps: expected an int >= 1, got 0"),
    (["--batch", "0"], "--batch: expected an int >= 1, got 0"),
    (["--window", "16", "--cursor", "15"], "--cursor: a non-flush step's cursor is at most"),
    (["--kernels", "cute:nonflush:nvfp4,vllm:update:fp32"], "--kernels: expected distinct"),
    (["--plot-only", "no/such.csv"], "--plot-only: no file no/such.csv"),
    (["--shape", "mamba3"], "invalid choice: 'mamba3'"),
    (["--bat", "8"], "unrecognized arguments: --bat"),
])
def test_argument_mistakes_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        to.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_csv_of_another_script_is_named_and_without_a_gpu_the_run_is_refused(tmp_path, capsys,
                                                                               monkeypatch):
    other = tmp_path / "other.csv"
    pd.DataFrame({"run": ["A"], "kernel": ["x"]}).to_csv(other, index=False)
    with pytest.raises(SystemExit):
        to.main(["--plot-only", str(other), "--plot", "none"])
    err = capsys.readouterr().err
    assert f"--plot-only: {other} (tail_overlap CSV): expected the columns" in err
    assert "missing shape, batch" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        to.main(["--out", str(tmp_path / "t.csv")])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()


@pytest.mark.gpu
def test_two_streams_overlap_consecutive_launches():
    """Four single-thread spins of about 20 us: one after another they take about four spins'
    time a replay, on two streams about two (the side streams really run side by side)."""
    spins = [lambda: torch.cuda._sleep(40_000) for _ in range(4)]
    serial, _ = harness.time_launches(spins, lambda: None, reps=5, lead_cycles=0)
    streams, method = harness.time_launches(spins, lambda: None, reps=5, lead_cycles=0, streams=2)
    assert method == "graph"
    ratio = sorted(streams)[2] / sorted(serial)[2]
    assert 0.4 < ratio < 0.65, (serial, streams)


@pytest.mark.gpu
def test_measure_times_both_forms_of_a_checked_step_and_its_copy():
    """At batch 24 (odd multiple of 8), cursor 5: rows for the step and the copy of its bytes,
    each serial and on two streams, with the bytes the benchmark counts; measure itself checks
    the step against the fp64 reference and the two forms' outputs bit for bit."""
    df = to.measure(["cute:nonflush:nvfp4"], "nemotron3-super", 24, 16, 5, reps=3,
                    run="t", log=lambda *_: None)
    nbytes = cases.kernel_bytes("cute:nonflush:nvfp4", cases.SHAPES["nemotron3-super"], 24, 5)
    assert list(df["form"]) == ["serial", "2 streams"] * 2
    copy = f"copy of {nbytes / 1e6:.1f} MB"
    assert list(df["kernel"]) == ["cute:nonflush:nvfp4"] * 2 + [copy] * 2
    assert (df["bytes"].iloc[:2] == nbytes).all()
    assert (df["bytes"].iloc[2:] - nbytes).abs().max() < 8
    assert (df["time_us"] > 0).all() and (df["sets"] % 2 == 0).all()
    for _, row in df.iterrows():
        assert math.isclose(row["gbps"], row["bytes"] / row["time_us"] / 1e3)
        assert math.isclose(row["frac_copy"], row["gbps"] / row["copy_gbps"])
