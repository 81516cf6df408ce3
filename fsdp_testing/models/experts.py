"""Mixture-of-experts layers of torch's DTensor test models, and the parallel styles that shard
them (``common_dtensor``'s names and placements).

- :class:`Experts`: ``num_experts`` feed-forwards stored as two 3-D parameters, ``w1``
  ``(experts, hidden, dim)`` and ``w2`` ``(experts, dim, hidden)``; every token goes through
  every expert and the outputs are summed (a dense stand-in for routing, enough to test
  sharding).
- :class:`ExpertLayer`: flattens tokens for :class:`Experts` and averages over the experts.
- :class:`TensorParallelForExpert`: ``w1`` column-wise (``Shard(1)``), ``w2`` row-wise
  (``Shard(2)``); the partial outputs are reduced, optionally with sequence-parallel
  gather/scatter of the tokens.
- :class:`ExpertParallel`: experts split across ranks (``Shard(0)``); tokens are all-gathered
  before and the outputs reduce-scattered after.
- :class:`ExpertParallelWithTP`: both on an ``(ep, tp)`` mesh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "ExpertLayer",
    "ExpertParallel",
    "ExpertParallelWithTP",
    "Experts",
    "TensorParallelForExpert",
]


class Experts(nn.Module):
    """``num_experts`` two-layer feed-forwards with GELU, weights ``w1`` and ``w2``.

    Args:
        dim: token width.
        hidden_dim: each expert's inner width.
        num_experts: how many experts.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # (E, hidden, dim)
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # (E, dim, hidden)
        self.reset_parameters()
        self.gelu = nn.GELU()

    def reset_parameters(self) -> None:
        """Normal initialization with standard deviation 0.02."""
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        # Sharded weights are DTensors while the tokens the parallel styles hand in are plain
        # tensors: compute on the local shards.
        w1: torch.Tensor = self.w1
        w2: torch.Tensor = self.w2
        if isinstance(w1, DTensor):
            w1 = w1.to_local()
        if isinstance(w2, DTensor):
            w2 = w2.to_local()
        per_expert = x.unsqueeze(0).expand(w1.shape[0], -1, -1)  # (E, tokens, dim)
        hidden = self.gelu(torch.bmm(per_expert, w1.transpose(-2, -1)))
        return torch.bmm(hidden, w2.transpose(-2, -1)).sum(dim=0)


