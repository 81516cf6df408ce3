"""The wrapper door's public names against torch's, the lambda and custom auto-wrap policies,
and ``device_id`` given as a string."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import fsdp_core
from fsdp_core import FSDP, ShardingStrategy
from fsdp_core import wrap as core_wrap
from fsdp_core._init import device_from_id

from ._models import NestedModel


def test_public_names_cover_torch_fsdp():
    """Every name in torch.distributed.fsdp.__all__ (the state dict configuration classes
    included) and every public name defined in torch.distributed.fsdp.wrap exists in fsdp_core
    (resp. fsdp_core.wrap)."""
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    missing = sorted(n for n in torch_fsdp.__all__ if not hasattr(fsdp_core, n))
    assert missing == []
    assert "StateDictSettings" in torch_fsdp.__all__  # the list this checks is torch's own
    wrap_names = {
        n
        for n, v in vars(torch_wrap).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == torch_wrap.__name__
    }
    assert {"CustomPolicy", "lambda_auto_wrap_policy", "ModuleWrapPolicy"} <= wrap_names
    assert sorted(n for n in wrap_names if not hasattr(core_wrap, n)) == []


def _units(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, FSDP) and n)


@pytest.mark.distributed(world_size=2)
def test_lambda_and_custom_policies_wrap_what_they_select(rank, process_group):
    """lambda_auto_wrap_policy wraps the modules its function selects; CustomPolicy does too,
    and a dict it returns overrides that unit's constructor arguments."""
    policy = functools.partial(
        core_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: m.__class__ is nn.Sequential
    )
    model = FSDP(NestedModel(), process_group, auto_wrap_policy=policy)
    assert _units(model) == ["_fsdp_wrapped_module.block"]

    def choose(m: nn.Module) -> bool | dict:
        if isinstance(m, nn.Linear) and m.out_features == 16:
            return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
        return isinstance(m, nn.Linear)

    model = FSDP(NestedModel(), process_group, auto_wrap_policy=core_wrap.CustomPolicy(choose))
    units = {n: m for n, m in model.named_modules() if isinstance(m, FSDP) and n}
    prefix = "_fsdp_wrapped_module."
    assert sorted(units) == sorted(prefix + n for n in ("inp", "block.0", "block.2", "out"))
    strategies = {n[len(prefix) :]: m.sharding_strategy for n, m in units.items()}
    assert strategies == {
        "inp": ShardingStrategy.FULL_SHARD,
        "block.0": ShardingStrategy.SHARD_GRAD_OP,
        "block.2": ShardingStrategy.SHARD_GRAD_OP,
        "out": ShardingStrategy.FULL_SHARD,
    }
    with pytest.raises(TypeError, match=r"CustomPolicy\(lambda_fn\) takes a callable"):
        core_wrap.CustomPolicy(3)  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=2)
def test_device_id_as_a_string(rank, process_group):
    """device_id="cpu" puts the unit on the CPU; a malformed name raises naming the fix."""
    assert device_from_id("FSDP", "cpu") == torch.device("cpu")
    assert device_from_id("FSDP", "cuda:1") == torch.device("cuda", 1)
    model = FSDP(NestedModel(), process_group, device_id="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ValueError, match=r"FullyShardedDataParallel: device_id='gpu0' is not"):
        FSDP(NestedModel(), process_group, device_id="gpu0")
