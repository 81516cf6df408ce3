"""``fsdp-testing plan``: every rank's numbers from one played rank (checked against playing
the others), uneven and empty shards at 1,024 ranks, hybrid 8 x 128 groups, classes of ranks,
the JSON of the SPEC, users' models and bad input (exit status 2 naming the option)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from fsdp_testing.cli import main
from fsdp_testing.cli._plan_args import PlanError, PlanRequest, parse_input_shape, parse_model
from fsdp_testing.cli._plan_cost import format_ranks, group_ranks, shard_index
from fsdp_testing.cli._plan_memory import StorageCounter
from fsdp_testing.cli._plan_render import plan_rows
from fsdp_testing.cli.plan import make_plan, plan_comm

SPEC_RANK_KEYS = [
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "peak_bytes",
    "padding_bytes",
    "empty_units",
    "comm",
]


def _plan(model: str, world_size: int, **options: object) -> object:
    return make_plan(PlanRequest(model=parse_model(model), world_size=world_size, **options))


# NestedWrappedModule's 4 units: the root (module.0: Linear(8, 4), module.3: Linear(4, 8)),
# module.1 (Linear(16, 16)), module.1.0 (Linear(4, 16)), module.2 (Linear(16, 4)).
NESTED_REST = [8, 1, 4, 1, 16, 1, 4, 1, 16, 1]  # elements per row of each of the 10 parameters


def test_uneven_and_empty_shards_at_1024_ranks():
    """1,024 ranks over layers of 4 to 16 rows: one row per rank at most, then only padding.
    The classes, their padding and empty units are counted by hand; every rank's numbers
    equal those of a plan that plays that rank (its own views, its own optimizer state)."""
    plan = _plan("nested", 1024)
    classes = {format_ranks(ranks): cost for ranks, cost in group_ranks(plan.ranks)}
    assert list(classes) == ["0-3", "4-7", "8-15", "16-1023"]
    # Ranks 4-7 hold rows of the 8- and 16-row layers only (module.2 is empty); 8-15 of the
    # 16-row layers (the root and module.2 empty); 16 on nothing.
    assert [c.empty_units for c in classes.values()] == [0, 1, 2, 4]
    # Every parameter is padded to one row per rank: the last ranks' shards are all padding.
    assert classes["16-1023"].padding_bytes == sum(NESTED_REST) * 4
    assert classes["0-3"].padding_bytes == 0
    # fsdp_core pads every shard to the same rows: parameter and gradient bytes are equal on
    # every rank, the optimizer state (Adam: two elements per real one) shrinks.
    assert len({(c.param_bytes, c.grad_bytes, c.comm) for c in classes.values()}) == 1
    state = [c.optim_bytes for c in classes.values()]
    assert state == sorted(state, reverse=True) and state[0] > state[-1]
    for played in (5, 9, 1023):
        other = _plan("nested", 1024, rank=played)
        assert other.measured.optim_bytes == plan.ranks[played].optim_bytes, played
        assert other.ranks == plan.ranks, played  # the whole world, from another rank
    assert len(plan_rows(plan)) == 4


def test_hybrid_8x128_groups():
    """``--mesh 8x128``: units sharded over groups of 128 consecutive ranks and all-reduced
    across the 8 replicas; a rank costs what the rank at its index in every other shard
    group costs (checked by playing rank 130)."""
    plan = _plan("transformer", 1024, mesh=(8, 128), strategy="HYBRID_SHARD")
    assert plan.comm_groups == {
        "all_gather": (128,),
        "reduce_scatter": (128,),
        "all_reduce": (8,),
    }
    assert plan.comm_calls["all_reduce"] == plan.comm_calls["reduce_scatter"]
    for rank in range(1024):
        assert plan.ranks[rank] == plan.ranks[rank % 128], rank
    # The vocabulary's 23 rows: ranks at index 0..22 of a shard group hold one each.
    assert plan.ranks[22].padding_bytes < plan.ranks[23].padding_bytes
    assert (
        plan.ranks[130].optim_bytes
        == _plan(
            "transformer", 1024, mesh=(8, 128), strategy="HYBRID_SHARD", rank=130
        ).measured.optim_bytes
    )


def test_shard_index_refuses_groups_it_cannot_extend():
    world = SimpleNamespace(fqn="a", shard_size=4, shard_ranks=(0, 1, 2, 3))
    assert [shard_index(world, r, 4) for r in range(4)] == [0, 1, 2, 3]
    mesh = SimpleNamespace(fqn="a", shard_size=2, shard_ranks=(2, 3))
    assert [shard_index(mesh, r, 8) for r in range(8)] == [0, 1] * 4
    strided = SimpleNamespace(fqn="b", shard_size=2, shard_ranks=(0, 2))
    with pytest.raises(PlanError, match=r"unit 'b' is sharded over ranks \[0, 2\]"):
        shard_index(strided, 1, 4)


def test_classes_of_ranks():
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert format_ranks([3]) == "3"
    costs = ["a", "a", "b", "a", "c", "c"]
    assert group_ranks(costs) == [([0, 1, 3], "a"), ([2], "b"), ([4, 5], "c")]  # type: ignore


def test_json_has_the_spec_keys_and_the_table_one_row_per_class(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "nested", "--world-size", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data) == ["world_size", "ranks"] and data["world_size"] == 8
    assert list(data["ranks"]) == [str(r) for r in range(8)]
    for entry in data["ranks"].values():
        assert list(entry) == SPEC_RANK_KEYS
        assert all(isinstance(v, int) for k, v in entry.items() if k != "comm")
    # By hand, 8 ranks, fp32: each parameter padded to a multiple of 8 rows, 2 order-tag
    # elements per rank after each rank's all-gather block, 2 per rank after each row of a
    # reduce-scatter's input (8 rows). Units by padded elements: the root 112 (gathered
    # once: it keeps its parameters for backward), module.1 272, module.1.0 80, module.2 136
    # (each gathered twice: FULL_SHARD).
    padded = {"root": 112, "module.1": 272, "module.1.0": 80, "module.2": 136}
    gathers = {"root": 1, "module.1": 2, "module.1.0": 2, "module.2": 2}
    all_gather = sum(4 * (n + 2 * 8) * gathers[u] for u, n in padded.items())
    reduce_scatter = sum(4 * (n + 2 * 8 * 8) for n in padded.values())
    assert data["ranks"]["5"]["comm"] == {
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "all_reduce": 0,
    }
    text = capsys.readouterr().out
    assert "fsdp-testing plan: nested on 8 ranks, FULL_SHARD, prefetch BACKWARD_PRE" in text
    assert f"all-gather 7 calls, {all_gather:,} B" in text
    assert re.search(r"^ranks +count +params +grads +optim +padding +empty units +peak", text, re.M)
    # Ranks 0-3 hold a row of every 4-row layer, 4-7 none of module.2's: two classes.
    assert re.search(r"^ +0-3 +4 .* 0 B +0 ", text, re.M), text
    assert re.search(r"^ +4-7 +4 .* 1 ", text, re.M), text
    assert "planned in" in text


def test_comm_of_the_cli_equals_the_comm_the_matrix_test_checks():
    """``make_plan`` (the command) and ``plan_comm`` (which the recorder comparison runs over
    the whole default matrix, for speed) give the same communication."""
    for model in ("nested", "transformer", "moe", "nonuniform", "always_wrap"):
        for options in ({}, {"strategy": "NO_SHARD", "mp": "bf16/fp32", "offload": True}):
            request = PlanRequest(model=parse_model(model), world_size=4, **options)
            plan = make_plan(request)
            assert plan_comm(request) == {
                family: (plan.comm_calls[family], dict(plan.ranks[0].comm)[family])
                for family in plan.comm_calls
            }, (model, options)
            assert plan.notes == ()  # the fake step sent what the theory says


def test_the_step_holds_what_the_schedule_says():
    """SHARD_GRAD_OP keeps every unit unsharded from forward to backward; FULL_SHARD without
    prefetch at most a unit and its ancestors; between steps a rank holds its parameters,
    gradients, optimizer state and buffers, nothing else."""
    full = _plan("nested", 2, prefetch="none")
    grad_op = _plan("nested", 2, strategy="SHARD_GRAD_OP")
    assert grad_op.measured.max_units_unsharded == grad_op.units == 4
    assert full.measured.max_units_unsharded == 3  # root, module.1, module.1.0
    assert grad_op.measured.peak_bytes > full.measured.peak_bytes
    for plan in (full, grad_op):
        m = plan.measured
        assert m.end_bytes == m.param_bytes + m.grad_bytes + m.optim_bytes + m.buffer_bytes
        assert plan.ranks[0].peak_bytes == m.peak_bytes > m.end_bytes
    sgd = _plan("nested", 2, optim="sgd")
    assert sgd.measured.optim_bytes == 0 and sgd.ranks[0].optim_bytes == 0


def test_transformer_size_arguments():
    sizes = "d_model=32,nhead=4,num_encoder_layers=1,num_decoder_layers=3,dim_feedforward=64"
    plan = _plan(f"transformer:{sizes},d_vocab=50", 2)
    layers = torch.nn.Transformer(32, 4, 1, 3, 64)
    # nn.Transformer's, then the tied embedding, the output bias and the batch norm's (over
    # the batch of 2).
    expected = sum(p.numel() for p in layers.parameters()) + 50 * 32 + 50 + 2 * 2
    assert plan.numel == expected
    assert plan.units == 1 + 1 + 3  # the root and each encoder and decoder layer


def test_storage_counter_follows_allocations_frees_and_resizes():
    """Each storage counts once (views share it) from the op that makes it until it is freed
    or resized in place; held tensors count from the start; the peak keeps its label."""
    held = torch.empty(10, device="meta")  # 40 bytes
    original = torch.UntypedStorage.resize_
    counter = StorageCounter()
    counter.hold([held, held[:5]])
    with counter:
        counter.phase = "first"
        a = torch.empty(250, device="meta")  # 1000 bytes
        b = a * 2
        view = b[:10]
        assert counter.alive == 2040
        del b
        assert counter.alive == 2040  # its view keeps the storage
        del view
        assert counter.alive == 1040
        counter.phase = "second"
        a.untyped_storage().resize_(0)
        assert counter.alive == 40
        a.untyped_storage().resize_(2000)
        assert (counter.alive, counter.peak, counter.peak_at) == (2040, 2040, "first")
        a.untyped_storage().resize_(3000)
    assert (counter.peak, counter.peak_at) == (3040, "second")
    assert torch.UntypedStorage.resize_ is original
    a.untyped_storage().resize_(0)  # after the block: no longer followed
    assert counter.alive == 3040


BAD_INPUT = [
    (["--model", "resnet"], "--model 'resnet': unknown model; give a reference model"),
    (["--model", "transformer:d_model"], "'d_model' is not k=v; give size arguments"),
    (["--model", "transformer:depth=3"], "'depth' is not a size argument of this model; valid: d"),
    (["--model", "nested:d_model=3"], "'d_model' is not a size argument of this model; valid: n"),
    (["--model", "transformer:d_model=wide"], "d_model='wide'; give a positive integer"),
    (
        ["--model", "nested", "--world-size", "16", "--mesh", "3x5"],
        "3 x 5 = 15 ranks, but --world-size is 16; give R x S with R * S = 16",
    ),
    (["--model", "nested", "--mesh", "2by2"], "--mesh '2by2': give R x S as two positive"),
    (
        ["--model", "nested", "--mesh", "2x2", "--strategy", "FULL_SHARD"],
        "use --strategy HYBRID_SHARD or _HYBRID_SHARD_ZERO2",
    ),
    (["--model", "nested", "--strategy", "HYBRID_SHARD"], "needs --mesh RxS"),
    (["--model", "nested", "--engine", "torch_fsdp2"], "--engine torch_fsdp2: not supported by"),
    (["--model", "nested", "--engine", "mine"], "--engine 'mine': unknown value; valid: fsdp_core"),
    (["--model", "nested", "--optim", "lamb"], "--optim 'lamb': unknown value; valid: adam"),
    (["--model", "nested", "--world-size", "0"], "--world-size 0: give at least 1 rank"),
    (["--model", "nested", "--wrap", "Linear"], "--wrap is for --model package.module:callable"),
    (
        ["--model", "nested", "--engine", "fsdp_core_fully_shard", "--strategy", "NO_SHARD"],
        "--engine fsdp_core_fully_shard: engine 'fsdp_core_fully_shard' (fsdp_core.fully_shard) "
        "does not support sharding_strategy",
    ),
    (["--model", "no.such.module:build"], "cannot import 'no.such.module'"),
    (["--model", "tests.cli._plan_models:missing"], "has no callable 'missing'"),
    (["--model", "tests.cli._plan_models:not_a_module"], "returned int, not an nn.Module"),
    (["--model", "tests.cli._plan_models:sharded"], "returned a sharded model; return it"),
    (["--model", "tests.cli._plan_models:stack"], "the model has no get_input(device); give its"),
    (
        ["--model", "tests.cli._plan_models:stack", "--wrap", "Blok", "--input-shape", "2,16"],
        "--wrap Blok: no such module class in the model; its classes: Block, Linear",
    ),
    (
        ["--model", "tests.cli._plan_models:stack", "--input-shape", "2,x"],
        "--input-shape '2,x': give positive sizes",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_exits_2_naming_the_option_and_the_fix(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdp-testing plan: ") and message in err, err


def test_argparse_mistakes_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "nested", "--world-size", "many"])
    assert exit_info.value.code == 2
    assert "--world-size: invalid int value: 'many'" in capsys.readouterr().err


def test_a_users_model_with_its_units_and_inputs():
    """``package.module:callable`` with size arguments: ``--wrap`` picks the units,
    ``--input-shape`` the inputs; a model with ``get_input`` needs none."""
    stack = _plan(
        "tests.cli._plan_models:stack:dim=64,depth=3",
        4,
        wrap=("Block",),
        inputs=(parse_input_shape("8,64"),),
    )
    assert (stack.units, stack.numel) == (3, 3 * (64 * 64 + 64))
    assert stack.comm_calls == {"all_gather": 6, "reduce_scatter": 3}  # FULL_SHARD, no root
    one_unit = _plan("tests.cli._plan_models:stack:dim=64,depth=3", 4, inputs=stack.request.inputs)
    assert one_unit.units == 1 and one_unit.comm_calls["all_gather"] == 1
    assert one_unit.measured.max_units_unsharded == 1
    with_input = _plan("tests.cli._plan_models:with_input", 2, wrap=("Block",))
    assert with_input.units == 2 and with_input.measured.step_adds > 0


def test_the_composable_door_plans_on_fake_tensors():
    """``fsdp_core_fully_shard`` (DTensor parameters on a CPU mesh) steps on fake tensors; its
    units and padding are those of the wrapper's for the same model, its root gathered once."""
    door = _plan("transformer", 4, engine="fsdp_core_fully_shard", mp="bf16")
    wrapper = _plan("transformer", 4, mp="bf16")
    assert door.units == wrapper.units and door.numel == wrapper.numel
    assert [c.padding_bytes for c in door.ranks] == [c.padding_bytes for c in wrapper.ranks]
    assert door.measured.param_bytes == wrapper.measured.param_bytes
    assert door.notes == ()