class ExpertLayer(nn.Module):
    """Runs ``experts`` on the flattened tokens and averages over the experts.

    Args:
        num_experts: how many experts.
        dim: token width.
        hidden_dim: each expert's inner width.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.experts = Experts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq_len, dim = x.shape
        out = self.experts(x.view(-1, dim)) / self.num_experts
        return out.view(bs, seq_len, dim)


def _shard_parameters(module: nn.Module, mesh: Any, placements: dict[str, list[Any]]) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        if name in placements:
            sharded = distribute_tensor(param, mesh, placements[name])
            module.register_parameter(name, nn.Parameter(sharded))


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(tensor)


class TensorParallelForExpert(ParallelStyle):
    """Tensor parallelism inside :class:`Experts`: ``w1`` sharded on its hidden dimension
    (``Shard(1)``), ``w2`` on its hidden dimension (``Shard(2)``); the outputs are partial sums,
    redistributed to ``output_layouts``. For sequence parallelism pass ``Shard(0)`` for both:
    the tokens are all-gathered before and the outputs reduce-scattered after.

    Args:
        input_layouts: the tokens' placement on the mesh, or None for tokens every rank holds
            whole (default None).
        output_layouts: the outputs' placement (default ``Replicate()``).
    """

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None) -> None:
        from torch.distributed.tensor import Replicate

        super().__init__()
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts or Replicate()

    def _partition_fn(self, name: str, mod: nn.Module, device_mesh: Any) -> None:
        from torch.distributed.tensor import Shard

        _shard_parameters(mod, device_mesh, {"w1": [Shard(1)], "w2": [Shard(2)]})

    def _input_fn(self, mod: nn.Module, inputs: tuple[Any, ...], device_mesh: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        if self.input_layouts is None:
            return inputs
        gathered = DTensor.from_local(inputs[0], device_mesh, [self.input_layouts])
        return (gathered.redistribute(device_mesh, [Replicate()]).to_local(),)

    def _output_fn(self, mod: nn.Module, outputs: torch.Tensor, device_mesh: Any) -> Any:
        from torch.distributed.tensor import DTensor, Partial

        partial = DTensor.from_local(outputs, device_mesh, [Partial()])
        return partial.redistribute(device_mesh, [self.output_layouts]).to_local()

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition_fn,
            input_fn=self._input_fn,
            output_fn=self._output_fn,
        )


class ExpertParallel(ParallelStyle):
    """Expert parallelism: each rank holds ``num_experts / ranks`` experts (``Shard(0)`` on every
    parameter); the tokens of all ranks are all-gathered before the experts run and the
    outputs reduce-scattered (summed) back to the ranks that own the tokens."""

    def _partition_fn(self, name: str, mod: nn.Module, device_mesh: Any) -> None:
        from torch.distributed.tensor import Shard

        params = [n for n, _ in mod.named_parameters(recurse=False)]
        _shard_parameters(mod, device_mesh, {n: [Shard(0)] for n in params})

    def _token_dispatch(self, mod: nn.Module, inputs: tuple[Any, ...], device_mesh: Any) -> Any:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        (x,) = inputs
        gathered = all_gather_single_autograd(x, gather_dim=0, group=device_mesh.get_group())
        return (_wait(gathered),)

    def _token_combine(self, mod: nn.Module, output: torch.Tensor, device_mesh: Any) -> Any:
        from torch.distributed._functional_collectives import reduce_scatter_single_autograd

        scattered = reduce_scatter_single_autograd(
            output, "sum", scatter_dim=0, group=device_mesh.get_group()
        )
        return _wait(scattered)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition_fn,
            input_fn=self._token_dispatch,
            output_fn=self._token_combine,
        )


class ExpertParallelWithTP(ParallelStyle):
    """Expert and tensor parallelism together, applied to an :class:`ExpertLayer`: its experts'
    weights are placed on the ``(ep, tp)`` mesh as ``[Shard(0), Shard(1)]`` (``w1``) and
    ``[Shard(0), Shard(2)]`` (``w2``). Hooks on the layer gather the tokens over ``ep_mesh``
    and scatter the outputs back; hooks on its experts all-reduce the input gradient and the
    partial outputs over ``tp_mesh``. In forward: expert dispatch, tensor-parallel input,
    experts, tensor-parallel reduction, expert combine.

    Args:
        ep_mesh: the expert-parallel 1-D mesh.
        tp_mesh: the tensor-parallel 1-D mesh.
    """

    def __init__(self, ep_mesh: Any, tp_mesh: Any) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        super().__init__()
        self.ep_mesh = ep_mesh
        self.tp_mesh = tp_mesh
        self.ep_tp_mesh = DeviceMesh._concatenate([ep_mesh, tp_mesh])

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed._functional_collectives import (
            all_gather_single_autograd,
            reduce_scatter_single_autograd,
        )
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        experts = module.experts
        if not isinstance(experts, nn.Module):
            raise TypeError(
                f"ExpertParallelWithTP applies to an ExpertLayer (a module with .experts), got "
                f"{type(module).__name__}"
            )
        _shard_parameters(
            experts, self.ep_tp_mesh, {"w1": [Shard(0), Shard(1)], "w2": [Shard(0), Shard(2)]}
        )
        ep_group, tp_mesh = self.ep_mesh.get_group(), self.tp_mesh

        def dispatch(mod: nn.Module, inputs: tuple[Any, ...]) -> Any:
            gathered = all_gather_single_autograd(inputs[0], gather_dim=0, group=ep_group)
            return (_wait(gathered),)

        def combine(mod: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> Any:
            return _wait(
                reduce_scatter_single_autograd(output, "sum", scatter_dim=0, group=ep_group)
            )

        def reduce_input_grad(mod: nn.Module, inputs: tuple[Any, ...]) -> Any:
            # Identity in forward; the input's gradient is all-reduced over tp in backward.
            replicated = DTensor.from_local(inputs[0], tp_mesh, [Replicate()])
            return (replicated.to_local(grad_placements=[Partial()]),)

        def reduce_output(mod: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> Any:
            partial = DTensor.from_local(output, tp_mesh, [Partial()])
            return partial.redistribute(tp_mesh, [Replicate()]).to_local()

        module.register_forward_pre_hook(dispatch)
        module.register_forward_hook(combine)
        experts.register_forward_pre_hook(reduce_input_grad)
        experts.register_forward_hook(reduce_output)
        return module
