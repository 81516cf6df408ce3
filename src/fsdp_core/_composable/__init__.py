"""The composable door, torch FSDP2's names on fsdp_core's engine.

By role: ``_api`` (the policies), ``_fsdp_module`` (``FSDPModule``'s methods,
``register_fsdp_forward_method``, ``share_comm_ctx``), ``_comm_settings`` (``FSDPModule``'s
base: its communication settings), ``_handles`` (``UnshardHandle``,
``GradientReductionHandle``), ``_hooks`` (forward hooks), ``_build`` (what
``fully_shard`` and ``replicate`` share: argument checks, owned parameters, the unit, state
and hooks), ``_fully_shard`` (``fully_shard``: its options and mesh), ``_replicate``
(``replicate``: whole parameters, all-reduced gradients), ``_shared`` (parameters shared
across units).
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_module import FSDPModule, register_fsdp_forward_method, share_comm_ctx
from ._fully_shard import fully_shard
from ._handles import GradientReductionHandle, UnshardHandle
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
