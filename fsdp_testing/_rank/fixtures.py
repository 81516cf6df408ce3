"""The values of a test's arguments on a rank: the rank fixtures, pytest's own process fixtures
made for the rank's process, and the user's fixtures that request them, set up here and torn
down when the test ends (or kept for their scope).

[Note: fixtures on the ranks]
A fixture's value exists where its code runs. ``rank``, ``process_group`` and ``device`` exist
only on a rank, so a fixture of the user's that requests one of them (or requests such a
fixture) must run on each rank too: in the parent its value would be built on placeholders.
The plugin sees such a fixture at setup (``pytest_fixture_setup``) and, instead of running it,
gives pytest a :class:`~fsdp_testing._protocol.RankSideFixture` that names the function, its
arguments, its scope and its parameter. Each rank sets it up before the test's body (a
generator fixture up to its ``yield``) and tears it down after, in reverse order; an error in
either is the rank's failure, named after the fixture. A fixture of a scope broader than
``function`` is kept on a warm rank process for the tests that share it (the same key: scope,
the node it is scoped to, the parameter) and torn down when pytest ends its scope in the
parent, as pytest would: at the end of its module or class, before the next parameter is set
up, at the end of the session (the parent's fixture finalizer sends each warm generation a
task that runs ``tear_down_key``), or when the rank process ends, whichever comes first; in
thread, local and fake mode a rank's process group lives for one test, so such a scope fails
the test that asks for it. The fixture may request ``request`` (``param``, ``fixturename``,
``scope`` and ``addfinalizer`` work) and pytest's process fixtures.

pytest's own fixtures that change the process they run in (``monkeypatch``, ``recwarn``,
``caplog``, ``capsys``) would change the parent, not the rank, and their undo would run in the
parent: a process-mode rank makes its own and undoes it when the test ends, so a warm rank
serves the next test as a fresh process would.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from fsdp_testing._protocol import (
    PROCESS_FIXTURES,
    RANK_FIXTURES,
    FunctionRef,
    RankFixture,
    RankSideFixture,
)
from fsdp_testing._rank.context import RankContext
from fsdp_testing._report.text import add_note

__all__ = ["arguments", "tear_down_key", "tear_down_scoped"]

_scoped: dict[str, tuple[Any, Iterator[Any] | None, list[Callable[[], None]]]] = {}
"""Values of fixtures broader than ``function`` kept on this process, by key, with their
generator and finalizers, in setup order."""


@contextlib.contextmanager
def arguments(kwargs: dict[str, Any], ctx: RankContext) -> Iterator[dict[str, Any]]:
    """The test's keyword arguments with every placeholder made on this rank; what was set up
    for the test is torn down when the block ends (its errors raised after the body's)."""
    test = _TestFixtures(ctx)
    try:
        values = {name: test.value(name, value) for name, value in kwargs.items()}
    except BaseException:
        test.close(body_failed=True)
        raise
    try:
        yield values
    except BaseException:
        test.close(body_failed=True)
        raise
    test.close(body_failed=False)


def tear_down_key(key: str) -> None:
    """Tear down the broader-scoped fixture kept under ``key``, if this rank holds it: pytest
    ended its scope in the parent (the end of its module, class or session, or a new parameter).
    Run as a task of its own; an error is this rank's failure, named after the fixture."""
    if key not in _scoped:
        return
    _, gen, finalizers = _scoped.pop(key)
    name = key.rpartition("::")[2].partition("[")[0]
    try:
        _finish(name, gen, finalizers)
    except BaseException as exc:
        add_note(exc, f"(in the teardown of fixture {name!r} at the end of its scope)")
        raise


def tear_down_scoped() -> None:
    """Tear down the fixtures this process kept for a broader scope (the rank ends), newest
    first; errors are printed (nobody waits for them)."""
    for key in reversed(list(_scoped)):
        _, gen, finalizers = _scoped.pop(key)
        try:
            _finish(key, gen, finalizers)
        except BaseException as exc:  # the process is ending: say so, go on
            print(f"fsdp_testing: tearing down fixture {key} failed: {exc!r}", file=sys.stderr)


class _Request:
    """What a fixture set up on a rank gets as ``request``."""

    def __init__(self, fixture: RankSideFixture, finalizers: list[Callable[[], None]]) -> None:
        self.fixturename = fixture.name
        self.scope = fixture.scope
        self.param = fixture.param
        self._finalizers = finalizers

    def addfinalizer(self, finalizer: Callable[[], None]) -> None:
        self._finalizers.append(finalizer)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"request.{name} is not available to fixture {self.fixturename!r}, which runs on "
            "each rank (it requests a rank fixture): it has request.param, fixturename, scope "
            "and addfinalizer. Read what else you need in a fixture of the pytest process and "
            "pass it as an argument."
        )


