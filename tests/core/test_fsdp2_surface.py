"""A guard for the future: fsdp_core's FSDP2 door against the installed torch's FSDP2 public
surface (``torch.distributed.fsdp.__all__``, ``FSDPModule``'s public methods and their
parameters, the handles, the policy dataclasses' fields, ``fully_shard``'s and
``replicate``'s parameters). A new torch release that adds a name makes
``test_fsdp_core_has_torchs_fsdp2_surface`` fail, naming each gap; a name an older torch
lacks (torch 2.11 has no ``DataParallelMeshDims``, 2.14 no ``GradientReductionHandle``) is
simply not required.

Run it under another torch with that torch's interpreter, e.g.
``scripts/torch_matrix.sh 2.15.0 tests/core/test_fsdp2_surface.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

import fsdp_core

# What one public item of the surface is: for a callable, its parameters by name, each with
# its kind (positional or keyword-only) and whether it has a default.
Params = dict[str, tuple[str, bool]]
Surface = dict[str, Params | None]

_HANDLES = ("UnshardHandle", "GradientReductionHandle")
_POLICIES = ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims")
_FUNCTIONS = ("fully_shard", "register_fsdp_forward_method", "share_comm_ctx")


def _params(fn: Callable[..., Any]) -> Params:
    """``fn``'s parameters, ``self`` left out, as (kind, has a default)."""
    out: Params = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = "keyword-only" if p.kind is p.KEYWORD_ONLY else "positional"
        out[name] = (kind, p.default is not p.empty)
    return out


def _methods(cls: type, prefix: str) -> Surface:
    return {
        f"{prefix}.{name}": _params(getattr(cls, name))
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name))
    }


def surface(
    namespace: dict[str, Any], exported: list[str], replicate: Callable[..., Any] | None
) -> Surface:
    """The FSDP2 surface of one implementation: ``namespace`` maps the public names to its
    objects, ``exported`` is its ``__all__``, ``replicate`` its FSDP2-style ``replicate``.
    What ``namespace`` lacks is left out: a smaller surface, not an error."""
    found: Surface = {f"__all__: {name}": None for name in exported}
    for cls_name in ("FSDPModule", *_HANDLES):
        if cls_name in namespace:
            found.update(_methods(namespace[cls_name], cls_name))
    for policy in _POLICIES:
        if policy not in namespace:
            continue
        cls = namespace[policy]
        found[f"{policy}(...)"] = _params(cls)
        for field in dataclasses.fields(cls):
            found[f"{policy}.{field.name}"] = None
    for function in _FUNCTIONS:
        if function in namespace:
            found[f"{function}(...)"] = _params(namespace[function])
    if replicate is not None:
        found["replicate(...)"] = _params(replicate)
    return found


def torch_surface() -> Surface:
    """The installed torch's FSDP2 surface."""
    import torch.distributed.fsdp as torch_fsdp

    replicate: Callable[..., Any] | None
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:  # a torch without FSDP2's replicate
        replicate = None
    exported = list(getattr(torch_fsdp, "__all__", ()))
    names = {name: getattr(torch_fsdp, name) for name in exported if hasattr(torch_fsdp, name)}
    composable: Any
    try:  # before 2.6, FSDP2's names lived only here
        import torch.distributed._composable.fsdp as composable
    except ImportError:
        composable = None
    for name in ("FSDPModule", *_HANDLES, *_POLICIES, *_FUNCTIONS):
        if name not in names and hasattr(composable, name):
            names[name] = getattr(composable, name)
    return surface(names, exported, replicate)


def fsdp_core_surface() -> Surface:
    """fsdp_core's: its top-level names (both doors export there)."""
    names = {name: getattr(fsdp_core, name) for name in fsdp_core.__all__}
    return surface(names, list(fsdp_core.__all__), fsdp_core.replicate)


def missing(theirs: Surface, ours: Surface) -> list[str]:
    """Every item of ``theirs`` that ``ours`` lacks or takes differently, one line each: a
    name, a parameter, a parameter of another kind, or one that needs a value theirs does
    not. Parameters only ours has are fine."""
    gaps: list[str] = []
    for item, params in sorted(theirs.items()):
        if item not in ours:
            gaps.append(f"{item}{_show(params)}: missing")
            continue
        mine = ours[item]
        if params is None or mine is None:
            continue
        for name, (kind, has_default) in params.items():
            if name not in mine:
                gaps.append(f"{item} parameter {name!r} ({kind}): missing")
                continue
            my_kind, my_default = mine[name]
            if my_kind != kind:
                gaps.append(f"{item} parameter {name!r}: torch's is {kind}, ours {my_kind}")
            if has_default and not my_default:
                gaps.append(f"{item} parameter {name!r}: torch's has a default, ours does not")
        for name, (_, my_default) in mine.items():
            if name not in params and not my_default:
                gaps.append(f"{item} parameter {name!r}: ours requires it, torch has none")
    return gaps


