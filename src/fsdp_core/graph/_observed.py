"""Running a train-step graph so that its data movement is observable, as eager mode's is.

[Note: observed graph runs]
Eager fsdp_core publishes an ``events.Unshard`` when a unit is gathered and an
``events.Collective`` just before each ``torch.distributed`` call, and tools (the test
harness's recorder, fault injection, hang reports) see the call itself by wrapping the
``torch.distributed`` functions. A compiled graph calls the functional collectives instead,
which none of them can see. So while ``events`` has subscribers a ``TrainStep`` runs its graph
node by node through :class:`ObservedRun`: before each all-gather it publishes one
``events.Unshard`` per unit the all-gather serves, and it runs every collective through
fsdp_core's own collective functions (``fsdp_core._collectives``), which publish the
``events.Collective`` and call ``torch.distributed`` with the same bytes as the graph's
functional collective. The collective's ``unit`` is the graph's ``meta["fsdp_unit"]`` (``"a+b"``
for a bucket). Nothing else changes: every other node runs as the compiled graph runs it, and
the results are the same bitwise (a test compares them).

The unshard ``reason`` says where the graph gathers: ``"forward"`` for an all-gather of the
forward, ``"backward"`` for one ``reshard_after_forward`` added, each with ``_prefetch`` when
the ``prefetch`` pass moved it ahead. Graph mode publishes no ``events.Reshard``: a gathered
tensor is freed when the graph drops its last reference, not by a transition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from .. import _collectives, events
from . import _meta

__all__ = ["ObservedRun"]


class ObservedRun(torch.fx.Interpreter):
    """See [Note: observed graph runs].

    Args:
        gm: a joint train-step graph.
        groups: each collective's process group, by group name.
        unit_params: the number of parameters each unit gathers, by unit FQN.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        groups: Mapping[str, dist.ProcessGroup],
        unit_params: Mapping[str, int],
    ) -> None:
        super().__init__(gm)
        self.groups = groups
        self.unit_params = unit_params
        self.forward = _meta.forward_nodes(gm.graph)
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def run_node(self, n: torch.fx.Node) -> Any:
        if _meta.is_wait(n):
            return self.env[n.args[0]]  # type: ignore[index]  # the collective ran to completion
        if not _meta.is_collective(n):
            return super().run_node(n)
        data = self.env[n.args[0]].contiguous()  # type: ignore[index]
        size, name = _meta.group_of(n)
        group = self.groups.get(name)
        if group is None:
            raise AssertionError(
                f"[rank {self.rank}] collective {n.name} runs on group {name!r}, which no traced "
                f"parameter's mesh has (groups: {sorted(self.groups)})"
            )
        expected = n.meta["val"]
        output = data.new_empty(tuple(expected.shape))
        unit = str(n.meta.get(_meta.UNIT, ""))
        if _meta.is_all_gather(n):
            self._publish_unshards(n, data)
            _collectives.all_gather_flat(output.view(-1), data.view(-1), group, unit=unit)
            return output
        op = n.args[1]
        if op not in ("sum", "avg"):
            raise NotImplementedError(
                f"graph mode runs reduce-scatters with reduce op 'sum' or 'avg', got {op!r} in "
                f"node {n.name}"
            )
        _collectives.reduce_scatter_flat(output.view(-1), data.view(-1), group, unit=unit)
        if op == "avg":
            output.div_(size)
        return output

    def _publish_unshards(self, n: torch.fx.Node, data: torch.Tensor) -> None:
        if not events.has_subscribers():
            return
        reason = "forward" if n in self.forward else "backward"
        if n.meta.get("fsdp_prefetch"):
            reason += "_prefetch"
        for unit in _meta.unit_names(n):
            count = self.unit_params.get(unit, 0)
            events.publish(
                events.Unshard(
                    unit=unit,
                    reason=reason,  # type: ignore[arg-type]
                    devices=(str(data.device),) * count,
                    rank=self.rank,
                )
            )
