"""Soak the warm rank pool: run many distributed tests (passing, failing, crashing and hanging)
in one pytest session and show that what the harness holds stays constant.

After every test the child session records, from its own process: the number of processes
under it (fork server and ranks), its open file descriptors, the ranks' open file descriptors,
the shared-memory files in /dev/shm, and the ranks' resident memory. This script prints the
figures, first tenth against the end, and exits 1 when processes, descriptors or shared-memory
files grew, or the ranks' memory grew by more than ``--max-rss-growth-mib``.

    python scripts/soak.py --tests 500

Nothing is left running afterwards (checked: no process carries the run's tag).
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

SCENARIO = """
import os, time
import pytest, torch, torch.distributed as dist

KINDS = {kinds!r}


@pytest.mark.parametrize("i", range(len(KINDS)))
@pytest.mark.distributed(world_size=2, timeout=1.5)
def test_soak(i, rank):
    kind = KINDS[i]
    t = torch.ones(256)
    dist.all_reduce(t)
    if kind == "fail":
        assert rank == 0, "planned failure"
    elif kind == "crash" and rank == 1:
        os._exit(3)
    elif kind == "hang" and rank == 1:
        time.sleep(30)
    dist.barrier()
"""

PROBE = """
import json, os

import pytest

OUT = os.environ["SOAK_OUT"]


def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def _tree(pid):
    out = []
    for child in _children(pid):
        out.append(child)
        out.extend(_tree(child))
    return out


def _fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    tree = _tree(os.getpid())
    ranks = [p for p in tree if _children(p) == []]
    shm = len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0
    with open(OUT, "a") as f:
        f.write(json.dumps({
            "test": item.name,
            "processes": len(tree),
            "fds": _fds(os.getpid()),
            "rank_fds": sum(_fds(p) for p in ranks),
            "shm": shm,
            "rank_rss_kib": sum(_rss_kib(p) for p in ranks),
        }) + "\\n")
"""


def _kinds(n: int) -> list[str]:
    """Mostly passing tests; every 10th fails, every 10th (offset 5) crashes, every 50th hangs."""
    kinds = []
    for i in range(n):
        if i % 50 == 25:
            kinds.append("hang")
        elif i % 10 == 3:
            kinds.append("fail")
        elif i % 10 == 7:
            kinds.append("crash")
        else:
            kinds.append("pass")
    return kinds


def _tagged(tag: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if tag.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def soak(n: int, max_rss_growth_mib: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="fsdp-testing-soak-") as work:
        return _soak(Path(work), n, max_rss_growth_mib)


def _soak(work: Path, n: int, max_rss_growth_mib: float) -> dict:
    kinds = _kinds(n)
    (work / "test_soak.py").write_text(SCENARIO.format(kinds=kinds))
    (work / "conftest.py").write_text(PROBE)
    out = work / "samples.jsonl"
    tag = f"fsdp-testing-soak-{os.getpid()}"
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
            "test_soak.py",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "SOAK_OUT": str(out), "SOAK_TAG": tag},
        timeout=3600,
    )
    seconds = time.monotonic() - start
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    # Steady state: after a passing test (a crash or hang may have just discarded a generation,
    # and the next one starts lazily).
    steady = [s for s, k in zip(samples, kinds, strict=True) if k == "pass"]
    tenth = max(1, len(steady) // 10)
    head, tail = steady[:tenth], steady[-tenth:]

    def span(key: str) -> tuple[int, int]:
        values = [s[key] for s in steady]
        return min(values), max(values)

    figures = {
        "tests": n,
        "kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
        "seconds": round(seconds, 1),
        "pytest_exit": proc.returncode,
        "processes": span("processes"),
        "parent_fds": span("fds"),
        "rank_fds": span("rank_fds"),
        "shm_files": span("shm"),
        "rank_rss_mib_first_tenth": round(
            statistics.median(s["rank_rss_kib"] for s in head) / 1024, 1
        ),
        "rank_rss_mib_last_tenth": round(
            statistics.median(s["rank_rss_kib"] for s in tail) / 1024, 1
        ),
        "left_running": _tagged(tag),
    }
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    figures["pytest_summary"] = summary
    growth = figures["rank_rss_mib_last_tenth"] - figures["rank_rss_mib_first_tenth"]
    figures["rank_rss_growth_mib"] = round(growth, 1)
    figures["ok"] = (
        figures["processes"][0] == figures["processes"][1]
        and figures["parent_fds"][0] == figures["parent_fds"][1]
        and figures["rank_fds"][0] == figures["rank_fds"][1]
        and figures["shm_files"][0] == figures["shm_files"][1]
        and growth <= max_rss_growth_mib
        and not figures["left_running"]
        and len(samples) == n
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=500, help="number of tests (default 500)")
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=64.0,
        help="allowed growth of the ranks' resident memory, first tenth to last (default 64)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = soak(args.tests, args.max_rss_growth_mib)
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:28} {value}")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
