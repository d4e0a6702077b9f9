#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite on the CPU: the lowprec reference,
# the Triton emulation under TRITON_INTERPRET=1, and sm_90a compiles of every CuTe kernel.
# GPU-only tests carry the `gpu` marker and skip cleanly here. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
