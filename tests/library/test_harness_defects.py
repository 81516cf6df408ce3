"""Issue 23's two harness defects: ``compiled_fsdp_test`` leaves the test module's own
``fully_shard`` in place (a warm rank used to keep torch's, so later tests silently ran torch's
engine), and torch's FSDP1 refusing parameter offload on CPU reads as "needs an accelerator",
which the torch-style classes turn into a skip naming the need (it used to fail them)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from fsdp_testing._compat.accelerator_errors import needs_accelerator as _needs_accelerator
from fsdp_testing._compat.fsdp import compiled_fsdp_test


def _module_with(**globals_: object) -> types.ModuleType:
    module = types.ModuleType("fake_torch_test_module")
    module.__dict__.update(globals_)
    exec(
        "def body(seen):\n    seen.append(globals().get('fully_shard'))\n",
        module.__dict__,
    )
    return module


def test_compiled_fsdp_test_shards_with_and_restores_the_modules_own_fully_shard() -> None:
    def engine_fully_shard(module: nn.Module) -> nn.Module:
        return module

    module = _module_with(fully_shard=engine_fully_shard)
    seen: list[object] = []
    compiled_fsdp_test()(module.body)(seen)
    eager, compiled = seen
    assert eager is engine_fully_shard
    assert compiled is not engine_fully_shard and callable(compiled)
    assert module.fully_shard is engine_fully_shard  # not torch's: later tests keep the engine


def test_compiled_fsdp_test_leaves_no_fully_shard_behind_where_there_was_none() -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    module = _module_with()
    seen: list[object] = []
    compiled_fsdp_test()(module.body)(seen)
    assert seen[0] is torch_fully_shard
    assert "fully_shard" not in module.__dict__


def test_compiled_fsdp_test_restores_after_a_failing_run() -> None:
    def engine_fully_shard(module: nn.Module) -> nn.Module:
        return module

    module = _module_with(fully_shard=engine_fully_shard)
    exec("def broken():\n    raise ValueError('boom')\n", module.__dict__)
    with pytest.raises(ValueError, match="boom"):
        compiled_fsdp_test()(module.broken)()
    assert module.fully_shard is engine_fully_shard


@pytest.mark.distributed(world_size=1024, mode="fake", rank=517)
def test_fsdp1_offload_refusal_is_read_as_needing_an_accelerator() -> None:
    from torch.distributed.fsdp import CPUOffload

    from fsdp_testing.engines import get_engine

    with pytest.raises(NotImplementedError) as info:
        get_engine("torch_fsdp1").wrap(nn.Linear(4, 4), cpu_offload=CPUOffload(offload_params=True))
    if torch.cuda.is_available():  # pragma: no cover - the refusal exists only without one
        pytest.skip("an accelerator is present")
    reason = _needs_accelerator(info.value)
    assert reason is not None and "Cannot access accelerator device" in reason
    assert "torch_fsdp2" in str(info.value)  # the fix is still named


def test_an_accelerator_index_built_from_the_cpu_module_reads_as_needing_an_accelerator() -> None:
    """torch's GPU-gated bodies build ``torch.device(type, module.current_device())``; on the CPU
    ``torch.cpu.current_device()`` is the string "cpu", so the body fails for want of an
    accelerator, not of the engine."""
    device_type = torch.device("cpu")
    with pytest.raises(TypeError) as info:
        torch.device(device_type.type, torch.get_device_module(device_type).current_device())
    reason = _needs_accelerator(info.value)
    assert reason is not None and reason.startswith("TypeError: device(): argument 'index'")
    assert _needs_accelerator(TypeError("device(): argument 'type' must be str")) is None


@pytest.mark.distributed(world_size=1)
def test_fsdp2_params_asked_for_on_an_indexed_cpu_device_read_as_needing_an_accelerator() -> None:
    """torch's GPU-gated collective tests build FSDP2's ``FSDPParamGroup`` for
    ``torch.device(device_type, 0)``; on the CPU that is ``cpu:0``, which no CPU tensor is on."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_init import _init_default_fully_shard_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
        FSDPMeshInfo,
        FSDPParamGroup,
    )

    module = nn.ParameterList([nn.Parameter(torch.randn(4, device=torch.device("cpu", 0)))])
    mesh_info = FSDPMeshInfo(_init_default_fully_shard_mesh(), shard_mesh_dim=0)
    with pytest.raises(AssertionError) as info:
        FSDPParamGroup(
            list(module.parameters()), (module,), mesh_info, None, torch.device("cpu", 0),
            None, MixedPrecisionPolicy(), OffloadPolicy(),
        )  # fmt: skip
    reason = _needs_accelerator(info.value)
    assert reason is not None and "moved to device cpu:0 but got cpu" in reason