def _show(params: Params | None) -> str:
    if not params:
        return ""
    return "(" + ", ".join(params) + ")"


def test_fsdp_core_has_torchs_fsdp2_surface():
    """Nothing of the installed torch's FSDP2 surface is missing from fsdp_core's door."""
    gaps = missing(torch_surface(), fsdp_core_surface())
    assert not gaps, (
        f"fsdp_core's FSDP2 door lacks {len(gaps)} item(s) of torch {torch.__version__}'s:\n"
        + "\n".join(gaps)
    )


def test_the_comparison_names_each_gap():
    """The comparison names a missing method, a missing parameter, a parameter of another
    kind, a required parameter torch does not have and a missing policy field."""
    theirs: Surface = {
        "FSDPModule.finalize_backward": {"async_op": ("keyword-only", True)},
        "replicate(...)": {
            "module": ("positional", False),
            "dp_mesh_dims": ("keyword-only", True),
        },
        "DataParallelMeshDims(...)": {"shard": ("positional", True)},
        "fully_shard(...)": {"module": ("positional", False)},
        "MixedPrecisionPolicy.param_dtype_override_fn": None,
    }
    ours: Surface = {
        "replicate(...)": {"module": ("positional", False)},
        "DataParallelMeshDims(...)": {"shard": ("keyword-only", True)},
        "fully_shard(...)": {"module": ("positional", False), "group": ("keyword-only", False)},
    }
    assert missing(theirs, ours) == [
        "DataParallelMeshDims(...) parameter 'shard': torch's is positional, ours keyword-only",
        "FSDPModule.finalize_backward(async_op): missing",
        "MixedPrecisionPolicy.param_dtype_override_fn: missing",
        "fully_shard(...) parameter 'group': ours requires it, torch has none",
        "replicate(...) parameter 'dp_mesh_dims' (keyword-only): missing",
    ]
    assert missing(theirs, theirs) == []


def _fsdp_core_namespace(*, without: str = "") -> tuple[dict[str, Any], list[str]]:
    exported = [name for name in fsdp_core.__all__ if name != without]
    return {name: getattr(fsdp_core, name) for name in exported}, exported


def test_a_name_torch_lacks_is_not_required():
    """A torch without a name (torch 2.11 has no ``DataParallelMeshDims``) gives a smaller
    surface, and fsdp_core having more is no gap."""
    names, exported = _fsdp_core_namespace(without="DataParallelMeshDims")
    older = surface(names, exported, fsdp_core.replicate)
    assert not any("DataParallelMeshDims" in item for item in older)
    assert "MixedPrecisionPolicy(...)" in older
    assert missing(older, fsdp_core_surface()) == []


def test_a_name_fsdp_core_lacks_is_named():
    """The other way round the same name is a gap: fsdp_core without ``DataParallelMeshDims``
    against a surface that has it names the export, the constructor and each field."""
    names, exported = _fsdp_core_namespace(without="DataParallelMeshDims")
    ours = surface(names, exported, fsdp_core.replicate)
    gaps = missing(fsdp_core_surface(), ours)
    assert "__all__: DataParallelMeshDims: missing" in gaps
    assert any(gap.startswith("DataParallelMeshDims(...)(") for gap in gaps), gaps
    fields = [f.name for f in dataclasses.fields(fsdp_core.DataParallelMeshDims)]
    for field in fields:
        assert f"DataParallelMeshDims.{field}: missing" in gaps
    assert len(gaps) == 2 + len(fields), gaps


def test_the_surface_sees_what_torch_has():
    """The introspection finds the items every supported torch has (so an empty comparison
    is not an empty surface)."""
    theirs = torch_surface()
    for item in (
        "__all__: fully_shard",
        "FSDPModule.unshard",
        "FSDPModule.set_requires_gradient_sync",
        "UnshardHandle.wait",
        "MixedPrecisionPolicy.reduce_dtype",
        "CPUOffloadPolicy.pin_memory",
        "fully_shard(...)",
    ):
        assert item in theirs, item
    assert theirs["fully_shard(...)"]["mesh"] == ("keyword-only", True)  # type: ignore[index]
