"""Likely causes of a parity failure, read from the numbers both sides already hold: pure
analysis, typed evidence in, ordered :class:`Cause` values out. ``..._explain`` gathers the
evidence of a lockstep step across the ranks; ``docs/parity.md`` ("Likely causes") has the
table of what is recognised, what each cause needs and its guard.

By role: ``_evidence`` (the typed evidence and causes), ``_math`` (ulps, fits, chunks),
``_slices`` (wrong shard slices, initial weights), ``_gradients`` (factors and grids in the
applied gradients), ``_rank`` (one rank's causes, and local shards), ``_across`` (the causes
across ranks and the merged list), ``_mesh`` (shards and ranks on a device mesh).

[Note: likely causes]
When a lockstep step diverges, the harness holds for every parameter its value before and after
the step on both sides, the reference's gradient, the reference's optimizer, and the values of
both sides before step 1; across the ranks it can compare what each rank holds. The common bugs
of sharded-training code leave fingerprints in these numbers:

- *The gradient the model under test applied.* Its own gradients are often not at hand (a ZeRO
  wrapper keeps a slice of them, an engine keeps shards), but its update is: with the same SGD
  as the reference and the same momentum buffer before the step (true at the first step that
  diverged: every earlier step matched), ``after - before = -lr * gain * g + ...`` on both
  sides, so ``g_model = g_ref - (update_model - update_ref) / (lr * gain)``, where ``gain`` is
  what the optimizer multiplies this step's gradient by (1 at the first step; ``1 - dampening``
  after it; nesterov adds ``momentum`` times that). Its error is the rounding of the parameters
  (half an ulp of each ``after``, divided by ``lr * gain``) plus, after step 1, what the
  earlier steps' tolerated differences left in the momentum buffers; :class:`Gradients` carries
  that bound per element (``noise``) and every test below allows for it.
- *Gross or rounding.* A parameter diverges grossly when its applied gradient differs from the
  reference's by more than 1% of the reference's norm (plus the noise), or, without gradients,
  when its value differs by more than 1% of the reference's update. Summation order at any world
  size changes gradients by ~1e-7 relative, bf16 rounding by ~4e-3: neither is gross. Causes
  that speak of structure (which parameters, which ranks) use only gross divergences, so a
  rounding-level failure (``exact=True`` at a larger world) names none.
- Each cause states the numbers it read in one line and is named only when they are clear; the
  raw divergence stays above it in the report. The order of :class:`CauseKind` is the order of
  the report: a cause that explains the others' symptoms comes first (ranks that started apart
  make every later number differ; a wrong slice moves whole blocks; a scale shows in every
  gradient).
"""

from __future__ import annotations

from collections.abc import Sequence

from ._across import cross_rank_causes, merge_causes
from ._evidence import (
    Cause,
    CauseKind,
    InitialPair,
    ParamStep,
    RankFacts,
    SGDRule,
    SliceFinding,
    StepEvidence,
)
from ._math import Gradients
from ._mesh import MeshShards
from ._rank import gross_names, local_causes, rank_facts, shard_causes

__all__ = [
    "Cause",
    "CauseKind",
    "Gradients",
    "InitialPair",
    "MeshShards",
    "ParamStep",
    "RankFacts",
    "SGDRule",
    "SliceFinding",
    "StepEvidence",
    "cross_rank_causes",
    "format_causes",
    "gross_names",
    "local_causes",
    "merge_causes",
    "rank_facts",
    "shard_causes",
]


def format_causes(causes: Sequence[Cause]) -> str:
    """The report's "likely cause" section: one indented line per cause, or the line that says
    none is clear."""
    if not causes:
        return (
            'likely cause: none that the numbers make clear (docs/parity.md, "Likely causes", '
            "lists what is recognised)"
        )
    heading = "likely cause" if len(causes) == 1 else "likely causes, first the strongest"
    return heading + ":\n" + "\n".join(f"  {c}" for c in causes)
