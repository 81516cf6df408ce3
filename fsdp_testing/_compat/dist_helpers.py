"""The remaining helpers of ``common_distributed``: stores, timeouts, temp directories, debug
levels, sparse-reduce cases, the forward-input recording models, thread-spawned tests."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import logging
import os
import queue
import sys
import tempfile
import time
import unittest
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from .env import FILE_SCHEMA, TEST_HPU, TEST_WITH_TSAN, TEST_XPU, TORCH_RELEASE
from .parametrize import find_free_port, retry_on_connect_failures

__all__ = [
    "EFA_PROBE_RESULT",
    "TIMEOUT_DEFAULT",
    "TIMEOUT_OVERRIDE",
    "TORCHCOMM_HAS_GLOO",
    "TORCHCOMM_HAS_NCCL",
    "TORCHCOMM_HAS_NCCLX",
    "TORCHCOMM_HAS_RCCL",
    "TORCHCOMM_HAS_RCCLX",
    "TORCHCOMM_HAS_XCCL",
    "DistTestCases",
    "SaveForwardInputsModel",
    "SaveForwardInputsModule",
    "captured_output",
    "cleanup_temp_dir",
    "core_dumps_disabled",
    "create_device",
    "create_tcp_store",
    "get_timeout",
    "has_efa",
    "init_multigpu_helper",
    "initialize_temp_directories",
    "logger",
    "retrieve_result_from_completion_queue",
    "setup_torchcomms_pg",
    "simple_sparse_reduce_tests",
    "spawn_threads_and_init_comms",
    "tmp_dir",
    "tp_transports",
    "verify_ddp_error_logged",
    "with_dist_debug_levels",
    "with_nccl_blocking_wait",
]

logger = logging.getLogger("fsdp_testing.common_distributed")

TIMEOUT_DEFAULT: int = (
    500 if TEST_WITH_TSAN else int(os.environ.get("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300"))
)
"""torch's per-test timeout in seconds. Our classes use the session's ``--dist-timeout``
instead (see docs/migration.md); this value is what :func:`get_timeout` reports."""
TIMEOUT_OVERRIDE: dict[str, int] = {
    "test_ddp_uneven_inputs": 400,
    "test_DistributedDataParallel": 500,
}

# torchcomms is an optional package; without it every flag is False.
_HAS_TORCHCOMMS = importlib.util.find_spec("torchcomms") is not None
TORCHCOMM_HAS_GLOO: bool = _HAS_TORCHCOMMS
TORCHCOMM_HAS_NCCL: bool = _HAS_TORCHCOMMS and dist.is_nccl_available()
TORCHCOMM_HAS_NCCLX: bool = TORCHCOMM_HAS_NCCL
TORCHCOMM_HAS_RCCL = TORCHCOMM_HAS_RCCLX = TORCHCOMM_HAS_XCCL = False

_XCCL_SINCE_2_14 = ("xccl",) if TORCH_RELEASE >= (2, 14) else ()


@dataclasses.dataclass
class DistTestCases:
    """Which backends lack a collective (``skip_collective``) or have a feature
    (``backend_feature``), as the installed torch lists them (xccl has the gpu, ddp and subgroup
    features from torch 2.14)."""

    skip_collective: ClassVar[dict[str, set[str]]] = {
        "allgather_coalesced": {"nccl", "mpi", "ucc", "xccl"},
        "reduce": set(),
        "sendrecv anysource": {"nccl", "ucc", "xccl"},
        "cpu barrier": {"nccl", "ucc", "xccl"},
    }
    backend_feature: ClassVar[dict[str, set[str]]] = {
        "gpu": {"nccl", "gloo", "ucc", *_XCCL_SINCE_2_14},
        "cuda": {"nccl", "gloo", "ucc"},
        "ddp": {"nccl", "gloo", "ucc", *_XCCL_SINCE_2_14},
        "subgroup": {"nccl", "gloo", "ucc", *_XCCL_SINCE_2_14},
        "plugin": set(),
        **({"hpu": {"hccl"}} if TEST_HPU else {}),
        **({"xpu": {"xccl"}} if TEST_XPU else {}),
    }


def get_timeout(test_id: str) -> int:
    """torch's timeout for ``test_id`` (its method name looked up in :data:`TIMEOUT_OVERRIDE`)."""
    return TIMEOUT_OVERRIDE.get(test_id.split(".")[-1], TIMEOUT_DEFAULT)


