"""Likely causes of a parity failure, read from the numbers both sides already hold: pure
analysis, typed evidence in, ordered :class:`Cause` values out. ``_explain`` gathers the
evidence of a lockstep step across the ranks; ``docs/parity.md`` ("Likely causes") has the
table of what is recognised, what each cause needs and its guard.

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

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "Cause",
    "CauseKind",
    "Gradients",
    "InitialPair",
    "ParamStep",
    "RankFacts",
    "SGDRule",
    "StepEvidence",
    "cross_rank_causes",
    "format_causes",
    "gross_names",
    "local_causes",
    "merge_causes",
    "shard_causes",
]

#: A gradient that differs from the reference's by more than this fraction of its norm is a
#: gross divergence (see [Note: likely causes]).
GROSS = 0.01
#: A constant factor must differ from 1 by more than this to be one.
MIN_FACTOR_GAP = 0.02
#: How close a factor must be to the world size (or 1/W, or the accumulation steps), relative.
FACTOR_MATCH = 0.005


class CauseKind(enum.Enum):
    """What a cause names, in the order the report lists them (see [Note: likely causes])."""

    #: Before step 1 the ranks held different values where the reference's agree.
    RANKS_STARTED_APART = "ranks started from different initial weights"
    #: Blocks of a parameter (or of the flat parameters) equal other blocks of the reference's.
    WRONG_SHARD_SLICE = "wrong shard slice"
    #: Before step 1 the model under test already differed from the reference.
    INITIAL_STATE_DIFFERS = "the initial weights differ"
    #: Some ranks diverge grossly while others match the reference.
    SOME_RANKS_ONLY = "a result that reached only some ranks"
    #: Only the parameters before one layer diverge.
    BACKWARD_STOPS = "a missing all-reduce or send in the backward"
    #: The ranks' gradients differ and average (or sum) to the reference's.
    GRADIENTS_NOT_REDUCED = "gradients not all-reduced"
    #: A parameter kept its value while the reference's moved.
    NEVER_STEPPED = "a parameter the optimizer never steps"
    #: Every diverging gradient is W times the reference's.
    GRADIENTS_SUMMED = "gradients summed, not averaged"
    #: Every diverging gradient is 1/W times the reference's.
    GRADIENTS_DIVIDED_TWICE = "gradients divided by the world size twice"
    #: Every diverging gradient is accum_steps times the reference's.
    ACCUMULATION_NOT_SCALED = "gradient accumulation not scaled"
    #: Every diverging gradient is another constant times the reference's.
    CONSTANT_FACTOR = "a constant gradient or learning-rate factor"
    #: Each rank's slice of the gradient scales by its own constant.
    PER_SLICE_FACTORS = "a scale computed from each rank's own slice"
    #: The applied gradients lie on a low-precision grid, within a few of its ulps.
    LOW_PRECISION_REDUCTION = "a reduction in lower precision"


@dataclasses.dataclass(frozen=True)
class Cause:
    """One hypothesis the numbers support: what it is and the evidence, in one line."""

    kind: CauseKind
    evidence: str
    """What was read, e.g. ``"every diverging gradient is 2.000x the reference's (world size
    2)"``."""
    conclusion: str
    """What it means, e.g. ``"gradients summed, not averaged"``."""

    def __str__(self) -> str:
        return f"{self.evidence}: {self.conclusion}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGDRule:
    """How ``torch.optim.SGD`` turns one parameter's gradient into its update at one step.

    Args:
        lr: the learning rate.
        momentum: the momentum (default 0).
        dampening: the dampening (default 0).
        nesterov: Nesterov momentum (default False).
        weight_decay: the weight decay (default 0).
        maximize: ascend instead of descend (default False).
        first_step: the momentum buffer did not exist before this step (default True).
    """

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False
    first_step: bool = True

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"SGDRule: lr must be positive, got {self.lr}")

    @property
    def gain(self) -> float:
        """d(update) / d(gradient) / lr at this step (see [Note: likely causes])."""
        if self.momentum == 0:
            return 1.0
        buffer = 1.0 if self.first_step else 1.0 - self.dampening
        return 1.0 + self.momentum * buffer if self.nesterov else buffer

    @classmethod
    def of(cls, optimizer: Any, param: torch.Tensor, *, first_step: bool) -> SGDRule | None:
        """The rule of ``param`` in ``optimizer`` if it is a ``torch.optim.SGD`` holding it,
        else None (another optimizer's update says nothing exact about the gradient).

        Args:
            optimizer: the reference's optimizer.
            param: one of its parameters.
            first_step: this is the first step that updated ``param``.
        """
        if not isinstance(optimizer, torch.optim.SGD):
            return None
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                lr = float(group["lr"])
                if not lr > 0:
                    return None
                return cls(
                    lr=lr,
                    momentum=float(group.get("momentum", 0.0)),
                    dampening=float(group.get("dampening", 0.0)),
                    nesterov=bool(group.get("nesterov", False)),
                    weight_decay=float(group.get("weight_decay", 0.0)),
                    maximize=bool(group.get("maximize", False)),
                    first_step=first_step,
                )
        return None


