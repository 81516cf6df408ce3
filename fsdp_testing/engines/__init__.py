"""Sharding engines behind one protocol: ``fsdp_core`` (default), ``torch_fsdp1``, ``torch_fsdp2``.

Select one per run (``--fsdp-engine NAME``, which calls :func:`set_default_engine`), per block
(``with use_engine("torch_fsdp2"): ...``) or explicitly (``get_engine(name).wrap(module)``).
Engine modules import their sharding implementation lazily, so importing this package needs
neither ``fsdp_core`` nor torch's FSDP modules.
"""

from ._base import (
    UNIT_EVENTS,
    FSDPEngine,
    PatchTarget,
    clean_param_name,
    modules_selected_by_policy,
    translate_kwargs,
)
from ._registry import (
    DEFAULT_ENGINE,
    available_engines,
    current_engine,
    get_engine,
    register_engine,
    set_default_engine,
    unregister_engine,
    use_engine,
)

__all__ = [
    "DEFAULT_ENGINE",
    "UNIT_EVENTS",
    "FSDPEngine",
    "PatchTarget",
    "available_engines",
    "clean_param_name",
    "current_engine",
    "engine_for",
    "get_engine",
    "modules_selected_by_policy",
    "register_engine",
    "set_default_engine",
    "translate_kwargs",
    "unregister_engine",
    "use_engine",
]


def engine_for(module: object) -> FSDPEngine | None:
    """The engine that sharded ``module`` (or a submodule), or ``None`` for a plain module.

    The current engine is asked first; ``fsdp_core`` is only asked once it has been imported.

    Args:
        module: any ``nn.Module``.
    """
    import sys

    first = current_engine()
    candidates = [first] + [
        get_engine(name)
        for name in available_engines()
        if name != first.name and (name != "fsdp_core" or "fsdp_core" in sys.modules)
    ]
    for engine in candidates:
        try:
            if engine.manages(module):  # type: ignore[arg-type]
                return engine
        except NotImplementedError:
            continue
    return None
