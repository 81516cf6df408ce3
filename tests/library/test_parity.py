"""DDP parity, sharded parity and cross-rank state checks, and that each one catches bugs."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision

from fsdp_testing.engines import get_engine
from fsdp_testing.engines.torch_fsdp1 import TorchFSDP1Engine
from fsdp_testing.models import (
    DEVICEInitMode,
    DummyDDP,
    FSDPInitMode,
    MixtureOfExperts,
    MLPStack,
    NestedWrappedModule,
    TransformerWithSharedParams,
)
from fsdp_testing.parity import (
    FP32_TOLERANCE,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    ParityRule,
    assert_module_states_equal,
    check_fsdp_parity,
    check_sharded_parity,
)
from fsdp_testing.patching import patch_reduce_scatter

PARITY_CASES = [
    pytest.param(NestedWrappedModule, {}, id="nested"),
    pytest.param(TransformerWithSharedParams, {}, id="transformer"),
    # Experts differ per rank: the reference must not synchronize parameters.
    pytest.param(MixtureOfExperts, {"ref_init_fn": DummyDDP}, id="moe"),
]


@pytest.mark.parametrize("model_class, options", PARITY_CASES)
@pytest.mark.distributed(world_size=2)
def test_torch_fsdp1_matches_ddp(model_class, options, process_group):
    check_fsdp_parity(
        model_class,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_BEFORE,
        process_group=process_group,
        engine="torch_fsdp1",
        **options,
    )


@pytest.mark.distributed(world_size=4)
def test_torch_fsdp1_matches_ddp_at_world_size_4_with_orig_params(process_group):
    check_fsdp_parity(
        NestedWrappedModule,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_AFTER,
        num_iters=3,
        use_orig_params=True,
        process_group=process_group,
        engine="torch_fsdp1",
    )


@pytest.mark.distributed(world_size=2)
def test_torch_fsdp2_matches_ddp(process_group):
    check_fsdp_parity(
        NestedWrappedModule,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_BEFORE,
        process_group=process_group,
        engine="torch_fsdp2",
    )


@pytest.mark.parametrize("model_class, options", PARITY_CASES)
@pytest.mark.distributed(world_size=2)
def test_fsdp_core_matches_ddp(model_class, options, process_group):
    check_fsdp_parity(
        model_class,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_BEFORE,
        process_group=process_group,
        engine="fsdp_core",
        **options,
    )


@pytest.mark.distributed(world_size=2)
def test_fsdp_core_matches_ddp_with_cpu_offload(process_group):
    """torch's CPUOffload, translated by the engine; parameters stay on the CPU."""
    check_fsdp_parity(
        NestedWrappedModule,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_BEFORE,
        process_group=process_group,
        engine="fsdp_core",
        cpu_offload=CPUOffload(offload_params=True),
    )


BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
POLICIES = {
    "bf16/fp32": BF16,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16),
    "fp16": MixedPrecision(param_dtype=torch.float16),
}


