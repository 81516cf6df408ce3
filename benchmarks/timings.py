"""The timings the docs quote, measured in one run: the main job, the check's matrices, the suite.

Every page that gives a duration (README, docs/cli.md) points at the table this prints, which
lives in docs/benchmarks.md ("Timings"); rerun this on an idle machine and paste its output there.

Each row is one command run to the end, timed by wall clock, with the machine's load average at
its start (the figures are only comparable on an idle machine: two cores, one heavy job at a
time). A command that fails is reported with its exit status, not a time.

Rows (``--rows``, comma separated; default all but ``ci``):

- ``main``: ``bash scripts/main.sh``, the README's main job with its set-up (venv ready);
- ``check``: ``fsdp-testing check``, the 180 default rows alone;
- ``hybrid``: ``fsdp-testing check --strategy HYBRID_SHARD,_HYBRID_SHARD_ZERO2``, the 120 hybrid
  rows;
- ``suite``: ``bash scripts/test.sh``, the README's test command (set-up, lint, docs, the suite);
- ``ci``: ``CI=true bash .ci/run`` in a fresh clone of this checkout's HEAD (what CI runs).

Each command's output goes to ``LOGS/<row>.log`` (``--logs``, default a new temporary folder,
printed first), so a failing row can be read.

Usage: python benchmarks/timings.py [--rows main,check,hybrid,suite,ci] [--logs DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FSDP_TESTING = str(ROOT / ".venv" / "bin" / "fsdp-testing")

ROWS: dict[str, tuple[str, list[str]]] = {
    "main": ("the main job, set-up included (`bash scripts/main.sh`)", ["bash", "scripts/main.sh"]),
    "check": ("`fsdp-testing check`: the 180 default rows", [FSDP_TESTING, "check"]),
    "hybrid": (
        "`fsdp-testing check --strategy HYBRID_SHARD,_HYBRID_SHARD_ZERO2`: 120 hybrid rows",
        [FSDP_TESTING, "check", "--strategy", "HYBRID_SHARD,_HYBRID_SHARD_ZERO2"],
    ),
    "suite": (
        "the test command, set-up included (`bash scripts/test.sh`)",
        ["bash", "scripts/test.sh"],
    ),
    "ci": ("`CI=true bash .ci/run` on a fresh clone", ["bash", ".ci/run"]),
}


def _run(name: str, argv: list[str], log: Path) -> tuple[float, int]:
    cwd = ROOT
    env = dict(os.environ)
    scratch = None
    if name == "ci":
        scratch = tempfile.TemporaryDirectory(prefix="timings-ci-")
        cwd = Path(scratch.name) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(cwd)], check=True)
        env["CI"] = "true"
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - start
    if scratch is not None:
        scratch.cleanup()
    return elapsed, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", default="main,check,hybrid,suite", help="rows to measure, comma separated"
    )
    parser.add_argument("--logs", type=Path, default=None, help="folder for each row's output")
    args = parser.parse_args()
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="timings-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, commit {_head()}; logs in {logs}")
    print()
    print("| what | wall time | load average at start |")
    print("| --- | ---: | ---: |")
    failed = False
    for name in names:
        label, argv = ROWS[name]
        load = os.getloadavg()[0]
        elapsed, rc = _run(name, argv, logs / f"{name}.log")
        figure = f"{elapsed:.0f} s" if rc == 0 else f"exit status {rc} after {elapsed:.0f} s"
        failed |= rc != 0
        print(f"| {label} | {figure} | {load:.1f} |", flush=True)
    return 1 if failed else 0


def _head() -> str:
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return proc.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
