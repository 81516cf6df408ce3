"""One timeout story (issue 43): under pytest-timeout (its option, ini key or marker) and
pytest's ``faulthandler_timeout``, a distributed test that hangs ends with the harness's hang
report (the hung rank named, every rank's stack and line, the divergence) before the outer
timer fires, never with the outer timer's bare stack of the pytest process; the next test
passes. See [Note: outer timeouts] in fsdp_testing/_integrations/timeouts.py."""

from __future__ import annotations

import pytest

HANG = """
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2{mode})
def test_hangs(rank):
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=2{mode})
def test_next(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

# The ranks' deadline is what is left of the outer limit when they get the test, to a tenth of a
# second: a loaded machine may take that long to set the test up, so the patterns leave it open.
OUR_REPORT = [
    "*timed out after * s: ranks 0, 1 still running (of world size 2)",
    "rank 1 hangs: it never entered all_reduce #1, which rank 0 waits in",
    "*[[]rank 0[]] stack when the timeout hit:",
    '  File "*test_hang.py", line 12 in test_hangs',
    "*[[]rank 1[]] stack when the timeout hit:",
    '  File "*test_hang.py", line 11 in test_hangs',
    "    time.sleep(60)",
]


def _no_outer_report(text: str) -> None:
    assert "Timeout (>" not in text  # pytest-timeout's own report
    assert "Timeout (0:" not in text  # faulthandler's dump_traceback_later header
    assert "selectors.py" not in text  # the parent waiting on its ranks


def test_a_shorter_timeout_option_gives_the_harness_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_hang=HANG.format(mode=""))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--timeout=3")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            *OUR_REPORT,
            "(the ranks' deadline, * s: pytest-timeout's 3 s for this test, less 1 s kept for "
            "the report and teardown)",
        ]
    )
    _no_outer_report(result.stdout.str())


def test_the_ini_key_and_the_marker_give_the_harness_report(pytester: pytest.Pytester) -> None:
    # The marker's limit wins over the ini key's, as in pytest-timeout; both come before the
    # harness's own default (120 s); a harness timeout shorter than theirs stays as it is.
    source = """
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.timeout(2)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_hangs_marked(rank):
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=2, mode="thread")
def test_hangs_ini(rank):
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=2, mode="thread", timeout=1)
def test_hangs_in_its_own_time(rank):
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=2, mode="thread")
def test_next(rank):
    dist.barrier()
"""
    pytester.makepyfile(test_hang=source)
    pytester.makeini("[pytest]\ntimeout = 3\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(failed=3, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_hangs_marked _*",
            "*timed out after * s: ranks 0, 1 still running*",
            "(the ranks' deadline, * s: pytest-timeout's 2 s for this test, *)",
            "*_ test_hangs_ini _*",
            "*timed out after * s: ranks 0, 1 still running*",
            "(the ranks' deadline, * s: pytest-timeout's 3 s for this test, *)",
            "*_ test_hangs_in_its_own_time _*",
            "*timed out after * s: ranks 0, 1 still running*",
            "rank 1 hangs*",
        ]
    )
    own = (
        result.stdout.str().split("test_hangs_in_its_own_time _")[1].split("short test summary")[0]
    )
    assert "the ranks' deadline" not in own
    _no_outer_report(result.stdout.str())


def test_faulthandler_timeout_gives_the_harness_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_hang=HANG.format(mode=""))
    pytester.makeini("[pytest]\nfaulthandler_timeout = 3\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:timeout")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            *OUR_REPORT,
            "(the ranks' deadline, * s: faulthandler_timeout's 3 s for this test, less 1 s "
            "kept for the report and teardown)",
        ]
    )
    _no_outer_report(result.stdout.str() + result.stderr.str())
