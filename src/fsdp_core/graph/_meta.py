"""Node conventions of a graph-mode train step: which nodes are collectives, which unit and which
pass they belong to, and the example value (shape, dtype) every node carries.

[Note: graph-mode node conventions]
A joint train-step graph (see :func:`fsdp_core.graph.trace_train_step`) follows these rules,
and every pass keeps them:

- Its first output is the loss. The *forward* is the loss and its ancestors; every other
  computing node is *backward* (gradients, reduce-scatters and what passes put there).
- A collective is a call of ``_c10d_functional.all_gather_into_tensor`` or
  ``_c10d_functional.reduce_scatter_tensor``; its result is read only through one
  ``_c10d_functional.wait_tensor`` node, which returns the same tensor. Between the two the
  collective is in flight.
- ``node.meta["fsdp_unit"]`` names the unit (its module FQN, ``""`` for the root) on every node
  that moves a unit's parameters or gradients: the copy-in before a collective, the collective,
  its wait, the copy-out after it. A bucketed collective serves several units: its
  ``"fsdp_unit"`` joins their names with ``"+"`` and ``node.meta["fsdp_units"]`` lists them.
- ``node.meta["fsdp_pass"]`` names the pass that made the node (absent on traced nodes).
- ``node.meta["val"]`` is a tensor with the node's shape and dtype (a fake tensor from tracing,
  or a ``meta``-device tensor made by a pass with :func:`infer_val`), or a list of them for an
  op returning several tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives
import torch.fx

__all__ = [
    "ALL_GATHER",
    "PASS",
    "REDUCE_SCATTER",
    "UNIT",
    "UNITS",
    "WAIT",
    "backward_nodes",
    "collective_nodes",
    "forward_nodes",
    "group_of",
    "infer_val",
    "is_all_gather",
    "is_collective",
    "is_reduce_scatter",
    "is_wait",
    "loss_node",
    "nbytes_of",
    "ordered",
    "positions",
    "stamp",
    "unit_names",
    "unit_of",
    "wait_of",
]

_FUNCOL = torch.ops._c10d_functional
ALL_GATHER = _FUNCOL.all_gather_into_tensor.default
REDUCE_SCATTER = _FUNCOL.reduce_scatter_tensor.default
WAIT = _FUNCOL.wait_tensor.default

UNIT = "fsdp_unit"
UNITS = "fsdp_units"
PASS = "fsdp_pass"


def is_all_gather(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is ALL_GATHER


def is_reduce_scatter(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is REDUCE_SCATTER


def is_collective(node: torch.fx.Node) -> bool:
    return is_all_gather(node) or is_reduce_scatter(node)


def is_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def collective_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """All-gathers and reduce-scatters in graph order."""
    return [node for node in graph.nodes if is_collective(node)]


def wait_of(collective: torch.fx.Node) -> torch.fx.Node:
    """The one ``wait_tensor`` that reads ``collective``'s result."""
    waits = [user for user in collective.users if is_wait(user)]
    if len(waits) != 1 or len(collective.users) != 1:
        raise AssertionError(
            f"collective {collective.name} must be read by exactly one wait_tensor, "
            f"found users {[u.name for u in collective.users]}"
        )
    return waits[0]


def group_of(collective: torch.fx.Node) -> tuple[int, str]:
    """``(group_size, group_name)`` of a collective node."""
    size, name = collective.args[-2], collective.args[-1]
    if not isinstance(size, int):
        raise AssertionError(f"collective {collective.name} has group size {size!r}")
    return size, str(name)


def unit_of(node: torch.fx.Node) -> str | None:
    unit = node.meta.get(UNIT)
    return None if unit is None else str(unit)


def stamp(node: torch.fx.Node, *, unit: str | None, pass_name: str) -> torch.fx.Node:
    """Record provenance on a node a pass made, and infer its example value."""
    if unit is not None:
        node.meta[UNIT] = unit
    node.meta[PASS] = pass_name
    node.meta["val"] = infer_val(node)
    return node


def nbytes_of(value: Any) -> int:
    """Bytes of a tensor example value (0 for anything else)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(
            tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta"
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def infer_val(node: torch.fx.Node) -> Any:
    """The example value of a ``call_function`` node, computed on the ``meta`` device from its
    inputs' example values (so no data is touched and no collective runs)."""
    if node.op != "call_function":
        raise AssertionError(f"infer_val expects a call_function node, got {node.op} {node.name}")

    def value(arg: torch.fx.Node) -> Any:
        if "val" not in arg.meta:
            raise AssertionError(f"node {arg.name} has no meta['val'] (needed by {node.name})")
        return _to_meta(arg.meta["val"])

    args = torch.fx.node.map_arg(node.args, value)
    kwargs = torch.fx.node.map_arg(node.kwargs, value)
    if callable(node.target):
        return node.target(*args, **kwargs)
    raise AssertionError(f"node {node.name} has a target that cannot be called: {node.target}")


def loss_node(graph: torch.fx.Graph) -> torch.fx.Node:
    """The graph's first output: the loss (see [Note: graph-mode node conventions])."""
    output = graph.output_node()
    outputs = output.args[0]
    first = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    if not isinstance(first, torch.fx.Node):
        raise ValueError(
            "graph-mode passes expect the graph's first output to be the loss node, got "
            f"{first!r}; trace the step with fsdp_core.graph.trace_train_step"
        )
    return first


def _ancestors(roots: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def forward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The loss and its ancestors, placeholders excluded."""
    return {n for n in _ancestors([loss_node(graph)]) if n.op != "placeholder"}


def backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Computing nodes that are not forward."""
    forward = forward_nodes(graph)
    return {
        n
        for n in graph.nodes
        if n.op not in ("placeholder", "output", "get_attr") and n not in forward
    }


def ordered(nodes: Iterable[torch.fx.Node], order: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    return sorted(nodes, key=order.__getitem__)


def positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def unit_names(node: torch.fx.Node) -> Sequence[str]:
    """The units a collective serves: several after bucketing, else its one unit."""
    units = node.meta.get(UNITS)
    if units is not None:
        return tuple(units)
    unit = unit_of(node)
    return () if unit is None else (unit,)
