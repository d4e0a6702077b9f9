"""Time the working tree's kernels against a commit's on one GPU: kernel_bench in each tree in
turn, alternating, then `tools.compare_bench` of every run against the commit's first.

    python -m tools.compare_trees REV [--repeats 2] [--out-dir DIR] -- KERNEL_BENCH_ARGS

REV's code (`git archive REV` of its code folders: lowprec, emulation, cute_kernels,
experiments, tools) is unpacked into a temporary folder; each run is its own process
(`python -m experiments.kernel_bench KERNEL_BENCH_ARGS --out DIR/NAME.csv --plot-dir none`)
with that tree first on PYTHONPATH, in the order REV, work, REV, work, ... (`--repeats`
pairs). The comparisons: each working-tree run against REV's first run, and REV's later runs
against its first (the run-to-run noise of this machine). Each run measures its own copy
ceiling; compare the runs of one invocation only. Needs git and a CUDA GPU (kernel_bench's);
`--dry-run` prints the commands. The arguments after -- go to every run, e.g. --shapes
qwen3-next-80b --batches 1,256 --windows 16 --peers none --kernels cute:flush:fp32.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C from the first import on: one line, status 130
    from experiments._interrupt import exit_on_interrupt

    exit_on_interrupt("python -m tools.compare_trees")

import io
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CODE_FOLDERS = ("lowprec", "emulation", "cute_kernels", "experiments", "tools")
ROOT = Path(__file__).resolve().parent.parent
SET_BY_THE_TOOL = ("--out", "--plot-dir")


def resolve(rev: str) -> str:
    """REV's full commit hash; a SystemExit naming REV where git does not know it."""
    done = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compare_trees: {rev!r} is not a commit of this repository")
    return done.stdout.strip()


def unpack(commit: str, dest: Path) -> Path:
    """REV's code folders (those it has of CODE_FOLDERS) under `dest`; returns `dest`."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", commit], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    folders = [name for name in CODE_FOLDERS if name in listed]
    archive = subprocess.run(["git", "archive", "--format=tar", commit, *folders], cwd=ROOT,
                             capture_output=True, check=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def plan(rev_tree: Path, repeats: int, out_dir: Path, bench_args: list[str]
         ) -> list[tuple[str, Path, list[str]]]:
    """(run name, the tree first on PYTHONPATH, the command) in the order they run."""
    runs = []
    for i in range(1, repeats + 1):
        for name, tree in ((f"rev_{i}", rev_tree), (f"work_{i}", ROOT)):
            runs.append((name, tree, [sys.executable, "-m", "experiments.kernel_bench",
                                      *bench_args, "--out", str(out_dir / f"{name}.csv"),
                                      "--plot-dir", "none"]))
    return runs


def comparisons(repeats: int) -> list[tuple[str, str]]:
    """(reference run, compared run): every working-tree run and REV's later runs against
    REV's first."""
    pairs = [("rev_1", f"work_{i}") for i in range(1, repeats + 1)]
    return pairs + [("rev_1", f"rev_{i}") for i in range(2, repeats + 1)]


def main(argv: list[str] | None = None) -> int:
    from tools import compare_bench
    from tools._default_sweep import check_bench_args, parser_and_bench_args

    argv = sys.argv[1:] if argv is None else argv
    parser, own, extra = parser_and_bench_args("python -m tools.compare_trees",
                                               __doc__.split("\n\n")[0], argv)
    parser.add_argument("rev", help="the commit to time against (any git revision)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="(REV, working tree) pairs of runs, alternating (default 2)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/compare_trees"),
                        help="folder for rev_N.csv and work_N.csv (default runs/compare_trees)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(own)
    check_bench_args(parser, extra, SET_BY_THE_TOOL)
    if not 1 <= args.repeats <= 10:
        parser.error(f"--repeats: expected 1 to 10, got {args.repeats}")
    commit = resolve(args.rev)
    out_dir = args.out_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="compare_trees_") as tmp:
        rev_tree = Path(tmp) / commit[:12]
        runs = plan(rev_tree, args.repeats, out_dir, extra)
        print(f"== {args.rev} ({commit[:12]}) against the working tree, {args.repeats} pairs")
        if args.dry_run:
            for name, tree, command in runs:
                print(f"{name}: PYTHONPATH={tree} {shlex.join(command)}")
            return 0
        unpack(commit, rev_tree)
        if (ROOT / ".peers").is_dir():  # kernel_bench looks for the peers beside the code
            (rev_tree / ".peers").symlink_to(ROOT / ".peers")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, tree, command in runs:
            env = dict(os.environ)
            if tree == rev_tree:  # its copy has no .git: the run's meta.json names REV
                env["LOWPREC_COMMIT"] = commit[:12]
            env["PYTHONPATH"] = os.pathsep.join(
                [str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            print(f"== {name}", flush=True)
            status = subprocess.run(command, cwd=tree, env=env).returncode
            if status:
                print(f"compare_trees: {name} failed (status {status})", file=sys.stderr)
                return status
    for old, new in comparisons(args.repeats):
        print(f"== {new} against {old}")
        compare_bench.main([str(out_dir / f"{old}.csv"), str(out_dir / f"{new}.csv")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
