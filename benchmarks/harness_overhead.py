"""Per-test overhead of distributed test harnesses, measured in one run on this machine.

Each harness runs the same test, a world-size-2 gloo ``all_reduce`` of one element, many times
in one pytest session; the figure is the median wall time pytest records per test (setup, call
and teardown), so interpreter start and the first pool start are not counted in the median but
every per-test cost is. Peers: torch's ``MultiProcessTestCase`` (a fresh process per rank per
test) and ``MultiThreadedTestCase`` (threads), both from ``torch.testing._internal`` (they need
the dev-only package ``expecttest``, which the ``test`` extra installs).

Usage: python benchmarks/harness_overhead.py [--tests N] [--torch-tests N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

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


def _run(work: Path, name: str, source: str, *args: str) -> list[float]:
    path = work / f"test_{name}.py"
    path.write_text(textwrap.dedent(source))
    xml = work / f"{name}.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            *args,
            path.name,
        ],
        cwd=work,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name}: pytest failed\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    times = [float(tc.get("time", 0)) for tc in ET.parse(xml).getroot().iter("testcase")]
    return times[1:]  # the first test pays for starting the pool / threads machinery once


def _print_report(rows: list[tuple[str, list[float]]]) -> None:
    """One row per harness: tests, median per-test time, and how many times faster than torch's
    MultiProcessTestCase (rich on a terminal, plain lines elsewhere)."""
    from fsdp_testing.cli._render import make_console, print_table

    torch_mp = statistics.median(dict(rows)["torch MultiProcessTestCase"])
    table = []
    for name, times in rows:
        med = statistics.median(times)
        table.append([name, str(len(times)), f"{med * 1000:.1f}", f"{torch_mp / med:.1f}x"])
    print_table(make_console(), ["harness", "tests", "median ms", "torch MP / this"], table)


def _write_png(path: str, rows: list[tuple[str, list[float]]]) -> None:
    """A bar chart of the median per-test time per harness (log scale: they differ 1000-fold)."""
    from fsdp_testing.cli._plot import BarPanel, draw_bars, save_png

    panel = BarPanel(
        title="median wall time per test (setup, call, teardown)",
        unit="ms (log scale)",
        groups=[name for name, _ in rows],
        series={"per test": [statistics.median(times) * 1000 for _, times in rows]},
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
