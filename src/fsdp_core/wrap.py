"""Which submodules become their own FSDP unit: auto-wrap policies and manual ``wrap``.

A policy is a callable ``policy(module, recurse, nonwrapped_numel) -> bool`` (torch's FSDP1
convention). The auto-wrapper asks it twice per module: with ``recurse=True`` whether to look
inside ``module`` at all, and, after the children were visited, with ``recurse=False`` whether to
wrap ``module`` itself given the ``nonwrapped_numel`` parameters not yet claimed by a wrapped
child. Bind extra arguments with ``functools.partial``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from torch import nn

from ._runtime import state_of

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "WrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


class WrapPolicy(Protocol):
    """``policy(module, recurse, nonwrapped_numel) -> bool``; see the module docstring."""

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool: ...


def always_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """Wrap every submodule (each becomes its own unit if it owns parameters)."""
    return True


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` parameters not yet wrapped.

    Args:
        min_num_params: threshold on ``nonwrapped_numel`` (default ``1e8``).
        force_leaf_modules: never look inside these (default ``{nn.MultiheadAttention}``).
        exclude_wrap_modules: never wrap these themselves (default
            ``{nn.ModuleList, nn.ModuleDict}``, containers that have no ``forward``).
    """
    leaves = tuple(force_leaf_modules or {nn.MultiheadAttention})
    excluded = tuple(exclude_wrap_modules or {nn.ModuleList, nn.ModuleDict})
    if recurse:
        return not isinstance(module, leaves)
    return nonwrapped_numel >= min_num_params and not isinstance(module, excluded)


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Iterable[type[nn.Module]],
) -> bool:
    """Wrap each instance of ``transformer_layer_cls`` (bind it with ``functools.partial``)."""
    return recurse or isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    lambda_fn: Callable[[nn.Module], bool],
) -> bool:
    """Wrap each module for which ``lambda_fn(module)`` is true (bind it with
    ``functools.partial``); every module is looked inside."""
    return recurse or bool(lambda_fn(module))


class CustomPolicy:
    """Wrap each module for which ``lambda_fn(module)`` is true or a dict; a dict's entries
    override the wrapper's constructor arguments for that module (torch's meaning).

    Args:
        lambda_fn: ``module -> bool | dict[str, Any]``.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(
                f"CustomPolicy(lambda_fn) takes a callable module -> bool | dict, got "
                f"{lambda_fn!r}; e.g. CustomPolicy(lambda m: isinstance(m, nn.Linear))."
            )
        self._lambda_fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or self.overrides(module) is not None

    def overrides(self, module: nn.Module) -> dict[str, Any] | None:
        """The constructor arguments for ``module``'s wrapper (None: do not wrap it)."""
        result = self._lambda_fn(module)
        if isinstance(result, dict):
            return result
        return {} if result else None


class ModuleWrapPolicy:
    """Wrap every instance of the given module classes.

    Args:
        module_classes: the classes whose instances become units.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = tuple(module_classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(
                f"ModuleWrapPolicy(module_classes) takes nn.Module subclasses, got {bad}. "
                "Pass the classes themselves, e.g. ModuleWrapPolicy({nn.TransformerEncoderLayer})."
            )
        self._classes = classes

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, self._classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self._classes]})"


def auto_wrap(
    module: nn.Module,
    policy: WrapPolicy,
    wrap_fn: Callable[..., nn.Module],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Wrap ``module``'s descendants bottom-up as ``policy`` says (``module`` itself is not).

    ``nonwrapped_numel`` leaves out the parameters of ``ignored_modules`` and
    ``ignored_params``, as torch's recursive wrap does: FSDP will not shard them.
    """
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy must be a callable policy(module, recurse, nonwrapped_numel) "
            f"such as ModuleWrapPolicy(...), got {policy!r}."
        )
    ignored_ids = {id(p) for m in ignored_modules for p in m.parameters()}
    ignored_ids |= {id(p) for p in ignored_params or ()}
    _wrap_children(module, policy, wrap_fn, ignored_modules, ignored_ids)


def _numel(module: nn.Module, ignored_params: set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in ignored_params)


def _wrap_children(
    module: nn.Module,
    policy: WrapPolicy,
    wrap_fn: Callable[..., nn.Module],
    ignored_modules: set[nn.Module],
    ignored_params: set[int],
) -> int:
    """Wrap inside ``module``; return how many parameters the wrapped descendants took."""
    taken = 0
    for name, child in list(module.named_children()):
        if child in ignored_modules or state_of(child) is not None:
            continue
        total = _numel(child, ignored_params)
        if not policy(module=child, recurse=True, nonwrapped_numel=total):
            continue
        inner = _wrap_children(child, policy, wrap_fn, ignored_modules, ignored_params)
        if policy(module=child, recurse=False, nonwrapped_numel=total - inner):
            overrides = policy.overrides(child) if isinstance(policy, CustomPolicy) else None
            setattr(module, name, wrap_fn(child, **(overrides or {})))
            taken += total
        else:
            taken += inner
    return taken


# ---------------------------------------------------------------------- manual wrapping
class _WrapConfig(threading.local):
    """The ``enable_wrap`` stack, one per thread: thread ranks (torch's threaded process group)
    each enter ``enable_wrap`` with their own process group at the same time."""

    def __init__(self) -> None:
        self.stack: list[tuple[Callable[..., nn.Module], dict[str, Any]]] = []


_wrap_config = _WrapConfig()


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any) -> Iterator[None]:
    """Within this context, :func:`wrap` wraps with ``wrapper_cls(module, **wrapper_kwargs)``.

    Args:
        wrapper_cls: usually ``FullyShardedDataParallel``.
        **wrapper_kwargs: constructor arguments shared by every ``wrap`` call.
    """
    _wrap_config.stack.append((wrapper_cls, dict(wrapper_kwargs)))
    try:
        yield
    finally:
        _wrap_config.stack.pop()


def wrap(module: nn.Module, **overrides: Any) -> nn.Module:
    """Wrap ``module`` inside :func:`enable_wrap`; return it unchanged outside.

    Args:
        module: the module to turn into an FSDP unit.
        **overrides: constructor arguments that replace those given to ``enable_wrap``.
    """
    if not _wrap_config.stack:
        return module
    wrapper_cls, kwargs = _wrap_config.stack[-1]
    return wrapper_cls(module, **{**kwargs, **overrides})
