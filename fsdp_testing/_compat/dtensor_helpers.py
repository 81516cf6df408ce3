"""``common_dtensor``'s helpers that are not test classes: converting an op's arguments to
every DTensor sharding (:class:`DTensorConverter`), per-rank values under torch's
``LocalTensorMode`` (:func:`map_local_tensor_for_rank`, ...) and redistribution with an
explicit shard order (:func:`redistribute`, :func:`patched_distribute_tensor`, ...). The checks
of sharding rules are in ``dtensor_rules``.

DTensor and LocalTensor internals are imported on use: they differ between torch releases, and
importing this module must not depend on them.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = [
    "DTensorConverter",
    "generate_shard_orders",
    "make_full_tensor",
    "map_local_for_rank",
    "map_local_tensor_for_rank",
    "patched_distribute_tensor",
    "redistribute",
    "reduce_local_int",
    "shard_order_to_placement",
]


# -- per-rank values under LocalTensorMode ------------------------------------------------------


def _for_each_local_rank(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` run once per simulated rank when torch's ``LocalTensorMode`` is on (torch's
    ``maybe_run_for_local_tensor``), else ``func`` itself. Without the module imported no such
    mode can be on, and nothing is imported."""
    local = sys.modules.get("torch.distributed._local_tensor")
    if local is None:
        return func
    return local.maybe_run_for_local_tensor(func)


def map_local_tensor_for_rank(tensor: Any, rank: Any, func: Callable[[Any, Any], Any]) -> Any:
    """``func(tensor, rank)``; under ``LocalTensorMode`` once per simulated rank with that
    rank's shard and number, the results assembled into a ``LocalTensor``.

    Args:
        tensor: a tensor (a ``LocalTensor`` under the mode), or a structure holding them.
        rank: this rank (under the mode, the per-rank ``SymInt`` of ``self.rank``).
        func: ``(tensor, rank) -> value``, free of side effects and collectives.
    """
    return _for_each_local_rank(lambda t, r, f: f(t, r))(tensor, rank, func)


def map_local_for_rank(rank: Any, func: Callable[[Any], Any]) -> Any:
    """``func(rank)``; under ``LocalTensorMode`` once per simulated rank.

    Args:
        rank: this rank (the per-rank ``SymInt`` under the mode).
        func: ``rank -> value``, free of side effects and collectives.
    """
    return _for_each_local_rank(lambda r, f: f(r))(rank, func)


def reduce_local_int(val: Any, func: Callable[[dict[int, int]], Any]) -> Any:
    """``func`` of the per-rank ints behind a ``SymInt`` made under ``LocalTensorMode``
    (``{rank: value}``), e.g. ``reduce_local_int(n, lambda d: max(d.values()))``.

    Args:
        val: a ``SymInt`` whose node is a ``LocalIntNode``.
        func: called with the ``{rank: int}`` mapping.
    """
    return func(val.node._local_ints)


# -- an op's arguments in every sharding ---------------------------------------------------------


