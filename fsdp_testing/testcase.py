"""torch-compatible unittest base classes that run each ``test_*`` method on every rank through
the same launcher, warm pool, timeouts and per-rank reports as ``@pytest.mark.distributed``.

[Note: unittest methods on ranks]
In the parent, ``__init__`` replaces the test method on the instance with a launcher call, so
unittest (or pytest's unittest support) runs ``setUp`` in the parent, then "the method", which
ships a :class:`_MethodTask` (module, class, method name) to the ranks. Each rank imports the
class, makes its own instance (with the method left alone), sets ``rank``, ``world_size`` and
friends, runs ``setUpRank`` (and torch's ``perThreadSetUp`` in thread mode), the method, and
``tearDownRank``/``perThreadTearDown``. Attributes set on the parent's instance do not travel,
exactly as in torch's harness, where each rank builds its instance afresh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import functools
import itertools
import os
import sys
import unittest
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fsdp_testing._compat.accelerator_errors import needs_accelerator as _needs_accelerator
from fsdp_testing._launch.spec import DistSpec, Mode, fake_ranks, mode_named
from fsdp_testing._protocol import FunctionRef, Task
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.resolve import alias_main_module
from fsdp_testing._rank.skips import TEST_SKIPS, TestSkip, multi_device_message
from fsdp_testing._report.expectation import expectation_of
from fsdp_testing._report.text import add_note
from fsdp_testing._unittest.assertions import TestCase
from fsdp_testing._unittest.process_group import (
    CompatibleInitProcessGroup,
    fresh_store_file,
    remove_if_present,
)
from fsdp_testing._unittest.world import (
    WorldChoice,
    choose_world_size,
    in_test_world,
    scaled_timeout,
)

__all__ = [
    "TEST_SKIPS",
    "DistributedTestFailure",
    "MultiProcessTestCase",
    "MultiThreadedTestCase",
    "TestSkip",
    "run_subtests",
    "skip_if_lt_x_gpu",
]

_on_rank: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_testing_on_rank", default=False
)
_F = TypeVar("_F", bound=Callable[..., Any])


class DistributedTestFailure(AssertionError):
    """A test method failed on one or more ranks; the message holds every rank's report."""


def _accelerator_count() -> int:
    from fsdp_testing._compat.env import accelerator_count

    return accelerator_count()


