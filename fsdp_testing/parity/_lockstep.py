"""Lockstep parity: a sharded model and its data parallel reference trained side by side and
compared after every step (:class:`Lockstep`), and torch's ``_test_fsdp_parity`` on top of it
(:func:`check_fsdp_parity`). ``fsdp-testing check`` and the core's tests train with the same
:class:`Lockstep`.

[Note: lockstep parity]
torch's ``_test_fsdp_parity`` trains the reference for N steps, then the sharded model for N
steps, and compares once at the end. Here both train in lockstep and are compared after every
step, under [Note: parity rule], so a failure names the first step that diverged, each diverging
parameter and its largest absolute difference. Every rank learns every other rank's verdict (one
``all_gather_object`` per step) and all raise together: a rank that diverged alone (a per-rank
expert) cannot leave the others blocked in the next step's collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._report.text import add_note
from ..engines import FSDPEngine, resolve_engine, use_engine
from ..engines._base import default_process_group
from ..models import (
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTestModel,
    as_device_init_mode,
    as_fsdp_init_mode,
)
from ..models._base import resolve_device
from ..patching import rank_prefix
from ._causes import Cause, MeshShards, format_causes
from ._compare import Divergence, ParityRule, format_divergences, max_abs_diff
from ._explain import History, explain
from ._reference import build_reference, reference_body
from ._training import TrainingLoop

__all__ = ["Lockstep", "StepReport", "check_fsdp_parity", "raise_on_divergence"]


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One lockstep step: both losses, what diverged and by how much."""

    step: int
    """1-based."""
    ref_loss: torch.Tensor
    loss: torch.Tensor
    divergences: tuple[Divergence, ...]
    """The loss's divergence (if any), then each parameter's (see :class:`ParityRule`)."""
    loss_diff: float
    """``|loss - reference loss|``."""
    param_diff: float | None
    """The largest absolute difference of any full parameter (None: not compared)."""


