"""A process-mode test whose warm ranks are ready is sent to them at the end of its setup and
judged in its call (see [Note: a test sent at the end of its setup] in fsdp_testing/plugin.py)."""

from __future__ import annotations

import json

CONFTEST = """
import json, os, time
from pathlib import Path

import pytest

OUT = Path(os.environ["SENT_AHEAD_OUT"])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.name == "test_first":  # no warm ranks yet: nothing is sent ahead
        return (yield)
    # Before the call runs the test: did its ranks start it already? (Up to 20 s: on a loaded
    # machine the ranks may take a while to get a processor.)
    started = OUT / f"{item.name}.0"
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(OUT / "calls.jsonl", "a") as f:
        f.write(json.dumps({"test": item.name, "started_before_call": started.exists()}) + "\\n")
    return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.name == "test_taken_over":
        return True  # another plugin runs this call: ours never sees it
    return None
"""

TESTS = """
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

OUT = Path(os.environ["SENT_AHEAD_OUT"])


def _started(name, rank):
    (OUT / f"{name}.{rank}").write_text(str(os.getpid()))


@pytest.mark.distributed(world_size=2)
def test_first(rank):  # no warm ranks yet: its call starts them
    _started("test_first", rank)


@pytest.mark.distributed(world_size=2)
def test_sent_at_the_end_of_setup(rank, tmp_path):
    _started("test_sent_at_the_end_of_setup", rank)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.distributed(world_size=2)
def test_taken_over(rank):
    _started("test_taken_over", rank)
    t = torch.ones(1)
    dist.all_reduce(t)


@pytest.mark.distributed(world_size=2)
def test_after_the_take_over(rank):
    _started("test_after_the_take_over", rank)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


def test_warm_ranks_start_the_test_before_its_call_and_a_call_that_never_comes_is_waited_for(
    pytester, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_sent=TESTS)
    monkeypatch.setenv("SENT_AHEAD_OUT", str(out))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=4)
    calls = {c["test"]: c for c in map(json.loads, (out / "calls.jsonl").read_text().splitlines())}
    # Sent at the end of setup: running before the call begins.
    assert calls["test_sent_at_the_end_of_setup"]["started_before_call"]
    assert calls["test_after_the_take_over"]["started_before_call"]
    # A call taken over by another plugin: the ranks ran the test once, and teardown waited for
    # them, so the next test ran on the same warm ranks.
    pids = {
        name: {(out / f"{name}.{r}").read_text() for r in range(2)}
        for name in ("test_first", "test_taken_over", "test_after_the_take_over")
    }
    assert pids["test_first"] == pids["test_taken_over"] == pids["test_after_the_take_over"]
