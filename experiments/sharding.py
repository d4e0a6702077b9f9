"""Sweeps of independent cells, in one process or over the ranks of ``torch.distributed``.

An experiment whose rows come from a grid of independent cells (recurrence, arm, format,
rounding, memory, seed, ...) gives `run_sweep` the ordered list of cells, a function that
computes one cell's rows, and the output path; the engine

- runs the cells in this process when the command was not launched by ``torchrun``, and
  splits them over the ranks when it was (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` in the
  environment): backend ``nccl`` with each rank on ``cuda:LOCAL_RANK`` where CUDA is
  available, else ``gloo``; with more ranks on a node than GPUs (a host-bound sweep, such as
  the emulation's step loop, keeps one GPU busy only from several processes) the ranks share
  the GPUs round robin, ``cuda:LOCAL_RANK % GPUs``, over ``gloo`` (NCCL takes one rank a
  GPU). The split is a pure function of the cells still to run (round robin over them in
  order, or longest-first greedy over the caller's costs), so a restarted sweep assigns the
  same way;
- keeps each finished cell as its own file in a cell store beside the output,
  ``<out>.cells/<hash of the cell key>.pkl`` (written atomically, holding the cell key and a
  fingerprint of the arguments), so that a rerun with the same ``--out`` and the same
  arguments skips the cells already done: a stopped sweep loses at most the cells in flight.
  A file made with other arguments, or one that cannot be read, is computed again. The store
  is a pickle of the cell's DataFrame because a CSV round trip can change a column's dtype
  (an int column with a NaN, a uint64 seed, text that reads as a number), and the merged CSV
  must not depend on which cells came from the store; load only stores a sweep of yours wrote;
- merges on rank 0: every cell's rows concatenated in cell order, sorted stably by the
  caller's columns, written with the caller's CSV writer to a temporary name in the output's
  folder and renamed, so the CSV is the same bytes on any number of ranks and after any number
  of resumes; then ``<csv stem>.meta.json`` (also atomically) with the sharding record
  (`Sweep.record`: world size, backend, the cells each rank ran and its busy time, the cells
  taken from the store, the speedup estimate), and the store is removed;
- prints a progress line per rank (cells done / this rank's share, estimated time left) at
  most every ``progress`` seconds, and at the end, on rank 0, the speedup over one process,
  estimated as the sum of the cell times over the wall time of the sweep (cells taken from the
  store count in neither);
- stops cleanly: a cell that raises is reported in one line with its key (the traceback goes
  to ``<out>.cells/rank<r>.traceback``), the other ranks stop after their cell in flight (a
  flag in the c10d store, polled between cells and while waiting for the others: no
  collective is entered until every rank has finished its share, so nothing hangs), and
  every rank exits non-zero through `SweepStopped`; Ctrl-C or SIGTERM is one line as well.

``run_cell`` must return only complete rows: a cell that returns is stored as done. Times and
host names go to the sharding record only, never into the CSV. The ranks must agree on the
arguments and the cell keys (checked before the first cell), so a per-rank value such as the
device ``cuda:LOCAL_RANK`` stays out of ``arguments``. Rank 0 alone reads the store: on several
nodes, put ``--out`` on a filesystem they share, or a resume computes again the cells that
other nodes ran.

    torchrun --nproc-per-node 4 -m experiments.error_growth --preset default   # 4 ranks
    python -m experiments.error_growth --preset default                          # 1 process
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import pandas as pd
import torch
import torch.distributed as dist

from experiments._common import meta_path
from experiments._interrupt import raise_if_interrupted

__all__ = [
    "Ranks",
    "Sweep",
    "SweepStopped",
    "HELP",
    "add_arguments",
    "assign_cells",
    "cell_store_path",
    "fingerprint",
    "ranks_from_env",
    "local_device",
    "is_main_rank",
    "run_sweep",
    "write_atomic",
]

HELP = """\
Several processes: torchrun --nproc-per-node N -m <this module> <the same arguments> splits
the grid's cells over N ranks (one GPU each where CUDA is available, else gloo on the CPU) and
writes the same CSV as one process. Each finished cell is kept in <out>.cells/ until the CSV is
written: the same command after a stop (Ctrl-C, a killed rank, a lost machine) skips the cells
done. The speedup printed at the end is an estimate: the sum of the cell times over the wall
time of the sweep."""

STORE_VERSION = 1  # a cell file of another layout is computed again
FAILED_STATUS = 1
INTERRUPTED_STATUS = 130  # the shell's status for a command stopped by Ctrl-C
POLL_SECONDS = (0.01, 0.5)  # first and longest sleep between looks at the others' progress


class SweepStopped(SystemExit):
    """A sweep that did not finish: a cell raised on some rank, or Ctrl-C / SIGTERM. Its one
    line has been printed; as a `SystemExit` it ends the command with ``code`` (1 for a
    failed cell, 130 for an interrupt) unless the caller catches it."""


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: ``launched`` is False for a plain ``python`` command (then
    rank 0 of 1); ``device`` is ``cuda:LOCAL_RANK`` under torchrun with CUDA, else None."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False
    local_world_size: int = 1

    @property
    def shares_gpus(self) -> bool:
        """More ranks on this node than GPUs: they share them round robin."""
        return self.local_world_size > torch.cuda.device_count()

    @property
    def backend(self) -> str:
        if not self.launched:
            return "none"
        return "nccl" if torch.cuda.is_available() and not self.shares_gpus else "gloo"

    @property
    def device(self) -> str | None:
        if self.launched and torch.cuda.is_available():
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return None


def ranks_from_env(env: Mapping[str, str] | None = None) -> Ranks:
    """The ranks torchrun describes in ``env`` (default ``os.environ``): launched when
    ``WORLD_SIZE`` is set; ``RANK`` and ``LOCAL_RANK`` must then be set too."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return Ranks()
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        text = env.get(name)
        try:
            values[name] = int(text)
        except (TypeError, ValueError):
            raise ValueError(f"environment: {name} must be an integer under torchrun, got "
                             f"{text!r}") from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"environment: expected 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0, "
                         f"got RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}")
    text = env.get("LOCAL_WORLD_SIZE", str(local + 1))  # torchrun sets it
    try:
        local_world = int(text)
    except ValueError:
        raise ValueError(f"environment: LOCAL_WORLD_SIZE must be an integer under torchrun, "
                         f"got {text!r}") from None
    if not 0 <= local < local_world:
        raise ValueError(f"environment: expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, got "
                         f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={local_world}")
    return Ranks(rank=rank, world_size=world, local_rank=local, launched=True,
                 local_world_size=local_world)


def is_main_rank() -> bool:
    """True in a plain process and on rank 0 under torchrun: the process that writes the
    merged CSV, plots and prints the summary."""
    return os.environ.get("RANK", "0") == "0"


def local_device(default: str) -> str:
    """The device a cell runs on: the rank's GPU (``Ranks.device``) under torchrun where
    ``default`` names CUDA, else ``default`` unchanged."""
    ranks = ranks_from_env()
    if ranks.launched and default.startswith("cuda") and torch.cuda.is_available():
        return ranks.device
    return default


def assign_cells(n_cells: int, world_size: int,
                 costs: Sequence[float] | None = None) -> list[list[int]]:
    """The cell indices each rank runs, in the order it runs them. Without costs, round robin
    (cell i to rank i % world_size). With costs, longest first: cells by decreasing cost (ties
    in index order) each to the rank with the least cost so far (ties to the lowest rank)."""
    if not isinstance(n_cells, int) or n_cells < 0:
        raise ValueError(f"n_cells: expected an integer >= 0, got {n_cells!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    if costs is None:
        return [list(range(r, n_cells, world_size)) for r in range(world_size)]
    if len(costs) != n_cells:
        raise ValueError(f"costs: expected {n_cells} values (one per cell), got {len(costs)}")
    _check_costs(costs)
    load = [0.0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(n_cells), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += costs[i]
    return shares


def _check_costs(costs: Sequence[float], keys: Sequence[str] | None = None) -> None:
    for i, c in enumerate(costs):
        if not isinstance(c, (int, float)) or not c >= 0 or c == float("inf"):
            where = f"cell {keys[i]!r}" if keys else f"cell {i}"
            raise ValueError(f"costs: expected finite numbers >= 0, got {c!r} for {where}")


def fingerprint(arguments: Any) -> str:
    """A hash of the arguments that determine the rows (JSON with sorted keys; values JSON
    cannot hold are written with ``str``): cells stored under another fingerprint are not
    reused."""
    text = json.dumps(arguments, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def cell_store_path(out: str | Path) -> Path:
    """``results/x.csv`` -> ``results/x.csv.cells``: the folder of the finished cells."""
    out = Path(out)
    return out.with_name(out.name + ".cells")


def write_atomic(path: str | Path, write: Callable[[Path], Any]) -> None:
    """``write(temporary path)`` in ``path``'s folder, then rename onto ``path``: a reader
    sees the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(temporary)
        raise_if_interrupted()
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def add_arguments(parser) -> None:
    """``--keep-cells`` on an experiment's argparse parser (its value is ``keep_cells``)."""
    parser.add_argument("--keep-cells", action="store_true",
                        help="keep the cell store <out>.cells/ after the merged CSV is written "
                             "(default: removed)")


def _default_write_csv(frame: pd.DataFrame, path: Path) -> None:
    frame.to_csv(path, index=False, lineterminator="\n")


# --------------------------------------------------------------------------------------------
# the cell store


class _CellStore:
    """One pickle per finished cell: ``{"version", "key", "fingerprint", "seconds", "rows"}``."""

    def __init__(self, folder: Path, print_line: Callable[[str], None]):
        self.folder = folder
        self.print_line = print_line

    def path(self, key: str) -> Path:
        return self.folder / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".pkl")

    def save(self, key: str, print_fp: str, rows: pd.DataFrame, seconds: float) -> None:
        record = {"version": STORE_VERSION, "key": key, "fingerprint": print_fp,
                  "seconds": seconds, "rows": rows}
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        write_atomic(self.path(key), lambda p: p.write_bytes(data))

    def load_done(self, keys: Sequence[str], print_fp: str) -> dict[int, tuple]:
        """``{cell index: (rows, seconds)}`` of the cells complete under ``print_fp``; a file
        that cannot be read gets a one-line note, files of other arguments one note in all."""
        done, stale = {}, 0
        if not self.folder.is_dir():
            return done
        for i, key in enumerate(keys):
            path = self.path(key)
            if not path.is_file():
                continue
            try:
                record = pickle.loads(path.read_bytes())
                problem = _record_problem(record, key)
            except Exception as error:  # a truncated or foreign file: any unpickling error
                problem = f"{type(error).__name__}: {error}"
            if problem:
                self.print_line(f"note: {path}: not a readable cell file ({problem}); "
                                "computing the cell again")
            elif record["fingerprint"] != print_fp:
                stale += 1
            else:
                done[i] = (record["rows"], float(record["seconds"]))
        if stale:
            self.print_line(f"note: {stale} cell file(s) in {self.folder} were made with other "
                            "arguments; computing those cells again")
        return done

    def remove(self) -> None:
        if not self.folder.is_dir():
            return
        for path in self.folder.iterdir():
            if path.is_file() and (path.suffix in (".pkl", ".traceback", ".tmp")):
                path.unlink()
        try:
            self.folder.rmdir()
        except OSError:  # a file the sweep did not write stays, and so does its folder
            pass


def _record_problem(record, key: str) -> str | None:
    if not isinstance(record, dict) or record.get("version") != STORE_VERSION:
        return f"expected a version {STORE_VERSION} cell record"
    if record.get("key") != key:
        return f"holds the cell {record.get('key')!r}"
    if not isinstance(record.get("rows"), pd.DataFrame):
        return "no rows"
    if not isinstance(record.get("seconds"), (int, float)) or not isinstance(
            record.get("fingerprint"), str):
        return "no seconds or fingerprint"
    return None


# --------------------------------------------------------------------------------------------
# coordination between ranks


class _Coordination:
    """The process group and the c10d store of this process, made once and kept until exit
    (a second sweep in the same command reuses them under its own key prefix)."""

    store = None
    group = None  # gloo, for the objects gathered on rank 0
    sweeps = 0

    @classmethod
    def start(cls, ranks: Ranks, timeout: timedelta):
        if cls.store is None:
            if dist.is_initialized():  # the caller made the group
                # torch keeps the store of its default group; no public getter
                cls.store = dist.distributed_c10d._get_default_store()
            else:
                if ranks.device is not None:
                    torch.cuda.set_device(ranks.device)
                store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
                dist.init_process_group(ranks.backend, store=store, rank=ranks.rank,
                                        world_size=ranks.world_size, timeout=timeout)
                atexit.register(dist.destroy_process_group)
                cls.store = store
            backend = dist.get_backend()
            cls.group = None if backend == "gloo" else dist.new_group(backend="gloo")
        cls.sweeps += 1
        # torchrun's agent store outlives a restart of the workers: keys per run and attempt
        prefix = "/".join(["lowprec-sweep", os.environ.get("TORCHELASTIC_RUN_ID", ""),
                           os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), str(cls.sweeps)])
        return dist.PrefixStore(prefix + "/", cls.store), cls.group


class _Peers:
    """The failure flag and the finish count of one sweep; a plain process has no peers."""

    def __init__(self, store=None):
        self.store = store

    def failed(self) -> str | None:
        """The line of the rank that stopped the sweep, or None."""
        if self.store is None:
            return None
        try:
            if self.store.check(["failed"]):
                return self.store.get("failed").decode()
        except Exception as error:  # rank 0 hosts the store outside torchrun: it is gone
            return f"lost the c10d store ({type(error).__name__}: {error})"
        return None

    def fail(self, line: str) -> None:
        if self.store is not None:
            try:
                self.store.compare_set("failed", "", line)  # the first line wins
            except Exception:  # the store is gone: the others see that themselves
                pass

    def finish(self, world_size: int) -> str | None:
        """Count this rank finished and wait for the others: None when all have, else the
        line of the rank that stopped the sweep."""
        if self.store is None:
            return None
        try:
            self.store.add("finished", 1)
        except Exception as error:
            return f"lost the c10d store ({type(error).__name__}: {error})"
        pause = POLL_SECONDS[0]
        while True:
            if line := self.failed():
                return line
            try:
                if self.store.add("finished", 0) >= world_size:
                    return None
            except Exception as error:
                return f"lost the c10d store ({type(error).__name__}: {error})"
            time.sleep(pause)
            pause = min(2 * pause, POLL_SECONDS[1])


class _Terminated(KeyboardInterrupt):
    """SIGTERM (torchrun stops the other workers with it when one fails) read as Ctrl-C."""


def _raise_terminated(signum, frame):
    raise _Terminated()


# --------------------------------------------------------------------------------------------
# the sweep


@dataclass
class Sweep:
    """What `run_sweep` returns. ``frame``: the merged, sorted rows as written to the CSV, on
    the writing rank (rank 0 or the plain process); None on the other ranks, which have nothing
    more to do. ``record``: the sharding record written into the meta.json (on rank 0;
    this rank's part elsewhere)."""

    frame: pd.DataFrame | None
    record: dict = field(default_factory=dict)
    ranks: Ranks = field(default_factory=Ranks)

    @property
    def is_writer(self) -> bool:
        return self.frame is not None


def run_sweep(
    cells: Sequence[Any],
    run_cell: Callable[[Any], pd.DataFrame],
    *,
    out: str | Path,
    arguments: Any,
    key: Callable[[Any], str] = str,
    sort_by: Sequence[str] | None = None,
    cost: Callable[[Any], float] | None = None,
    write_csv: Callable[[pd.DataFrame, Path], Any] = _default_write_csv,
    meta: Mapping[str, Any] | None = None,
    write_meta: Callable[[Path, float, dict], Any] | None = None,
    keep_cells: bool = False,
    progress: float | None = 10.0,
    stream: TextIO | None = None,
    timeout: timedelta = timedelta(minutes=30),
) -> Sweep:
    """Run every cell once over this command's ranks and write the merged CSV at ``out``.

    cells        the grid, in the order its rows are concatenated before sorting
    run_cell     ``run_cell(cell) -> DataFrame``: the cell's complete rows (a cell that
                 returns is stored as done; one that raises stops the sweep)
    out          the merged CSV; the cell store is ``<out>.cells`` (`cell_store_path`)
    arguments    what determines the rows (a JSON-able config, without output paths): cells
                 stored under other arguments are computed again (`fingerprint`)
    key          ``key(cell) -> str``, unique per cell and stable across runs (default str)
    sort_by      columns of the final stable sort (None: cell order, rows as returned)
    cost         ``cost(cell) -> float``, relative run time: longest-first assignment instead
                 of round robin (`assign_cells`)
    write_csv    ``write_csv(frame, path)``: the experiment's own CSV writer (float format,
                 line ends), called on a temporary path that is then renamed onto ``out``
    meta         fields of the default meta.json: ``{**meta, "seconds", "sharding": record}``
    write_meta   ``write_meta(out, seconds, record)`` writes the meta.json instead (the
                 caller's layout); called on the writing rank after the CSV
    keep_cells   keep the cell store after the merge (default: removed)
    progress     seconds between a rank's progress lines (None: no progress lines)
    stream       where progress and notes go (default stderr)
    timeout      of the process group's collectives (rank 0 loading the store, the merge)

    Returns a `Sweep`; raises `SweepStopped` (a `SystemExit`, its line printed) when a cell
    raised on any rank or on Ctrl-C / SIGTERM, ValueError/TypeError for bad arguments, and
    OSError when the CSV or the meta.json cannot be written."""
    cells = list(cells) if not isinstance(cells, list) else cells
    if not cells:
        raise ValueError("cells: expected at least one cell, got none")
    if not callable(run_cell):
        raise TypeError(f"run_cell: expected a callable, got {type(run_cell).__name__}")
    keys = [key(c) for c in cells]
    for c, k in zip(cells, keys, strict=True):
        if not isinstance(k, str) or not k:
            raise TypeError(f"key: expected a non-empty str per cell, got {k!r} for {c!r}")
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key: expected one key per cell, got {twice!r} for several cells")
    if sort_by is not None and (isinstance(sort_by, str) or not all(
            isinstance(s, str) for s in sort_by)):
        raise TypeError(f"sort_by: expected a sequence of column names, got {sort_by!r}")
    if progress is not None and not progress >= 0:
        raise ValueError(f"progress: expected seconds >= 0 or None, got {progress!r}")
    costs = None
    if cost is not None:
        costs = [cost(c) for c in cells]
        _check_costs(costs, keys)
    out = Path(out)
    stream = sys.stderr if stream is None else stream
    print_fp = fingerprint(arguments)

    ranks = ranks_from_env()
    tag = f"rank {ranks.rank}: " if ranks.launched else ""

    def say(line: str) -> None:
        # one write per line: stderr is unbuffered, and print's separate "\n" lets another
        # rank's line land in the middle of this one
        stream.write(line + "\n")
        stream.flush()

    start = time.perf_counter()
    store = _CellStore(cell_store_path(out), say)
    peers, group = _Peers(), None
    done: dict[int, tuple] = {}
    mine: list[int] = []
    results: list[tuple[int, pd.DataFrame, float]] = []
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if ranks.launched:
            coordination, group = _Coordination.start(ranks, timeout)
            peers = _Peers(coordination)
            _check_same_grid(ranks, group, print_fp, keys)
        done, mine = _plan(ranks, group, store, keys, print_fp, costs, say)
        busy_start = time.perf_counter()
        _run_share(cells, keys, mine, costs, run_cell, store, print_fp, peers, results,
                   ranks.rank, tag, progress, say)
        stopped_by = peers.finish(ranks.world_size)
        busy = time.perf_counter() - busy_start
    except KeyboardInterrupt as error:
        what = "SIGTERM" if isinstance(error, _Terminated) else "Ctrl-C"
        peers.fail(f"rank {ranks.rank} stopped by {what}")
        if results or done:
            kept = f"kept in {store.folder}; the same command resumes"
        else:
            kept = "none finished, nothing kept; the same command starts over"
        say(f"{tag}{what} after {len(results)} of {len(mine)} cells ({kept})")
        raise SweepStopped(INTERRUPTED_STATUS) from None
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
    if stopped_by:
        say(f"{tag}stopping after {len(results)} of {len(mine)} cells ({stopped_by})")
        raise SweepStopped(FAILED_STATUS)

    part = {"rank": ranks.rank, "host": socket.gethostname(), "cells": len(results),
            "seconds": round(busy, 3), "cell_seconds": round(sum(r[2] for r in results), 3)}
    if ranks.launched:
        parts = [None] * ranks.world_size if ranks.rank == 0 else None
        dist.gather_object((part, results), parts, dst=0, group=group)
        if ranks.rank != 0:
            return Sweep(frame=None, record=part, ranks=ranks)
    else:
        parts = [(part, results)]

    frame = _merge(keys, done, [r for _, r in parts], sort_by)
    wall = time.perf_counter() - start
    record = _record(ranks, [p for p, _ in parts], len(cells), len(done), wall,
                     "longest-first" if costs is not None else "round-robin")
    write_atomic(out, lambda p: write_csv(frame, p))
    if write_meta is not None:
        write_meta(out, wall, record)
    else:
        document = {**(meta or {}), "seconds": round(wall, 2), "sharding": record}
        write_atomic(meta_path(out),
                     lambda p: p.write_text(json.dumps(document, indent=2, default=str) + "\n"))
    if ranks.launched:
        say(f"{len(cells) - len(done)} cells on {ranks.world_size} ranks in {wall:.1f} s; "
            f"the cells took {record['cell_seconds']:.1f} s: speedup {record['speedup']:.2f}x "
            "over one process (estimate: sum of cell times / wall time)")
    if not keep_cells:
        store.remove()
    return Sweep(frame=frame, record=record, ranks=ranks)


def _check_same_grid(ranks: Ranks, group, print_fp: str, keys: list[str]) -> None:
    """Every rank must mean the same grid, or the merge would mix two runs."""
    prints = [None] * ranks.world_size
    dist.all_gather_object(prints, (print_fp, fingerprint(keys)), group=group)
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if differ:
        what = "arguments" if prints[differ[0]][0] != prints[0][0] else "cell keys"
        raise ValueError(f"{what}: rank {differ[0]} has other {what} than rank 0 (leave "
                         "per-rank values, such as the device cuda:LOCAL_RANK, out of "
                         "arguments)")


def _plan(ranks: Ranks, group, store: _CellStore, keys: list[str], print_fp: str,
          costs: list[float] | None, say) -> tuple[dict[int, tuple], list[int]]:
    """Rank 0 reads the store (``{index: (rows, seconds)}``, empty elsewhere) and tells every
    rank which cells are done; the rest are assigned (`assign_cells`): this rank's share."""
    done = store.load_done(keys, print_fp) if ranks.rank == 0 else {}
    box = [sorted(done)]
    if ranks.launched:
        dist.broadcast_object_list(box, src=0, group=group)
    if box[0] and ranks.rank == 0:
        say(f"resuming: skipping {len(box[0])} of {len(keys)} cells already in {store.folder}")
    skipped = set(box[0])
    todo = [i for i in range(len(keys)) if i not in skipped]
    shares = assign_cells(len(todo), ranks.world_size,
                          None if costs is None else [costs[i] for i in todo])
    return done, [todo[j] for j in shares[ranks.rank]]


def _merge(keys: list[str], done: dict[int, tuple], ran: list[list[tuple]],
           sort_by: Sequence[str] | None) -> pd.DataFrame:
    """Every cell's rows in cell order, then the stable sort: the same frame whichever rank
    ran a cell and whether it came from the store."""
    frames: list[pd.DataFrame | None] = [None] * len(keys)
    for i, (rows, _) in done.items():
        frames[i] = rows
    for rank_results in ran:
        for i, rows, _ in rank_results:
            frames[i] = rows
    missing = [keys[i] for i, f in enumerate(frames) if f is None]
    if missing:  # a bug in the engine, not a user error: no rank ran these cells
        raise RuntimeError(f"no rows for the cells {missing[:3]} ({len(missing)} in all)")
    frame = pd.concat(frames, ignore_index=True)
    if sort_by is None:
        return frame
    absent = [c for c in sort_by if c not in frame.columns]
    if absent:
        raise ValueError(f"sort_by: columns {absent} are not in the rows "
                         f"(columns {list(frame.columns)})")
    return frame.sort_values(list(sort_by), kind="mergesort", ignore_index=True)


def _run_share(cells, keys, mine, costs, run_cell, store, print_fp, peers, results, rank,
               tag, progress, say) -> None:
    """Run this rank's cells in order, each stored when done; stop between cells when another
    rank failed (`_Peers.finish` reports it)."""
    begun = time.perf_counter()
    last_line = begun
    total_cost = sum(costs[i] for i in mine) if costs is not None else len(mine)
    done_cost = 0.0
    for n, i in enumerate(mine, start=1):
        if peers.failed():
            return
        cell_start = time.perf_counter()
        try:
            rows = run_cell(cells[i])
            if not isinstance(rows, pd.DataFrame):
                raise TypeError(f"run_cell: expected a pandas DataFrame, got "
                                f"{type(rows).__name__}")
            seconds = time.perf_counter() - cell_start
            store.save(keys[i], print_fp, rows, seconds)
        except Exception as error:  # the cell's own error, or the store's (a full disk)
            _report_failure(store, rank, tag, keys[i], error, peers, say)
            raise SweepStopped(FAILED_STATUS) from None
        results.append((i, rows, seconds))
        done_cost += costs[i] if costs is not None else 1
        now = time.perf_counter()
        if progress is not None and (now - last_line >= progress or n == len(mine)):
            last_line = now
            left = (now - begun) * (total_cost - done_cost) / done_cost if done_cost else 0.0
            tail = f"in {_duration(now - begun)}" if n == len(mine) else \
                f"~{_duration(left)} left"
            say(f"{tag}{n}/{len(mine)} cells, {tail}")


def _report_failure(store: _CellStore, rank: int, tag: str, cell_key: str,
                    error: BaseException, peers: _Peers, say) -> None:
    """One line naming the cell and the error; the traceback in the store's folder."""
    message = " ".join(str(error).split()) or "(no message)"
    where = store.folder / f"rank{rank}.traceback"
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text("".join(traceback.format_exception(error)))
        hint = f" (traceback in {where})"
    except OSError:
        hint = ""
    peers.fail(f"rank {rank} failed on cell {cell_key!r}")
    say(f"{tag}cell {cell_key!r} failed: {type(error).__name__}: {message}{hint}")


def _record(ranks: Ranks, parts: list[dict], n_cells: int, n_done: int, wall: float,
            assignment: str) -> dict:
    cell_seconds = sum(p["cell_seconds"] for p in parts)
    return {
        "world_size": ranks.world_size,
        "backend": dist.get_backend() if ranks.launched else "none",
        "assignment": assignment,
        "cells": n_cells,
        "cells_from_store": n_done,
        "ranks": sorted(parts, key=lambda p: p["rank"]),
        "cell_seconds": round(cell_seconds, 3),
        "wall_seconds": round(wall, 3),
        "speedup": round(cell_seconds / wall, 3) if wall > 0 else None,
        "speedup_estimate": "sum of the cell times of this run / its wall time",
    }


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
