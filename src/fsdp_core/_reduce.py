"""A unit's gradient reduction over its groups: reduce-scatter inside the shard group, then
all-reduce of the reduced shard across the replicate group, each step skipped over a group of
one (see [Note: unit groups] in ``_groups``). Each collective carries its own order tags, one
digit pair per rank of its group, checked after it (see [Note: order check] in
``_order_check``): the all-reduce's pairs replace the reduce-scatter's in the same spare
elements after the shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _collectives, _order_check
from ._collectives import ReduceScatterComm
from ._groups import UnitGroups
from ._order_check import TagOp, UnitTags

__all__ = [
    "AllReduceHook",
    "ReduceScatter",
    "input_tag_slots",
    "reduce_gradients",
    "start_reduce_scatter",
]


@dataclass(frozen=True)
class AllReduceHook:
    """``FSDPModule.set_all_reduce_hook``: ``hook(reduced)`` runs on each reduced gradient shard
    (1D, ``reduce_dtype``, padded) after the unit's last reduction collective (the
    reduce-scatter, or the all-reduce with a 2-D mesh), before it is added to the ``.grad``s,
    and may change it in place (e.g. all-reduce it over a group of its own), on ``stream`` when
    given."""

    hook: Callable[[torch.Tensor], None]
    stream: Any = None  # a stream of the compute device's module (torch.cuda.Stream, ...)

    def run(self, reduced: torch.Tensor, device: torch.device) -> None:
        if self.stream is None:
            self.hook(reduced)
            return
        with torch.get_device_module(device.type).stream(self.stream):
            self.hook(reduced)


def _tag_slots(groups: UnitGroups) -> tuple[int, int]:
    """Tag elements after a row of the reduce-scatter and after the all-reduce's shard."""
    shard, replicas = groups.shard_size, groups.replicate_size
    return (
        _order_check.reduce_tag_numel(shard) if shard > 1 else 0,
        _order_check.reduce_tag_numel(replicas) if replicas > 1 else 0,
    )


def input_tag_slots(groups: UnitGroups) -> int:
    """Tag elements after each row of the reduction's input: for its first collective (the
    reduce-scatter, or the all-reduce of an unsharded unit)."""
    scatter, replicas = _tag_slots(groups)
    return scatter if groups.shard_size > 1 else replicas


@dataclass
class ReduceScatter:
    """A unit's reduce-scatter, issued, and the order-tag check that follows it."""

    work: Any  # ``dist.Work``, or None once complete
    reduced: torch.Tensor  # 1D: the shard, then room for tags
    numel: int
    row: int  # elements per row of the input: the shard and its tags
    tags: UnitTags | None
    code: int
    group: Any

    def finish(self) -> torch.Tensor:
        """Wait, check the tags, return the reduced shard with room for the all-reduce's tags
        after it (1D)."""
        _collectives.wait(self.work)
        self.work = None
        if self.tags is not None:
            self.tags.check(self.code, self.reduced[self.numel : self.row], self.group)
        return self.reduced


def start_reduce_scatter(
    reduce_input: torch.Tensor,
    numel: int,
    groups: UnitGroups,
    tags: UnitTags | None,
    *,
    unit: str,
    comm: ReduceScatterComm | None = None,
    async_op: bool = False,
) -> ReduceScatter:
    """Issue the reduce-scatter inside ``groups.shard`` (more than one rank) of the pre-divided
    input, with its order tags if ``tags``; ``async_op`` as for
    ``_collectives.reduce_scatter_flat`` (see [Note: overlap on the CPU] in ``_overlap``)."""
    group = groups.shard
    if group is None:
        raise AssertionError(f"{unit}: a reduce-scatter needs a shard group")
    code = tags.code(TagOp.REDUCE) if tags is not None else 0
    scatter, replicas = _tag_slots(groups) if tags is not None else (0, 0)
    if tags is not None:
        _order_check.write_reduce_tag(reduce_input, code, groups.shard_rank, groups.shard_size)
    row = reduce_input.shape[1]
    # Room for the all-reduce's tags after the shard, which replace the scatter's.
    reduced = _collectives.new_buffer(
        comm, numel + max(scatter, replicas), reduce_input.dtype, reduce_input.device
    )
    work = _collectives.reduce_scatter_flat(
        reduced[:row], reduce_input.view(-1), group, unit=unit, comm=comm, async_op=async_op
    )
    return ReduceScatter(work, reduced, numel, row, tags, code, group)


def reduce_gradients(
    reduce_input: torch.Tensor,
    numel: int,
    groups: UnitGroups,
    tags: UnitTags | None,
    *,
    unit: str,
    all_reduce: bool = True,
    partial: torch.Tensor | None = None,
    comm: ReduceScatterComm | None = None,
) -> torch.Tensor:
    """This rank's summed gradient shard (1D, ``numel``) from the pre-divided input.

    Args:
        reduce_input: ``(shard size, numel [+ input_tag_slots])``, written in place.
        numel: gradient elements per row.
        groups: the unit's groups.
        tags: the order tags to send and check, or ``None`` (then the rows have no tag
            columns).
        unit: the unit's name, for the events.
        all_reduce: all-reduce across the replicate group (default ``True``); ``False``
            returns the reduce-scattered shard (``set_requires_all_reduce(False)``).
        partial: reduce-scattered shards of earlier backwards that were not all-reduced,
            added before the all-reduce (default ``None``).
        comm: a custom reduce-scatter (``set_custom_reduce_scatter``; default ``None``).
    """
    if groups.world == 1:
        alone = reduce_input.view(-1)[:numel]
        return alone if partial is None else alone.add_(partial)
    code = tags.code(TagOp.REDUCE) if tags is not None else 0
    replicas = _tag_slots(groups)[1] if tags is not None else 0
    replicate = groups.replicate
    if groups.shard is not None and groups.shard_size > 1:
        scatter = start_reduce_scatter(reduce_input, numel, groups, tags, unit=unit, comm=comm)
        reduced = scatter.finish()
    else:
        reduced = reduce_input.view(-1)
    if partial is not None:
        reduced[:numel].add_(partial)
    if all_reduce and replicate is not None and groups.replicate_size > 1:
        payload = reduced[: numel + replicas]
        if tags is not None:
            payload[numel:].zero_()
            _order_check.write_reduce_tag(
                payload.view(1, -1), code, groups.replicate_rank, groups.replicate_size
            )
        _collectives.all_reduce_flat(payload, replicate, unit=unit)
        if tags is not None:
            tags.check(code, payload[numel:], replicate)
    return reduced[:numel]
