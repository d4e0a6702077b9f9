"""scripts/gpu.sh, scripts/setup.sh, scripts/test.sh and scripts/model_drift_gpu.sh on the CPU:
their argument checks, the commands they print with --dry-run or run (which must parse with the
parsers of the tools they call), and their exit status, with stand-ins for python, pip and
ncu."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _tree(tmp_path: Path, *scripts: str) -> Path:
    """A bare copy of the named scripts (and requirements.txt, pyproject.toml) in tmp_path/tree."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in scripts:
        shutil.copy(ROOT / "scripts" / name, tree / "scripts" / name)
    for name in ("requirements.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, tree / name)
    return tree


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _gpu(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(tree / "scripts" / "gpu.sh"), *args], cwd=tree,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def _commands(stdout: str) -> list[list[str]]:
    """The dry run's commands, each as its arguments (a redirection '> FILE' kept at the end)."""
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def _module_args(command: list[str], module: str) -> list[str]:
    """The arguments after `-m module` in a command, without a trailing '> FILE'."""
    at = command.index(module)
    assert command[at - 1] == "-m"
    rest = command[at + 1:]
    return rest[:rest.index(">")] if ">" in rest else rest


def test_help_names_every_target_and_exits_0(tmp_path):
    done = _gpu(_tree(tmp_path, "gpu.sh"), "--help")
    assert done.returncode == 0, done.stderr
    for target in ("test", "bench", "profile", "error-growth", "--dry-run"):
        assert f"  {target}" in done.stdout
    assert "set -uo" not in done.stdout and not done.stdout.lstrip().startswith("#")


@pytest.mark.parametrize("args", [(), ("benchmark",), ("--dry-run",), ("--dry-run", "tests")])
def test_a_missing_or_unknown_target_is_a_usage_error_that_writes_nothing(tmp_path, args):
    tree = _tree(tmp_path, "gpu.sh")
    done = _gpu(tree, *args)
    assert done.returncode == 2
    assert "usage: bash scripts/gpu.sh [--dry-run] test|bench|profile|error-growth" in done.stderr
    assert not (tree / "runs").exists()


@pytest.mark.parametrize("env", [{"LIMIT_S": "9m"}, {"LIMIT_S": "090"}, {"TEST_WORKERS": "x"}])
def test_a_malformed_number_in_the_environment_is_named(tmp_path, env):
    done = _gpu(_tree(tmp_path, "gpu.sh"), "--dry-run", "test", **env)
    assert done.returncode == 2
    name, value = next(iter(env.items()))
    assert done.stderr.startswith(f"gpu.sh: {name}: expected a whole number")
    assert value in done.stderr


def test_dry_run_bench_prints_a_kernel_bench_command_that_parses_and_writes_nothing(tmp_path):
    """The benchmark's command goes to kernel_bench with the peers that .peers/ holds, its CSV
    and plots under OUT, and the extra arguments last, where they win."""
    from experiments import kernel_bench as kb

    tree = _tree(tmp_path, "gpu.sh")
    (tree / ".peers" / "vllm").mkdir(parents=True)
    (tree / ".peers" / "fla").mkdir(parents=True)
    out = tmp_path / "bench out"
    done = _gpu(tree, "--dry-run", "bench", "--batches", "256", "--windows", "16",
                OUT=str(out))
    assert done.returncode == 0, done.stderr
    [command] = _commands(done.stdout)
    args = _module_args(command, "experiments.kernel_bench")
    assert args[:6] == ["--peers", "vllm,fla", "--out", f"{out}/kernel_bench.csv", "--plot-dir",
                        str(out)]
    assert args[6:] == ["--batches", "256", "--windows", "16"]
    parsed = kb.build_parser().parse_args(args)
    assert parsed.out == f"{out}/kernel_bench.csv"
    assert not out.exists() and not (tree / "runs").exists()


def test_bench_without_peers_asks_for_none_and_writes_under_runs_by_default(tmp_path):
    done = _gpu(_tree(tmp_path, "gpu.sh"), "--dry-run", "bench")
    [command] = _commands(done.stdout)
    args = _module_args(command, "experiments.kernel_bench")
    assert args == ["--peers", "none", "--out", "runs/gpu-bench/kernel_bench.csv", "--plot-dir",
                    "runs/gpu-bench"]


@pytest.mark.parametrize("shape", [None, "qwen3-next-80b"])
def test_dry_run_profile_reads_back_what_ncu_wrote_for_each_kernel(tmp_path, shape):
    """Per kernel: two ncu runs of kernel_bench --profile at batch 256, L = 16 of the layer
    (the commands parse with kernel_bench's parser and name its kernels), the source exports,
    and the two readers given the very files the exports and the trim wrote, the pipe reader
    told the layer."""
    from experiments import kernel_bench as kb

    out = tmp_path / "prof"
    layer = shape or "nemotron3-super"
    done = _gpu(_tree(tmp_path, "gpu.sh"), "--dry-run", "profile",
                *(["--shape", shape] if shape else []), OUT=str(out))
    assert done.returncode == 0, done.stderr
    commands = _commands(done.stdout)
    profiled = []
    for command in commands:
        if "experiments.kernel_bench" in command:
            args = _module_args(command, "experiments.kernel_bench")
            parsed = kb.build_parser().parse_args(args)
            assert parsed.profile in kb.KERNELS, parsed.profile
            assert args[2:] == ["--shapes", layer, "--batches", "256", "--windows", "16"]
            profiled.append(parsed.profile)
    assert profiled == ["cute:nonflush:nvfp4"] * 2 + ["cute:flush:fp16sr+nvfp4"] * 2
    written = {c[-1] for c in commands if c[-2:-1] == [">"]}
    for name in (f"{layer}-cute_nonflush_nvfp4", f"{layer}-cute_flush_fp16sr_nvfp4"):
        [stalls] = [c for c in commands if "tools.stall_sites" in c and name in " ".join(c)]
        report, lines = _module_args(stalls, "tools.stall_sites")[0::2]
        assert {report, lines} <= written
        [pipes] = [c for c in commands if "tools.instruction_count" in c and name in " ".join(c)]
        assert _module_args(pipes, "tools.instruction_count") == [
            "--ncu", f"{out}/ncu_pipes_{name}.trim.txt", "--layer", layer]
        assert f"{out}/ncu_pipes_{name}.txt" in written


def test_profile_refuses_a_shape_it_cannot_read_with_one_line(tmp_path):
    done = _gpu(_tree(tmp_path, "gpu.sh"), "--dry-run", "profile", "--shape", "mamba2-2.7b")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("gpu.sh profile: --shape takes nemotron3-super or "
                                   "qwen3-next-80b, got 'mamba2-2.7b'")


def test_profile_readers_are_modules_of_the_tools_package():
    for module in ("tools.stall_sites", "tools.instruction_count"):
        assert importlib.util.find_spec(module) is not None, module


def test_profile_without_ncu_stops_at_once_with_one_line(tmp_path):
    tree = _tree(tmp_path, "gpu.sh")
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if not (Path(d) / "ncu").exists())
    done = _gpu(tree, "profile", "cute:flush:fp32", PATH=path, OUT=str(tmp_path / "o"),
                PYTHON=sys.executable)
    assert done.returncode == 2
    assert done.stderr.strip() == ("gpu.sh profile: no ncu here (Nsight Compute; run it on the "
                                   "GPU machine)")


