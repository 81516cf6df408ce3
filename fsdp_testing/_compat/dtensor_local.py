"""``common_dtensor``'s ``LocalTensorMode`` classes: :class:`LocalDTensorTestBase`,
:class:`LocalDTensorOpTestBase`, :class:`LocalDTensorContinuousTestBase`, and
:func:`create_local_tensor_test_class`, which copies a test class onto one of them.

[Note: LocalTensorMode classes in fake mode]
torch's ``LocalDTensorTestBase`` (and the Op and Continuous ones) run the whole world in the
test's own process: a fake process group of ``world_size`` ranks, ``self.rank`` a per-rank
``SymInt``, and ``create_local_tensor_test_class`` enters ``LocalTensorMode`` around each test.
Here they run in fake mode (``dist_mode = "fake"``, rank 0 of a fake world of ``world_size``),
which is that: one rank thread of this process over torch's fake backend, now with the
launcher's timeout, hang report and failure report.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import unittest
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from .dtensor import (
    NUM_DEVICES,
    DTensorContinuousTestBase,
    DTensorOpTestBase,
    DTensorTestBase,
)

__all__ = [
    "LocalDTensorContinuousTestBase",
    "LocalDTensorOpTestBase",
    "LocalDTensorTestBase",
    "create_local_tensor_test_class",
    "make_wrapped",
]


class _LocalTensorClass:
    """What the ``LocalTensorMode`` classes share (see [Note: LocalTensorMode classes in fake
    mode])."""

    dist_mode: str | None = "fake"
    fake_rank: Any = 0
    world_size: Any

    @property
    def is_local_tensor_enabled(self) -> bool:
        return True

    def _handle_test_skip(self, msg: str) -> None:
        cast(unittest.TestCase, self).skipTest(msg)

    def _get_local_tensor_mode(self) -> Any:
        from torch.distributed._local_tensor import LocalTensorMode

        return LocalTensorMode(frozenset(range(self.world_size)))

    @property
    def rank(self) -> Any:
        """Every simulated rank at once: a ``SymInt`` whose value on rank ``r`` is ``r``."""
        from torch.distributed._local_tensor import LocalIntNode

        return torch.SymInt(LocalIntNode({r: r for r in range(self.world_size)}))

    @rank.setter
    def rank(self, rank: Any) -> None:
        del rank  # the rank is every rank

    def build_device_mesh(self) -> Any:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

        with maybe_disable_local_tensor_mode():
            return super().build_device_mesh()  # type: ignore[misc]

    def init_manual_seed_for_rank(self) -> None:
        torch.manual_seed(0)

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        torch.autograd._enable_record_function(False)

    def tearDown(self) -> None:
        from torch.distributed.tensor import _random

        _random._rng_tracker = None
        torch.autograd._enable_record_function(True)
        super().tearDown()  # type: ignore[misc]


class _FakeGroupMethods:
    """``init_pg``/``destroy_pg`` of the LocalTensorMode classes: the fake group of the world
    exists (the launcher's fake mode made it), so these keep torch's ``self._pg``."""

    world_size: Any
    _pg: Any

    def init_pg(self, eager_init: bool, backend: str | None = None) -> None:
        """Keep the fake group of the world as ``self._pg``.

        Args:
            eager_init: accepted for torch's signature.
            backend: accepted for torch's signature (the group is fake).
        """
        del eager_init, backend
        from torch.distributed import distributed_c10d

        self._pg = distributed_c10d._get_default_group()

    def destroy_pg(self, device_id: int | None = None) -> None:
        """Forget ``self._pg`` (the harness ends the fake group).

        Args:
            device_id: accepted for torch's signature.
        """
        del device_id
        self._pg = None

    def join_or_run(self, fn: Callable[[], Any]) -> Any:
        """torch's hook that runs ``fn`` in the test's process: here, as a bound method."""

        @functools.wraps(fn)
        def wrapper(self: Any) -> None:
            fn()

        return types.MethodType(wrapper, self)

    def _spawn_processes(self) -> None:
        """The world lives in this process: nothing to spawn."""

    def run_test(self, test_name: str, parent_pipe: Any = None) -> None:
        """Run ``test_name`` in this process (torch's hook)."""
        getattr(self, test_name)()


class LocalDTensorTestBase(_FakeGroupMethods, _LocalTensorClass, DTensorTestBase):
    """torch's ``LocalDTensorTestBase``: the world of :class:`DTensorTestBase` simulated in one
    process under ``LocalTensorMode``, run in fake mode (see [Note: LocalTensorMode classes in
    fake mode])."""


class LocalDTensorOpTestBase(_FakeGroupMethods, _LocalTensorClass, DTensorOpTestBase):
    """torch's ``LocalDTensorOpTestBase``: :class:`DTensorOpTestBase`'s world simulated in one
    process under ``LocalTensorMode``, run in fake mode."""

    def _spawn_threads(self) -> None:
        """The world lives in this process: nothing to spawn."""


class LocalDTensorContinuousTestBase(_LocalTensorClass, DTensorContinuousTestBase):  # type: ignore[misc]
    """torch's ``LocalDTensorContinuousTestBase``: :class:`DTensorContinuousTestBase`'s world
    simulated in one process, run in fake mode; ``world_size`` unset means
    :data:`NUM_DEVICES`."""

    def _declared_world_size(self) -> Any:
        declared = super()._declared_world_size()
        return NUM_DEVICES if declared == -2 else declared


def make_wrapped(fn: Callable[..., Any], ctxs: Iterable[Any]) -> Callable[..., Any]:
    """``fn`` (a test method) run inside ``ctxs``, dynamo reset first: each context manager is
    entered as it is, or, when callable, as ``ctx(self)``.

    Args:
        fn: the test method.
        ctxs: context managers or ``self -> context manager`` callables, entered in order.
    """
    contexts = list(ctxs)

    @functools.wraps(fn)
    def wrapped(self: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:  # never imported: nothing compiled to forget
            dynamo.reset()
        with contextlib.ExitStack() as stack:
            for ctx in contexts:
                stack.enter_context(ctx(self) if callable(ctx) else ctx)
            return fn(self)

    return wrapped


def create_local_tensor_test_class(
    orig_cls: type,
    skipped_tests: Iterable[str] | None = None,
    base_class: type = LocalDTensorTestBase,
) -> type:
    """A copy of the test class ``orig_cls`` named ``<name>WithLocalTensor`` that runs every
    test under ``LocalTensorMode`` on ``base_class`` (a LocalTensorMode class, run in fake mode)
    in front of ``orig_cls``'s bases. Assign it to a module global so the runner finds it.

    Args:
        orig_cls: the test class (already instantiated when parametrized).
        skipped_tests: names of tests the copy skips (e.g. those with rank-dependent control
            flow that a simulated world cannot take).
        base_class: default :class:`LocalDTensorTestBase`; :class:`LocalDTensorOpTestBase` for
            a :class:`DTensorOpTestBase` class.
    """
    skipped = set(skipped_tests or ())
    namespace: dict[str, Any] = {}
    for name, value in vars(orig_cls).items():
        if name in ("__dict__", "__weakref__"):
            continue
        if callable(value) and name in skipped:
            value = _skipped_test
        elif callable(value) and name.startswith("test_"):
            value = make_wrapped(value, [lambda test: test._get_local_tensor_mode()])
        namespace[name] = value
    new_name = f"{orig_cls.__name__}WithLocalTensor"
    namespace["__qualname__"] = new_name
    return type(new_name, (base_class, *orig_cls.__bases__), namespace)


def _skipped_test(self: unittest.TestCase) -> None:
    self.skipTest("Skipped test")