@retry_on_connect_failures
def create_tcp_store(
    addr: str = "localhost",
    world_size: int = 1,
    is_master: bool = True,
    timeout: timedelta = timedelta(minutes=5),
    wait_for_workers: bool = True,
    jit_class: bool = False,
    use_libuv: bool = True,
) -> Any:
    """A ``TCPStore`` on a free port (retried when the port is taken meanwhile)."""
    port = find_free_port()
    if jit_class:
        millis = int(timeout / timedelta(milliseconds=1))
        return torch.classes.dist_c10d.TCPStore(addr, port, world_size, is_master, millis)
    return dist.TCPStore(
        addr,
        port,
        world_size,
        is_master,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        use_libuv=use_libuv,
    )


def create_device(interface: str | None = None, lazy_init: bool = False) -> Any:
    """A gloo transport device on loopback, or on ``interface``."""
    from torch.distributed import ProcessGroupGloo

    if sys.platform == "win32" or interface is None:
        return ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=lazy_init)
    return ProcessGroupGloo.create_device(interface=interface, lazy_init=lazy_init)


@contextlib.contextmanager
def captured_output() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """Redirect ``sys.stdout``/``sys.stderr`` to two ``StringIO`` objects inside the block."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = saved


@contextlib.contextmanager
def core_dumps_disabled() -> Iterator[None]:
    """Core dumps off (soft ``RLIMIT_CORE`` 0) inside the block, restored after it (torch 2.15).

    A HIP runtime with core dumps enabled aborts the process on a device-side assert, to write
    a GPU core file; with the limit at 0 the fault surfaces as an exception at the next
    synchronization, as on CUDA. Keep the block open through that synchronization. Nothing
    changes on Windows, which has no ``RLIMIT_CORE``.
    """
    if sys.platform == "win32":
        yield
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def _sparse_case(rank: int, world_size: int, sparse_dims: int, dense_dims: int) -> torch.Tensor:
    # Rows 0..rank of the first sparse dimension, zeros elsewhere: every two ranks overlap.
    indices = torch.arange(rank + 1).reshape(1, rank + 1)
    shape = [world_size] + [2] * dense_dims
    for _ in range(sparse_dims - 1):
        indices = torch.cat((indices, torch.zeros(1, rank + 1, dtype=indices.dtype)))
        shape.append(world_size)
    values = torch.ones([rank + 1] + [2] * dense_dims)
    return torch.sparse_coo_tensor(indices, values, shape)


def simple_sparse_reduce_tests(
    rank: int, world_size: int, num_inputs: int = 1
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Sparse all-reduce cases: for 1-3 sparse and 1-3 dense dimensions, this rank's inputs and
    the expected sums over all ranks."""
    shapes = [(1, 0), (2, 0), (3, 0), (1, 1), (1, 2), (1, 3)]
    cases = []
    total = num_inputs * world_size
    for sparse_dims, dense_dims in shapes:
        inputs = [
            _sparse_case(num_inputs * rank + i, total, sparse_dims, dense_dims)
            for i in range(num_inputs)
        ]
        summed = _sparse_case(0, total, sparse_dims, dense_dims)
        for other in range(1, total):
            summed = summed + _sparse_case(other, total, sparse_dims, dense_dims)
        cases.append((inputs, [summed] * num_inputs))
    return cases


