"""Wrong shard slices: blocks of a parameter (or of the flat parameters) that equal other
blocks of the reference's, before step 1 or around the step that diverged; and initial weights
that differ otherwise."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._evidence import Cause, CauseKind, ParamStep, StepEvidence
from ._math import chunk_spans, equal_within, f64, plural, ulp_slack


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


def _slice_evidence(
    what: str, moved: list[tuple[int, int]], spans: list[tuple[int, int]], unit: str, how: str
) -> str:
    """``"rank 0's shard of w (rows 0-3) equals the reference's rows 4-7; rank 1's (rows 4-7)
    equals rows 0-3"``: ``what`` is ``"shard of w"``, ``how`` the verb."""
    parts = []
    for n, (i, j) in enumerate(moved[:3]):
        mine, theirs = span_text(spans[i], unit), span_text(spans[j], unit)
        if n == 0:
            parts.append(f"rank {i}'s {what} ({mine}) {how} the reference's {theirs}")
        else:
            parts.append(f"rank {i}'s ({mine}) {how} {theirs}")
    more = f" (and {len(moved) - 3} more)" if len(moved) > 3 else ""
    return "; ".join(parts) + more


def _wrong_slice(
    pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
    world: int,
    *,
    where: str,
    how: str = "equals",
) -> Cause | None:
    """Per parameter along each dim, then over the flat concatenation of all of them (the
    order a flat-buffer wrapper shards): ``pairs`` are (name, actual, expected, per-element
    slack); a pair whose shapes differ is never a permutation."""
    for name, actual, expected, slack in pairs:
        if actual.shape != expected.shape:
            continue
        for dim in range(actual.dim()):
            moved = _permutation(actual, expected, slack, world, dim)
            if moved:
                spans = [s for s in chunk_spans(actual.shape[dim], world) if s[1] > s[0]]
                unit = DIM_UNITS.get(dim, f"indices along dim {dim}")
                text = _slice_evidence(f"shard of {name}", moved, spans, unit, how)
                return Cause(CauseKind.WRONG_SHARD_SLICE, where + text, _WRONG_SLICE)
    if pairs and all(a.shape == e.shape for _, a, e, _ in pairs):
        actual = torch.cat([a.reshape(-1) for _, a, _, _ in pairs])
        expected = torch.cat([e.reshape(-1) for _, _, e, _ in pairs])
        slack = torch.cat([s.reshape(-1) for _, _, _, s in pairs])
        moved = _permutation(actual, expected, slack, world, 0)
        if moved:
            spans = [s for s in chunk_spans(actual.numel(), world) if s[1] > s[0]]
            text = _slice_evidence("slice of the flat parameters", moved, spans, "elements", how)
            return Cause(CauseKind.WRONG_SHARD_SLICE, where + text, _WRONG_SLICE)
    return None


_WRONG_SLICE = "a shard taken from the wrong rank's slice"


def initial_causes(evidence: StepEvidence) -> list[Cause]:
    """Before step 1: a wrong shard slice, else initial weights that differ grossly."""
    differing = [
        p
        for p in evidence.initial
        if p.reference.shape != p.actual.shape
        or not torch.equal(p.reference.detach().cpu(), p.actual.detach().cpu())
    ]
    if not differing:
        return []
    pairs = []
    for p in evidence.initial:
        ref, act = p.reference.detach().cpu(), p.actual.detach().cpu()
        slack = ulp_slack(ref, act).view(ref.shape) if ref.shape == act.shape else ref
        pairs.append((p.name, act.to(torch.float64), ref.to(torch.float64), slack))
    found = _wrong_slice(pairs, evidence.world_size, where="before step 1, ")
    if found:
        return [found]
    gross = []
    for p in differing:
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


def slice_after_step(evidence: StepEvidence, diverged: list[ParamStep]) -> Cause | None:
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
        found = _wrong_slice(mine, world, where=where, how=how) if mine else None
        if found is None:
            found = _wrong_slice(pairs, world, where=where, how=how)
        if found:
            return found
    return None
