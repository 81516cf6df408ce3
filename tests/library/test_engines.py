"""Engine registry, option mapping and the torch engines on CPU/gloo."""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn as nn

from fsdp_testing.engines import (
    available_engines,
    current_engine,
    get_engine,
    modules_selected_by_policy,
    set_default_engine,
    translate_kwargs,
    use_engine,
)
from fsdp_testing.parity import assert_module_states_equal, get_full_params


def test_registry_lists_the_five_engines_and_defaults_to_fsdp_core():
    assert available_engines() == [
        "fsdp_core",
        "fsdp_core_fully_shard",
        "fsdp_core_graph",
        "torch_fsdp1",
        "torch_fsdp2",
    ]
    assert current_engine().name == "fsdp_core"


@pytest.mark.parametrize("api", [get_engine, set_default_engine, use_engine])
def test_unknown_engine_name_lists_valid_names(api):
    with pytest.raises(
        ValueError,
        match=r"unknown FSDP engine 'fsdp3'.*fsdp_core, fsdp_core_fully_shard, fsdp_core_graph, torch_fsdp1",
    ):
        result = api("fsdp3")
        if hasattr(result, "__enter__"):
            result.__enter__()


def test_use_engine_nests_and_restores():
    with use_engine("torch_fsdp1") as outer:
        assert current_engine() is outer
        with use_engine("torch_fsdp2"):
            assert current_engine().name == "torch_fsdp2"
        assert current_engine().name == "torch_fsdp1"
    assert current_engine().name == "fsdp_core"


def test_set_default_engine_is_process_wide():
    try:
        set_default_engine("torch_fsdp2")
        assert current_engine().name == "torch_fsdp2"
    finally:
        set_default_engine("fsdp_core")


def test_patch_targets_name_each_engines_unit_transitions():
    fsdp2 = get_engine("torch_fsdp2")
    assert fsdp2.patch_target("reshard").owner is fsdp2.unit_class
    assert get_engine("torch_fsdp1").patch_target("unshard").attribute == "_unshard"
    with pytest.raises(ValueError, match="unknown event 'free'"):
        fsdp2.patch_target("free")


def test_fsdp2_rejects_options_it_cannot_map_naming_the_engine():
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    engine = get_engine("torch_fsdp2")
    module = nn.Linear(2, 2)
    cases = [
        {"sharding_strategy": ShardingStrategy.NO_SHARD},
        {"mixed_precision": MixedPrecision(buffer_dtype=torch.float16)},
        {"forward_prefetch": True},
    ]
    for options in cases:
        with pytest.raises(NotImplementedError, match="engine 'torch_fsdp2'"):
            engine.wrap(module, None, **options)
    with pytest.raises(TypeError, match="unknown FSDP options bogus"):
        engine.wrap(module, None, bogus=1)


def test_translate_kwargs_maps_enums_by_name_and_configs_by_field():
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_core

    options = translate_kwargs(
        {
            "sharding_strategy": torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
            "cpu_offload": torch_fsdp.CPUOffload(offload_params=True),
            "forward_prefetch": True,
        },
        {"sharding_strategy": fsdp_core.ShardingStrategy, "cpu_offload": fsdp_core.CPUOffload},
    )
    assert options["sharding_strategy"] is fsdp_core.ShardingStrategy.SHARD_GRAD_OP
    assert isinstance(options["cpu_offload"], fsdp_core.CPUOffload)
    assert options["cpu_offload"].offload_params is True
    assert options["forward_prefetch"] is True


def test_policy_selection_is_bottom_up():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    inner = nn.Sequential(nn.Linear(2, 2))
    root = nn.Sequential(inner, nn.Linear(2, 2))
    chosen = modules_selected_by_policy(root, ModuleWrapPolicy({nn.Linear, nn.Sequential}))
    assert chosen == [inner[0], inner, root[1]]


@pytest.mark.distributed(world_size=2)
def test_fsdp1_on_cpu_syncs_module_states_without_an_accelerator(rank, process_group):
    torch.manual_seed(rank)  # different on each rank
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    engine = get_engine("torch_fsdp1")
    wrapped = engine.wrap(model, process_group, sync_module_states=True)
    assert engine.is_wrapped(wrapped)
    with engine.full_params(wrapped, writeback=False):
        assert_module_states_equal(wrapped, process_group)
    wrapped(torch.randn(3, 4)).sum().backward()


