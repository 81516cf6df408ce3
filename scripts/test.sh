#!/usr/bin/env bash
# The whole test suite: set-up, ruff (lint and format), mypy, the documentation (mkdocs, strict),
# then pytest.
# pytest's "no tests collected" (exit 5) is a failure here, not a pass.
# Tests run on two pytest-xdist workers, a test file per worker at a time (--dist loadfile keeps
# a file's module-scoped scenario runs in one worker): most of a distributed test's time is spent
# waiting on ranks, so two workers on two cores halve the wall time. Pass -n 0 to run serially.
# --no-loadscope-reorder: the files in collection order, where the root conftest.py puts the
# longest first (xdist would order them by their number of tests).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh || exit 1
.venv/bin/ruff check fsdp_testing src tests examples benchmarks conftest.py || exit 1
.venv/bin/ruff format --check --quiet fsdp_testing src tests examples benchmarks conftest.py || exit 1
.venv/bin/mypy || exit 1
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
.venv/bin/mkdocs build --strict --quiet --site-dir "$site" || exit 1
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
