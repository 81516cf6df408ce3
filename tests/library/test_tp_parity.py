"""Parity for model-parallel code (issue 48): a tensor-parallel library of a user's own
(``examples/tensor_parallel.py``) checked against one device on a mesh with no gather code, and
each bug planted in it caught with a report that names the tensor, the step and the mesh
coordinates whose shards differ."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import tensor_parallel as tp  # noqa: E402

from fsdp_testing.parity import check_parity, layout_from_plan  # noqa: E402

from ._failures import failure_of, first_cause  # noqa: E402

LAYOUT = {"0.weight": 0, "0.bias": 0, "2.weight": 1}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _batch(i: int, dp_rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(i))


class _WrongSlice(tp.ColumnParallelLinear):
    """Planted: each rank takes the other rank's rows of the weight."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup) -> None:
        super().__init__(full, group)
        other = 1 - dist.get_rank(group)
        self.weight = nn.Parameter(full.weight.detach().chunk(2)[other].clone())


class _NoForwardReduce(tp.RowParallelLinear):
    """Planted: the row-parallel layer forgets to sum the partial outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.bias


def _mlp_with(column: type, row: type, group: dist.ProcessGroup) -> nn.Sequential:
    def wrap(model: nn.Sequential, _: object) -> nn.Sequential:
        return nn.Sequential(column(model[0], group), model[1], row(model[2], group))

    return wrap  # type: ignore[return-value]


@pytest.mark.distributed(world_size=2)
def test_a_wrong_shard_slice_names_the_tensor_and_the_coordinates():
    mesh = _mesh()
    wrap = _mlp_with(_WrongSlice, tp.RowParallelLinear, mesh.get_group("tp"))
    message = failure_of(lambda: check_parity(_build, wrap, _batch, mesh=mesh, layout=LAYOUT))
    assert "diverged from the reference" in message and "at step 1 of 3" in message
    # One data-parallel rank (the mesh is all tensor-parallel): not "the batches of all 1 ranks".
    assert "the reference (local: one process, the same batches as the ranks)" in message
    assert (
        "0.weight: the shards of 2 of 2 mesh coordinates differ from the reference's: (tp=0), (tp=1)"
        in message
    )
    assert first_cause(message) == (
        "before step 1, rank 0's shard of 0.weight (rows 0-7) equals the reference's rows 8-15; "
        "rank 1's (rows 8-15) equals rows 0-7: a shard taken from the wrong rank's slice"
    )


@pytest.mark.distributed(world_size=4)
def test_a_wrong_shard_slice_on_a_dp_by_tp_mesh_is_read_in_the_layouts_shards():
    # 2 replicas x 2 tensor-parallel ranks: each rank holds 8 rows of 0.weight (the layout
    # splits across tp only), and both replicas hold the same wrong rows: one line names both.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    column = _mlp_with(_WrongSlice, tp.RowParallelLinear, mesh.get_group("tp"))

    def wrap(model: nn.Sequential, group: object) -> nn.Module:
        parallel = column(model, group)
        return nn.parallel.DistributedDataParallel(parallel, process_group=mesh.get_group("dp"))

    message = failure_of(
        lambda: check_parity(_build, wrap, _batch, mesh=mesh, dp_dims="dp", layout=LAYOUT)
    )
    assert first_cause(message) == (
        "before step 1, the tp=0 shard of 0.weight (rows 0-7), on ranks 0 (dp=0, tp=0) and 2 "
        "(dp=1, tp=0), equals the reference's rows 8-15; the tp=1 shard (rows 8-15), on ranks 1 "
        "(dp=0, tp=1) and 3 (dp=1, tp=1), equals rows 0-7: a shard taken from the wrong rank's "
        "slice"
    ), message


@pytest.mark.distributed(world_size=4)
def test_a_dtensor_shard_from_the_wrong_rank_is_read_in_its_placements_shards():
    # DTensor parameters need no layout: a Shard placement on the tp sub-mesh of a 2 x 2 mesh
    # splits across tp only, and the other dim's ranks hold the same chunk.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "tp"))

    def wrap(model: nn.Sequential, _: object) -> nn.Module:
        full = model[0].weight.detach().clone()
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        other = 1 - mesh.get_local_rank("tp")
        with torch.no_grad():  # planted: the other tp rank's rows
            model[0].weight.to_local().copy_(full.chunk(2)[other])
        return model

    message = failure_of(lambda: check_parity(_build, wrap, _batch, mesh=mesh))
    assert first_cause(message) == (
        "before step 1, the tp=0 shard of 0.weight (rows 0-7), on ranks 0 (rep=0, tp=0) and 2 "
        "(rep=1, tp=0), equals the reference's rows 8-15; the tp=1 shard (rows 8-15), on ranks "
        "1 (rep=0, tp=1) and 3 (rep=1, tp=1), equals rows 0-7: a shard taken from the wrong "
        "rank's slice"
    ), message


@pytest.mark.distributed(world_size=2)
def test_a_shape_the_layout_gathered_wrong_says_what_the_layout_did():
    mesh = _mesh()
    wrap = _mlp_with(tp.ColumnParallelLinear, tp.RowParallelLinear, mesh.get_group("tp"))
    wrong_dim = {**LAYOUT, "2.weight": 0}  # the row-parallel weight is split on dim 1
    with pytest.raises(ValueError) as failure:
        check_parity(_build, wrap, _batch, mesh=mesh, layout=wrong_dim)
    assert (
        "2.weight gathered on dim 0 across tp (2 shards of (8, 8)) gives (16, 8), the model's is "
        "(8, 16) (gathered on dim 1 it would be (8, 16)): check layout['2.weight'] (the shard "
        "dim, or which mesh dims it splits across); or pass full_state="
    ) in str(failure.value)
    left_out = {name: dim for name, dim in LAYOUT.items() if name != "2.weight"}
    with pytest.raises(ValueError) as failure:
        check_parity(_build, wrap, _batch, mesh=mesh, layout=left_out)
    assert (
        "2.weight is not in layout, so its (8, 8) was taken as the full (replicated) value; if it "
        "is a shard, name its dim in layout['2.weight']; or pass full_state="
    ) in str(failure.value)


@pytest.mark.distributed(world_size=2)
def test_a_forgotten_forward_all_reduce_is_caught():
    mesh = _mesh()
    wrap = _mlp_with(tp.ColumnParallelLinear, _NoForwardReduce, mesh.get_group("tp"))
    with pytest.raises(AssertionError, match=r"mesh coordinates differ from the reference's"):
        check_parity(_build, wrap, _batch, mesh=mesh, layout=LAYOUT)


class _NoBackwardReduce(tp.ColumnParallelLinear):
    """Planted: the input's gradient is not summed over the tensor-parallel ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mlp = _build()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids))


