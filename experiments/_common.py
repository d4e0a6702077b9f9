"""Provenance shared by the experiment scripts: the git commit, the device, and a sidecar
``<csv stem>.meta.json`` that records how a CSV was made (the CSV itself keeps only its tidy
columns, so that a fresh run can be compared with the committed file byte for byte)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

# the output-path checks live below the experiments, so that cute_kernels' command lines
# (which must not import experiments) share them
from lowprec._paths import file_problem, folder_problem, is_file, is_folder

__all__ = [
    "git_commit",
    "device_name",
    "meta_path",
    "write_meta",
    "folder_problem",
    "file_problem",
    "OneLineParser",
    "is_folder",
    "is_file",
]


def git_commit(repo: Path | None = None) -> str:
    """The checked-out commit (with ``+dirty`` if the tree has changes or untracked files), or
    ``'unknown'`` outside a git repository or before the first commit.

    ``LOWPREC_COMMIT`` in the environment wins: the GPU machine gets a copy of the working
    tree whose ``.git`` is not the checkout's (on 2026-11-29 it named a commit several hours
    old), so a GPU run is started as ``LOWPREC_COMMIT=<hash here> bash scripts/...``.

    A dirty tree also gets ``(tree <hash>)``: the git tree of the files as they are (tracked
    and untracked, less the ignored), which names the content even where ``.git`` is stale.
    Here, ``git log --all --format='%h %T' | grep <hash>`` finds the commit that has it."""
    if os.environ.get("LOWPREC_COMMIT"):
        return os.environ["LOWPREC_COMMIT"] + " (LOWPREC_COMMIT)"
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if not dirty:
        return commit
    tree = _worktree_tree(repo)
    return commit + "+dirty" + (f" (tree {tree})" if tree else "")


def _worktree_tree(repo: Path) -> str:
    """`git write-tree` of the working tree through a throwaway index and object folder (the
    repository's own objects read, none written to it); '' if git fails."""
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "objects"))  # git refuses an object folder that is not there
        objects = subprocess.run(["git", "rev-parse", "--git-path", "objects"], cwd=repo,
                                 capture_output=True, text=True)
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index"),
               "GIT_OBJECT_DIRECTORY": os.path.join(tmp, "objects"),
               "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(repo / objects.stdout.strip())}
        try:
            for argv in (["git", "add", "-A"], ["git", "write-tree"]):
                done = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True,
                                      check=True)
        except (OSError, subprocess.CalledProcessError):
            return ""
    return done.stdout.strip()


def device_name(device: str = "cpu") -> str:
    """A human-readable name of the device the numbers were computed on."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def meta_path(csv_path: str | Path) -> Path:
    """``results/x.csv`` -> ``results/x.meta.json``."""
    csv_path = Path(csv_path)
    return csv_path.with_name(csv_path.stem + ".meta.json")


def write_meta(
    csv_path: str | Path, command: str, seconds: float, config: dict, device: str = "cpu"
) -> Path:
    """Write the sidecar of ``csv_path``: command line, commit, wall time, versions, config."""
    path = meta_path(csv_path)
    meta = {
        "command": command,
        "commit": git_commit(),
        "seconds": round(seconds, 2),
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": config,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


class OneLineParser(argparse.ArgumentParser):
    """The experiments' argument parser: an argument error is one line on stderr (a reason
    spanning lines is joined) and exit status 2, without argparse's usage block. Flags are
    spelled out: argparse's abbreviations (``--batch`` for ``--batches``) are refused, so a
    command in a results file reads the same as the flag it set."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        message = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def save_small_png(fig, png) -> None:
    """Save at dpi 110 with a 128-colour palette: a third of the RGBA size (about 100 KB for
    a traffic plot), no visible change for line plots."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=128).save(png, optimize=True)
