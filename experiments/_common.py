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
    old), so a GPU run is started as ``LOWPREC_COMMIT=<hash here> bash scripts/...``."""
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
    return commit + ("+dirty" if dirty else "")


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


def folder_problem(folder: str | Path) -> str | None:
    """Why files cannot be written into ``folder`` (to be created with its parents), or None.

    Checked before the work, so that a bad output path is an argument error and not a
    traceback after a long run; nothing is created (a refused command leaves no folders
    behind): the command makes its folders when it writes."""
    try:
        return _folder_problem(Path(folder))
    except OSError as error:  # a stat can fail too: a name too long, a loop of links
        return f"{_short(folder)}: {error.strerror or error}"


def file_problem(path: str | Path) -> str | None:
    """Why the file ``path`` cannot be written (its folder created if need be), or None."""
    path = Path(path)
    try:
        if path.is_dir():
            return f"{path} is a folder"
        if problem := _folder_problem(path.parent):
            return problem
        if path.exists() and not os.access(path, os.W_OK):
            return "the file is not writable"
        return _long_name([path.name], _nearest_existing(path.parent))
    except OSError as error:
        return f"{_short(path)}: {error.strerror or error}"


def is_folder(path) -> bool:
    """Path.is_dir, False where the check itself fails (a name too long raises on 3.11):
    file_problem and folder_problem then name the problem."""
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def is_file(path) -> bool:
    """Path.is_file, False where the check itself fails (as is_folder)."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def _short(path) -> str:
    text = str(path)
    return text if len(text) <= 80 else text[:77] + "..."


def _nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _folder_problem(folder: Path) -> str | None:
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the folder {existing} is not writable"
    # os.access says yes to root everywhere (/proc, /sys, read-only mounts): try a real write,
    # a nameless temporary file that is gone when closed
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"cannot write in the folder {existing}: {error.strerror or error}"
    return _long_name(folder.relative_to(existing).parts, existing)


def _long_name(names, folder: Path) -> str | None:
    """Why one of ``names`` (path components to be made in ``folder``) is too long, or None."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for name in names:
        if len(os.fsencode(name)) > limit:
            return f"the name {name[:40]}... is longer than the {limit} bytes allowed"
    return None


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
