"""Property: an experiment's CSV reader, given a file it wrote and then corrupted at random
(cut at a byte, bytes flipped, inserted or deleted, a row dropped or repeated, two column names
swapped, an exponent changed, an error made negative or NaN), either returns the frame of the
original file (the corruption changed nothing) or refuses with a ValueError (``BadFile``
included) or SystemExit whose message is one line naming the file; never another exception,
never a different frame."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
SETTINGS = settings(derandomize=True, deadline=None, max_examples=25,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@st.composite
def corruptions(draw, data: bytes):
    """A corrupted copy of ``data`` (it may equal ``data``)."""
    lines = data.split(b"\n")[:-1]
    kind = draw(st.sampled_from(["cut", "flip", "insert", "delete", "drop_row", "repeat_row",
                                 "swap_names", "exponent", "negative", "nan"]))
    if kind == "cut":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind in ("flip", "insert", "delete"):
        at = draw(st.integers(0, len(data) - 1))
        byte = bytes([draw(st.integers(0, 255))])
        if kind == "flip":
            return data[:at] + byte + data[at + 1:]
        return data[:at] + (byte if kind == "insert" else b"") + data[at + (kind == "delete"):]
    if kind in ("drop_row", "repeat_row"):
        row = draw(st.integers(1, len(lines) - 1))
        lines = lines[:row] + ([] if kind == "drop_row" else [lines[row]]) + lines[row:]
        return b"\n".join(lines) + b"\n"
    if kind == "swap_names":
        names = lines[0].split(b",")
        i, j = draw(st.integers(0, len(names) - 1)), draw(st.integers(0, len(names) - 1))
        names[i], names[j] = names[j], names[i]
        return b"\n".join([b",".join(names), *lines[1:]]) + b"\n"
    row = draw(st.integers(1, len(lines) - 1))
    text = lines[row].decode()
    numbers = list(re.finditer(r"-?\d+\.\d+(e[+-]\d+)?", text))
    if not numbers:
        return data
    m = draw(st.sampled_from(numbers))
    if kind == "exponent":
        new = re.sub(r"e([+-])(\d+)", lambda e: f"e{e[1]}{int(e[2]) + 1:02d}", m[0]) \
            if "e" in m[0] else m[0] + "e+01"
    else:
        new = "-" + m[0].lstrip("-") if kind == "negative" else "nan"
    lines[row] = (text[:m.start()] + new + text[m.end():]).encode()
    return b"\n".join(lines) + b"\n"


def _check(reader, path: Path, original: pd.DataFrame) -> None:
    try:
        frame = reader(path)
    except (ValueError, SystemExit) as error:
        message = str(error.code if isinstance(error, SystemExit) else error)
        assert "\n" not in message.strip() and str(path) in message, message
        return
    pd.testing.assert_frame_equal(frame.reset_index(drop=True),
                                  original.reset_index(drop=True))


def _copy(tmp, *names, into=RESULTS) -> Path:
    for name in names:
        shutil.copy(into / name, tmp / name)
    return tmp / names[0]


def _property(reader, csv: Path):
    data, original = csv.read_bytes(), reader(csv)

    @SETTINGS
    @given(st.data())
    def run(draw):
        csv.write_bytes(draw.draw(corruptions(data)))
        _check(reader, csv, original)

    run()


def test_error_growth_replot_reader_returns_the_frame_or_refuses_in_one_line(tmp_path):
    from experiments import error_growth as eg

    csv = _copy(tmp_path, "error_growth_toy.csv", "error_growth_toy.meta.json")
    _property(eg.read_csv, csv)


def test_traffic_plot_only_reader_returns_the_frame_or_refuses_in_one_line(tmp_path):
    from experiments import traffic

    csv = _copy(tmp_path, "traffic_spec_nemotron3-super.csv", "traffic_nemotron3-super.meta.json")
    _property(traffic.read_sweep, csv)


def _with_run_meta(tmp_path, name, module):
    from experiments import harness

    csv = _copy(tmp_path, name)
    harness.write_run_meta(csv, module, [], 0.0, {})
    return csv


@pytest.mark.parametrize("module, name, read", [
    ("experiments.kernel_bench", "kernel_bench_same_kernels/product_346311a.csv",
     lambda p: __import__("experiments.kernel_bench", fromlist=["x"]).read_csv(p)),
    ("experiments.copy_sizes", "copy_sizes.csv",
     lambda p: __import__("experiments._gpu_cli", fromlist=["x"]).read_csv(
         p, __import__("experiments.copy_sizes", fromlist=["x"]).COLUMN_TYPES, "copy_sizes",
         key=["run", "label"])),
    ("experiments.staggered_step", "staggered_step.csv",
     lambda p: __import__("experiments.staggered_step", fromlist=["x"]).read_csv(p)),
])
def test_gpu_run_readers_return_the_frame_or_refuse_in_one_line(tmp_path, module, name, read):
    """kernel_bench's --plot-only/--merge reader and the GPU diagnostics' (harness.read_table
    underneath), on a CSV with the meta.json a run writes beside it."""
    (tmp_path / Path(name).parent).mkdir(exist_ok=True)
    csv = _with_run_meta(tmp_path, name, module)
    _property(read, csv)


@pytest.mark.slow
@pytest.mark.parametrize("module", ["experiments.kernel_bench", "experiments.copy_sizes"])
def test_ctrl_c_during_imports_exits_130_with_one_line(module):
    """SIGINT while the command imports torch/pandas: status 130 and one line on stderr."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", module, "--help"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
