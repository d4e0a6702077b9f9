"""Output-path checks shared by the kit's command lines (experiments/ and cute_kernels/'
benchmarks): why a file or folder cannot be written, asked before the work so that a bad path
is an argument error and not a traceback after a long run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
