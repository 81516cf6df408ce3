"""The causes only several ranks' numbers show, and the one list every rank reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from ._evidence import ORDER, Cause, CauseKind, RankFacts
from ._math import GROSS, Gradients, concat, f64, name_list, norm, plural, rank_list, ulp_slack
from ._mesh import MeshShards
from ._slices import slice_cause


def _ranks(ranks: Sequence[int], mesh: MeshShards | None) -> str:
    """``"ranks 0, 1"``; on a mesh of more than one dim, with their coordinates."""
    return rank_list(ranks) if mesh is None or mesh.plain else mesh.ranks_name(ranks)


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _prefix_cause(facts: Sequence[RankFacts]) -> Cause | None:
    order = facts[0].order
    gross = {n for f in facts for n in f.gross}
    if not gross or not order:
        return None
    n = len(gross)
    if n >= len(order) or set(order[:n]) != gross:
        return None
    last, first_match = order[n - 1], order[n]
    if _module_of(last) == _module_of(first_match):
        return None  # the boundary splits a layer: not "before one layer"
    kept = {k for f in facts for k in f.kept}
    before = list(order[:n])
    still = " and none of them moved" if kept >= gross else ""
    reached = "no gradient reached them" if still else "the gradient reaching them is wrong"
    after = len(order) - n - 1
    matching = f"{first_match} and the {after} after it match" if after else "it matches"
    return Cause(
        CauseKind.BACKWARD_STOPS,
        f"only the {plural(n, 'parameter')} before {first_match} "
        f"{'diverges' if n == 1 else 'diverge'} ({name_list(before)}){still}; {matching}",
        f"{reached}: a missing all-reduce (or send) of the backward's gradient at the layer of "
        f"{first_match}",
    )


def _some_ranks_cause(facts: Sequence[RankFacts], mesh: MeshShards | None) -> Cause | None:
    wrong = [f.rank for f in facts if f.gross]
    right = [f.rank for f in facts if not f.diverged]
    if not wrong or not right:
        return None
    names = sorted({n for f in facts for n in f.gross}, key=facts[0].order.index)
    verb = "diverges" if len(wrong) == 1 else "diverge"
    agree = "matches" if len(right) == 1 else "match"
    return Cause(
        CauseKind.SOME_RANKS_ONLY,
        f"only {_ranks(wrong, mesh)} {verb} ({name_list(names)}); {_ranks(right, mesh)} "
        f"{agree} the reference",
        "a result that reached only some ranks (a reduce, gather or send where an all-reduce or "
        "all-gather was meant)",
    )


def _apart_cause(
    facts: Sequence[RankFacts],
    initial: Mapping[str, Sequence[torch.Tensor]],
    mesh: MeshShards | None,
) -> Cause | None:
    apart = []
    for name, values in initial.items():
        first = f64(values[0])
        worst, who = 0.0, 0
        for rank, value in enumerate(values[1:], start=1):
            if value.shape != values[0].shape:
                worst, who = float("inf"), rank
                break
            diff = float((f64(value) - first).abs().max()) if first.numel() else 0.0
            if diff > worst:
                worst, who = diff, rank
        slack = float(ulp_slack(values[0]).max()) if values[0].numel() else 0.0
        if worst > slack:
            apart.append((name, worst, who))
    if not apart:
        return None
    order = facts[0].order
    apart.sort(key=lambda item: order.index(item[0]) if item[0] in order else len(order))
    name, worst, who = max(apart, key=lambda item: item[1])
    others = f" and {plural(len(apart) - 1, 'other parameter')}" if len(apart) > 1 else ""
    return Cause(
        CauseKind.RANKS_STARTED_APART,
        f"before step 1 the ranks held different {name}{others} ({_ranks([who], mesh)}'s "
        f"differs from {_ranks([0], mesh)}'s by up to {worst:.3e}; the reference's is the same "
        "on every rank)",
        "ranks started from different initial weights (broadcast them from one rank, or seed "
        "every rank alike)",
    )


def _partial_sum(
    stacked: torch.Tensor, mesh: MeshShards | None, noise: float
) -> tuple[str, torch.Tensor, float]:
    """How the ranks' partial sums add up to the reference's: all of them; on a mesh with
    data-parallel dims, one per model-parallel coordinate (the mean of its data-parallel
    replicas), as tensor-parallel partials are summed within a replica."""
    count = stacked.shape[0]
    if mesh is None or mesh.plain or not mesh.dp_dims or not mesh.model_parallel:
        return "sum", stacked.sum(0), noise * count
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(min(count, len(mesh.coordinates))):
        key = tuple(mesh.coordinates[rank][i] for i in mesh.model_parallel)
        groups.setdefault(key, []).append(rank)
    means = [stacked[members].mean(0) for members in groups.values()]
    spread = max(float((stacked[m] - stacked[m].mean(0)).abs().max()) for m in groups.values())
    across = ", ".join(mesh.names[i] for i in mesh.model_parallel)
    replicas = ", ".join(mesh.names[i] for i in mesh.dp_dims)
    how = f"sum across {across}"
    if spread > 3 * noise:
        how += f" (each the mean across {replicas})"
    return how, torch.stack(means).sum(0), noise * len(groups)


def _not_reduced_cause(
    facts: Sequence[RankFacts],
    grads: Mapping[str, Sequence[Gradients]],
    mesh: MeshShards | None,
) -> Cause | None:
    if len(facts) < 2 or not grads:
        return None
    names = [n for n in facts[0].order if n in grads]
    per_rank = [concat(grads[n][r] for n in names) for r in range(len(facts))]
    if any(g is None for g in per_rank):
        return None
    ranks = [g for g in per_rank if g is not None]
    reference = ranks[0].reference
    ref_norm = norm(reference)
    noise = max(norm(g.noise) for g in ranks)
    spread = max(norm(g.actual - ranks[0].actual) for g in ranks)
    if ref_norm == 0 or spread <= GROSS * ref_norm + 3 * noise:
        return None  # the ranks agree: a reduction happened, whatever else is wrong
    stacked = torch.stack([g.actual for g in ranks])
    for how, combined, bound in (
        ("average", stacked.mean(0), noise),
        _partial_sum(stacked, mesh, noise),
    ):
        off = norm(combined - reference)
        if off <= GROSS * ref_norm + 3 * bound:
            what = (
                "each rank stepped on its own"
                if how == "average"
                else "each rank stepped on its partial sum (e.g. a tensor-parallel input's "
                "gradient)"
            )
            return Cause(
                CauseKind.GRADIENTS_NOT_REDUCED,
                f"the ranks' gradients of {name_list(names)} differ from each other but {how} "
                f"to the reference's (within {off / ref_norm:.1e} relative)",
                f"gradients not all-reduced: {what}",
            )
    return None


def _slice_on_mesh(facts: Sequence[RankFacts], mesh: MeshShards | None) -> Cause | None:
    """The lowest rank's wrong slice, each chunk named with every rank that found the same
    (the data-parallel replicas holding the same thing, in one line; see [Note: shards on a
    mesh])."""
    found = [f for f in facts if f.slice is not None]
    if mesh is None or mesh.plain or not found:
        return None
    first = found[0].slice
    assert first is not None  # for mypy: filtered above
    name = first.name
    if name is None or name not in mesh.splits:
        return None
    same = [f.rank for f in found if f.slice == first and f.rank < len(mesh.coordinates)]
    holders = {i: [r for r in same if mesh.chunk_of(r, name) == i] for i, _ in first.moved}
    if not all(holders.values()):
        return None
    return slice_cause(first, mesh=mesh, holders=lambda i: holders[i])


def cross_rank_causes(
    facts: Sequence[RankFacts],
    *,
    initial: Mapping[str, Sequence[torch.Tensor]] | None = None,
    gradients: Mapping[str, Sequence[Gradients]] | None = None,
    mesh: MeshShards | None = None,
) -> tuple[Cause, ...]:
    """The causes only several ranks' numbers show, in :class:`CauseKind` order.

    Args:
        facts: every rank's :class:`RankFacts`, by rank.
        initial: for each parameter that differed across ranks before step 1 (where the
            reference's did not), every rank's value.
        gradients: for each grossly diverging parameter, every rank's :class:`Gradients`.
        mesh: the device mesh the code ran on (default None: none; see [Note: shards on a
            mesh]).
    """
    found = [
        _apart_cause(facts, initial or {}, mesh),
        _slice_on_mesh(facts, mesh),
        _some_ranks_cause(facts, mesh),
        _prefix_cause(facts),
        _not_reduced_cause(facts, gradients or {}, mesh),
    ]
    return tuple(c for c in found if c is not None)


def merge_causes(
    cross: Sequence[Cause], facts: Sequence[RankFacts], *, mesh: MeshShards | None = None
) -> tuple[Cause, ...]:
    """One list for every rank: the cross-rank causes, and of each kind of local cause the
    lowest rank's (named with its ranks when not every diverging rank found it), in
    :class:`CauseKind` order.

    Args:
        cross: :func:`cross_rank_causes`.
        facts: every rank's :class:`RankFacts`.
        mesh: the device mesh the code ran on (default None), to name ranks by coordinate.
    """
    chosen: dict[CauseKind, Cause] = {c.kind: c for c in cross}
    diverging = [f.rank for f in facts if f.gross] or [f.rank for f in facts if f.diverged]
    for kind in CauseKind:
        if kind in chosen:
            continue
        holders = [f for f in facts if any(c.kind is kind for c in f.local)]
        if not holders:
            continue
        cause = next(c for c in holders[0].local if c.kind is kind)
        ranks = [f.rank for f in holders]
        if len(facts) > 1 and not set(diverging) <= set(ranks):
            cause = dataclasses.replace(
                cause, evidence=f"on {_ranks(ranks, mesh)}: {cause.evidence}"
            )
        chosen[kind] = cause
    if CauseKind.RANKS_STARTED_APART in chosen:
        chosen.pop(CauseKind.INITIAL_STATE_DIFFERS, None)  # the same fact, seen per rank
    return tuple(sorted(chosen.values(), key=lambda c: ORDER[c.kind]))
