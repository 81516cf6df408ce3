"""What a lockstep keeps for the likely causes of a failure, and the exchange between ranks that
turns it into one list of :class:`~._causes.Cause` on every rank. The analysis itself is
``_causes`` (pure); see [Note: likely causes] there.

[Note: keeping the evidence]
The causes need, per parameter, both sides' values before and after the step that diverged,
the values before step 1, the reference's gradient and its optimizer. The comparison already
makes the after-step lists every step; :class:`History` keeps a reference to the previous
step's (they are the next step's "before") and one copy of both sides' parameters before step 1
(one extra full-state read of each side, the only cost when parity holds). The reference's
gradients are still on its parameters right after the step. Nothing is computed until a step
has diverged on some rank; then every rank runs :func:`explain`: its own analysis, one
``all_gather_object`` of small facts, and, only where a cross-rank cause needs them, a second
one of the tensors it compares (parameters that differed across ranks before step 1, the
gradients of the grossly diverging parameters).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..engines import clean_param_name
from ._causes import (
    Cause,
    Gradients,
    InitialPair,
    MeshShards,
    ParamStep,
    RankFacts,
    SGDRule,
    StepEvidence,
    cross_rank_causes,
    merge_causes,
    rank_facts,
)

__all__ = ["History", "explain"]

Named = list[tuple[str, torch.Tensor]]


def _aligned(reference: Named, actual: Named) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """``(name, reference name, reference value, value)``, paired as ``_compare.align_named``
    pairs them for the comparison (by name, else by position), keeping the reference's own name
    (the key of its parameter, whose gradient the causes read); unpaired tensors are left out."""
    ref_map, act_map = dict(reference), dict(actual)
    if ref_map.keys() == act_map.keys():
        return [(n, n, ref_map[n], act_map[n]) for n in act_map]
    if len(reference) == len(actual):
        return [(a, r, rv, av) for (r, rv), (a, av) in zip(reference, actual, strict=True)]
    return [(n, n, ref_map[n], act_map[n]) for n in act_map if n in ref_map]


@dataclasses.dataclass
class History:
    """Both sides' full parameters before step 1, before the last step and after it. See
    [Note: keeping the evidence]."""

    initial: tuple[Named, Named] | None = None
    before: tuple[Named, Named] | None = None
    after: tuple[Named, Named] | None = None
    step: int = 0

    def start(self, reference: Named, actual: Named) -> None:
        """Keeps both sides' parameters before step 1."""
        self.initial = self.before = (reference, actual)

    def record(self, step: int, reference: Named, actual: Named) -> None:
        """Keeps step ``step``'s parameters (the last step's become its "before")."""
        if self.after is not None:
            self.before = self.after
        self.after, self.step = (reference, actual), step

    def evidence(
        self,
        *,
        diverged: Iterable[str],
        reference_model: Any,
        reference_optimizer: Any,
        rank: int,
        world_size: int,
        accum_steps: int,
        mesh: MeshShards | None = None,
    ) -> StepEvidence | None:
        """The last step as :class:`StepEvidence`; None if nothing was kept.

        Args:
            diverged: the names the rule found diverged on this rank.
            reference_model: the reference's plain model (its parameters hold the gradients
                its optimizer stepped with).
            reference_optimizer: the reference's optimizer.
            rank: this rank in the group.
            world_size: the group's size.
            accum_steps: forwards per optimizer step.
            mesh: the device mesh the code ran on (default None).
        """
        if self.after is None or self.before is None:
            return None
        names = set(diverged)
        params_by_name: dict[str, nn.Parameter] = {}
        if isinstance(reference_model, nn.Module):
            params_by_name = {clean_param_name(n): p for n, p in reference_model.named_parameters()}
        before = {n: (rv, av) for n, _, rv, av in _aligned(*self.before)}
        steps = []
        for name, ref_name, ref_after, after in _aligned(*self.after):
            if name not in before:
                continue
            ref_before, value_before = before[name]
            param = params_by_name.get(ref_name)
            grad = param.grad if param is not None else None
            rule = (
                SGDRule.of(reference_optimizer, param, first_step=self.step == 1)
                if param is not None
                else None
            )
            steps.append(
                ParamStep(
                    name=name,
                    ref_before=ref_before,
                    ref_after=ref_after,
                    before=value_before,
                    after=after,
                    ref_grad=grad.detach().clone() if grad is not None else None,
                    sgd=rule,
                    diverged=name in names,
                )
            )
        initial: tuple[InitialPair, ...] = ()
        if self.initial is not None:
            initial = tuple(InitialPair(n, rv, av) for n, _, rv, av in _aligned(*self.initial))
        return StepEvidence(
            step=self.step,
            rank=rank,
            world_size=world_size,
            accum_steps=accum_steps,
            params=tuple(steps),
            initial=initial,
            mesh=mesh,
        )


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return f"{data.dtype}{tuple(data.shape)}:" + hashlib.blake2b(raw, digest_size=16).hexdigest()


