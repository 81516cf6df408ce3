"""Testing a tensor-parallel library of your own (``examples/tensor_parallel.py``) against one
device with ``check_parity``: the mesh says which dims split the batch, ``layout`` which dim
each plain shard is cut on, and the harness assembles the full weights and compares them after
every step. No gather code.

Run it with ``pytest examples/test_tensor_parallel.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    mlp,
    vocab_parallel_cross_entropy,
)

from fsdp_testing.parity import check_parity

MLP_LAYOUT = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # column rows, row columns


def build_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def tokens(i: int, dp_rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * i + dp_rank))


@pytest.mark.distributed(world_size=2)
def test_tensor_parallel_mlp():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    check_parity(
        build_mlp, lambda model, _: mlp(model, mesh.get_group("tp")), tokens,
        mesh=mesh, layout=MLP_LAYOUT,
    )  # fmt: skip


@pytest.mark.distributed(world_size=4)
def test_data_and_tensor_parallel_mlp():
    # 2 replicas x 2 tensor-parallel ranks: the batch follows the "dp" coordinate, and DDP
    # averages each shard's gradient over the replicas.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def wrap(model: nn.Module, _: object) -> nn.Module:
        tp = mlp(model, mesh.get_group("tp"))
        return nn.parallel.DistributedDataParallel(tp, process_group=mesh.get_group("dp"))

    check_parity(build_mlp, wrap, tokens, mesh=mesh, dp_dims="dp", layout=MLP_LAYOUT)


@pytest.mark.distributed(world_size=2)
def test_sequence_parallel_mlp():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shard = x.chunk(2)[dist.get_rank(group)]  # this rank's part of the sequence
        loss = model(shard).pow(2).sum() / x.numel()
        loss.backward()
        dist.all_reduce(total := loss.detach().clone(), group=group)
        return total

    check_parity(
        build_mlp, lambda model, _: mlp(model, group, sequence_parallel=True), tokens,
        loss_fn=lambda model, x: model(x).pow(2).mean(), step_fn=step,
        mesh=mesh, layout=MLP_LAYOUT,
    )  # fmt: skip


class LanguageModel(nn.Module):
    """An embedding and an output projection over a vocabulary of 16."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def text(i: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randint(16, (12,), generator=g), torch.randint(16, (12,), generator=g)


@pytest.mark.distributed(world_size=2)
def test_vocab_parallel_embedding_and_cross_entropy():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")

    def shard(model: LanguageModel, _: object) -> nn.Module:
        model.embed = VocabParallelEmbedding(model.embed, group)
        model.out = ColumnParallelLinear(model.out, group)  # logits split on the vocabulary
        return model

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = vocab_parallel_cross_entropy(model(batch[0]), batch[1], group)
        loss.backward()
        return loss

    check_parity(
        LanguageModel, shard, text, step_fn=step,
        loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        mesh=mesh, layout={"embed.weight": 0, "out.weight": 0, "out.bias": 0},
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
