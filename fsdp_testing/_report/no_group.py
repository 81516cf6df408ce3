"""A ``torch.distributed`` call in a test that is not distributed: the error says which marker
and fixture give the test a process group, instead of torch's bare "Default process group has
not been initialized".

A plugin of its own (``plugin.py`` registers it): its hooks look at a test's ``ValueError``
on its way out of setup or the call, so ordinary tests pay nothing, and a test that makes its
own process group is never touched (its calls do not raise this). Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from types import TracebackType
from typing import Any

import pytest

__all__ = ["explain", "pytest_runtest_call", "pytest_runtest_setup"]

_TORCH_SAYS = "Default process group has not been initialized"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    try:
        return (yield)
    except ValueError as exc:
        _raise_explained(item, exc)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    try:
        return (yield)
    except ValueError as exc:
        _raise_explained(item, exc)
        raise


def _raise_explained(item: pytest.Item, exc: ValueError) -> None:
    if item.get_closest_marker("distributed") is None:
        error = explain(exc, item.nodeid)
        if error is not None:
            raise error from None


def explain(exc: BaseException, test: str) -> ValueError | None:
    """The error to raise in place of ``exc``, raised by test ``test`` (a pytest node id), when
    ``exc`` is torch's "no default process group" and none exists; else None. A
    ``ValueError``, as torch's is, so that a test expecting torch's error type still gets it."""
    if not isinstance(exc, ValueError) or not str(exc).startswith(_TORCH_SAYS):
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is None or (dist.is_available() and dist.is_initialized()):
        return None
    call = _called(exc.__traceback__)
    error = ValueError(
        f"{call} needs a process group, and {test} has none: it is not a distributed test. "
        "Mark it @pytest.mark.distributed(world_size=2) (any world size; "
        "mode='thread' or mode='local' runs the ranks in this process) to run its body on "
        "every rank of a process group, and take the group from the process_group fixture "
        "(def test_x(rank, process_group): ..., then group=process_group), or leave group=None "
        f"for the default group. torch says: {exc}"
    )
    return error.with_traceback(exc.__traceback__)


def _called(tb: TracebackType | None) -> str:
    """The ``torch.distributed`` function the test called, from the traceback."""
    entered = False
    while tb is not None:
        code = tb.tb_frame.f_code
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if module.startswith("torch.distributed"):
            entered = True
            if not code.co_name.startswith("_") and code.co_name != "wrapper":
                public = sys.modules.get("torch.distributed")
                if getattr(public, code.co_name, None) is not None:
                    return f"torch.distributed.{code.co_name}"
                return f"{module}.{code.co_name}"
        elif entered:
            break
        tb = tb.tb_next
    return "a torch.distributed call"
