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
# one-row CSV whose time encodes the variant, its .meta.json and (unless --plot-dir none) its
# three PNGs; bench_write, bench_read, pytest and error_growth record their arguments (one
# line each in $CALLS.other, the arguments apart by \x1f) and write the files they name;
# anything else runs the real interpreter.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "experiments.kernel_bench" ]; then
  out=""; label=""; plots=""; args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    [ "${args[$i]}" = "--out" ] && out=${args[$((i + 1))]}
    [ "${args[$i]}" = "--run-label" ] && label=${args[$((i + 1))]}
    [ "${args[$i]}" = "--plot-dir" ] && plots=${args[$((i + 1))]}
  done
  echo "$*" >> "$CALLS"
  knobs=$(echo "$*" | grep -o -- "--nonflush-knob [^ ]*" | wc -l)
  printf 'run,shape,window,batch,cursor,time_us,status\\n' > "$out"
  printf '%s,m2,32,256,8,%s.5,ok\\n%s,m2,32,1,8,4.25,skipped\\n' "$label" "$knobs" "$label" \\
    >> "$out"
  echo "{}" > "${out%.csv}.meta.json"
  if [ -n "$plots" ] && [ "$plots" != none ]; then
    for kind in time speedup formats; do touch "$plots/$(basename "${out%.csv}")_$kind.png"; done
  fi
  exit "${FAKE_KB_EXIT:-0}"
fi
others="^(cute_kernels.bench_(write|read)|pytest|experiments.error_growth)$"
if [ "$1" = "-m" ] && [[ "$2" =~ $others ]]; then
  (IFS=$'\\x1f'; echo "$*") >> "$CALLS.other"
  args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [ "${args[$i]}" = "--out" ]; then
      touch "${args[$((i + 1))]}"
      [ "$2" = experiments.error_growth ] && touch "${args[$((i + 1))]%.csv}.meta.json"
    fi
    [ "${args[$i]}" = "--plot" ] && touch "${args[$((i + 1))]}"
  done
  [ "$2" = pytest ] && { printf '%b' "${FAKE_PYTEST_OUT:-}"; sleep "${FAKE_PYTEST_S:-0}"; }
  exit 0
fi
if [ "$1" = "-c" ] && [ -n "$FAKE_NO_CUTLASS" ] && [[ "$2" == *cutlass* ]]; then
  exit 1
