"""Time one kernel default at several values: kernel_bench once a value, in this process, with
the module's default set to it (restored afterwards), then `tools.compare_bench` of each run
against the first value's. Each run measures its own copy ceiling; compare the runs of one
invocation only."""

from __future__ import annotations

import argparse
from pathlib import Path

SET_BY_THE_TOOL = ("--shapes", "--kernels", "--out")


def parser_and_bench_args(prog: str, description: str, argv: list[str]):
    """(the tool's parser, its own arguments, kernel_bench's extra arguments): the arguments
    after -- go to every kernel_bench run. Call `check_bench_args` after parsing."""
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog=prog, description=description,
        epilog="Arguments after -- go to every kernel_bench run (e.g. --batches 1,256 "
               "--windows 16).")
    return parser, own, extra


def check_bench_args(parser, extra: list[str], set_by_the_tool=SET_BY_THE_TOOL) -> None:
    """A usage error for a kernel_bench argument the tool sets itself (`set_by_the_tool`)."""
    for flag in set_by_the_tool:
        if flag in extra:
            parser.error(f"{flag} is set by the tool; pass kernel_bench's other arguments")


def sweep_default(module, attr: str, values: list, bench_args: list[str], out_dir: Path,
                  csv_name, extra: list[str], describe) -> int:
    """kernel_bench `bench_args` + ``--out out_dir/csv_name(value)`` + `extra` for each value
    with ``module.attr = value``; prints ``describe(value)`` before each run. Returns the first
    failing run's status, else 0 after the comparisons."""
    from experiments import kernel_bench
    from tools import compare_bench

    out_dir.mkdir(parents=True, exist_ok=True)
    default = getattr(module, attr)
    try:
        for value in values:
            setattr(module, attr, value)
            print(f"== {describe(value)}", flush=True)
            status = kernel_bench.main(bench_args + ["--out", str(out_dir / csv_name(value))]
                                       + extra)
            if status:
                return status
    finally:
        setattr(module, attr, default)
    first = out_dir / csv_name(values[0])
    for value in values[1:]:
        print(f"== {describe(value)} against {describe(values[0])}")
        compare_bench.main([str(first), str(out_dir / csv_name(value))])
    return 0