def init_multigpu_helper(world_size: int, backend: str) -> dict[int, list[int]]:
    """Split the visible accelerators evenly among ``world_size`` ranks: rank -> device ids."""
    del backend
    from .env import accelerator_count

    count = accelerator_count()
    per_rank = count // world_size if world_size > count else 1
    return {r: list(range(count))[r * per_rank : (r + 1) * per_rank] for r in range(world_size)}


tmp_dir: tempfile.TemporaryDirectory[str] | None = None


def initialize_temp_directories(init_method: str | None = None) -> None:
    """Create torch's temp layout (``barrier``, ``test_dir``, ``init_dir``) and set
    ``TEMP_DIR`` and ``INIT_METHOD`` in the environment."""
    global tmp_dir
    tmp_dir = tempfile.TemporaryDirectory()
    os.environ["TEMP_DIR"] = tmp_dir.name
    for name in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(tmp_dir.name, name))
    os.environ["INIT_METHOD"] = init_method or (
        FILE_SCHEMA + os.path.join(tmp_dir.name, "init_dir", "shared_init_file")
    )


def cleanup_temp_dir() -> None:
    """Remove the directory made by :func:`initialize_temp_directories`."""
    if tmp_dir is not None:
        tmp_dir.cleanup()


def retrieve_result_from_completion_queue(
    process: Any, completion_queue: Any, timeout: int | None = None
) -> Any:
    """The next result ``process`` put on ``completion_queue``; a ``RuntimeError`` instance
    (returned, not raised) when the process exited without one or ``timeout`` passed."""
    poll = 120 if timeout is None else max(10, min(120, timeout // 4))
    start = time.monotonic()
    while True:
        try:
            return completion_queue.get(timeout=poll)
        except queue.Empty:
            if not process.is_alive() and completion_queue.empty():
                return RuntimeError(f"Exited with {process.exitcode}")
        if timeout is not None and time.monotonic() - start > timeout:
            return RuntimeError(f"Process timed out after {time.monotonic() - start}s")


EFA_PROBE_RESULT: bool | None = None
""":func:`has_efa`'s answer once it ran, None before (torch up to 2.9 names it in
``common_distributed``)."""


def has_efa() -> bool:
    """Whether an AWS EFA network device is present (``fi_info -p efa`` succeeds); probed once."""
    import subprocess

    global EFA_PROBE_RESULT
    if EFA_PROBE_RESULT is None:
        try:
            probe = subprocess.run(["fi_info", "-p", "efa", "-t", "FI_EP_RDM"], check=False)
            EFA_PROBE_RESULT = probe.returncode == 0
        except FileNotFoundError:
            EFA_PROBE_RESULT = False
    return EFA_PROBE_RESULT


def tp_transports() -> list[str] | None:
    """TensorPipe transports to use: shared memory and libuv on EFA machines, else default."""
    return ["shm", "uv"] if has_efa() else None


def verify_ddp_error_logged(model_DDP: Any, err_substr: str) -> None:
    """Assert that DDP's logging data recorded an error containing ``err_substr`` (its C++
    stack trace, if any, removed)."""
    data = model_DDP._get_ddp_logging_data()
    for key in ("iteration", "has_error", "error"):
        if key not in data:
            raise AssertionError(f"verify_ddp_error_logged: {key!r} missing from DDP logging data")
    expected = err_substr.split("\nException raised from ")[0]
    if expected not in data["error"]:
        raise AssertionError(
            f"verify_ddp_error_logged: {expected!r} not in DDP logging data error {data['error']!r}"
        )


def with_nccl_blocking_wait(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func`` with ``TORCH_NCCL_BLOCKING_WAIT=1`` and ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
    unset, restoring both afterwards."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        saved = {
            k: os.environ.get(k)
            for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")
        }
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
        try:
            return func(*args, **kwargs)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    return wrapper


def with_dist_debug_levels(levels: Sequence[str]) -> Callable[[Callable[..., Any]], Any]:
    """Run the test once per ``TORCH_DISTRIBUTED_DEBUG`` level in ``levels`` (a barrier after
    each), restoring the previous level."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            previous = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
            result = None
            try:
                for level in levels:
                    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
                    dist.set_debug_level_from_env()
                    result = func(*args, **kwargs)
                    dist.barrier()
            finally:
                if previous is None:
                    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
                else:
                    os.environ["TORCH_DISTRIBUTED_DEBUG"] = previous
                dist.set_debug_level_from_env()
            return result

        return wrapper

    return decorator


class _ThreadedCall:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def run_on_rank(self, ctx: Any) -> None:
        self.fn()


def spawn_threads_and_init_comms(
    func: Callable[..., Any] | None = None,
    timeout: float = TIMEOUT_DEFAULT,
    world_size: int = 4,
) -> Any:
    """Run a test method on ``world_size`` threads over torch's threaded process group (the
    harness's thread launcher, with its timeout and per-rank report)."""
    if func is None:
        return functools.partial(
            spawn_threads_and_init_comms, timeout=timeout, world_size=world_size
        )

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        from fsdp_testing._launch.spec import DistSpec, Mode
        from fsdp_testing._protocol import Task
        from fsdp_testing.launcher import VerdictOutcome, run_distributed, session_settings

        task = Task(
            target=_ThreadedCall(lambda: func(self, *args, **kwargs)),
            kwargs={},
            test_id=f"{type(self).__qualname__}.{func.__name__}",
        )
        verdict = run_distributed(
            task, DistSpec(world_size, None, Mode.THREAD, float(timeout)), session_settings()
        )
        if verdict.outcome is VerdictOutcome.FAILED:
            raise AssertionError(verdict.message)
        if verdict.outcome in (VerdictOutcome.SKIPPED, VerdictOutcome.XFAILED):
            raise unittest.SkipTest(verdict.message)

    return wrapper


def setup_torchcomms_pg(
    backend: str, rank: int, world_size: int, device: torch.device, store_path: str, group_name: str
) -> Any:
    """torch's process group over the optional ``torchcomms`` package; a test calling it is
    skipped, with that reason, where the package is not installed."""
    if not TORCHCOMM_HAS_GLOO:
        raise unittest.SkipTest(
            f"setup_torchcomms_pg(backend={backend!r}) needs the torchcomms package, which is not "
            "installed"
        )
    from torch.testing._internal.common_distributed import (
        setup_torchcomms_pg as torch_setup,
    )

    return torch_setup(backend, rank, world_size, device, store_path, group_name)


class _RecordsForwardInput(nn.Module):
    """Notes each forward input under ``forward_inputs[self]``, then runs ``_compute``."""

    def __init__(self, forward_inputs: dict[nn.Module, torch.Tensor]) -> None:
        super().__init__()
        self.forward_inputs = forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs[self] = x
        return self._compute(x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SaveForwardInputsModule(_RecordsForwardInput):
    """A 100x100 linear layer ``l`` that records its forward input in ``forward_inputs[self]``
    and, with ``cast_forward_inputs``, casts it to the layer's dtype first."""

    def __init__(
        self, forward_inputs: dict[nn.Module, torch.Tensor], cast_forward_inputs: bool
    ) -> None:
        super().__init__(forward_inputs)
        self.l = nn.Linear(100, 100)
        self.cast_forward_inputs = cast_forward_inputs

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast_forward_inputs:
            x = x.to(self.l.weight.dtype)
        return self.l(x)


class SaveForwardInputsModel(_RecordsForwardInput):
    """:class:`SaveForwardInputsModule` ``c1`` then ``c2``; records its own input too."""

    def __init__(
        self, forward_inputs: dict[nn.Module, torch.Tensor], cast_forward_inputs: bool
    ) -> None:
        super().__init__(forward_inputs)
        self.c1, self.c2 = (
            SaveForwardInputsModule(forward_inputs, cast_forward_inputs) for _ in range(2)
        )

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x))
