"""A collected test as a :class:`~fsdp_testing._protocol.Task` for its ranks: the function and
its fixture values, checked to travel to rank processes (the error names what cannot)."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from fsdp_testing._protocol import (
    PROCESS_FIXTURES,
    RANK_FIXTURES,
    FunctionRef,
    RankFixture,
    RankSideFixture,
    Task,
)
from fsdp_testing._rank import temp_paths

__all__ = ["NotPortable", "build_task", "local_task"]


class NotPortable(TypeError):
    """A process-mode test that cannot be sent to its ranks (a local function, an unpicklable
    fixture value); the message names the test, what cannot travel and the fix, and the plugin
    reports it alone, as the test's error (the harness's frames would only hide it)."""


def local_task(item: pytest.Function) -> Task:
    """The test as a task for ranks in this process: the function itself, with the fixtures
    whose value differs per rank (rank, process group, device) left for the rank to fill in."""
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    for name in RANK_FIXTURES:
        if name in kwargs and name not in ("world_size", "dist_backend"):
            kwargs[name] = RankFixture(name)
    tbstyle = str(item.config.getoption("tbstyle", "auto"))
    return Task(target=item.obj, kwargs=kwargs, test_id=item.nodeid, tbstyle=tbstyle)


def portable_value(name: str, value: Any) -> Any:
    """A fixture value as it travels to rank processes: a temporary path for the rank's use,
    pytest's process fixtures as placeholders the rank makes its own of (see [Note: fixtures
    on the ranks] in ``fsdp_testing/_rank/fixtures.py``), a rank-side fixture with its own
    arguments made portable."""
    if name in PROCESS_FIXTURES and not isinstance(value, RankFixture):
        return RankFixture(name)
    if isinstance(value, RankSideFixture):
        kwargs = {arg: portable_value(arg, v) for arg, v in value.kwargs.items()}
        return dataclasses.replace(value, kwargs=kwargs)
    return temp_paths.portable(value)


def build_task(item: pytest.Function, *, portable: bool) -> Task:
    """The test as a task; ``portable``: one that another process can unpickle and import."""
    task = local_task(item)
    if not portable:
        return task
    kwargs, tbstyle = task.kwargs, task.tbstyle
    func = getattr(item.obj, "__func__", item.obj)
    if "<locals>" in func.__qualname__:
        raise NotPortable(
            f"{item.nodeid}: process-mode distributed tests must be module-level functions or "
            "methods of module-level classes, so the ranks can import them"
        )
    if item.instance is not None:
        kwargs = {"self": item.instance, **kwargs}
    from fsdp_testing._integrations.rank_properties import RECORDING_FIXTURES

    kwargs = {name: portable_value(name, value) for name, value in kwargs.items()}
    for name, value in kwargs.items():
        if isinstance(value, RankFixture):
            continue
        if name in RECORDING_FIXTURES:
            raise NotPortable(
                f"{item.nodeid}: {name} records into the pytest process's report and cannot be "
                "called on a process-mode rank. Each rank's ending is recorded already (junitxml "
                "properties 'rank N'); call it from a fixture of the test, which runs in the "
                "pytest process, or use mode='thread'"
            )
        try:
            pickle.dumps(value)
        except Exception as exc:
            what = "the test class instance" if name == "self" else f"fixture or parameter {name!r}"
            raise NotPortable(
                f"{item.nodeid}: {what} ({type(value).__name__}) cannot be sent to the rank "
                f"processes: {exc}. Make it picklable, build it inside the test body, or use "
                "mode='thread'."
            ) from None
    module = item.module
    assert module is not None
    ref = FunctionRef(module.__name__, getattr(module, "__file__", None), func.__qualname__)
    return Task(target=ref, kwargs=kwargs, test_id=item.nodeid, tbstyle=tbstyle)
