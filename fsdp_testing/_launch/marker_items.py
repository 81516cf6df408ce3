"""The ``distributed`` marker on collected items: the world sizes and fake ranks a list in it
parametrizes, and the one :class:`~fsdp_testing._launch.spec.DistSpec` each item runs with."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_testing._launch.spec import DistSpec, parse_marker

__all__ = ["parametrize", "spec_of", "spec_of_item"]

_WS_PARAM = "_fsdp_testing_world_size"
_RANK_PARAM = "_fsdp_testing_fake_rank"


def _marker_specs(node: Any) -> list[DistSpec] | None:
    marker = node.get_closest_marker("distributed")
    if marker is None:
        return None
    return parse_marker(marker.args, marker.kwargs)


def parametrize(metafunc: pytest.Metafunc) -> None:
    """``pytest_generate_tests``: a list of world sizes (ids ``ws2``) or fake ranks (``rank7``)
    in the marker parametrizes the test. A malformed marker leaves the test as it is: it fails
    alone when it runs (:func:`spec_of`), the rest of the session runs."""
    try:
        specs = _marker_specs(metafunc.definition)
    except (TypeError, ValueError):
        return
    if specs is None:
        return
    marker = metafunc.definition.get_closest_marker("distributed")
    assert marker is not None
    ws_arg = marker.kwargs.get("world_size", marker.args[0] if marker.args else None)
    if isinstance(ws_arg, (list, tuple)):
        metafunc.fixturenames.append(_WS_PARAM)
        sizes = list(dict.fromkeys(s.world_size for s in specs))
        metafunc.parametrize(_WS_PARAM, sizes, ids=[f"ws{n}" for n in sizes])
    if isinstance(marker.kwargs.get("rank"), (list, tuple)):
        metafunc.fixturenames.append(_RANK_PARAM)
        ranks = list(dict.fromkeys(s.rank for s in specs))
        metafunc.parametrize(_RANK_PARAM, ranks, ids=[f"rank{r}" for r in ranks])


_spec_key = pytest.StashKey["DistSpec | None"]()
_MISSING: Any = object()


def spec_of(item: pytest.Item) -> DistSpec | None:
    """The spec ``item`` runs with (None: not a distributed test), parsed once. A malformed
    marker fails the test (and that test alone) with the marker's error, naming the test."""
    spec = item.stash.get(_spec_key, _MISSING)
    if spec is _MISSING:
        error = None
        try:
            spec = spec_of_item(item)
        except (TypeError, ValueError) as exc:
            error = f"{item.nodeid}: {exc}"
        if error is not None:
            pytest.fail(error, pytrace=False)
        item.stash[_spec_key] = spec
    return spec


def spec_of_item(item: pytest.Item) -> DistSpec | None:
    """The spec ``item`` runs with (None: not a distributed test)."""
    specs = _marker_specs(item)
    if specs is None:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    if _WS_PARAM in params:
        specs = [s for s in specs if s.world_size == params[_WS_PARAM]]
    if _RANK_PARAM in params:
        specs = [s for s in specs if s.rank == params[_RANK_PARAM]]
    return specs[0]
