"""experiments.copy_sizes on the CPU: the sizes it times, its argument checks, and the summary
and plot it draws from a CSV (the timing itself needs the GPU machine)."""

import pandas as pd
import pytest
import torch

from experiments import cases as kb
from experiments import copy_sizes as cs


def test_default_sizes_start_with_the_headline_kernels_bytes_and_end_at_the_ceilings():
    """The first two sizes are the bytes kernel_bench counts for the two non-flush steps at
    the headline point; the grid ends at 2 GiB, the traffic of kernel_bench's large copy."""
    sizes = cs.default_sizes()
    shape = kb.SHAPES["nemotron3-super"]
    assert [b for _, b in sizes[:2]] == [kb.kernel_bytes(k, shape, 256, 8)
                                         for k in ("cute:nonflush:nvfp4", "cute:nonflush:fp32")]
    assert 200e6 < sizes[0][1] < 210e6  # the 204 MB of results/README.md
    assert sizes[-1][1] == 2 * 2**30 == 2 * (2**30 // 4) * 4
    assert len({b for _, b in sizes}) == len(sizes)
    assert cs.default_sizes((3, 1000))[2:] == [("3 MiB", 3 << 20), ("1000 MiB", 1000 << 20)]


def _csv(tmp_path):
    rng = torch.Generator().manual_seed(3)
    sizes = cs.default_sizes()
    gbps = (3000 + 1200 * torch.rand(len(sizes), generator=rng)).tolist()
    rows = [dict(run="A", label=label, bytes=b, sets=4 + i, time_us=b / g / 1e3,
                 time_us_p10=0.99 * b / g / 1e3, time_us_p90=1.01 * b / g / 1e3, gbps=g,
                 frac_ceiling=g / 4261.0, ceiling_gbps=4261.0, timing="graph")
            for i, ((label, b), g) in enumerate(zip(sizes, gbps, strict=True))]
    path = tmp_path / "copy.csv"
    pd.DataFrame(rows, columns=cs.COLUMNS).to_csv(path, index=False)
    return path, rows


def test_plot_only_prints_each_size_and_draws_the_plot(tmp_path, capsys):
    path, rows = _csv(tmp_path)
    png = tmp_path / "copy.png"
    assert cs.main(["--plot-only", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(rows)
    for line, row in zip(out, rows, strict=True):
        assert row["label"] in line and f"{row['frac_ceiling']:.3f} of 4,261" in line
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps: expected an int >= 1, got 0"),
    (["--plot-only", "no/such.csv"], "--plot-only: no file no/such.csv"),
    (["--abbrev"], "unrecognized arguments: --abbrev"),
    (["--mib", "64,x"], "--mib: expected distinct integers in [1, 16384]"),
    (["--mib", "64,64"], "--mib: expected distinct integers"),
    (["--mib", "0"], "--mib: expected distinct integers"),
])
def test_argument_mistakes_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cs.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_csv_of_another_script_is_named_and_without_a_gpu_the_run_is_refused(tmp_path, capsys,
                                                                               monkeypatch):
    other = tmp_path / "other.csv"
    pd.DataFrame({"run": ["A"], "label": ["x"], "bytes": [1]}).to_csv(other, index=False)
    with pytest.raises(SystemExit):
        cs.main(["--plot-only", str(other), "--plot", "none"])
    err = capsys.readouterr().err
    assert f"--plot-only: {other} (copy_sizes CSV): expected the columns" in err
    assert "missing sets" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        cs.main(["--out", str(tmp_path / "c.csv")])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "c.csv").exists()
