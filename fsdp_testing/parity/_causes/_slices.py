"""Wrong shard slices: blocks of a parameter (or of the flat parameters) that equal other
blocks of the reference's, before step 1 or around the step that diverged; and initial weights
that differ otherwise."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._evidence import Cause, CauseKind, InitialPair, ParamStep, SliceFinding, StepEvidence
from ._math import chunk_spans, equal_within, f64, plural, ulp_slack
from ._mesh import MeshShards


def _permutation(
    actual: torch.Tensor, expected: torch.Tensor, slack: torch.Tensor, world: int, dim: int
) -> list[tuple[int, int]] | None:
    """For ``actual`` and ``expected`` split into ``world`` chunks along ``dim``: the pairs
    ``(i, j)``, ``j != i``, where chunk ``i`` of ``actual`` equals chunk ``j`` of ``expected``,
    when every chunk of ``actual`` equals exactly one chunk of ``expected``, the chunks of
    ``expected`` are pairwise different and at least one pair is off its place; else None."""
    if actual.dim() <= dim or actual.shape[dim] < world or actual.shape != expected.shape:
        return None
    spans = [s for s in chunk_spans(actual.shape[dim], world) if s[1] > s[0]]
    if len(spans) < 2:
        return None

    def chunk(t: torch.Tensor, i: int) -> torch.Tensor:
        start, end = spans[i]
        return t.narrow(dim, start, end - start)

    count = len(spans)
    for i in range(count):
        for j in range(i + 1, count):
            if equal_within(chunk(expected, i), chunk(expected, j), chunk(slack, i)):
                return None  # equal blocks (zeros, constants): no order to read
    moved = []
    for i in range(count):
        part, tol = chunk(actual, i), chunk(slack, i)
        if equal_within(part, chunk(expected, i), tol):
            continue
        matches = [
            j for j in range(count) if j != i and equal_within(part, chunk(expected, j), tol)
        ]
        if len(matches) != 1:
            return None
        moved.append((i, matches[0]))
    return moved or None


def span_text(span: tuple[int, int], unit: str) -> str:
    start, end = span
    return f"{unit} {start}-{end - 1}" if end - start > 1 else f"{unit[:-1]} {start}"


DIM_UNITS = {0: "rows", 1: "columns"}

_WRONG_SLICE = "a shard taken from the wrong rank's slice"


def slice_cause(
    finding: SliceFinding,
    *,
    mesh: MeshShards | None = None,
    holders: Callable[[int], Sequence[int]] | None = None,
) -> Cause:
    """The cause of ``finding``: ``"rank 0's shard of w (rows 0-3) equals the reference's rows
    4-7; rank 1's (rows 4-7) equals rows 0-3"``, chunk ``i`` rank ``i``'s; or, on a mesh,
    ``"the tp=0 shard of w (rows 0-3), on ranks 0 (dp=0, tp=0) and 2 (dp=1, tp=0), equals the
    reference's rows 4-7; ..."``, chunk ``i`` held by ``holders(i)`` (see [Note: shards on a
    mesh])."""
    what = (
        f"shard of {finding.name}" if finding.name is not None else "slice of the flat parameters"
    )
    named = mesh is not None and holders is not None and finding.name is not None
    parts = []
    for n, (i, j) in enumerate(finding.moved[:3]):
        mine = span_text(finding.spans[i], finding.unit)
        theirs = span_text(finding.spans[j], finding.unit)
        if named:
            assert mesh is not None and holders is not None and finding.name is not None  # mypy
            label = mesh.shard_label(finding.name, i)
            on = mesh.ranks_name(holders(i))
            subject = f"the {label} {what}" if n == 0 else f"the {label} shard"
            parts.append(f"{subject} ({mine}), on {on}, {finding.how} ")
        else:
            subject = f"rank {i}'s {what}" if n == 0 else f"rank {i}'s"
            parts.append(f"{subject} ({mine}) {finding.how} ")
        parts[-1] += f"the reference's {theirs}" if n == 0 else theirs
    more = f" (and {len(finding.moved) - 3} more)" if len(finding.moved) > 3 else ""
    return Cause(CauseKind.WRONG_SHARD_SLICE, finding.where + "; ".join(parts) + more, _WRONG_SLICE)


def local_slice_cause(finding: SliceFinding, evidence: StepEvidence) -> Cause:
    """``finding`` as one rank read it: on a mesh, each chunk named by the rank of this rank's
    replica that holds it."""
    mesh, name = evidence.mesh, finding.name
    if mesh is None or mesh.plain or name is None or name not in mesh.splits:
        return slice_cause(finding)
    peers = [mesh.peer(evidence.rank, name, i) for i in range(len(finding.spans))]
    ranks = [p for p in peers if p is not None]
    if len(ranks) != len(peers):
        return slice_cause(finding)
    return slice_cause(finding, mesh=mesh, holders=lambda i: [ranks[i]])


def _wrong_slice(
    pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
    world: int,
    *,
    where: str,
    how: str = "equals",
    mesh: MeshShards | None = None,
) -> SliceFinding | None:
    """Per parameter along each dim, then over the flat concatenation of all of them (the
    order a flat-buffer wrapper shards): ``pairs`` are (name, actual, expected, per-element
    slack); a pair whose shapes differ is never a permutation. On a mesh that splits
    parameters, each split parameter along its split dim into its real chunks only (see
    [Note: shards on a mesh])."""
    split = mesh is not None and bool(mesh.splits)
    for name, actual, expected, slack in pairs:
        if actual.shape != expected.shape:
            continue
        if mesh is not None and split:
            if name not in mesh.splits or mesh.count(name) < 2:
                continue
            cuts = [(mesh.splits[name][0], mesh.count(name))]
        else:
            cuts = [(dim, world) for dim in range(actual.dim())]
        for dim, count in cuts:
            moved = _permutation(actual, expected, slack, count, dim)
            if moved:
                spans = [s for s in chunk_spans(actual.shape[dim], count) if s[1] > s[0]]
                unit = DIM_UNITS.get(dim, f"indices along dim {dim}")
                return SliceFinding(where, how, name, unit, tuple(spans), tuple(moved))
    if not split and pairs and all(a.shape == e.shape for _, a, e, _ in pairs):
        actual = torch.cat([a.reshape(-1) for _, a, _, _ in pairs])
        expected = torch.cat([e.reshape(-1) for _, _, e, _ in pairs])
        slack = torch.cat([s.reshape(-1) for _, _, _, s in pairs])
        moved = _permutation(actual, expected, slack, world, 0)
        if moved:
            spans = [s for s in chunk_spans(actual.numel(), world) if s[1] > s[0]]
            return SliceFinding(where, how, None, "elements", tuple(spans), tuple(moved))
    return None


def _differing(evidence: StepEvidence) -> list[InitialPair]:
    return [
        p
        for p in evidence.initial
        if p.reference.shape != p.actual.shape
        or not torch.equal(p.reference.detach().cpu(), p.actual.detach().cpu())
    ]


def initial_slice(evidence: StepEvidence) -> SliceFinding | None:
    """Before step 1: a wrong shard slice."""
    if not _differing(evidence):
        return None
    pairs = []
    for p in evidence.initial:
        ref, act = p.reference.detach().cpu(), p.actual.detach().cpu()
        slack = ulp_slack(ref, act).view(ref.shape) if ref.shape == act.shape else ref
        pairs.append((p.name, act.to(torch.float64), ref.to(torch.float64), slack))
    return _wrong_slice(pairs, evidence.world_size, where="before step 1, ", mesh=evidence.mesh)


def initial_differs(evidence: StepEvidence) -> list[Cause]:
    """Before step 1, where no wrong slice explains it: initial weights that differ grossly."""
    gross = []
    for p in _differing(evidence):
        if p.reference.shape != p.actual.shape:
            gross.append((p.name, float("inf")))
            continue
        ref, act = f64(p.reference), f64(p.actual)
        worst = float((act - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        if worst > 1e-3 * max(scale, 1e-12) or not math.isfinite(worst):
            gross.append((p.name, worst))
    if not gross:
        return []
    name, worst = max(gross, key=lambda item: item[1])
    others = f" and {plural(len(gross) - 1, 'other parameter')}" if len(gross) > 1 else ""
    return [
        Cause(
            CauseKind.INITIAL_STATE_DIFFERS,
            f"before step 1, {name}{others} already differed from the reference "
            f"(max abs diff {worst:.3e})",
            "the wrapping changed the initial weights (it must start from the module it is given)",
        )
    ]


def slice_after_step(evidence: StepEvidence, diverged: list[ParamStep]) -> SliceFinding | None:
    """A step that started from (or ended in) another rank's slice: the model's value minus the
    reference's update equals a permutation of the reference's value before the step, or its
    value equals a permutation of the reference's after it."""
    if not diverged:
        return None
    world, step = evidence.world_size, evidence.step
    started, ended = [], []
    for p in evidence.params:
        shapes = {p.after.shape, p.ref_after.shape, p.ref_before.shape}
        if len(shapes) != 1:
            return None
        shape = p.after.shape
        a, ra, rb = f64(p.after), f64(p.ref_after), f64(p.ref_before)
        slack = (ulp_slack(p.after, p.ref_after, p.ref_before) * 2).view(shape)
        started.append((p.name, (a - (ra - rb)).view(shape), rb.view(shape), slack))
        ended.append((p.name, a.view(shape), ra.view(shape), slack))
    names = {p.name for p in diverged}
    for pairs, where, how in (
        (started, f"at step {step}, ", "stepped from"),
        (ended, f"after step {step}, ", "equals"),
    ):
        mine = [pair for pair in pairs if pair[0] in names]
        mesh = evidence.mesh
        found = _wrong_slice(mine, world, where=where, how=how, mesh=mesh) if mine else None
        if found is None:
            found = _wrong_slice(pairs, world, where=where, how=how, mesh=mesh)
        if found:
            return found
    return None
