"""The one table of ``torch.distributed`` collective names, by family.

torch spells one collective several ways: ``all_gather_single`` is the current single-tensor
all-gather, ``all_gather_into_tensor`` and ``_all_gather_base`` its deprecated aliases, and
``all_gather`` the same collective over a list of tensors; likewise for reduce-scatter. Every
tool that patches, counts or records collectives reads the names here, so "all_gather" means
the same set of functions to all of them: the patch helpers (:mod:`fsdp_testing.patching`), the
recorder (:mod:`fsdp_testing.recording`), the command line's collective counts, fault injection
and the hang reports' collective log. ``fsdp_core`` cannot import this package (it must not
depend on its test harness), so a test checks that every name it calls is a spelling here of the
family it means (``tests/library/test_collectives.py``).

Nothing here imports torch, so ``pytest --help`` stays fast.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = [
    "COLLECTIVES",
    "COLLECTIVE_FAMILIES",
    "COLLECTIVE_NAMES",
    "Form",
    "Spelling",
    "family_of",
    "spelling",
    "spellings",
]


class Form(enum.Enum):
    """How a spelling passes its data."""

    #: ``(output, input, ...)``, one tensor each (``all_gather_single``).
    TENSOR = "tensor"
    #: The same collective with a list of tensors on one side (``all_gather(tensor_list, t)``).
    LIST = "list"
    #: One tensor, reduced, sent or received in place (``all_reduce``, ``broadcast``, ``send``).
    INPLACE = "inplace"
    #: Picklable Python objects (``all_gather_object``).
    OBJECT = "object"
    #: No data: a synchronization point (``barrier``).
    SYNC = "sync"


class Spelling(NamedTuple):
    """One ``torch.distributed`` function and the collective it performs."""

    name: str
    """The attribute of ``torch.distributed``, e.g. ``"all_gather_into_tensor"``."""
    family: str
    """The collective it performs, e.g. ``"all_gather"``."""
    form: Form
    """How it passes its data."""
    sized: int | None
    """Index of the argument whose size is the volume of the call, the unsharded side:
    all-gather output, reduce-scatter input, the all-reduced, broadcast or sent tensor; None
    where no tensor moves (objects, barriers)."""


_T, _L, _I, _O, _S = Form.TENSOR, Form.LIST, Form.INPLACE, Form.OBJECT, Form.SYNC

#: Every spelling, by family; within a family the current single-tensor name comes first, then
#: its older aliases (newest first), then the other forms.
COLLECTIVES: tuple[Spelling, ...] = (
    Spelling("all_gather_single", "all_gather", _T, 0),
    Spelling("all_gather_into_tensor", "all_gather", _T, 0),
    Spelling("_all_gather_base", "all_gather", _T, 0),
    Spelling("all_gather", "all_gather", _L, 0),
    Spelling("all_gather_object", "all_gather", _O, None),
    Spelling("reduce_scatter_single", "reduce_scatter", _T, 1),
    Spelling("reduce_scatter_tensor", "reduce_scatter", _T, 1),
    Spelling("_reduce_scatter_base", "reduce_scatter", _T, 1),
    Spelling("reduce_scatter", "reduce_scatter", _L, 1),
    Spelling("all_reduce", "all_reduce", _I, 0),
    Spelling("broadcast", "broadcast", _I, 0),
    Spelling("broadcast_object_list", "broadcast", _O, None),
    Spelling("reduce", "reduce", _I, 0),
    Spelling("gather", "gather", _I, 0),
    Spelling("scatter", "scatter", _I, 0),
    Spelling("all_to_all_single", "all_to_all", _T, 1),
    Spelling("all_to_all", "all_to_all", _L, 1),
    Spelling("barrier", "barrier", _S, None),
    Spelling("monitored_barrier", "barrier", _S, None),
    Spelling("send", "send", _I, 0),
    Spelling("isend", "send", _I, 0),
    Spelling("recv", "recv", _I, 0),
    Spelling("irecv", "recv", _I, 0),
)

_BY_NAME: dict[str, Spelling] = {s.name: s for s in COLLECTIVES}

#: Every name of the table, in table order.
COLLECTIVE_NAMES: tuple[str, ...] = tuple(_BY_NAME)

#: Read-only map from a family (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ...)
#: to the ``torch.distributed`` names of every spelling of it, in table order.
COLLECTIVE_FAMILIES: Mapping[str, tuple[str, ...]] = types.MappingProxyType(
    {
        family: tuple(s.name for s in COLLECTIVES if s.family == family)
        for family in dict.fromkeys(s.family for s in COLLECTIVES)
    }
)


def spelling(name: str) -> Spelling | None:
    """The table's entry for ``torch.distributed.<name>``, or None for a name not in it."""
    return _BY_NAME.get(name)


def family_of(name: str) -> str | None:
    """The family of ``torch.distributed.<name>`` (``"all_gather_into_tensor"`` ->
    ``"all_gather"``), or None for a name not in the table."""
    found = _BY_NAME.get(name)
    return found.family if found is not None else None


def spellings(family: str, forms: Iterable[Form] | None = None) -> tuple[Spelling, ...]:
    """The spellings of ``family``, in table order, optionally only those of ``forms``.

    Args:
        family: a key of :data:`COLLECTIVE_FAMILIES`.
        forms: keep only these forms (default: every form).

    Raises:
        ValueError: ``family`` is not in the table; the message lists the families.
    """
    if family not in COLLECTIVE_FAMILIES:
        known = ", ".join(COLLECTIVE_FAMILIES)
        raise ValueError(f"unknown collective family {family!r}; one of {known}")
    wanted = set(forms) if forms is not None else set(Form)
    return tuple(s for s in COLLECTIVES if s.family == family and s.form in wanted)
