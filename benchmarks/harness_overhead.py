"""Per-test overhead of distributed test harnesses, measured in one run on this machine.

Each harness runs the same test, a world-size-2 gloo ``all_reduce`` of one element, many times
in one pytest session; the figure is the median wall time pytest records per test (setup, call
and teardown, each as pytest's report has it, to the microsecond), so interpreter start and the
first pool start are not counted in the median but every per-test cost is. Peers: torch's
``MultiProcessTestCase`` (a fresh process per rank per test) and ``MultiThreadedTestCase``
(threads), both from ``torch.testing._internal`` (they need the dev-only package ``expecttest``,
which the ``test`` extra installs). The first row is the floor on this machine: a plain test
with no ranks in a module that imports torch, what pytest itself costs per test.

Usage: python benchmarks/harness_overhead.py [--tests N] [--torch-tests N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

PLAIN = """
import pytest, torch

@pytest.mark.parametrize("i", range({n}))
def test_plain(i):
    t = torch.ones(1)
    assert t.item() == 1
"""

# Loaded into each measured session (``-p``): every phase's duration from pytest's own reports,
# which junit XML rounds to the millisecond.
PHASES_PLUGIN = """
import json, os

_phases = {}


def pytest_runtest_logreport(report):
    _phases.setdefault(report.nodeid, {})[report.when] = report.duration


def pytest_sessionfinish(session):
    with open(os.environ["HARNESS_OVERHEAD_PHASES"], "w") as f:
        json.dump(list(_phases.values()), f)
"""

PHASES = ("setup", "call", "teardown")
Phases = dict[str, float]

OURS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.parametrize("i", range({n}))
@pytest.mark.distributed(world_size=2)
def test_all_reduce(i, rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

OURS_THREAD = OURS.replace("world_size=2)", 'world_size=2, mode="thread")')

TORCH_MP = """
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase

class AllReduce(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _check(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        dist.destroy_process_group()

{methods}
"""

TORCH_MT = """
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiThreadedTestCase

class AllReduce(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def _check(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2

{methods}
"""


def _methods(n: int) -> str:
    return "\n".join(f"    def test_{i}(self):\n        self._check()\n" for i in range(n))


def _run(work: Path, name: str, source: str, *args: str) -> list[Phases]:
    """Run ``source`` as a test file in its own pytest session; each test's phases, in seconds,
    but the first (it pays for starting the pool or the threads' machinery once)."""
    path = work / f"test_{name}.py"
    path.write_text(textwrap.dedent(source))
    (work / "harness_overhead_phases.py").write_text(PHASES_PLUGIN)
    out = work / f"{name}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "harness_overhead_phases",
            *args,
            path.name,
        ],
        cwd=work,
        env={
            **os.environ,
            "HARNESS_OVERHEAD_PHASES": str(out),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(work), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name}: pytest failed\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    tests = json.loads(out.read_text())
    if any(set(t) != set(PHASES) for t in tests):
        raise SystemExit(f"{name}: a test is missing one of {PHASES} in pytest's reports")
    return tests[1:]


def _total(test: Phases) -> float:
    return sum(test[p] for p in PHASES)


def _print_report(rows: list[tuple[str, list[Phases]]]) -> None:
    """One row per harness: tests, the median per-test time and the median of each phase
    (milliseconds), and how many times faster than torch's MultiProcessTestCase (rich on a
    terminal, plain lines elsewhere)."""
    from fsdp_testing.cli._render import make_console, print_table

    torch_mp = statistics.median(map(_total, dict(rows)["torch MultiProcessTestCase"]))
    table = []
    for name, tests in rows:
        med = statistics.median(map(_total, tests))
        phases = [f"{statistics.median(t[p] for t in tests) * 1000:.2f}" for p in PHASES]
        table.append(
            [name, str(len(tests)), f"{med * 1000:.2f}", *phases, f"{torch_mp / med:.1f}x"]
        )
    headers = ["harness", "tests", "median ms", "setup", "call", "teardown", "torch MP / this"]
    print_table(make_console(), headers, table)


def _write_png(path: str, rows: list[tuple[str, list[Phases]]]) -> None:
    """A bar chart of the median per-test time per harness (log scale: they differ 1000-fold)."""
    from fsdp_testing.cli._plot import BarPanel, draw_bars, save_png

    panel = BarPanel(
        title="median wall time per test (setup, call, teardown)",
        unit="ms (log scale)",
        groups=[name for name, _ in rows],
        series={"per test": [statistics.median(map(_total, tests)) * 1000 for _, tests in rows]},
        log=True,
    )
    save_png(draw_bars([panel], title="Per-test overhead, world size 2 (gloo, CPU)"), path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=40, help="tests per run for our harness")
    parser.add_argument("--torch-tests", type=int, default=8, help="tests for torch's harness")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="also draw the per-test overhead per harness (matplotlib: the 'plot' extra)",
    )
    args = parser.parse_args()
    if args.png:
        from fsdp_testing.cli._plot import require_matplotlib

        try:
            require_matplotlib("harness_overhead.py --png")
        except ImportError as error:
            parser.error(str(error))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = [
            (
                "plain pytest test, no ranks (the floor)",
                _run(work, "plain", PLAIN.format(n=args.tests)),
            ),
            ("fsdp_testing warm pool", _run(work, "pool", OURS.format(n=args.tests))),
            (
                "fsdp_testing fresh processes (--no-dist-pool)",
                _run(work, "fresh", OURS.format(n=args.tests), "--no-dist-pool"),
            ),
            ("fsdp_testing thread mode", _run(work, "thread", OURS_THREAD.format(n=args.tests))),
            (
                "torch MultiProcessTestCase",
                _run(work, "torch_mp", TORCH_MP.format(methods=_methods(args.torch_tests))),
            ),
            (
                "torch MultiThreadedTestCase",
                _run(work, "torch_mt", TORCH_MT.format(methods=_methods(args.tests))),
            ),
        ]
    _print_report(rows)
    if args.png:
        _write_png(args.png, rows)


if __name__ == "__main__":
    main()
