"""Moving collectives within a graph without crossing a data dependency.

A collective's *copy-in* is the chain of pure nodes that feeds only it (flattening and padding
the shards before an all-gather, say): the collective can move anywhere after the chain's
*frontier*, the latest node outside the chain that the chain reads, provided the chain moves
with it. Bucketing and prefetching both move collectives this way; neither moves compute.
"""

from __future__ import annotations

import copy
import heapq

import torch
import torch.fx

from . import _meta

__all__ = ["copy_module", "exclusive_inputs", "frontier", "is_pure", "move_before"]


def is_pure(node: torch.fx.Node) -> bool:
    """A ``call_function`` node with no side effect: no collective, no wait, no in-place op."""
    if node.op != "call_function" or _meta.is_wait(node) or _meta.is_collective(node):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and any(
        argument.alias_info is not None and argument.alias_info.is_write
        for argument in schema.arguments
    ):
        return False
    return not node.is_impure()


def exclusive_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The pure nodes that feed ``node`` and nothing else (transitively), in graph order.

    Candidates are decided latest first: a node's users come after it in the graph, so by the
    time a candidate is decided every user that could be in the chain already is or is not.
    Only the chain and the nodes next to it are visited, not every pure ancestor (a gradient's
    ancestors are most of the backward).
    """
    order = _meta.positions(node.graph)
    chain: set[torch.fx.Node] = set()
    seen: set[torch.fx.Node] = set()
    latest_first: list[tuple[int, torch.fx.Node]] = []  # a heap of (-position, node)

    def offer(inputs: list[torch.fx.Node]) -> None:
        for candidate in inputs:
            if candidate not in seen:
                seen.add(candidate)
                heapq.heappush(latest_first, (-order[candidate], candidate))

    offer(node.all_input_nodes)
    while latest_first:
        _, candidate = heapq.heappop(latest_first)
        if all(user is node or user in chain for user in candidate.users) and is_pure(candidate):
            chain.add(candidate)
            offer(candidate.all_input_nodes)
    return _meta.ordered(chain, order)


def frontier(
    node: torch.fx.Node, chain: list[torch.fx.Node], order: dict[torch.fx.Node, int]
) -> int:
    """Position of the latest node outside ``chain`` that ``node`` or its chain reads (-1 if
    none): ``node`` and its chain can be placed anywhere after it."""
    inside = set(chain)
    latest = -1
    for member in [*chain, node]:
        for arg in member.all_input_nodes:
            if arg not in inside:
                latest = max(latest, order[arg])
    return latest


def move_before(nodes: list[torch.fx.Node], anchor: torch.fx.Node) -> None:
    """Move ``nodes`` (kept in their order) to just before ``anchor``."""
    for node in nodes:
        if node is not anchor:
            anchor.prepend(node)


def copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (nodes' meta copied shallowly), so a pass
    rewrites the copy and leaves its input unchanged."""
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    output = graph.graph_copy(gm.graph, value_map)
    graph.output(output)
    result = torch.fx.GraphModule(gm, graph)
    result.meta.update(gm.meta)
    return result
