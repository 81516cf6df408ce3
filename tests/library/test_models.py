"""Reference models: interface, structure, device placement, determinism and delays."""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from fsdp_testing.engines import PatchTarget, clean_param_name, get_engine, use_engine
from fsdp_testing.models import (
    MLP,
    AlwaysWrapNestedWrappedModule,
    CUDAInitMode,
    DEVICEInitMode,
    DoubleLinear,
    DummyDDP,
    FSDPInitMode,
    FSDPTestModel,
    MixtureOfExperts,
    MLPStack,
    ModuleWithDelay,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    NonUniformReqGradNWM,
    SkipModel,
    TransformerWithSharedParams,
    as_device_init_mode,
    as_fsdp_init_mode,
)
from fsdp_testing.parity import assert_module_states_equal
from fsdp_testing.patching import patched

CPU = torch.device("cpu")
ENGINE_NAMES = ["fsdp_core", "torch_fsdp1", "torch_fsdp2"]
# A stand-in group for unsharded construction in a single process.
SOLO = SimpleNamespace(rank=lambda: 0, size=lambda: 1)

LOCAL_MODELS = [
    NestedWrappedModule,
    AlwaysWrapNestedWrappedModule,
    NonUniformReqGradNWM,
    TransformerWithSharedParams,
    NestedWrappedModuleWithDelay,
]


def _train_step(model: FSDPTestModel) -> torch.Tensor:
    inputs = model.get_input(CPU)
    loss = model.get_loss(inputs, model(*inputs))
    model.run_backward(loss)
    return loss


@pytest.mark.parametrize("model_class", LOCAL_MODELS, ids=lambda c: c.__name__)
def test_unsharded_models_run_forward_and_backward_on_cpu(model_class):
    model = model_class.init(
        SOLO, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_BEFORE, deterministic=True, device=CPU
    )
    loss = _train_step(model)
    assert loss.dim() == 0 and torch.isfinite(loss)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)
    assert all(p.device == CPU for p in model.parameters())


@pytest.mark.parametrize("model_class", LOCAL_MODELS, ids=lambda c: c.__name__)
def test_deterministic_init_is_reproducible(model_class):
    def build() -> nn.Module:
        return model_class.init(
            SOLO, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_NEVER, deterministic=True
        )

    first, second = build(), build()
    states = zip(first.state_dict().items(), second.state_dict().items(), strict=True)
    for (name, a), (_, b) in states:
        assert torch.equal(a, b), name


def test_nested_wrapped_module_keeps_torch_module_paths():
    model = NestedWrappedModule.init(SOLO, FSDPInitMode.NO_FSDP, CUDAInitMode.CUDA_NEVER)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.endswith("weight")}
    assert shapes == {
        "module.0.weight": (4, 8),
        "module.1.0.weight": (16, 4),
        "module.1.1.weight": (16, 16),
        "module.2.weight": (4, 16),
        "module.3.weight": (8, 4),
    }


def test_non_uniform_req_grad_freezes_all_but_module_2_1():
    model = NonUniformReqGradNWM.init(SOLO, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_NEVER)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["module.2.1.bias", "module.2.1.weight"]


def test_transformer_ties_embedding_and_output_and_stays_small():
    model = TransformerWithSharedParams.init(
        SOLO, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_NEVER, deterministic=True
    )
    assert model.output_proj.weight is model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "output_proj.weight" not in names  # deduplicated: one parameter
    assert model.embed_tokens.weight.shape == (23, 16)
    assert sum(p.numel() for p in model.parameters()) < 10_000
    assert not model.training  # deterministic: eval mode, no dropout
    assert isinstance(model.bn, nn.BatchNorm1d)
    assert model.get_ignored_modules() == [model.transformer]


def test_device_init_mode_aliases_are_the_same_members():
    assert CUDAInitMode.CUDA_BEFORE is DEVICEInitMode.DEVICE_BEFORE
    assert CUDAInitMode.CUDA_AFTER is DEVICEInitMode.DEVICE_AFTER
    assert CUDAInitMode.CUDA_NEVER is DEVICEInitMode.DEVICE_NEVER
    assert [m.name for m in DEVICEInitMode] == ["DEVICE_BEFORE", "DEVICE_AFTER", "DEVICE_NEVER"]


def test_torch_init_modes_are_accepted():
    from torch.testing._internal import common_fsdp

    assert as_fsdp_init_mode(common_fsdp.FSDPInitMode.RECURSIVE) is FSDPInitMode.RECURSIVE
    torch_mode = common_fsdp.DEVICEInitMode.DEVICE_AFTER
    assert as_device_init_mode(torch_mode) is DEVICEInitMode.DEVICE_AFTER
    with pytest.raises(ValueError, match="DEVICE_BEFORE, DEVICE_AFTER"):
        as_device_init_mode("GPU_SOMETIMES")


def test_module_with_delay_sleeps_on_cpu():
    model = ModuleWithDelay.init(
        NestedWrappedModule,
        SOLO,
        FSDPInitMode.NO_FSDP,
        DEVICEInitMode.DEVICE_NEVER,
        delay_after_loss_ms=150,
        delay_before_reduction_ms=0,
    )
    inputs = model.get_input(CPU)
    output = model(*inputs)
    start = time.perf_counter()
    model.get_loss(inputs, output)
    assert time.perf_counter() - start >= 0.14


