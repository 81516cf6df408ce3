"""Small stacks of linear layers with nested sharded units: the workhorse parity models.

Layer shapes and module paths (``module.0`` ... ``module.3``) follow torch's test models, so
tests that address parameters by name carry over.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ..engines import current_engine, has_nested_units
from ..patching.delays import delayed_calls
from ._base import (
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTestModel,
    as_device_init_mode,
    as_fsdp_init_mode,
    finish_placement,
    group_rank_and_size,
    placer,
    resolve_device,
    sharder,
)

__all__ = [
    "AlwaysWrapNestedWrappedModule",
    "MixtureOfExperts",
    "NestedWrappedModule",
    "NonUniformReqGradNWM",
]


def _linears(shapes: list[tuple[int, int]], deterministic: bool, seed: int) -> list[nn.Linear]:
    # Build every layer before any wrapping so that sharding cannot change the initialization.
    if deterministic:
        torch.manual_seed(seed)
    return [nn.Linear(fan_in, fan_out) for fan_in, fan_out in shapes]


class NestedWrappedModule(FSDPTestModel):
    """``Linear(8,4) -> [Linear(4,16) -> Linear(16,16)] -> Linear(16,4) -> Linear(4,8)``.

    With sharding, ``module.1``, ``module.1.0`` and ``module.2`` are units; the root is not (the
    parity check wraps it).

    Args:
        group: the process group.
        wrap_fsdp: shard the nested units with the active engine.
        device_init_mode: when to move to ``device``.
        deterministic: seed the initialization identically on every rank.
        device: compute device, default CUDA if available else CPU.
        fsdp_kwargs: engine options for the nested units.
    """

    _SHAPES: ClassVar[list[tuple[int, int]]] = [(8, 4), (4, 16), (16, 16), (16, 4), (4, 8)]

    def __init__(
        self,
        group: dist.ProcessGroup,
        wrap_fsdp: bool,
        device_init_mode: DEVICEInitMode,
        deterministic: bool,
        *,
        device: torch.device | str | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.rank, self.world_size = group_rank_and_size(group)
        self.device = resolve_device(device)
        place = placer(as_device_init_mode(device_init_mode), self.device)
        shard = sharder(wrap_fsdp, group, fsdp_kwargs)
        first, grow, mix, shrink, last = (
            place(layer) for layer in _linears(self._SHAPES, deterministic, seed=0)
        )
        self.module = self._assemble(shard, first, grow, mix, shrink, last)

    @staticmethod
    def _assemble(shard: Any, *layers: nn.Module) -> nn.Sequential:
        first, grow, mix, shrink, last = layers
        middle = shard(nn.Sequential(shard(grow), mix))
        return nn.Sequential(first, middle, shard(shrink), last)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(1 + self.rank)
        return (torch.rand(4, 8, generator=generator).to(device),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def get_loss(self, input: Any, output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @classmethod
    def _build(
        cls,
        group: Any,
        fsdp_init_mode: Any,
        device_init_mode: Any,
        fsdp_kwargs: Mapping[str, Any] | None,
        deterministic: bool,
        device: torch.device | str | None,
        **extra: Any,
    ) -> nn.Module:
        mode = as_fsdp_init_mode(fsdp_init_mode)
        placement = as_device_init_mode(device_init_mode)
        wrap = mode is FSDPInitMode.RECURSIVE
        model = cls(
            group,
            wrap,
            placement,
            deterministic=deterministic,
            device=device,
            **extra,
            **(fsdp_kwargs if wrap and fsdp_kwargs else {}),
        )
        return finish_placement(model, placement, resolve_device(device), wrap)

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """Builds the model; ``RECURSIVE`` shards the nested units but not the root.

        Args:
            group: the process group.
            fsdp_init_mode: ``NO_FSDP`` or ``RECURSIVE``.
            device_init_mode: when to move to ``device``.
            fsdp_kwargs: engine options for the units, default none.
            deterministic: seed the initialization identically on every rank (default False).
            device: compute device, default CUDA if available else CPU.
        """
        return NestedWrappedModule._build(
            group, fsdp_init_mode, device_init_mode, fsdp_kwargs, deterministic, device
        )


class AlwaysWrapNestedWrappedModule(NestedWrappedModule):
    """A plain :class:`NestedWrappedModule` that ``RECURSIVE`` shards from the root with the
    engine's always-wrap policy (every submodule becomes a unit; the root alone for a
    root-only engine)."""

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """Builds the model (see :meth:`NestedWrappedModule.init` for the arguments)."""
        placement = as_device_init_mode(device_init_mode)
        model = NestedWrappedModule._build(
            group, FSDPInitMode.NO_FSDP, placement, None, deterministic, device
        )
        if as_fsdp_init_mode(fsdp_init_mode) is FSDPInitMode.NO_FSDP:
            return model
        engine = current_engine()
        kwargs = dict(fsdp_kwargs or {})
        if has_nested_units(engine):  # see [Note: root-only engines]
            kwargs["auto_wrap_policy"] = engine.always_wrap_policy()
        sharded = engine.wrap(model, group, **kwargs)
        return finish_placement(sharded, placement, resolve_device(device), True)


class NonUniformReqGradNWM(NestedWrappedModule):
    """Like :class:`NestedWrappedModule` but the last two linears form one unit
    (``module.2``) and every parameter except those of ``module.2.1`` is frozen, so some ranks
    hold no trainable shard (the ``ShardedGradScaler`` edge case)."""

    #: Parameters that stay trainable, with or without wrapper prefixes in their names.
    TRAINABLE = re.compile(r"module\.2.*\.1.*")

    @staticmethod
    def _assemble(shard: Any, *layers: nn.Module) -> nn.Sequential:
        first, grow, mix, shrink, last = layers
        middle = shard(nn.Sequential(shard(grow), mix))
        return nn.Sequential(first, middle, shard(nn.Sequential(shrink, last)))

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """Builds the model and freezes all but ``module.2.1`` (arguments as
        :meth:`NestedWrappedModule.init`)."""
        model = NonUniformReqGradNWM._build(
            group, fsdp_init_mode, device_init_mode, fsdp_kwargs, deterministic, device
        )
        NonUniformReqGradNWM._set_nonuniform_req_grad(model, NonUniformReqGradNWM.TRAINABLE)
        return model

    @staticmethod
    def _set_nonuniform_req_grad(model: nn.Module, req_grad_mask: re.Pattern[str]) -> None:
        """Freeze every parameter whose name ``req_grad_mask`` does not match (torch's name)."""
        frozen = [p for n, p in model.named_parameters() if not req_grad_mask.match(n)]
        for param in frozen:
            param.requires_grad_(False)


class MixtureOfExperts(NestedWrappedModule):
    """``Linear(8,12) -> shared Linear(12,23) -> expert Linear(23,12) -> Linear(12,8)``.

    The expert differs on every rank and is never replicated: sharded, it is a unit over a group
    of one rank; unsharded, :meth:`run_backward` averages every gradient except the expert's.
    Expert parameters carry ``param.expert = True``. Use a reference that does not synchronize
    parameters (``DummyDDP``), as DDP would overwrite the experts.

    Args:
        group: the process group.
        wrap_fsdp: shard ``shared`` over ``group`` and ``expert`` over a one-rank group.
        device_init_mode: when to move to ``device``.
        delay_before_free_ms: sleep before each reshard of the active engine, in forward and
            in :meth:`run_backward`.
        deterministic: seed the shared layers identically and the expert per rank.
        device: compute device, default CUDA if available else CPU.
        fsdp_kwargs: engine options for the units.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        wrap_fsdp: bool,
        device_init_mode: DEVICEInitMode,
        delay_before_free_ms: int,
        deterministic: bool,
        *,
        device: torch.device | str | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        FSDPTestModel.__init__(self)
        self.rank, self.world_size = group_rank_and_size(group)
        self.group = group
        self.device = resolve_device(device)
        self.wrap_fsdp = wrap_fsdp
        self.delay_before_free_ms = delay_before_free_ms
        self._engine = current_engine() if wrap_fsdp else None
        place = placer(as_device_init_mode(device_init_mode), self.device)
        d_input, d_shared, d_expert = 8, 12, 23
        (expert,) = _linears([(d_expert, d_shared)], deterministic, seed=42 + self.rank)
        shared, entry, exit_ = _linears(
            [(d_shared, d_expert), (d_input, d_shared), (d_shared, d_input)], deterministic, 0
        )
        self.num_expert_params = sum(p.numel() for p in expert.parameters())
        for param in expert.parameters():
            param.expert = True  # type: ignore[attr-defined]
        expert_unit: nn.Module = place(expert)
        shared_unit: nn.Module = place(shared)
        if wrap_fsdp and not has_nested_units(self._engine):
            raise NotImplementedError(
                f"MixtureOfExperts: engine {getattr(self._engine, 'name', self._engine)!r} "
                "wraps the root only, so it would average the per-rank expert's gradients; "
                "the model needs its expert as a unit of its own (see [Note: root-only engines])"
            )
        if wrap_fsdp:
            # A group of one rank: the expert is wrapped but never sharded nor reduced.
            expert_group = dist.new_group([dist.get_rank()])
            expert_unit = sharder(True, expert_group, fsdp_kwargs)(expert_unit)
            shared_unit = sharder(True, group, fsdp_kwargs)(shared_unit)
        self.module = nn.Sequential(place(entry), shared_unit, expert_unit, place(exit_))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._delayed_frees():
            return self.module(x)

    def run_backward(self, loss: torch.Tensor) -> None:
        with self._delayed_frees():
            loss.backward()
        if self.wrap_fsdp:
            return
        with torch.no_grad():
            for param in self.parameters():
                if getattr(param, "expert", False) or param.grad is None:
                    continue
                param.grad.div_(self.world_size)
                dist.all_reduce(param.grad, group=self.group)

    def _delayed_frees(self) -> contextlib.AbstractContextManager[None]:
        # Forward and backward: the root is not sharded, so both units are roots, which
        # fsdp_core never reshards after forward (FSDP1/FSDP2 call their reshard there but keep
        # a root's parameters); every engine frees them in backward.
        if self._engine is None:
            return contextlib.nullcontext()
        target = self._engine.patch_target("reshard")
        return delayed_calls(target, self.delay_before_free_ms, self.device)

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        delay_before_free_ms: int = 0,
        *,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """Builds the model; ``RECURSIVE`` shards the shared and expert layers, not the root.

        Args:
            group: the process group.
            fsdp_init_mode: ``NO_FSDP`` or ``RECURSIVE``.
            device_init_mode: when to move to ``device``.
            fsdp_kwargs: engine options for the units, default none.
            deterministic: seed the initialization (default False).
            delay_before_free_ms: sleep before each reshard in forward and backward (ms,
                default 0).
            device: compute device, default CUDA if available else CPU.
        """
        return MixtureOfExperts._build(
            group,
            fsdp_init_mode,
            device_init_mode,
            fsdp_kwargs,
            deterministic,
            device,
            delay_before_free_ms=delay_before_free_ms,
        )
