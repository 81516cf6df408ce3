"""``peak_memory``: the bytes a graph holds at its worst point, by liveness over its nodes.

[Note: liveness estimate]
Every tensor-producing node either allocates a new storage or returns a view of one of its
inputs: the op's schema says which (``aten::t(Tensor(a) self) -> Tensor(a)`` is a view,
``aten::mm`` allocates), ``wait_tensor`` returns its input, and ``getitem`` picks one element of
a node returning several tensors. A storage is allocated at the node that makes it and freed
after the last node that reads it or any view of it; a storage the graph returns lives to the
end. Graph inputs (sharded parameters, the batch) are held by the caller for the whole step and
count from the first node. The bytes at a node are the storages alive while it runs: its
inputs, its outputs and everything still needed later. This is what the graph's generated code
does too (it drops each value after its last use), so the estimate follows the real step on a
caching-free allocator; allocator caching and temporary buffers inside an op are not counted.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from . import _meta

__all__ = ["memory_timeline", "peak_memory"]


class _Storage:
    __slots__ = ("last_use", "nbytes")

    def __init__(self, nbytes: int, born: int) -> None:
        self.nbytes = nbytes
        self.last_use = born


def _aliased_argument(target: Any, index: int) -> int | None:
    """Index of the schema argument that return ``index`` of ``target`` is a view of."""
    schema = getattr(target, "_schema", None)
    if schema is None or index >= len(schema.returns):
        return None
    alias = schema.returns[index].alias_info
    if alias is None:
        return None
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and (
            set(argument.alias_info.before_set) & set(alias.before_set)
        ):
            return position
    return None


def _fresh(value: Any, born: int) -> Any:
    if isinstance(value, (list, tuple)):
        return [_fresh(v, born) for v in value]
    if isinstance(value, torch.Tensor):
        return _Storage(_meta.nbytes_of(value), born)
    return None


def _storages_of_node(node: torch.fx.Node, index: int, env: dict[torch.fx.Node, Any]) -> Any:
    value = node.meta.get("val")
    if node.op != "call_function":
        return _fresh(value, index)
    if _meta.is_wait(node):
        return env.get(node.args[0])  # type: ignore[arg-type]
    if node.target is operator.getitem:
        source = env.get(node.args[0])  # type: ignore[arg-type]
        item = node.args[1]
        if isinstance(source, list) and isinstance(item, int) and item < len(source):
            return source[item]
        return _fresh(value, index)
    if isinstance(value, (list, tuple)):
        viewed = _aliased_argument(node.target, 0)
        if viewed is not None and viewed < len(node.args):
            source = env.get(node.args[viewed])  # type: ignore[arg-type]
            if isinstance(source, _Storage):
                return [source for _ in value]
        return _fresh(value, index)
    viewed = _aliased_argument(node.target, 0)
    if viewed is not None and viewed < len(node.args):
        arg = node.args[viewed]
        if isinstance(arg, torch.fx.Node) and isinstance(env.get(arg), _Storage):
            return env[arg]
    return _fresh(value, index)


def _flatten(storages: Any) -> list[_Storage]:
    if isinstance(storages, _Storage):
        return [storages]
    if isinstance(storages, list):
        return [s for item in storages for s in _flatten(item)]
    return []


def memory_timeline(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """Bytes alive while each node runs, in graph order, as ``(node name, bytes)``.

    See [Note: liveness estimate]. Every node needs ``meta["val"]`` (tracing sets it; passes set
    it on the nodes they make).
    """
    nodes = list(gm.graph.nodes)
    env: dict[torch.fx.Node, Any] = {}
    born: dict[int, list[_Storage]] = {}
    inputs: list[_Storage] = []
    known: set[int] = set()
    for index, node in enumerate(nodes):
        if node.op == "output":
            break
        if node.op != "placeholder" and "val" not in node.meta:
            raise ValueError(
                f"peak_memory needs node.meta['val'] on every node; {node.name} has none. "
                "Trace with fsdp_core.graph.trace_train_step, or set it with "
                "fsdp_core.graph._meta.infer_val for nodes made by hand"
            )
        storages = _storages_of_node(node, index, env)
        env[node] = storages
        for storage in _flatten(storages):
            if id(storage) in known:
                continue
            known.add(id(storage))
            if node.op == "placeholder":
                inputs.append(storage)
            else:
                born.setdefault(index, []).append(storage)
        for arg in node.all_input_nodes:
            for storage in _flatten(env.get(arg)):
                storage.last_use = max(storage.last_use, index)
    end = len(nodes) - 1
    for arg in nodes[-1].all_input_nodes if nodes and nodes[-1].op == "output" else []:
        for storage in _flatten(env.get(arg)):
            storage.last_use = end
    alive = sum(storage.nbytes for storage in inputs)
    dying: dict[int, int] = {}
    for storages in born.values():
        for storage in storages:
            dying[storage.last_use] = dying.get(storage.last_use, 0) + storage.nbytes
    timeline = []
    for index, node in enumerate(nodes):
        if node.op in ("placeholder", "output"):
            continue
        alive += sum(storage.nbytes for storage in born.get(index, []))
        timeline.append((node.name, alive))
        alive -= dying.get(index, 0)
    return timeline


def peak_memory(gm: torch.fx.GraphModule) -> tuple[int, str]:
    """The bytes alive at the graph's worst point and the node where that happens.

    A liveness estimate over the graph (see [Note: liveness estimate]): each storage counts
    from the node that allocates it to the last node that reads it or a view of it; graph inputs
    count throughout. Compare two versions of one step (before and after a pass) with it.

    Args:
        gm: a graph module whose nodes carry ``meta["val"]``, e.g. ``step.gm`` of a
            :class:`~fsdp_core.graph.TrainStep`.

    Returns:
        ``(bytes, node_name)``: the peak, and the first node at which it is reached.
    """
    timeline = memory_timeline(gm)
    if not timeline:
        return 0, ""
    best_name, best = timeline[0]
    for name, alive in timeline:
        if alive > best:
            best_name, best = name, alive
    return best, best_name
