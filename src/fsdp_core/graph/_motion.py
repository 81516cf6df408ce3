"""Moving collectives within a graph without crossing a data dependency.

A collective's *copy-in* is the chain of pure nodes that feeds only it (flattening and padding
the shards before an all-gather, say): the collective can move anywhere after the chain's
*frontier*, the latest node outside the chain that the chain reads, provided the chain moves
with it. Bucketing and prefetching both move collectives this way; neither moves compute.
"""

from __future__ import annotations

import copy

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
    """The pure nodes that feed ``node`` and nothing else (transitively), in graph order."""
    chain: set[torch.fx.Node] = set()
    frontier_nodes = list(node.all_input_nodes)
    changed = True
    candidates: set[torch.fx.Node] = set()
    while frontier_nodes:
        candidate = frontier_nodes.pop()
        if candidate in candidates:
            continue
        candidates.add(candidate)
        if is_pure(candidate):
            frontier_nodes.extend(candidate.all_input_nodes)
    # Keep the candidates whose every user is ``node`` or already in the chain.
    while changed:
        changed = False
        for candidate in candidates - chain:
            if not is_pure(candidate):
                continue
            if all(user is node or user in chain for user in candidate.users):
                chain.add(candidate)
                changed = True
    order = _meta.positions(node.graph)
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