def test_building_blocks():
    x = torch.randn(2, 8)
    mlp = MLP(8, with_buffer=True, dim_multiplier=3)
    assert mlp.in_proj.out_features == 24 and mlp(x).shape == (2, 8)
    stack = MLPStack(8, with_seq_parallel=True)
    assert [type(m).__name__ for m in stack] == ["MLP", "MLP", "MLP", "LayerNorm"]
    pair = DoubleLinear(8)
    assert isinstance(pair(x), tuple)
    assert isinstance(DoubleLinear(8, use_second_linear=False)(x), torch.Tensor)
    assert torch.equal(DummyDDP(pair.lin1)(x), pair.lin1(x))
    skip = SkipModel(double_nest=True, device=CPU)  # outside enable_wrap: nothing wrapped
    assert skip(torch.randn(3, 10)).shape == (3, 10)
    assert type(skip.nested_linear.nested_linear) is nn.Linear


@pytest.mark.distributed(world_size=2)
def test_deterministic_init_matches_across_ranks(rank, process_group):
    model = NestedWrappedModule.init(
        process_group, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_BEFORE, deterministic=True
    )
    assert_module_states_equal(model, process_group)
    (first,) = model.get_input(CPU)
    gathered = [torch.empty_like(first) for _ in range(2)]
    torch.distributed.all_gather(gathered, first, group=process_group)
    assert not torch.equal(gathered[0], gathered[1])  # ranks see different data


@pytest.mark.distributed(world_size=2)
def test_mixture_of_experts_keeps_experts_per_rank(rank, process_group):
    model = MixtureOfExperts.init(
        process_group, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_BEFORE, deterministic=True
    )
    expert = model.module[2]
    assert all(getattr(p, "expert", False) for p in expert.parameters())
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: module\.2\.weight"):
        assert_module_states_equal(model, process_group)
    _train_step(model)
    # run_backward averaged the shared gradients, not the expert's.
    shared_grad = model.module[1].weight.grad.clone()
    others = [torch.empty_like(shared_grad) for _ in range(2)]
    torch.distributed.all_gather(others, shared_grad, group=process_group)
    assert torch.equal(others[0], others[1])


# torch's reference models under FSDPInitMode.RECURSIVE: TransformerWithSharedParams and
# AlwaysWrapNestedWrappedModule wrap the root; NestedWrappedModule, NonUniformReqGradNWM,
# MixtureOfExperts and NestedWrappedModuleWithDelay shard nested units only ("the model may later
# be wrapped with a top-level FSDP external to this method") and the parity check wraps the root.
RECURSIVE_MODELS = [
    NestedWrappedModule,
    AlwaysWrapNestedWrappedModule,
    NonUniformReqGradNWM,
    TransformerWithSharedParams,
    MixtureOfExperts,
    NestedWrappedModuleWithDelay,
]
ROOT_WRAPPED = {TransformerWithSharedParams, AlwaysWrapNestedWrappedModule}


def _unit_paths(model: nn.Module, is_unit: Any) -> list[str]:
    return [clean_param_name(f"{n}.").rstrip(".") for n, m in model.named_modules() if is_unit(m)]


def _torch_unit_paths(model_class: type, process_group: Any) -> list[str]:
    """The FSDP1 units of torch's own model of the same name, built under RECURSIVE."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.testing._internal import common_fsdp

    # torch's FSDP1 refuses the CPU unless device_id says so, and MixtureOfExperts builds some
    # units without the caller's fsdp_kwargs: give every FSDP(...) call in common_fsdp the CPU.
    # DEVICE_NEVER keeps the parameters there too: DEVICE_BEFORE would move them to
    # common_fsdp's DEVICE_TYPE, which is cuda wherever a GPU exists.
    on_cpu = functools.partial(FSDP, device_id=CPU)
    with patched(PatchTarget(common_fsdp, "FSDP"), on_cpu):
        reference = getattr(common_fsdp, model_class.__name__).init(
            process_group,
            common_fsdp.FSDPInitMode.RECURSIVE,
            common_fsdp.DEVICEInitMode.DEVICE_NEVER,
            deterministic=True,
        )
    return _unit_paths(reference, lambda m: isinstance(m, FSDP))


@pytest.mark.parametrize("model_class", RECURSIVE_MODELS, ids=lambda c: c.__name__)
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch's transformer
@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")  # MoE's one-rank expert
@pytest.mark.distributed(world_size=2, mode="thread")
def test_recursive_init_shards_the_units_torch_does_for_every_engine(model_class, process_group):
    expected = _torch_unit_paths(model_class, process_group)
    assert ("" in expected) == (model_class in ROOT_WRAPPED)  # torch's root wrapping
    for name in ENGINE_NAMES:
        engine = get_engine(name)
        with use_engine(engine):
            model = model_class.init(
                process_group,
                FSDPInitMode.RECURSIVE,
                DEVICEInitMode.DEVICE_BEFORE,
                deterministic=True,
                device=CPU,
            )
        assert _unit_paths(model, engine.is_wrapped) == expected, name
        assert engine.is_wrapped(model) == (model_class in ROOT_WRAPPED), name