class DTensorConverter:
    """Iterates over an op's ``(args, kwargs)`` with their tensors turned into DTensors on
    ``mesh``, one placement combination per step: each tensor is replicated or sharded on a
    dimension whose size is a multiple of the mesh size (bool tensors replicated only, scalar
    tensors always replicated). Tensors DTensor cannot hold (sparse, quantized, nested,
    conjugated, meta, ...) and tensor subclasses are left as they are and counted as misses;
    :meth:`successful` says whether every tensor converted.

    Args:
        mesh: the 1-D device mesh.
        args: the op's positional arguments.
        kwargs: its keyword arguments.
        replicate_only: only the replicated placement (default False).
    """

    def __init__(
        self,
        mesh: Any,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        replicate_only: bool = False,
    ) -> None:
        self.hit = 0
        self.miss = 0
        self.mesh = mesh
        self.args = args
        self.kwargs = kwargs
        self.replicate_only = replicate_only
        self.flatten_args, self.flatten_args_spec = pytree.tree_flatten(args)
        self.flatten_kwargs, self.flatten_kwargs_spec = pytree.tree_flatten(kwargs)
        tensors = [
            a for a in [*self.flatten_args, *self.flatten_kwargs] if isinstance(a, torch.Tensor)
        ]
        choices = [self.gen_sharding_choices_for_arg(t) for t in tensors]
        self.sharding_combs: Iterator[tuple[Any, ...]] = iter(itertools.product(*choices))

    def successful(self) -> bool:
        """At least one tensor converted, and none was left as it was."""
        return self.hit > 0 and self.miss == 0

    def is_supported_tensor(self, t: torch.Tensor) -> bool:
        """Whether DTensor can hold ``t`` (not sparse, quantized, nested, functional, conjugated
        or negated, not on the lazy or meta device)."""
        return not (
            t.is_sparse_csr
            or t.is_sparse
            or t.is_mkldnn
            or t.is_quantized
            or t.is_nested
            or torch._is_functional_tensor(t)
            or t.is_neg()
            or t.is_conj()
            or t.device.type in ("lazy", "meta")
        )

    def gen_sharding_choices_for_arg(self, arg: torch.Tensor) -> Sequence[Any]:
        """``Replicate()``, then ``Shard(d)`` for each dimension ``d`` longer than 1 whose size
        the mesh size divides (none for bool tensors: c10d has no bool collectives)."""
        from torch.distributed.tensor import Replicate, Shard

        choices: list[Any] = [Replicate()]
        if self.replicate_only or arg.dtype == torch.bool:
            return choices
        size = self.mesh.size()
        return choices + [Shard(d) for d, n in enumerate(arg.shape) if n > 1 and n % size == 0]

    def __iter__(self) -> DTensorConverter:
        return self

    def __next__(self) -> tuple[Any, dict[str, Any]]:
        placements = iter(next(self.sharding_combs))

        def convert(values: list[Any]) -> list[Any]:
            return [
                self.to_dist_tensor(v, self.mesh, [next(placements)])
                if isinstance(v, torch.Tensor)
                else v
                for v in values
            ]

        new_args = convert(self.flatten_args)
        new_kwargs = convert(self.flatten_kwargs)
        return (
            pytree.tree_unflatten(new_args, self.flatten_args_spec),
            pytree.tree_unflatten(new_kwargs, self.flatten_kwargs_spec),
        )

    def to_dist_tensor(self, t: torch.Tensor, mesh: Any, placements: list[Any]) -> torch.Tensor:
        """``t`` distributed with ``placements`` (a scalar replicated), or ``t`` itself,
        counted as a miss, when DTensor cannot hold it.

        Raises:
            RuntimeError: ``t`` is not a tensor at all.
        """
        from torch.distributed.tensor import Replicate, distribute_tensor

        local = sys.modules.get("torch.distributed._local_tensor")
        plain = type(t) in (torch.Tensor, nn.Parameter) or (
            local is not None and type(t) is local.LocalTensor
        )
        if plain and self.is_supported_tensor(t):
            self.hit += 1
            spec = [Replicate()] * mesh.ndim if t.ndim == 0 else placements
            converted: torch.Tensor = distribute_tensor(t, mesh, spec)
            if isinstance(t, nn.Parameter):
                converted = nn.Parameter(converted, requires_grad=converted.requires_grad)
            return converted
        if plain or torch.overrides.is_tensor_like(t):
            # Unsupported layouts, and tensor subclasses (a DTensor holding a subclass is not
            # supported), stay as they are.
            self.miss += 1
            return t
        raise RuntimeError(f"Trying to convert to DTensor, but got {type(t)}")


# -- redistribution with an explicit shard order -------------------------------------------------


def _shard_order_entries(shard_order: Mapping[int, Sequence[int]]) -> tuple[Any, ...]:
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

    return tuple(
        ShardOrderEntry(tensor_dim=dim, mesh_dims=tuple(mesh_dims))
        for dim, mesh_dims in shard_order.items()
    )


def shard_order_to_placement(shard_order: Any, mesh: Any) -> tuple[Any, ...]:
    """The placements (``Shard``/``Replicate`` only) that ``shard_order`` describes on
    ``mesh``: ``Shard(entry.tensor_dim)`` on each of an entry's mesh dimensions.

    Args:
        shard_order: ``ShardOrderEntry`` items, or None for all replicated.
        mesh: the device mesh.
    """
    from torch.distributed.tensor import Replicate, Shard

    placements: list[Any] = [Replicate() for _ in range(mesh.ndim)]
    for entry in shard_order or ():
        for mesh_dim in entry.mesh_dims:
            placements[mesh_dim] = Shard(entry.tensor_dim)
    return tuple(placements)


