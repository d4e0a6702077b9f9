"""scripts/peers/prepare.sh and flashinfer_prebuild.py on a machine without network or
FlashInfer: a bad argument or a download that cannot happen is one clear line, at once, not
pip's error alone after minutes or a traceback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _prepare(tmp_path: Path, *args: str, **env) -> subprocess.CompletedProcess:
    """Runs a copy of prepare.sh in a bare tree, its wheels folder empty, pip's configuration
    files and indexes replaced by `env`'s."""
    tree = tmp_path / "tree"
    (tree / "scripts" / "peers").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "peers" / "prepare.sh", tree / "scripts" / "peers")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    full = {**clean, "PYTHON": sys.executable, "PEERS_WHEELS": str(tmp_path / "wheels"),
            "PIP_CONFIG_FILE": os.devnull, **env}
    return subprocess.run(["bash", str(tree / "scripts" / "peers" / "prepare.sh"), *args],
                          env=full, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("args", [["--help"], ["flashinfer", "-h"]])
def test_help_prints_the_header_and_makes_nothing(tmp_path, args):
    """--help was 'unknown argument'."""
    done = _prepare(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert "bash scripts/peers/prepare.sh [vllm] [flashinfer]" in done.stdout
    assert "PEERS_WHEELS" in done.stdout and not done.stdout.startswith("#")
    assert not (tmp_path / "wheels").exists() and not (tmp_path / "tree" / ".peers").exists()


@pytest.mark.parametrize("args, words", [
    (["vllm", "--fast"], "unknown argument '--fast'"),
    (["--prebuild", "flashinfer", "--no-prebuild"], "--prebuild and --no-prebuild given"),
])
def test_a_bad_argument_is_one_line_before_anything_is_made(tmp_path, args, words):
    """--prebuild with --no-prebuild: the last one won without a word."""
    done = _prepare(tmp_path, *args)
    assert done.returncode == 2 and words in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "wheels").exists()


def test_without_network_it_names_the_wheel_to_bring_and_gives_up_soon(tmp_path):
    """An index that takes connections and never answers (a network that drops packets):
    with pip's own settings the call waited six timeouts (18 minutes under the 180 s of
    some pip configurations) and ended on pip's error, set -e cutting off the script's own
    line; now it gives up after one retry of PEERS_PIP_TIMEOUT and says which wheel to put
    where."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes the handshakes; nothing ever reads or answers
    try:
        index = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        start = time.monotonic()
        done = _prepare(tmp_path, "vllm", PIP_INDEX_URL=index, PIP_DEFAULT_TIMEOUT="180",
                        PEERS_PIP_TIMEOUT="2")
        seconds = time.monotonic() - start
    finally:
        silent.close()
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("prepare.sh: the vllm 0.33.0 wheel is missing from "
                           f"{tmp_path / 'wheels'} and pip could not download it")
    assert "put vllm-0.33.0-*.whl there (PEERS_WHEELS)" in last
    assert seconds < 60
    assert not (tmp_path / "tree" / ".peers" / "vllm").exists()


def test_flashinfer_without_its_wheels_names_both(tmp_path):
    """A refused connection: both downloads fail at once, and the line names both wheels."""
    done = _prepare(tmp_path, "flashinfer", "--no-prebuild",
                    PIP_INDEX_URL="http://127.0.0.1:9/simple")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "flashinfer_python-0.7.2.post1-*.whl and apache_tvm_ffi-*-cp312-*.whl" in last


@pytest.mark.parametrize("args, words", [
    (["--windows", "8,x"], "--windows: expected comma-separated integers"),  # a traceback
    (["--windows", "8,32"], "--windows: expected windows 1..16"),  # 32 was left out silently
    (["--windows", "0"], "--windows: expected windows 1..16"),
    ([], "flashinfer is not importable"),  # a ModuleNotFoundError traceback
])
def test_prebuild_argument_and_import_problems_are_one_line(tmp_path, args, words):
    if not args and _importable("flashinfer"):
        pytest.skip("flashinfer is importable here")
    files = ["--aot", str(tmp_path / "aot"), "--deps", str(tmp_path / "deps.txt"),
             "--report", str(tmp_path / "report.tsv")]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "peers" /
                                               "flashinfer_prebuild.py"), *files, *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