def _payload(evidence: StepEvidence, apart: list[str], gross: list[str]) -> dict[str, Any]:
    """What a rank sends for the cross-rank causes: its values before step 1 of ``apart``, its
    applied gradients of ``gross``."""
    initial = {p.name: p.actual.detach().cpu() for p in evidence.initial}
    by_name = {p.name: p for p in evidence.params}
    gradients = {}
    for name in gross:
        grads = by_name[name].gradients() if name in by_name else None
        if grads is not None:
            gradients[name] = grads
    return {"initial": {n: initial[n] for n in apart if n in initial}, "gradients": gradients}


def explain(
    evidence: StepEvidence | None,
    *,
    diverged: bool,
    group: dist.ProcessGroup,
    mesh: MeshShards | None = None,
) -> tuple[Cause, ...]:
    """The likely causes of a step that diverged on some rank, the same list on every rank.
    A collective: every rank of ``group`` calls it, with its own evidence.

    Args:
        evidence: this rank's numbers (None: nothing was kept; the rank still takes part).
        diverged: the rule found something diverged on this rank.
        group: the ranks that trained.
        mesh: the device mesh the code ran on, the same on every rank (default None).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    facts = RankFacts(rank=rank, diverged=diverged)
    failure: Exception | None = None
    if evidence is not None:
        try:
            facts = rank_facts(evidence, diverged=diverged, digest=_digest)
        except Exception as error:  # still take part in the exchange, then say so
            failure = error
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, facts, group=group)
    if failure is not None:
        raise failure
    ranks: Sequence[RankFacts] = everyone
    if any(not f.order for f in ranks):
        return merge_causes((), ranks, mesh=mesh)  # a rank kept nothing: its local causes only
    apart = [
        n
        for n in ranks[0].order
        if len({f.initial_digest.get(n) for f in ranks}) > 1
        and len({f.initial_ref_digest.get(n) for f in ranks}) == 1
    ]
    gross = [n for n in ranks[0].order if any(n in f.gross for f in ranks)]
    payload: dict[str, Any] = {"initial": {}, "gradients": {}}
    if evidence is not None:
        try:
            payload = _payload(evidence, apart, gross)
        except Exception as error:
            failure = error
    payloads: list[Any] = [payload] * world
    if apart or gross:
        dist.all_gather_object(payloads, payload, group=group)
    if failure is not None:
        raise failure
    initial_values = {
        n: [p["initial"][n] for p in payloads]
        for n in apart
        if all(n in p["initial"] for p in payloads)
    }
    gradients: dict[str, list[Gradients]] = {
        n: [p["gradients"][n] for p in payloads]
        for n in gross
        if all(n in p["gradients"] for p in payloads)
    }
    cross = cross_rank_causes(ranks, initial=initial_values, gradients=gradients, mesh=mesh)
    return merge_causes(cross, ranks, mesh=mesh)
