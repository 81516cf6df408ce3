"""Which engine a test runs against: the registry, the default and the per-context choice.

The default engine is process wide (the plugin sets it from ``--fsdp-engine``); ``use_engine``
overrides it for the current context only. Context variables are per thread, so under thread
ranks each rank selects its engine itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from collections.abc import Callable, Iterator

from ._base import FSDPEngine

__all__ = [
    "DEFAULT_ENGINE",
    "available_engines",
    "current_engine",
    "get_engine",
    "register_engine",
    "resolve_engine",
    "set_default_engine",
    "unregister_engine",
    "use_engine",
]

#: The engine used when nothing else is selected.
DEFAULT_ENGINE = "fsdp_core"

# name -> "module:Class" (imported on first use) or a factory returning an engine.
_FACTORIES: dict[str, str | Callable[[], FSDPEngine]] = {
    "fsdp_core": "fsdp_testing.engines.fsdp_core:FSDPCoreEngine",
    "fsdp_core_fully_shard": "fsdp_testing.engines.fsdp_core_fully_shard:FSDPCoreFullyShardEngine",
    "fsdp_core_graph": "fsdp_testing.engines.fsdp_core_graph:FSDPCoreGraphEngine",
    "torch_fsdp1": "fsdp_testing.engines.torch_fsdp1:TorchFSDP1Engine",
    "torch_fsdp2": "fsdp_testing.engines.torch_fsdp2:TorchFSDP2Engine",
}
_INSTANCES: dict[str, FSDPEngine] = {}
_LOCK = threading.Lock()
_default_name = DEFAULT_ENGINE
_selected: contextvars.ContextVar[FSDPEngine | None] = contextvars.ContextVar(
    "fsdp_testing_engine", default=None
)


def available_engines() -> list[str]:
    """Names accepted by :func:`get_engine`, :func:`use_engine` and ``--fsdp-engine``."""
    return sorted(_FACTORIES)


def _validate_name(name: object, api: str) -> str:
    if not isinstance(name, str) or name not in _FACTORIES:
        raise ValueError(
            f"{api}: unknown FSDP engine {name!r}; valid engines: {', '.join(available_engines())}"
        )
    return name


def get_engine(name: str) -> FSDPEngine:
    """Returns the engine registered as ``name``.

    Args:
        name: one of :func:`available_engines`.

    Raises:
        ValueError: ``name`` is not registered; the message lists the valid names.
    """
    _validate_name(name, "get_engine")
    with _LOCK:
        engine = _INSTANCES.get(name)
        if engine is None:
            factory = _FACTORIES[name]
            if isinstance(factory, str):
                module_name, class_name = factory.split(":")
                engine = getattr(importlib.import_module(module_name), class_name)()
            else:
                engine = factory()
            _INSTANCES[name] = engine
    return engine


def register_engine(name: str, factory: Callable[[], FSDPEngine], *, replace: bool = False) -> None:
    """Adds an engine (for example a test double, or a third-party implementation).

    Args:
        name: the registry name.
        factory: called once, on first use, to build the engine.
        replace: allow replacing an existing registration (default False).
    """
    with _LOCK:
        if name in _FACTORIES and not replace:
            raise ValueError(
                f"register_engine: an engine named {name!r} exists; pass replace=True to replace it"
            )
        _FACTORIES[name] = factory
        _INSTANCES.pop(name, None)


def unregister_engine(name: str) -> None:
    """Removes an engine added with :func:`register_engine` (built-in names cannot be removed)."""
    if name in ("fsdp_core", "fsdp_core_fully_shard", "torch_fsdp1", "torch_fsdp2"):
        raise ValueError(f"unregister_engine: {name!r} is built in and cannot be removed")
    global _default_name
    with _LOCK:
        _FACTORIES.pop(name, None)
        _INSTANCES.pop(name, None)
        if _default_name == name:
            _default_name = DEFAULT_ENGINE


def set_default_engine(name: str) -> None:
    """Sets the process-wide engine (what the plugin calls for ``--fsdp-engine NAME``).

    Args:
        name: one of :func:`available_engines`.

    Raises:
        ValueError: ``name`` is not registered; the message lists the valid names.
    """
    global _default_name
    _default_name = _validate_name(name, "set_default_engine")


def current_engine() -> FSDPEngine:
    """The engine selected by the innermost :func:`use_engine`, else the default engine."""
    selected = _selected.get()
    return selected if selected is not None else get_engine(_default_name)


def resolve_engine(engine: str | FSDPEngine | None) -> FSDPEngine:
    """The engine that an ``engine=`` argument (or ``fsdp-testing check --engine``) names.

    Args:
        engine: None for :func:`current_engine`; an engine object, returned as is; a registered
            name; or ``"module:attribute"`` naming an engine object or class outside the
            registry (a class is instantiated), e.g. a deliberately broken engine in a test.

    Raises:
        ValueError: an unknown name, or a ``module:attribute`` whose module cannot be imported
            or has no such attribute.
        TypeError: ``module:attribute`` names a class that cannot be built without arguments,
            or something that is not an engine (no ``wrap`` method).
    """
    if engine is None:
        return current_engine()
    if not isinstance(engine, str):
        return engine
    if ":" not in engine:
        return get_engine(engine)
    module_name, _, attribute = engine.partition(":")
    registered = f"give a registered name ({', '.join(available_engines())})"
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"resolve_engine: cannot import {module_name!r} for engine {engine!r} ({error}); "
            f"run from the directory that holds it or put it on PYTHONPATH, or {registered}"
        ) from error
    found = getattr(module, attribute, None)
    if found is None:
        raise ValueError(
            f"resolve_engine: {module_name} has no attribute {attribute!r} (engine {engine!r}); "
            f"name an engine object or class defined there, or {registered}"
        )
    if isinstance(found, type):
        try:
            found = found()
        except TypeError as error:
            raise TypeError(
                f"resolve_engine: the engine class {engine!r} cannot be built without arguments "
                f"({error}); give its arguments defaults or name an engine object instead"
            ) from error
    if not callable(getattr(type(found), "wrap", None)):
        raise TypeError(
            f"resolve_engine: {engine!r} is {type(found).__name__!r}, not an engine: it has no "
            "wrap(module, process_group, **fsdp_kwargs) method; name an object or class that "
            f"follows fsdp_testing.engines.FSDPEngine, or {registered}"
        )
    return found


@contextlib.contextmanager
def use_engine(engine: str | FSDPEngine) -> Iterator[FSDPEngine]:
    """Selects the engine for the code inside the ``with`` block (this thread only).

    Args:
        engine: a registered name, or any :class:`FSDPEngine` object (registered or not).

    Yields:
        the selected engine.
    """
    chosen = get_engine(engine) if isinstance(engine, str) else engine
    if not callable(getattr(type(chosen), "wrap", None)):
        raise TypeError(f"use_engine: expected an engine name or FSDPEngine, got {engine!r}")
    token = _selected.set(chosen)
    try:
        yield chosen
    finally:
        _selected.reset(token)