def test_dry_run_error_growth_prints_the_three_layers_and_each_parses(tmp_path):
    """error-growth runs the Mamba-2, GDN and KDA layers (presets emulation-gpu, gdn-gpu,
    kda-gpu), each a torchrun of one rank per arm: three commands that error_growth's parser
    reads, each writing its own CSV and PNG under OUT; other arguments are presets, and an
    unknown one or an option is refused."""
    from experiments import error_growth as eg

    done = _gpu(_tree(tmp_path, "gpu.sh"), "--dry-run", "error-growth")
    assert done.returncode == 0, done.stderr
    commands = _commands(done.stdout)
    assert len(commands) == 3
    parsed = [eg.build_parser().parse_args(_module_args(c, "experiments.error_growth"))
              for c in commands]
    assert [p.preset for p in parsed] == ["emulation-gpu", "gdn-gpu", "kda-gpu"]
    for p, layer in zip(parsed, ("emulation", "gdn", "kda"), strict=True):
        assert p.out == f"runs/gpu-error-growth/error_growth_{layer}_gpu.csv"
        assert p.plot == f"runs/gpu-error-growth/error_growth_{layer}_gpu.png"
        assert eg.PRESETS[p.preset]["backend"] == "emulation"
    assert [eg.PRESETS[p.preset]["recurrence"] for p in parsed] == ["mamba2", "gdn", "kda"]
    ranks = [c[c.index("--nproc-per-node") + 1] for c in commands]
    arms = [len(eg.PRESETS[p.preset]["arms"].split(",")) for p in parsed]
    assert [int(r) for r in ranks] == arms == [2, 3, 3]
    assert all(c[1:3] == ["-m", "torch.distributed.run"] for c in commands)
    one = _commands(_gpu(_tree(tmp_path / "c", "gpu.sh"), "--dry-run", "error-growth",
                         "kda-gpu").stdout)
    assert [_module_args(c, "experiments.error_growth")[1] for c in one] == ["kda-gpu"]
    assert _gpu(_tree(tmp_path / "b", "gpu.sh"), "error-growth", "--steps", "9").returncode == 2


