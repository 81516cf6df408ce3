"""What coverage costs per distributed test: the same tests with ``--cov`` and without, in the
same run, in process mode (warm pool), thread and local mode.

One generated test file holds ``--tests`` copies of a small test per mode: each rank calls a
function of a little library (``mylib``, the measured source) and all-reduces a tensor, at
world size 2. Each repeat runs it twice, alternating: plain ``pytest``, then ``pytest
--cov=mylib`` (pytest-cov, the ranks measured as the pytest process is; see [Note: coverage on
rank processes] in ``fsdp_testing/_integrations/rank_coverage.py``). A test's figure is
its setup, call and teardown as pytest timed them; the first test of each mode is
reported apart, since it starts the ranks (a fork server and its processes in process mode).
The times are pytest's own (``report.duration``), gathered by a conftest of the session.
Printed: the median per test of each mode without and with coverage and their ratio, the first
tests, and each session's wall time.

Usage: python benchmarks/coverage_cost.py [--tests N] [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MYLIB = """
import torch
import torch.distributed as dist


def scaled(rank, n):
    total = 0
    for i in range(n):
        total += (i * (rank + 1)) % 7
    return total


def reduced(value):
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return t.item()
"""

TEST = """
import pytest
from mylib import ops


@pytest.mark.parametrize("i", range({tests}))
@pytest.mark.distributed(world_size=2, mode="{mode}")
def test_{mode}(rank, i):
    assert ops.reduced(ops.scaled(rank, 200)) >= 0
"""

# Each test's setup, call and teardown durations, summed, as pytest measured them (the JUnit
# XML rounds them to milliseconds).
CONFTEST = """
import json
import os

DURATIONS = {}


def pytest_runtest_logreport(report):
    DURATIONS[report.nodeid] = DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    with open(os.environ["COVERAGE_COST_OUT"], "w") as f:
        json.dump(DURATIONS, f)
"""

MODES = ("process", "thread", "local")


def _session(folder: Path, *args: str) -> tuple[dict[str, list[float]], float]:
    """Run pytest in ``folder``; each mode's test times in order, and the wall time."""
    out = folder / "durations.json"
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            *args,
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(folder), "COVERAGE_COST_OUT": str(out)},
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"pytest {' '.join(args)} failed:\n{proc.stdout[-3000:]}")
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for nodeid, seconds in json.loads(out.read_text()).items():  # in the order they ran
        mode = nodeid.split("::")[1].split("[")[0].removeprefix("test_")
        times[mode].append(seconds)
    return times, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=20, help="tests per mode (default 20)")
    parser.add_argument("--repeat", type=int, default=3, help="sessions of each kind")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    kinds = {"without": [], "with --cov": ["--cov=mylib", "--cov-report="]}
    runs: dict[str, list[tuple[dict[str, list[float]], float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="coverage-cost-") as tmp:
        folder = Path(tmp)
        (folder / "mylib").mkdir()
        (folder / "mylib" / "__init__.py").write_text("")
        (folder / "mylib" / "ops.py").write_text(MYLIB)
        (folder / "conftest.py").write_text(CONFTEST)
        for mode in MODES:
            (folder / f"test_{mode}.py").write_text(TEST.format(tests=args.tests, mode=mode))
        for _ in range(args.repeat):
            for kind, extra in kinds.items():  # alternating, so drift hits both alike
                runs[kind].append(_session(folder, *extra))
    figures: dict[str, dict[str, float]] = {}
    for mode in MODES:
        row: dict[str, float] = {}
        for kind in kinds:
            rest = [t for times, _ in runs[kind] for t in times[mode][1:]]
            row[f"{kind}: per test"] = statistics.median(rest)
            row[f"{kind}: first test"] = statistics.median(
                times[mode][0] for times, _ in runs[kind]
            )
        row["ratio"] = row["with --cov: per test"] / row["without: per test"]
        figures[mode] = row
    walls = {kind: statistics.median(w for _, w in runs[kind]) for kind in kinds}
    if args.json:
        print(json.dumps({"tests": args.tests, "modes": figures, "session_wall_s": walls}))
        return
    print(f"{args.tests} tests per mode, world size 2, {args.repeat} sessions of each kind")
    print(
        f"{'mode':<8} {'per test':>10} {'with --cov':>11} {'ratio':>6}"
        f" {'first test':>11} {'with --cov':>11}"
    )
    for mode, row in figures.items():
        print(
            f"{mode:<8} {row['without: per test'] * 1e3:>8.1f}ms"
            f" {row['with --cov: per test'] * 1e3:>9.1f}ms {row['ratio']:>6.2f}"
            f" {row['without: first test']:>10.2f}s {row['with --cov: first test']:>10.2f}s"
        )
    print("session wall: " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()))


if __name__ == "__main__":
    main()