class Gradients(NamedTuple):
    """The gradient each side applied to one tensor (flat, float64), and how well the model
    under test's is known, per element (0 where it was read, not inferred)."""

    reference: torch.Tensor
    actual: torch.Tensor
    noise: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamStep:
    """One parameter at the step that diverged, on one rank: full values of both sides.

    Args:
        name: the parameter's name in the model.
        ref_before: the reference's value before the step.
        ref_after: the reference's value after it.
        before: the model under test's value before the step.
        after: its value after it.
        ref_grad: the gradient the reference's optimizer stepped with (None: none).
        sgd: the reference optimizer's rule for this parameter (None: not SGD).
        diverged: the parity rule found it diverged on this rank.
    """

    name: str
    ref_before: torch.Tensor
    ref_after: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    ref_grad: torch.Tensor | None = None
    sgd: SGDRule | None = None
    diverged: bool = False

    def gradients(self) -> Gradients | None:
        """The gradients both sides applied at this step (see [Note: likely causes]); None
        without an SGD rule, a reference gradient or equal shapes."""
        rule, grad = self.sgd, self.ref_grad
        shapes = {self.ref_before.shape, self.ref_after.shape, self.before.shape, self.after.shape}
        if rule is None or grad is None or len(shapes) != 1 or grad.shape != self.after.shape:
            return None
        wide = torch.float64
        rb, ra = _f64(self.ref_before), _f64(self.ref_after)
        b, a = _f64(self.before), _f64(self.after)
        scale = rule.lr * rule.gain
        sign = 1.0 if rule.maximize else -1.0
        delta_update = (a - b) - (ra - rb)
        delta = sign * delta_update / scale - rule.weight_decay * (b - rb)
        reference = grad.detach().to("cpu", wide).reshape(-1)
        dtype = self.after.dtype if self.after.is_floating_point() else torch.float32
        rounding = 0.5 * (_ulp(a, dtype) + _ulp(ra, dtype)) / scale
        # What the earlier steps' tolerated differences left in the momentum buffers.
        history = 0.0 if rule.first_step else 2.0 * rule.momentum / scale
        noise = rounding + history * (b - rb).abs()
        return Gradients(reference, reference + delta, noise)


class InitialPair(NamedTuple):
    """One parameter before step 1: the reference's value and the model under test's."""

    name: str
    reference: torch.Tensor
    actual: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepEvidence:
    """What one rank holds at the first step that diverged.

    Args:
        step: the step (1-based).
        rank: this rank in the group.
        world_size: the group's size.
        accum_steps: forwards per optimizer step (default 1).
        params: every compared parameter, in the model's order.
        initial: every parameter before step 1 (empty: not kept).
    """

    step: int
    rank: int
    world_size: int
    accum_steps: int = 1
    params: tuple[ParamStep, ...] = ()
    initial: tuple[InitialPair, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFacts:
    """What one rank tells the others (small and picklable; see ``_explain``).

    Args:
        rank: the rank.
        diverged: the rule found any parameter diverged on this rank.
        gross: the parameters that diverged grossly here, in the model's order.
        order: every compared parameter's name, in the model's order.
        kept: the grossly diverging parameters that kept their value through the step.
        initial_digest: each parameter's digest before step 1, the model under test's.
        initial_ref_digest: the same, the reference's.
        local: the causes this rank's own numbers support.
    """

    rank: int
    diverged: bool
    gross: tuple[str, ...] = ()
    order: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    initial_digest: Mapping[str, str] = dataclasses.field(default_factory=dict)
    initial_ref_digest: Mapping[str, str] = dataclasses.field(default_factory=dict)
    local: tuple[Cause, ...] = ()


# -- numbers ------------------------------------------------------------------------------------


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64).reshape(-1)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|x|`` (x float64)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.abs())  # |x| in [2^(e-1), 2^e)
    spacing = torch.ldexp(torch.full_like(x, info.eps), exponent - 1)
    tiny = info.smallest_normal * info.eps
    return torch.where(x == 0, torch.full_like(x, tiny), spacing.clamp(min=tiny))


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


