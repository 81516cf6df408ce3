"""Sharding engines behind one protocol: ``fsdp_core`` (default), ``fsdp_core_fully_shard``,
``fsdp_core_graph`` (graph mode: it steps the model itself, see :class:`StepsItself`),
``torch_fsdp1``, ``torch_fsdp2``.

Select one per run (``--fsdp-engine NAME``, which calls :func:`set_default_engine`), per block
(``with use_engine("torch_fsdp2"): ...``) or explicitly (``get_engine(name).wrap(module)``).
Engine modules import their sharding implementation lazily, so importing this package needs
neither ``fsdp_core`` nor torch's FSDP modules.

By role: ``_base`` (the :class:`FSDPEngine` protocol, :class:`BaseEngine` defaults, shared
helpers), ``_registry`` (names, the default and the per-context choice), ``_probe`` (what the
recorder asks an engine), ``_volume`` (the theoretical communication of a step), ``_wrapper``
(the FSDP1-style wrapper API both ``fsdp_core`` and FSDP1 have), ``_composable`` (the
``fully_shard`` API both ``fsdp_core`` and FSDP2 have), ``_root_only`` (the defaults of a
root-only engine, DDP- or ZeRO-style, [Note: root-only engines]), ``_core`` (what the ``fsdp_core``
engines share: they read the core through ``fsdp_core.unit_views`` and its events), and one
module per engine.
"""

from ._base import (
    UNIT_EVENTS,
    BaseEngine,
    FSDPEngine,
    PatchTarget,
    StepsItself,
    clean_param_name,
    engine_optimizer,
    has_nested_units,
    modules_selected_by_policy,
    translate_kwargs,
)
from ._probe import Probe
from ._registry import (
    DEFAULT_ENGINE,
    available_engines,
    current_engine,
    get_engine,
    register_engine,
    resolve_engine,
    set_default_engine,
    unregister_engine,
    use_engine,
)
from ._root_only import RootOnlyEngine
from ._volume import CommVolume, UnitVolume

__all__ = [
    "DEFAULT_ENGINE",
    "UNIT_EVENTS",
    "BaseEngine",
    "CommVolume",
    "FSDPEngine",
    "PatchTarget",
    "Probe",
    "RootOnlyEngine",
    "StepsItself",
    "UnitVolume",
    "available_engines",
    "clean_param_name",
    "current_engine",
    "engine_for",
    "engine_optimizer",
    "get_engine",
    "has_nested_units",
    "modules_selected_by_policy",
    "register_engine",
    "resolve_engine",
    "set_default_engine",
    "translate_kwargs",
    "unregister_engine",
    "use_engine",
]


def engine_for(module: object) -> FSDPEngine | None:
    """The engine that sharded ``module`` (or a submodule), or ``None`` for a plain module.

    The current engine is asked first, then every registered engine.

    Args:
        module: any ``nn.Module``.
    """
    first = current_engine()
    candidates = [first] + [get_engine(n) for n in available_engines() if n != first.name]
    for engine in candidates:
        try:
            if engine.manages(module):  # type: ignore[arg-type]
                return engine
        except NotImplementedError:
            continue
    return None
