"""Error growth against decode length: how each precision policy's output error evolves.

The kit's main figure. A batch of sequences is decoded token by token twice from the same
inputs: once exactly (FP64, nothing rounded) and once under each precision policy of
`lowprec.policies` (one `Simulator` per arm, all advanced in the same step loop). At every
recorded step the error of the layer output of one sequence is

    rel_err_t = ||y_hat_t - y_t||_2 / ||y_t||_2        norms over heads and d_v

Arms (``--arms``; the grammar, with the CSV's ``arm`` column holding the canonical form):

    every_step:<format>[:<rounding>]      conventional: the state is stored in the format
                                          every token (rounding rn or sr)
    shared:<format>[:<rounding>]          one checkpoint in the format, rounded once per
                                          window of L tokens, read by the window's steps and by
                                          the next flush
    separate:<hi format>[:<rounding>]:<read format>
                                          two copies written at each flush: the recurrence
                                          copy in <hi format> with <rounding> (default rn),
                                          the read copy in <read format>, always RN; e.g.
                                          separate:fp16:sr:nvfp4, separate:bf16:sr:nvfp4,
                                          separate:fp8_e4m3:sr:nvfp4, separate:fp64:nvfp4
    separate_exact:<read format>          alias of separate:fp64:rn:<read format>
    separate_fp16sr:<read format>         alias of separate:fp16:sr:<read format>: the kit's
                                          two-precision scheme

A missing format expands over ``--formats`` and a missing rounding of every_step and shared
over ``--rounding``. The CSV spells each arm out: ``arm`` (canonical, ``separate:fp16:sr:nvfp4``),
``hi_format``/``hi_rounding`` (the recurrence copy; the stored state for every_step and shared)
and ``lo_format``/``lo_rounding`` (the copy the window's steps read; the same for every_step
and shared). Windows are L tokens long (``--window`` takes a list: one run, a ``window``
column); step ``t`` (counting from 1) is a flush step when ``t % L == 0``, and a flush step's
output reads the unrounded new state. So before the first flush the windowed arms are exact,
and at every flush step separate:fp64 is exact again: its error lives on the L - 1 other steps.

Inputs, per sequence (seed) and head, a fresh draw every step, seeded by a `torch.Generator`
per seed (so a seed's inputs do not depend on the other seeds or on ``--steps``):

    v ~ N(0, I_dv)   (Mamba-2's dt * x)     k ~ N(0, I_dk)  (B)     q ~ N(0, I_dk)  (C)
    a ~ U[lo, hi)    per head (Mamba-2, GDN) or per head and channel of d_k (KDA)
    beta ~ U[0, 1)   GDN and KDA only, whose k and q are scaled to unit norm (as those models
                     L2-normalise them, which keeps the delta rule a contraction)

``--memory`` names the decay range: ``long`` = [0.9995, 0.99999), ``short`` = [0.9, 0.95),
or ``LO,HI``. All memory profiles share the Gaussian draws and the uniform behind ``a``, so
their curves differ only by the decay. Memories and seeds form the simulator's batch
(slot = memory index * seeds + seed index); SR words are Philox words keyed by ``--seed0`` and
indexed by that slot, the write counter and the element (``lowprec/README.md``).

Recording. ``--log-grid 0`` records every step. ``--log-grid G`` records every step of about
G windows spaced geometrically over the run, plus the windows that hold steps 64, 1,024, 4,096
and the last step: whole windows, because the error of a windowed arm is a sawtooth over the
window (zero at separate_exact's flush steps, which all powers of two >= L are), and a step
sampled at one phase would misreport it. The plot and the summary therefore use the *window
mean* of rel_err (over the L steps of the window holding a step), median over seeds.

Backends (``--backend``; the exact run is the FP64 ``Simulator`` on ``--device`` for both, and
the CSV has the same rows and columns for both):

    reference   ``lowprec.policies.Simulator`` in FP64, every recurrence (the default); needs
                neither Triton nor CuTe DSL
    emulation   the Triton kernels of ``emulation/`` (fp32 containers holding values of the
                format; Mamba-2 only), on a GPU compiled, on a CPU under TRITON_INTERPRET=1
                (about 0.15 s per arm and step at the test size: tiny runs only); imported
                only for this backend

The emulation runs the generic step through the Mamba-2 kernel arguments exactly
(``mamba2_kernel_inputs``): per head ``A = -1`` and the processed ``dt = -log(a)``
(``dt_softplus=False``, no ``dt_bias``), so ``exp(dt A) = a``; ``x = v / dt``, so ``dt x = v``;
``B = k`` and ``C = q`` with ``ngroups = nheads``; ``D`` and ``z`` absent; all fp32. Its slots
are the simulator's batch in the same order and the Philox seed is ``--seed0``, so SR draws
the same words as the reference. Arms: every_step is ``emulation.state_update`` with the
format and rounding, the output reading the stored state (as the reference defines the arm);
the other arms are ``emulation.replay_decode`` with window L and the arm's recurrence and read
copies; a recurrence copy in fp64 (separate:fp64) is kept in fp32 (the kernels' exact copy),
so its flush steps carry an fp32 error (about 1e-7) instead of 0; shared keeps hi = lo = the
format, which is the shared policy only for element formats with RN (the kernels' read copy
is always RN and the recurrence copy holds no block scales). fp64 is not a kernel format.
Otherwise the two backends differ by fp32 arithmetic only, which at times flips an FP16
rounding (tests/test_error_growth.py compares the two CSVs).

The grid. A run is a list of independent cells (``cells(config)``), one per (window, arm) in
that order; ``run_cell(config, cell)`` returns the cell's rows (every memory profile and seed:
they are the simulator's batch, whose slot numbers key the SR words), computed from the
cell's own inputs and the exact outputs (``exact_outputs``, computed once per window and
process). ``run`` writes the cells' rows in cell order, so rows computed apart (another
process, another rank) and concatenated in that order give the same bytes.

Outputs: a tidy CSV, one row per (window, arm, memory, seed, step), columns exactly
``CSV_COLUMNS``, floats written ``%.6e`` so a rerun reproduces the file byte for byte; a
sidecar ``<csv stem>.meta.json`` (command, commit, seconds, versions, config, the CSV's row
count and sha256); a PNG read back from the CSV only (``plot``); a summary table printed to
stdout (``summarize``). Every file is written under a temporary name and renamed when
complete. Where they go:

    --preset NAME alone          results/error_growth_NAME.{csv,meta.json,png}: the preset's
                                 regenerate command, the only run that replaces committed files
    --out PATH.csv               PATH.csv, PATH.meta.json and PATH.png, whatever the current
                                 folder (--plot elsewhere or none)
    anything else                runs/error_growth_<preset or custom>_<flags>/error_growth.*
                                 (git-ignored), named by the flags given

A file at an output path that is not this experiment's own (another header, another meta,
another PNG) is not replaced without ``--force``. A run stopped by Ctrl-C or SIGTERM writes
the whole windows done to ``<stem>.partial.csv`` (and its meta), never to the final name,
and exits with status 130. ``--replot`` refuses, in one line naming the file and the line, a
CSV that differs from what its meta.json recorded, is cut short, has other columns, a value of
the wrong type, a negative error, a step off the recorded grid, or a row twice.

    python -m experiments.error_growth --preset toy                    # ~10 s, 2-core CPU
    python -m experiments.error_growth --preset default               # ~6 min on a 2-core CPU
    python -m experiments.error_growth --preset default --replot       # redraw from the CSV
    python -m experiments.error_growth --preset default --replot --plot none --at 112,192
                                                  # the summary at the windows of other steps
    python -m experiments.error_growth --preset toy --window 8,16,32 \
        --arms separate:bf16:sr:fp8_e4m3_row,separate:fp8_e4m3:sr:fp8_e4m3_row
                                                  # writes under runs/
    python -m experiments.error_growth --help
    python -m experiments.error_growth --backend emulation --device cuda --dv 64 --dk 128 \
        --heads 128 --seeds 2 --steps 131072 --log-grid 48 \
        --arms separate_fp16sr:nvfp4,every_step:fp16:rn --memory long \
        --out results/error_growth_emulation_gpu.csv --plot results/error_growth_emulation_gpu.png
                                                  # on a GPU (scripts/gpu.sh error-growth)

The default preset (Nemotron-3-Super head shape, 2 heads x 2 seeds, 16,384 steps, 16 arms)
took 348 s on a 2-core CPU (its meta.json). Its every_step arms are RN: SR at every token
would draw one Philox word per state element per step (about 1.5 hours at this size); the toy
preset is where RN and SR of the conventional state are compared.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m experiments.error_growth")

import dataclasses
import shlex
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from experiments._common import meta_path, output_problem, write_meta
from experiments._interrupt import (
    INTERRUPTED_STATUS,
    ctrl_c_as_keyboard_interrupt,
    report_interrupt,
)
from experiments.error_growth_backends import (  # noqa: F401 (the experiment's public names)
    _EXACT_CACHE,
    INPUT_CHUNK,
    _cpu_threads,
    _Inputs,
    exact_outputs,
    make_inputs,
    mamba2_kernel_inputs,
    run_cell,
)
from experiments.error_growth_cli import (  # noqa: F401
    BASE_DEFAULTS,
    PRESETS,
    build_parser,
    config_from_args,
    default_out,
    parse_steps,
)
from experiments.error_growth_config import (  # noqa: F401
    ALIASES,
    ARMS,
    BACKENDS,
    MAX_EMULATION_STEPS,
    MAX_STEPS,
    MEMORY_PROFILES,
    PROG,
    RECURRENCES,
    ROUNDINGS,
    SCHEMES,
    SOURCE,
    SUMMARY_STEPS,
    ArmSpec,
    Cell,
    Config,
    Memory,
    _emulation_without_sr_settings,
    cells,
    parse_arm,
    parse_arms,
    parse_memory,
    recorded_steps,
    sr_settings,
)
from experiments.error_growth_table import (  # noqa: F401
    CSV_COLUMNS,
    DECADES,
    EVERY_MANTISSA,
    FLOAT_FORMAT,
    KEYS,
    ONE_TWO_FIVE,
    SCHEMA,
    SERIES,
    growth_table,
    log_subs,
    read_csv,
    read_table,
    sr_table,
    student_t_quantile,
    summaries,
    summarize,
    window_means,
    write_csv,
)

__all__ = [
    "ARMS",
    "BACKENDS",
    "CSV_COLUMNS",
    "MEMORY_PROFILES",
    "PRESETS",
    "SCHEMA",
    "ArmSpec",
    "Cell",
    "Config",
    "Memory",
    "cells",
    "config_from_args",
    "exact_outputs",
    "main",
    "make_inputs",
    "mamba2_kernel_inputs",
    "merge_cells",
    "parse_arm",
    "parse_arms",
    "parse_memory",
    "plot",
    "read_csv",
    "recorded_steps",
    "run",
    "run_cell",
    "summarize",
    "window_means",
]

STOPPED_STATUS = INTERRUPTED_STATUS  # a run stopped by SIGINT or SIGTERM (its windows kept)


def merge_cells(config: Config, frames: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """The run's rows from the frames of its cells (``{cell.index: run_cell(...)}``, computed
    anywhere): concatenated in cell order, so the CSV is the same bytes as one process's."""
    order = [cell.index for cell in cells(config) if cell.index in frames]
    if not order:
        return pd.DataFrame(columns=list(CSV_COLUMNS))
    return pd.concat([frames[i] for i in order], ignore_index=True)