def test_dry_run_error_growth_passes_the_arguments_after_a_double_dash_to_every_preset(tmp_path):
    """`error-growth gdn-gpu kda-gpu -- --sr-bits 32 --philox-rounds 10`: two commands, each
    parsed to its own preset with the reference SR setting; without `--` the default holds."""
    from experiments import error_growth as eg

    done = _gpu(_tree(tmp_path, "gpu.sh"), "--dry-run", "error-growth", "gdn-gpu", "kda-gpu",
                "--", "--sr-bits", "32", "--philox-rounds", "10")
    assert done.returncode == 0, done.stderr
    parsed = [eg.build_parser().parse_args(_module_args(c, "experiments.error_growth"))
              for c in _commands(done.stdout)]
    assert [(p.preset, p.sr_bits, p.philox_rounds) for p in parsed] == [
        ("gdn-gpu", "32", "10"), ("kda-gpu", "32", "10")]
    plain = _commands(_gpu(_tree(tmp_path / "p", "gpu.sh"), "--dry-run", "error-growth",
                           "gdn-gpu").stdout)
    [alone] = [eg.build_parser().parse_args(_module_args(c, "experiments.error_growth"))
               for c in plain]
    assert alone.sr_bits is None and alone.philox_rounds is None


@pytest.mark.parametrize("exit_status", [0, 3])
def test_test_target_runs_pytest_gpu_and_exits_with_its_status(tmp_path, exit_status):
    """A stand-in python records its arguments and exits with `exit_status`; the target passes
    -m gpu and the extra arguments, logs under OUT, and exits with pytest's status."""
    tree = _tree(tmp_path, "gpu.sh")
    calls = tmp_path / "calls.txt"
    fake = _executable(tmp_path / "bin" / "python", f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = pytest ]; then
  echo "$*" >> {calls}; echo "7 passed"; exit {exit_status}
fi
if [ "$1" = -c ]; then exit 1; fi
exit 0
""")
    out = tmp_path / "out"
    done = _gpu(tree, "test", "-k", "flush", PYTHON=str(fake), OUT=str(out), TEST_WORKERS="3")
    assert done.returncode == exit_status, done.stdout + done.stderr
    assert calls.read_text().split() == ["-m", "pytest", "-m", "gpu", "-q", "-p",
                                         "no:cacheprovider", "-n", "3", "-k", "flush"]
    log = (out / "test.log").read_text()
    assert "7 passed" in log and f"gpu.sh test: exit {exit_status}" in log
    assert (out / "environment.txt").exists()


# A stand-in for .venv/bin/python: `-c` checks pass; `-m pip install` records its arguments
# (one line a call) and, for the step whose last argument is $FAIL_AT, prints $FAIL_TEXT and
# exits 1 (or sleeps $SLEEP_S).
FAKE_VENV_PYTHON = """#!/bin/bash
if [ "$1" = -c ]; then exit 0; fi
if [ "$1" = -m ] && [ "$2" = pip ]; then
  echo "${@: -1}|$*" >> "$CALLS"
  if [ "${@: -1}" = "$FAIL_AT" ]; then
    [ -n "${SLEEP_S:-}" ] && sleep "$SLEEP_S"
    printf '%b\\n' "$FAIL_TEXT"; exit 1
  fi
  echo "Successfully installed"; exit 0
