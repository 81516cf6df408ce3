"""The rank fixtures, and the user's fixtures that request them, on the pytest process's side:
the fixtures are placeholders here (their values exist only on the ranks), and a fixture that
requests one is not run here but described for the ranks to set up (see [Note: fixtures on the
ranks] in ``fsdp_testing/_rank/fixtures.py``).

The plugin (``fsdp_testing/plugin.py``) imports the fixtures and hooks of this module, which
is how pytest finds them. Nothing here imports torch.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from fsdp_testing._launch.marker_items import spec_of
from fsdp_testing._launch.spec import MARKER_SIGNATURE, DistSpec, Mode
from fsdp_testing._protocol import FunctionRef, RankFixture, RankSideFixture

__all__ = [
    "device",
    "dist_backend",
    "fail_if_refused",
    "process_group",
    "pytest_fixture_setup",
    "rank",
    "rank_side_fixtures",
    "refuse_at_setup",
    "refuse_outside_distributed_tests",
    "validate_rank_side_fixtures",
    "world_size",
]

#: The fixtures that make a fixture requesting them run on the ranks: those whose value exists
#: only on a rank, and ``world_size``, which the parent knows too but which a fixture requests
#: to build what belongs to a rank (``init_device_mesh("cpu", (world_size,))``: run in the
#: parent, that made torch's "environment variable RANK expected" error).
ON_RANKS = ("rank", "process_group", "device", "world_size")


def _require_marker(request: pytest.FixtureRequest, name: str) -> DistSpec:
    spec = spec_of(request.node)
    if spec is None:
        raise pytest.fail(
            f"fixture {name!r} is only available in distributed tests: mark the test with "
            f"@pytest.mark.{MARKER_SIGNATURE}",
            pytrace=False,
        )
    return spec


# The fixtures whose value exists only on a rank are session-scoped placeholders, so that a
# fixture of any scope may request them (pytest refuses a module-scoped fixture that requests a
# function-scoped one); a test that is not distributed is refused them in its setup
# (``refuse_outside_distributed_tests``).


@pytest.fixture(scope="session")
def rank() -> Any:
    """This rank's index in the process group (distributed tests only)."""
    return RankFixture("rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The number of ranks (distributed tests only)."""
    return _require_marker(request, "world_size").world_size


@pytest.fixture(scope="session")
def process_group() -> Any:
    """The process group of all ranks (distributed tests only)."""
    return RankFixture("process_group")


@pytest.fixture(scope="session")
def device() -> Any:
    """This rank's ``torch.device``: cpu for gloo, this rank's GPU for nccl."""
    return RankFixture("device")


def refuse_outside_distributed_tests(item: pytest.Item) -> None:
    """A test that is not distributed and requests a fixture whose value exists only on a rank
    (itself or through one of its fixtures) fails, naming the fixture and the marker."""
    names = getattr(item, "fixturenames", ())
    for name in ON_RANKS:
        if name in names:
            _require_marker_for(item, name)


def _require_marker_for(item: pytest.Item, name: str) -> None:
    pytest.fail(
        f"fixture {name!r} is only available in distributed tests: mark the test with "
        f"@pytest.mark.{MARKER_SIGNATURE}",
        pytrace=False,
    )


@pytest.fixture
def dist_backend(request: pytest.FixtureRequest) -> str:
    """The backend the test runs on (distributed tests only)."""
    from fsdp_testing.launcher import resolve_backend, session_settings

    spec = _require_marker(request, "dist_backend")
    return resolve_backend(spec, session_settings().backend)


def rank_side_fixtures(closure: dict[str, Any]) -> dict[str, Any]:
    """The fixtures of a test's closure (``name -> FixtureDef`` sequences, as pytest keeps them)
    that run on the ranks: those that request a rank fixture, or such a fixture, by name."""
    found: dict[str, Any] = {}

    def on_ranks(name: str, seen: frozenset[str]) -> bool:
        if name in ON_RANKS:
            return True
        defs = closure.get(name)
        if not defs or name in seen:
            return False
        fixturedef = defs[-1]
        if fixturedef.argname in ON_RANKS:  # our own, overridden by nobody
            return True
        if any(on_ranks(arg, seen | {name}) for arg in fixturedef.argnames):
            found[name] = fixturedef
            return True
        return False

    for name in list(closure):
        on_ranks(name, frozenset())
    return found


def validate_rank_side_fixtures(metafunc: pytest.Metafunc, spec: DistSpec) -> str | None:
    """What a fixture that runs on the ranks cannot be, found at collection (None: nothing):
    one scoped beyond a test where a rank's process group lives for one test (thread, local and
    fake mode), one defined in a class (a rank process cannot build the instance). The plugin
    fails the test with it at setup, that test alone (``refuse_at_setup``)."""
    closure = getattr(metafunc, "_arg2fixturedefs", {})
    for name, fixturedef in rank_side_fixtures(closure).items():
        scope = str(getattr(fixturedef, "scope", "function"))
        if scope != "function" and spec.mode is not Mode.PROCESS:
            return (
                f"{metafunc.definition.nodeid}: fixture {name!r} (scope={scope!r}) requests a "
                f"rank fixture, so it runs on each rank; in mode={spec.mode.value!r} a rank's "
                "process group lives for one test. Make it scope='function', or use "
                "mode='process' (warm rank processes keep it for its scope)."
            )
        func = getattr(fixturedef, "func", None)
        qualname = getattr(func, "__qualname__", "")
        if spec.mode is Mode.PROCESS and ("." in qualname or "<locals>" in qualname):
            return (
                f"{metafunc.definition.nodeid}: fixture {name!r} requests a rank fixture, so "
                f"each rank process sets it up, and it must import it: {qualname} is not a "
                "module-level function. Define it in the test module or a conftest.py, or use "
                "mode='thread'."
            )
    return None


_refused_key = pytest.StashKey["dict[str, str]"]()


def refuse_at_setup(metafunc: pytest.Metafunc, spec: DistSpec) -> None:
    """``pytest_generate_tests``: remember what ``validate_rank_side_fixtures`` found, for
    ``fail_if_refused`` (a collection error would stop the whole session)."""
    problem = validate_rank_side_fixtures(metafunc, spec)
    if problem is not None:
        refused = metafunc.config.stash.setdefault(_refused_key, {})
        refused[metafunc.definition.nodeid] = problem


def fail_if_refused(item: pytest.Item) -> None:
    """At setup, before any fixture: fail ``item`` with its fixtures' problem, if any."""
    refused = item.config.stash.get(_refused_key, {})
    problem = refused.get(item.nodeid.partition("[")[0])
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Any:
    """A fixture that requests a rank fixture, in a distributed test: described for the ranks
    (a :class:`RankSideFixture`), not run here. Any other fixture: pytest's own setup."""
    if fixturedef.argname in ON_RANKS or not fixturedef.argnames:
        return None
    item = getattr(request, "_pyfuncitem", None)
    spec = spec_of(item) if item is not None else None
    if spec is None or not any(_on_ranks(request, arg) for arg in fixturedef.argnames):
        return None
    kwargs: dict[str, Any] = {}
    for arg in fixturedef.argnames:
        kwargs[arg] = RankFixture("request") if arg == "request" else request.getfixturevalue(arg)
    func = fixturedef.func
    if spec.mode is Mode.PROCESS:
        module = func.__module__
        import sys

        path = getattr(sys.modules.get(module), "__file__", None)
        func = FunctionRef(module, path, func.__qualname__)
    cache_key = fixturedef.cache_key(request)
    node = getattr(request, "node", None)
    param = getattr(request, "param", None)
    placeholder = RankSideFixture(
        name=fixturedef.argname,
        func=func,
        kwargs=kwargs,
        scope=str(fixturedef.scope),
        key=f"{getattr(node, 'nodeid', '')}::{fixturedef.argname}[{cache_key!r}]",
        param=param,
    )
    fixturedef.cached_result = (placeholder, cache_key, None)
    if placeholder.scope != "function" and spec.mode is Mode.PROCESS:
        # Its scope ends in the parent: see [Note: fixtures on the ranks].
        fixturedef.addfinalizer(functools.partial(_tear_down_on_ranks, placeholder.key))
    return placeholder


def _tear_down_on_ranks(key: str) -> None:
    from fsdp_testing.launcher import tear_down_rank_fixture

    tear_down_rank_fixture(key)


def _on_ranks(request: Any, arg: str) -> bool:
    """Whether fixture ``arg`` of the test has a rank-side value (set up before this one)."""
    if arg == "request":
        return False
    if arg in ON_RANKS:
        return True
    try:
        value = request.getfixturevalue(arg)
    except pytest.FixtureLookupError:
        return False
    return isinstance(value, (RankSideFixture, RankFixture))