def sweep_arguments(config: Config) -> dict:
    """What determines the rows, for the cell store's fingerprint: the config without its
    output paths and without the device's number (``cuda:LOCAL_RANK`` differs per rank)."""
    settings = config_settings(config)
    settings["device"] = torch.device(config.device).type
    return settings


def run(config: Config, command: str | None = None, *, keep_cells: bool = False
        ) -> pd.DataFrame:
    """Run every cell of ``config`` through `experiments.sharding.run_sweep` (in this process,
    or split over the ranks under ``torchrun``), write the CSV to ``config.out`` and then its
    meta.json (``command`` the command line; from Python, a note saying so), and return the
    rows on the writing rank (None elsewhere). A rerun with the same ``out`` and config skips
    the cells finished before (kept in ``<out>.cells/`` until the CSV is written, or for good
    with ``keep_cells``). A plain process stopped by Ctrl-C or SIGTERM writes the finished
    cells and the whole windows of the cell in flight to ``partial_path(config.out)``.
    ``attrs`` of the frame: ``complete``, ``cells_done``, ``written``, ``status``."""
    from experiments.sharding import (
        SweepStopped,
        _CellStore,
        cell_store_path,
        fingerprint,
        ranks_from_env,
        run_sweep,
    )

    c = config
    start = time.perf_counter()
    grid = cells(c)
    ranks = ranks_from_env()
    batch = len(c.memory) * c.seeds
    command = command or f"{PROG} (run() called from Python)"
    bar = tqdm(
        total=c.steps * (len(grid) + len(c.window)),
        desc=f"error_growth {c.recurrence} {c.backend} ({len(grid)} cells x {batch} seqs)",
        unit="step",
        file=sys.stderr,
        disable=not c.progress or ranks.launched,  # under torchrun: the engine's lines
        mininterval=0.5,
    )
    in_flight: dict[int, pd.DataFrame] = {}
    arguments = sweep_arguments(c)

    def one_cell(cell: Cell) -> pd.DataFrame:
        return run_cell(c, cell, bar=bar,
                        on_stop=lambda frame: in_flight.__setitem__(cell.index, frame))

    def meta(out: Path, seconds: float, record: dict) -> None:
        write_meta(out, command, seconds, config_settings(c), device=c.device,
                   extra={"experiment": SOURCE, "status": "complete", "sharding": record})

    try:
        with bar:
            sweep = run_sweep(grid, one_cell, out=c.out, arguments=arguments,
                              key=lambda cell: cell.key, write_csv=write_csv, write_meta=meta,
                              keep_cells=keep_cells, progress=10.0 if c.progress else None)
    except SweepStopped as stopped:
        if ranks.launched or stopped.code != STOPPED_STATUS:
            raise
        finished = _CellStore(cell_store_path(c.out), lambda line: None).load_done(
            [cell.key for cell in grid], fingerprint(arguments))
        frames = {i: rows for i, (rows, _) in finished.items()}
        for index, frame in in_flight.items():
            if len(frame):
                frames[index] = frame
        frame = merge_cells(c, frames)
        written = partial_path(c.out)
        write_csv(frame, written)
        kept = (f"kept in {cell_store_path(c.out)}: the same command resumes" if finished
                else "none finished: the same command starts over")
        status = f"stopped after {len(finished)} of {len(grid)} cells ({kept})"
        if in_flight:
            status += f" and step {max(f.attrs['steps_done'] for f in in_flight.values())} of " \
                      "the next"
        write_meta(written, command, time.perf_counter() - start, config_settings(c),
                   device=c.device, extra={"experiment": SOURCE, "status": status})
        frame.attrs.update(complete=False, cells_done=len(finished), written=str(written),
                           status=status)
        return frame
    if not sweep.is_writer:
        return None
    frame = sweep.frame
    frame.attrs.update(complete=True, cells_done=len(grid), written=str(c.out),
                       status="complete", sharding=sweep.record)
    return frame


