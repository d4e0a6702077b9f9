#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs ruff and the test suite on the CPU: the lowprec reference,
# the Triton emulation under TRITON_INTERPRET=1, and sm_90a compiles of every CuTe kernel.
# GPU-only tests carry the `gpu` marker and skip here (counted in pytest's last line; on a GPU
# machine: bash scripts/gpu.sh test). Extra arguments go to pytest, e.g. -m "not slow".
#
# It also tries once to build the git-ignored .peers/vllm (vLLM's Triton decode kernels,
# scripts/peers/prepare.sh; a 336 MB wheel downloaded once into $PEERS_WHEELS, default
# /tmp/peers), so that the benchmark's vLLM adapters are checked against the reference under
# the Triton interpreter. Without a registry those tests skip, and say so;
# LOWPREC_NO_PEERS=1 leaves the download out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff check ."
.venv/bin/ruff check .
if [ -z "${LOWPREC_NO_PEERS:-}" ] && [ ! -d .peers/vllm/site ]; then
  echo "test: building .peers/vllm (at most 10 minutes; LOWPREC_NO_PEERS=1 skips it)"
  PYTHON=.venv/bin/python timeout 600 bash scripts/peers/prepare.sh vllm > /tmp/lowprec-peers.log 2>&1 \
    || echo "test: .peers/vllm not built (see /tmp/lowprec-peers.log); its tests will skip"
fi
echo "test: pytest (the whole suite takes about 15 minutes on 2 cores; -m \"not slow\" about 6)"
.venv/bin/python -m pytest -q "$@"
