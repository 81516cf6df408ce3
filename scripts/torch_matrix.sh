#!/usr/bin/env bash
# One row of the torch compatibility table (docs/compatibility.md): a venv for one torch release,
# this package installed there (editable, with the test extra), the suite or the named part of it
# run there, and one Markdown row printed last:
#
#   scripts/torch_matrix.sh 2.15.0                          # the whole suite (-n 2, as test.sh)
#   scripts/torch_matrix.sh 2.15.0 tests/unittest_compat    # a part; arguments go to pytest
#
# TORCH_MATRIX_DIR: where the venvs live, one folder per version (default .venv-torch/ here,
# which git ignores); a venv already holding that torch is reused. TORCH_MATRIX_PYTHON: the
# interpreter that makes a new venv (default python3).
# Which build: pip's own choice for `torch==VERSION`, so a CPU wheel (`+cpu`) wherever the
# configured indexes or find-links have one (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/
# whl/cpu adds PyTorch's CPU index), else PyPI's default build with its nvidia packages, which
# imports and runs on a machine without a GPU. Where pip's configuration holds a constraint
# that excludes VERSION (this project's development machines cap torch for CI time), that
# version is installed with PIP_CONFIG_FILE=/dev/null, and only that one.
# The exit status is pytest's (5, no tests collected, becomes 1).
set -uo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: scripts/torch_matrix.sh TORCH_VERSION [PYTEST ARGS...]   e.g. 2.15.0 tests/unittest_compat" >&2
  exit 2
fi
version=$1
shift
if ! [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "scripts/torch_matrix.sh: TORCH_VERSION must be a release such as 2.15.0, not '$version'" >&2
  exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
root=${TORCH_MATRIX_DIR:-$repo/.venv-torch}
venv=$root/$version
py=$venv/bin/python

say() { echo "torch_matrix: $*" >&2; }

if [ ! -x "$py" ]; then
  mkdir -p "$root" || exit 1
  say "creating $venv"
  "${TORCH_MATRIX_PYTHON:-python3}" -m venv "$venv" || exit 1
fi

# pip under the configuration that can install `torch==$version`: the user's own, unless its
# constraint excludes that version (pip then reports a conflict without downloading anything).
pip_env=()
if ! "$py" -m pip install -q --disable-pip-version-check --dry-run --no-deps "torch==$version" \
  >"$venv/pip-probe.log" 2>&1; then
  if grep -q -e ResolutionImpossible -e "conflicting dependencies" "$venv/pip-probe.log"; then
    say "pip's configuration excludes torch $version (a constraint): installing with PIP_CONFIG_FILE=/dev/null"
    pip_env=(env PIP_CONFIG_FILE=/dev/null)
  else
    cat "$venv/pip-probe.log" >&2
    say "pip cannot find torch $version"
    exit 1
  fi
fi
pip=("${pip_env[@]}" "$py" -m pip install -q --disable-pip-version-check)

torch_version() { "$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null; }
# The stamp: this checkout, its pyproject.toml and the torch installed; rewritten after a
# complete install, so an interrupted one is finished by the next run.
stamp=$venv/.fsdp-testing-installed
want="$repo $(sha256sum pyproject.toml | cut -d' ' -f1) torch==$version"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -f "$stamp"
  installed=$(torch_version)
  if [ "${installed%%+*}" != "$version" ]; then
    say "installing torch $version into $venv"
    "${pip[@]}" "torch==$version" || exit 1
  fi
  installed=$(torch_version)
  # The package and its test extra, with torch held at the version installed above, and the
  # build requirements of pyproject.toml: the suite builds this package without build isolation
  # (tests/docs/test_own_project.py), and a new venv's setuptools can be too old for that.
  build_reqs=$("$py" -c 'import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' \
    2>/dev/null) || build_reqs="setuptools wheel"
  say "installing fsdp-testing[test] (editable) and $build_reqs into $venv"
  # shellcheck disable=SC2086 # one requirement a word
  "${pip[@]}" -e "$repo[test]" "torch==$installed" $build_reqs || exit 1
  echo "$want" >"$stamp"
fi
installed=$(torch_version)

args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(-n 2 --dist loadfile --no-loadscope-reorder)
fi
log=$venv/pytest.log
# One import of torch (seconds on a loaded machine) for both: the GPUs it sees and its build.
read -r cuda build < <("$py" -c 'import torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(gpus, f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build")' 2>/dev/null)
say "torch $installed ($build), $cuda CUDA device(s); pytest ${args[*]} (log: $log)"
start=$(date +%s)
"$py" -m pytest -p no:cacheprovider "${args[@]}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
wall=$(($(date +%s) - start))

# The row: torch and its build, date, pytest's counts (from its last summary line), wall time, command.
"$py" - "$log" "$installed" "$build" "$cuda" "$wall" "$version" "$*" <<'EOF'
import datetime
import re
import sys

log, installed, build, cuda, wall, version, args = sys.argv[1:]
summary = ""
for line in open(log, encoding="utf-8", errors="replace"):
    # "== 3 passed, 1 skipped in 2.1s ==", or undecorated under -q: "3 passed in 2.1s".
    if re.match(r"^=*\s*((\d+ \w+,? )+|no tests ran )in [0-9.]+s", line):
        summary = line
counts = dict.fromkeys(("passed", "failed", "skipped", "error"), 0)
for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary):
    word = "error" if word.startswith("error") else word
    counts[word] = counts.get(word, 0) + int(number)
cells = f"{counts['passed']} / {counts['failed']} / {counts['skipped']}"
extra = ", ".join(f"{counts[k]} {k}" for k in ("error", "xfailed", "xpassed") if counts.get(k))
if extra:
    cells += f" ({extra})"
if not summary:
    cells = "no pytest summary (see the log)"
gpus = f"{cuda} GPU" if cuda != "0" else "no GPU"
command = f"scripts/torch_matrix.sh {version}" + (f" {args}" if args else "")
today = datetime.date.today().isoformat()
print(f"| {installed} ({build}) | {today} | {cells} | {wall} s, {gpus} | `{command}` |")
EOF
if [ "$rc" -eq 5 ]; then
  say "pytest collected no tests: that is a failure"
  exit 1
fi
exit "$rc"
