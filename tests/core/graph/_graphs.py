"""Small joint train-step graphs built by hand with torch.fx.Graph, and a single-process stand-in
for a world of ranks that runs them, for the graph-mode pass tests."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from fsdp_core.graph import _meta

ATEN = torch.ops.aten
GROUP = "0"


def _call(graph: torch.fx.Graph, target: Any, *args: Any, unit: str | None = None, **kwargs: Any):
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = _meta.infer_val(node)
    if unit is not None:
        node.meta[_meta.UNIT] = unit
    return node


def _input(graph: torch.fx.Graph, name: str, shape: tuple[int, ...]) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


def linear_chain(
    units: int = 3, *, dim: int = 8, rows: int = 4, world: int = 2
) -> torch.fx.GraphModule:
    """``units`` bias-free linear layers, each its own unit, with a hand-written backward::

        w_i = wait(all_gather(shard_i));  h_i = mm(h_{i-1}, t(w_i))          # forward
        loss = sum(h_n)
        dh_n = expand(ones_like(loss));  dw_i = mm(t(dh_i), h_{i-1})        # backward
        dh_{i-1} = mm(dh_i, t(t(w_i)));  g_i = wait(reduce_scatter(dw_i))
        return loss, g_1, ..., g_n

    Inputs are ``shard_1 .. shard_n`` (``dim // world`` rows each) and ``x`` (``rows x dim``).
    """
    graph = torch.fx.Graph()
    shards = [_input(graph, f"shard_{i}", (dim // world, dim)) for i in range(units)]
    x = _input(graph, "x", (rows, dim))
    hidden = [x]
    transposed = []
    for i, shard in enumerate(shards):
        unit = f"layers.{i}"
        gather = _call(graph, _meta.ALL_GATHER, shard, world, GROUP, unit=unit)
        weight = _call(graph, _meta.WAIT, gather, unit=unit)
        transposed.append(_call(graph, ATEN.t.default, weight))
        hidden.append(_call(graph, ATEN.mm.default, hidden[-1], transposed[-1]))
    loss = _call(graph, ATEN.sum.default, hidden[-1])
    ones = _call(graph, ATEN.ones_like.default, loss)
    grad = _call(graph, ATEN.expand.default, ones, [rows, dim])
    reduced: list[torch.fx.Node] = [None] * units  # type: ignore[list-item]
    for i in reversed(range(units)):
        unit = f"layers.{i}"
        grad_t = _call(graph, ATEN.t.default, grad)
        grad_w = _call(graph, ATEN.mm.default, grad_t, hidden[i])
        weight_back = _call(graph, ATEN.t.default, transposed[i])
        grad = _call(graph, ATEN.mm.default, grad, weight_back)
        scatter = _call(graph, _meta.REDUCE_SCATTER, grad_w, "avg", world, GROUP, unit=unit)
        reduced[i] = _call(graph, _meta.WAIT, scatter, unit=unit)
    graph.output((loss, *reduced))
    graph.lint()
    return torch.fx.GraphModule(torch.nn.Module(), graph)


class SimulatedWorld(torch.fx.Interpreter):
    """Runs a graph as rank ``rank`` of ``world`` ranks in one process, without a process group.

    Rank ``k`` is taken to hold its peer's inputs plus ``k`` (all-gather) or times ``k + 1``
    (reduce-scatter): elementwise stand-ins, so a pass that lays data out differently (a bucket)
    must still give every element the same value, and a pass that mixes ranks or members up
    gives different numbers.
    """

    def __init__(self, gm: torch.fx.GraphModule, *, rank: int = 0) -> None:
        super().__init__(gm)
        self.rank = rank
        self.issued: list[tuple[str, tuple[str, ...]]] = []

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is _meta.ALL_GATHER:
            shard, world = args[0], args[1]
            self.issued.append(("all_gather", tuple(self._units())))
            return torch.cat([shard + k for k in range(world)])
        if target is _meta.REDUCE_SCATTER:
            full, op, world = args[0], args[1], args[2]
            self.issued.append(("reduce_scatter", tuple(self._units())))
            total = sum(full * (k + 1) for k in range(world))
            mine = total.chunk(world)[self.rank]
            return (mine / world if op == "avg" else mine).clone()
        if target is _meta.WAIT:
            return args[0]
        return super().call_function(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        self._node = n
        return super().run_node(n)

    def _units(self) -> list[str]:
        return list(_meta.unit_names(self._node))


def example_inputs(gm: torch.fx.GraphModule, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(tuple(node.meta["val"].shape), generator=generator)
        for node in gm.graph.nodes
        if node.op == "placeholder"
    ]


def run(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> tuple[Any, list]:
    world = SimulatedWorld(gm)
    return world.run(*inputs), world.issued


def count(gm: torch.fx.GraphModule, target: Any) -> int:
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target is target)


__all__ = ["ATEN", "SimulatedWorld", "count", "example_inputs", "linear_chain", "run"]
_ = operator