def redistribute(
    dtensor_input: Any,
    device_mesh: Any,
    placements: Any,
    shard_order: Any,
    use_graph_based_transform: bool = True,
) -> Any:
    """``dtensor_input`` redistributed to ``placements`` in ``shard_order`` (forward only), for
    torch releases whose ``DTensor.redistribute`` takes no shard order.

    Args:
        dtensor_input: the DTensor.
        device_mesh: its mesh.
        placements: the target placements, or None to derive them from ``shard_order``.
        shard_order: the target ``ShardOrderEntry`` items; None or ``()`` for the default.
        use_graph_based_transform: plan the transform as torch's graph search does (default
            True).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    if placements is None:
        placements = shard_order_to_placement(shard_order, device_mesh)
    old_spec = dtensor_input._spec
    new_spec = copy.deepcopy(old_spec)
    new_spec.placements = tuple(placements)
    new_spec.shard_order = shard_order if shard_order is not None else ()
    if old_spec == new_spec:
        return dtensor_input
    local = redistribute_local_tensor(
        dtensor_input.to_local(),
        old_spec,
        new_spec,
        use_graph_based_transform=use_graph_based_transform,
    )
    result = DTensor.from_local(local, device_mesh)
    result._spec = copy.deepcopy(new_spec)
    return result


def patched_distribute_tensor(
    input_tensor: torch.Tensor,
    device_mesh: Any,
    placements: Any,
    shard_order: Any,
    use_graph_based_transform: bool = True,
    src_data_rank: int | None = 0,
) -> Any:
    """``distribute_tensor`` with a shard order: distributed with ``placements`` (strided shards
    not read as a shard order), then :func:`redistribute` to ``shard_order``.

    Args:
        input_tensor: the full tensor.
        device_mesh: the mesh.
        placements: the placements, or None to derive them from ``shard_order``.
        shard_order: the ``ShardOrderEntry`` items.
        use_graph_based_transform: see :func:`redistribute` (default True).
        src_data_rank: the rank whose tensor is scattered; None for each rank's own
            (default 0).
    """
    from torch.distributed.tensor import distribute_tensor

    if placements is None:
        placements = shard_order_to_placement(shard_order, device_mesh)
    placements = tuple(placements)
    distributed = distribute_tensor(
        input_tensor, device_mesh, placements, src_data_rank=src_data_rank
    )
    distributed._spec.use_strided_shard_as_shard_order = False
    distributed._spec.__post_init__()
    return redistribute(
        distributed, device_mesh, placements, shard_order, use_graph_based_transform
    )


def make_full_tensor(dtensor_input: Any) -> torch.Tensor:
    """The whole tensor of a DTensor with any shard order (``DTensor.full_tensor`` for torch
    releases that ignore it)."""
    replicated = redistribute(
        dtensor_input, dtensor_input.device_mesh, placements=None, shard_order=()
    )
    return replicated.to_local()


def _contiguous_splits(items: list[int], parts: int) -> Iterator[list[list[int]]]:
    """Each way of cutting ``items`` into ``parts`` non-empty runs, in order."""
    for cuts in itertools.combinations(range(1, len(items)), parts - 1):
        bounds = (0, *cuts, len(items))
        yield [items[a:b] for a, b in itertools.pairwise(bounds)]


def generate_shard_orders(mesh: Any, tensor_rank: int) -> Iterator[tuple[Any, ...]]:
    """Every shard order of a tensor with ``tensor_rank`` dimensions over ``mesh``, in torch's
    order (repeats included): for each ordering of the mesh dimensions, cut into consecutive
    runs, each run assigned to one tensor dimension (tensor dimensions taken in increasing
    order).

    Args:
        mesh: the device mesh.
        tensor_rank: the tensor's number of dimensions.
    """
    mesh_dims = list(range(mesh.ndim))
    for device_order in itertools.permutations(mesh_dims):
        for parts in range(1, mesh.ndim + 1):
            for runs in _contiguous_splits(mesh_dims, parts):
                for tensor_dims in itertools.combinations(range(tensor_rank), len(runs)):
                    order = {
                        dim: device_order[run[0] : run[-1] + 1]
                        for dim, run in zip(tensor_dims, runs, strict=True)
                    }
                    yield _shard_order_entries(order)