@pytest.mark.parametrize("engine", ["fsdp_core", "torch_fsdp1", "torch_fsdp2"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model_class, options", PARITY_CASES)
@pytest.mark.distributed(world_size=2)
def test_mixed_precision_matches_the_precision_reference_bitwise(
    engine, policy, model_class, options, process_group
):
    """Under a mixed precision policy the reference runs the policy by hand (fp32 masters,
    bf16/fp16 compute, gradients averaged in the reduce dtype): at world size 2 on the CPU
    every engine matches it to the bit, losses and parameters, for three steps (the
    transformer's batch norm included, kept in fp32 by every engine)."""
    check_fsdp_parity(
        model_class,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_BEFORE,
        num_iters=3,
        mixed_precision=POLICIES[policy],
        process_group=process_group,
        engine=engine,
        exact=True,
        **options,
    )


@pytest.mark.distributed(world_size=2)
def test_mixed_precision_parity_catches_a_reduction_in_the_wrong_dtype(process_group):
    """bf16 compute with an fp32 reduction: an engine that sums the gradients in bf16 instead
    changes the parameters by bf16 roundings of the averaged gradients. The precision
    reference compares parameters, so the default rule catches it; a loss compared against an
    autocast reference could not."""

    def rounded_to_bf16(output, input, **kwargs):
        work = call_next(output, input, **kwargs)
        output.copy_(output.to(torch.bfloat16))
        return work

    with patch_reduce_scatter(rounded_to_bf16) as call_next:
        with pytest.raises(AssertionError, match=r"at step 1 of 2 .*\n.*max abs diff"):
            check_fsdp_parity(
                NestedWrappedModule,
                FSDPInitMode.RECURSIVE,
                DEVICEInitMode.DEVICE_BEFORE,
                mixed_precision=BF16,
                process_group=process_group,
                engine="fsdp_core",
            )


def test_parity_rule_tolerances_follow_the_precision():
    assert ParityRule.for_training() == ParityRule(loss=FP32_TOLERANCE, params=FP32_TOLERANCE)
    rule = ParityRule.for_training(POLICIES["bf16"])
    assert rule.loss == LOSS_TOLERANCE[torch.bfloat16]
    assert rule.params == PARAM_TOLERANCE[torch.bfloat16]
    assert ParityRule.for_training(BF16).params == FP32_TOLERANCE  # reduced in fp32
    pure = ParityRule.for_training(use_pure_fp16=True, exact=True)
    assert pure.exact and pure.params is None and pure.loss == LOSS_TOLERANCE[torch.float16]
    one, other = torch.tensor([1.0]), torch.tensor([1.0 + 2e-6])
    assert ParityRule(exact=True).divergences(one, other, [], []) != []
    assert ParityRule().divergences(one, other, [], []) == []  # within 1e-5 relative
    # Dtypes must agree: a bf16 loss is not an fp32 one, whatever the values.
    (dtype,) = ParityRule().divergences(one, one.bfloat16(), [], [])
    assert "dtype torch.bfloat16, reference torch.float32" in str(dtype)


@pytest.mark.distributed(world_size=2)
def test_check_sharded_parity_with_torch_fsdp2(process_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = MLPStack(8)
    model = copy.deepcopy(reference)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    check_sharded_parity(reference, model)  # before training: no gradients on either side
    rank = process_group.rank()
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(batch).sum().backward()
    # The replicated reference sees the whole global batch; FSDP averages over ranks.
    everyone = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (reference(torch.cat(everyone)).sum() / 2).backward()
    check_sharded_parity(reference, model)


# -- the checks catch bugs ----------------------------------------------------------------------


class _NoReductionEngine:
    """A broken "data parallel" engine: leaves the module alone, so gradients are never
    averaged across ranks."""

    name = "no_reduction"

    def wrap(self, module, process_group=None, **fsdp_kwargs):
        module._broken_engine = True
        return module

    def is_wrapped(self, module):
        return getattr(module, "_broken_engine", False)

    def manages(self, module):
        return any(self.is_wrapped(m) for m in module.modules())

    def named_full_params(self, module):
        return [(n, p.detach().clone()) for n, p in module.named_parameters()]

    def full_params(self, module, *, recurse=True, writeback=True):
        return contextlib.nullcontext()

    def full_state_dict(self, module):
        return {k: v.clone() for k, v in module.state_dict().items()}

    def load_full_state_dict(self, module, state_dict):
        module.load_state_dict(state_dict)


class _WrongParameterEngine(TorchFSDP1Engine):
    """torch's FSDP1, but the root wrap corrupts ``module.3.bias`` first."""

    name = "wrong_parameter"

    def wrap(self, module, process_group=None, **fsdp_kwargs):
        if isinstance(module, NestedWrappedModule):
            with torch.no_grad():
                module.module[3].bias.add_(0.5)
        return super().wrap(module, process_group, **fsdp_kwargs)


@pytest.mark.distributed(world_size=2)
def test_parity_failure_names_step_and_parameters_when_gradients_are_not_averaged(
    process_group,
):
    with pytest.raises(AssertionError) as failure:
        check_fsdp_parity(
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            num_iters=3,
            process_group=process_group,
            engine=_NoReductionEngine(),
        )
    message = str(failure.value)
    assert f"[rank {process_group.rank()}]" in message
    assert "at step 1 of 3" in message
    assert "module.0.weight: max abs diff" in message
    cause = message.split("likely cause:\n  ")[1]
    assert cause.startswith("the ranks' gradients of module.0.weight, module.1.0.weight, ")
    assert "differ from each other but average to the reference's (within " in cause
    assert cause.endswith("gradients not all-reduced: each rank stepped on its own")


@pytest.mark.distributed(world_size=2)
def test_parity_failure_names_a_wrong_parameter_and_its_difference(process_group):
    with pytest.raises(AssertionError) as failure:
        check_fsdp_parity(
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            process_group=process_group,
            engine=_WrongParameterEngine(),
        )
    message = str(failure.value)
    assert "at step 1 of 2" in message
    bias_line = next(line for line in message.splitlines() if "module.3.bias" in line)
    assert "max abs diff 5.0" in bias_line  # the corruption, give or take one SGD step
    assert message.endswith(
        "likely cause:\n  before step 1, module.3.bias already differed from the reference (max "
        "abs diff 5.000e-01): the wrapping changed the initial weights (it must start from the "
        "module it is given)"
    )


@pytest.mark.distributed(world_size=2)
def test_check_sharded_parity_names_a_diverged_shard(process_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = MLPStack(8)
    model = copy.deepcopy(reference)
    fully_shard(model)
    with torch.no_grad():
        reference[1].out_proj.bias.add_(1.0)
    with pytest.raises(AssertionError, match=r"1\.out_proj\.bias: max abs diff 1\.000e\+00"):
        check_sharded_parity(reference, model)
    with pytest.raises(AssertionError, match=r"0\.in_proj\.weight is a Parameter, not a DTensor"):
        check_sharded_parity(reference, copy.deepcopy(reference))


@pytest.mark.distributed(world_size=2)
def test_assert_module_states_equal_names_state_and_rank(rank, process_group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert_module_states_equal(model, process_group)
    if rank == 1:
        model[1].running_mean.add_(3.0)
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: 1\.running_mean: max abs diff 3"):
        assert_module_states_equal(model, process_group)


@pytest.mark.distributed(world_size=2)
def test_full_state_dict_survives_save_zero_load_for_fsdp1(process_group):
    engine = get_engine("torch_fsdp1")
    torch.manual_seed(0)
    model = engine.wrap(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), process_group)
    saved = engine.full_state_dict(model)
    with engine.full_params(model, writeback=True), torch.no_grad():
        for param in model.parameters():
            param.zero_()
    assert all(not p.any() for p in engine.full_state_dict(model).values())
    engine.load_full_state_dict(model, saved)
    restored = engine.full_state_dict(model)
    assert all(torch.equal(restored[k], v) for k, v in saved.items())


class _BadOptionModel(NestedWrappedModule):
    @staticmethod
    def init(group, fsdp_init_mode, *args, **kwargs):  # type: ignore[override]
        if fsdp_init_mode is FSDPInitMode.NO_FSDP:  # the reference builds fine
            return NestedWrappedModule.init(group, fsdp_init_mode, *args, **kwargs)
        raise TypeError("wrap() got an unexpected keyword argument 'shard_everything'")


@pytest.mark.distributed(world_size=2, mode="thread")
def test_an_engine_init_error_keeps_its_type_and_names_model_and_engine(process_group):
    with pytest.raises(TypeError, match="shard_everything") as info:
        check_fsdp_parity(
            _BadOptionModel,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            process_group=process_group,
            engine="fsdp_core",
        )
    notes = getattr(info.value, "__notes__", [])
    assert any("_BadOptionModel" in n and "'fsdp_core'" in n for n in notes), notes
