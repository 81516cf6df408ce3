"""The composable door, torch FSDP2's names on fsdp_core's engine.

By role: ``_api`` (the policies), ``_fsdp_module`` (``FSDPModule``'s methods, forward hooks,
``UnshardHandle``, ``register_fsdp_forward_method``, ``share_comm_ctx``), ``_fully_shard``
(``fully_shard``: validation, mesh, the unit).
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from ._fully_shard import fully_shard

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
