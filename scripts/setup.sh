#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv with torch (pinned: an open range pulls CUDA wheels) and
# this package with its test and plot extras. Sourced by the two README commands.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "2.13.0")' 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
fi
# The editable install is redone only when pyproject.toml (its dependencies and entry points)
# or the checkout's path changed: pip's own no-op pass costs about 18 s (a build environment).
stamp=.venv/.fsdp-testing-installed
want="$PWD $(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x .venv/bin/fsdp-testing ]; then
  rm -f "$stamp"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,plot]'
  echo "$want" >"$stamp"
fi
