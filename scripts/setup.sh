#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv with torch (pinned: an open range pulls CUDA wheels) and
# this package with its test and plot extras. Sourced by the two README commands.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip byte-compiles what it installs one file at a time (about 40 s for torch and the extras on
# two cores); install without that and compile the venv's packages on every core at the end.
# The stamp says that the editable install and the compilation are done: it is written last and
# removed before any install, so an interrupted set-up is finished by the next run.
# The editable install is redone only when pyproject.toml (its dependencies and entry points)
# or the checkout's path changed: pip's own no-op pass costs about 18 s (a build environment).
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile)
stamp=.venv/.fsdp-testing-installed
if ! .venv/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch").split("+")[0] != "2.13.0")' 2>/dev/null; then
  rm -f "$stamp"
  "${PIP[@]}" torch==2.13.0
fi
want="$PWD $(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x .venv/bin/fsdp-testing ]; then
  rm -f "$stamp"
  "${PIP[@]}" -e '.[test,plot]'
  # Some files are not meant for this Python (torch ships a 3.12-only test helper): compileall
  # names them and goes on, as pip does; they are never imported here.
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j 0 "$site" >/dev/null || true
  echo "$want" >"$stamp"
fi