def partial_path(out: str | Path) -> Path:
    """Where a stopped run's rows go: ``x.csv`` -> ``x.partial.csv``."""
    out = Path(out)
    return out.with_name(out.stem + ".partial.csv")



def plot(csv_path: str | Path, png_path: str | Path) -> None:
    """The figure of ``csv_path`` at ``png_path`` (`experiments.error_growth_plot.plot`),
    from the CSV alone."""
    from experiments.error_growth_plot import plot as draw

    draw(csv_path, png_path)




# --------------------------------------------------------------------------------------------
# entry point


def config_settings(config: Config) -> dict:
    """The config as its meta.json records it (``read_csv`` reads steps, window and log_grid
    back): arms by their canonical labels, memory profiles with their bounds."""
    c = config
    return {
        "recurrence": c.recurrence, "dv": c.dv, "dk": c.dk, "heads": c.heads,
        "seeds": c.seeds, "seed0": c.seed0, "steps": c.steps, "window": list(c.window),
        "memory": [{"name": m.name, "low": m.low, "high": m.high} for m in c.memory],
        "arms": [a.label for a in c.arms], "log_grid": c.log_grid, "device": c.device,
        "threads": c.threads, "backend": c.backend, "sr_bits": list(c.sr_bits),
        "philox_rounds": list(c.philox_rounds), "cells": len(cells(c)),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, argv)
        at = None if args.at is None else parse_steps(args.at)
    except ValueError as error:
        parser.error(str(error))
    if at is not None and not args.replot and max(at) > config.steps:
        parser.error(f"--at: step {max(at)} is past --steps {config.steps}")
    if args.replot:
        try:
            frame = read_csv(config.out)
        except (OSError, ValueError) as error:
            parser.error(f"--replot: {error}")
    else:
        from experiments.sharding import SweepStopped, is_main_rank, local_device

        # under torchrun each rank on its own GPU (the CSV records the device's kind only)
        config = dataclasses.replace(config, device=local_device(config.device))
        for window in config.window if is_main_rank() else ():
            if window > config.steps:
                print(f"note: --window {window} is longer than --steps {config.steps}: no "
                      "flush happens (the windowed arms never round a checkpoint) and the plot "
                      "and summary average over one partial window", file=sys.stderr)
            elif config.steps % window:
                whole = config.steps - config.steps % window
                print(f"note: --steps {config.steps} is not a multiple of --window {window}: "
                      f"the CSV keeps steps {whole + 1}-{config.steps}, but the plot and "
                      f"summary end at step {whole}, the last whole window", file=sys.stderr)
        start = time.perf_counter()
        try:
            with ctrl_c_as_keyboard_interrupt():  # the sweep keeps its windows on Ctrl-C
                frame = run(config, " ".join([PROG, *map(shlex.quote, argv)]),
                            keep_cells=args.keep_cells)
        except KeyboardInterrupt:  # outside the sweep's cells: nothing to keep
            return report_interrupt(PROG)
        except OSError as error:  # the CSV is written at the end of the run
            parser.error(f"cannot write {config.out}: {error}")
        except SweepStopped as stopped:  # a cell failed, or a rank under torchrun stopped
            return stopped.code
        if frame is None:  # a rank other than 0: rank 0 writes, plots and summarises
            return 0
        seconds = time.perf_counter() - start
        stopped = not frame.attrs["complete"]
        written, status = frame.attrs["written"], frame.attrs["status"]
        if stopped:
            print(f"{PROG}: {status}: wrote the whole windows done to {written} "
                  f"({len(frame)} rows); {config.out} is unchanged", file=sys.stderr)
            return STOPPED_STATUS
        for stale in (partial_path(config.out), meta_path(partial_path(config.out))):
            if stale.is_file() and not output_problem(stale, SOURCE, SCHEMA.header):
                stale.unlink()  # a finished run supersedes its stopped attempt
        print(f"wrote {config.out} and its .meta.json ({len(frame)} rows) in {seconds:.1f} s",
              file=sys.stderr)
    last = int(window_means(frame)["last_step"].max())
    if at is not None and (past := [t for t in at if t > last]):  # before the plot is drawn
        parser.error(f"--at: step {past[0]} is past the last whole window of {config.out} "
                     f"(step {last})")
    if config.plot:
        try:
            plot(config.out, config.plot)
        except OSError as error:
            parser.error(f"cannot write {config.plot}: {error}")
        print(f"wrote {config.plot}", file=sys.stderr)
    print(summaries(frame, at))
    return 0


if __name__ == "__main__":
    sys.exit(main())