class _Fit(NamedTuple):
    """``actual ~ k * reference``: the factor, whether the residual is only noise, and the
    factor's uncertainty (relative)."""

    k: float
    good: bool
    error: float


def _fit(g: Gradients) -> _Fit | None:
    ref_sq = float(torch.dot(g.reference, g.reference))
    if ref_sq == 0 or not math.isfinite(ref_sq):
        return None
    k = float(torch.dot(g.actual, g.reference)) / ref_sq
    if not math.isfinite(k):
        return None
    noise = _norm(g.noise)
    residual = _norm(g.actual - k * g.reference)
    good = residual <= GROSS * _norm(g.actual - g.reference) + 3 * noise
    return _Fit(k, good, 3 * noise / math.sqrt(ref_sq))


def _concat(parts: Iterable[Gradients]) -> Gradients | None:
    items = list(parts)
    if not items:
        return None
    return Gradients(*(torch.cat([getattr(g, f) for g in items]) for f in Gradients._fields))


def _is_gross(param: ParamStep, grads: Gradients | None) -> bool:
    if grads is not None:
        diff = _norm(grads.actual - grads.reference)
        return diff > GROSS * _norm(grads.reference) + 3 * _norm(grads.noise)
    if param.after.shape != param.ref_after.shape:
        return True
    a, ra, rb = _f64(param.after), _f64(param.ref_after), _f64(param.ref_before)
    rounding = _norm(_ulp(a, torch.float32) + _ulp(ra, torch.float32))
    return _norm(a - ra) > GROSS * _norm(ra - rb) + 4 * rounding


def gross_names(evidence: StepEvidence) -> tuple[str, ...]:
    """The parameters that diverged grossly on this rank (see [Note: likely causes])."""
    return tuple(p.name for p in evidence.params if p.diverged and _is_gross(p, p.gradients()))


def _close(k: float, target: float, error: float) -> bool:
    return abs(k - target) <= FACTOR_MATCH * abs(target) + error


