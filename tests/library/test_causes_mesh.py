"""The likely causes on a device mesh, in one process on synthetic tensors: shards cut to the
layout's real extents (the model-parallel dims only), ranks named with their mesh coordinates,
the data-parallel replicas that hold the same thing named in one line (see [Note: shards on a
mesh] in ``fsdp_testing/parity/_causes/_mesh.py``). The planted bugs on a real 2 x 2 mesh are
``test_tp_parity.py``."""

from __future__ import annotations

import torch

from fsdp_testing.parity._causes import (
    CauseKind,
    Gradients,
    InitialPair,
    MeshShards,
    ParamStep,
    RankFacts,
    SGDRule,
    StepEvidence,
    cross_rank_causes,
    local_causes,
    merge_causes,
    rank_facts,
)

LR = 0.05
# A 2 x 2 (dp, tp) mesh: rank = 2 * dp + tp; a column-parallel 1.weight split across tp only.
SPLITS = {"1.weight": (0, (1,)), "1.bias": (0, (1,)), "3.weight": (1, (1,))}
MESH = MeshShards(
    names=("dp", "tp"),
    shape=(2, 2),
    coordinates=((0, 0), (0, 1), (1, 0), (1, 1)),
    dp_dims=(0,),
    splits=SPLITS,
)
SHAPES = {"1.weight": (16, 8), "1.bias": (16,), "3.weight": (8, 16), "3.bias": (8,)}


def _values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _swapped(t: torch.Tensor) -> torch.Tensor:
    """The two tensor-parallel chunks of a (16, 8) weight, each in the other's place."""
    top, bottom = t.chunk(2)
    return torch.cat([bottom, top])


def _started(rank: int, wrong: bool, mesh: MeshShards = MESH) -> StepEvidence:
    reference = _values()
    initial = tuple(
        InitialPair(n, v, _swapped(v) if wrong and n == "1.weight" else v)
        for n, v in reference.items()
    )
    return StepEvidence(step=1, rank=rank, world_size=4, initial=initial, mesh=mesh)


def _agreed(evidence: list[StepEvidence]) -> tuple[str, ...]:
    facts = [rank_facts(e, diverged=True, digest=lambda t: str(t.sum())) for e in evidence]
    return tuple(
        str(c) for c in merge_causes(cross_rank_causes(facts, mesh=MESH), facts, mesh=MESH)
    )


def test_a_wrong_slice_is_read_in_the_layouts_chunks_and_names_the_ranks_coordinates():
    """Each rank holds 8 rows (split across tp, size 2), not 4; rank 2 is (dp=1, tp=0)."""
    (cause,) = local_causes(_started(2, wrong=True))
    assert cause.kind is CauseKind.WRONG_SHARD_SLICE
    assert cause.evidence == (
        "before step 1, the tp=0 shard of 1.weight (rows 0-7), on rank 2 (dp=1, tp=0), equals "
        "the reference's rows 8-15; the tp=1 shard (rows 8-15), on rank 3 (dp=1, tp=1), equals "
        "rows 0-7"
    )


def test_the_replicas_that_hold_the_same_wrong_slice_are_named_together():
    (line,) = _agreed([_started(rank, wrong=True) for rank in range(4)])
    assert line == (
        "before step 1, the tp=0 shard of 1.weight (rows 0-7), on ranks 0 (dp=0, tp=0) and 2 "
        "(dp=1, tp=0), equals the reference's rows 8-15; the tp=1 shard (rows 8-15), on ranks 1 "
        "(dp=0, tp=1) and 3 (dp=1, tp=1), equals rows 0-7: a shard taken from the wrong rank's "
        "slice"
    )


def test_only_the_replica_that_holds_a_wrong_slice_is_named():
    (line,) = _agreed([_started(rank, wrong=rank < 2) for rank in range(4)])
    assert line.startswith(
        "before step 1, the tp=0 shard of 1.weight (rows 0-7), on rank 0 (dp=0, tp=0), equals "
        "the reference's rows 8-15; the tp=1 shard (rows 8-15), on rank 1 (dp=0, tp=1), equals "
        "rows 0-7"
    )


def test_on_a_one_dim_mesh_the_ranks_are_their_coordinates():
    splits = {name: (dim, (0,)) for name, (dim, _) in SPLITS.items()}
    mesh = MeshShards(names=("tp",), shape=(2,), coordinates=((0,), (1,)), splits=splits)
    (cause,) = local_causes(_started(0, wrong=True, mesh=mesh))
    assert cause.evidence == (
        "before step 1, rank 0's shard of 1.weight (rows 0-7) equals the reference's rows "
        "8-15; rank 1's (rows 8-15) equals rows 0-7"
    )


