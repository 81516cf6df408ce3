"""Stress the thread launcher's teardown (issue 23): run thread-mode worlds whose ranks all fail
together, fail while their peers wait in a collective, hang in a collective, or never enter
one, round after round in one pytest session, and show that every test ends with its report
within its deadline, the next one runs, and no rank thread is left behind.

A round is five tests (four ways to fail, one pass; a rank that never enters the collective
its peers wait in is a certain deadlock, which ends its test before the timeout). The child
session records after every test how long it took and how many threads its process holds; the
script exits 1 when a test is missing (the session hung and was killed), reports the wrong
outcome, took longer than its bound, or left threads behind.

    python scripts/thread_stress.py --rounds 20 --world-size 128

Before the fix a world of 128 once deadlocked in teardown (every rank thread and the launcher
waiting on one lock) and pytest sat idle until an outer timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMEOUT_S = 3.0
"""The marker timeout of the hanging tests."""

SCENARIO = """
import time
import pytest, torch, torch.distributed as dist

WS = {world_size}


@pytest.mark.parametrize("round", range({rounds}))
@pytest.mark.distributed(world_size=WS, mode="thread", timeout=60)
def test_no_entry(round, rank):
    # The last rank returns without the all-reduce the others wait in: a certain deadlock,
    # which ends the test about a second in (the timeout is only the bound).
    t = torch.ones(1)
    if rank != WS - 1:
        dist.all_reduce(t)


@pytest.mark.parametrize("round", range({rounds}))
@pytest.mark.parametrize("kind", ["all_fail", "fail_in_collective", "hang", "pass"])
@pytest.mark.distributed(world_size=WS, mode="thread", timeout={timeout})
def test_world(kind, round, rank):
    t = torch.ones(1)
    if kind == "all_fail":
        dist.all_reduce(t)
        raise ValueError(f"rank {{rank}} fails with the others")
    if kind == "fail_in_collective" and rank == round % WS:
        raise ValueError("fails while the others wait in all_reduce")
    if kind == "hang" and rank == (3 * round + 1) % WS:
        while True:
            time.sleep(0.05)
    dist.all_reduce(t)
    assert t.item() == WS
"""

PROBE = """
import json, os, threading

import pytest

OUT = os.environ["STRESS_OUT"]


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    with open(OUT, "a") as f:
        f.write(json.dumps({
            "test": report.nodeid.split("::")[-1],
            "outcome": report.outcome,
            "message": str(report.longrepr or "")[:300],
            "seconds": report.duration,
            "threads": threading.active_count(),
        }) + "\\n")
"""

EXPECTED = {
    "all_fail": ("failed", "failed: ValueError: rank "),
    "fail_in_collective": ("failed", "failed: ValueError: fails while the others wait"),
    "hang": ("failed", f"timed out after {TIMEOUT_S:g} s"),
    "no_entry": ("failed", "deadlock: ranks 0-"),
    "pass": ("passed", ""),
}


def _bound(world_size: int) -> float:
    """The longest one test may take: the timeout, the stop window (20 s at most) and room
    for a loaded machine formatting ``world_size`` failures."""
    return TIMEOUT_S + 20.0 + 0.1 * world_size


def stress(rounds: int, world_size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fsdp-testing-thread-stress-") as work:
        return _stress(Path(work), rounds, world_size)


def _stress(work: Path, rounds: int, world_size: int) -> dict:
    (work / "test_stress.py").write_text(
        SCENARIO.format(world_size=world_size, rounds=rounds, timeout=TIMEOUT_S)
    )
    (work / "conftest.py").write_text(PROBE)
    out = work / "samples.jsonl"
    tests = 5 * rounds
    start = time.monotonic()
    try:
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
                "test_stress.py",
            ],
            cwd=work,
            capture_output=True,
            text=True,
            env={**os.environ, "STRESS_OUT": str(out)},
            timeout=tests * _bound(world_size) + 60,
        )
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    except subprocess.TimeoutExpired:
        summary = "the session did not end: killed"
    seconds = time.monotonic() - start
    samples = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    wrong, slow = [], []
    for sample in samples:
        test, _, params = sample["test"].partition("[")
        kind = "no_entry" if test == "test_no_entry" else params.split("-", 1)[0]
        outcome, text = EXPECTED[kind]
        if sample["outcome"] != outcome or text not in sample["message"]:
            wrong.append(f"{sample['test']}: {sample['outcome']}: {sample['message'][:160]}")
        if sample["seconds"] > _bound(world_size):
            slow.append(f"{sample['test']}: {sample['seconds']:.1f} s")
    threads = [s["threads"] for s in samples]
    figures = {
        "world_size": world_size,
        "rounds": rounds,
        "tests": tests,
        "reported": len(samples),
        "seconds": round(seconds, 1),
        "slowest_test_s": round(max((s["seconds"] for s in samples), default=0.0), 1),
        "threads_after_each_test": (min(threads), max(threads)) if threads else None,
        "wrong": wrong,
        "slow": slow,
        "pytest_summary": summary,
    }
    figures["ok"] = (
        len(samples) == tests
        and not wrong
        and not slow
        and bool(threads)
        and max(threads) == min(threads)
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of five tests (20)")
    parser.add_argument("--world-size", type=int, default=128, help="thread ranks (128)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = stress(args.rounds, args.world_size)
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:26} {value}")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
