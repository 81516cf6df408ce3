"""A model on the full SPMD mesh, as ``dp_mesh_dims`` takes it (see [Note: SPMD meshes] in
``src/fsdp_core/_spmd_mesh.py``): what a user writes before ``fully_shard(..., mesh=mesh,
dp_mesh_dims=...)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module


def on_spmd_mesh(model: nn.Module, mesh: Any) -> nn.Module:
    """``model``'s parameters as ``Replicate()`` DTensors on ``mesh``; its tensor inputs become
    replicated DTensors there (each rank's own batch, as DDP's) and its output a plain tensor
    again, so the training loop stays the one for a plain model."""

    def inputs_on_mesh(_: nn.Module, inputs: tuple[Any, ...], device_mesh: Any) -> tuple[Any, ...]:
        replicate = [Replicate()] * device_mesh.ndim
        return tuple(
            DTensor.from_local(x, device_mesh, replicate, run_check=False)
            if isinstance(x, torch.Tensor)
            else x
            for x in inputs
        )

    def output_local(_: nn.Module, output: Any, device_mesh: Any) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    distribute_module(model, mesh, input_fn=inputs_on_mesh, output_fn=output_local)
    return model