def test_a_parameter_the_layout_leaves_whole_is_not_cut_by_the_world_size():
    """Without the mesh, 3.bias's four chunks in another order read as a wrong slice; on the
    mesh it is replicated, so there is no slice to be wrong."""
    reference = _values()
    bias = reference["3.bias"]
    moved = torch.cat([bias[2:], bias[:2]])
    initial = tuple(InitialPair(n, v, moved if n == "3.bias" else v) for n, v in reference.items())
    bare = StepEvidence(step=1, rank=0, world_size=4, initial=initial)
    assert local_causes(bare)[0].kind is CauseKind.WRONG_SHARD_SLICE
    on_mesh = StepEvidence(step=1, rank=0, world_size=4, initial=initial, mesh=MESH)
    assert [c.kind for c in local_causes(on_mesh)] == [CauseKind.INITIAL_STATE_DIFFERS]


# -- gradients ----------------------------------------------------------------------------------


def _stepped(name: str, before: torch.Tensor, ref_grad: torch.Tensor, grad: torch.Tensor):
    """One parameter at step 1 of plain SGD: the reference stepped with ``ref_grad``, the model
    under test with ``grad``."""
    return ParamStep(
        name=name,
        ref_before=before,
        ref_after=before - LR * ref_grad,
        before=before,
        after=before - LR * grad,
        ref_grad=ref_grad,
        sgd=SGDRule(lr=LR),
        diverged=not torch.equal(grad, ref_grad),
    )


def test_each_tensor_parallel_ranks_own_scale_is_read_on_its_shards():
    """A clipping coefficient computed from each tp rank's own shards: rank 1's chunks (rows
    8-15 of 1.weight and 1.bias, columns 8-15 of 3.weight) are 3x, rank 0's are right."""
    values, grads = _values(0), _values(1)

    def scaled(name: str, g: torch.Tensor) -> torch.Tensor:
        if name not in SPLITS:
            return g
        mine, theirs = g.chunk(2, SPLITS[name][0])
        return torch.cat([mine, 3 * theirs], SPLITS[name][0])

    params = tuple(_stepped(n, values[n], grads[n], scaled(n, grads[n])) for n in SHAPES)
    evidence = StepEvidence(step=1, rank=0, world_size=4, params=params, mesh=MESH)
    per_slice = [c for c in local_causes(evidence) if c.kind is CauseKind.PER_SLICE_FACTORS]
    assert [c.evidence for c in per_slice] == [
        "each rank's slice of the gradient (its shards of the split parameters) scales by its "
        "own constant: rank 0 (dp=0, tp=0)'s shards 1.000x, rank 1 (dp=0, tp=1)'s shards "
        "3.000x the reference's"
    ]


def test_a_sum_over_the_data_parallel_ranks_is_named_with_their_world_size():
    """DDP over dp with its division left out: 2 replicas, on 4 ranks."""
    values, grads = _values(0), _values(1)
    params = tuple(_stepped(n, values[n], grads[n], 2 * grads[n]) for n in SHAPES)
    evidence = StepEvidence(step=1, rank=0, world_size=4, params=params, mesh=MESH)
    assert [str(c) for c in local_causes(evidence)] == [
        "every gradient is 2.000x the reference's (data-parallel world size 2): gradients "
        "summed, not averaged"
    ]


def test_tensor_parallel_partial_sums_add_up_across_tp_not_across_every_rank():
    """Megatron's f left out under DDP: each tp rank holds its partial sum (the same on both dp
    replicas); the two partials, not the four ranks, sum to the reference's."""
    reference = torch.randn(64, generator=torch.Generator().manual_seed(0))
    first = torch.randn(64, generator=torch.Generator().manual_seed(1))
    partials = [first, reference - first]
    zero = torch.zeros(64, dtype=torch.float64)
    per_rank = [
        Gradients(reference.double(), partials[tp].double(), zero) for _, tp in MESH.coordinates
    ]
    facts = [
        RankFacts(rank=r, diverged=True, gross=("0.weight",), order=("0.weight",)) for r in range(4)
    ]
    causes = cross_rank_causes(facts, gradients={"0.weight": per_rank}, mesh=MESH)
    (cause,) = [c for c in causes if c.kind is CauseKind.GRADIENTS_NOT_REDUCED]
    assert cause.evidence.startswith(
        "the ranks' gradients of 0.weight differ from each other but sum across tp to the "
        "reference's"
    )
    assert "partial sum" in cause.conclusion


def test_ranks_are_named_with_their_coordinates_across_ranks():
    facts = [
        RankFacts(
            rank=r,
            diverged=r >= 2,
            gross=("1.weight",) if r >= 2 else (),
            order=("1.weight", "1.bias"),
        )
        for r in range(4)
    ]
    (cause,) = cross_rank_causes(facts, mesh=MESH)
    assert cause.evidence == (
        "only ranks 2 (dp=1, tp=0) and 3 (dp=1, tp=1) diverge (1.weight); ranks 0 (dp=0, tp=0) "
        "and 1 (dp=0, tp=1) match the reference"
    )