class Lockstep:
    """A sharded model and its reference, trained side by side and compared after every step
    (see [Note: lockstep parity]). Build it with :meth:`build`, or from two loops.

    Args:
        reference: the reference's training loop.
        sharded: the sharded model's training loop.
        rule: what the comparison allows.
        mesh: the device mesh the code under test runs on and how its parameters are split,
            for the likely causes (default None: each cut into one chunk per rank).
    """

    def __init__(
        self,
        reference: TrainingLoop,
        sharded: TrainingLoop,
        *,
        rule: ParityRule,
        mesh: MeshShards | None = None,
    ):
        self.reference = reference
        self.sharded = sharded
        self.rule = rule
        self.mesh = mesh
        self.steps_done = 0
        # See [Note: keeping the evidence] in ``_explain``.
        self.history = History()

    @classmethod
    def build(
        cls,
        model_class: type[FSDPTestModel],
        *,
        process_group: dist.ProcessGroup,
        engine: FSDPEngine,
        fsdp_kwargs: dict[str, Any],
        device: torch.device | str | None = None,
        fsdp_init_mode: FSDPInitMode = FSDPInitMode.RECURSIVE,
        device_init_mode: DEVICEInitMode = DEVICEInitMode.DEVICE_BEFORE,
        ref_init_fn: Callable[[nn.Module], nn.Module] | None = None,
        init_kwargs: dict[str, Any] | None = None,
        lr: float = 0.01,
        enable_sharded_grad_scaler: bool = False,
        use_pure_fp16: bool = False,
        sharded_grad_scaler_kwargs: dict[str, Any] | None = None,
        exact: bool = False,
    ) -> Lockstep:
        """Builds ``model_class`` twice from the same seed (``deterministic=True``): sharded by
        ``engine`` with ``fsdp_kwargs`` (the root too, if ``init()`` left it plain), and as the
        reference (see ``build_reference`` and [Note: mixed precision parity]).

        Args:
            model_class: an :class:`FSDPTestModel` class.
            process_group: the group both models train over.
            engine: the engine that shards.
            fsdp_kwargs: engine options (``cpu_offload`` and ``mixed_precision`` also shape the
                training loops and the rule).
            device: the compute device, default CUDA if available else CPU.
            fsdp_init_mode: how ``init()`` shards; must not be ``NO_FSDP`` (default
                ``RECURSIVE``).
            device_init_mode: when the sharded model moves to ``device`` (default
                ``DEVICE_BEFORE``).
            ref_init_fn: makes the reference data parallel (default: DDP over the group).
            init_kwargs: extra ``model_class.init`` keyword arguments.
            lr: learning rate (default 0.01).
            enable_sharded_grad_scaler: scale losses with ``ShardedGradScaler``.
            use_pure_fp16: convert both models to fp16.
            sharded_grad_scaler_kwargs: extra ``ShardedGradScaler`` arguments.
            exact: compare bitwise (default False: [Note: parity rule]'s tolerances).
        """
        if as_fsdp_init_mode(fsdp_init_mode) is FSDPInitMode.NO_FSDP:
            raise ValueError(
                "_test_fsdp_parity: fsdp_init_mode=NO_FSDP builds no sharded model; use RECURSIVE"
            )
        placement = as_device_init_mode(device_init_mode)
        target = resolve_device(device)
        init_kwargs = dict(init_kwargs or {})
        mixed_precision = fsdp_kwargs.get("mixed_precision")
        plain = model_class.init(
            process_group,
            FSDPInitMode.NO_FSDP,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
            **init_kwargs,
        )
        reference, after_backward = build_reference(
            plain,
            process_group=process_group,
            device=target,
            ref_init_fn=ref_init_fn,
            mixed_precision=mixed_precision,
            use_pure_fp16=use_pure_fp16,
        )
        with use_engine(engine):
            try:
                model = model_class.init(
                    process_group,
                    fsdp_init_mode,
                    placement,
                    fsdp_kwargs,
                    deterministic=True,
                    **init_kwargs,
                )
            except Exception as error:
                # Keep the engine's own exception (its type says what kind of mistake it is);
                # say which model and engine it came from.
                add_note(
                    error,
                    f"while initializing {model_class.__name__} with engine {engine.name!r} "
                    f"(fsdp_init_mode={fsdp_init_mode}, kwargs={fsdp_kwargs})",
                )
                raise
            if not engine.is_wrapped(model):
                # The reference is data parallel over the whole model: shard the root too.
                model = engine.wrap(model, process_group, **fsdp_kwargs)
        if use_pure_fp16:
            model = model.half()
        if placement is DEVICEInitMode.DEVICE_AFTER:
            model = model.to(target)
        common: dict[str, Any] = dict(
            lr=lr,
            fsdp_cpu_offload=fsdp_kwargs.get("cpu_offload"),
            mixed_precision=mixed_precision,
            enable_sharded_grad_scaler=enable_sharded_grad_scaler,
            use_pure_fp16=use_pure_fp16,
            sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs,
            device=target,
        )
        return cls(
            TrainingLoop(reference, after_backward=after_backward, **common),
            TrainingLoop(model, engine=engine, **common),
            rule=ParityRule.for_training(mixed_precision, exact=exact, use_pure_fp16=use_pure_fp16),
        )

    def step(
        self,
        *,
        save_model: bool = False,
        around_sharded: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> StepReport:
        """Trains the reference one step, then the sharded model, and compares them.

        Args:
            save_model: save, zero and reload the sharded model's state dict after its step.
            around_sharded: a context manager factory entered around the sharded model's step
                only (``fsdp-testing check`` counts collectives and times the step in it).
        """
        compare_params = self.rule.params is not None
        if compare_params and self.steps_done == 0:
            self.history.start(self.reference.named_full_params(), self.sharded.named_full_params())
        self.steps_done += 1
        ref_loss = self.reference.step()
        with around_sharded() if around_sharded is not None else contextlib.nullcontext():
            loss = self.sharded.step(save_model)
        ref_params = self.reference.named_full_params() if compare_params else []
        params = self.sharded.named_full_params() if compare_params else []
        if compare_params:
            self.history.record(self.steps_done, ref_params, params)
        return StepReport(
            step=self.steps_done,
            ref_loss=ref_loss,
            loss=loss,
            divergences=tuple(self.rule.divergences(ref_loss, loss, ref_params, params)),
            loss_diff=abs(float(loss) - float(ref_loss)),
            param_diff=max_abs_diff(ref_params, params) if compare_params else None,
        )

    def explain(self, report: StepReport, *, group: dist.ProcessGroup) -> tuple[Cause, ...]:
        """The likely causes of the last step's divergence (``report``, this rank's), the same
        list on every rank; empty where the numbers make none clear. A collective: every rank of
        ``group`` calls it after the same step. See [Note: likely causes] in ``_causes``.

        Args:
            report: this rank's report of the last step.
            group: the ranks that trained.
        """
        model = self.reference.model
        evidence = self.history.evidence(
            diverged=[d.name for d in report.divergences],
            reference_model=reference_body(model) if isinstance(model, nn.Module) else None,
            reference_optimizer=self.reference.optim,
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            accum_steps=self.sharded.accum_steps,
            mesh=self.mesh,
        )
        return explain(evidence, diverged=bool(report.divergences), group=group, mesh=self.mesh)


def _fail(message: str) -> AssertionError:
    return AssertionError(f"{rank_prefix()}{message}")


def _causes_section(causes: Callable[[], Sequence[Cause]]) -> str:
    """The report's likely causes; never in place of the divergence above it."""
    try:
        return format_causes(causes())
    except Exception as error:
        return (
            f"likely cause: the analysis failed ({type(error).__name__}: {error}); the "
            "divergence above stands"
        )


def _agree_on_failure(
    local: str | None,
    group: dist.ProcessGroup,
    where: str,
    causes: Callable[[], Sequence[Cause]] | None = None,
    details: Callable[[], Sequence[str]] | None = None,
) -> None:
    # See [Note: lockstep parity]
    verdicts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, local, group=group)
    failed = [r for r, verdict in enumerate(verdicts) if verdict is not None]
    if not failed:
        return
    section = ""
    if details is not None:  # a collective, like causes: every rank runs it
        lines = list(details())
        section += "".join(f"\n{line}" for line in lines)
    section += f"\n{_causes_section(causes)}" if causes is not None else ""
    if local is not None:
        raise _fail(local + section)
    raise _fail(
        f"{where}: no divergence on this rank, but ranks {failed} of the group diverged{section}"
    )


