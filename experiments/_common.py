"""What the experiment scripts share: provenance, atomic output files, checked input files.

- Provenance: the git commit, the device, and a sidecar ``<csv stem>.meta.json`` that records
  how a CSV was made (the CSV itself keeps only its tidy columns, so that a fresh run can be
  compared with the committed file byte for byte). The sidecar also records the CSV's row
  count and sha256, which the readers compare with the file.
- Atomic outputs: every file is written under a temporary name in its own folder and renamed
  into place once complete (``atomic_file``, ``write_text``, ``write_csv``, ``write_meta``,
  ``save_small_png``), so a run stopped at any point leaves either no file or a complete one
  under the final name.
- Where outputs go (``output_problem``, ``runs_folder``): committed results change only on an
  explicit request; an existing file that is not the experiment's own is not overwritten
  without ``--force``.
- Checked readers (``Column``, ``Schema``, ``read_table``): a CSV is refused, in one line
  naming the file and the line, when it is incomplete, has other columns, a value of the
  wrong type or out of range, or a key twice.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import platform
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments._interrupt import raise_if_interrupted

# the output-path checks live below the experiments, so that cute_kernels' command lines
# (which must not import experiments) share them
from lowprec._paths import file_problem, folder_problem, is_file, is_folder

__all__ = [
    "FLOAT_6E",
    "INT",
    "BadFile",
    "Column",
    "OneLineParser",
    "Schema",
    "atomic_file",
    "check_against_meta",
    "check_rows",
    "device_name",
    "file_problem",
    "file_sha256",
    "folder_problem",
    "git_commit",
    "is_file",
    "is_folder",
    "meta_path",
    "output_problem",
    "read_meta",
    "read_table",
    "runs_folder",
    "save_small_png",
    "write_csv",
    "write_meta",
    "write_text",
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


# --------------------------------------------------------------------------------------------
# atomic outputs


@contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file beside ``path`` (``.<name>.<pid>.tmp``, same folder, so the
    rename stays on one filesystem); on a clean exit flush it to disk and rename it to
    ``path``, on any exception (Ctrl-C included) remove it. The folder is created if need
    be. ``mode`` is ``'w'`` (text, ``\\n`` line ends) or ``'wb'``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode: expected 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": "\n"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        raise_if_interrupted()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_file(path) as handle:
        handle.write(text)
    return Path(path)


def write_csv(frame, path: str | Path, float_format: str | None = None) -> Path:
    """Write a DataFrame as a CSV atomically: no index, ``\\n`` line ends, NaN as ``nan``,
    floats with ``float_format`` (``'%.6e'``, ``'%.10g'``) so a rerun reproduces the bytes."""
    text = frame.to_csv(index=False, float_format=float_format, na_rep="nan",
                        lineterminator="\n")
    return write_text(path, text)


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_meta(
    csv_path: str | Path, command: str, seconds: float, config: dict, device: str = "cpu",
    *, extra: dict | None = None
) -> Path:
    """Write the sidecar of ``csv_path`` atomically: command line, commit, wall time,
    versions, config, ``extra`` (a run's status, for one), and, if ``csv_path`` exists, its
    row count and sha256 under ``"csv"`` (what the readers check the CSV against)."""
    path = meta_path(csv_path)
    meta = {
        "command": command,
        "commit": git_commit(),
        "seconds": round(seconds, 2),
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": config,
        **(extra or {}),
    }
    if Path(csv_path).is_file():
        with open(csv_path, "rb") as handle:
            rows = sum(1 for _ in handle) - 1  # less the header
        meta["csv"] = {"name": Path(csv_path).name, "rows": rows,
                       "sha256": file_sha256(csv_path)}
    write_text(path, json.dumps(meta, indent=2) + "\n")
    return path


def read_meta(path: str | Path) -> dict:
    """A ``.meta.json`` as a dict; ``BadFile`` (one line naming it) if it is not one."""
    try:
        meta = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadFile(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadFile(f"{path}: not a meta.json ({_one_line(error)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("command"), str):
        raise BadFile(f"{path}: not a meta.json (no 'command')")
    return meta


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


PNG_SOURCE_KEY = "Source"  # the PNG text chunk naming the command that drew the figure


def save_small_png(fig, png, dpi: int = 110, source: str | None = None) -> None:
    """Save atomically with a 128-colour palette: a third of the RGBA size (about 100 KB for
    a traffic plot at dpi 110), no visible change for line plots. ``source`` (the experiment,
    ``experiments.traffic``) goes into a PNG text chunk, so a later run recognises its own
    figure (``output_problem``)."""
    import io

    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    buffer.seek(0)
    info = PngInfo()
    if source:
        info.add_text(PNG_SOURCE_KEY, f"lowprec-ssm {source}")
    with Image.open(buffer) as image, atomic_file(png, "wb") as handle:
        image.convert("RGB").quantize(colors=128).save(handle, format="PNG", optimize=True,
                                                       pnginfo=info)


# --------------------------------------------------------------------------------------------
# where outputs go


def runs_folder(experiment: str, what: list[str], root: str | Path = "runs") -> Path:
    """``runs/<experiment>_<what ran>``: the folder of a run that does not regenerate the
    committed results. ``what`` are its settings as ``name-value`` words; a name past 100
    characters keeps its start and a hash of the whole."""
    words = [re.sub(r"[^A-Za-z0-9.=+-]+", "-", w).strip("-") for w in what]
    name = "_".join([experiment, *[w for w in words if w]])
    if len(name) > 100:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        name = name[:88].rstrip("_-") + "_" + digest
    return Path(root) / name


# flags that say where outputs go or how a run reports, not what it measures
_OUTPUT_DESTS = {"help", "out", "plot", "plot_only", "plot_dir", "run_label", "force", "merge",
                 "list_kernels", "profile", "peers_dir", "no_progress", "replot", "keep_cells"}


def default_out(parser, args, experiment: str, committed: str | Path) -> Path:
    """Where a run writes when ``--out`` is not given: ``committed`` (a file under
    ``results/``) when every setting equals its parser default, i.e. the run is the command
    that regenerates the committed result; else ``runs/<experiment>_<changed settings>/`` with
    the committed file's name, so a custom run never replaces committed results."""
    changed = []
    for action in parser._actions:
        dest = action.dest
        if dest in _OUTPUT_DESTS or dest == "==SUPPRESS==" or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value != action.default:
            if isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            changed.append(dest.replace("_", "-") + ("" if value is True else f"-{value}"))
    if not changed:
        return Path(committed)
    return runs_folder(experiment, changed) / Path(committed).name


def output_problem(path: str | Path, source: str, header: str | None = None) -> str | None:
    """Why writing ``path`` would replace a file that is not ``source``'s own output (None if
    the path is free or holds one): a CSV whose first line is ``header`` or whose
    ``<stem>.meta.json`` names ``source``, a JSON whose
    ``command`` runs ``python -m <source>``, a PNG whose text chunk or sibling
    ``<stem>.meta.json`` names ``source``. Callers refuse the run unless ``--force``."""
    path = Path(path)
    if not path.exists() or path.is_dir():
        return None  # a folder is file_problem's to name
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            if header is not None:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    if handle.readline().rstrip("\n") == header:
                        return None
            if meta_path(path).is_file() and _json_is_from(meta_path(path), source):
                return None  # its own, in an older layout
        elif suffix == ".json" and _json_is_from(path, source):
            return None
        elif suffix == ".png":
            from PIL import Image

            with Image.open(path) as image:
                if image.info.get(PNG_SOURCE_KEY) == f"lowprec-ssm {source}":
                    return None
            sibling = meta_path(path.with_suffix(".csv"))
            if sibling.is_file() and _json_is_from(sibling, source):
                return None
    except Exception:  # an unreadable or foreign file is foreign: the message below
        pass
    return (f"{path} exists and is not an output of {source} (pass --force to replace it, or "
            "choose another --out)")


def _json_is_from(path: Path, source: str) -> bool:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(meta, dict) and (
        str(meta.get("command", "")).startswith(f"python -m {source}")
        or meta.get("experiment") == source)


# --------------------------------------------------------------------------------------------
# checked readers


class BadFile(ValueError):
    """An input file the reader refuses; the message is one line naming the file (and the
    line of the first bad row, counting the header as line 1)."""


@dataclass(frozen=True)
class Column:
    """One column of a ``Schema``.

    ``kind`` is ``int``, ``float``, ``str`` or ``bool``; ``pattern`` a regular expression every
    cell must match in full (the writer's number format: ``FLOAT_6E`` for ``'%.6e'``, so a
    value rewritten as ``1.01993`` or ``1.0e-1`` is refused rather than read as another
    number); ``minimum``/``maximum`` bound the values (inclusive); ``choices`` lists the
    allowed values; ``nonfinite`` allows ``nan``, ``inf`` and ``-inf`` in a float column (a
    bound still refuses an infinity past it). ``loose`` reads a cell as pandas wrote it from
    a frame with gaps: spaces around it ignored, a blank float is NaN, an int may read
    ``16.0``, a bool is ``true``/``false`` in any case. ``optional`` (with ``Schema.exact``
    off) checks the column where the file has it."""

    name: str
    kind: type = str
    pattern: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    nonfinite: bool = False
    loose: bool = False
    optional: bool = False

    def __post_init__(self):
        if self.kind not in (int, float, str, bool):
            raise TypeError(f"kind: expected int, float, str or bool, got {self.kind!r}")
        if self.kind is bool and not self.loose:
            raise ValueError(f"{self.name}: a bool column is read loose (true/false)")


@dataclass(frozen=True)
class Schema:
    """A CSV's columns and the columns that identify a row (``keys``: no two rows may share
    their values). ``exact``: the header is these columns in this order; off, the file needs
    the columns that are not optional and may have others (kept as text)."""

    columns: tuple[Column, ...]
    keys: tuple[str, ...] = ()
    exact: bool = True

    def __post_init__(self):
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise ValueError(f"columns: expected distinct names, got {names}")
        if missing := [k for k in self.keys if k not in names]:
            raise ValueError(f"keys: expected column names, got {missing}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def header(self) -> str:
        return ",".join(self.names)


FLOAT_6E = r"-?\d\.\d{6}e[+-]\d{2,3}"  # what '%.6e' writes
INT = r"-?\d+"
_LOOSE_INT = r"[+-]?\d{1,18}(\.0*)?"  # 16.0: an int column with gaps, written as floats


def read_table(path: str | Path, schema: Schema, *, what: str = "", recorded: bool = False):
    """Read the CSV at ``path`` and check it against ``schema``; a DataFrame with int, float,
    bool and str columns. Raises ``BadFile`` with one line naming the file (and ``what`` it
    is) and the first bad line: missing or unreadable, empty, cut short (no line end after
    its last row), other columns, a row with too many or too few fields or blank, a value
    that does not match its column's pattern, type, range or choices, or a key twice. With
    ``recorded``, a file whose ``.meta.json`` records a sha256 of it must have those bytes."""
    import pandas as pd

    path = Path(path)
    label = f"{path}" + (f" ({what})" if what else "")
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise BadFile(f"{label}: cannot be read as CSV ({_one_line(why)})") from None
    if not raw:
        raise BadFile(f"{label}: empty file")
    if not raw.endswith(b"\n"):
        last = raw.count(b"\n") + 1
        raise BadFile(f"{label}: line {last}: incomplete (no line end after "
                      "the last row: the file was cut short)")
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as error:
        raise BadFile(f"{label}: cannot be read as CSV ({_one_line(error)})") from None
    header = [name.rstrip("\r") for name in rows[0]]
    if schema.exact and header != list(schema.names):
        missing = [c for c in schema.names if c not in header]
        extra = [c for c in header if c not in schema.names]
        detail = (f"missing {missing}" if missing else "") + (
            ("; " if missing else "") + f"unexpected {extra}" if extra else "")
        raise BadFile(f"{label}: line 1: expected the columns {list(schema.names)}, got "
                      f"{header}" + (f" ({detail})" if detail else " (another order)"))
    required = [c.name for c in schema.columns if not c.optional]
    if missing := [c for c in required if c not in header]:
        raise BadFile(f"{label}: expected the columns {', '.join(required)}; missing "
                      f"{', '.join(missing)}")
    if len(set(header)) != len(header) or "" in header:
        raise BadFile(f"{label}: line 1: a column name twice or empty, got "
                      f"{', '.join(header)}")
    for number, fields in enumerate(rows, start=1):
        if len(fields) != len(header):
            raise BadFile(f"{label}: line {number}: expected {len(header)} fields, got "
                          f"{len(fields)} (a row cut short, run together or blank)")
    if recorded:
        _check_recorded_bytes(path, label)
    if len(rows) == 1:
        raise BadFile(f"{label}: no rows (the header alone)")
    frame = pd.DataFrame(rows[1:], columns=header, dtype=str)
    for column in schema.columns:
        if column.name in header:
            frame[column.name] = (_loose_values if column.loose else _strict_values)(
                frame[column.name], column, label)
    table = frame if not schema.exact else frame[list(schema.names)]
    if schema.keys:
        keys = list(schema.keys)
        twice = table.duplicated(keys, keep="first")
        if twice.any():
            row = int(twice.to_numpy().nonzero()[0][0])
            first = int((table[keys] == table[keys].iloc[row]).all(axis=1).to_numpy()
                        .nonzero()[0][0])
            values = ", ".join(f"{k}={table[k].iloc[row]}" for k in keys)
            raise BadFile(f"{label}: line {row + 2}: repeats the point of line {first + 2} "
                          f"({values})")
    return table


def _strict_values(cells, column: Column, label: str):
    """``cells`` (text) as ``column``'s values, each written as its writer writes it."""
    import numpy as np
    import pandas as pd

    name = column.name
    if column.pattern is not None:
        allowed = column.pattern + ("|nan|inf|-inf" if column.nonfinite else "")
        check_rows(label, ~cells.str.fullmatch(allowed), f"{name}: expected values written "
                   f"as /{allowed}/", cells)
    if column.kind is str:
        values = cells
    elif column.kind is int:
        check_rows(label, ~cells.str.fullmatch(INT), f"{name}: expected an integer", cells)
        values = _as_int(cells, label, name)
    else:
        values = pd.to_numeric(cells, errors="coerce")
        check_rows(label, values.isna() & (cells != "nan"), f"{name}: expected a number",
                   cells)
    if column.kind is not str:
        finite = values.astype(float)
        if column.kind is float and not column.nonfinite:
            check_rows(label, ~np.isfinite(finite), f"{name}: expected a finite number", cells)
        if column.minimum is not None:
            check_rows(label, finite < column.minimum, f"{name}: expected values "
                       f">= {column.minimum:g}", cells)
        if column.maximum is not None:
            check_rows(label, finite > column.maximum, f"{name}: expected values "
                       f"<= {column.maximum:g}", cells)
    if column.choices is not None:
        check_rows(label, ~values.isin(column.choices), f"{name}: expected one of "
                   f"{list(column.choices)}", cells)
    return values


def _loose_values(cells, column: Column, label: str):
    """``cells`` (text) as ``column``'s values, read the way ``Column.loose`` says."""
    import pandas as pd

    if column.kind is str:
        return cells
    text = cells.str.strip()
    if column.kind is bool:
        lowered = text.str.lower()
        bad, values = ~lowered.isin(["true", "false"]), lowered == "true"
    else:
        values = pd.to_numeric(text.replace({"": "nan"}), errors="coerce")
        bad = values.isna() & ~text.str.lower().isin(["nan", ""])
        if column.kind is int:
            bad |= ~text.str.fullmatch(_LOOSE_INT)
    kind = {int: "an integer", float: "a float", bool: "a bool"}[column.kind]
    check_rows(label, bad, f"column {column.name}: expected {kind}", cells)
    return values.astype("int64") if column.kind is int else values


def _check_recorded_bytes(path: Path, label: str) -> None:
    """``BadFile`` if ``path``'s meta.json records a sha256 of it that its bytes do not have:
    rows dropped, repeated or changed after the run wrote them. A meta.json without one (an
    older layout) or none at all checks nothing."""
    try:
        recorded = json.loads(meta_path(path).read_text()).get("csv")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return
    if (isinstance(recorded, dict) and recorded.get("name") == path.name
            and file_sha256(path) != recorded.get("sha256")):
        raise BadFile(f"{label}: its bytes differ from those {meta_path(path).name} recorded "
                      f"({recorded.get('rows')} rows): changed or cut after it was written")


def _as_int(cells, path: str | Path, name: str):
    """Integer cells as int64, or uint64 where a value passes int64 (Philox seeds); a value
    outside both is ``BadFile`` naming the file and its line."""
    import numpy as np
    import pandas as pd

    values = [int(c) for c in cells]
    outside = pd.Series([not -2**63 <= v < 2**64 for v in values], index=cells.index)
    check_rows(path, outside, f"{name}: expected an integer within int64 or uint64", cells)
    negative = any(v < 0 for v in values)
    if negative:
        check_rows(path, pd.Series([v >= 2**63 for v in values], index=cells.index),
                   f"{name}: expected integers within int64 (the column has negatives)", cells)
    kind = np.uint64 if values and not negative and max(values) >= 2**63 else np.int64
    return cells.map(int).astype(kind)


def check_rows(path: str | Path, bad, reason: str, cells=None) -> None:
    """``BadFile`` naming the first row where the boolean Series ``bad`` holds (by its line in
    the file: the header is line 1, the row at index ``i`` line ``i + 2``), with ``reason``
    and, given ``cells``, the value found there."""
    if not bool(bad.any()):
        return
    index = bad.index[bad.to_numpy().nonzero()[0][0]]
    count = int(bad.sum())
    value = "" if cells is None else f", got {str(cells.loc[index])[:40]!r}"
    more = f" ({count - 1} more row(s) like it)" if count > 1 else ""
    raise BadFile(f"{path}: line {index + 2}: {reason}{value}{more}")


def check_against_meta(path: str | Path, meta: dict) -> None:
    """``BadFile`` unless the CSV at ``path`` has the sha256 its meta.json recorded (a file
    changed, cut or mixed with another run's after it was written)."""
    recorded = meta.get("csv")
    if not isinstance(recorded, dict) or "sha256" not in recorded:
        raise BadFile(f"{meta_path(path)}: records no sha256 of {Path(path).name}; rerun the "
                      "command in its 'command' to rewrite both")
    if file_sha256(path) != recorded["sha256"]:
        raise BadFile(f"{path}: its bytes differ from those its meta.json recorded "
                      f"({recorded.get('rows')} rows, sha256 {recorded['sha256'][:12]}...): "
                      "changed or cut after it was written")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]