def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = True) -> Callable[[_F], _F]:
    """Skip a test that needs ``x`` GPUs when fewer are present.

    Unlike torch's decorator, ``allow_cpu`` defaults to True: on a machine with no accelerator
    the test runs on CPU ranks over gloo (which is what makes migrated FSDP tests useful on
    CPU-only CI), on at least ``x`` of them whatever the class's ``world_size`` says (see
    [Note: CPU world size]). Pass ``allow_cpu=False`` for a test that truly needs GPUs. A machine
    with some GPUs, but fewer than ``x``, skips either way.

    Args:
        x: number of GPUs the test needs.
        allow_cpu: run on CPU ranks when there is no accelerator (default True).
    """

    def decorator(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            reason = _gpu_skip_reason(x, allow_cpu)
            if reason is not None:
                raise unittest.SkipTest(reason)
            return fn(*args, **kwargs)

        wrapper._fsdp_testing_gpus = (x, allow_cpu)  # type: ignore[attr-defined]
        # torch 2.15's attribute, which its test/conftest.py reads at collection to place a test
        # on a machine with enough GPUs.
        wrapper._min_gpus_required = x  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorator


def _gpu_skip_reason(x: int, allow_cpu: bool) -> str | None:
    count = _accelerator_count()
    if count >= x or (allow_cpu and count == 0):
        return None
    return multi_device_message(x)


def run_subtests(
    cls_inst: unittest.TestCase,
    subtest_config: dict[str, list[Any]],
    test_fn: Callable[..., Any],
    *test_args: Any,
    **test_kwargs: Any,
) -> None:
    """Run ``test_fn`` once per combination of ``subtest_config`` values, in one process group.

    A failing subtest is labelled with its configuration (an exception note, shown in the rank's
    report) and stops the run; every rank meets at a barrier after each subtest.

    Args:
        cls_inst: the running test case.
        subtest_config: keyword name -> list of values; the cartesian product is run.
        test_fn: called as ``test_fn(*test_args, **test_kwargs, **one_config)``.
    """
    import torch.distributed as dist

    names = list(subtest_config)
    for values in itertools.product(*(subtest_config[n] for n in names)):
        config = dict(zip(names, values, strict=True))
        label = ", ".join(f"{k}={v!r}" for k, v in config.items())
        try:
            with cls_inst.subTest(**config):
                test_fn(*test_args, **test_kwargs, **config)
        except unittest.SkipTest:
            raise
        except BaseException as exc:
            add_note(exc, f"subtest {label}")
            raise
        if dist.is_initialized():
            dist.barrier()


@dataclasses.dataclass(frozen=True)
class _MethodTask:
    """Runs one test method of one class on a rank (see [Note: unittest methods on ranks])."""

    cls_ref: FunctionRef
    method: str
    file_name: str

    def run_on_rank(self, ctx: RankContext) -> None:
        from fsdp_testing._rank.resolve import resolve

        cls = resolve(self.cls_ref)
        token = _on_rank.set(True)
        try:
            case = cls(self.method)
        finally:
            _on_rank.reset(token)
        case._run_method_on_rank(ctx, self.method, self.file_name)


class _LocalMethodTask:
    """Thread mode: the class object itself is at hand, nothing needs importing."""

    def __init__(self, cls: type, method: str, file_name: str) -> None:
        self.cls, self.method, self.file_name = cls, method, file_name

    def run_on_rank(self, ctx: RankContext) -> None:
        token = _on_rank.set(True)
        try:
            case = self.cls(self.method)
        finally:
            _on_rank.reset(token)
        case._run_method_on_rank(ctx, self.method, self.file_name)


class _DistributedTestCase(TestCase):
    """Shared machinery of the process and thread base classes."""

    _mode = Mode.PROCESS
    timeout: float | datetime.timedelta | None = None
    """Per-test timeout (seconds or a ``timedelta``). None: the session default (``--dist-timeout``,
    120 s), multiplied by ``world_size / CPU cores`` when there are more ranks than cores."""
    backend: str | None = None
    """Process mode: ``"gloo"``/``"nccl"``, None for nccl only with enough GPUs."""
    use_warm_pool: bool = True
    """False: run this class's methods on freshly forked rank processes."""
    dist_mode: str | None = None
    """Overrides the class's mode as the marker's ``mode`` does: ``"local"`` (every rank here,
    exact collectives, 64+ ranks on one core) or ``"fake"`` (rank ``fake_rank`` of any world)."""
    fake_rank: int | tuple[int, ...] | list[int] = 0
    """Fake mode: the rank to play; a list runs each method once per rank (default 0)."""

    rank: int
    file_name: str

    def __init__(self, methodName: str = "runTest") -> None:
        super().__init__(methodName)
        self.rank = -1
        self._ctx: RankContext | None = None
        self._fsdp_testing_note: str | None = None
        if not _on_rank.get() and methodName != "runTest":
            self._rank_method = methodName
            setattr(self, methodName, self._parent_method(getattr(type(self), methodName)))

    def _parent_method(self, original: Callable[..., Any]) -> Callable[[], None]:
        # unittest reads expectedFailure/skip markers from the method it calls: keep them.
        def run_on_ranks() -> None:
            __tracebackhide__ = True
            self._run_on_ranks()

        run_on_ranks.__dict__.update(getattr(original, "__dict__", {}))
        run_on_ranks.__dict__.pop("__wrapped__", None)
        run_on_ranks.__name__ = getattr(original, "__name__", self._rank_method)
        run_on_ranks.__doc__ = getattr(original, "__doc__", None)
        return run_on_ranks

    def __getattribute__(self, name: str) -> Any:
        # On a rank, world_size is the world the test runs in, whatever the class computes
        # (a class sized by the GPU count says 0 on a CPU machine). See [Note: CPU world size].
        if name == "world_size":
            ctx = object.__getattribute__(self, "__dict__").get("_ctx")
            if ctx is not None:
                return ctx.world_size
        return super().__getattribute__(name)

    # --- torch's public surface ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks: override in a subclass (default: the GPUs if any, else 4)."""
        return _accelerator_count() or 4

    @property
    def process_group(self) -> Any:
        """The group of all ranks (only on a rank)."""
        return self._rank_context().process_group

    @property
    def device(self) -> Any:
        """This rank's device: cpu for gloo and threads, the rank's GPU for nccl."""
        return self._rank_context().device

    @property
    def init_method(self) -> str:
        return f"file://{self.file_name}"

    @property
    def destroy_pg_upon_exit(self) -> bool:
        return True

    def run_subtests(self, *args: Any, **kwargs: Any) -> None:
        """See :func:`run_subtests`."""
        run_subtests(self, *args, **kwargs)

    def _spawn_processes(self) -> None:
        """torch's ``setUp`` step; here ranks start (or are reused) when the method runs, so this
        only checks that the world size is usable."""
        if self.world_size < 1:
            raise ValueError(
                f"{type(self).__name__}.world_size must be at least 1, got {self.world_size}"
            )

    _spawn_threads = _spawn_processes

    def setUpRank(self) -> None:
        """Runs on every rank before the test method (override; the default does nothing)."""

    def tearDownRank(self) -> None:
        """Runs on every rank after the test method, even when it failed."""

    # --- parent side --------------------------------------------------------------------------

    def _rank_context(self) -> RankContext:
        if self._ctx is None:
            raise AttributeError(
                f"{type(self).__name__}: rank, process_group and device exist only inside a test "
                "method running on the ranks (not in the parent's setUp/tearDown)"
            )
        return self._ctx

    def _declared_world_size(self) -> Any:
        """The class's ``world_size``, or the method's ``requires_world_size(n)``."""
        method = getattr(type(self), self._rank_method, None)
        required = getattr(method, "_required_world_size", None)
        return required if required is not None else self.world_size

    def _choose_world(self) -> WorldChoice:
        method = getattr(type(self), self._rank_method, None)
        gpus = getattr(method, "_fsdp_testing_gpus", None)
        return choose_world_size(
            self._declared_world_size(),
            accelerators=_accelerator_count(),
            min_ranks=gpus[0] if gpus and gpus[1] else None,
            owner=f"{type(self).__name__}.world_size",
        )

    def _spec(self, world_size: int | None = None, base_timeout: float | None = None) -> DistSpec:
        if world_size is None:
            world_size = self._choose_world().world_size
        timeout = self.timeout
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if timeout is None and base_timeout is not None:
            timeout = scaled_timeout(base_timeout, world_size)
        return DistSpec(world_size, self._launch_backend(), self._dist_mode(), timeout)

    def _dist_mode(self) -> Mode:
        """The class's ``dist_mode``, else its own mode."""
        return mode_named(getattr(type(self), "dist_mode", None), self._mode, type(self).__name__)

    def _launch_backend(self) -> str | None:
        """The class's ``backend`` attribute (None: automatic)."""
        backend = getattr(type(self), "backend", None)
        return backend if isinstance(backend, str) else None

    @contextlib.contextmanager
    def _rank_method_context(self) -> Iterator[None]:
        """Wraps the test method on each rank (subclasses add engine selection, seeding)."""
        yield

    def _run_on_ranks(self) -> None:
        __tracebackhide__ = True
        from fsdp_testing.launcher import (
            UnavailableBackend,
            VerdictOutcome,
            resolve_backend,
            run_distributed,
            session_settings,
        )

        method = getattr(type(self), self._rank_method)
        gpus = getattr(method, "_fsdp_testing_gpus", None)
        if gpus is not None:
            reason = _gpu_skip_reason(*gpus)
            if reason is not None:
                raise unittest.SkipTest(reason)
        settings = session_settings()
        choice = self._choose_world()
        spec = self._spec(choice.world_size, settings.timeout)
        self._fsdp_testing_note = choice.note
        try:
            resolve_backend(spec, settings.backend)
        except UnavailableBackend as exc:
            raise unittest.SkipTest(str(exc)) from None
        if choice.note:
            sys.stdout.write(f"{self.id()}: {choice.note}\n")
        # The parent's rendezvous file when setUp made one (MultiProcessTestCase), so the parent
        # and the ranks name the same file; else a fresh name, removed after the run.
        parents = self.__dict__.get("file_name")
        file_name = parents if isinstance(parents, str) else fresh_store_file(create=False)
        test_id = self.id()
        if spec.mode is Mode.PROCESS:
            module = sys.modules[type(self).__module__]
            if module.__name__ == "__main__":
                alias_main_module()  # See [Note: a test file run as a script]
            ref = FunctionRef(
                module.__name__, getattr(module, "__file__", None), type(self).__qualname__
            )
            target: Any = _MethodTask(ref, self._rank_method, file_name)
        else:
            target = _LocalMethodTask(type(self), self._rank_method, file_name)
        specs = [spec]
        if spec.mode is Mode.FAKE:
            ranks = fake_ranks(type(self).fake_rank, spec.world_size, type(self).__name__)
            specs = [dataclasses.replace(spec, rank=r) for r in ranks]
        failures: list[str] = []
        skips: list[str] = []
        try:
            for one in specs:
                verdict = run_distributed(
                    Task(target=target, kwargs={}, test_id=test_id, tbstyle=settings.tbstyle),
                    one,
                    settings,
                    pool=None if self.use_warm_pool else False,
                    expect=expectation_of(method),
                )
                played = f"[fake rank {one.rank}] " if len(specs) > 1 else ""
                for title, content in verdict.sections:
                    sys.stdout.write(f"----- {played}{title} -----\n{content}")
                if verdict.outcome is not VerdictOutcome.PASSED:
                    failed = verdict.outcome is VerdictOutcome.FAILED
                    (failures if failed else skips).append(f"{played}{verdict.message}")
        finally:
            if file_name != parents and os.path.exists(file_name):
                os.unlink(file_name)
        note = f" [{choice.note}]" if choice.note else ""
        if failures:
            raise DistributedTestFailure("\n\n".join(failures) + note)
        if skips:
            raise unittest.SkipTest(f"{skips[0]}{note}")

    # --- rank side ----------------------------------------------------------------------------

    def _run_method_on_rank(self, ctx: RankContext, method: str, file_name: str) -> None:
        self._ctx = ctx
        self.rank = ctx.rank
        self.file_name = file_name
        try:
            self.setUpRank()
            if self._dist_mode() in (Mode.THREAD, Mode.LOCAL):
                self.perThreadSetUp()
        except BaseException as exc:
            add_note(exc, f"in setUpRank on rank {ctx.rank}")
            raise
        try:
            with (
                in_test_world(ctx.world_size),
                CompatibleInitProcessGroup(ctx),
                self._rank_method_context(),
            ):
                getattr(self, method)()
        except unittest.SkipTest:
            raise
        except Exception as exc:
            reason = _needs_accelerator(exc) if _accelerator_count() == 0 else None
            if reason is None:
                raise
            raise unittest.SkipTest(
                f"the test needs an accelerator, which this machine lacks ({reason})"
            ) from exc
        finally:
            if self._dist_mode() in (Mode.THREAD, Mode.LOCAL):
                self.perThreadTearDown()
            self.tearDownRank()

    def perThreadSetUp(self) -> None:
        """Thread and local mode: runs in each rank thread before the method (torch's name)."""

    def perThreadTearDown(self) -> None:
        """Thread and local mode: runs in each rank thread after the method (torch's name)."""


class MultiProcessTestCase(_DistributedTestCase):
    """Each ``test_*`` method runs on ``world_size`` rank processes (gloo on CPU, nccl with enough
    GPUs), in the warm pool. Inside a method: ``self.rank``, ``self.world_size``,
    ``self.process_group``, ``self.device``, ``self.file_name``/``self.init_method``."""

    _mode = Mode.PROCESS

    def setUp(self) -> None:
        """As torch's: ``self.file_name`` names an empty file that the ranks see as theirs too
        (``self.init_method``, a ``FileStore``), so a ``tearDown`` may remove it (torch's tests
        do: ``os.remove(self.file_name)``). The harness removes it after the test if they do
        not."""
        super().setUp()
        self.file_name = fresh_store_file(create=True)
        self.addCleanup(remove_if_present, self.file_name)


class MultiThreadedTestCase(_DistributedTestCase):
    """Each ``test_*`` method runs on ``world_size`` threads over torch's threaded process group."""

    _mode = Mode.THREAD

    @property
    def world_size(self) -> int:
        return 4
