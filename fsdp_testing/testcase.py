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

import contextvars
import dataclasses
import functools
import itertools
import os
import sys
import tempfile
import unittest
from collections.abc import Callable
from typing import Any, TypeVar

from fsdp_testing._launch.spec import DistSpec, Mode
from fsdp_testing._protocol import FunctionRef, Task
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.skips import TEST_SKIPS, TestSkip

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
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = True) -> Callable[[_F], _F]:
    """Skip a test that needs ``x`` GPUs when fewer are present.

    Unlike torch's decorator, ``allow_cpu`` defaults to True: on a machine with no accelerator
    the test runs on CPU ranks over gloo (which is what makes migrated FSDP tests useful on
    CPU-only CI). Pass ``allow_cpu=False`` for a test that truly needs GPUs. A machine with some
    GPUs, but fewer than ``x``, skips either way.

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
        return wrapper  # type: ignore[return-value]

    return decorator


def _gpu_skip_reason(x: int, allow_cpu: bool) -> str | None:
    count = _accelerator_count()
    if count >= x or (allow_cpu and count == 0):
        return None
    skip = TEST_SKIPS.get(f"multi-gpu-{x}")
    return skip.message if skip else f"Need at least {x} CUDA devices"


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
            exc.add_note(f"subtest {label}")
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
        from fsdp_testing._rank.import_test import resolve

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


class _DistributedTestCase(unittest.TestCase):
    """Shared machinery of the process and thread base classes."""

    _mode = Mode.PROCESS
    timeout: float | None = None
    """Seconds before a test method counts as hung (None: the session default, 120 s)."""
    backend: str | None = None
    """Process mode: ``"gloo"``/``"nccl"``, None for nccl only with enough GPUs."""
    use_warm_pool: bool = True
    """False: run this class's methods on freshly forked rank processes."""

    rank: int
    file_name: str

    def __init__(self, methodName: str = "runTest") -> None:
        super().__init__(methodName)
        self.rank = -1
        self._ctx: RankContext | None = None
        if not _on_rank.get() and methodName != "runTest":
            self._rank_method = methodName
            setattr(self, methodName, self._run_on_ranks)

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

    def _spec(self) -> DistSpec:
        return DistSpec(self.world_size, self.backend, self._mode, self.timeout)

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
        spec = self._spec()
        settings = session_settings()
        try:
            resolve_backend(spec, settings.backend)
        except UnavailableBackend as exc:
            raise unittest.SkipTest(str(exc)) from None
        fd, file_name = tempfile.mkstemp(prefix="fsdp-testing-store-")
        os.close(fd)
        os.unlink(file_name)
        test_id = self.id()
        if self._mode is Mode.PROCESS:
            module = sys.modules[type(self).__module__]
            ref = FunctionRef(
                module.__name__, getattr(module, "__file__", None), type(self).__qualname__
            )
            target: Any = _MethodTask(ref, self._rank_method, file_name)
        else:
            target = _LocalMethodTask(type(self), self._rank_method, file_name)
        try:
            verdict = run_distributed(
                Task(target=target, kwargs={}, test_id=test_id),
                spec,
                settings,
                pool=None if self.use_warm_pool else False,
            )
        finally:
            if os.path.exists(file_name):
                os.unlink(file_name)
        for title, content in verdict.sections:
            sys.stdout.write(f"----- {title} -----\n{content}")
        if verdict.outcome is VerdictOutcome.FAILED:
            raise DistributedTestFailure(verdict.message)
        if verdict.outcome in (VerdictOutcome.SKIPPED, VerdictOutcome.XFAILED):
            raise unittest.SkipTest(verdict.message)

    # --- rank side ----------------------------------------------------------------------------

    def _run_method_on_rank(self, ctx: RankContext, method: str, file_name: str) -> None:
        self._ctx = ctx
        self.rank = ctx.rank
        self.file_name = file_name
        try:
            self.setUpRank()
            if self._mode is Mode.THREAD:
                self.perThreadSetUp()
        except BaseException as exc:
            exc.add_note(f"in setUpRank on rank {ctx.rank}")
            raise
        try:
            with _compatible_init_process_group(ctx):
                getattr(self, method)()
        finally:
            if self._mode is Mode.THREAD:
                self.perThreadTearDown()
            self.tearDownRank()

    def perThreadSetUp(self) -> None:
        """Thread mode: runs in each rank thread before the method (torch's name)."""

    def perThreadTearDown(self) -> None:
        """Thread mode: runs in each rank thread after the method (torch's name)."""


class _compatible_init_process_group:
    """Tests written for torch's ``MultiProcessTestCase`` join the process group themselves
    (``dist.init_process_group(..., init_method=self.init_method)``) and leave it at the end. On
    a warm rank the group already exists: joining it again with the same rank and world size is
    accepted as a no-op and leaving the default group is deferred to the pool."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        import torch.distributed as dist

        self._init, self._destroy = dist.init_process_group, dist.destroy_process_group
        ctx, real_init, real_destroy = self.ctx, self._init, self._destroy

        def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
            if not dist.is_initialized():
                return real_init(backend, *args, **kwargs)
            rank, ws = kwargs.get("rank", ctx.rank), kwargs.get("world_size", ctx.world_size)
            wanted = str(backend).lower() if backend is not None else None
            if (rank, ws) != (ctx.rank, ctx.world_size) or (
                wanted is not None
                and wanted not in ctx.dist_backend
                and ctx.dist_backend not in wanted
            ):
                raise ValueError(
                    f"init_process_group(backend={backend!r}, rank={rank}, world_size={ws}) on "
                    f"a rank that already belongs to a {ctx.dist_backend} group of "
                    f"{ctx.world_size} as rank {ctx.rank}: set the test class's world_size/"
                    "backend to match instead"
                )

        def destroy_process_group(group: Any = None) -> None:
            if group is None or group is dist.GroupMember.WORLD:
                return
            real_destroy(group)

        dist.init_process_group = init_process_group
        dist.destroy_process_group = destroy_process_group

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.init_process_group = self._init
        dist.destroy_process_group = self._destroy


class MultiProcessTestCase(_DistributedTestCase):
    """Each ``test_*`` method runs on ``world_size`` rank processes (gloo on CPU, nccl with enough
    GPUs), in the warm pool. Inside a method: ``self.rank``, ``self.world_size``,
    ``self.process_group``, ``self.device``, ``self.file_name``/``self.init_method``."""

    _mode = Mode.PROCESS


class MultiThreadedTestCase(_DistributedTestCase):
    """Each ``test_*`` method runs on ``world_size`` threads over torch's threaded process group."""

    _mode = Mode.THREAD

    @property
    def world_size(self) -> int:
        return 4
