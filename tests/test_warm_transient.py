"""experiments.warm_transient: how it counts a transient's passes, its argument checks and the
summary and plot it draws from a CSV (CPU); on the GPU, every phase's replays of a checked
step."""

import pandas as pd
import pytest
import torch

from experiments import warm_transient as wt


def test_settled_after_counts_the_passes_through_the_last_slow_one():
    gen = torch.Generator().manual_seed(5)
    noise = (1 + 0.005 * torch.rand(40, generator=gen)).tolist()
    steady = [56.3 * n for n in noise]
    assert wt.settled_after(steady) == 0
    slow = [59.5 * n for n in noise[:17]] + steady[17:]
    assert wt.settled_after(slow) == 17
    # one late slow replay ends the transient there
    late = steady[:25] + [60.0] + steady[26:]
    assert wt.settled_after(late) == 26
    # 1.9% above the settled median is not slow
    assert wt.settled_after([56.0 * 1.019] * 5 + [56.0] * 35) == 0


def _csv(tmp_path):
    gen = torch.Generator().manual_seed(9)
    rows = []
    for kernel, fast, slow_for in (("cute:nonflush:nvfp4", 56.4, 18), ("cute:nonflush:fp32",
                                                                         283.2, 8)):
        for k, phase in enumerate(wt.PHASES):
            n = slow_for if k in (0, 2, 4) else 0
            for i in range(48):
                t = fast * (1.06 if i < n else 1.0) * (1 + 0.003 * float(
                    torch.rand((), generator=gen)))
                rows.append(dict(run="A", kernel=kernel, shape="nemotron3-super", batch=256,
                                 window=16, cursor=8, sets=4, phase=phase, replay=i + 1,
                                 time_us=t, clocks_after="1980 MHz, 3201 MHz, P0"))
    path = tmp_path / "warm.csv"
    pd.DataFrame(rows, columns=wt.COLUMNS).to_csv(path, index=False)
    return path


def test_plot_only_names_each_phases_slow_passes_and_draws(tmp_path, capsys):
    path = _csv(tmp_path)
    png = tmp_path / "warm.png"
    assert wt.main(["--plot-only", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 * len(wt.PHASES)
    assert "fresh " in out[0] and "slow (> 1.02x) through replay  18, +6." in out[0]
    assert out[0].endswith("[after: 1980 MHz, 3201 MHz, P0]")
    assert "same buffers, new graph" in out[1] and "through replay   0  [after" in out[1]
    assert "cute:nonflush:fp32" in out[7] and "state rewritten" in out[7]
    assert "through replay   8" in out[7]
    assert png.stat().st_size > 10_000


def test_a_csv_without_the_clocks_column_still_reads(tmp_path, capsys):
    path = _csv(tmp_path)
    pd.read_csv(path).drop(columns="clocks_after").to_csv(path, index=False)
    assert wt.main(["--plot-only", str(path), "--plot", "none"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 * len(wt.PHASES) and "[after" not in out[0]
    assert out[0].endswith("% there")


def test_clocks_asks_nvidia_smi_and_never_raises():
    class Done:
        returncode, stdout = 0, "1980 MHz, 3201 MHz, P0\n"

    asked = []

    def ok(cmd, **kw):
        asked.append(cmd)
        return Done()

    assert wt.clocks(ok) == "1980 MHz, 3201 MHz, P0"
    assert asked[0][:2] == ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,pstate"]

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    assert wt.clocks(missing) == ""

    class Failed:
        returncode, stdout = 9, "No devices were found"

    assert wt.clocks(lambda cmd, **kw: Failed()) == ""


@pytest.mark.parametrize("argv, message", [
    (["--kernels", "cute:flush:fp32"], "--kernels: expected distinct names from"),
    (["--kernels", "cute:nonflush:fp32,cute:nonflush:fp32"], "--kernels: expected distinct"),
    (["--kernels", ","], "--kernels: expected distinct"),
    (["--replays", "4"], "--replays: expected an int >= 8, got 4"),
    (["--window", "8", "--cursor", "7"], "--cursor: a non-flush step's cursor is at most L - 2"),
    (["--plot-only", "no/such.csv"], "--plot-only: no file no/such.csv"),
    (["--replay", "9"], "unrecognized arguments: --replay"),
])
def test_argument_mistakes_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        wt.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_csv_of_another_script_is_named_and_without_a_gpu_the_run_is_refused(tmp_path, capsys,
                                                                               monkeypatch):
    other = tmp_path / "other.csv"
    pd.DataFrame({"run": ["A"], "kernel": ["x"], "shape": ["y"]}).to_csv(other, index=False)
    with pytest.raises(SystemExit):
        wt.main(["--plot-only", str(other), "--plot", "none"])
    err = capsys.readouterr().err
    assert f"--plot-only: {other} (warm_transient CSV): expected the columns" in err
    assert "missing batch" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        wt.main(["--out", str(tmp_path / "w.csv")])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "w.csv").exists()


@pytest.mark.gpu
def test_measure_times_every_replay_of_every_phase_of_a_checked_step():
    df = wt.measure(["cute:nonflush:nvfp4"], "nemotron3-super", 24, 16, 5, replays=9, run="t",
                    log=lambda *_: None)
    assert list(df["phase"].unique()) == list(wt.PHASES)
    for _, part in df.groupby("phase"):
        assert part["replay"].tolist() == list(range(1, 10))
    assert (df["time_us"] > 0).all() and df["sets"].nunique() == 1 and df["sets"].iloc[0] >= 4
    assert df["clocks_after"].str.contains("MHz").all()  # nvidia-smi is there on the GPU machine
