"""The causes one rank's own numbers support (:func:`local_causes`), what a rank tells the
others (:func:`rank_facts`), and the causes of one rank's local shards against a replicated
reference (:func:`shard_causes`, for ``check_sharded_parity``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._evidence import ORDER, Cause, CauseKind, ParamStep, RankFacts, SliceFinding, StepEvidence
from ._gradients import factor_cause, low_precision_cause, per_slice_cause
from ._math import GROSS, Gradients, chunk_spans, f64, name_list, norm, plural, ulp
from ._slices import (
    DIM_UNITS,
    initial_differs,
    initial_slice,
    local_slice_cause,
    slice_after_step,
    span_text,
)


def _is_gross(param: ParamStep, grads: Gradients | None) -> bool:
    if grads is not None:
        diff = norm(grads.actual - grads.reference)
        return diff > GROSS * norm(grads.reference) + 3 * norm(grads.noise)
    if param.after.shape != param.ref_after.shape:
        return True
    a, ra, rb = f64(param.after), f64(param.ref_after), f64(param.ref_before)
    rounding = norm(ulp(a, torch.float32) + ulp(ra, torch.float32))
    return norm(a - ra) > GROSS * norm(ra - rb) + 4 * rounding


def gross_names(evidence: StepEvidence) -> tuple[str, ...]:
    """The parameters that diverged grossly on this rank (see [Note: likely causes])."""
    return tuple(p.name for p in evidence.params if p.diverged and _is_gross(p, p.gradients()))


def _never_stepped(evidence: StepEvidence, gross: Sequence[str]) -> list[str]:
    kept = []
    for p in evidence.params:
        if p.name not in gross or p.after.shape != p.before.shape:
            continue
        moved = not torch.equal(p.ref_after.detach().cpu(), p.ref_before.detach().cpu())
        if moved and torch.equal(p.after.detach().cpu(), p.before.detach().cpu()):
            kept.append(p.name)
    return kept


def _never_stepped_cause(evidence: StepEvidence, kept: Sequence[str]) -> Cause | None:
    if not kept:
        return None
    by_name = {p.name: p for p in evidence.params}
    moved = max(
        float((f64(by_name[n].ref_after) - f64(by_name[n].ref_before)).abs().max()) for n in kept
    )
    if len(kept) == 1:
        subject = f"{kept[0]} kept its value"
    else:
        subject = f"{plural(len(kept), 'parameter')} kept their values ({name_list(kept)})"
    return Cause(
        CauseKind.NEVER_STEPPED,
        f"{subject} through step {evidence.step} while the reference's moved by up to {moved:.3e}",
        "a parameter the optimizer never steps (left out of its parameters, or its gradient "
        "never arrives)",
    )


def local_causes(evidence: StepEvidence) -> tuple[Cause, ...]:
    """The causes one rank's own numbers support, in :class:`CauseKind` order (the causes
    that need several ranks are :func:`cross_rank_causes`'s).

    Args:
        evidence: this rank's numbers at the first step that diverged.
    """
    return _local(evidence)[0]


def _local(evidence: StepEvidence) -> tuple[tuple[Cause, ...], SliceFinding | None]:
    """:func:`local_causes`, and what its wrong-slice cause read."""
    found: list[Cause] = []
    diverged = [p for p in evidence.params if p.diverged]
    grads = {p.name: g for p in evidence.params if (g := p.gradients()) is not None}
    gross = [p.name for p in diverged if _is_gross(p, grads.get(p.name))]
    sliced = initial_slice(evidence)
    if sliced is None:
        found += initial_differs(evidence)
        sliced = slice_after_step(evidence, [p for p in diverged if p.name in gross])
    if sliced:
        found.append(local_slice_cause(sliced, evidence))
    never = _never_stepped_cause(evidence, _never_stepped(evidence, gross))
    if never:
        found.append(never)
    if gross:
        factor = factor_cause(evidence, grads, gross)
        if factor:
            found.append(factor)
        else:
            per_slice = per_slice_cause(evidence, grads)
            if per_slice:
                found.append(per_slice)
    else:
        low = low_precision_cause(evidence, grads, [p.name for p in diverged])
        if low:
            found.append(low)
    return tuple(sorted(found, key=lambda c: ORDER[c.kind])), sliced


def rank_facts(
    evidence: StepEvidence, *, diverged: bool, digest: Callable[[torch.Tensor], str]
) -> RankFacts:
    """What this rank tells the others about its step (see ``_explain``).

    Args:
        evidence: this rank's numbers.
        diverged: the rule found a parameter (or the loss) diverged on this rank.
        digest: ``digest(tensor) -> str``, a digest of a tensor's bytes.
    """
    gross = gross_names(evidence)
    local, sliced = _local(evidence)
    return RankFacts(
        rank=evidence.rank,
        diverged=diverged,
        gross=gross,
        order=tuple(p.name for p in evidence.params),
        kept=tuple(_never_stepped(evidence, gross)),
        initial_digest={p.name: digest(p.actual) for p in evidence.initial},
        initial_ref_digest={p.name: digest(p.reference) for p in evidence.initial},
        local=local,
        slice=sliced,
    )


def shard_causes(
    shards: Sequence[tuple[str, torch.Tensor, torch.Tensor, int]],
    grads: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
    *,
    rank: int,
    world_size: int,
    who: str | None = None,
) -> tuple[Cause, ...]:
    """The causes one rank's local shards support, against the replicated reference.

    Args:
        shards: for each diverging parameter: name, the reference's full value, this rank's
            local shard, and the dim it is sharded on (chunk ``rank`` of ``world_size``).
        grads: for each gradient: name, the expected local gradient and this rank's; all of
            them, diverging or not.
        rank: this rank's coordinate on the sharded mesh dim.
        world_size: that dim's size.
        who: how the report names this rank (default ``"rank {rank}"``; on a sub-mesh, e.g.
            ``"rank 3 (dp=1)"``: its coordinate is not its rank).
    """
    who = who if who is not None else f"rank {rank}"
    found: list[Cause] = []
    for name, full, local, dim in shards:
        if full.dim() <= dim:
            continue
        spans = chunk_spans(full.shape[dim], world_size)
        unit = DIM_UNITS.get(dim, f"indices along dim {dim}")
        expected = spans[rank]
        for other, (start, end) in enumerate(spans):
            if other == rank or end - start != local.shape[dim] or end == start:
                continue
            candidate = full.narrow(dim, start, end - start).detach().cpu()
            if torch.equal(candidate, local.detach().cpu()):
                where = span_text(expected, unit) if expected[1] > expected[0] else "no rows"
                found.append(
                    Cause(
                        CauseKind.WRONG_SHARD_SLICE,
                        f"{who}'s shard of {name} equals the reference's "
                        f"{span_text((start, end), unit)}, expected {where}",
                        "a shard taken from the wrong rank's slice",
                    )
                )
                break
        if found:
            break
    pairs = {
        name: Gradients(
            f64(expected), f64(actual), torch.zeros(expected.numel(), dtype=torch.float64)
        )
        for name, expected, actual in grads
        if expected.shape == actual.shape
    }
    diverging = [
        name
        for name, g in pairs.items()
        if norm(g.actual - g.reference) > GROSS * norm(g.reference)
    ]
    params = tuple(
        ParamStep(name=name, ref_before=e, ref_after=e, before=e, after=a, diverged=True)
        for name, e, a in grads
    )
    evidence = StepEvidence(step=0, rank=rank, world_size=world_size, params=params)
    if diverging:
        factor = factor_cause(evidence, pairs, diverging)
        if factor:
            found.append(factor)
    elif pairs:
        differing = [n for n, g in pairs.items() if not torch.equal(g.actual, g.reference)]
        low = low_precision_cause(evidence, pairs, differing)
        if low:
            found.append(low)
    return tuple(sorted(found, key=lambda c: ORDER[c.kind]))
