"""Engine for torch's FSDP1 wrapper, ``torch.distributed.fsdp.FullyShardedDataParallel``.

[Note: FSDP1 on a machine without an accelerator]
FSDP1 (torch 2.13) refuses to build when no accelerator exists unless ``device_id`` is the CPU
("FSDP needs a non-CPU accelerator device"), refuses ``sync_module_states=True`` for CPU modules,
and fails on ``CPUOffload(offload_params=True)`` ("Cannot access accelerator device"). With no
accelerator this engine therefore passes ``device_id=torch.device("cpu")`` unless one is given,
performs ``sync_module_states`` itself (a broadcast from the group's rank 0 before wrapping,
skipping already wrapped subtrees, whose local tensors are shards), and rejects parameter
offloading with a NotImplementedError. With an accelerator, arguments pass through unchanged.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._base import PatchTarget, broadcast_module_states, has_accelerator
from ._wrapper import WrapperEngine

__all__ = ["TorchFSDP1Engine"]


class TorchFSDP1Engine(WrapperEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for torch's ``FullyShardedDataParallel``.

    Unit transitions are FSDP1's free functions in ``torch.distributed.fsdp._runtime_utils``
    (``_unshard``, ``_reshard``, ``_post_backward_hook``); the unit class is ``FlatParamHandle``.
    """

    name = "torch_fsdp1"

    def _load_api(self) -> SimpleNamespace:
        import torch.distributed.fsdp as fsdp
        import torch.distributed.fsdp._runtime_utils as runtime
        import torch.distributed.fsdp.wrap as wrap_module
        from torch.distributed.fsdp._flat_param import FlatParamHandle

        return SimpleNamespace(
            FSDP=fsdp.FullyShardedDataParallel,
            wrap_module=wrap_module,
            StateDictType=fsdp.StateDictType,
            option_types={
                "sharding_strategy": fsdp.ShardingStrategy,
                "backward_prefetch": fsdp.BackwardPrefetch,
                "cpu_offload": fsdp.CPUOffload,
                "mixed_precision": fsdp.MixedPrecision,
            },
            unit_class=FlatParamHandle,
            patch_targets={
                "unshard": PatchTarget(runtime, "_unshard"),
                "reshard": PatchTarget(runtime, "_reshard"),
                "post_backward": PatchTarget(runtime, "_post_backward_hook"),
            },
        )

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        _attach_functional_collectives()
        return super().wrap(module, process_group, **fsdp_kwargs)

    def _prepare_kwargs(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None,
        fsdp_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        if has_accelerator():
            return fsdp_kwargs
        # See [Note: FSDP1 on a machine without an accelerator]
        kwargs = dict(fsdp_kwargs)
        if kwargs.get("device_id") is None:
            kwargs["device_id"] = torch.device("cpu")
        offload = kwargs.get("cpu_offload")
        if offload is not None and getattr(offload, "offload_params", False):
            raise NotImplementedError(
                "engine 'torch_fsdp1': torch's FSDP1 cannot offload parameters "
                "(cpu_offload=CPUOffload(offload_params=True)) on a machine without an "
                "accelerator; use engine 'torch_fsdp2' or 'fsdp_core', or drop cpu_offload"
            )
        if kwargs.pop("sync_module_states", False):
            broadcast_module_states(
                module, process_group, skip=lambda m: isinstance(m, self.api.FSDP)
            )
        return kwargs


def _attach_functional_collectives() -> None:
    # FSDP1's FlatParamHandle reads ``torch.distributed._functional_collectives`` as an
    # attribute without importing it (torch 2.13), so it fails with an AttributeError in a
    # process where nothing imported it, or where the submodule is in sys.modules but the
    # attribute on torch.distributed was removed (a warm rank restoring module attributes).
    module = importlib.import_module("torch.distributed._functional_collectives")
    if getattr(dist, "_functional_collectives", None) is not module:
        dist._functional_collectives = module
