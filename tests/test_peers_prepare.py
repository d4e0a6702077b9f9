"""scripts/peers/prepare.sh and flashinfer_prebuild.py on a machine without network or
FlashInfer: a bad argument or a download that cannot happen is one clear line, at once, not
pip's error alone after minutes or a traceback; and, where the wheels are at hand ($PEERS_WHEELS
or /tmp/peers), the FLA and vLLM extractions carry the GDN kernels and exactly the modules they
import."""

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
    assert "bash scripts/peers/prepare.sh [vllm] [flashinfer] [fla]" in done.stdout
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


def _wheel(pattern: str) -> Path:
    """The first wheel matching `pattern` where prepare.sh looks ($PEERS_WHEELS, /tmp/peers),
    or skip."""
    for folder in dict.fromkeys([os.environ.get("PEERS_WHEELS", "/tmp/peers"), "/tmp/peers"]):
        found = sorted(Path(folder).glob(pattern)) + sorted(Path(folder).glob(f"*/{pattern}"))
        if found:
            return found[0]
    pytest.skip(f"no {pattern} in $PEERS_WHEELS or /tmp/peers")


def _imported(site: Path, module: str, prefix: str) -> list[str]:
    """The modules under `prefix` that importing `module` from `site` loads (a fresh Python,
    Triton's interpreter on, so that no GPU is looked for)."""
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); import {module}; "
            f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == {prefix!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _module_files(site: Path, modules: list[str]) -> set[str]:
    files = set()
    for name in modules:
        path = site / name.replace(".", "/")
        files.add(str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
                      .relative_to(site)))
    return files


def test_fla_target_carries_the_gdn_kernel_and_exactly_what_it_imports(tmp_path):
    """prepare.sh fla: .peers/fla/site holds fused_recurrent_gated_delta_rule and the modules
    importing it loads, every one of them and no other file (stub package __init__ files stop
    FLA's import-everything ones); the MIT LICENSE and activate.sh beside; about 100 KiB."""
    wheel = _wheel("fla_core-0.6.0-*.whl")
    (tmp_path / "wheels").mkdir()
    shutil.copy(wheel, tmp_path / "wheels")
    done = _prepare(tmp_path, "fla")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("fla: ") and wheel.name in done.stdout
    peer = tmp_path / "tree" / ".peers" / "fla"
    site = peer / "site"
    assert "MIT License" in (peer / "LICENSE").read_text()
    files = {str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()}
    modules = _imported(site, "fla.ops.gated_delta_rule.fused_recurrent", "fla")
    assert "fla.ops.gated_delta_rule.fused_recurrent" in modules
    assert _module_files(site, modules) == files
    for stub in ("fla/ops/__init__.py", "fla/ops/utils/__init__.py",
                 "fla/ops/gated_delta_rule/__init__.py"):
        assert "generated by lowprec-ssm" in (site / stub).read_text()
    assert sum(p.stat().st_size for p in peer.rglob("*") if p.is_file()) < 256 * 1024
    shown = subprocess.run(["bash", "-c", f"source {peer / 'activate.sh'}; echo $PYTHONPATH"],
                           capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert shown.stdout.strip() == str(site)


def test_vllm_target_carries_the_gdn_decode_beside_the_mamba_kernels(tmp_path):
    """prepare.sh vllm: the packed GDN decode Qwen3-Next calls
    (vllm/third_party/flash_linear_attention/ops/fused_recurrent.py) and the Mamba kernels
    import from .peers/vllm/site with the shims; the vendored FLA ops' __init__ is a stub
    (the real one imports every op) and their LICENSE is carried."""
    wheel = _wheel("vllm-0.33.0-*.whl")
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / wheel.name).symlink_to(wheel)
    done = _prepare(tmp_path, "vllm")
    assert done.returncode == 0, done.stderr
    site = tmp_path / "tree" / ".peers" / "vllm" / "site"
    fla = site / "vllm" / "third_party" / "flash_linear_attention"
    assert sorted(p.name for p in (fla / "ops").iterdir()) == [
        "__init__.py", "fused_recurrent.py", "op.py", "utils.py"]
    assert "generated by lowprec-ssm" in (fla / "ops" / "__init__.py").read_text()
    assert "MIT" in (fla / "LICENSE").read_text()
    modules = _imported(site, "vllm.third_party.flash_linear_attention.ops.fused_recurrent",
                        "vllm")
    assert "vllm.third_party.flash_linear_attention.ops.fused_recurrent" in modules
    assert not [m for m in modules if m.endswith((".chunk", ".kda", ".l2norm"))]
    assert "vllm.model_executor.layers.mamba.ops.mamba_ssm" in _imported(
        site, "vllm.model_executor.layers.mamba.ops.mamba_ssm", "vllm")


def test_fla_without_its_wheel_names_it(tmp_path):
    """A refused connection: the download fails at once and the line names the wheel."""
    done = _prepare(tmp_path, "fla", PIP_INDEX_URL="http://127.0.0.1:9/simple")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"prepare.sh: the fla-core 0.6.0 wheel is missing from "
                           f"{tmp_path / 'wheels'}")
    assert "put fla_core-0.6.0-*.whl there (PEERS_WHEELS)" in last
