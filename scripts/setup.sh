#!/usr/bin/env bash
# Makes .venv with the tested CPU stack (requirements.txt, used as constraints: torch==2.13.0,
# the CPU build) and installs the kit in editable mode with its extras, one step at a time:
# the core (numpy, torch, pandas, matplotlib, tqdm), the Triton emulation, the CuTe DSL
# kernels, the test tools. Idempotent: a second run with unchanged requirements.txt and
# pyproject.toml only checks that the kit imports.
#
# Each network step is bounded: pip waits at most PIP_TIMEOUT_S seconds (default 30) on a
# silent connection and retries twice, and the whole step stops after SETUP_STEP_S seconds
# (default 900). A step that fails names, in one line, the package it could not get.
# PYTHON picks the interpreter that makes .venv (default python3, 3.10 or later).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
step_s=${SETUP_STEP_S:-900}
pip_timeout=${PIP_TIMEOUT_S:-30}
for knob in step_s pip_timeout; do
  if ! [[ ${!knob} =~ ^[1-9][0-9]*$ ]]; then
    echo "setup.sh: SETUP_STEP_S and PIP_TIMEOUT_S take whole seconds, got '${!knob}'" >&2; exit 2
  fi
done
stamp=.venv/.setup-stamp
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2> /dev/null)" = "$want" ] \
   && .venv/bin/python -c "import lowprec, emulation, experiments" 2> /dev/null; then
  echo "setup: .venv is up to date (requirements.txt and pyproject.toml unchanged)"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: making .venv with $("$python" --version 2>&1)"
  "$python" -m venv .venv
fi
log=$(mktemp "${TMPDIR:-/tmp}/lowprec-setup.XXXXXX")
trap 'rm -f "$log"' EXIT

# pip_step WHAT ARGS...: one bounded pip install, its output shown and kept for the diagnosis
pip_step() {
  local what=$1; shift
  echo "setup: $what"
  local rc=0
  PYTHONUNBUFFERED=1 timeout "$step_s" .venv/bin/python -m pip install --disable-pip-version-check \
    --timeout "$pip_timeout" --retries 2 -c requirements.txt "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && return 0
  local package
  package=$(grep -oE "(No matching distribution found for|satisfies the requirement|requested \(constraint\)) [^ ;(]+" "$log" \
    | tail -n 1 | awk '{print $NF}' || true)
  [ -n "$package" ] || package=$(grep -oE "/simple/[^/ ]+/" "$log" | tail -n 1 | cut -d/ -f3 || true)
  [ -n "$package" ] || package=$(grep -oE "^ *(Collecting|Downloading) [^ ;(]+" "$log" \
    | tail -n 1 | awk '{print $NF}' || true)
  if [ "$rc" -eq 124 ]; then
    echo "setup: could not get ${package:-the packages of this step} ($what): no answer within ${step_s} s (SETUP_STEP_S)" >&2
  elif grep -qE "ReadTimeoutError|ConnectTimeoutError|NewConnectionError|ConnectionResetError" "$log"; then
    echo "setup: could not get ${package:-the packages of this step} ($what): the registry did not answer within ${pip_timeout} s, twice retried (PIP_TIMEOUT_S)" >&2
  else
    echo "setup: could not get ${package:-the packages of this step} ($what): pip exited $rc (its output is above)" >&2
  fi
  exit 1
}

# the editable installs build without isolation (no download of a build backend each step);
# setuptools 70.1 is the first that builds wheels without the wheel package
if ! .venv/bin/python -c "import setuptools, sys; v = tuple(int(p) for p in setuptools.__version__.split('.')[:2]); sys.exit(v < (70, 1))" 2> /dev/null; then
  pip_step "the build backend: setuptools" "setuptools>=70.1"
fi
editable=(--no-build-isolation -e)
pip_step "the core: numpy, torch (CPU), pandas, matplotlib, tqdm" "${editable[@]}" .
pip_step "the Triton emulation: triton" "${editable[@]}" ".[emulation]"
pip_step "the CuTe DSL kernels: nvidia-cutlass-dsl" "${editable[@]}" ".[cute]"
pip_step "the test tools: pytest, hypothesis, ruff, ml_dtypes, safetensors, transformers" "${editable[@]}" ".[dev]"
echo "$want" > "$stamp"
echo "setup: done; .venv/bin/python has the kit (editable) and every extra"
