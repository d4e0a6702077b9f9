"""experiments/_common.py: atomic output files, the checked CSV reader, foreign outputs."""

import json

import pandas as pd
import pytest

from experiments import _common as common

SCHEMA = common.Schema(
    (common.Column("name", choices=("a", "b")), common.Column("n", int, minimum=1),
     common.Column("x", float, pattern=common.FLOAT_6E, minimum=0.0, nonfinite=True)),
    keys=("name", "n"))


def _table(tmp_path, text):
    path = tmp_path / "t.csv"
    path.write_text(text)
    return path


def test_an_exception_mid_write_leaves_no_file_and_no_temporary(tmp_path):
    """atomic_file: an error after half the bytes leaves the final name as it was (absent,
    or the previous complete file) and no temporary file beside it."""
    path = tmp_path / "out.csv"
    with pytest.raises(OSError), common.atomic_file(path) as handle:
        handle.write("half,")
        raise OSError(28, "No space left on device")
    assert not list(tmp_path.iterdir())
    common.write_text(path, "whole\n")
    with pytest.raises(KeyboardInterrupt), common.atomic_file(path) as handle:
        handle.write("half,")
        raise KeyboardInterrupt
    assert path.read_text() == "whole\n" and [p.name for p in tmp_path.iterdir()] == ["out.csv"]


def test_write_meta_records_the_csv_rows_and_sha256(tmp_path):
    """The sidecar holds the CSV's row count and sha256, which check_against_meta compares
    with the file (and refuses once a byte changes)."""
    csv = tmp_path / "r.csv"
    common.write_csv(pd.DataFrame({"name": ["a", "b"], "n": [1, 2], "x": [0.5, 0.25]}), csv,
                     float_format="%.6e")
    meta = json.loads(common.write_meta(csv, "python -m x", 1.0, {}).read_text())
    assert meta["csv"]["rows"] == 2 and meta["csv"]["sha256"] == common.file_sha256(csv)
    common.check_against_meta(csv, meta)
    csv.write_text(csv.read_text().replace("2.5", "2.6"))
    with pytest.raises(common.BadFile, match="differ"):
        common.check_against_meta(csv, meta)


BAD = {
    "cut": ("name,n,x\na,1,1.000000e-01\nb,2,2.0000", "line 3: incomplete"),
    "header": ("name,x\na,1.000000e-01\n", "line 1: expected the columns"),
    "few fields": ("name,n,x\na,1\n", "line 2: expected 3 fields, got 2"),
    "many fields": ("name,n,x\na,1,1.000000e-01,9\n", "line 2: expected 3 fields, got 4"),
    "type": ("name,n,x\na,one,1.000000e-01\n", "line 2: n: expected an integer"),
    "range": ("name,n,x\na,0,1.000000e-01\n", "line 2: n: expected values >= 1"),
    "negative": ("name,n,x\na,1,-1.000000e-01\n", "line 2: x: expected values >= 0"),
    "format": ("name,n,x\na,1,0.1\n", "line 2: x: expected values written as"),
    "choice": ("name,n,x\nc,1,1.000000e-01\n", "line 2: name: expected one of"),
    "duplicate": ("name,n,x\na,1,1.000000e-01\nb,1,1.000000e-01\na,1,2.000000e-01\n",
                  "line 4: repeats the point of line 2 (name=a, n=1)"),
    "blank line": ("name,n,x\na,1,1.000000e-01\n\nb,2,1.000000e-01\n", "blank"),
}


@pytest.mark.parametrize("name", BAD, ids=BAD)
def test_read_table_refuses_each_bad_file_in_one_line_naming_file_and_line(tmp_path, name):
    text, message = BAD[name]
    path = _table(tmp_path, text)
    with pytest.raises(common.BadFile) as info:
        common.read_table(path, SCHEMA)
    assert str(path) in str(info.value) and message in str(info.value)
    assert "\n" not in str(info.value)


def test_read_table_types_the_columns_and_keeps_nan_where_allowed(tmp_path):
    path = _table(tmp_path, "name,n,x\na,3,nan\nb,18446744073709551615,2.500000e+00\n")
    table = common.read_table(path, SCHEMA)
    assert table["n"].tolist() == [3, 2**64 - 1] and table["x"].iloc[1] == 2.5
    assert pd.isna(table["x"].iloc[0])


def test_output_problem_knows_its_own_files_and_refuses_others(tmp_path):
    """Ours: a CSV with our header or beside our meta.json, a JSON whose command runs us, a
    PNG with our text chunk; anything else at that path is foreign."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv, meta, png = tmp_path / "r.csv", tmp_path / "r.meta.json", tmp_path / "p.png"
    csv.write_text("name,n,x\n")
    assert common.output_problem(csv, "experiments.e", "name,n,x") is None
    assert "not an output" in common.output_problem(csv, "experiments.e", "other")
    meta.write_text(json.dumps({"command": "python -m experiments.e --x"}))
    assert common.output_problem(csv, "experiments.e", "other") is None  # its meta says so
    assert common.output_problem(meta, "experiments.f") is not None
    fig = plt.figure()
    common.save_small_png(fig, png, dpi=150, source="experiments.e")
    plt.close(fig)
    assert common.output_problem(png, "experiments.e") is None
    assert common.output_problem(png, "experiments.f") is not None
    assert common.output_problem(tmp_path / "absent.csv", "experiments.e", "h") is None


def test_runs_folder_names_the_settings_and_bounds_the_length():
    assert str(common.runs_folder("eg", ["toy", "window-8,16"])) == "runs/eg_toy_window-8-16"
    long = common.runs_folder("eg", ["custom", "arms-" + "x" * 200])
    assert len(long.name) <= 100 and long.parent.name == "runs"
    assert long != common.runs_folder("eg", ["custom", "arms-" + "x" * 199 + "y"])
