"""Parity for a user's own sharded-training code: their model factory, their wrapping (or step)
function and a reference, trained in lockstep by the same trainer as ``check_fsdp_parity``
(:class:`Lockstep` over two :class:`TrainingLoop` s), with no engine adapter.

[Note: the user's reference]
Data parallel training on ``W`` ranks, each rank ``r`` with its own batch ``b_r`` and the
gradients averaged, is gradient descent on ``(L(b_0) + ... + L(b_{W-1})) / W``, whatever the
loss and the batch structure are. The two references compute exactly that:

- ``"ddp"``: the model in ``DistributedDataParallel`` over the group, each rank on its own
  batch (DDP averages: pre-divide by ``W``, sum).
- ``"local"``: the plain model on every rank, with no communication: each forward runs the
  model on every rank's batch in turn (``get_batch(i, r)`` for ``r`` in ``0 .. W-1``) and
  backpropagates the mean of the ``W`` losses. Running the ranks' batches separately rather than
  concatenated keeps the equivalence for any loss (a sum as well as a mean), any batch structure
  and unequal batch sizes, and for layers whose output depends on the whole batch (batch norm
  statistics are per rank, as under DDP without ``SyncBatchNorm``). Its cost is ``W`` forwards
  per step on each rank. The loss it reports on rank ``r`` is ``L(b_r)``, the loss the code
  under test computes there.

Both are bitwise equal to a correct implementation at world size 2 on the CPU when it averages
as DDP does (every gradient element is a sum of two halves, which is order independent); at
larger worlds the summation order differs and [Note: parity rule]'s ``FP32_TOLERANCE`` applies.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ..engines import clean_param_name
from ..engines._base import default_process_group
from ..models._base import resolve_device
from ._compare import FP32_TOLERANCE, ParityRule, Tolerance, compare_named, format_divergences
from ._lockstep import Lockstep, StepReport, raise_on_divergence
from ._mesh import MeshLayout, full_state_of, shard_lines
from ._reference import build_reference
from ._training import TrainingLoop

__all__ = ["REFERENCES", "UserLockstep", "check_parity", "mean_square_loss"]

#: The references :func:`check_parity` trains against. See [Note: the user's reference].
REFERENCES = ("ddp", "local")

_API = "check_parity"


def _sgd_momentum(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # SGD with momentum: Adam is scale invariant, which hides gradient-scaling bugs.
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def mean_square_loss(model: Any, batch: Any) -> torch.Tensor:
    """The default loss: the model called with the batch (a tensor as ``model(batch)``, a tuple
    or list as ``model(*batch)``, a dict as ``model(**batch)``), then the sum over the floating
    point tensors of its output of their mean square."""
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, tuple | list):
        output = model(*batch)
    else:
        output = model(batch)
    floats = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.is_floating_point()]
    if not floats:
        raise TypeError(
            f"{_API}: the model's output holds no floating point tensor for the default loss; "
            "pass loss_fn=lambda model, batch: ... returning the scalar loss"
        )
    loss = floats[0].float().pow(2).mean()
    for tensor in floats[1:]:
        loss = loss + tensor.float().pow(2).mean()
    return loss


def _build(build_model: Callable[[], nn.Module], seed: int) -> nn.Module:
    # The same seed for both builds: a factory that does not seed gives equal models anyway.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{_API}: build_model() returned {type(model).__name__}, not an nn.Module; "
            "return a new unwrapped model"
        )
    return model


def _match_name(name: str, names: set[str]) -> str:
    """``name`` without the leading parts a wrapper adds (``module.``, FSDP1's
    ``_fsdp_wrapped_module``), as found in ``names``; unchanged when nothing matches."""
    clean = clean_param_name(name)
    parts = clean.split(".")
    for start in range(len(parts)):
        candidate = ".".join(parts[start:])
        if candidate in names:
            return candidate
    return clean


def _validate_names(
    reference: list[tuple[str, torch.Tensor]],
    wrapped: list[tuple[str, torch.Tensor]],
    custom: bool,
    layout: MeshLayout | None = None,
) -> None:
    expected = {name: tuple(t.shape) for name, t in reference}
    actual = {name: tuple(t.shape) for name, t in wrapped}
    missing = sorted(expected.keys() - actual.keys())
    unexpected = sorted(actual.keys() - expected.keys())
    reshaped = sorted(n for n in expected.keys() & actual.keys() if expected[n] != actual[n])
    if not (missing or unexpected or reshaped):
        return
    lines = []
    if missing:
        lines.append(f"missing: {', '.join(missing)}")
    if unexpected:
        lines.append(f"not in the model: {', '.join(unexpected)}")
    if reshaped:
        lines.append(
            "other shapes: " + ", ".join(f"{n} {actual[n]} (model {expected[n]})" for n in reshaped)
        )
    fix = (
        "return every parameter under the model's own name, full (unsharded)"
        if custom
        else "pass full_state=lambda wrapped: {name: full tensor} with the model's parameter "
        "names (a wrapper that keeps flat or sharded parameters must gather them)"
    )
    if layout is not None and reshaped and not custom:  # what the layout's gathers did
        said = [layout.shape_mismatch(n, actual[n], expected[n]) for n in reshaped]
        fix = "; ".join(said) + "; or " + fix
    source = "full_state(wrapped)" if custom else "the wrapped model's parameters"
    raise ValueError(
        f"{_API}: {source} do not match the model's parameters ({'; '.join(lines)}); {fix}"
    )


def check_parity(
    build_model: Callable[[], nn.Module],
    wrap: Callable[[nn.Module, dist.ProcessGroup], Any] | None,
    get_batch: Callable[[int, int], Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    reference: str = "ddp",
    loss_fn: Callable[[Any, Any], torch.Tensor] = mean_square_loss,
    step_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    make_optimizer: Callable[[Iterable[nn.Parameter]], Any] = _sgd_momentum,
    wrapped_optimizer: Callable[[Any], Any] | None = None,
    full_state: Callable[[Any], Mapping[str, torch.Tensor]] | None = None,
    num_steps: int = 3,
    accum_steps: int = 1,
    device: torch.device | str | None = None,
    exact: bool = False,
    tolerance: Tolerance = FP32_TOLERANCE,
    seed: int = 0,
    mesh: Any = None,
    dp_dims: str | int | Sequence[str | int] | None = None,
    layout: Mapping[str, int | tuple[int, str | int]] | None = None,
) -> tuple[StepReport, ...]:
    """Trains a user's own sharded or data parallel code and a reference in lockstep on the
    same batches, compares the loss and every full parameter after every optimizer step, and
    raises ``AssertionError`` on every rank at the first step that diverged, naming the step,
    both losses and each diverging parameter with its largest absolute difference. Every rank
    of the group must call it. See [Note: the user's reference].

    Args:
        build_model: ``build_model()``, a new unwrapped ``nn.Module``; called twice (the model
            under test and the reference) under ``torch.manual_seed(seed)``, which must make
            them equal.
        wrap: ``wrap(module, process_group)``, the user's wrapping, returning what is trained:
            called like the module (by ``loss_fn``). None: the module itself is trained
            (then ``step_fn`` does the distributed part).
        get_batch: ``get_batch(i, rank)``, the batch of ``rank`` (with ``mesh``: of the
            data-parallel rank, see [Note: model-parallel parity]) for the ``i``-th forward
            (0-based; with ``accum_steps`` forwards per optimizer step, step ``s`` uses ``i =
            s * accum_steps ... (s + 1) * accum_steps - 1``), of any structure (a tensor, a
            tuple, a dict, nested); its tensors are moved to ``device``. Must return the same
            batch for the same arguments.
        process_group: the ranks that train (default: the default group).
        reference: ``"ddp"`` (``DistributedDataParallel``, default) or ``"local"`` (one
            process per rank, no communication, every rank's batch; see the Note).
        loss_fn: ``loss_fn(model, batch)``, forward and scalar loss of one batch (default
            :func:`mean_square_loss`); used for both models.
        step_fn: ``step_fn(wrapped, batch)``, the user's forward, loss and backward of one
            batch, returning the loss (default: ``loss_fn`` and ``loss.backward()``); with
            ``accum_steps > 1`` it must backpropagate ``loss / accum_steps``, as the
            reference does. The reference always uses ``loss_fn``.
        make_optimizer: ``make_optimizer(params)``, the reference's optimizer, and the wrapped
            model's over ``wrapped.parameters()`` unless ``wrapped_optimizer`` is given
            (default SGD, lr 0.01, momentum 0.9: Adam would hide a gradient scaled by a
            constant).
        wrapped_optimizer: ``wrapped_optimizer(wrapped)``, what steps the wrapped model, with
            ``step()`` and ``zero_grad()``, for code that shards the optimizer itself (ZeRO)
            (default None: ``make_optimizer(wrapped.parameters())``).
        full_state: ``full_state(wrapped)``, the wrapped model's full parameters by the
            model's own names, for code that renames, flattens or shards them (default: the
            wrapped model's ``named_parameters()`` with leading wrapper parts such as
            ``module.`` dropped).
        num_steps: optimizer steps (default 3).
        accum_steps: forwards and backwards per optimizer step; each backpropagates its loss
            divided by ``accum_steps`` (default 1).
        device: where both models and the batches go (default: CUDA if available, else CPU).
        exact: demand bitwise equality (default False: ``tolerance``).
        tolerance: ``(rtol, atol)`` for losses and parameters (default ``FP32_TOLERANCE``).
        seed: the seed of both builds (default 0).
        mesh: the ``DeviceMesh`` model-parallel code runs on (default None: data parallel
            code over ``process_group``). See [Note: model-parallel parity].
        dp_dims: the mesh dims that split the batch (names or indices; default none: every
            rank trains on the same batch, the reference on it alone).
        layout: for plain parameters split across the other dims (not DTensors): name -> the
            dim they are split on (see :func:`layout_from_plan`), or ``(dim, mesh_dim)`` for
            one split across one mesh dim's ranks (experts across expert-parallel ranks);
            DTensor parameters need none.

    Returns:
        one :class:`StepReport` per step (this rank's losses and differences).
    """
    if num_steps < 1 or accum_steps < 1:
        raise ValueError(
            f"{_API}: num_steps={num_steps} and accum_steps={accum_steps} must be at least 1"
        )
    run = UserLockstep.build(
        build_model,
        wrap,
        get_batch,
        process_group=process_group,
        reference=reference,
        loss_fn=loss_fn,
        step_fn=step_fn,
        make_optimizer=make_optimizer,
        wrapped_optimizer=wrapped_optimizer,
        full_state=full_state,
        accum_steps=accum_steps,
        device=device,
        exact=exact,
        tolerance=tolerance,
        seed=seed,
        mesh=mesh,
        dp_dims=dp_dims,
        layout=layout,
    )
    reports = []
    for _ in range(num_steps):
        report = run.step()
        run.raise_on_divergence(report, num_steps=num_steps)
        reports.append(report)
    return tuple(reports)


class UserLockstep:
    """:func:`check_parity`'s trainer, built and not yet trained: the user's code and its
    reference in one :class:`Lockstep`, with where the failure report comes from. ``check_parity``
    steps it ``num_steps`` times; ``fsdp-testing check`` and ``trace`` step it in their
    model-parallel rows (see [Note: model-parallel rows] in ``fsdp_testing/cli/_parallel.py``),
    so the library and the command line share one trainer. Build it with :meth:`build`.

    Args:
        lockstep: the reference's and the wrapped model's training loops.
        group: the ranks that train (they agree on every verdict).
        where: the check, as failures name it.
        reference_name: the reference, as failures name it.
        details: the per-shard lines of a divergence (a collective; None without a mesh).
    """

    def __init__(
        self,
        lockstep: Lockstep,
        *,
        group: dist.ProcessGroup,
        where: str,
        reference_name: str,
        details: Callable[[StepReport], list[str]] | None,
    ) -> None:
        self.lockstep = lockstep
        self.group = group
        self.where = where
        self.reference_name = reference_name
        self._details = details

    @property
    def wrapped(self) -> Any:
        """What ``wrap`` returned (the module when ``wrap`` is None): what is trained."""
        return self.lockstep.sharded.model

    @classmethod
    def build(
        cls,
        build_model: Callable[[], nn.Module],
        wrap: Callable[[nn.Module, dist.ProcessGroup], Any] | None,
        get_batch: Callable[[int, int], Any],
        *,
        process_group: dist.ProcessGroup | None = None,
        reference: str = "ddp",
        loss_fn: Callable[[Any, Any], torch.Tensor] = mean_square_loss,
        step_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        make_optimizer: Callable[[Iterable[nn.Parameter]], Any] = _sgd_momentum,
        wrapped_optimizer: Callable[[Any], Any] | None = None,
        full_state: Callable[[Any], Mapping[str, torch.Tensor]] | None = None,
        accum_steps: int = 1,
        device: torch.device | str | None = None,
        exact: bool = False,
        tolerance: Tolerance = FP32_TOLERANCE,
        seed: int = 0,
        mesh: Any = None,
        dp_dims: str | int | Sequence[str | int] | None = None,
        layout: Mapping[str, int | tuple[int, str | int]] | None = None,
    ) -> UserLockstep:
        """Builds both models, wraps one, and checks that they start equal and name the same
        parameters. The arguments are :func:`check_parity`'s (less ``num_steps``).

        Raises:
            ValueError: an argument is out of range, or the two builds or their parameter names
                differ (the message names the argument and the fix).
            TypeError: what ``wrap`` returned cannot be read or optimized without
                ``full_state`` / ``wrapped_optimizer``.
        """
        if wrap is None and step_fn is None:
            raise ValueError(
                f"{_API}: wrap=None and step_fn=None leave none of your code to test; pass your "
                "wrapping function wrap(module, process_group), your step function "
                "step_fn(model, batch), or both"
            )
        if reference not in REFERENCES:
            raise ValueError(
                f"{_API}: unknown reference {reference!r}; valid: "
                f"{', '.join(map(repr, REFERENCES))}"
            )
        if accum_steps < 1:
            raise ValueError(f"{_API}: accum_steps={accum_steps} must be at least 1")
        if mesh is None and (dp_dims is not None or layout is not None):
            raise ValueError(
                f"{_API}: dp_dims and layout describe a device mesh; pass mesh=<the DeviceMesh the "
                "code runs on> as well"
            )
        group = process_group if process_group is not None else default_process_group()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        target = resolve_device(device)
        place = MeshLayout(mesh, dp_dims, layout) if mesh is not None else None
        # See [Note: model-parallel parity]: the batch follows the data-parallel coordinate.
        data_rank = place.dp_rank if place is not None else rank
        data_world = place.dp_world if place is not None else world
        ref_group = group if place is None else place.dp_group()
        if ref_group is None:
            reference = "local"  # one replica on every rank: nothing to run DDP over

        plain = _build(build_model, seed).to(target)
        under_test = _build(build_model, seed).to(target)
        different = compare_named(
            list(plain.state_dict().items()), list(under_test.state_dict().items()), exact=True
        )
        if different:
            raise ValueError(
                f"{_API}: two calls of build_model() under torch.manual_seed({seed}) gave "
                f"different models:\n{format_divergences(different)}\nbuild the model "
                "deterministically (no other random source than torch's global generator)"
            )
        ref_names = {name for name, _ in plain.named_parameters()}

        def on_device(batch: Any) -> Any:
            return tree_map(lambda t: t.to(target) if torch.is_tensor(t) else t, batch)

        wrapped = wrap(under_test, group) if wrap is not None else under_test
        state: Callable[[Any], Mapping[str, torch.Tensor]]
        if full_state is None:
            if not isinstance(wrapped, nn.Module):
                raise TypeError(
                    f"{_API}: wrap returned {type(wrapped).__name__}, not an nn.Module, so its "
                    "parameters cannot be read; pass full_state=lambda wrapped: {name: full "
                    "tensor} and wrapped_optimizer=lambda wrapped: its optimizer"
                )
            module = wrapped

            def named_like_model(_: Any) -> dict[str, torch.Tensor]:
                return full_state_of(module, place, lambda n: _match_name(n, ref_names))

            state = named_like_model
        else:
            state = full_state
        if wrapped_optimizer is not None:
            optimizer = wrapped_optimizer(wrapped)
        elif isinstance(wrapped, nn.Module):
            optimizer = make_optimizer(wrapped.parameters())
        else:
            raise TypeError(
                f"{_API}: wrap returned {type(wrapped).__name__}, which has no parameters() to "
                "optimize; pass wrapped_optimizer=lambda wrapped: the optimizer that steps it"
            )
        under_test_loop = TrainingLoop(
            wrapped,
            batches=lambda i: on_device(get_batch(i, data_rank)),
            loss_fn=loss_fn,
            step_fn=step_fn,
            optimizer=optimizer,
            accum_steps=accum_steps,
            full_state=state,
            device=target,
        )
        if reference == "ddp":
            assert ref_group is not None  # a mesh with no data-parallel dim trains "local"
            ddp, _ = build_reference(plain, process_group=ref_group, device=target)
            reference_loop = TrainingLoop(
                ddp,
                batches=lambda i: on_device(get_batch(i, data_rank)),
                loss_fn=loss_fn,
                optimizer=make_optimizer(ddp.parameters()),
                accum_steps=accum_steps,
                device=target,
            )
            reference_name = "DistributedDataParallel"
        else:

            def every_rank(model: Any, batches: list[Any]) -> torch.Tensor:
                # See [Note: the user's reference]
                losses = [loss_fn(model, batch) for batch in batches]
                total = losses[0]
                for loss in losses[1:]:
                    total = total + loss
                (total / (data_world * accum_steps)).backward()
                return losses[data_rank]

            reference_loop = TrainingLoop(
                plain,
                batches=lambda i: [on_device(get_batch(i, r)) for r in range(data_world)],
                step_fn=every_rank,
                optimizer=make_optimizer(plain.parameters()),
                accum_steps=accum_steps,
                device=target,
            )
            batches = f"the batches of all {data_world} ranks"
            if data_world == 1:  # one data-parallel rank: every rank trains on its batches
                batches = "the same batches as the ranks"
            reference_name = f"local: one process, {batches}"
        _validate_names(
            reference_loop.named_full_params(),
            under_test_loop.named_full_params(),
            custom=full_state is not None,
            layout=place,
        )
        rule = ParityRule(exact=exact, loss=tolerance, params=tolerance)
        shards = (
            place.shards(group, wrapped, lambda n: _match_name(n, ref_names)) if place else None
        )
        lockstep = Lockstep(reference_loop, under_test_loop, rule=rule, mesh=shards)
        details: Callable[[StepReport], list[str]] | None = None
        if place is not None and isinstance(wrapped, nn.Module):
            layout_of = place

            def shard_details(report: StepReport) -> list[str]:
                return shard_lines(
                    wrapped,
                    layout_of,
                    lambda n: _match_name(n, ref_names),
                    dict(reference_loop.named_full_params()),
                    [d.name for d in report.divergences],
                    tolerance,
                )

            details = shard_details
        return cls(
            lockstep,
            group=group,
            where=f"{_API}[{type(wrapped).__name__}, reference {reference}]",
            reference_name=reference_name,
            details=details,
        )

    def step(
        self, *, around_wrapped: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    ) -> StepReport:
        """Trains the reference one step, then the user's code, and compares them.

        Args:
            around_wrapped: a context manager factory entered around the user's code's step
                only (``fsdp-testing check`` counts its collectives and times it there).
        """
        return self.lockstep.step(around_sharded=around_wrapped)

    def details(self, report: StepReport) -> list[str]:
        """On a mesh, for each tensor that diverged in ``report``, the mesh coordinates whose
        shards differ from the reference's (a collective over the world: every rank calls it
        after the same step); empty without a mesh."""
        return self._details(report) if self._details is not None else []

    def raise_on_divergence(self, report: StepReport, *, num_steps: int) -> None:
        """Raises ``AssertionError`` on every rank if any rank's ``report`` diverged (a
        collective: see :func:`raise_on_divergence`).

        Args:
            report: this rank's step.
            num_steps: the steps the check trains (for the message).
        """
        raise_on_divergence(
            report,
            where=self.where,
            reference=self.reference_name,
            num_steps=num_steps,
            group=self.group,
            subject="wrapped",
            causes=functools.partial(self.lockstep.explain, report, group=self.group),
            details=None if self._details is None else functools.partial(self._details, report),
        )