def raise_on_divergence(
    report: StepReport,
    *,
    where: str,
    reference: str,
    num_steps: int,
    group: dist.ProcessGroup,
    subject: str = "sharded",
    causes: Callable[[], Sequence[Cause]] | None = None,
    details: Callable[[], Sequence[str]] | None = None,
) -> None:
    """Raises ``AssertionError`` on every rank of ``group`` if ``report`` (this rank's step)
    or any other rank's diverged, naming the step, both losses and each diverging tensor (see
    [Note: lockstep parity]). A collective: every rank of ``group`` calls it each step.

    Args:
        report: this rank's step.
        where: the check, e.g. ``"_test_fsdp_parity[NestedWrappedModule, engine fsdp_core]"``.
        reference: the reference's name (its class).
        num_steps: the steps the check trains.
        group: the ranks that agree.
        subject: what is compared with the reference (default ``"sharded"``).
        causes: called on every rank when some rank diverged (a collective, e.g.
            ``lambda: lockstep.explain(report, group=group)``); its causes are added to the
            report as its "likely cause" section (default None: no section).
        details: called on every rank when some rank diverged (a collective); its lines go
            under the diverging tensors (default None: none).
    """
    local = None
    if report.divergences:
        local = (
            f"{where}: the {subject} model diverged from the reference ({reference}) at step "
            f"{report.step} of {num_steps} (losses: reference {report.ref_loss.item():.6g}, "
            f"{subject} {report.loss.item():.6g}); diverging tensors:\n"
            f"{format_divergences(report.divergences)}"
        )
    _agree_on_failure(local, group, where, causes, details)


