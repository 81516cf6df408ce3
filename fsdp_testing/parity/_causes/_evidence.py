"""The evidence the causes read, and the causes themselves: typed values, no analysis (see
[Note: likely causes] in ``__init__``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ._math import Gradients, f64, ulp
from ._mesh import MeshShards


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
        rb, ra = f64(self.ref_before), f64(self.ref_after)
        b, a = f64(self.before), f64(self.after)
        scale = rule.lr * rule.gain
        sign = 1.0 if rule.maximize else -1.0
        delta_update = (a - b) - (ra - rb)
        delta = sign * delta_update / scale - rule.weight_decay * (b - rb)
        reference = grad.detach().to("cpu", wide).reshape(-1)
        dtype = self.after.dtype if self.after.is_floating_point() else torch.float32
        # The parameters' rounding, then the optimizer's own: the gradient and the momentum
        # buffer (as large as an update / lr) are rounded to ``dtype`` on each side.
        rounding = 0.5 * (ulp(a, dtype) + ulp(ra, dtype)) / scale
        buffers = ((a - b).abs() + (ra - rb).abs()) / rule.lr + reference.abs()
        arithmetic = 2 * ulp(buffers, dtype) / rule.gain
        # What the earlier steps' tolerated differences left in the momentum buffers.
        history = 0.0 if rule.first_step else 2.0 * rule.momentum / scale
        noise = rounding + arithmetic + history * (b - rb).abs()
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
        mesh: the device mesh the code ran on and its parameters' splits (default None: each
            parameter is cut into ``world_size`` chunks; see [Note: shards on a mesh]).
    """

    step: int
    rank: int
    world_size: int
    accum_steps: int = 1
    params: tuple[ParamStep, ...] = ()
    initial: tuple[InitialPair, ...] = ()
    mesh: MeshShards | None = None


class SliceFinding(NamedTuple):
    """Chunks of a parameter (or of the flat parameters) that equal other chunks of the
    reference's: what a wrong-slice cause says, before it names the ranks that hold them."""

    where: str
    """When it was seen: ``"before step 1, "``, ``"at step 2, "``."""
    how: str
    """``"equals"``, or ``"stepped from"``."""
    name: str | None
    """The parameter (None: the flat parameters)."""
    unit: str
    """``"rows"``, ``"columns"``, ``"elements"``, ..."""
    spans: tuple[tuple[int, int], ...]
    """``[start, end)`` of each chunk."""
    moved: tuple[tuple[int, int], ...]
    """``(i, j)``: chunk ``i`` equals the reference's chunk ``j``."""


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
        slice: what its wrong-slice cause read, for the ranks to name it together on a mesh.
    """

    rank: int
    diverged: bool
    gross: tuple[str, ...] = ()
    order: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    initial_digest: Mapping[str, str] = dataclasses.field(default_factory=dict)
    initial_ref_digest: Mapping[str, str] = dataclasses.field(default_factory=dict)
    local: tuple[Cause, ...] = ()
    slice: SliceFinding | None = None


ORDER = {kind: i for i, kind in enumerate(CauseKind)}
