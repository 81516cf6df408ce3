"""What a planted point-to-point deadlock costs a suite: the wall time of each test of a small
pipeline suite with two planted bugs (both ranks receive first; a stage sends to the wrong rank)
and one correct test, in process and thread mode, with the default timeout (120 s).

Without a deadlock watch a wait cycle is only found at the test's timeout; with it
(``fsdp_testing/_launch/wait_watch.py``) the test ends once the cycle is certain. The script runs
the same file under this checkout and, with ``--before DIR``, under another checkout of the
project (e.g. ``git worktree add /tmp/before <commit>``), its packages put first on the path, and
prints each test's call time under both with the ratio.

Usage: python benchmarks/deadlock_cost.py [--before DIR] [--timeout SECONDS] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = """
import pytest
import torch
import torch.distributed as dist

TIMEOUT = {timeout}


def deadlock(rank):
    t = torch.ones(4)
    dist.recv(t, 1 - rank)  # planted: both ranks receive first
    dist.send(t, 1 - rank)


def wrong_peer(rank):
    t = torch.ones(4)
    if rank == 0:
        dist.send(t, 2)  # planted: the next stage is rank 1
    elif rank == 1:
        dist.recv(t, 0)


def exchange(rank):
    t = torch.ones(4)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)


@pytest.mark.distributed(world_size=2, timeout=TIMEOUT)
def test_warm_up_2(rank):
    exchange(rank)  # starts the ranks of world size 2: the first test pays for that


@pytest.mark.distributed(world_size=3, timeout=TIMEOUT)
def test_warm_up_3(rank):
    exchange(rank)


@pytest.mark.distributed(world_size=2, timeout=TIMEOUT)
def test_deadlock_process(rank):
    deadlock(rank)


@pytest.mark.distributed(world_size=3, timeout=TIMEOUT)
def test_wrong_peer_process(rank):
    wrong_peer(rank)


@pytest.mark.distributed(world_size=2, mode="thread", timeout=TIMEOUT)
def test_deadlock_thread(rank):
    deadlock(rank)


@pytest.mark.distributed(world_size=3, mode="thread", timeout=TIMEOUT)
def test_wrong_peer_thread(rank):
    wrong_peer(rank)


@pytest.mark.distributed(world_size=3, timeout=TIMEOUT)
def test_correct_process(rank):
    exchange(rank)
"""


def run(checkout: Path, folder: Path) -> dict[str, tuple[float, str]]:
    """Each test's call time (s) and the first words of its report, and the session's wall
    time, under ``checkout``'s packages."""
    xml = folder / f"report-{checkout.name}.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(checkout), str(checkout / "src")]),
    }
    start = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            "test_suite.py",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.monotonic() - start
    found: dict[str, tuple[float, str]] = {}
    for case in ET.parse(xml).iter("testcase"):
        failure = case.find("failure")
        said = "passed" if failure is None else (failure.get("message") or "")[:48]
        found[case.get("name", "")] = (float(case.get("time", 0)), said)
    return {**found, "suite (wall)": (wall, "")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="another checkout to compare with")
    parser.add_argument("--timeout", type=float, default=120.0, help="each test's timeout")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "test_suite.py").write_text(textwrap.dedent(SUITE.format(timeout=args.timeout)))
        after = run(ROOT, folder)
        before = run(args.before.resolve(), folder) if args.before else None
    print(f"{'test':26} {'before (s)':>10} {'after (s)':>10} {'ratio':>7}  report before | after")
    for name, (seconds, said) in after.items():
        if before is None:
            print(f"{name:26} {'':>10} {seconds:10.1f} {'':>7}  {said}")
            continue
        old, old_said = before.get(name, (float("nan"), ""))
        ratio = old / max(seconds, 1e-9)
        print(f"{name:26} {old:10.1f} {seconds:10.1f} {ratio:7.1f}  {old_said} | {said}")
    if args.json:
        args.json.write_text(json.dumps({"after": after, "before": before}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