def check_fsdp_parity(
    model_class: type[FSDPTestModel],
    fsdp_init_mode: FSDPInitMode,
    device_init_mode: DEVICEInitMode,
    ref_init_fn: Callable[[nn.Module], nn.Module] | None = None,
    num_iters: int = 2,
    save_model: bool = True,
    cpu_offload: Any = None,
    backward_prefetch: Any = None,
    sharding_strategy: Any = None,
    mixed_precision: Any = None,
    forward_prefetch: bool = False,
    use_orig_params: bool = False,
    enable_sharded_grad_scaler: bool = False,
    use_pure_fp16: bool = False,
    init_kwargs: dict[str, Any] | None = None,
    sharded_grad_scaler_kwargs: dict[str, Any] | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    engine: str | FSDPEngine | None = None,
    exact: bool = False,
    **fsdp_kwargs: Any,
) -> None:
    """Trains ``model_class`` sharded by ``engine`` and a data parallel reference in lockstep
    and raises ``AssertionError`` at the first step whose loss or full parameters differ.
    torch's ``FSDPTest._test_fsdp_parity`` (see [Note: lockstep parity]).

    Args:
        model_class: an :class:`FSDPTestModel` class; built with ``deterministic=True``.
        fsdp_init_mode: how ``init()`` shards; must not be ``NO_FSDP``. The root is wrapped
            by the engine if ``init()`` did not.
        device_init_mode: when the sharded model moves to ``device``.
        ref_init_fn: wraps the plain model into the reference (default: DDP over the group).
        num_iters: training steps (default 2).
        save_model: save, zero and reload the sharded model's state dict each step (default
            True).
        cpu_offload, backward_prefetch, sharding_strategy, mixed_precision, forward_prefetch,
            use_orig_params: engine options (defaults: the engine's, None, None, None, False,
            False). Under ``mixed_precision`` the reference runs the policy by hand (see [Note:
            mixed precision parity]); parameters are not compared under pure fp16.
        enable_sharded_grad_scaler: scale losses with ``ShardedGradScaler`` (default False).
        use_pure_fp16: convert both models to fp16 (default False).
        init_kwargs: extra ``model_class.init`` keyword arguments.
        sharded_grad_scaler_kwargs: extra ``ShardedGradScaler`` arguments.
        process_group: the group, default the default group.
        device: the compute device, default CUDA if available else CPU; when given it is also
            passed to ``init()`` as ``device=``.
        engine: engine name or instance, default :func:`~fsdp_testing.engines.current_engine`.
        exact: demand bitwise equality (default False: the tolerances of [Note: parity rule]).
        fsdp_kwargs: further engine options.
    """
    group = process_group if process_group is not None else default_process_group()
    chosen = resolve_engine(engine)
    target = resolve_device(device)
    init_kwargs = dict(init_kwargs or {})
    if device is not None:
        init_kwargs.setdefault("device", target)
    options: dict[str, Any] = dict(fsdp_kwargs)
    options.update(
        backward_prefetch=backward_prefetch,
        sharding_strategy=sharding_strategy,
        mixed_precision=mixed_precision,
        forward_prefetch=forward_prefetch,
        use_orig_params=use_orig_params,
    )
    if cpu_offload is not None:
        options["cpu_offload"] = cpu_offload
    lockstep = Lockstep.build(
        model_class,
        process_group=group,
        engine=chosen,
        fsdp_kwargs=options,
        device=target,
        fsdp_init_mode=fsdp_init_mode,
        device_init_mode=device_init_mode,
        ref_init_fn=ref_init_fn,
        init_kwargs=init_kwargs,
        enable_sharded_grad_scaler=enable_sharded_grad_scaler,
        use_pure_fp16=use_pure_fp16,
        sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs,
        exact=exact,
    )
    model = lockstep.sharded.model
    offload_params = bool(getattr(cpu_offload, "offload_params", False))
    expects_device_error = (
        offload_params
        and as_device_init_mode(device_init_mode) is DEVICEInitMode.DEVICE_AFTER
        and target.type != "cpu"
    )
    if offload_params and not expects_device_error:
        on_device = [n for n, p in model.named_parameters() if p.device.type != "cpu"]
        if on_device:
            raise _fail(f"CPU offloading is on but these parameters are not on CPU: {on_device}")
    if expects_device_error:
        lockstep.reference.step()
        try:
            lockstep.sharded.step(save_model)
        except RuntimeError:
            return
        raise _fail(
            "expected a RuntimeError for CPU offloading with a model moved to "
            f"{target} after wrapping, but step 1 ran"
        )
    where = f"_test_fsdp_parity[{model_class.__name__}, engine {chosen.name}]"
    ref_name = type(lockstep.reference.model).__name__
    for _ in range(num_iters):
        report = lockstep.step(save_model=save_model)
        raise_on_divergence(
            report,
            where=where,
            reference=ref_name,
            num_steps=num_iters,
            group=group,
            causes=functools.partial(lockstep.explain, report, group=group),
        )


_test_fsdp_parity = check_fsdp_parity
