"""``common_distributed``'s other test-case classes on fsdp_testing's launcher:
``DistributedTestBase``, ``MultiProcContinuousTest``, the dynamo ones and
``C10dTorchCommsTestBase``."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import unittest
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_testing._unittest.assertions import TestCase
from fsdp_testing.testcase import MultiProcessTestCase

from .env import TORCH_RELEASE, accelerator_count

__all__ = [
    "C10dTorchCommsTestBase",
    "DistributedTestBase",
    "DynamoDistributedMultiProcTestCase",
    "DynamoDistributedSingleProcTestCase",
    "MultiProcContinuousTest",
]

_BACKEND_BY_DEVICE = (("cuda", "nccl"), ("hpu", "hccl"), ("xpu", "xccl"))


def _backend_for(device: str) -> str:
    return next((backend for kind, backend in _BACKEND_BY_DEVICE if kind in device), "gloo")


def backend_available(backend: str, release: tuple[int, int] = TORCH_RELEASE) -> bool:
    """Whether torch ``release`` would let a test class ask for ``backend``: from 2.15
    ``dist.is_backend_available`` (third-party backends too; an unknown name is unavailable),
    before it only nccl, gloo, mpi and xccl were checked and any other name let the class run."""
    if release >= (2, 15):
        return bool(dist.is_backend_available(backend))
    checks = {
        "nccl": dist.is_nccl_available,
        "gloo": dist.is_gloo_available,
        "mpi": dist.is_mpi_available,
        "xccl": getattr(dist, "is_xccl_available", lambda: False),
    }
    check = checks.get(backend)
    return check is None or bool(check())


@contextlib.contextmanager
def _world_size_env(world_size: int) -> Iterator[None]:
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


class DistributedTestBase(MultiProcessTestCase):
    """torch's ``DistributedTestBase``: the body calls ``self.create_pg(device)`` to get the
    default group (here it already exists: the call checks the device and returns it), and sees
    ``WORLD_SIZE`` in its environment."""

    @contextlib.contextmanager
    def _rank_method_context(self) -> Iterator[None]:
        with _world_size_env(self.world_size), super()._rank_method_context():
            yield

    def backend(self, device: str) -> str:  # type: ignore[override]
        """The backend for ``device``: nccl for cuda, hccl for hpu, xccl for xpu, else gloo."""
        return _backend_for(device)

    def create_pg(
        self, device: str, world_size: int | None = None, backend: str | None = None
    ) -> Any:
        """The process group of the test's ranks for ``device``: the default group (here it
        already exists, so the call checks the device and returns it). Skips the test when
        ``device`` or ``backend`` needs what this machine lacks.

        Args:
            device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
            world_size: must equal the test's world size when given.
            backend: the backend (torch 2.15's argument; default: the device's, as
                :meth:`backend` says). When the default group runs another one, a group of
                every rank over ``backend`` is made and returned; the harness destroys it after
                the test.
        """
        if backend is not None and not isinstance(backend, str):
            raise TypeError(
                f"create_pg(backend={backend!r}): backend must be a backend name such as "
                "'gloo' or 'nccl', or None for the device's"
            )
        wanted = backend or self.backend(device)
        needs_accelerator = any(name in wanted for name in ("nccl", "xccl", "hccl"))
        if needs_accelerator and accelerator_count() == 0:
            raise unittest.SkipTest(
                f"create_pg({device!r}) needs the {wanted} backend and a {device} device; this "
                "machine has no accelerator"
            )
        if backend is not None and not dist.is_backend_available(backend):
            raise unittest.SkipTest(
                f"create_pg(backend={backend!r}): Backend '{backend}' is not available"
            )
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"create_pg(world_size={world_size}) in a test running on {self.world_size} "
                "ranks: set the class's world_size to match"
            )
        if needs_accelerator:
            index = self.rank % accelerator_count()
            torch.accelerator.set_device_index(index)
            torch.set_default_device(torch.device(device.split(":")[0], index))
        group = self.process_group
        if backend is not None and backend not in str(dist.get_backend(group)):
            return dist.new_group(backend=backend)
        return group

    def rank_to_device(self, device: str) -> dict[int, list[int]]:
        """Rank -> device ids, round robin over the visible devices of ``device``'s type."""
        visible = max(torch.get_device_module(device).device_count(), 1)
        return {i: [i % visible] for i in range(self.world_size)}

    def _launch_backend(self) -> str | None:
        return None