@pytest.mark.distributed(world_size=2)
def test_fsdp2_full_params_writeback_and_state_dict_round_trip(rank, process_group):
    torch.manual_seed(0)
    engine = get_engine("torch_fsdp2")
    model = engine.wrap(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)), process_group)
    full = engine.full_state_dict(model)
    assert full["0.weight"].shape == (5, 3)
    with engine.full_params(model, writeback=True):
        assert model[0].weight.shape == (5, 3)
        with torch.no_grad():
            model[0].weight.fill_(7.0)
    assert torch.equal(get_full_params(model)[0], torch.full((5, 3), 7.0))
    # Writeback needs no communication: each rank keeps its own rows (dim-0 chunks of 3 and 2)
    # of what it wrote, so writes that differ between ranks end up mixed, rank by rank.
    with engine.full_params(model, writeback=True), torch.no_grad():
        model[0].weight.fill_(rank + 1.0)
    mixed = torch.cat([torch.full((3, 3), 1.0), torch.full((2, 3), 2.0)])
    assert torch.equal(get_full_params(model)[0], mixed)
    engine.load_full_state_dict(model, full)
    assert torch.equal(get_full_params(model)[0], full["0.weight"])


@pytest.mark.parametrize("engine_name", ["fsdp_core", "torch_fsdp1"])
@pytest.mark.distributed(world_size=2, mode="thread")
def test_enable_wrap_is_per_thread_rank(engine_name, rank, process_group):
    """Thread ranks inside an engine's ``enable_wrap`` at the same time each wrap with their own
    process group and options (torch's own enable_wrap context is shared by every thread)."""
    import torch.distributed as dist

    engine = get_engine(engine_name)
    strategy = ("FULL_SHARD", "SHARD_GRAD_OP")[rank]
    from fsdp_core import ShardingStrategy  # translated for torch's engine by name

    with engine.enable_wrap(process_group, sharding_strategy=ShardingStrategy[strategy]):
        dist.barrier(process_group)
        wrapped = engine.wrap_if_enabled(nn.Linear(4, 4))
        dist.barrier(process_group)
    assert engine.is_wrapped(wrapped)
    assert wrapped.process_group is process_group
    assert wrapped.sharding_strategy.name == strategy
    plain = nn.Linear(4, 4)
    assert engine.wrap_if_enabled(plain) is plain
    with pytest.raises(ValueError, match="no counterpart"):
        with engine.enable_wrap(process_group, sharding_strategy=_NoSuchStrategy.ZIGZAG):
            pass


class _NoSuchStrategy(enum.Enum):
    ZIGZAG = 1


@pytest.mark.parametrize(
    ("engine", "api"),
    [("torch_fsdp2", "torch.distributed.fsdp.fully_shard"),
     ("fsdp_core_fully_shard", "fsdp_core.fully_shard")],
)  # fmt: skip
def test_an_unsupported_option_names_the_engine_that_refused_it(engine, api) -> None:
    from fsdp_core import BackwardPrefetch
    from fsdp_testing.engines import get_engine

    with pytest.raises(NotImplementedError, match=rf"^engine '{engine}' \({api}\) does not"):
        get_engine(engine)._fully_shard_kwargs(  # type: ignore[attr-defined]
            {"backward_prefetch": BackwardPrefetch.BACKWARD_POST}
        )


@pytest.mark.parametrize("engine", ["torch_fsdp2", "fsdp_core_fully_shard"])
def test_fsdp1_reduce_dtype_none_reaches_fully_shard_as_the_param_dtype(engine) -> None:
    # FSDP1's MixedPrecision(reduce_dtype=None) reduces in param_dtype; FSDP2's None means the
    # gradient's own dtype from torch 2.15, so the engines pass param_dtype explicitly.
    from fsdp_core import MixedPrecision
    from fsdp_testing.engines import get_engine

    kwargs = get_engine(engine)._fully_shard_kwargs(  # type: ignore[attr-defined]
        {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}
    )
    assert kwargs["mp_policy"].param_dtype == torch.bfloat16
    assert kwargs["mp_policy"].reduce_dtype == torch.bfloat16
    kwargs = get_engine(engine)._fully_shard_kwargs(  # type: ignore[attr-defined]
        {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    )
    assert kwargs["mp_policy"].reduce_dtype == torch.float32
