"""Users' models for ``fsdp-testing plan --model tests.cli._plan_models:NAME``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    """``Linear(dim, dim) + ReLU``: one unit under ``--wrap Block``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def stack(dim: int = 16, depth: int = 3) -> nn.Module:
    """``depth`` blocks; its inputs come from ``--input-shape``."""
    return nn.Sequential(*[Block(dim) for _ in range(depth)])


class WithInput(nn.Sequential):
    """A stack that says its own inputs (``get_input``, ``get_loss``, ``run_backward``)."""

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(4, 16, device=device),)

    def get_loss(self, input: Any, output: torch.Tensor) -> torch.Tensor:
        return output.square().sum()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


def with_input() -> nn.Module:
    return WithInput(Block(16), Block(16))


def not_a_module() -> int:
    return 3


def sharded() -> nn.Module:
    """A model that shards itself (the planner refuses it: it shards models itself)."""
    from fsdp_core import fully_shard

    model = stack()
    fully_shard(model)
    return model
