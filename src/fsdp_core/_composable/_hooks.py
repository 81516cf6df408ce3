"""The hooks a composable door puts on a unit's modules: forward pre-hook and hook
(``ForwardHooks``) and the load-state-dict pre-hook (``load_full_tensors_hook``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._runtime import FSDPState
from ..api import TrainingState

__all__ = ["ForwardHooks", "hooks_of", "load_full_tensors_hook"]


def hooks_of(module: nn.Module) -> ForwardHooks | None:
    """The forward hooks the composable door gave ``module``, or ``None``."""
    hooks = module.__dict__.get("_fsdp_forward_hooks")
    return hooks if isinstance(hooks, ForwardHooks) else None


class ForwardHooks:
    """The forward pre-hook and hook of one unit's modules.

    [Note: grouped modules]
    ``fully_shard([a, b])`` makes one unit of several modules. Inside the root's forward the
    unit unshards when the first of them starts and reshards when every one has finished; a
    module re-entered (a registered forward method calling ``forward``) counts once. As in
    FSDP2, the forward may run only some of them (chunked loss: ``fully_shard([norm,
    head])`` with the model's forward running ``norm`` only): when the root's forward ends,
    such a unit is completed (resharded as after its forward; the outputs of the modules that
    ran already carry its pre-backward hook). A module of a group called on its own outside the
    root's forward (``head`` per chunk) is a forward of the unit by itself: unshard, run,
    reshard, and its backward reduces what it produced. Every module of a group casts its
    inputs and outputs by the unit's ``mp_policy``.

    ``handles`` are the door's hooks on the modules (forward pre-hook, forward hook,
    load-state-dict pre-hook, per module). While the state's hooks are suspended
    (``fsdp_core.suspend_hooks``) both hooks pass everything through: a switch rather than
    removing them through the handles, so that they keep their place among the user's hooks on
    the same modules.
    """

    def __init__(self, state: FSDPState, modules: list[nn.Module]) -> None:
        self.state = state
        self.modules = modules
        self.handles: list[RemovableHandle] = []
        self._remaining: set[int] = set()
        self._depth: dict[int, int] = {}

    def pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.state.hooks_suspended:
            return args, kwargs
        if self.state.training_state is TrainingState.PRE_BACKWARD:
            return self.state.pre_forward(args, kwargs)  # a recompute inside backward
        if not self._remaining:
            root = self.state.root  # a module of a group called outside the root's forward:
            alone = (
                root is not None
                and root is not self.state
                and root.training_state is not TrainingState.FORWARD
            )
            self._remaining = {id(module)} if alone else {id(m) for m in self.modules}
            args, kwargs = self.state.pre_forward(args, kwargs)
        else:
            args, kwargs = self.state.cast_forward_inputs(args, kwargs)
        self._depth[id(module)] = self._depth.get(id(module), 0) + 1
        return args, kwargs

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.state.hooks_suspended:
            return output
        if self.state.training_state is TrainingState.PRE_BACKWARD:
            return self.state.post_forward(output)
        depth = self._depth.get(id(module), 0) - 1
        self._depth[id(module)] = depth
        if depth > 0:
            return output
        self._remaining.discard(id(module))
        if self._remaining:
            output = self.state.cast_output(output)
            if torch.is_grad_enabled():
                self.state.hook_outputs(output)
            return output
        if self.state.is_root:
            for state in self.state.all_states:
                hooks = state.owner.__dict__.get("_fsdp_forward_hooks")
                if hooks is not None and hooks is not self and hooks._remaining:
                    hooks.complete()
        return self.state.post_forward(output)

    def complete(self) -> None:
        """End a forward that ran only some of the modules. See [Note: grouped modules]."""
        self._remaining.clear()
        self._depth.clear()
        self.state.post_forward(None)

    def reset(self) -> None:
        """Forget a forward an exception interrupted."""
        self._remaining.clear()
        self._depth.clear()


def load_full_tensors_hook(module: nn.Module, state: FSDPState) -> Any:
    """A load-state-dict pre-hook turning full tensors into this rank's ``DTensor`` shards
    (of ``state``'s unit at load time: a shared parameter may have moved out of it)."""

    def by_name() -> dict[str, Any]:
        found: dict[str, Any] = {}
        if state.unit is None:
            return found
        names = {id(m): name for name, m in module.named_modules()}
        for p in state.unit.params:
            for owner, attr in p.slots:
                if id(owner) in names:
                    prefix = names[id(owner)]
                    found[f"{prefix}.{attr}" if prefix else attr] = p
        return found

    def hook(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        from torch.distributed.tensor import DTensor

        for name, p in by_name().items():
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                if tuple(value.shape) != tuple(p.full_shape):
                    continue  # nn.Module reports the size mismatch
                state_dict[key] = p.shard_of(value)

    return hook
