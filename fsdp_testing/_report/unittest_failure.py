"""A unittest-class test that failed on its ranks, reported as a ``distributed`` marker test is.

[Note: unittest failures honour --tb]
A method of ``MultiProcessTestCase``/``FSDPTest``/... fails in the pytest process by raising
:class:`~fsdp_testing.testcase.DistributedTestFailure`, whose message is the ranks' report.
pytest's unittest support would show it below a traceback of the harness's own frames, the
whole report in every ``--tb`` style, the ranks' tracebacks always in the long style. Instead:
the ranks format their tracebacks in the session's ``--tb`` style (``LaunchSettings.tbstyle``),
and the failure's report is the message alone, the ``value`` style pytest gives
``pytest.fail(..., pytrace=False)``, as the marker's tests have it. So ``--tb=short`` shows short
rank tracebacks, ``--tb=line`` one line per rank and the test's location, ``--tb=no`` nothing,
and the short summary names the report's first line.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest

__all__ = ["report_as_ranks_did"]


def _failure_of(call: pytest.CallInfo[None]) -> BaseException | None:
    testcase = sys.modules.get("fsdp_testing.testcase")
    if testcase is None or call.excinfo is None:
        return None  # no unittest class of ours ran in this process
    value = call.excinfo.value
    return value if isinstance(value, testcase.DistributedTestFailure) else None


def _location(item: pytest.Item) -> tuple[str, int] | None:
    """The test method's file and first line (before the harness wrapped it)."""
    instance = getattr(item, "instance", None)
    name = getattr(instance, "_rank_method", None)
    method = getattr(type(instance), name, None) if name else None
    try:
        function = inspect.unwrap(method) if method is not None else None
        path = inspect.getsourcefile(function) if function is not None else None
        line = inspect.getsourcelines(function)[1] if function is not None else None
    except (OSError, TypeError):
        return None
    return (path, line) if path and line else None


def report_as_ranks_did(item: pytest.Item, call: pytest.CallInfo[None], report: Any) -> None:
    """Give a failed unittest-class test the report a marker test gets (see [Note: unittest
    failures honour --tb]); other reports are left alone.

    Args:
        item: the test item.
        call: its call phase.
        report: the report pytest made of it.
    """
    failure = _failure_of(call)
    if failure is None or call.when != "call" or not report.failed or call.excinfo is None:
        return
    longrepr = call.excinfo.getrepr(style="value", tbfilter=False, chain=False)
    headline = str(failure).split("\n", 1)[0]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        crash.message = f"{type(failure).__name__}: {headline}"
        where = _location(item)
        if where is not None:
            crash.path, crash.lineno = where
    report.longrepr = longrepr
