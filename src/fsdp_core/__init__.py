"""fsdp_core: a readable FSDP engine on torch.distributed collectives.

Layout (one role per module). Public:

- ``api``: public enums and frozen config dataclasses.
- ``fully_sharded_data_parallel``: the FSDP1-style wrapper door, ``FullyShardedDataParallel``.
- ``_composable``: the composable door, ``fully_shard``, ``replicate`` and ``FSDPModule``
  (FSDP2 names; private package, its names are re-exported here).
- ``views``: ``unit_views``, frozen views of how a model is sharded (both doors), for code on
  top of the engine (the harness, graph mode, benchmarks).
- ``debug``: switches for tools and measurement (``suspend_hooks``, ``set_order_check``).
- ``events``: the publish/subscribe hook that makes unshard/reshard/collectives observable.
- ``wrap``: auto-wrap policies and manual ``wrap``/``enable_wrap``.
- ``checkpoint``: DCP ``get_state_dict``/``set_state_dict``/``save``/``load`` for both doors.
- ``sharded_grad_scaler``: ``ShardedGradScaler``, loss scaling with found-inf agreed by all ranks.
- ``graph``: graph mode, a ``fully_shard`` step as one FX graph and FSDP's choices as passes
  over it (imported on its own: ``import fsdp_core.graph``).

The engine both doors share:

- ``_init``: construction steps both doors share (owned parameters and buffers, nested units,
  ``sync_module_states``).
- ``_wrapper``: what the wrapper door uses beside the engine: argument checks and groups
  (``args``), ``summon_full_params`` (``full_params``), gradient norm clipping (``clip_grad``).
- ``_groups``: a unit's process groups (shard, replicate, the hybrid grid).
- ``_param``: one parameter moving between its local dim-0 shard and its unsharded form
  (shown as a ``DTensor`` of a ``_dtensor_layout.DTensorLayout``).
- ``_unit``: ``FSDPUnit``, the parameters of one fully sharded module, with one all-gather per
  unshard and one gradient reduction per backward.
- ``_reduce``: a unit's gradient reduction over its groups (reduce-scatter, then all-reduce
  across replicas).
- ``_post_forward``: resharding after forward to a smaller group (``reshard_after_forward=N``).
- ``_offload``: CPU offload copies.
- ``_precision``: resolved mixed precision dtypes, input casting, buffer slots.
- ``_streams``: the CUDA side streams and the events that order them (absent on the CPU).
- ``_collectives``: pure functions over ``torch.distributed`` (looked up at call time).
- ``_exec_order``: the recorded forward order, prefetch targets, cross-rank order validation.
- ``_order_check``: the order tag every unit collective carries in its payload, compared after
  it (a divergence in any iteration raises on every rank, with no extra collective).
- ``_runtime``: ``FSDPState``, the forward/backward hooks; ``_root``: what only a root does
  (lazy init, the end of a backward iteration).
- ``_state_dict``: state dicts: full (``full``), sharded (``DTensor``) and local (``sharded``),
  the ``state_dict_type`` settings and the save/load dispatch on them (``settings``), optimizer
  state dicts keyed by parameter name (``optim``).
"""

from . import debug, events, views, wrap
from ._composable import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    GradientReductionHandle,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    replicate,
    share_comm_ctx,
)
from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    TrainingState,
)
from .fully_sharded_data_parallel import FSDP, FullyShardedDataParallel
from .sharded_grad_scaler import ShardedGradScaler
from .views import ParamView, ShardedState, UnitView, unit_views

__all__ = [
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "GradientReductionHandle",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ParamView",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedState",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "TrainingState",
    "UnitView",
    "UnshardHandle",
    "debug",
    "events",
    "fully_shard",
    "register_fsdp_forward_method",
    "replicate",
    "share_comm_ctx",
    "unit_views",
    "views",
    "wrap",
]
