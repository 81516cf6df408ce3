#!/usr/bin/env bash
# The main job: set-up, then the example suite of distributed tests under examples/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -p no:cacheprovider -v examples "$@"
rc=$?
[ "$rc" -eq 5 ] && { echo "scripts/main.sh: no example tests were collected" >&2; exit 1; }
exit "$rc"
