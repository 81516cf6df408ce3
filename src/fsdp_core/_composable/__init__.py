"""The composable door, torch FSDP2's names on fsdp_core's engine.

By role: ``_api`` (the policies), ``_fsdp_module`` (``FSDPModule``'s methods, forward hooks,
``UnshardHandle``, ``register_fsdp_forward_method``, ``share_comm_ctx``), ``_build`` (what
``fully_shard`` and ``replicate`` share: argument checks, owned parameters, the unit, state
and hooks), ``_fully_shard`` (``fully_shard``: its options and mesh), ``_replicate``
(``replicate``: whole parameters, all-reduced gradients), ``_shared`` (parameters shared
across units).
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_module import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ._fully_shard import fully_shard
from ._replicate import replicate

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "replicate",
    "share_comm_ctx",
]
