"""Run a script under ``python -m torch.distributed.run --standalone`` for the sharding tests.

The agent binds a free port itself, so two tests (or two checkouts on one machine) never race
for a port picked beforehand. The command leads a process group of its own: on a timeout the whole
process group is killed, ranks included, so a hung rank fails its test and leaves nothing
behind (killing the agent alone would orphan its ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def torchrun(script: str | Path, args: list[str], *, cwd: str | Path, pythonpath: str | Path,
             nproc: int = 2, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    """``script args`` on ``nproc`` CPU ranks (gloo); the finished process, output captured."""
    environment = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1",
                   "CUDA_VISIBLE_DEVICES": "", **env}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--standalone", str(script), *args]
    proc = subprocess.Popen(argv, cwd=cwd, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun {Path(script).name} did not finish in {timeout} s; "
                             f"its stderr ends: {err[-1500:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