class MultiProcContinuousTest(MultiProcessTestCase):
    """torch's ``MultiProcContinuousTest``: every test of the class runs on the same ranks and
    process group, which the warm pool provides for every class. A failing test fails alone;
    unlike torch's, it does not skip the rest of the class (no ``poison_pill``).

    ``world_size`` may be a class attribute; -2 (unset) means one rank per accelerator, and
    on a machine without one the CPU world size (see [Note: CPU world size]).
    ``backend_str()`` picks the backend (None: automatic); ``timeout`` is a ``timedelta``.
    """

    MAIN_PROCESS_RANK = -1
    world_size: int = -2
    rank: int = -2
    rdvz_file: str | None = None
    timeout: Any = datetime.timedelta(seconds=120)
    poison_pill: bool = False

    @classmethod
    def setUpClass(cls) -> None:
        """Skips the class when ``backend_str()`` names a backend this torch lacks (see
        :func:`backend_available`)."""
        super().setUpClass()
        backend = cls.backend_str()
        if backend is not None and not backend_available(backend):
            raise unittest.SkipTest(f"Backend '{backend}' is not available")

    @classmethod
    def backend_str(cls) -> str | None:
        """The backend name (override; None picks nccl with enough GPUs, else gloo)."""
        return None

    @classmethod
    def device_type(cls) -> str:
        """The accelerator type, or ``"cpu"``."""
        accelerator = torch.accelerator.current_accelerator()
        return accelerator.type if accelerator is not None else "cpu"

    @classmethod
    def opts(cls, high_priority_stream: bool = False) -> Any:
        """Process-group options (torch's hook; the pool's group is created without them)."""
        return None

    def _declared_world_size(self) -> Any:
        declared = super()._declared_world_size()
        return accelerator_count() if declared == -2 else declared

    def _launch_backend(self) -> str | None:
        backend = type(self).backend_str()
        return backend if backend in ("gloo", "nccl") else None

    @property
    def pg(self) -> Any:
        """The class's process group (on a rank)."""
        return self.process_group


class DynamoDistributedMultiProcTestCase(DistributedTestBase):
    """torch's ``DynamoDistributedMultiProcTestCase``: one rank per accelerator (the CPU world
    size without one), dynamo reset around each test."""

    @property
    def world_size(self) -> int:
        return accelerator_count()

    @contextlib.contextmanager
    def _rank_method_context(self) -> Iterator[None]:
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            with super()._rank_method_context():
                yield
        finally:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()


class DynamoDistributedSingleProcTestCase(TestCase):
    """torch's ``DynamoDistributedSingleProcTestCase``: the tests run in this process, in a
    process group of one rank (the accelerator's backend, gloo without one); ``self.device``
    and ``self.device_ids`` name rank 0's device."""

    rank = 0
    device: str = "cpu"
    device_ids: list[int] | None = None

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        accelerator = torch.accelerator.current_accelerator()
        kind = accelerator.type if accelerator is not None else "cpu"
        cls.device = f"{kind}:0" if accelerator is not None else "cpu"
        cls.device_ids = [0] if accelerator is not None else None
        if dist.is_initialized():
            raise RuntimeError(
                f"{cls.__name__}: a default process group already exists in this process; "
                "single-process dynamo tests create their own"
            )
        dist.init_process_group(
            dist.get_default_backend_for_device(kind), rank=0, world_size=1, store=dist.HashStore()
        )

    @classmethod
    def tearDownClass(cls) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        super().tearDownClass()

    def setUp(self) -> None:
        super().setUp()
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()


class C10dTorchCommsTestBase(MultiProcContinuousTest):
    """torch's ``C10dTorchCommsTestBase``: process groups over the optional ``torchcomms``
    package; its tests are skipped, with that reason, where it is not installed."""

    @classmethod
    def setUpClass(cls) -> None:
        from .dist_helpers import TORCHCOMM_HAS_GLOO

        if not TORCHCOMM_HAS_GLOO:
            raise unittest.SkipTest(f"{cls.__name__} needs the torchcomms package")
        super().setUpClass()

    @staticmethod
    def backend(device: str) -> str:  # type: ignore[override]
        """torchcomms' backend for ``device``."""
        return _backend_for(device)

    def rank_to_device(self, device: str) -> dict[int, list[int]]:
        """Rank -> device ids, round robin over the visible devices."""
        visible = max(torch.get_device_module(device).device_count(), 1)
        return {i: [i % visible] for i in range(self.world_size)}
