"""Pure collective functions used by the units.

Every collective is looked up on the ``torch.distributed`` module at call time, never bound at
import, so a test that monkeypatches ``torch.distributed.all_gather_single`` (or the older
``all_gather_into_tensor``) sees every call the engine makes.

[Note: gradient averaging]
Gloo has no ``ReduceOp.AVG`` for reduce-scatter on older torch, and NCCL's AVG is not available
for every dtype, so the engine always averages by dividing the local gradient by the group size
*before* a SUM collective. That is what DDP does (it pre-divides each bucket by the world size and
all-reduces with SUM), so for fp32 at world sizes that are powers of two the arithmetic matches
DDP operation for operation; any remaining difference comes from the order in which the backend
sums the contributions. Under mixed precision the pre-division happens in ``reduce_dtype``
(``FSDPUnit._reduce_input``), which keeps magnitudes bounded in low precision for the world
sizes used here.

[Note: custom collectives]
FSDP2's ``set_custom_all_gather(comm)`` and ``set_custom_reduce_scatter(comm)`` hand a unit's
all-gather or reduce-scatter to the caller's object (torch's ``AllGather``/``ReduceScatter``
interface, duck-typed here): ``comm.allocate(size, dtype=, device=)`` makes the staging buffers
(the all-gather's output; the reduce-scatter's input and output), and ``comm(output, input,
group, async_op=False)`` (the reduce-scatter's with ``op`` before ``async_op``) runs the
collective; a returned ``Work`` is waited on. The buffers keep the unit's layout and order tags,
and the recorder still sees each collective. ``set_allocate_memory_from_process_group_for_comm``
installs :class:`GroupAllocatedAllGather`/:class:`GroupAllocatedReduceScatter`: the default
collectives on buffers from the process group's own allocator where its backend has one (NCCL
with memory registration), else ``torch.empty`` (gloo); it cannot replace a custom comm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from . import events
from ._staging import StagingBuffers

__all__ = [
    "AllGatherComm",
    "GroupAllocatedAllGather",
    "GroupAllocatedReduceScatter",
    "ReduceScatterComm",
    "SymmMemAllGather",
    "SymmMemComms",
    "SymmMemReduceScatter",
    "all_gather_flat",
    "all_reduce_flat",
    "check_same_index",
    "is_default_comm",
    "moves_data",
    "new_buffer",
    "reduce_scatter_flat",
    "symm_mem_comms",
    "wait",
]


class AllGatherComm(Protocol):
    """torch's ``AllGather`` interface; see [Note: custom collectives]."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...

    def __call__(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any: ...


class ReduceScatterComm(Protocol):
    """torch's ``ReduceScatter`` interface; see [Note: custom collectives]."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any: ...


def new_buffer(
    comm: AllGatherComm | ReduceScatterComm | None,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    staging: StagingBuffers | None = None,
) -> torch.Tensor:
    """A 1D staging buffer of ``numel`` elements, from ``comm.allocate`` if a comm is set, else
    from ``staging`` if given (see [Note: staging buffers on the CPU] in ``_staging``)."""
    if comm is None:
        if staging is not None:
            return staging.take(numel, dtype, device)
        return torch.empty(numel, dtype=dtype, device=device)
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if buffer.numel() != numel or buffer.dtype != dtype or not buffer.is_contiguous():
        raise ValueError(
            f"{type(comm).__name__}.allocate(({numel},), dtype={dtype}, device={device}) "
            f"returned a tensor of shape {tuple(buffer.shape)} and dtype {buffer.dtype}; it "
            "must return a contiguous tensor of the size and dtype asked for."
        )
    return buffer.view(-1)


class _GroupAllocated:
    """Staging buffers from ``group``'s backend's allocator where it has one (NCCL with memory
    registration), else ``torch.empty``."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        get_backend = getattr(self.group, "_get_backend", None)
        if get_backend is not None:
            backend = get_backend(device)
            if backend.supports_tensor_alloc(device):
                return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
        return torch.empty(tuple(size), dtype=dtype, device=device)


class GroupAllocatedAllGather(_GroupAllocated):
    """The default all-gather on buffers of the group's allocator. See [Note: custom
    collectives]."""

    def __call__(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


class GroupAllocatedReduceScatter(_GroupAllocated):
    """The default reduce-scatter on buffers of the group's allocator. See [Note: custom
    collectives]."""

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        return getattr(dist, _REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


def is_default_comm(comm: object) -> bool:
    """Whether ``comm`` is one the engine installs itself (not the caller's custom one)."""
    return isinstance(comm, GroupAllocatedAllGather | GroupAllocatedReduceScatter | _SymmMem)


class _SymmMem:
    """Staging buffers from symmetric memory's pool on ``device``, made known to the group's
    peers (rendezvous) before each collective; see [Note: custom collectives]."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group = group
        self.device = device
        self._symm_mem = symm_mem

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        pool = self._symm_mem.get_mem_pool(device)
        with torch.cuda.use_mem_pool(pool):
            return torch.empty(tuple(size), dtype=dtype, device=device)

    def _rendezvous(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._symm_mem.rendezvous(t, group=self.group.group_name)


class SymmMemAllGather(_SymmMem):
    """The default all-gather on a symmetric-memory output buffer."""

    def __call__(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self._rendezvous(output)  # in place: only the output is symmetric
        return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


class SymmMemReduceScatter(_SymmMem):
    """The default reduce-scatter on symmetric-memory input and output buffers."""

    def __call__(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self._rendezvous(input, output)
        return getattr(dist, _REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)


class SymmMemComms(NamedTuple):
    all_gather: SymmMemAllGather
    reduce_scatter: SymmMemReduceScatter


def symm_mem_comms(group: dist.ProcessGroup | None, device: torch.device) -> SymmMemComms:
    """Symmetric-memory all-gather and reduce-scatter over ``group`` on ``device``, or a
    ``RuntimeError`` naming what is missing: CUDA, an NCCL group, torch's symmetric memory."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            f"set_symm_mem_for_comm needs CUDA: symmetric memory is allocated on a CUDA device "
            f"for NCCL, but this module computes on {device}. Leave it unset on the CPU (gloo)."
        )
    backend = dist.get_backend(group) if group is not None else dist.get_backend()
    if backend != "nccl":
        raise RuntimeError(
            f"set_symm_mem_for_comm needs an NCCL process group, got {backend!r}; init the "
            "process group with backend='nccl'."
        )
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as error:  # pragma: no cover - a torch built without it
        raise RuntimeError(
            "set_symm_mem_for_comm needs torch.distributed._symmetric_memory, which this torch "
            "build lacks."
        ) from error
    symm_mem.set_backend("NCCL")
    if group is None:
        raise RuntimeError("set_symm_mem_for_comm: this unit is not sharded over a group.")
    # A rendezvous needs the communicator initialized; one barrier at setup does it.
    dist.barrier(group=group)
    return SymmMemComms(SymmMemAllGather(group, device), SymmMemReduceScatter(group, device))


def _publish(
    op: str, nbytes: int, tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, unit: str
) -> None:
    events.publish(
        events.Collective(
            op=op,
            bytes=nbytes,
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtype=str(tensors[0].dtype).removeprefix("torch."),
            group_size=dist.get_world_size(group),
            unit=unit,
            rank=dist.get_rank(),
        )
    )


# Looked up by name at call time (see above); the older spellings on older torch.
_ALL_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
_REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    unit: str = "",
    comm: AllGatherComm | None = None,
    async_op: bool = False,
) -> Any:
    """All-gather equal 1D ``shard``s into ``output`` (1D, ``group size * shard.numel()``),
    with ``comm`` if given (see [Note: custom collectives]).

    With ``async_op`` returns the ``Work`` to wait on (``None``: already complete; see
    [Note: overlap on the CPU] in ``_overlap``), else waits and returns ``None``.
    """
    if events.has_subscribers():
        _publish(_ALL_GATHER, output.numel() * output.element_size(), (output, shard), group, unit)
    if comm is None:
        if async_op:
            return getattr(dist, _ALL_GATHER)(output, shard, group=group, async_op=True)
        getattr(dist, _ALL_GATHER)(output, shard, group=group)
    else:
        wait(comm(output, shard, group, async_op=False))
    return None


def reduce_scatter_flat(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    unit: str = "",
    comm: ReduceScatterComm | None = None,
    async_op: bool = False,
) -> Any:
    """Sum-reduce-scatter 1D ``full`` (``group size * output.numel()``) into ``output``, with
    ``comm`` if given (see [Note: custom collectives]); ``async_op`` as for
    :func:`all_gather_flat`.

    The caller pre-divides for an average. See [Note: gradient averaging].
    """
    if events.has_subscribers():
        _publish(_REDUCE_SCATTER, full.numel() * full.element_size(), (output, full), group, unit)
    if comm is None:
        if async_op:
            return getattr(dist, _REDUCE_SCATTER)(
                output, full, op=dist.ReduceOp.SUM, group=group, async_op=True
            )
        getattr(dist, _REDUCE_SCATTER)(output, full, op=dist.ReduceOp.SUM, group=group)
    else:
        wait(comm(output, full, group, dist.ReduceOp.SUM, async_op=False))
    return None


def wait(work: Any) -> None:
    """Wait for what a collective returned: a ``Work``, or ``None`` (or anything without
    ``wait``, e.g. from a patched collective) for one already complete."""
    if work is not None and hasattr(work, "wait"):
        work.wait()


def all_reduce_flat(tensor: torch.Tensor, group: dist.ProcessGroup, *, unit: str = "") -> None:
    """Sum-all-reduce ``tensor`` in place. See [Note: gradient averaging]."""
    if events.has_subscribers():
        _publish("all_reduce", tensor.numel() * tensor.element_size(), (tensor,), group, unit)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def moves_data(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s collectives move data: not over torch's fake backend
    (``init_process_group("fake")``), whose collectives return at once and leave every output
    as it was, so that one process can play one rank of a large world (sharding math, the
    planner's fake-tensor steps). Nothing received over it can be compared."""
    return dist.get_backend(group) != "fake"


def check_same_index(index: int, group: dist.ProcessGroup, device: torch.device) -> tuple[int, int]:
    """Return the smallest and largest ``index`` any rank of ``group`` passed.

    One all-reduce (MAX) of two int64 values; used to check that ranks agree on which unit
    they are about to communicate for. See [Note: order validation] in ``_exec_order``. Over a
    fake backend (:func:`moves_data`) the collective is issued but nothing is read back:
    ``(index, index)`` (the values may be fake tensors, which have none).
    """
    pair = torch.tensor([index, -index], dtype=torch.int64, device=device)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group)
    if not moves_data(group):
        return index, index
    return -int(pair[1]), int(pair[0])
