"""scripts/gpu_session.sh, the GPU calls' driver, run on the CPU with a stand-in for the
benchmark: a call's arguments must reach kernel_bench as written, since a device call that
times the wrong variant costs minutes of a 30-minute budget."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Stands in for `python`: `-m experiments.kernel_bench` records its arguments and writes a
# one-row CSV whose time encodes the variant; anything else runs the real interpreter.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "experiments.kernel_bench" ]; then
  out=""; label=""; args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[$i]}" = "--out" ] && out=${args[$((i + 1))]}
    [ "${args[$i]}" = "--run-label" ] && label=${args[$((i + 1))]}
  done
  echo "$*" >> "$CALLS"
  knobs=$(echo "$*" | grep -o -- "--nonflush-knob [^ ]*" | wc -l)
  printf 'run,shape,window,batch,cursor,time_us,status\\n' > "$out"
  printf '%s,m2,32,256,8,%s.5,ok\\n%s,m2,32,1,8,4.25,skipped\\n' "$label" "$knobs" "$label" \\
    >> "$out"
  exit "${FAKE_KB_EXIT:-0}"
fi
if [ "$1" = "-c" ] && [ -n "$FAKE_NO_CUTLASS" ] && [[ "$2" == *cutlass* ]]; then
  exit 1
fi
exec "$REAL_PYTHON" "$@"
"""


def _session(tmp_path: Path, part: str, **env) -> subprocess.CompletedProcess:
    """Runs a copy of the script in a bare tree (no .device, no .peers) with the stand-in."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_session.sh", tree / "scripts" / "gpu_session.sh")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    full_env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable,
                "OUT": str(out), "CALLS": str(tmp_path / "calls.txt"), **env}
    return subprocess.run(["bash", str(tree / "scripts" / "gpu_session.sh"), part],
                          env=full_env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                    reason="needs bash and tar")
def test_knob_comparison_runs_each_variant_in_turn_with_its_knobs(tmp_path):
    """Part K runs every variant of KB_AB once per repetition, in turn, with one
    --nonflush-knob per key=value of the variant (none for an empty list), labels each run
    name_rep, passes the batches, shapes and windows asked for, tabulates the runs' ok rows
    in its log, and packs the CSVs into ab.tar."""
    done = _session(tmp_path, "K", KB_AB="base: st:ring_stage=smem two:warps=2,prefetch=True",
                    KB_AB_REPS="3", KB_AB_BATCHES="7,256", KB_AB_SHAPES="m2,n3",
                    KB_AB_WINDOWS="32,8")
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    labels = [c.split("--run-label ")[1].split()[0] for c in calls]
    assert labels == [f"{name}_{rep}" for rep in (1, 2, 3) for name in ("base", "st", "two")]
    for call in calls:
        assert "--batches 7,256" in call and "--kernels cute:nonflush:nvfp4" in call
        assert "--shapes m2,n3" in call and "--windows 32,8" in call
        knobs = [part.split()[0] for part in call.split("--nonflush-knob ")[1:]]
        name = call.split("--run-label ")[1].split("_")[0]
        assert knobs == {"base": [], "st": ["ring_stage=smem"],
                         "two": ["warps=2", "prefetch=True"]}[name]
    out = tmp_path / "out"
    with tarfile.open(out / "ab.tar") as tar:
        names = sorted(tar.getnames())
    assert names == sorted(f"ab_{n}_{r}.{ext}" for n in ("base", "st", "two")
                           for r in (1, 2, 3) for ext in ("csv", "log"))
    assert not list(out.glob("ab_*.csv"))  # packed, not left beside the tar
    log = (out / "kernel_bench_K.log").read_text().splitlines()
    header = next(i for i, line in enumerate(log) if line.startswith("shape"))
    assert log[header].split()[:4] == ["shape/format", "window", "batch", "cursor"]
    assert log[header].split()[4:] == sorted(labels)
    rows = [line.split() for line in log[header + 1:] if re.match(r"m2/\S+\s+\d+\s", line)]
    assert [row[:4] for row in rows] == [["m2/nvfp4", "32", "256", "8"]]  # the ok row only
    times = dict(zip(log[header].split()[4:], map(float, rows[0][4:]), strict=True))
    assert times == {label: {"base": 0.5, "st": 1.5, "two": 2.5}[label.split("_")[0]]
                     for label in labels}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_knob_comparison_passes_the_kernels_asked_for(tmp_path):
    """KB_AB_KERNELS reaches kernel_bench's --kernels as written (default: the nvfp4 step)."""
    done = _session(tmp_path, "K", KB_AB="base: eager:eager_loads=True", KB_AB_REPS="1",
                    KB_AB_KERNELS="cute:nonflush:fp32,cute:nonflush:fp8_e4m3")
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2
    assert all("--kernels cute:nonflush:fp32,cute:nonflush:fp8_e4m3" in c for c in calls)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_unknown_part_is_refused_with_its_usage(tmp_path):
    """A part other than A, B, C, D, E, K, P or T stops at once with the usage line."""
    done = _session(tmp_path, "Z")
    assert done.returncode == 2
    assert "usage: bash scripts/gpu_session.sh A|B|C|D|E|K|P|T" in done.stderr
    assert not (tmp_path / "calls.txt").exists()



@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failed_step_is_the_calls_exit_status_and_the_rest_still_runs(tmp_path):
    """A benchmark run that fails makes the whole call exit with its status (it used to
    report `call K done` and exit 0), after every later variant has still run."""
    done = _session(tmp_path, "K", KB_AB="a: b:warps=2", KB_AB_REPS="2", FAKE_KB_EXIT="3")
    assert done.returncode == 3, done.stdout + done.stderr
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 4
    assert "exit 3 (the first step that failed)" in done.stdout
    (tmp_path / "ok").mkdir()
    ok = _session(tmp_path / "ok", "K", KB_AB="a:", KB_AB_REPS="1")
    assert ok.returncode == 0 and "exit 0" in ok.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_help_prints_what_each_part_does(tmp_path):
    """--help prints the header's description of every part (exit 0), not the bare usage."""
    done = _session(tmp_path, "--help")
    assert done.returncode == 0
    for part in "ABCDEKPT":
        assert f"bash scripts/gpu_session.sh {part}" in done.stdout
    assert not done.stdout.lstrip().startswith("#")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_part_b_without_cute_dsl_times_the_peers_alone(tmp_path):
    """Without .device (no cutlass to import) call B still runs the peers, as its header says:
    kernel_bench gets --kernels none, which it reads as no kernels of the kit's (an empty
    --kernels used to stop the call with an argument error)."""
    done = _session(tmp_path, "B", FAKE_NO_CUTLASS="1")
    assert done.returncode == 0, done.stderr
    (call,) = (tmp_path / "calls.txt").read_text().splitlines()
    assert "--kernels none --peers flashinfer,vllm --run-label B" in call
    args = call.split()[2:]  # without "-m experiments.kernel_bench"
    sys.path.insert(0, str(ROOT))
    from experiments import kernel_bench as kb

    config = kb.config_from_args(kb.build_parser().parse_args(args), args)
    assert config.kernels == () and config.all_kernels() == tuple(
        name for name, spec in kb.KERNELS.items()
        if spec.default and spec.impl in ("flashinfer", "vllm"))
