#!/usr/bin/env bash
# The checks that need a GPU, for a machine with one or more NVIDIA GPUs and torch already
# installed (CI has none: there these tests skip). Run from the repository root:
#
#   bash scripts/gpu_checks.sh [LOG_DIR]
#
# 1. tests/core/test_cuda.py: side streams, pinned offload copies and bf16 mixed precision on
#    NCCL, both doors, against DDP (two ranks with two GPUs, one rank with one).
# 2. tests/core with --dist-backend nccl: every test whose world fits the GPUs runs on NCCL; the
#    rest skip naming the devices they need.
# 3. The whole suite with the default backend on a machine that has a GPU (a one-rank test
#    without a backend picks nccl there; tests that name gloo keep it).
#
# Each step has its own time limit and log (LOG_DIR, default ./gpu-logs); the script goes on
# after a failed step and exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
logs=${1:-gpu-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
workers=$(( $(nproc) > 12 ? 12 : $(nproc) ))
installed() { python3 -c "import importlib.metadata as m; m.distribution('fsdp-testing')" 2>/dev/null; }
# Installed, the plugin's entry point also reaches the child pytest sessions that the plugin's
# own tests start; an offline machine installs it without fetching anything.
installed || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  || echo "fsdp-testing could not be installed: the plugin is loaded with -p (its own scenario tests then fail)"
pytest=(python3 -m pytest -p fsdp_testing.plugin -p no:cacheprovider -rs)
if installed; then
  pytest=(python3 -m pytest -p no:cacheprovider -rs)  # the entry point loads it
fi
failed=0

step() {  # step NAME LIMIT_S ARGS...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s)"
  local start=$SECONDS
  timeout "$limit" "${pytest[@]}" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$logs/$name.log"
  echo "=== $name: rc $rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=1
}

nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
# The limits can be shortened for a device session with little time: GPU_LIMITS="cuda core suite".
read -r cuda_s core_s suite_s <<<"${GPU_LIMITS:-120 180 420}"
step cuda "$cuda_s" tests/core/test_cuda.py -v
step core-nccl "$core_s" tests/core -n "$workers" --dist loadfile --dist-backend nccl -q
# -v: each test's outcome is in the log as it ends, so a step stopped at its limit still names
# its failures (an H100 machine with 14 workers ran 99% of the suite in 290 s).
step suite "$suite_s" tests -n "$workers" --dist loadfile -v
exit "$failed"