class _TestFixtures:
    """What one test set up on this rank, torn down in reverse order by :meth:`close`."""

    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx
        self._made: dict[str, Any] = {}  # process fixtures and function-scoped user fixtures
        self._teardowns: list[tuple[str, Callable[[], None]]] = []

    def value(self, name: str, value: Any) -> Any:
        if isinstance(value, RankFixture):
            if value.name in RANK_FIXTURES:
                return self._ctx.value(value.name)
            if value.name in PROCESS_FIXTURES:
                return self._process_fixture(value.name)
            raise AssertionError(f"[rank {self._ctx.rank}] unknown rank fixture {value.name!r}")
        if isinstance(value, RankSideFixture):
            return self._user_fixture(value)
        return value

    def _process_fixture(self, name: str) -> Any:
        if name not in self._made:
            manager = _MAKERS[name]()
            self._made[name] = manager.__enter__()
            self._teardowns.append((name, lambda: _exit(manager)))
        return self._made[name]

    def _user_fixture(self, fixture: RankSideFixture) -> Any:
        broad = fixture.scope != "function"
        if broad and fixture.key in _scoped:
            return _scoped[fixture.key][0]
        if not broad and fixture.name in self._made:
            return self._made[fixture.name]
        finalizers: list[Callable[[], None]] = []
        kwargs = {}
        for arg, value in fixture.kwargs.items():
            if isinstance(value, RankFixture) and value.name == "request":
                kwargs[arg] = _Request(fixture, finalizers)
            else:
                kwargs[arg] = self.value(arg, value)
        func = _function(fixture)
        try:
            result = func(**kwargs)
            gen = None
            if _is_generator(result):
                gen = result
                result = next(gen)
        except StopIteration:
            raise ValueError(
                f"fixture {fixture.name!r} did not yield a value (a generator fixture must yield "
                "once)"
            ) from None
        except BaseException as exc:
            add_note(exc, f"(in the setup of fixture {fixture.name!r} on rank {self._ctx.rank})")
            raise
        if broad:
            _scoped[fixture.key] = (result, gen, finalizers)
        else:
            self._made[fixture.name] = result
            self._teardowns.append((fixture.name, lambda: _finish(fixture.name, gen, finalizers)))
        return result

    def close(self, *, body_failed: bool) -> None:
        """Tear down what the test set up, newest first. The first error is raised once all
        ran, unless the body already failed (then the body's error is the report)."""
        first: BaseException | None = None
        while self._teardowns:
            name, teardown = self._teardowns.pop()
            try:
                teardown()
            except BaseException as exc:
                add_note(exc, f"(in the teardown of fixture {name!r} on rank {self._ctx.rank})")
                first = first or exc
        self._made.clear()
        if first is not None and not body_failed:
            raise first


def _exit(manager: contextlib.AbstractContextManager[Any]) -> None:
    manager.__exit__(None, None, None)


def _function(fixture: RankSideFixture) -> Callable[..., Any]:
    func = fixture.func
    if isinstance(func, FunctionRef):
        from fsdp_testing._rank.resolve import resolve

        func = resolve(func)
    unwrap = getattr(func, "_get_wrapped_function", None)  # pytest's FixtureFunctionDefinition
    return unwrap() if unwrap is not None else func


