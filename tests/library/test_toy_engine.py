"""Adding an engine is writing one module: a small, real engine defined here (replicated units
that average their gradients with one all-reduce each, like DDP per unit), registered with
``register_engine``, is recorded, checked for parity against DDP and for its theoretical volume
against the collectives it sends, by the library and by ``fsdp-testing check``, with no change
anywhere else."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_testing.engines import (
    UNIT_EVENTS,
    BaseEngine,
    CommVolume,
    PatchTarget,
    Probe,
    UnitVolume,
    clean_param_name,
    current_engine,
    register_engine,
    unregister_engine,
)
from fsdp_testing.models import DEVICEInitMode, FSDPInitMode, NestedWrappedModule
from fsdp_testing.parity import check_fsdp_parity
from fsdp_testing.recording import record_fsdp

NAME = "toy_replicate"


class ToyUnit:
    """The parameters of ``module`` that no unit inside it owns; after backward their gradients
    are averaged over ``group`` with one all-reduce (pre-divide by the world size, then sum)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        inner = {
            id(p)
            for m in module.modules()
            if m is not module and hasattr(m, "_toy_unit")
            for p in m._toy_unit.params
        }
        self.module, self.group = module, group
        self.params = [p for p in module.parameters() if id(p) not in inner]
        self.trainable = [p for p in self.params if p.requires_grad]
        self.unsharded = False
        self._ready = 0
        for param in self.trainable:
            param.register_post_accumulate_grad_hook(self._on_gradient)
        module.register_forward_pre_hook(lambda *_: self.unshard("forward"))
        module.register_forward_hook(lambda *_: self.reshard("forward"))

    # The transitions the engine names as patch targets: called through the class, so a patch
    # (the recorder's, a test's) sees every call.
    def unshard(self, reason: str) -> None:
        self.unsharded = True

    def reshard(self, reason: str) -> None:
        self.unsharded = False

    def post_backward(self) -> None:
        grads = [p.grad for p in self.trainable if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(dist.get_world_size(self.group))
        dist.all_reduce(flat, group=self.group)
        for grad, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(chunk.view_as(grad))

    def _on_gradient(self, param: torch.Tensor) -> None:
        self._ready += 1
        if self._ready == len(self.trainable):
            self._ready = 0
            self.post_backward()


class ToyProbe(Probe):
    """Whether a unit holds its parameters, which module it is (for its FQN) and why it was
    called (the transitions take the reason as an argument)."""

    def reason(self, kind: str, args: tuple[Any, ...]) -> str:
        return str(args[1])

    def unsharded(self, unit: ToyUnit) -> bool | None:
        return unit.unsharded

    def modules(self, unit: ToyUnit) -> tuple[nn.Module, ...]:
        return (unit.module,)


class ToyEngine(BaseEngine):
    """Replicated units (``NO_SHARD`` semantics), wrapped in place."""

    name = NAME
    _contexts = threading.local()

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        strategy = getattr(fsdp_kwargs.get("sharding_strategy"), "name", "NO_SHARD")
        offload = getattr(fsdp_kwargs.get("cpu_offload"), "offload_params", False)
        if strategy != "NO_SHARD" or offload or fsdp_kwargs.get("mixed_precision") is not None:
            raise NotImplementedError(
                f"engine {NAME!r} replicates: only sharding_strategy NO_SHARD, without offload "
                "or mixed precision"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        module._toy_unit = ToyUnit(module, group)  # type: ignore[assignment]
        return module

    def is_wrapped(self, module: nn.Module) -> bool:
        return hasattr(module, "_toy_unit")

    def manages(self, module: nn.Module) -> bool:
        return any(self.is_wrapped(m) for m in module.modules())

    def module_wrap_policy(self, module_classes: Iterable[type[nn.Module]]) -> Any:
        raise NotImplementedError(f"engine {NAME!r} wraps explicitly: no policies")

    def always_wrap_policy(self) -> Any:
        raise NotImplementedError(f"engine {NAME!r} wraps explicitly: no policies")

    @contextlib.contextmanager
    def enable_wrap(
        self, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> Iterator[None]:
        stack = self._contexts.__dict__.setdefault("stack", [])
        stack.append((process_group, fsdp_kwargs))
        try:
            yield
        finally:
            stack.pop()

    def wrap_if_enabled(self, module: nn.Module) -> nn.Module:
        stack = self._contexts.__dict__.get("stack")
        return self.wrap(module, stack[-1][0], **stack[-1][1]) if stack else module

    def full_params(
        self, module: nn.Module, *, recurse: bool = True, writeback: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # replicated: the parameters are always full

    def named_full_params(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [(clean_param_name(n), p.detach().clone()) for n, p in module.named_parameters()]

    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def load_full_state_dict(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        module.load_state_dict(state_dict)

    @property
    def unit_class(self) -> type:
        return ToyUnit

    def patch_target(self, event: str) -> PatchTarget:
        if event not in UNIT_EVENTS:
            raise ValueError(f"{NAME}.patch_target: unknown event {event!r}")
        return PatchTarget(ToyUnit, event)

    def probe(self) -> Probe:
        return ToyProbe()

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        units = [m._toy_unit for m in module.modules() if self.is_wrapped(m)]
        return CommVolume(
            "toy: replicated, one all-reduce per unit",
            tuple(
                UnitVolume(
                    name=type(u.module).__name__,
                    gather_bytes=0,
                    reduce_bytes=sum(p.numel() * p.element_size() for p in u.trainable),
                    gathers=0,
                    reduce_kind="all_reduce" if u.trainable else None,
                )
                for u in units
            ),
        )


@contextlib.contextmanager
def _registered() -> Iterator[None]:
    register_engine(NAME, ToyEngine)
    try:
        yield
    finally:
        unregister_engine(NAME)


def _nested(group: dist.ProcessGroup, engine: ToyEngine) -> nn.Module:
    torch.manual_seed(0)
    model = NestedWrappedModule(
        group, True, DEVICEInitMode.DEVICE_BEFORE, deterministic=True, device="cpu"
    )
    return engine.wrap(model, group)  # the root owns module.0 and module.3


@pytest.mark.distributed(world_size=2)
def test_toy_engine_matches_ddp_with_every_library_check(rank, process_group):
    from fsdp_testing.cli._measure import CollectiveLog, theoretical_volume

    with _registered():
        # Parity: the library's lockstep trainer against DDP, bitwise at world size 2.
        check_fsdp_parity(
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            num_iters=3,
            process_group=process_group,
            engine=NAME,
            exact=True,
        )
        with pytest.raises(AssertionError, match="diverged from the reference"):
            # The same engine without its averaging is caught.
            with contextlib.ExitStack() as stack:
                stack.enter_context(_summing_instead_of_averaging())
                check_fsdp_parity(
                    NestedWrappedModule,
                    FSDPInitMode.RECURSIVE,
                    DEVICEInitMode.DEVICE_BEFORE,
                    process_group=process_group,
                    engine=NAME,
                )

        from fsdp_testing.engines import use_engine

        engine = ToyEngine()
        with use_engine(engine):
            assert current_engine() is engine
            model = _nested(process_group, engine)
        units = ["", "module.1", "module.1.0", "module.2"]
        batch = torch.rand(4, 8, generator=torch.Generator().manual_seed(rank))

        # Recording: found through the registry (engine_for), named by FQN, attributed.
        with record_fsdp(model) as rec:
            model(batch).sum().backward()
        assert rec.engine.name == NAME
        rec.assert_count("all_reduce", len(units))
        assert sorted({c.unit for c in rec.collectives("all_reduce")}) == units
        assert sorted(r.unit for r in rec.unshards("forward")) == units
        rec.assert_resharded(after="forward")

        # Volume: the engine's theory against the collectives counted on the wire.
        log = CollectiveLog()
        with log.watching():
            model(batch).sum().backward()
        theory = theoretical_volume(model, full_shard=False)
        assert theory is not None
        params = sum(p.numel() * 4 for p in model.parameters())
        assert theory.totals() == {"all_reduce": (len(units), params)}
        assert log.totals() == theory.totals()


@contextlib.contextmanager
def _summing_instead_of_averaging() -> Iterator[None]:
    original = ToyUnit.post_backward

    def summing(unit: ToyUnit) -> None:
        for p in unit.trainable:
            assert p.grad is not None
            p.grad.mul_(dist.get_world_size(unit.group))
        original(unit)

    ToyUnit.post_backward = summing  # type: ignore[method-assign]
    try:
        yield
    finally:
        ToyUnit.post_backward = original  # type: ignore[method-assign]


def test_fsdp_testing_check_runs_the_toy_engine_by_module_path(tmp_path, capsys):
    """The command line takes the engine as ``module:attribute`` and measures it as any
    other: parity with DDP, and exactly the theoretical volume."""
    from fsdp_testing.cli import main

    report = tmp_path / "check.json"
    args = ["check", "--model", "nested", "--strategy", "NO_SHARD,FULL_SHARD"]
    args += ["--prefetch", "none", "--offload", "off", "--mp", "off"]
    args += ["--engine", f"{__name__}:ToyEngine", "--json", str(report)]
    assert main(args) == 0, capsys.readouterr().out
    rows = {r["label"]: r for r in json.loads(report.read_text())["rows"]}
    ok = rows["nested NO_SHARD none offload=off mp=off ToyEngine"]
    assert ok["status"] == "ok" and ok["loss_max_abs_diff"] == 0 == ok["param_max_abs_diff"]
    assert set(ok["collectives_per_step"]) == {"all_reduce"}
    assert ok["collectives_per_step"] == ok["theory_per_step"]
    refused = rows["nested FULL_SHARD none offload=off mp=off ToyEngine"]
    assert refused["status"] == "unavailable"
