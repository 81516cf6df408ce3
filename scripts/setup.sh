#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv with torch (pinned: an open range pulls CUDA wheels) and
# this package with its test and plot extras. Sourced by the two README commands.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,plot]'
