"""scripts/ncu_pipes.sh, ncu_flush_stages.sh and ncu_source.sh on a machine without ncu: the
argument checks in front of ncu, and the commands their headers give (which must pass those
checks, with names the tools they call know)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("ncu_pipes", "ncu_flush_stages", "ncu_source")
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(name: str, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path} if path is not None else None
    return subprocess.run(["bash", str(ROOT / "scripts" / f"{name}.sh"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def _no_ncu_path() -> str:
    """PATH without ncu: its folders but any that holds one."""
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if not (Path(d) / "ncu").exists())


def _header_command(name: str) -> list[str]:
    """The arguments of the header's `bash scripts/<name>.sh ...` line."""
    text = (ROOT / "scripts" / f"{name}.sh").read_text()
    line = re.search(rf"bash scripts/{name}\.sh (.*)$", text, re.M)[1]
    return line.replace("...", "").split()


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_the_header_with_its_command(name):
    """--help was the usage line and exit status 2 (ncu_pipes, ncu_source) or, with no
    folder named --help, the same."""
    done = _run(name, "--help")
    assert done.returncode == 0, done.stderr
    assert f"bash scripts/{name}.sh $OUT" in done.stdout
    assert not done.stdout.lstrip().startswith("#") and "set -uo" not in done.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_missing_out_dir_is_named(tmp_path, name):
    """A folder that does not exist got the bare usage line, which does not say why."""
    missing = tmp_path / "not made"
    args = [str(missing)] + ([] if name == "ncu_flush_stages" else ["cute:nonflush:nvfp4"])
    done = _run(name, *args)
    assert done.returncode == 2
    assert done.stderr.strip() == f"{name}.sh: OUT_DIR {missing} is not a folder (make it first)"
    assert not missing.exists()


def test_flush_stages_refuses_a_second_argument(tmp_path):
    """It takes one folder; a kernel name after it (as the other two take) was ignored."""
    done = _run("ncu_flush_stages", str(tmp_path), "cute:flush:fp16sr+nvfp4",
                path=_no_ncu_path())
    assert done.returncode == 2
    assert done.stderr.startswith("usage: bash scripts/ncu_flush_stages.sh OUT_DIR ")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_header_command_passes_the_argument_checks(tmp_path, name):
    """Run as the header writes it (OUT a folder), each script gets as far as looking for ncu;
    its kernels are kernel_bench's names, and ncu_flush_stages' forms bench_write's cases."""
    from cute_kernels import bench_write as bw
    from experiments import kernel_bench as kb

    args = [str(tmp_path) if a == "$OUT" else a for a in _header_command(name)]
    for kernel in args[1:]:
        assert kernel in kb.KERNELS, kernel
    done = _run(name, *args, path=_no_ncu_path())
    assert done.returncode == 2
    assert done.stderr.strip() == f"{name}.sh: no ncu here (run it on the GPU machine)"
    if name == "ncu_flush_stages":
        text = (ROOT / "scripts" / f"{name}.sh").read_text()
        cases = re.findall(r'^  "[a-z0-9_]+\|([^|]+)\|\d"$', text, re.M)
        names = [case[0] for case in bw.bench_cases(bw.BenchConfig())]
        assert len(cases) == 4 and all(case in names for case in cases)


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("ncu_status", [0, 3])
def test_the_exit_status_is_ncus_not_the_last_greps(tmp_path, name, ncu_status):
    """The scripts exited with their last command's status: a trim that matched nothing
    (grep's 1) failed a good run, and a failed ncu whose log matched passed. A stand-in ncu
    that prints a line no trim keeps and exits with `ncu_status` stands for the real one."""
    fake = tmp_path / "bin"
    fake.mkdir()
    # a line the trims do not keep: their grep finds nothing and exits 1, which was the
    # scripts' status after a good run
    (fake / "ncu").write_text(f"#!/bin/sh\necho 'stand-in ncu'\nexit {ncu_status}\n")
    (fake / "ncu").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    args = [str(out) if a == "$OUT" else a for a in _header_command(name)]
    done = _run(name, *args, path=os.pathsep.join([str(fake), _no_ncu_path()]))
    assert done.returncode == ncu_status, done.stdout + done.stderr
    assert f"exit {ncu_status}" in done.stdout