def _is_generator(value: Any) -> bool:
    import inspect

    return inspect.isgenerator(value)


def _finish(name: str, gen: Iterator[Any] | None, finalizers: list[Callable[[], None]]) -> None:
    """Run a fixture's teardown: its finalizers (newest first), then the rest of its generator."""
    while finalizers:
        finalizers.pop()()
    if gen is None:
        return
    try:
        next(gen)
    except StopIteration:
        return
    raise ValueError(f"fixture {name!r} yielded twice; a fixture yields once")


# --- pytest's process fixtures, made on a rank -----------------------------------------------


@contextlib.contextmanager
def _monkeypatch() -> Iterator[Any]:
    import pytest

    patch = pytest.MonkeyPatch()
    try:
        yield patch
    finally:
        patch.undo()


@contextlib.contextmanager
def _recwarn() -> Iterator[Any]:
    from _pytest.recwarn import WarningsRecorder

    recorder = WarningsRecorder(_ispytest=True)
    with recorder:
        warnings.simplefilter("default")
        yield recorder


class _Caplog:
    """``caplog`` on a rank: the records logged on this rank during the test (pytest's own
    fixture needs the test item, which lives in the pytest process)."""

    def __init__(self) -> None:
        from _pytest.logging import LogCaptureHandler

        self.handler = LogCaptureHandler()
        self._levels: dict[str | None, int] = {}

    @property
    def records(self) -> list[logging.LogRecord]:
        return list(self.handler.records)

    @property
    def text(self) -> str:
        return self.handler.stream.getvalue()

    @property
    def record_tuples(self) -> list[tuple[str, int, str]]:
        return [(r.name, r.levelno, r.getMessage()) for r in self.handler.records]

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.handler.records]

    def clear(self) -> None:
        self.handler.reset()

    def set_level(self, level: int | str, logger: str | None = None) -> None:
        target = logging.getLogger(logger)
        self._levels.setdefault(logger, target.level)
        target.setLevel(level)
        self.handler.setLevel(level)

    @contextlib.contextmanager
    def at_level(self, level: int | str, logger: str | None = None) -> Iterator[None]:
        target = logging.getLogger(logger)
        before, handler_before = target.level, self.handler.level
        target.setLevel(level)
        self.handler.setLevel(level)
        try:
            yield
        finally:
            target.setLevel(before)
            self.handler.setLevel(handler_before)

    def _restore(self) -> None:
        for logger, level in self._levels.items():
            logging.getLogger(logger).setLevel(level)


@contextlib.contextmanager
def _caplog() -> Iterator[Any]:
    caplog = _Caplog()
    root = logging.getLogger()
    root.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        root.removeHandler(caplog.handler)
        caplog._restore()


class _Capsys:
    """``capsys`` on a rank: ``readouterr()`` returns what the rank printed since the test began
    or the last call; what is never read stays in the rank's captured output."""

    def __init__(self) -> None:
        self._out, self._err = io.StringIO(), io.StringIO()

    def readouterr(self) -> Any:
        from _pytest.capture import CaptureResult

        out, err = self._out.getvalue(), self._err.getvalue()
        for stream in (self._out, self._err):
            stream.seek(0)
            stream.truncate()
        return CaptureResult(out, err)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        yield  # the rank's output goes to its report either way


@contextlib.contextmanager
def _capsys() -> Iterator[Any]:
    capsys = _Capsys()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = capsys._out, capsys._err
    try:
        yield capsys
    finally:
        sys.stdout, sys.stderr = saved
        left = capsys.readouterr()
        sys.stdout.write(left.out)
        sys.stderr.write(left.err)


_MAKERS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "monkeypatch": _monkeypatch,
    "recwarn": _recwarn,
    "caplog": _caplog,
    "capsys": _capsys,
}
