"""A public, typed view of how a model is sharded: one frozen :class:`UnitView` per unit.

[Note: unit views]
Code on top of the engine (the test harness's engines, graph mode, the benchmarks, a planner)
needs to know how a model was sharded: which units exist, over which groups, which parameters
each owns, how they are padded, in which dtypes they move. :func:`unit_views` answers that for
both doors (``FullyShardedDataParallel``, ``fully_shard`` and ``replicate``) from the engine's
state at the time of the call, so such code reads this module and nothing private: a change
inside the engine changes how a view is built here, not what a view says.

A view is a snapshot: it is built on each call (never in a hook), holds no tensor, and does not
change when the model does. Everything in it is this rank's: the shard and replicate groups
with this rank's index in each, this rank's rows of every parameter and its padding. On a fake
world (``@pytest.mark.distributed(mode="fake")``) and on the meta device the views are those of
the rank being played, so sharding math for a large world needs no allocation.

Units exist per FSDP instance or ``fully_shard``/``replicate`` call that owns parameters; an
instance that owns none (e.g. a root whose parameters all sit in nested units) has no unit and
no view. Which instance is the root is decided at the first forward (lazy init): before it,
``is_root`` is ``None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ._composable._fsdp_module import api_of
from ._composable._hooks import hooks_of
from ._param import ShardedState
from ._runtime import FSDPState, clean_fqn, states_in
from .api import ShardingStrategy, TrainingState
from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["ParamView", "ShardedState", "UnitView", "unit_views"]


@dataclass(frozen=True, kw_only=True)
class ParamView:
    """One original parameter of a unit, as this rank holds it.

    Args:
        fqn: its name in the model (as ``named_parameters()`` of the model passed to
            :func:`unit_views` gives it; the first name of a tied parameter).
        shape: the full (unsharded) shape (of a tensor-parallel ``DTensor`` parameter: its
            local tensor-parallel piece, which is what the unit shards).
        dtype: the sharded parameter's dtype (what the optimizer steps; the original dtype).
        requires_grad: whether it trains now (users may freeze it after sharding).
        shard_dim: the dimension it is sharded along (0, or the ``shard_placement_fn`` dim);
            "rows" below count along it.
        padded_rows: rows every rank of the shard group holds after padding,
            ``ceil(shape[shard_dim] / shard_size)`` (the whole tensor when unsharded).
        start_row: the first row of this rank's shard.
        local_shape: the shape of this rank's shard: ``shape`` with ``local_rows`` at
            ``shard_dim``, where ``local_rows`` may be fewer than ``padded_rows`` (the last
            ranks) or zero.
        padding_numel: elements of zero padding behind this rank's rows, up to
            ``padded_rows`` (sent by the all-gather and the reduce-scatter like data).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    shard_dim: int
    padded_rows: int
    start_row: int
    local_shape: tuple[int, ...]
    padding_numel: int

    @property
    def local_rows(self) -> int:
        """Rows of the parameter this rank holds (``local_shape[shard_dim]``)."""
        return self.local_shape[self.shard_dim]

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class UnitView:
    """One unit (the parameters one FSDP instance or ``fully_shard`` call owns), as this rank
    sees it. See [Note: unit views].

    A group of one rank (no sharding, or no replicas) is ``None`` with size 1, index 0 and this
    rank's global rank as its only member. Dtypes are what the unit moves: ``param_dtype`` is
    the dtype it gathers and computes in when it casts (``None``: each parameter's own dtype),
    ``reduce_dtype`` the one it reduces gradients in when that differs from the parameters'
    (``None``: their own).

    Args:
        fqn: the module name of the instance (``""`` for the model passed in, which is the root
            when that is the outermost FSDP module), wrapper components removed.
        door: ``"FullyShardedDataParallel"``, ``"fully_shard"`` or ``"replicate"``.
        is_root: whether the unit is the root's; ``None`` before the first forward.
        module_fqns: the modules the unit was applied to (several for ``fully_shard([a, b])``).
        params: the parameters it owns, in the order of its flat buffer.
        shard_group: the group the parameters are dim-0 sharded over, or ``None``.
        shard_size: ranks in it.
        shard_rank: this rank's index in it.
        shard_ranks: its global ranks.
        replicate_group: the group each shard is replicated across (HSDP, ``NO_SHARD``,
            ``replicate``), or ``None``.
        replicate_size: ranks in it.
        replicate_rank: this rank's index in it.
        replicate_ranks: its global ranks.
        param_dtype: see above.
        reduce_dtype: see above.
        output_dtype: the dtype forward outputs are cast to, or ``None``.
        buffer_dtype: the dtype floating-point buffers are cast to for compute (the wrapper's
            ``MixedPrecision.buffer_dtype``), or ``None``.
        offload_params: the shards and their gradients live on the CPU.
        compute_device: where forward and backward run.
        reshard_after_forward: what the unit does after forward: ``True`` frees the unsharded
            parameters, ``False`` keeps them, an int keeps a copy sharded over groups of that
            many ranks. The root keeps its parameters unless its door was told otherwise; before
            the first forward (``is_root`` is ``None``) this is the value for a non-root unit.
        sharding_strategy: the wrapper's strategy; ``None`` for ``fully_shard``/``replicate``.
        order_check: the unit's collectives carry order tags, from the first forward on (see
            "Order checks" in docs/core.md; off only through
            :func:`fsdp_core.debug.set_order_check`).
        state: ``UNSHARDED`` between an unshard and its reshard (the unsharded parameters
            allocated and shown), else ``SHARDED`` (also inside ``summon_full_params``, which
            shows full copies).
        training_state: where the instance is in a step (``IDLE`` between steps).
    """

    fqn: str
    door: str
    is_root: bool | None
    module_fqns: tuple[str, ...]
    params: tuple[ParamView, ...]
    shard_group: dist.ProcessGroup | None
    shard_size: int
    shard_rank: int
    shard_ranks: tuple[int, ...]
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    replicate_rank: int
    replicate_ranks: tuple[int, ...]
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    buffer_dtype: torch.dtype | None
    offload_params: bool
    compute_device: torch.device
    reshard_after_forward: bool | int
    sharding_strategy: ShardingStrategy | None
    order_check: bool
    state: ShardedState
    training_state: TrainingState

    @property
    def world(self) -> int:
        """Ranks holding a part or a replica of the unit (``shard_size * replicate_size``):
        what gradients are averaged over."""
        return self.shard_size * self.replicate_size

    def gather_dtype(self, param: ParamView) -> torch.dtype:
        """The dtype ``param`` is all-gathered and computed in."""
        return self.param_dtype or param.dtype

    def grad_reduce_dtype(self, param: ParamView) -> torch.dtype:
        """The dtype ``param``'s gradient is reduced in."""
        return self.reduce_dtype or param.dtype


