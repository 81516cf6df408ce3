"""Parity checks: a sharded model against a data parallel reference, sharded parameters against
replicated ones, and module states across ranks.

[Note: lockstep parity]
torch's ``_test_fsdp_parity`` trains the reference for N steps, then the sharded model for N
steps, and compares once at the end. Here both train in lockstep and are compared after every
step, so a failure names the first step that diverged, each diverging parameter and its largest
absolute difference. Every rank learns every other rank's verdict (one ``all_gather_object``
per step) and all raise together: a rank that diverged alone (a per-rank expert) cannot leave the
others blocked in the next step's collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ._compare import Divergence, compare_named, format_divergences, rank_prefix
from .engines import (
    FSDPEngine,
    clean_param_name,
    current_engine,
    engine_for,
    get_engine,
    use_engine,
)
from .engines._base import default_process_group
from .models import (
    DEVICEInitMode,
    DummyDDP,
    FSDPInitMode,
    FSDPTestModel,
    as_device_init_mode,
    as_fsdp_init_mode,
)
from .models._base import resolve_device

__all__ = [
    "FSDPParityMixin",
    "_assert_module_states",
    "_test_fsdp_parity",
    "_train_for_several_steps",
    "assert_module_states_equal",
    "check_fsdp_parity",
    "check_sharded_parity",
    "get_full_params",
    "train_for_several_steps",
]


# -- helpers ------------------------------------------------------------------------------------


def _resolve_engine(engine: str | FSDPEngine | None) -> FSDPEngine:
    if engine is None:
        return current_engine()
    return get_engine(engine) if isinstance(engine, str) else engine


def _test_model(model: nn.Module) -> FSDPTestModel:
    """The :class:`FSDPTestModel` inside wrappers (DDP, FSDP1, ``DummyDDP``)."""
    inner: Any = model
    while not isinstance(inner, FSDPTestModel):
        inner = getattr(inner, "module", None)
        if not isinstance(inner, nn.Module):
            raise TypeError(
                f"{type(model).__name__} does not contain an FSDPTestModel (get_input, get_loss, "
                "run_backward); parity training needs one"
            )
    return inner


def _reference_body(model: nn.Module) -> nn.Module:
    while isinstance(model, (DistributedDataParallel, DummyDDP)):
        model = model.module
    return model


def _named_full_params(
    model: nn.Module, engine: FSDPEngine | None = None
) -> list[tuple[str, torch.Tensor]]:
    engine = engine if engine is not None else engine_for(model)
    if engine is not None:
        return engine.named_full_params(model)
    return [
        (clean_param_name(name), param.detach().clone())
        for name, param in _reference_body(model).named_parameters()
    ]


def get_full_params(model: nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    """Detached copies of the full (unsharded) parameters of ``model``, in
    ``model.parameters()`` order, for any engine (found with ``engine_for``) or a plain module.

    Args:
        model: a sharded or plain module.
        recurse: unshard submodules too (default True); False only the parameters that
            ``model`` itself manages.
    """
    engine = engine_for(model)
    if engine is None:
        return [param.detach().clone() for param in model.parameters()]
    with engine.full_params(model, recurse=recurse, writeback=False):
        return [param.detach().clone() for param in model.parameters()]


def _cast_floats(values: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...]:
    return tuple(
        v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values
    )


def _fail(message: str) -> AssertionError:
    return AssertionError(f"{rank_prefix()}{message}")


# -- training -----------------------------------------------------------------------------------


class _TrainingLoop:
    """One model, its SGD-with-momentum optimizer and grad scaler; :meth:`step` runs one
    iteration the way ``_train_for_several_steps`` does."""

    def __init__(
        self,
        model: nn.Module,
        *,
        autocast: bool,
        lr: float,
        fsdp_cpu_offload: Any,
        mixed_precision: Any,
        enable_sharded_grad_scaler: bool,
        use_pure_fp16: bool,
        sharded_grad_scaler_kwargs: dict[str, Any] | None,
        device: torch.device,
        engine: FSDPEngine | None = None,
    ) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.model = model
        self.test_model = _test_model(model)
        self.engine = engine if engine is not None else engine_for(model)
        self.autocast = autocast
        self.offload_params = bool(getattr(fsdp_cpu_offload, "offload_params", False))
        self.mixed_precision = mixed_precision
        self.use_pure_fp16 = use_pure_fp16
        self.device = device
        self.scaler = ShardedGradScaler(
            device=device.type,
            enabled=enable_sharded_grad_scaler,
            **(sharded_grad_scaler_kwargs or {}),
        )
        # SGD with momentum: Adam is scale invariant, which hides gradient-scaling bugs.
        self.optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    @property
    def sharded(self) -> bool:
        return self.engine is not None

    def _autocast_dtype(self) -> torch.dtype:
        dtype = getattr(self.mixed_precision, "param_dtype", None)
        if dtype is not None:
            return dtype
        return torch.float16 if self.device.type == "cuda" else torch.bfloat16

    def step(self, save_model: bool) -> torch.Tensor:
        model, test_model = self.model, self.test_model
        model_device = next(model.parameters()).device
        self.optim.zero_grad()
        with torch.autocast(self.device.type, dtype=self._autocast_dtype(), enabled=self.autocast):
            inputs = test_model.get_input(self.device)
            if self.use_pure_fp16:
                inputs = _cast_floats(inputs, torch.float16)
            elif self.mixed_precision is not None and not self.sharded:
                inputs = _cast_floats(inputs, self._autocast_dtype())
            output = model(*inputs)
            loss = test_model.get_loss(inputs, output).to(model_device)
        loss = self.scaler.scale(loss)
        self._validate_loss_dtype(loss)
        test_model.run_backward(loss)
        if self.offload_params and self.sharded:
            on_device = [n for n, p in model.named_parameters() if p.device.type != "cpu"]
            if on_device:
                raise _fail(
                    f"parameters offloaded to CPU are on the device after backward: {on_device}"
                )
        self.scaler.step(self.optim)
        self.scaler.update()
        if save_model:
            self._save_zero_load()
        return loss.detach()

    def _validate_loss_dtype(self, loss: torch.Tensor) -> None:
        """The loss dtype says whether the precision under test took effect.

        As torch's ``_train_for_several_steps``: fp16 with ``use_pure_fp16``; ``param_dtype``
        for a sharded model with mixed precision; float32 otherwise. A model under autocast
        (the mixed precision reference) may also end in the autocast dtype: which ops autocast
        keeps in float32 depends on the device (CUDA sums in float32, the CPU in bf16), so
        torch's "the DDP AMP loss is fp32" holds on CUDA only.
        """
        expected: tuple[torch.dtype | None, ...]
        if self.use_pure_fp16:
            expected = (torch.float16,)
        elif self.mixed_precision is not None and self.sharded:
            expected = (self.mixed_precision.param_dtype,)
        elif self.autocast:
            expected = (torch.float32, self._autocast_dtype())
        else:
            expected = (torch.float32,)
        if None not in expected and loss.dtype not in expected:
            raise _fail(
                f"loss dtype is {loss.dtype}, expected {' or '.join(map(str, expected))} "
                f"(mixed_precision={self.mixed_precision}, use_pure_fp16={self.use_pure_fp16}, "
                f"autocast={self.autocast})"
            )

    def _save_zero_load(self) -> None:
        # Zeroing between save and load makes a state dict that loses anything visible.
        model, engine = self.model, self.engine
        if engine is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            full: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            state = engine.full_state_dict(model)
            full = engine.full_params(model, writeback=True)
        with full, torch.no_grad():
            for param in model.parameters():
                param.zero_()
        if engine is None:
            model.load_state_dict(state)
        else:
            engine.load_full_state_dict(model, state)


def train_for_several_steps(
    model: nn.Module,
    num_steps: int,
    autocast: bool,
    lr: float = 0.01,
    fsdp_cpu_offload: Any = None,
    save_model: bool = False,
    mixed_precision: Any = None,
    enable_sharded_grad_scaler: bool = False,
    use_pure_fp16: bool = False,
    sharded_grad_scaler_kwargs: dict[str, Any] | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Trains ``model`` (wrapping an :class:`FSDPTestModel`) for ``num_steps`` with SGD and
    momentum 0.9 and returns the last loss, detached. torch's ``_train_for_several_steps``.

    Args:
        model: the model, plain, DDP-wrapped or sharded by any engine.
        num_steps: number of optimizer steps.
        autocast: run forward under ``torch.autocast`` for ``device``.
        lr: learning rate (default 0.01).
        fsdp_cpu_offload: the model's ``CPUOffload``; with ``offload_params`` the parameters
            must be on the CPU after each backward (default None).
        save_model: after each step, save a full state dict, zero the parameters and load it.
        mixed_precision: the model's ``MixedPrecision`` (sets the expected loss dtype).
        enable_sharded_grad_scaler: scale the loss with ``ShardedGradScaler``.
        use_pure_fp16: the model is in fp16; inputs are cast to fp16.
        sharded_grad_scaler_kwargs: extra ``ShardedGradScaler`` arguments.
        device: where inputs go, default CUDA if available else CPU.
    """
    loop = _TrainingLoop(
        model,
        autocast=autocast,
        lr=lr,
        fsdp_cpu_offload=fsdp_cpu_offload,
        mixed_precision=mixed_precision,
        enable_sharded_grad_scaler=enable_sharded_grad_scaler,
        use_pure_fp16=use_pure_fp16,
        sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs,
        device=resolve_device(device),
    )
    if num_steps < 1:
        raise ValueError(f"train_for_several_steps: num_steps must be >= 1, got {num_steps}")
    loss = loop.step(save_model)
    for _ in range(num_steps - 1):
        loss = loop.step(save_model)
    return loss


