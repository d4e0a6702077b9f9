#!/usr/bin/env bash
# Creates .venv (if missing) with the pinned CPU stack and installs the kit in editable mode.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>/dev/null \
  || .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