def unit_views(module: nn.Module) -> tuple[UnitView, ...]:
    """The units of every FSDP instance in ``module``'s tree (``module`` included), outermost
    first (``modules()`` order), as frozen views. See [Note: unit views].

    Args:
        module: a model sharded by either door, or a module containing some (names are
            relative to it).

    Returns:
        One :class:`UnitView` per unit; empty for a module with no FSDP instance.
    """
    names: dict[int, str] = {}  # module -> its first name, in ``named_modules()`` order
    for name, sub in module.named_modules(remove_duplicate=False):
        names.setdefault(id(sub), clean_fqn(name))
    position = {key: index for index, key in enumerate(names)}
    return tuple(_view(s, names, position) for s in states_in(module) if s.unit is not None)


def _modules_of(state: FSDPState) -> list[nn.Module]:
    hooks = hooks_of(state.owner)
    return list(hooks.modules) if hooks is not None else [state.owner]


def _door(state: FSDPState) -> str:
    if isinstance(state.owner, FullyShardedDataParallel):
        return "FullyShardedDataParallel"
    return api_of(state.owner)


def _group(group: dist.ProcessGroup | None) -> tuple[int, int, tuple[int, ...]]:
    """Size, this rank's index and the global ranks of ``group`` (``None``: this rank)."""
    if group is None:
        return 1, 0, (dist.get_rank(),)
    ranks = tuple(dist.get_process_group_ranks(group))
    return len(ranks), dist.get_rank(group), ranks


def _view(state: FSDPState, names: dict[int, str], position: dict[int, int]) -> UnitView:
    unit = state.unit
    assert unit is not None  # for mypy: unit_views skips states without one
    modules = [m for m in _modules_of(state) if id(m) in names]
    module_fqns = tuple(names[id(m)] for m in modules)
    # The instance's name: that of the first of its modules in ``named_modules()`` order, as
    # lazy init names it.
    fqn = names[min((id(m) for m in modules), key=position.__getitem__)]
    params = []
    for p in unit.params:
        owner, attr = p.slots[0]
        prefix = names.get(id(owner))
        if prefix is None:  # its first user is outside ``module``: its name in the unit
            param_fqn = f"{fqn}.{p.fqn}" if fqn else p.fqn
        else:
            param_fqn = f"{prefix}.{attr}" if prefix else attr
        local_shape = list(p.chunk_shape)
        local_shape[p.shard_dim] = p.valid_rows
        row_numel = math.prod(p.full_shape) // p.rows if p.rows else 0
        params.append(
            ParamView(
                fqn=param_fqn,
                shape=tuple(p.full_shape),
                dtype=p.padded_shard.dtype,
                requires_grad=p.requires_grad,
                shard_dim=p.shard_dim,
                padded_rows=p.chunk_rows,
                start_row=p.start_row,
                local_shape=tuple(local_shape),
                padding_numel=(p.chunk_rows - p.valid_rows) * row_numel,
            )
        )
    shard_size, shard_rank, shard_ranks = _group(unit.groups.shard)
    replicate_size, replicate_rank, replicate_ranks = _group(unit.groups.replicate)
    precision, config = unit.precision, state.config
    rsf: bool | int = config.reshard_after_forward
    if state.is_root and not config.reshard_root_after_forward:
        rsf = False  # the root's parameters are the first that backward needs
    owner = state.owner
    return UnitView(
        fqn=fqn,
        door=_door(state),
        is_root=state.is_root,
        module_fqns=module_fqns,
        params=tuple(params),
        shard_group=unit.groups.shard,
        shard_size=shard_size,
        shard_rank=shard_rank,
        shard_ranks=shard_ranks,
        replicate_group=unit.groups.replicate,
        replicate_size=replicate_size,
        replicate_rank=replicate_rank,
        replicate_ranks=replicate_ranks,
        param_dtype=precision.param_dtype if precision.casts_params else None,
        reduce_dtype=(
            precision.reduce_dtype if precision.reduce_dtype != precision.orig_dtype else None
        ),
        output_dtype=config.output_dtype,
        buffer_dtype=config.buffer_dtype,
        offload_params=unit.offload_params,
        compute_device=unit.device,
        reshard_after_forward=rsf,
        sharding_strategy=(
            owner.sharding_strategy if isinstance(owner, FullyShardedDataParallel) else None
        ),
        order_check=state.tag_collectives,
        state=ShardedState.UNSHARDED if unit.is_unsharded else ShardedState.SHARDED,
        training_state=state.training_state,
    )