_train_for_several_steps = train_for_several_steps


# -- DDP parity ---------------------------------------------------------------------------------


def _step_divergences(
    ref_loss: torch.Tensor,
    loss: torch.Tensor,
    ref_model: nn.Module,
    model: nn.Module,
    engine: FSDPEngine,
    compare_params: bool,
) -> list[Divergence]:
    # Each loss in its own dtype: the tolerance is the lower precision's (as torch's
    # ``assert_close(ref_loss, fsdp_loss, check_dtype=False)``), e.g. bf16's under mixed
    # precision, float32's otherwise.
    found = compare_named([("loss", ref_loss)], [("loss", loss)])
    if compare_params:
        found += compare_named(_named_full_params(ref_model), _named_full_params(model, engine))
    return found


def _agree_on_failure(local: str | None, group: dist.ProcessGroup, where: str) -> None:
    # See [Note: lockstep parity]
    verdicts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, local, group=group)
    failed = [r for r, verdict in enumerate(verdicts) if verdict is not None]
    if not failed:
        return
    if local is not None:
        raise _fail(local)
    raise _fail(f"{where}: no divergence on this rank, but ranks {failed} of the group diverged")


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
            False). Parameters are not compared under mixed precision or pure fp16.
        enable_sharded_grad_scaler: scale losses with ``ShardedGradScaler`` (default False).
        use_pure_fp16: convert both models to fp16 (default False).
        init_kwargs: extra ``model_class.init`` keyword arguments.
        sharded_grad_scaler_kwargs: extra ``ShardedGradScaler`` arguments.
        process_group: the group, default the default group.
        device: the compute device, default CUDA if available else CPU; when given it is also
            passed to ``init()`` as ``device=``.
        engine: engine name or instance, default :func:`~fsdp_testing.engines.current_engine`.
        fsdp_kwargs: further engine options.
    """
    if as_fsdp_init_mode(fsdp_init_mode) is FSDPInitMode.NO_FSDP:
        raise ValueError(
            "_test_fsdp_parity: fsdp_init_mode=NO_FSDP builds no sharded model; use RECURSIVE"
        )
    placement = as_device_init_mode(device_init_mode)
    group = process_group if process_group is not None else default_process_group()
    chosen = _resolve_engine(engine)
    target = resolve_device(device)
    init_kwargs = dict(init_kwargs or {})
    if device is not None:
        init_kwargs.setdefault("device", target)
    lr = 1e-2

    plain = model_class.init(
        group,
        FSDPInitMode.NO_FSDP,
        DEVICEInitMode.DEVICE_BEFORE,
        deterministic=True,
        **init_kwargs,
    )
    if ref_init_fn is not None:
        ref_model = ref_init_fn(plain)
    else:
        device_ids = [target.index] if target.type == "cuda" and target.index is not None else None
        ref_model = DistributedDataParallel(plain, device_ids=device_ids, process_group=group)
    if use_pure_fp16:
        ref_model = ref_model.half()

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
    with use_engine(chosen):
        try:
            model = model_class.init(
                group, fsdp_init_mode, placement, options, deterministic=True, **init_kwargs
            )
        except NotImplementedError:
            raise
        except Exception as error:
            raise ValueError(
                f"Initializing {model_class.__name__} with engine {chosen.name!r} raised {error}"
            ) from error
        if not chosen.is_wrapped(model):
            # The reference is data parallel over the whole model: shard the root too.
            model = chosen.wrap(model, group, **options)
    if use_pure_fp16:
        model = model.half()
    if placement is DEVICEInitMode.DEVICE_AFTER:
        model = model.to(target)
    offload_params = bool(getattr(cpu_offload, "offload_params", False))
    expects_device_error = (
        offload_params and placement is DEVICEInitMode.DEVICE_AFTER and target.type != "cpu"
    )
    if offload_params and not expects_device_error:
        on_device = [n for n, p in model.named_parameters() if p.device.type != "cpu"]
        if on_device:
            raise _fail(f"CPU offloading is on but these parameters are not on CPU: {on_device}")

    common = dict(
        lr=lr,
        fsdp_cpu_offload=cpu_offload,
        mixed_precision=mixed_precision,
        enable_sharded_grad_scaler=enable_sharded_grad_scaler,
        use_pure_fp16=use_pure_fp16,
        sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs,
        device=target,
    )
    ref_loop = _TrainingLoop(ref_model, autocast=mixed_precision is not None, **common)
    loop = _TrainingLoop(model, autocast=False, engine=chosen, **common)
    compare_params = mixed_precision is None and not use_pure_fp16
    ref_name = type(ref_model).__name__
    for step in range(1, num_iters + 1):
        ref_loss = ref_loop.step(save_model=False)
        if expects_device_error:
            try:
                loop.step(save_model)
            except RuntimeError:
                return
            raise _fail(
                "expected a RuntimeError for CPU offloading with a model moved to "
                f"{target} after wrapping, but step {step} ran"
            )
        loss = loop.step(save_model)
        found = _step_divergences(ref_loss, loss, ref_model, model, chosen, compare_params)
        where = f"_test_fsdp_parity[{model_class.__name__}, engine {chosen.name}]"
        local = None
        if found:
            local = (
                f"{where}: the sharded model diverged from the reference ({ref_name}) at step "
                f"{step} of {num_iters} (losses: reference {ref_loss.item():.6g}, sharded "
                f"{loss.item():.6g}); diverging tensors:\n{format_divergences(found)}"
            )
        _agree_on_failure(local, group, where)


_test_fsdp_parity = check_fsdp_parity


# -- sharded parity and cross-rank states --------------------------------------------------------


def check_sharded_parity(
    replicated_module: Any,
    sharded_module: Any,
    prefixes_to_ignore: Any = (),
    *legacy: Any,
) -> None:
    """Checks FSDP2-style sharded parameters (``DTensor``) and their gradients against a
    replicated reference: each rank's local shard must equal the same slice of the reference.

    Also accepts torch's form ``check_sharded_parity(test_case, replicated, sharded,
    prefixes_to_ignore)``.

    Args:
        replicated_module: the reference, the same on every rank.
        sharded_module: the sharded module; parameters in the same order.
        prefixes_to_ignore: substrings removed from sharded names before matching names.
    """
    if not isinstance(replicated_module, nn.Module) and isinstance(sharded_module, nn.Module):
        # torch's signature: (cls, replicated_module, sharded_module, prefixes_to_ignore=()).
        replicated_module, sharded_module = sharded_module, prefixes_to_ignore
        prefixes_to_ignore = legacy[0] if legacy else ()
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    problems: list[str] = []
    found: list[Divergence] = []
    pairs = list(
        zip(replicated_module.named_parameters(), sharded_module.named_parameters(), strict=False)
    )
    for (ref_name, ref_param), (name, param) in pairs:
        clean = name
        for prefix in prefixes_to_ignore:
            clean = clean.replace(prefix, "")
        if clean != ref_name:
            problems.append(f"parameter order differs: {name!r} against reference {ref_name!r}")
            continue
        if not isinstance(param, DTensor):
            problems.append(f"{name} is a {type(param).__name__}, not a DTensor")
            continue
        placements = tuple(param.placements)
        if placements == (Shard(0), Shard(0)):
            raise _fail(
                "check_sharded_parity: the (Shard(0), Shard(0)) layout of FSDP differs from "
                f"distribute_tensor()'s, so {name} cannot be compared"
            )
        expected = distribute_tensor(
            ref_param.detach(), param.device_mesh, placements, src_data_rank=None
        )
        divergence = compare_named([(name, expected.to_local())], [(name, param.to_local())])
        found += divergence
        if ref_param.grad is None:
            if param.grad is not None:
                problems.append(f"{name}.grad exists but the reference has no gradient")
            continue
        if param.grad is None:
            problems.append(f"{name}.grad is None but the reference has a gradient")
            continue
        if not isinstance(param.grad, DTensor):
            problems.append(f"{name}.grad is a {type(param.grad).__name__}, not a DTensor")
            continue
        expected_grad = distribute_tensor(
            ref_param.grad, param.device_mesh, placements, src_data_rank=None
        )
        found += compare_named(
            [(f"{name}.grad", expected_grad.to_local())],
            [(f"{name}.grad", param.grad.to_local())],
        )
    counts = (len(list(replicated_module.parameters())), len(list(sharded_module.parameters())))
    if counts[0] != counts[1]:
        problems.append(f"parameter counts differ: reference {counts[0]}, sharded {counts[1]}")
    if problems or found:
        details = "\n".join(f"  {p}" for p in problems)
        if found:
            details += ("\n" if details else "") + format_divergences(found)
        raise _fail(f"check_sharded_parity: sharded module differs from the reference:\n{details}")


def _gather_states(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    states = [*module.named_parameters(), *module.named_buffers()]
    return [
        (name, (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu())
        for name, t in states
    ]


def assert_module_states_equal(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> None:
    """Raises unless every rank holds bitwise-equal parameters and buffers (``DTensor``s are
    compared as full tensors). Every rank raises the same message, naming each differing state
    and the ranks that differ from rank 0.

    Args:
        module: the module to check (call on every rank).
        process_group: the group, default the default group.
    """
    group = process_group if process_group is not None else default_process_group()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, _gather_states(module), group=group)
    reference = gathered[0]
    lines = []
    for other_rank, states in enumerate(gathered[1:], start=1):
        for divergence in compare_named(reference, states, exact=True):
            lines.append(f"  rank {other_rank} vs rank 0: {divergence}")
    if lines:
        raise _fail(
            f"assert_module_states_equal: {type(module).__name__} states differ across ranks:\n"
            + "\n".join(lines)
        )


def _assert_module_states(
    model: nn.Module,
    process_group: dist.ProcessGroup,
    assert_fn: Callable[[torch.Tensor, torch.Tensor], Any],
) -> None:
    """torch's form: calls ``assert_fn(rank0_state, rank_r_state)`` for each state and rank."""
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, _gather_states(model), group=process_group)
    for states in gathered[1:]:
        for (_, first), (_, other) in zip(gathered[0], states, strict=True):
            assert_fn(first, other)


