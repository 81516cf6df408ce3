"""``common_dtensor``'s test classes on fsdp_testing's launcher: :class:`DTensorTestBase`
(process ranks, the warm pool), :class:`DTensorContinuousTestBase`, :class:`DTensorOpTestBase`
(thread ranks), ``with_comms`` and the device constants. Their ``LocalTensorMode`` variants are
in ``dtensor_local``.

[Note: DTensor classes on warm ranks]
torch's ``DTensorTestBase`` spawns its processes for each test and ``with_comms`` joins a
process group in them (``init_pg``), runs the test and leaves the group (``destroy_pg``). Here
the ranks are the launcher's, warm or fresh, and they hold the group before the method starts:
``init_pg`` checks that the backend asked for is the group's (skipping where it needs
accelerators the machine lacks, as torch's exits with its skip code), and ``destroy_pg`` keeps
torch's barrier and leaves the group to the harness, which destroys what the test made and
resets per-test state (DTensor's caches and RNG tracker too, see ``_rank/state_reset.py``).
Each rank is seeded with 1234 before the method, as torch's rank processes are.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import unittest
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from fsdp_testing._launch.spec import Mode
from fsdp_testing._rank.skips import multi_device_message
from fsdp_testing._unittest.assertions import set_rng_seed
from fsdp_testing.testcase import (
    MultiProcessTestCase,
    MultiThreadedTestCase,
    run_subtests,
    skip_if_lt_x_gpu,
)

from .classes import MultiProcContinuousTest
from .env import TEST_CUDA, TEST_HPU, TEST_WITH_ROCM, TEST_XPU, accelerator_count
from .requirements import ACCELERATOR_DIST_BACKENDS

__all__ = [
    "DEVICE_COUNT",
    "DEVICE_TYPE",
    "NUM_DEVICES",
    "PG_BACKEND",
    "TEST_PRIVATEUSE1",
    "DTensorContinuousTestBase",
    "DTensorOpTestBase",
    "DTensorTestBase",
    "DTensorTestMixin",
    "T",
    "TestFunc",
    "skip_unless_torch_gpu",
    "with_comms",
]

T = TypeVar("T")
TestFunc = Callable[..., object]


def _privateuse1_available() -> bool:
    from torch._utils import _is_privateuse1_backend_available

    return bool(_is_privateuse1_backend_available())


TEST_PRIVATEUSE1: bool = _privateuse1_available()
"""A PrivateUse1 (out-of-tree) accelerator backend is registered and available."""

_HAS_ACCELERATOR = TEST_CUDA or TEST_XPU or TEST_HPU or TEST_PRIVATEUSE1


def _device_selection() -> tuple[str, str, int]:
    accelerator = torch.accelerator.current_accelerator() if _HAS_ACCELERATOR else None
    if accelerator is None:
        return "cpu", "gloo", 0
    return (
        accelerator.type,
        dist.Backend.default_device_backend_map[accelerator.type],
        torch.accelerator.device_count(),
    )


DEVICE_TYPE, PG_BACKEND, DEVICE_COUNT = _device_selection()
"""The accelerator's device type, its process-group backend and device count; ``"cpu"``,
``"gloo"`` and 0 without one (torch leaves ``DEVICE_COUNT`` undefined there)."""


def _num_devices() -> int:
    wanted = min(4, max(2, torch.cuda.device_count())) if TEST_WITH_ROCM else 4
    if _HAS_ACCELERATOR and DEVICE_COUNT > 1:
        wanted = min(wanted, DEVICE_COUNT)
    return wanted


NUM_DEVICES: int = _num_devices()
"""The world size of the DTensor classes: 4, or fewer on a machine with 2 or 3 accelerators
(torch's value; on CPU the ranks are gloo processes or threads)."""

# The backends torch's init_pg accepts (``f"cpu:gloo,{device}:{backend}"`` is added per device).
_KNOWN_BACKENDS = (
    "nccl",
    "gloo",
    "mpi",
    "cpu:gloo,cuda:ncclx",
    "cuda:ncclx",
    "hccl",
    "xccl",
    "fake",
    "cpu:gloo,xpu:xccl",
)


def skip_unless_torch_gpu(method: T) -> T:
    """Skip the test unless there are :data:`NUM_DEVICES` accelerators, as torch's does: unlike
    a bare ``skip_if_lt_x_gpu(n)`` of the mirror it does not run on CPU ranks, since it says
    that the test needs GPUs (torch's transformer tests under it call attention kernels that
    DTensor shards only on accelerators; see docs/compatibility.md)."""
    gate = skip_if_lt_x_gpu(NUM_DEVICES, allow_cpu=False)
    return cast(T, gate(cast(Callable[..., Any], method)))


class DTensorTestMixin:
    """What :class:`DTensorTestBase` and :class:`DTensorContinuousTestBase` share: the device
    type, a 1-D mesh of the world, per-rank seeding and op-against-full-tensor checks."""

    world_size: Any
    rank: Any
    assertEqual: Callable[..., None]

    @property
    def is_local_tensor_enabled(self) -> bool:
        """Whether the class runs under ``LocalTensorMode`` (False here)."""
        return False

    @property
    def device_type(self) -> str:
        """The accelerator's type when there is one per rank, else ``"cpu"``."""
        if not _HAS_ACCELERATOR or DEVICE_COUNT < self.world_size:
            return "cpu"
        return DEVICE_TYPE

    def build_device_mesh(self) -> Any:
        """A 1-D device mesh of every rank, on :attr:`device_type`."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.world_size,))

    def init_manual_seed_for_rank(self) -> None:
        """Seed torch with this rank's number."""
        torch.manual_seed(self.rank)

    @contextlib.contextmanager
    def _rank_method_context(self) -> Iterator[None]:
        # torch's rank processes are seeded with 1234 before the test (run_test).
        with super()._rank_method_context():  # type: ignore[misc]
            set_rng_seed()
            yield

    def _test_op_on_dtensor(self, op_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Check ``op_call(dtensor args).full_tensor()`` against ``op_call`` on the arguments'
        full tensors (DTensors given directly, not generated)."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_flatten, tree_unflatten

        flat, spec = tree_flatten(args)
        full_args = tree_unflatten(
            [a.full_tensor().detach().clone() if isinstance(a, DTensor) else a for a in flat],
            spec,
        )
        full_kwargs = {
            k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in kwargs.items()
        }
        expected, _ = tree_flatten(op_call(*full_args, **full_kwargs))
        got, _ = tree_flatten(op_call(*args, **kwargs))
        self.assertEqual(expected, [dt.full_tensor() for dt in got])

    def _test_op(self, mesh: Any, op_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Check ``op_call`` on every sharding of its tensor arguments (see
        :class:`~fsdp_testing._compat.dtensor_helpers.DTensorConverter`) against ``op_call``
        on the plain arguments."""
        from .dtensor_helpers import DTensorConverter

        expected = op_call(*args, **kwargs)
        converter = DTensorConverter(mesh, args, kwargs)
        for d_args, d_kwargs in converter:
            self.assertEqual(converter.successful(), True)
            self.assertEqual(op_call(*d_args, **d_kwargs).full_tensor(), expected)

    def run_subtests(self, *args: Any, **kwargs: Any) -> None:
        """See :func:`fsdp_testing.testcase.run_subtests`."""
        run_subtests(cast(Any, self), *args, **kwargs)


def _group_backend() -> str:
    return str(dist.get_backend()).lower()


class DTensorTestBase(DTensorTestMixin, MultiProcessTestCase):
    """torch's ``DTensorTestBase``: each ``test_*`` method runs on :data:`NUM_DEVICES` rank
    processes (gloo on CPU, the accelerator's backend with one device per rank) in the warm
    pool; ``with_comms`` methods find their process group ready (see [Note: DTensor classes on
    warm ranks])."""

    @property
    def world_size(self) -> int:
        return NUM_DEVICES

    @property
    def backend(self) -> str:  # type: ignore[override]
        """The default backend of :attr:`device_type`."""
        return str(dist.get_default_backend_for_device(self.device_type))

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def init_pg(self, eager_init: bool, backend: str | None = None) -> None:
        """torch's ``init_pg``: join the test's process group over ``backend`` (default
        :attr:`backend`). The launcher's ranks are in it already; this checks that ``backend``
        is the group's, skips the test where it needs an accelerator per rank that the machine
        lacks, and binds the rank's device for an accelerator backend.

        Args:
            eager_init: torch binds the device to the group at once (accepted; the launcher
                made the group).
            backend: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ...; default
                :attr:`backend`.

        Raises:
            RuntimeError: ``backend`` is none of the backends torch's ``init_pg`` knows.
            ValueError: ``backend`` is not the backend of the group the ranks hold.
        """
        del eager_init
        wanted = backend if backend is not None else self.backend
        if any(name in wanted for name in ACCELERATOR_DIST_BACKENDS) and (
            accelerator_count() < self.world_size
        ):
            raise unittest.SkipTest(multi_device_message(self.world_size))
        device_backend = dist.get_default_backend_for_device(self.device_type)
        known = (*_KNOWN_BACKENDS, f"cpu:gloo,{self.device_type}:{device_backend}")
        if wanted not in known:
            raise RuntimeError(
                f"Backend {wanted} not supported! {type(self).__name__}.init_pg takes one of "
                f"{', '.join(known)} (torch's list)"
            )
        if self._dist_mode() is not Mode.PROCESS:
            return  # dist_mode = "thread"/"local"/"fake": the mode's group stands in for it
        if "nccl" in wanted or "xccl" in wanted:
            torch.accelerator.set_device_index(int(self.rank))
        actual = _group_backend()
        if not any(part.split(":")[-1] in actual for part in wanted.split(",")):
            raise ValueError(
                f"{type(self).__name__}.init_pg(backend={wanted!r}): the ranks' process group "
                f"runs {actual}. A DTensorTestBase class gets the accelerator's backend with one "
                "device per rank and gloo otherwise; use a LocalDTensorTestBase (or "
                "dist_mode='fake') for the fake backend"
            )

    def destroy_pg(self, device_id: int | None = None) -> None:
        """torch's ``destroy_pg``: every rank meets in a barrier; the group itself stays with the
        harness, which tears down what the test made.

        Args:
            device_id: the device of the barrier for an accelerator backend (default: the
                current device).
        """
        if self.device_type == "cpu":
            dist.barrier()
            return
        if device_id is None:
            device_id = torch.accelerator.current_device_index()
        dist.barrier(device_ids=[device_id])


def with_comms(eager_init: Any = False, backend: str | None = None) -> Any:
    """torch's ``with_comms``: around the test method, ``self.init_pg(eager_init, backend)`` and,
    after it returns, ``self.destroy_pg()``; a class without ``init_pg``
    (:class:`DTensorOpTestBase`) runs the method as it is. Used bare (``@with_comms``) or with
    arguments (``@with_comms(eager_init=True)``, ``@with_comms(backend="gloo")``).

    Args:
        eager_init: True to bind the device to the group at once (default False); when
            ``with_comms`` is used bare this is the test method.
        backend: the backend to check the group against (default: the class's).
    """

    def decorate(func: Callable[..., Any], eager_init: bool, backend: str | None) -> Any:
        @functools.wraps(func)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            if not hasattr(self, "init_pg"):
                func(self, *args, **kwargs)
                return
            self.init_pg(eager_init, backend)
            # A failure leaves the group as it is: the harness replaces failed ranks.
            func(self, *args, **kwargs)
            self.destroy_pg()

        return wrapper

    if callable(eager_init):
        return decorate(eager_init, False, None)
    return functools.partial(decorate, eager_init=bool(eager_init), backend=backend)


class DTensorContinuousTestBase(DTensorTestMixin, MultiProcContinuousTest):  # type: ignore[misc]
    """torch's ``DTensorContinuousTestBase``: the class's tests share warm ranks; the backend
    is the default one of :data:`DEVICE_TYPE`; ``world_size`` unset means one rank per
    accelerator, and the CPU world size without one (torch: 1, ``torch.cpu.device_count()``)."""

    @classmethod
    def backend_str(cls) -> str:
        return str(dist.get_default_backend_for_device(DEVICE_TYPE))

    @classmethod
    def _init_pg(cls, rank: int, world_size: int, rdvz_file: str) -> None:
        """torch's hook that joins the process group in each worker; the launcher's ranks are
        in one already."""


class DTensorOpTestBase(MultiThreadedTestCase):
    """torch's ``DTensorOpTestBase``: each test method runs on :data:`NUM_DEVICES` thread ranks
    over torch's threaded process group, with DTensor's fake-tensor propagation serialized
    by a lock while the class runs."""

    @property
    def world_size(self) -> int:
        return NUM_DEVICES

    @property
    def device_type(self) -> str:
        """:data:`DEVICE_TYPE`."""
        return DEVICE_TYPE

    def build_device_mesh(self) -> Any:
        """A 1-D device mesh of every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.world_size,))

    def setUp(self) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        super().setUp()
        self._orig_fake_mode_lock = getattr(ShardingPropagator, "_fake_mode_lock", None)
        if self._orig_fake_mode_lock is not None:
            ShardingPropagator._fake_mode_lock = threading.Lock()  # type: ignore[assignment]
        self._spawn_threads()

    def tearDown(self) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        if self._orig_fake_mode_lock is not None:
            ShardingPropagator._fake_mode_lock = self._orig_fake_mode_lock
        super().tearDown()