fi
exec "$REAL_PYTHON" "$@"
"""


def _session(tmp_path: Path, part: str, *more: str, **env) -> subprocess.CompletedProcess:
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
    return subprocess.run(["bash", str(tree / "scripts" / "gpu_session.sh"), part, *more],
                          env=full_env, capture_output=True, text=True, timeout=120)


def _other_calls(tmp_path: Path, module: str) -> list[list[str]]:
    """The stand-in's calls of `python -m module`, each as its argument list after the
    module's name."""
    path = tmp_path / "calls.txt.other"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.split("\x1f")[2:] for line in lines if line.split("\x1f")[1] == module]


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
                           for r in (1, 2, 3) for ext in ("csv", "meta.json", "log"))
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
    """A part other than A, B, C, D, E, G, K, P or T stops at once with the usage line."""
    done = _session(tmp_path, "Z")
    assert done.returncode == 2
    assert "usage: bash scripts/gpu_session.sh A|B|C|D|E|G|K|P|T" in done.stderr
    assert not (tmp_path / "calls.txt").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failed_step_is_the_calls_exit_status_and_the_rest_still_runs(tmp_path):
    """A benchmark run that fails makes the whole call exit with its status (it used to
    report `call K done` and exit 0), after every later variant has still run; a call that
    passed says so (its last line used to call exit 0 "the first step that failed")."""
    done = _session(tmp_path, "K", KB_AB="a: b:warps=2", KB_AB_REPS="2", FAKE_KB_EXIT="3")
    assert done.returncode == 3, done.stdout + done.stderr
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 4
    assert "exit 3 (the first step that failed)" in done.stdout
    (tmp_path / "ok").mkdir()
    ok = _session(tmp_path / "ok", "K", KB_AB="a:", KB_AB_REPS="1")
    assert ok.returncode == 0 and "exit 0 (every step passed)" in ok.stdout
    assert "failed" not in ok.stdout.splitlines()[-1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_help_prints_what_each_part_does(tmp_path):
    """--help prints the header's description of every part (exit 0), not the bare usage."""
    done = _session(tmp_path, "--help")
    assert done.returncode == 0
    for part in "ABCDEGKPT":
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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_second_part_is_refused_not_ignored(tmp_path):
    """`gpu_session.sh A B` ran A alone and said nothing of B."""
    done = _session(tmp_path, "A", "B")
    assert done.returncode == 2
    assert "usage: bash scripts/gpu_session.sh" in done.stderr and "got: A B" in done.stderr
    assert not (tmp_path / "calls.txt").exists() and not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("knob, value", [("KB_TOTAL_S", "9m"), ("KB_TESTS_S", "150s"),
                                         ("KB_E_S", "-5"), ("KB_AB_REPS", "two"),
                                         ("KB_TOTAL_S", "090")])
def test_a_numeric_knob_that_is_not_a_number_is_refused_before_anything_runs(tmp_path, knob,
                                                                             value):
    """`KB_TOTAL_S=9m` was a shell arithmetic error in the middle of a call."""
    done = _session(tmp_path, "K", **{knob: value})
    assert done.returncode == 2
    assert done.stderr.strip() == (f"gpu_session.sh: {knob}: expected a whole number of "
                                   f"seconds (or reps), got '{value}'")
    assert not (tmp_path / "calls.txt").exists() and not (tmp_path / "out").exists()


def _help_files(help_text: str, part: str) -> set[str]:
    """The files --help says `part` writes: its paragraph's list after the last ': ', the
    braces expanded, "E's files" read as E's list."""
    block = help_text.split(f"bash scripts/gpu_session.sh {part} ")[1]
    block = " ".join(block.split("bash scripts/gpu_session.sh ")[0].split())
    listing = block.rsplit(": ", 1)[1].replace(" and ", ", ")
    names = set()
    for item in re.split(r",\s*(?![^{]*\})", listing):
        if item == "E's files":
            names |= {n for n in _help_files(help_text, "E") if not n.endswith(".log")}
            continue
        head, _, rest = item.partition("{")
        choices, _, tail = rest.partition("}")
        names |= {head + c.strip() + tail for c in choices.split(",")} if rest else {item}
    return names


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("part", ["A", "B", "C", "D", "E", "G", "T"])
def test_each_part_writes_the_files_its_help_names(tmp_path, part):
    """What --help lists for a part is what lands in $OUT (D listed 'the files of E and of A',
    but A's plots are not drawn in D and its log is kernel_bench_D.log; E left its log out)."""
    text = _session(tmp_path / "help", "--help").stdout
    done = _session(tmp_path, part, FAKE_NO_CUTLASS="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in (tmp_path / "out").iterdir()} == _help_files(text, part)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_small_batch_and_short_calls_time_the_bench_write_cases_their_help_names(tmp_path):
    """C's 'two flush layouts at batch 1 and 8' and T's 'two-precision and FP32 flushes and
    windows' are exactly those cases of bench_write's --only: the bare names ('flush fp16-SR
    + nvfp4', 'flush fp16-SR', 'flush fp32') are in every later variant's name, so C's small
    runs had grown to 11 cases in 30 s and T's to 18."""
    sys.path.insert(0, str(ROOT))
    from cute_kernels import bench_write as bw

    names = [case[0] for case in bw.bench_cases(bw.BenchConfig())]

    def picked(argv):
        only = argv[argv.index("--only") + 1:]
        only = only[:next(i for i, a in enumerate(only) if a.startswith("--"))]
        return [n for n in names if bw.matches(n, only)]

    layouts = ["flush fp16-SR + nvfp4",
               "flush fp16-SR + nvfp4, 64 elements per thread (128 threads)"]
    assert _session(tmp_path, "C").returncode == 0
    small = [a for a in _other_calls(tmp_path, "cute_kernels.bench_write") if "--only" in a]
    assert [a[a.index("--batch") + 1] for a in small] == ["1", "8"]
    assert all(picked(argv) == layouts for argv in small)
    (tmp_path / "t").mkdir()
    assert _session(tmp_path / "t", "T").returncode == 0
    (argv,) = _other_calls(tmp_path / "t", "cute_kernels.bench_write")
    assert picked(argv) == ["flush fp16-SR + nvfp4", "flush fp32 single copy",
                            "window/token fp16-SR + nvfp4", "window/token fp32 single copy"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("value, tested", [("1", False), ("yes", False), ("0", True),
                                           ("", True), (None, True)])
def test_kb_skip_tests_leaves_a_tests_out_unless_unset_empty_or_0(tmp_path, monkeypatch,
                                                                  value, tested):
    """KB_SKIP_TESTS=0 skipped the tests too (any value that was not empty did)."""
    monkeypatch.delenv("KB_SKIP_TESTS", raising=False)
    env = {} if value is None else {"KB_SKIP_TESTS": value}
    done = _session(tmp_path, "A", **env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert bool(_other_calls(tmp_path, "pytest")) == tested
    assert ("gpu tests: skipped" in done.stdout) != tested


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_kb_tests_s_bounds_the_knob_calls_test_subset(tmp_path):
    """K's `KB_TEST_K` subset ran under a fixed 200 s whatever KB_TESTS_S said."""
    done = _session(tmp_path, "K", KB_TEST_K="flush and not slow", KB_TESTS_S="2",
                    FAKE_PYTEST_S="30", KB_AB_REPS="0")
    assert done.returncode == 124, done.stdout + done.stderr
    assert "gpu tests (-k flush and not slow): exit 124" in done.stdout
    ((*_, k, selection, folder),) = _other_calls(tmp_path, "pytest")
    assert (k, selection, folder) == ("-k", "flush and not slow", "tests")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("ncu") is not None,
                    reason="needs bash and a machine without ncu")
def test_part_p_without_ncu_says_so_and_launches_nothing(tmp_path):
    """Each of P's three ncu runs exited 127 into its ncu_<kernel>.txt ('failed to run
    command'), and the call's only word was 'exit 127'."""
    done = _session(tmp_path, "P")
    assert done.returncode == 2
    assert "gpu_session.sh P: no ncu here" in done.stderr
    assert not list((tmp_path / "out").glob("ncu_*")) and not (tmp_path / "calls.txt").exists()



@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("progress, status, said", [
    ("........................ [ 22%]\\n.......s..", 0,
     "stopped by the time box after 34 tests, none failed"),
    ("....F................... [ 22%]\\n....", 124, "gpu tests: exit 124"),
    ("", 0, "stopped by the time box after 0 tests, none failed"),
])
def test_time_boxed_tests_stopped_with_no_failure_do_not_fail_the_call(tmp_path, progress,
                                                                       status, said):
    """The whole GPU suite (419 s in the twenty-third session) outlasts the tests' time box in
    A, C and T, so every such call exited 124 as if a step had failed: stopped with no F or E
    in its progress lines it now keeps status 0 and says how far it got; a failure seen
    before the stop is still the call's status. Part G runs the whole suite, 10 workers."""
    done = _session(tmp_path, "T", KB_TESTS_S="1", FAKE_PYTEST_S="20",
                    FAKE_PYTEST_OUT=progress)
    assert done.returncode == status, done.stdout + done.stderr
    assert said in done.stdout
    (tmp_path / "g").mkdir()
    whole = _session(tmp_path / "g", "G", KB_TOTAL_S="60")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert _other_calls(tmp_path / "g", "pytest")[0][:5] == ["-m", "gpu", "-q", "-n", "10"]
