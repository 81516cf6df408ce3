#!/usr/bin/env bash
# The main job: set-up, then `fsdp-testing check` with its defaults: the parity and
# communication matrix of fsdp_core on gloo ranks (exit status 1 on any mismatch). Extra
# arguments go to the check, e.g. --json report.json --junit-xml report.xml.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh || exit 1
exec .venv/bin/fsdp-testing check "$@"
