"""Small local test models for the fsdp_core tests (independent of fsdp_testing.models).

Each builder returns an unwrapped module, built identically on every rank from a fixed seed,
plus the auto-wrap policy or manual wrapping that makes it a nested FSDP model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import FSDP
from fsdp_core.wrap import ModuleWrapPolicy, always_wrap_policy, enable_wrap, wrap

Wrapper = Callable[[nn.Module], nn.Module]


class NestedModel(nn.Module):
    """Linear -> (Linear -> Linear) -> Linear, the inner pair its own sub-block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 4)
        self.block = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.block(self.inp(x))))


class FrozenNestedModel(NestedModel):
    """NestedModel with non-uniform requires_grad: ``inp`` fully and ``block[0].bias`` frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.inp.requires_grad_(False)
        self.block[0].bias.requires_grad_(False)


class TiedTransformer(nn.Module):
    """Embedding -> 2 encoder layers -> projection whose weight is the embedding weight."""

    vocab = 23

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 8)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, self.vocab, bias=False)
        self.proj.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.proj(self.norm(h))


class MixtureOfExperts(nn.Module):
    """Shared in/out layers around a per-rank expert (different weights on every rank)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)
        self.expert = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        _init_params(self.expert, seed=1000 + rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.expert(self.inp(x))))


class FourLinear(nn.Module):
    """The seed-000 model: lin1..lin4 with ``lin4`` holding ``nested_lin``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(1, 1, bias=False)
        self.lin2 = nn.Linear(1, 1, bias=False)
        self.lin3 = nn.Linear(1, 1, bias=False)
        self.lin4 = nn.Sequential(nn.Linear(1, 1, bias=False))

    @property
    def nested_lin(self) -> nn.Module:
        return self.lin4[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin4(self.lin3(self.lin2(self.lin1(x))))


def get_input(kind: str, rank: int, step: int) -> torch.Tensor:
    """A per-rank, per-step batch for model ``kind``."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    if kind == "transformer":
        return torch.randint(0, TiedTransformer.vocab, (2, 5), generator=gen)
    return torch.randn(4, 8, generator=gen)


def _init_params(model: nn.Module, seed: int) -> None:
    """Deterministic values from a private generator: thread ranks share the global RNG."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def build(kind: str, rank: int) -> nn.Module:
    """The unwrapped model ``kind``, identical on every rank except MoE experts."""
    models: dict[str, Callable[[], nn.Module]] = {
        "nested": NestedModel,
        "always_wrap": NestedModel,
        "frozen": FrozenNestedModel,
        "transformer": TiedTransformer,
        "moe": functools.partial(MixtureOfExperts, rank),
    }
    model = models[kind]()
    shared = [m for name, m in model.named_children() if name != "expert"]
    for i, module in enumerate(shared):
        _init_params(module, seed=i)
    return model


def wrap_model(
    kind: str, model: nn.Module, group: dist.ProcessGroup, **fsdp_kwargs: Any
) -> nn.Module:
    """Wrap ``model`` the way model ``kind`` is meant to be nested."""
    if kind == "always_wrap":
        return FSDP(model, group, auto_wrap_policy=always_wrap_policy, **fsdp_kwargs)
    if kind == "transformer":
        policy = ModuleWrapPolicy({nn.TransformerEncoderLayer})
        return FSDP(model, group, auto_wrap_policy=policy, **fsdp_kwargs)
    if kind == "moe":
        # Each rank's expert is its own unit on a group of one rank: never sharded or averaged.
        expert_group = _own_rank_group(group)
        assert isinstance(model, MixtureOfExperts)
        model.expert = FSDP(model.expert, expert_group, **fsdp_kwargs)
        return FSDP(model, group, **fsdp_kwargs)
    # nested / frozen: manual wrapping of the inner block.
    with enable_wrap(wrapper_cls=FSDP, process_group=group, **fsdp_kwargs):
        assert isinstance(model, NestedModel)
        model.block = wrap(model.block)
        return wrap(model)


# (parent group, {rank: one-rank group}); kept so a warm rank reuses its groups.
_rank_groups: list[tuple[dist.ProcessGroup, dict[int, Any]]] = []


def _own_rank_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A one-rank group per rank (new_group must be called by every rank for every group)."""
    for parent, groups in list(_rank_groups):
        if parent is group:
            try:
                dist.get_rank(groups[dist.get_rank()])
            except ValueError:  # destroyed between tests (the parent may outlive them): rebuild
                _rank_groups.remove((parent, groups))
                break
            return groups[dist.get_rank()]
    ranks = dist.get_process_group_ranks(group)
    groups = {r: dist.new_group([r]) for r in ranks}
    _rank_groups.append((group, groups))
    return groups[dist.get_rank()]