fi
exit 0
"""


def _setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    tree = tmp_path / "tree"
    if not tree.exists():
        tree = _tree(tmp_path, "setup.sh")
        _executable(tree / ".venv" / "bin" / "python", FAKE_VENV_PYTHON)
    full_env = {**os.environ, "CALLS": str(tmp_path / "pip_calls.txt"), "FAIL_AT": "",
                "FAIL_TEXT": "", **env}
    return subprocess.run(["bash", str(tree / "scripts" / "setup.sh")], cwd=tree, env=full_env,
                          capture_output=True, text=True, timeout=60)


def _pip_calls(tmp_path: Path) -> list[tuple[str, str]]:
    path = tmp_path / "pip_calls.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(line.split("|", 1)) for line in lines]


def test_setup_installs_the_extras_step_by_step_bounded_and_is_idempotent(tmp_path):
    """Each step is one pip install with the tested pins as constraints, pip's timeout and
    retries given explicitly, and a line saying what it installs; a second run with the same
    requirements calls pip no more."""
    done = _setup(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = _pip_calls(tmp_path)
    assert [target for target, _ in calls] == [".", ".[emulation]", ".[cute]", ".[dev]"]
    for _, command in calls:
        args = command.split()
        assert args[args.index("--timeout") + 1] == "30"
        assert args[args.index("--retries") + 1] == "2"
        assert args[args.index("-c") + 1] == "requirements.txt"
    steps = [line for line in done.stdout.splitlines() if line.startswith("setup: ")]
    assert len(steps) == 5 and "triton" in steps[1] and "nvidia-cutlass-dsl" in steps[2]
    again = _setup(tmp_path)
    assert again.returncode == 0
    assert "up to date" in again.stdout and len(_pip_calls(tmp_path)) == 4


@pytest.mark.parametrize("text, package, why", [
    ("ERROR: No matching distribution found for triton==3.6.0", "triton==3.6.0", "pip exited 1"),
    ("WARNING: Retrying (Retry(total=0)) after connection broken by 'ReadTimeoutError(...)': "
     "/simple/triton/\\nERROR: Could not find a version that satisfies the requirement "
     "triton==3.6.0", "triton==3.6.0", "the registry did not answer within 30 s"),
])
def test_setup_names_the_package_it_could_not_get_in_one_line(tmp_path, text, package, why):
    done = _setup(tmp_path, FAIL_AT=".[emulation]", FAIL_TEXT=text)
    assert done.returncode == 1
    [line] = [line for line in done.stderr.splitlines() if line.startswith("setup: ")]
    assert line.startswith(f"setup: could not get {package} (the Triton emulation: triton): ")
    assert why in line
    assert not (tmp_path / "tree" / ".venv" / ".setup-stamp").exists()
    assert [target for target, _ in _pip_calls(tmp_path)] == [".", ".[emulation]"]


def test_setup_stops_a_step_that_never_finishes(tmp_path):
    done = _setup(tmp_path, FAIL_AT=".", SLEEP_S="30", SETUP_STEP_S="1",
                  FAIL_TEXT="  Collecting numpy")
    assert done.returncode == 1
    assert "no answer within 1 s (SETUP_STEP_S)" in done.stderr


def test_setup_refuses_a_malformed_time_limit(tmp_path):
    done = _setup(tmp_path, SETUP_STEP_S="15m")
    assert done.returncode == 2 and "15m" in done.stderr
    assert not _pip_calls(tmp_path)


def test_ci_runs_the_readmes_test_command():
    run = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in run
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/setup.sh" in readme


def test_test_sh_runs_setup_ruff_and_pytest_in_that_order(tmp_path):
    """With a stand-in venv (setup finds it up to date) it runs ruff, then pytest with the
    extra arguments, and exits with pytest's status."""
    tree = _tree(tmp_path, "setup.sh", "test.sh")
    log = tmp_path / "order.txt"
    _executable(tree / ".venv" / "bin" / "python", f"""#!/bin/bash
if [ "$1" = -c ]; then exit 0; fi
if [ "$1" = -m ] && [ "$2" = pytest ]; then echo "pytest ${{*:3}}" >> {log}; exit 4; fi
echo "pip" >> {log}; exit 0
""")
    _executable(tree / ".venv" / "bin" / "ruff", f"#!/bin/bash\necho ruff $* >> {log}\n")
    want = subprocess.run("cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1",
                          shell=True, cwd=tree, capture_output=True, text=True).stdout.strip()
    (tree / ".venv" / ".setup-stamp").write_text(want + "\n")
    done = subprocess.run(["bash", "scripts/test.sh", "-m", "not slow"], cwd=tree,
                          env={**os.environ, "LOWPREC_NO_PEERS": "1"}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 4, done.stdout + done.stderr
    assert log.read_text().splitlines() == ["ruff check .", "pytest -q -m not slow"]


# --------------------------------------------------------------------------------------------
# scripts/model_drift_gpu.sh, with a stand-in python that records its commands

FAKE_PYTHON = """#!/bin/bash
if [ "$1" = -c ]; then echo "python 3 torch 2"; exit 0; fi
echo "$*" >> {log}
out=""; prev=""
for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
case "$2" in
  experiments.train_lm) mkdir -p "$out/model" && echo '{{}}' > "$out/model/config.json" ;;
  experiments.model_drift) [ -n "$out" ] && echo csv > "$out" ;;
esac
exit 0
"""


def _drift_job(tmp_path, *args, **env):
    tree = _tree(tmp_path, "model_drift_gpu.sh")
    (tree / "runs" / "kjv").mkdir(parents=True)
    (tree / "runs" / "kjv" / "kjv.txt").write_text("text")
    log = tmp_path / "commands.txt"
    python = _executable(tmp_path / "bin" / "python", FAKE_PYTHON.format(log=log))
    out = tmp_path / "out"
    done = subprocess.run(["bash", "scripts/model_drift_gpu.sh", *args], cwd=tree,
                          env={**os.environ, "PYTHON": str(python), "OUT": str(out),
                               "LOWPREC_COMMIT": "abc", **env},
                          capture_output=True, text=True, timeout=60)
    commands = log.read_text().splitlines() if log.is_file() else []
    return done, [shlex.split(c) for c in commands], out


def test_model_drift_job_help_names_the_parts_and_the_gdn_time():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "model_drift_gpu.sh"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "PART is mamba2 (the default), gdn, or all" in done.stdout
    assert "about 8.5 min on one H100" in done.stdout


@pytest.mark.parametrize("args, env, message", [
    (["kda"], {}, "PART: expected mamba2, gdn or all, got 'kda'"),
    (["gdn", "mamba2"], {}, "expected one PART"),
    (["gdn"], {"MD_GDN_DRIFT_S": "1m"}, "MD_GDN_DRIFT_S: expected a whole number"),
    (["gdn"], {"MD_GDN_MODEL": "/nonexistent"}, "MD_GDN_MODEL: expected a checkpoint folder"),
], ids=["part", "two-parts", "knob", "model"])
def test_model_drift_job_refuses_bad_input_in_one_line(tmp_path, args, env, message):
    done, commands, _ = _drift_job(tmp_path, *args, **env)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not commands


def test_model_drift_job_gdn_part_trains_then_drifts_and_packs_two_files(tmp_path):
    """The gdn part: train_lm --arch gdn for 150 s (its arguments parse), then model_drift
    --preset gdn-gpu on that checkpoint with 60 s a decode, no Pareto figure; $OUT holds
    the tarball and the log only."""
    from experiments import train_lm

    done, commands, out = _drift_job(tmp_path, "gdn")
    assert done.returncode == 0, done.stderr
    train, drift = commands
    assert train[:2] == ["-m", "experiments.train_lm"]
    _, c = train_lm.parse_args(train[2:])
    assert (c.arch, c.time_limit_s, c.data) == ("gdn", 150.0, "runs/kjv")
    assert c.out == "runs/model_drift_gpu_work/gdn/train"
    assert drift[:4] == ["-m", "experiments.model_drift", "--preset", "gdn-gpu"]
    assert drift[drift.index("--model") + 1] == "runs/model_drift_gpu_work/gdn/train/model"
    assert drift[drift.index("--time-limit-s") + 1] == "60"
    assert sorted(p.name for p in out.iterdir()) == ["model_drift_gdn_gpu.log",
                                                     "model_drift_gdn_gpu.tar.gz"]
    assert "total:" in (out / "model_drift_gdn_gpu.log").read_text()


def test_model_drift_job_defaults_to_mamba2_and_gdn_can_take_a_checkpoint(tmp_path):
    """No PART runs the Mamba-2 job (train 180 s, the gpu preset, the Pareto figure);
    MD_GDN_MODEL=DIR makes the gdn part drift on DIR without training."""
    done, commands, out = _drift_job(tmp_path / "a")
    assert done.returncode == 0, done.stderr
    assert [c[1] for c in commands] == ["experiments.train_lm", "experiments.model_drift",
                                        "experiments.model_drift"]
    assert "--arch" not in commands[0] and commands[1][2:4] == ["--preset", "gpu"]
    assert "--pareto" in commands[2]
    assert sorted(p.name for p in out.iterdir()) == ["model_drift_gpu.log",
                                                     "model_drift_gpu.tar.gz"]
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    done, commands, _ = _drift_job(tmp_path / "b", "gdn", MD_GDN_MODEL=str(model))
    assert done.returncode == 0, done.stderr
    assert len(commands) == 1 and commands[0][commands[0].index("--model") + 1] == str(model)
