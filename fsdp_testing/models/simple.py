"""Building-block models without the :class:`FSDPTestModel` interface: MLPs, a pass-through
data-parallel wrapper, a two-output module and the ``wrap()``-annotated skip models."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._protocol import ENGINE_ENV
from ..engines import current_engine
from ._base import resolve_device

__all__ = [
    "MLP",
    "DoubleLinear",
    "DummyDDP",
    "MLPStack",
    "NestedLinear",
    "SkipModel",
    "SkipModule",
]


class DummyDDP(nn.Module):
    """A reference "data parallel" wrapper that does nothing: forward calls ``self.module``.

    For models that reduce their own gradients (``MixtureOfExperts``) or whose parameters must
    not be synchronized across ranks.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class MLP(nn.Module):
    """``relu(out_proj(relu(in_proj(x)))) [+ buffer]``.

    Args:
        dim: input and output width.
        device: where to create the parameters (default: torch's default device).
        bias: give the projections biases (default True).
        with_buffer: add a ``buffer`` of shape ``(dim,)`` to the output (default False).
        dim_multiplier: hidden width is ``dim_multiplier * dim`` (default 4).
    """

    def __init__(
        self,
        dim: int,
        device: torch.device | str | None = None,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ) -> None:
        super().__init__()
        hidden = dim * dim_multiplier
        self.in_proj = nn.Linear(dim, hidden, bias=bias, device=device)
        self.out_proj = nn.Linear(hidden, dim, bias=bias, device=device)
        self.buffer: torch.Tensor | None
        if with_buffer:
            self.register_buffer("buffer", torch.randn(dim, device=device))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        return out if self.buffer is None else out + self.buffer

    def reset_parameters(self) -> None:
        """Re-draws the buffer (the projections reset themselves), e.g. after meta init."""
        if self.buffer is not None:
            nn.init.normal_(self.buffer)


class MLPStack(nn.Sequential):
    """Three :class:`MLP` blocks (hidden widths 3x, 4x, 3x: the 3x ones shard unevenly), plus a
    ``LayerNorm`` when ``with_seq_parallel``.

    Args:
        mlp_dim: width of every block.
        with_seq_parallel: append ``LayerNorm(mlp_dim, bias=False)`` for sequence parallelism.
    """

    def __init__(self, mlp_dim: int, *, with_seq_parallel: bool = False) -> None:
        blocks: list[nn.Module] = [MLP(mlp_dim, dim_multiplier=m) for m in (3, 4, 3)]
        if with_seq_parallel:
            blocks.append(nn.LayerNorm(mlp_dim, bias=False))
        super().__init__(*blocks)
        self.with_seq_parallel = with_seq_parallel

    def parallelize(
        self,
        tp_mesh: Any,
        dp_mesh: Any,
        use_activation_checkpointing: bool,
        **fsdp_kwargs: Any,
    ) -> MLPStack:
        """Applies tensor parallelism over ``tp_mesh`` (skipped when ``None``), optional
        activation checkpointing, then FSDP2 ``fully_shard`` over ``dp_mesh`` per block and at
        the root: torch's, or ``fsdp_core.fully_shard`` when the session's engine is fsdp_core
        (``--fsdp-engine fsdp_core``, under which ``benchmarks/torch_compat.py`` also points a
        torch-style body's FSDP2 imports at fsdp_core).

        Args:
            tp_mesh: 1D mesh for tensor parallelism, or ``None`` for FSDP only.
            dp_mesh: 1D mesh for data parallel sharding.
            use_activation_checkpointing: checkpoint each block.
            fsdp_kwargs: keyword arguments of ``fully_shard``.
        """
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        fully_shard: Any = torch_fully_shard
        if os.environ.get(ENGINE_ENV, "").startswith("fsdp_core"):
            from fsdp_core import fully_shard as core_fully_shard

            fully_shard = core_fully_shard

        if tp_mesh is not None:
            self._apply_tensor_parallel(tp_mesh)
        blocks = [block for block in self if not isinstance(block, nn.LayerNorm)]
        for block in blocks:
            if use_activation_checkpointing:
                from torch.distributed._composable import checkpoint

                checkpoint(block)
            fully_shard(block, mesh=dp_mesh, **fsdp_kwargs)
        fully_shard(self, mesh=dp_mesh, **fsdp_kwargs)
        return self

    def _apply_tensor_parallel(self, tp_mesh: Any) -> None:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        plan: dict[str, Any] = {}
        for index in range(3):
            # Keep activations as DTensors between blocks: hidden widths are uneven.
            plan[f"{index}.in_proj"] = ColwiseParallel(use_local_output=False)
            plan[f"{index}.out_proj"] = RowwiseParallel(use_local_output=False)
        if self.with_seq_parallel:
            plan["2.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
            plan["3"] = SequenceParallel(sequence_dim=1)
        else:
            plan["2.out_proj"] = RowwiseParallel()
        parallelize_module(self, device_mesh=tp_mesh, parallelize_plan=plan)


class DoubleLinear(nn.Module):
    """Two parallel linears: returns both outputs (``use_second_linear=True``) or only the
    first, leaving ``lin2`` unused.

    Args:
        dim: width.
        use_second_linear: return ``(relu(lin1(x)), relu(lin2(x)))`` (default True).
    """

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        first = self.relu(self.lin1(x))
        if not self.use_second_linear:
            return first
        return first, self.relu(self.lin2(x))


class SkipModule(nn.Module):
    """One bias-free ``Linear(10, 10)`` named ``lin``."""

    def __init__(self, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False, device=resolve_device(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class NestedLinear(nn.Module):
    """A bias-free ``Linear(10, 10)`` as ``nested_linear``, wrapped with the active engine's
    ``wrap()`` when ``fsdp_wrap`` (effective inside the engine's ``enable_wrap``).

    Args:
        fsdp_wrap: annotate ``nested_linear`` for wrapping.
        device: where to create it, default CUDA if available else CPU.
    """

    def __init__(self, fsdp_wrap: bool, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        linear = nn.Linear(10, 10, bias=False, device=resolve_device(device))
        self.nested_linear = current_engine().wrap_if_enabled(linear) if fsdp_wrap else linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nested_linear(x)


class SkipModel(nn.Module):
    """``linear -> linear_skip (SkipModule) -> nested_linear (NestedLinear, wrap()-annotated)``.

    Args:
        double_nest: also annotate the linear inside ``nested_linear``.
        device: where to create it, default CUDA if available else CPU.
    """

    def __init__(self, double_nest: bool, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        target = resolve_device(device)
        self.linear = nn.Linear(10, 10, bias=False, device=target)
        self.linear_skip = SkipModule(device=target)
        nested = NestedLinear(fsdp_wrap=double_nest, device=target)
        self.nested_linear = current_engine().wrap_if_enabled(nested)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nested_linear(self.linear_skip(self.linear(x)))