@pytest.mark.distributed(world_size=2)
def test_a_missing_backward_all_reduce_is_caught_before_the_layer():
    # The bug of issue 48 that an MLP alone hid: its input needs no gradient. With an
    # embedding before it, the embedding's gradient is half of what it should be.
    mesh = _mesh()
    group = mesh.get_group("tp")

    def wrap(model: _Embedded, _: object) -> _Embedded:
        model.mlp = nn.Sequential(
            _NoBackwardReduce(model.mlp[0], group),
            model.mlp[1],
            tp.RowParallelLinear(model.mlp[2], group),
        )
        return model

    layout = {f"mlp.{name}": dim for name, dim in LAYOUT.items()}
    with pytest.raises(AssertionError) as failure:
        check_parity(
            _Embedded, wrap, lambda i, r: torch.randint(16, (6,), generator=torch.Generator().manual_seed(i)),
            mesh=mesh, layout=layout,
        )  # fmt: skip
    assert "embed.weight" in str(failure.value)


@pytest.mark.distributed(world_size=2)
def test_dtensor_parameters_need_no_layout():
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    check_parity(_build, lambda model, _: parallelize_module(model, mesh, plan), _batch, mesh=mesh)
    assert layout_from_plan(plan) == {"0.weight": 0, "0.bias": 0, "2.weight": 1}


def test_dims_without_a_mesh_are_refused():
    with pytest.raises(ValueError, match=r"pass mesh=<the DeviceMesh the code runs on>"):
        check_parity(_build, lambda m, g: m, _batch, layout={"0.weight": 0})
