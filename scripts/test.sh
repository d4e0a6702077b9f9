#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite on the CPU: the lowprec reference,
# the Triton emulation under TRITON_INTERPRET=1, and sm_90a compiles of every CuTe kernel.
# GPU-only tests carry the `gpu` marker and skip cleanly here. Extra arguments go to pytest.
#
# It also tries to build the git-ignored .peers/vllm (vLLM 0.33.0's Triton decode kernels,
# scripts/peers/prepare.sh; a 336 MB wheel downloaded once into $PEERS_WHEELS, default
# /tmp/peers), so that the benchmark's vLLM adapters are checked against the reference under
# the Triton interpreter (tests/test_kernel_bench.py, 8 tests). Without a registry those
# tests skip, and say so; LOWPREC_NO_PEERS=1 leaves the download out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
if [ -z "${LOWPREC_NO_PEERS:-}" ] && [ ! -d .peers/vllm/site ]; then
  PYTHON=.venv/bin/python timeout 600 bash scripts/peers/prepare.sh vllm > /tmp/lowprec-peers.log 2>&1 \
    || echo "note: .peers/vllm not built (see /tmp/lowprec-peers.log); its tests will skip"
fi
.venv/bin/python -m pytest -q "$@"