def _names(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _rank_list(ranks: Sequence[int]) -> str:
    from .._report.text import rank_ranges

    return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


# -- blocks: wrong shard slices -----------------------------------------------------------------


def _spans(n: int, world: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's chunk of ``n`` (``torch.chunk``'s sizes, as FSDP pads:
    trailing ranks may hold nothing)."""
    size = -(-n // world)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


def _equal_within(a: torch.Tensor, b: torch.Tensor, slack: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= slack).all())


def _permutation(
    actual: torch.Tensor, expected: torch.Tensor, slack: torch.Tensor, world: int, dim: int
) -> list[tuple[int, int]] | None:
    """For ``actual`` and ``expected`` split into ``world`` chunks along ``dim``: the pairs
    ``(i, j)``, ``j != i``, where chunk ``i`` of ``actual`` equals chunk ``j`` of ``expected``,
    when every chunk of ``actual`` equals exactly one chunk of ``expected``, the chunks of
    ``expected`` are pairwise different and at least one pair is off its place; else None."""
    if actual.dim() <= dim or actual.shape[dim] < world or actual.shape != expected.shape:
        return None
    spans = [s for s in _spans(actual.shape[dim], world) if s[1] > s[0]]
    if len(spans) < 2:
        return None

    def chunk(t: torch.Tensor, i: int) -> torch.Tensor:
        start, end = spans[i]
        return t.narrow(dim, start, end - start)

    count = len(spans)
    for i in range(count):
        for j in range(i + 1, count):
            if _equal_within(chunk(expected, i), chunk(expected, j), chunk(slack, i)):
                return None  # equal blocks (zeros, constants): no order to read
    moved = []
    for i in range(count):
        part, tol = chunk(actual, i), chunk(slack, i)
        if _equal_within(part, chunk(expected, i), tol):
            continue
        matches = [
            j for j in range(count) if j != i and _equal_within(part, chunk(expected, j), tol)
        ]
        if len(matches) != 1:
            return None
        moved.append((i, matches[0]))
    return moved or None


def _span_text(span: tuple[int, int], unit: str) -> str:
    start, end = span
    return f"{unit} {start}-{end - 1}" if end - start > 1 else f"{unit[:-1]} {start}"


_DIM_UNITS = {0: "rows", 1: "columns"}


def _slice_evidence(
    name: str, moved: list[tuple[int, int]], spans: list[tuple[int, int]], unit: str, where: str
) -> str:
    parts = []
    for i, j in moved[:3]:
        parts.append(
            f"rank {i}'s shard of {name} ({_span_text(spans[i], unit)}) equals the reference's "
            f"{_span_text(spans[j], unit)}"
        )
    more = f" (and {len(moved) - 3} more shards)" if len(moved) > 3 else ""
    return f"{where}{'; '.join(parts)}{more}"


def _wrong_slice(
    pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], world: int, where: str
) -> Cause | None:
    """Per parameter along each dim, then over the flat concatenation: ``pairs`` are (name,
    actual, expected, slack), full shapes."""
    for name, actual, expected, slack in pairs:
        if actual.shape != expected.shape:
            continue
        for dim in range(actual.dim()):
            moved = _permutation(actual, expected, slack, world, dim)
            if moved:
                spans = [s for s in _spans(actual.shape[dim], world) if s[1] > s[0]]
                unit = _DIM_UNITS.get(dim, f"indices along dim {dim}")
                return Cause(
                    CauseKind.WRONG_SHARD_SLICE,
                    _slice_evidence(name, moved, spans, unit, where),
                    "a shard taken from the wrong rank's slice",
                )
    shaped = [(a, e, s) for _, a, e, s in pairs if a.shape == e.shape]
    if len(shaped) == len(pairs) and shaped:
        flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in zip(*shaped, strict=True)]
        moved = _permutation(flat[0], flat[1], flat[2], world, 0)
        if moved:
            spans = [s for s in _spans(flat[0].numel(), world) if s[1] > s[0]]
            text = _slice_evidence("the flat parameters", moved, spans, "elements", where)
            return Cause(
                CauseKind.WRONG_SHARD_SLICE,
                text.replace("shard of the flat parameters", "slice of the flat parameters"),
                "a shard taken from the wrong rank's slice",
            )
    return None


def _slack(*tensors: torch.Tensor) -> torch.Tensor:
    """Four ulps (fp32, or the tensors' dtype) of the largest magnitude, per element."""
    dtype = tensors[0].dtype if tensors[0].is_floating_point() else torch.float32
    dtype = dtype if torch.finfo(dtype).eps >= torch.finfo(torch.float32).eps else torch.float32
    biggest = torch.stack([t.detach().to("cpu", torch.float64).abs() for t in tensors]).amax(0)
    return 4 * _ulp(biggest, dtype)


# -- causes of one rank -------------------------------------------------------------------------


def _initial_causes(evidence: StepEvidence) -> list[Cause]:
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
        if ref.shape == act.shape:
            wide_ref, wide_act = ref.to(torch.float64), act.to(torch.float64)
            pairs.append((p.name, wide_act, wide_ref, _slack(ref, act).view(ref.shape)))
        else:
            pairs.append(
                (p.name, act.to(torch.float64), ref.to(torch.float64), ref.to(torch.float64))
            )
    found = _wrong_slice(pairs, evidence.world_size, "before step 1, ")
    if found:
        return [found]
    gross = []
    for p in differing:
        if p.reference.shape != p.actual.shape:
            gross.append((p.name, float("inf")))
            continue
        ref, act = _f64(p.reference), _f64(p.actual)
        worst = float((act - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        if worst > 1e-3 * max(scale, 1e-12) or not math.isfinite(worst):
            gross.append((p.name, worst))
    if not gross:
        return []
    name, worst = max(gross, key=lambda item: item[1])
    others = f" and {_plural(len(gross) - 1, 'other parameter')}" if len(gross) > 1 else ""
    return [
        Cause(
            CauseKind.INITIAL_STATE_DIFFERS,
            f"before step 1, {name}{others} already differed from the reference "
            f"(max abs diff {worst:.3e})",
            "the wrapping changed the initial weights (it must start from the module it is given)",
        )
    ]


def _slice_after_step(evidence: StepEvidence, diverged: list[ParamStep]) -> Cause | None:
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
        a, ra, rb = _f64(p.after), _f64(p.ref_after), _f64(p.ref_before)
        slack = (_slack(p.after, p.ref_after, p.ref_before) * 2).view(shape)
        started.append((p.name, (a - (ra - rb)).view(shape), rb.view(shape), slack))
        ended.append((p.name, a.view(shape), ra.view(shape), slack))
    names = {p.name for p in diverged}
    for pairs, where in (
        (started, f"at step {step}, the step started from the wrong slice: "),
        (ended, f"after step {step}, "),
    ):
        mine = [pair for pair in pairs if pair[0] in names]
        found = _wrong_slice(mine, world, where) if mine else None
        if found is None:
            found = _wrong_slice(pairs, world, where)
        if found:
            return found
    return None


def _factor_cause(
    evidence: StepEvidence, grads: Mapping[str, Gradients], gross: Sequence[str]
) -> Cause | None:
    used = [n for n in gross if n in grads]
    if not used or len(used) < len(gross):
        return None
    whole = _fit(_concat(grads[n] for n in used))  # type: ignore[arg-type]
    if whole is None or not whole.good or whole.error > 0.05:
        return None
    k = whole.k
    if k < 0.05 or abs(k - 1) <= MIN_FACTOR_GAP + whole.error:
        return None
    for name in used:  # each parameter on its own, where its numbers can tell
        own = _fit(grads[name])
        if (
            own is not None
            and own.error < 0.05
            and not _close(own.k, k, 2 * FACTOR_MATCH + own.error)
        ):
            return None
    world, accum = evidence.world_size, evidence.accum_steps
    total = len(evidence.params)
    if len(used) == total:
        subject = "every gradient"
    else:
        others = _plural(total - len(used), "other parameter")
        subject = f"every diverging gradient ({_names(used)}; {others} match)"
    base = f"{subject} is {k:.3f}x the reference's"
    err = whole.error
    if world > 1 and _close(k, world, err):
        also = f"; or accum_steps {accum} not divided" if accum == world else ""
        return Cause(
            CauseKind.GRADIENTS_SUMMED,
            f"{base} (world size {world})",
            f"gradients summed, not averaged{also}",
        )
    if world > 1 and _close(k, 1 / world, err):
        return Cause(
            CauseKind.GRADIENTS_DIVIDED_TWICE,
            f"{base} (1/{world}, world size {world})",
            "gradients divided by the world size twice (averaged, then divided again)",
        )
    if accum > 1 and _close(k, accum, err):
        return Cause(
            CauseKind.ACCUMULATION_NOT_SCALED,
            f"{base} (accum_steps {accum})",
            f"gradient accumulation not scaled (each of the {accum} micro-batch losses must be "
            f"divided by {accum})",
        )
    known = []
    if accum > 1 and _close(k, 1 / accum, err):
        known.append(f"1/accum_steps: each micro-batch loss divided by {accum} twice")
    if accum > 1 and world > 1 and _close(k, world * accum, err):
        known.append(
            f"world size x accum_steps = {world * accum}: summed over ranks and micro-batches"
        )
    rounded = round(k)
    if not known and rounded >= 2 and _close(k, rounded, err):
        known.append(f"a sum of {rounded} terms where their mean was meant")
    hint = f" ({'; '.join(known)})" if known else ""
    return Cause(
        CauseKind.CONSTANT_FACTOR,
        f"{base}, not a factor of world size {world} or accum_steps {accum}{hint}",
        "a constant gradient scale (a loss or gradient scaled, or the learning rate differs)",
    )


def _per_slice_cause(evidence: StepEvidence, grads: Mapping[str, Gradients]) -> Cause | None:
    world = evidence.world_size
    ordered = [(p, grads[p.name]) for p in evidence.params if p.name in grads]
    if world < 2 or len(ordered) < len(evidence.params) or not ordered:
        return None
    chunkings: list[tuple[str, list[Gradients]]] = []
    flat = _concat(g for _, g in ordered)
    assert flat is not None  # for mypy: ordered is not empty
    spans = _spans(flat.reference.numel(), world)
    chunkings.append(
        (
            "flat elements",
            [Gradients(*(t[s:e] for t in flat)) for s, e in spans if e > s],
        )
    )
    per_rank: list[list[Gradients]] = [[] for _ in range(world)]
    for p, g in ordered:
        shape = p.after.shape
        if not shape or shape[0] < world:
            continue
        for r, (s, e) in enumerate(_spans(shape[0], world)):
            if e > s:
                per_rank[r].append(Gradients(*(t.view(shape)[s:e].reshape(-1) for t in g)))
    rows = [_concat(parts) for parts in per_rank if parts]
    if len(rows) == world:
        chunkings.append(("rows of each parameter", [r for r in rows if r is not None]))
    for label, blocks in chunkings:
        fits = [_fit(b) for b in blocks]
        if len(fits) < 2 or any(f is None or not f.good or f.error > 0.02 for f in fits):
            continue
        ks = [f.k for f in fits if f is not None]
        if min(ks) < 0.05 or max(ks) / min(ks) < 1 + MIN_FACTOR_GAP + 2 * max(
            f.error for f in fits if f
        ):
            continue
        if all(abs(k - 1) <= MIN_FACTOR_GAP for k in ks):
            continue
        if label == "flat elements":
            shown = [
                f"elements {s}-{e - 1} (rank {r}) {k:.3f}x"
                for r, ((s, e), k) in enumerate(
                    zip([sp for sp in spans if sp[1] > sp[0]], ks, strict=True)
                )
            ]
        else:
            shown = [f"rank {r}'s rows {k:.3f}x" for r, k in enumerate(ks)]
        listed = ", ".join(shown[:4]) + (f", ... ({len(shown)} slices)" if len(shown) > 4 else "")
        return Cause(
            CauseKind.PER_SLICE_FACTORS,
            f"each rank's slice of the gradient ({label}) scales by its own constant: "
            f"{listed} the reference's",
            "a scale computed from each rank's own slice, not agreed across ranks (a dropped "
            "MAX or SUM all-reduce, e.g. of a clipping norm)",
        )
    return None


_GRIDS = (("bf16", torch.bfloat16), ("fp16", torch.float16))


def _on_grid(x: torch.Tensor, dtype: torch.dtype, slack: torch.Tensor) -> torch.Tensor:
    rounded = x.to(dtype).to(torch.float64)
    return torch.isfinite(rounded) & ((x - rounded).abs() <= slack)


def _low_precision_cause(
    evidence: StepEvidence, grads: Mapping[str, Gradients], diverged: Sequence[str]
) -> Cause | None:
    if not diverged:
        return None
    flat = _concat(grads[p.name] for p in evidence.params if p.name in grads)
    if flat is None:
        return None
    world = evidence.world_size
    for label, dtype in _GRIDS:
        spacing = _ulp(flat.actual, dtype)
        # Elements whose inferred value is known to 1/64 of the grid's spacing, so that landing
        # on the grid by chance has a probability of at most ~10%.
        known = (flat.actual != 0) & torch.isfinite(flat.actual) & (64 * flat.noise < spacing)
        count = int(known.sum())
        if count < 32:
            continue
        actual, reference = flat.actual[known], flat.reference[known]
        slack = 3 * flat.noise[known] + 1e-300
        best = None
        for multiplier in sorted({1, world}):  # summed in the low precision, then divided
            frac = float(_on_grid(actual * multiplier, dtype, slack * multiplier).double().mean())
            ref_frac = float(
                _on_grid(reference * multiplier, dtype, slack * multiplier).double().mean()
            )
            if best is None or frac - ref_frac > best[0] - best[1]:
                best = (frac, ref_frac, multiplier)
        assert best is not None  # for mypy: at least one multiplier
        frac, ref_frac, multiplier = best
        ulps = ((actual - reference).abs() / _ulp(reference, dtype)).sort().values
        most, worst = float(ulps[int(0.9 * (count - 1))]), float(ulps[-1])
        # On the grid where the reference is not, within a few of its ulps, and off the
        # reference by a visible fraction of one somewhere (fp32 rounding is 2^-16 of one).
        if frac >= 0.95 and ref_frac <= 0.75 and most <= 4 and worst >= 0.1:
            times = f" x {multiplier}" if multiplier != 1 else ""
            return Cause(
                CauseKind.LOW_PRECISION_REDUCTION,
                f"the gradients applied{times} lie on the {label} grid ({frac:.0%} of {count} "
                f"elements; the reference's {ref_frac:.0%}), 90% of them within {most:.2f} "
                f"{label} ulps of the reference's",
                f"a reduction in {label} (cast to {label} before the all-reduce or reduce-scatter)",
            )
    return None


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
        float((_f64(by_name[n].ref_after) - _f64(by_name[n].ref_before)).abs().max()) for n in kept
    )
    if len(kept) == 1:
        subject = f"{kept[0]} kept its value"
    else:
        subject = f"{_plural(len(kept), 'parameter')} kept their values ({_names(kept)})"
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
    found: list[Cause] = []
    found += _initial_causes(evidence)
    diverged = [p for p in evidence.params if p.diverged]
    grads = {p.name: g for p in evidence.params if (g := p.gradients()) is not None}
    gross = [p.name for p in diverged if _is_gross(p, grads.get(p.name))]
    if not any(c.kind is CauseKind.WRONG_SHARD_SLICE for c in found):
        sliced = _slice_after_step(evidence, [p for p in diverged if p.name in gross])
        if sliced:
            found.append(sliced)
    never = _never_stepped_cause(evidence, _never_stepped(evidence, gross))
    if never:
        found.append(never)
    if gross:
        factor = _factor_cause(evidence, grads, gross)
        if factor:
            found.append(factor)
        else:
            per_slice = _per_slice_cause(evidence, grads)
            if per_slice:
                found.append(per_slice)
    else:
        low = _low_precision_cause(evidence, grads, [p.name for p in diverged])
        if low:
            found.append(low)
    return tuple(sorted(found, key=lambda c: _ORDER[c.kind]))


_ORDER = {kind: i for i, kind in enumerate(CauseKind)}


def rank_facts(evidence: StepEvidence, *, diverged: bool, digest: Any) -> RankFacts:
    """What this rank tells the others about its step (see ``_explain``).

    Args:
        evidence: this rank's numbers.
        diverged: the rule found a parameter (or the loss) diverged on this rank.
        digest: ``digest(tensor) -> str``, a digest of a tensor's bytes.
    """
    gross = gross_names(evidence)
    return RankFacts(
        rank=evidence.rank,
        diverged=diverged,
        gross=gross,
        order=tuple(p.name for p in evidence.params),
        kept=tuple(_never_stepped(evidence, gross)),
        initial_digest={p.name: digest(p.actual) for p in evidence.initial},
        initial_ref_digest={p.name: digest(p.reference) for p in evidence.initial},
        local=local_causes(evidence),
    )


# -- causes across ranks ------------------------------------------------------------------------


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
    return Cause(
        CauseKind.BACKWARD_STOPS,
        f"only the {_plural(n, 'parameter')} before {first_match} diverge "
        f"({_names(before)}){still}; "
        f"{first_match} and the {len(order) - n - 1} after it match",
        f"{reached}: a missing all-reduce (or send) of the backward's gradient at the layer of "
        f"{first_match}",
    )


def _some_ranks_cause(facts: Sequence[RankFacts]) -> Cause | None:
    wrong = [f.rank for f in facts if f.gross]
    right = [f.rank for f in facts if not f.diverged]
    if not wrong or not right:
        return None
    names = sorted({n for f in facts for n in f.gross}, key=facts[0].order.index)
    verb = "diverges" if len(wrong) == 1 else "diverge"
    agree = "matches" if len(right) == 1 else "match"
    return Cause(
        CauseKind.SOME_RANKS_ONLY,
        f"only {_rank_list(wrong)} {verb} ({_names(names)}); {_rank_list(right)} {agree} the "
        "reference",
        "a result that reached only some ranks (a reduce, gather or send where an all-reduce or "
        "all-gather was meant)",
    )


def _apart_cause(
    facts: Sequence[RankFacts], initial: Mapping[str, Sequence[torch.Tensor]]
) -> Cause | None:
    apart = []
    for name, values in initial.items():
        first = _f64(values[0])
        worst, who = 0.0, 0
        for rank, value in enumerate(values[1:], start=1):
            if value.shape != values[0].shape:
                worst, who = float("inf"), rank
                break
            diff = float((_f64(value) - first).abs().max()) if first.numel() else 0.0
            if diff > worst:
                worst, who = diff, rank
        slack = float(_slack(values[0]).max()) if values[0].numel() else 0.0
        if worst > slack:
            apart.append((name, worst, who))
    if not apart:
        return None
    order = facts[0].order
    apart.sort(key=lambda item: order.index(item[0]) if item[0] in order else len(order))
    name, worst, who = max(apart, key=lambda item: item[1])
    others = f" and {_plural(len(apart) - 1, 'other parameter')}" if len(apart) > 1 else ""
    return Cause(
        CauseKind.RANKS_STARTED_APART,
        f"before step 1 the ranks held different {name}{others} (rank {who}'s differs from "
        f"rank 0's by up to {worst:.3e}; the reference's is the same on every rank)",
        "ranks started from different initial weights (broadcast them from one rank, or seed "
        "every rank alike)",
    )


def _not_reduced_cause(
    facts: Sequence[RankFacts], grads: Mapping[str, Sequence[Gradients]]
) -> Cause | None:
    if len(facts) < 2 or not grads:
        return None
    names = [n for n in facts[0].order if n in grads]
    per_rank = [_concat(grads[n][r] for n in names) for r in range(len(facts))]
    if any(g is None for g in per_rank):
        return None
    ranks = [g for g in per_rank if g is not None]
    reference = ranks[0].reference
    ref_norm = _norm(reference)
    noise = max(_norm(g.noise) for g in ranks)
    spread = max(_norm(g.actual - ranks[0].actual) for g in ranks)
    if ref_norm == 0 or spread <= GROSS * ref_norm + 3 * noise:
        return None  # the ranks agree: a reduction happened, whatever else is wrong
    stacked = torch.stack([g.actual for g in ranks])
    for how, combined, bound in (
        ("average", stacked.mean(0), noise),
        ("sum", stacked.sum(0), noise * len(ranks)),
    ):
        off = _norm(combined - reference)
        if off <= GROSS * ref_norm + 3 * bound:
            what = (
                "each rank stepped on its own"
                if how == "average"
                else "each rank stepped on its partial sum (e.g. a tensor-parallel input's "
                "gradient)"
            )
            return Cause(
                CauseKind.GRADIENTS_NOT_REDUCED,
                f"the ranks' gradients of {_names(names)} differ from each other but {how} to the "
                f"reference's (within {off / ref_norm:.1e} relative)",
                f"gradients not all-reduced: {what}",
            )
    return None


def cross_rank_causes(
    facts: Sequence[RankFacts],
    *,
    initial: Mapping[str, Sequence[torch.Tensor]] | None = None,
    gradients: Mapping[str, Sequence[Gradients]] | None = None,
) -> tuple[Cause, ...]:
    """The causes only several ranks' numbers show, in :class:`CauseKind` order.

    Args:
        facts: every rank's :class:`RankFacts`, by rank.
        initial: for each parameter that differed across ranks before step 1 (where the
            reference's did not), every rank's value.
        gradients: for each grossly diverging parameter, every rank's :class:`Gradients`.
    """
    found = [
        _apart_cause(facts, initial or {}),
        _some_ranks_cause(facts),
        _prefix_cause(facts),
        _not_reduced_cause(facts, gradients or {}),
    ]
    return tuple(c for c in found if c is not None)


def merge_causes(cross: Sequence[Cause], facts: Sequence[RankFacts]) -> tuple[Cause, ...]:
    """One list for every rank: the cross-rank causes, and of each kind of local cause the
    lowest rank's (named with its ranks when not every diverging rank found it), in
    :class:`CauseKind` order.

    Args:
        cross: :func:`cross_rank_causes`.
        facts: every rank's :class:`RankFacts`.
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
            cause = dataclasses.replace(cause, evidence=f"on {_rank_list(ranks)}: {cause.evidence}")
        chosen[kind] = cause
    if CauseKind.RANKS_STARTED_APART in chosen:
        chosen.pop(CauseKind.INITIAL_STATE_DIFFERS, None)  # the same fact, seen per rank
    return tuple(sorted(chosen.values(), key=lambda c: _ORDER[c.kind]))


# -- sharded parameters (check_sharded_parity) --------------------------------------------------


def shard_causes(
    shards: Sequence[tuple[str, torch.Tensor, torch.Tensor, int]],
    grads: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
    *,
    rank: int,
    world_size: int,
) -> tuple[Cause, ...]:
    """The causes one rank's local shards support, against the replicated reference.

    Args:
        shards: for each diverging parameter: name, the reference's full value, this rank's
            local shard, and the dim it is sharded on (chunk ``rank`` of ``world_size``).
        grads: for each gradient: name, the expected local gradient and this rank's; all of
            them, diverging or not.
        rank: this rank's coordinate on the sharded mesh dim.
        world_size: that dim's size.
    """
    found: list[Cause] = []
    for name, full, local, dim in shards:
        if full.dim() <= dim:
            continue
        spans = _spans(full.shape[dim], world_size)
        unit = _DIM_UNITS.get(dim, f"indices along dim {dim}")
        expected = spans[rank]
        for other, (start, end) in enumerate(spans):
            if other == rank or end - start != local.shape[dim] or end == start:
                continue
            candidate = full.narrow(dim, start, end - start).detach().cpu()
            if torch.equal(candidate, local.detach().cpu()):
                where = _span_text(expected, unit) if expected[1] > expected[0] else "no rows"
                found.append(
                    Cause(
                        CauseKind.WRONG_SHARD_SLICE,
                        f"rank {rank}'s shard of {name} equals the reference's "
                        f"{_span_text((start, end), unit)}, expected {where}",
                        "a shard taken from the wrong rank's slice",
                    )
                )
                break
        if found:
            break
    pairs = {
        name: Gradients(
            _f64(expected), _f64(actual), torch.zeros(expected.numel(), dtype=torch.float64)
        )
        for name, expected, actual in grads
        if expected.shape == actual.shape
    }
    diverging = [
        name
        for name, g in pairs.items()
        if _norm(g.actual - g.reference) > GROSS * _norm(g.reference)
    ]
    params = tuple(
        ParamStep(name=name, ref_before=e, ref_after=e, before=e, after=a, diverged=True)
        for name, e, a in grads
    )
    evidence = StepEvidence(step=0, rank=rank, world_size=world_size, params=params)
    if diverging:
        factor = _factor_cause(evidence, pairs, diverging)
        if factor:
            found.append(factor)
    elif pairs:
        differing = [n for n, g in pairs.items() if not torch.equal(g.actual, g.reference)]
        low = _low_precision_cause(evidence, pairs, differing)
        if low:
            found.append(low)
    return tuple(sorted(found, key=lambda c: _ORDER[c.kind]))


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
