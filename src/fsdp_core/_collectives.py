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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import events

__all__ = [
    "all_gather_flat",
    "all_reduce_flat",
    "check_same_index",
    "moves_data",
    "reduce_scatter_flat",
]


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


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *, unit: str = ""
) -> torch.Tensor:
    """All-gather equal 1D ``shard``s into ``output`` (1D, ``group size * shard.numel()``)."""
    op = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    if events.has_subscribers():
        _publish(op, output.numel() * output.element_size(), (output, shard), group, unit)
    getattr(dist, op)(output, shard, group=group)
    return output


def reduce_scatter_flat(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, *, unit: str = ""
) -> torch.Tensor:
    """Sum-reduce-scatter 1D ``full`` (``group size * output.numel()``) into ``output``.

    The caller pre-divides for an average. See [Note: gradient averaging].
    """
    new_name = hasattr(dist, "reduce_scatter_single")
    op = "reduce_scatter_single" if new_name else "reduce_scatter_tensor"
    if events.has_subscribers():
        _publish(op, full.numel() * full.element_size(), (output, full), group, unit)
    getattr(dist, op)(output, full, op=dist.ReduceOp.SUM, group=group)
    return output


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
