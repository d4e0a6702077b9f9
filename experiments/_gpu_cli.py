"""The command-line pieces the GPU diagnostics share (`copy_sizes`, `tail_overlap`,
`warm_transient`): one benchmark point's flags, `--plot-only`, the output checks, reading a
CSV back checked, and writing a run's CSV, meta file, summary and plot (`experiments.harness`).
Each script keeps its own flags, measurement, summary and plot."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from experiments import harness
from experiments._common import default_out, file_problem
from experiments.cases import SHAPES

__all__ = ["add_point_arguments", "add_output_arguments", "check_point", "check_outputs",
           "read_csv", "plot_only", "save_run"]


def add_point_arguments(p: argparse.ArgumentParser) -> None:
    """--shape, --batch, --window, --cursor: one non-flush point of kernel_bench's grid
    (default the headline point, Nemotron-3-Super, batch 256, L = 16, cursor 8)."""
    p.add_argument("--shape", default="nemotron3-super", choices=sorted(SHAPES),
                   help="layer shape (default nemotron3-super)")
    p.add_argument("--batch", type=int, default=256, help="slots (default 256)")
    p.add_argument("--window", type=int, default=16, help="L (default 16)")
    p.add_argument("--cursor", type=int, default=8,
                   help="records in the ring before the step (default 8, the window's middle)")


def add_output_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """--run-label, --out (default `out`), --plot and --plot-only."""
    p.add_argument("--run-label", default="A", help="the run column (default A)")
    p.add_argument("--out", default=None,
                   help=f"CSV to write (default {out} for the default settings, the command that "
                   "regenerates it; runs/<script>_<settings>/ otherwise)")
    p.set_defaults(committed_out=out)
    p.add_argument("--plot", default=None,
                   help="PNG to draw (default: the CSV's name with .png; 'none': no plot)")
    p.add_argument("--plot-only", metavar="CSV", help="only plot and summarise this CSV")


def resolve_out(parser: argparse.ArgumentParser, args, script: str) -> str:
    """--out as given, else the committed CSV for the default settings and a runs/ folder for
    any other (`_common.default_out`)."""
    if args.out is None:
        args.out = str(default_out(parser, args, script, args.committed_out))
    return args.out


def read_csv(csv, columns: dict[str, str], script: str, key: list[str] | None = None,
             optional: dict[str, str] | None = None):
    """`csv` checked (`harness.read_table`: `columns` name -> type, one row per `key`); a
    ValueError in one line naming the file (and the row) if it is not a `script` CSV."""
    return harness.read_table(csv, columns, key, optional, what=f"{script} CSV")


def check_point(parser: argparse.ArgumentParser, args, **more_minimums: tuple[int, int]) -> None:
    """One parser error for a point flag (or a `more_minimums` flag: name=(value, least)) out
    of range, or a cursor past L - 2 (a non-flush step's last)."""
    minimums = {"--batch": (args.batch, 1), "--window": (args.window, 2),
                "--cursor": (args.cursor, 0)}
    minimums.update({"--" + k.replace("_", "-"): v for k, v in more_minimums.items()})
    for flag, (value, least) in minimums.items():
        if value < least:
            parser.error(f"{flag}: expected an int >= {least}, got {value}")
    if args.cursor > args.window - 2:
        parser.error(f"--cursor: a non-flush step's cursor is at most L - 2 = "
                     f"{args.window - 2}, got {args.cursor}")


def check_outputs(parser: argparse.ArgumentParser, out: str, png: str, what: str) -> None:
    """One parser error if --out or --plot (unless 'none') cannot be written, or, before any
    GPU work, if there is no GPU (`what`: what the script times)."""
    for flag, path in (("--out", out), ("--plot", None if png == "none" else png)):
        problem = path is not None and file_problem(path)
        if problem:
            parser.error(f"{flag}: {problem}")
    if not torch.cuda.is_available():
        parser.error(f"needs a CUDA GPU (this times {what}); --plot-only CSV works anywhere")


def plot_only(parser: argparse.ArgumentParser, csv: str, png: str, summarize, plot) -> int:
    """--plot-only CSV: print `summarize(csv)` and draw `plot(csv, png)` (unless png is
    'none'); a missing file, or a CSV the script does not read, is one parser error."""
    if not Path(csv).is_file():
        parser.error(f"--plot-only: no file {csv}")
    try:
        print(summarize(csv))
        if png != "none":
            plot(csv, png)
    except (ValueError, KeyError) as error:
        parser.error(f"--plot-only: {error}")
    return 0


def save_run(df, out: str, png: str, module: str, argv, seconds: float, config: dict,
             summarize, plot) -> None:
    """Write a run's tidy CSV and its meta file (the command as typed, `config` with the
    versions and the GPU's identity), then print its summary and draw its plot from the CSV."""
    harness.write_csv(df, out, float_format="%.6g")
    harness.write_run_meta(out, module, argv, seconds, config)
    print(summarize(out))
    if png != "none":
        plot(out, png)
        print(f"wrote {out} and {png}")
    else:
        print(f"wrote {out}")
