"""experiments/sharding.py: a sweep of cells gives the same CSV bytes on 1, 2 and 3 ranks
(gloo on the CPU, launched by torchrun as a user would), resumes from its cell store after a
killed rank, refuses cells of other arguments and recomputes unreadable ones, and stops every
rank with one line when a cell fails.

The sweep is tests/sharding_demo.py: 7 cells (odd, so ranks get unequal shares) of random
rows from a per-cell seed, sorted by columns that interleave the cells. The torchrun cases
start three or four Python processes each (about 10 s on a 2-core machine): marked slow."""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import sharding_demo
import torch
from torchrun import torchrun

from experiments.sharding import (
    SweepStopped,
    assign_cells,
    cell_store_path,
    fingerprint,
    ranks_from_env,
    run_sweep,
)

ROOT = Path(__file__).resolve().parent.parent
DEMO = Path(__file__).resolve().parent / "sharding_demo.py"
N_CELLS = 7


def _torchrun(nproc: int, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The demo under torchrun (tests/torchrun.py); a hang fails the test through the
    timeout."""
    return torchrun(DEMO, ["--out", str(out), *args], cwd=ROOT, pythonpath=ROOT, nproc=nproc,
                    timeout=150, **env)


def _expected_bytes(tmp_path: Path, *args: str) -> bytes:
    """The CSV computed without the engine: every cell's rows, concatenated, sorted by
    (group, j) stably, written by the demo's writer."""
    parsed = sharding_demo.build_parser().parse_args(["--out", "unused", *args])
    frame = pd.concat([sharding_demo.run_cell(parsed, c)
                       for c in sharding_demo.cells(parsed.cells)], ignore_index=True)
    frame = frame.sort_values(["group", "j"], kind="mergesort", ignore_index=True)
    path = tmp_path / "expected.csv"
    sharding_demo.write_csv(frame, path)
    return path.read_bytes()


def _meta(out: Path) -> dict:
    return json.loads(out.with_name(out.stem + ".meta.json").read_text())


def _valid_cells(out: Path) -> int:
    """Cell files of the store that unpickle to a record (what a rerun may skip)."""
    count = 0
    for path in cell_store_path(out).glob("*.pkl"):
        try:
            pickle.loads(path.read_bytes())
        except Exception:
            continue
        count += 1
    return count


# --------------------------------------------------------------------------------------------
# the pure parts


def test_assign_cells_round_robin_and_longest_first_by_hand():
    """7 cells on 3 ranks: round robin [[0,3,6],[1,4],[2,5]]; costs (5,1,4,2,3,9,1) longest
    first: 9->r0, 5->r1, 4->r2, 3->r2 (load 4), 2->r1 (5), 1->r1 (7 ties 7: lowest rank),
    1->r2 (7 < 8)."""
    assert assign_cells(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert assign_cells(7, 3, [5, 1, 4, 2, 3, 9, 1]) == [[5], [0, 3, 1], [2, 4, 6]]
    assert assign_cells(2, 3) == [[0], [1], []]


@pytest.mark.parametrize("n,world", [(0, 1), (1, 4), (13, 3), (29, 5)])
def test_assign_cells_runs_every_cell_once(n, world):
    """Every index lands on exactly one rank, with and without (random) costs."""
    import random

    costs = [random.Random(n).uniform(0.1, 7) for _ in range(n)]
    for shares in (assign_cells(n, world), assign_cells(n, world, costs)):
        assert len(shares) == world
        assert sorted(i for share in shares for i in share) == list(range(n))


def test_assign_cells_and_ranks_from_env_name_bad_values():
    with pytest.raises(ValueError, match="world_size: expected an integer >= 1, got 0"):
        assign_cells(3, 0)
    with pytest.raises(ValueError, match="costs: expected 3 values"):
        assign_cells(3, 2, [1.0, 2.0])
    with pytest.raises(ValueError, match="costs: expected finite numbers >= 0, got nan"):
        assign_cells(2, 2, [1.0, float("nan")])
    with pytest.raises(ValueError, match="RANK must be an integer under torchrun, got None"):
        ranks_from_env({"WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="RANK=2, WORLD_SIZE=2"):
        ranks_from_env({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})


def test_ranks_from_env_reads_torchrun_variables():
    """No WORLD_SIZE: a plain process (rank 0 of 1, backend none); torchrun's three variables
    give the rank, and gloo on a machine without CUDA."""
    plain = ranks_from_env({})
    assert (plain.rank, plain.world_size, plain.launched, plain.backend) == (0, 1, False, "none")
    ranks = ranks_from_env({"WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "1"})
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.launched) == (2, 3, 1, True)
    if not ranks_from_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}).device:
        assert ranks.backend == "gloo"


@pytest.mark.parametrize("gpus, device, backend", [(1, "cuda:0", "gloo"), (2, "cuda:0", "gloo"),
                                                    (3, "cuda:2", "nccl")])
def test_ranks_share_gpus_round_robin_over_gloo_when_a_node_has_fewer(monkeypatch, gpus, device,
                                                                      backend):
    """Three ranks on a node: each its own GPU over NCCL where there are three; round robin
    over fewer GPUs, with gloo (NCCL takes one rank a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    ranks = ranks_from_env({"WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "2",
                            "LOCAL_WORLD_SIZE": "3"})
    assert (ranks.device, ranks.backend, ranks.local_world_size) == (device, backend, 3)
    with pytest.raises(ValueError, match="LOCAL_RANK=3, LOCAL_WORLD_SIZE=3"):
        ranks_from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3",
                        "LOCAL_WORLD_SIZE": "3"})


def test_fingerprint_depends_on_values_not_key_order():
    assert fingerprint({"a": 1, "b": [2, 3]}) == fingerprint({"b": [2, 3], "a": 1})
    assert fingerprint({"a": 1, "b": [2, 3]}) != fingerprint({"a": 1, "b": [2, 4]})


def test_run_sweep_validates_its_arguments(tmp_path):
    out = tmp_path / "x.csv"
    with pytest.raises(ValueError, match="cells: expected at least one cell"):
        run_sweep([], lambda c: pd.DataFrame(), out=out, arguments={})
    with pytest.raises(ValueError, match="key: expected one key per cell, got 'k'"):
        run_sweep([1, 2], lambda c: pd.DataFrame(), out=out, arguments={}, key=lambda c: "k")
    with pytest.raises(TypeError, match="sort_by: expected a sequence of column names"):
        run_sweep([1], lambda c: pd.DataFrame(), out=out, arguments={}, sort_by="step")
    with pytest.raises(ValueError, match=r"sort_by: columns \['step'\] are not in the rows"):
        run_sweep([1, 2], lambda c: pd.DataFrame({"v": [c]}), out=out, arguments={},
                  sort_by=["step"], progress=None)
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# one process


def test_one_process_csv_equals_the_rows_computed_without_the_engine(tmp_path, capsys):
    """The plain command: every cell's rows, sorted, the demo writer's bytes; the store is
    gone afterwards and meta.json says world size 1 with 7 cells on rank 0."""
    out = tmp_path / "one.csv"
    assert sharding_demo.main(["--out", str(out)]) == 0
    assert out.read_bytes() == _expected_bytes(tmp_path)
    assert not cell_store_path(out).exists()
    meta = _meta(out)
    assert meta["command"].startswith("tests/sharding_demo.py")
    sharding = meta["sharding"]
    assert (sharding["world_size"], sharding["backend"], sharding["cells"]) == (1, "none", 7)
    assert [r["cells"] for r in sharding["ranks"]] == [N_CELLS]
    assert f"{N_CELLS}/{N_CELLS} cells" in capsys.readouterr().err


def test_stale_store_of_other_arguments_is_not_reused(tmp_path, capsys):
    """Cells kept from --scale 1 are not taken for --scale 2: one note, nothing skipped, and
    the CSV holds the --scale 2 rows."""
    out = tmp_path / "x.csv"
    assert sharding_demo.main(["--out", str(out), "--keep-cells"]) == 0
    assert _valid_cells(out) == N_CELLS
    capsys.readouterr()
    assert sharding_demo.main(["--out", str(out), "--scale", "2"]) == 0
    err = capsys.readouterr().err
    assert f"note: {N_CELLS} cell file(s) in {cell_store_path(out)} were made with other " \
           "arguments" in err
    assert "resuming" not in err
    assert out.read_bytes() == _expected_bytes(tmp_path, "--scale", "2")
    assert out.read_bytes() != _expected_bytes(tmp_path)
    assert _meta(out)["sharding"]["cells_from_store"] == 0


def test_corrupt_cell_files_are_computed_again(tmp_path, capsys):
    """A truncated cell file and one of foreign bytes each get a one-line note; the other 5
    cells are skipped and the CSV is the same bytes."""
    out = tmp_path / "x.csv"
    assert sharding_demo.main(["--out", str(out), "--keep-cells"]) == 0
    first = out.read_bytes()
    files = sorted(cell_store_path(out).glob("*.pkl"))
    files[0].write_bytes(files[0].read_bytes()[:100])
    files[1].write_bytes(b"cell,group\nc1,2\n")
    capsys.readouterr()
    assert sharding_demo.main(["--out", str(out)]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "not a readable cell file" in line]
    assert sorted(notes[i].split(":")[1].strip() for i in range(2)) == sorted(map(str, files[:2]))
    assert len(notes) == 2
    assert f"skipping {N_CELLS - 2} of {N_CELLS} cells" in err
    assert out.read_bytes() == first
    assert _meta(out)["sharding"]["cells_from_store"] == N_CELLS - 2


def test_interrupt_in_the_first_cell_says_nothing_was_kept(tmp_path, capsys):
    """Ctrl-C before any cell finished: the line does not point at an empty store."""
    out = tmp_path / "x.csv"

    def run_cell(cell):
        raise KeyboardInterrupt

    with pytest.raises(SweepStopped):
        run_sweep(range(N_CELLS), run_cell, out=out, arguments={"rows": 5}, progress=None)
    assert capsys.readouterr().err == (f"Ctrl-C after 0 of {N_CELLS} cells (none finished, "
                                       "nothing kept; the same command starts over)\n")
    assert not out.exists() and _valid_cells(out) == 0


def test_interrupt_keeps_finished_cells_and_the_rerun_resumes(tmp_path, capsys):
    """Ctrl-C in the fifth cell: SweepStopped(130) after one line, no CSV, four cells in the
    store; the rerun skips those four and writes the same bytes as an uninterrupted run."""
    out = tmp_path / "x.csv"
    args = sharding_demo.build_parser().parse_args(["--out", str(out)])

    def run_cell(cell):
        if cell == 4:
            raise KeyboardInterrupt
        return sharding_demo.run_cell(args, cell)

    with pytest.raises(SweepStopped) as stopped:
        run_sweep(range(N_CELLS), run_cell, out=out, arguments={"rows": 5}, sort_by=["j"],
                  progress=None)
    assert stopped.value.code == 130
    err = capsys.readouterr().err
    assert err == f"Ctrl-C after 4 of {N_CELLS} cells (kept in {cell_store_path(out)}; the " \
                  "same command resumes)\n"
    assert not out.exists() and _valid_cells(out) == 4
    sweep = run_sweep(range(N_CELLS), lambda c: sharding_demo.run_cell(args, c), out=out,
                      arguments={"rows": 5}, sort_by=["j"], progress=None)
    assert f"skipping 4 of {N_CELLS} cells" in capsys.readouterr().err
    assert sweep.record["cells_from_store"] == 4
    assert [r["cells"] for r in sweep.record["ranks"]] == [N_CELLS - 4]
    whole = run_sweep(range(N_CELLS), lambda c: sharding_demo.run_cell(args, c),
                      out=tmp_path / "whole.csv", arguments={"rows": 5}, sort_by=["j"],
                      progress=None)
    assert out.read_bytes() == (tmp_path / "whole.csv").read_bytes()
    pd.testing.assert_frame_equal(sweep.frame, whole.frame)


def test_failing_cell_is_one_line_with_its_key(tmp_path, capsys, monkeypatch):
    """A cell that raises: SweepStopped(1), one line naming the cell and the error, the
    traceback in the store; the cells before it are kept."""
    out = tmp_path / "x.csv"
    monkeypatch.setenv("SHARDING_DEMO_RAISE", "c2")
    assert sharding_demo.main(["--out", str(out)]) == 1
    lines = capsys.readouterr().err.splitlines()
    traceback = cell_store_path(out) / "rank0.traceback"
    assert lines[-1] == ("cell 'c2' failed: ValueError: demo failure in c2 (traceback in "
                         f"{traceback})")
    assert "ValueError: demo failure in c2" in traceback.read_text()
    assert not out.exists() and _valid_cells(out) == 2


# --------------------------------------------------------------------------------------------
# several ranks (torchrun, gloo)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,cost", [(2, False), (3, True)], ids=["2-ranks", "3-ranks-cost"])
def test_ranks_write_the_one_process_bytes(tmp_path, nproc, cost):
    """2 ranks round robin (4 + 3 cells) and 3 ranks longest first by cost = index (cells
    6, 5, 4 to ranks 0-2, then 3 -> r2, 2 -> r1, 1 -> r0, 0 -> r0 by the tie: 3 + 2 + 2):
    the merged CSV is the single-process bytes; meta.json has the world size, gloo and the
    cells each rank ran, summing to 7; the store is removed."""
    out = tmp_path / "ranks.csv"
    extra = ["--cost"] if cost else []
    done = _torchrun(nproc, out, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes() == _expected_bytes(tmp_path, *extra)
    sharding = _meta(out)["sharding"]
    assert (sharding["world_size"], sharding["backend"]) == (nproc, "gloo")
    assert sharding["assignment"] == ("longest-first" if cost else "round-robin")
    counts = [r["cells"] for r in sharding["ranks"]]
    costs = [float(c) for c in range(N_CELLS)] if cost else None
    assert counts == [len(s) for s in assign_cells(N_CELLS, nproc, costs)]
    assert counts == ([3, 2, 2] if cost else [4, 3])
    assert sum(counts) == N_CELLS and sharding["cells_from_store"] == 0
    assert not cell_store_path(out).exists()
    for r in range(nproc):
        assert f"rank {r}: {counts[r]}/{counts[r]} cells" in done.stderr
    assert f"{N_CELLS} cells on {nproc} ranks" in done.stderr


@pytest.mark.slow
def test_killed_rank_leaves_its_cells_and_the_rerun_skips_them(tmp_path):
    """Rank 1 (cells 1, 3, 5) dies at the start of cell 5: the command fails, no CSV, cells 1
    and 3 (and whatever rank 0 finished) are in the store; the rerun says it skipped exactly
    the cells stored, runs the rest, and writes the single-process bytes."""
    out = tmp_path / "ranks.csv"
    killed = _torchrun(2, out, SHARDING_DEMO_EXIT="c5")
    assert killed.returncode != 0
    assert not out.exists()
    stored = _valid_cells(out)
    assert 2 <= stored < N_CELLS
    rerun = _torchrun(2, out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming: skipping {stored} of {N_CELLS} cells" in rerun.stderr
    assert out.read_bytes() == _expected_bytes(tmp_path)
    sharding = _meta(out)["sharding"]
    assert sharding["cells_from_store"] == stored
    assert sum(r["cells"] for r in sharding["ranks"]) == N_CELLS - stored


@pytest.mark.slow
def test_failing_cell_stops_every_rank_with_one_line(tmp_path):
    """Cell 3 raises on rank 0 of 3: that rank prints one line with the key and the error, the
    others stop after their cell in flight, the command exits non-zero without hanging (the
    subprocess timeout), and the finished cells stay in the store."""
    out = tmp_path / "ranks.csv"
    done = _torchrun(3, out, SHARDING_DEMO_RAISE="c3")
    assert done.returncode != 0
    failure = [line for line in done.stderr.splitlines() if "failed: ValueError" in line]
    assert failure == [f"rank 0: cell 'c3' failed: ValueError: demo failure in c3 (traceback "
                       f"in {cell_store_path(out) / 'rank0.traceback'})"], done.stderr[-3000:]
    assert not out.exists()
    assert 1 <= _valid_cells(out) < N_CELLS, done.stderr[-3000:]


@pytest.mark.slow
def test_ranks_with_other_arguments_are_refused(tmp_path):
    """A per-rank value in the arguments (here the rank) would store each rank's cells under
    its own fingerprint: every rank refuses before running a cell, naming the argument."""
    out = tmp_path / "ranks.csv"
    done = _torchrun(2, out, SHARDING_DEMO_RANK_ARGUMENT="1")
    assert done.returncode != 0
    assert "ValueError: arguments: rank 1 has other arguments than rank 0" in done.stderr
    assert not out.exists() and not cell_store_path(out).exists()


@pytest.mark.gpu
def test_one_gpu_rank_under_nccl_writes_the_one_process_bytes(tmp_path):
    """torchrun --nproc-per-node 1 on a CUDA machine: backend nccl, rank 0 on cuda:0, the
    single-process bytes."""
    out = tmp_path / "gpu.csv"
    done = _torchrun(1, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes() == _expected_bytes(tmp_path)
    sharding = _meta(out)["sharding"]
    assert (sharding["world_size"], sharding["backend"]) == (1, "nccl")
    assert [r["cells"] for r in sharding["ranks"]] == [N_CELLS]