# -- unittest mixin -----------------------------------------------------------------------------


class FSDPParityMixin:
    """Adds torch's ``_train_for_several_steps`` and ``_test_fsdp_parity`` methods to a test
    case that has ``process_group`` (and optionally ``device`` and ``fsdp_engine``)."""

    def _parity_device(self) -> torch.device | None:
        return getattr(self, "device", None)

    def _train_for_several_steps(
        self,
        model: nn.Module,
        num_steps: int,
        autocast: bool,
        lr: float = 0.01,
        fsdp_cpu_offload: Any = None,
        save_model: bool = False,
        mixed_precision: Any = None,
        enable_sharded_grad_scaler: bool = False,
        use_pure_fp16: bool = False,
        sharded_grad_scaler_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """See :func:`train_for_several_steps`."""
        return train_for_several_steps(
            model,
            num_steps,
            autocast,
            lr,
            fsdp_cpu_offload,
            save_model,
            mixed_precision,
            enable_sharded_grad_scaler,
            use_pure_fp16,
            sharded_grad_scaler_kwargs,
            device=self._parity_device(),
        )

    def _test_fsdp_parity(
        self,
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
        **fsdp_kwargs: Any,
    ) -> None:
        """See :func:`check_fsdp_parity`; uses ``self.process_group`` and ``self.device``."""
        check_fsdp_parity(
            model_class,
            fsdp_init_mode,
            device_init_mode,
            ref_init_fn,
            num_iters,
            save_model,
            cpu_offload,
            backward_prefetch,
            sharding_strategy,
            mixed_precision,
            forward_prefetch,
            use_orig_params,
            enable_sharded_grad_scaler,
            use_pure_fp16,
            init_kwargs,
            sharded_grad_scaler_kwargs,
            process_group=getattr(self, "process_group", None),
            device=self._parity_device(),
            engine=getattr(self, "fsdp_engine", None),
            **fsdp_kwargs,
        )
