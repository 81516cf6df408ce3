"""The table of collective names: complete for this torch, torch-free, and the names fsdp_core
calls are spellings of the families it means."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

from fsdp_testing.collectives import (
    COLLECTIVE_FAMILIES,
    COLLECTIVE_NAMES,
    COLLECTIVES,
    Form,
    family_of,
    spelling,
    spellings,
)

CORE = pathlib.Path(__file__).resolve().parents[2] / "src" / "fsdp_core"
#: The table's names that torch before 2.13 lacks (their aliases are the next entries).
NEW_IN_TORCH_2_13 = ("all_gather_single", "reduce_scatter_single")


def test_every_spelling_exists_in_this_torch_with_its_sized_argument():
    for entry in COLLECTIVES:
        function = getattr(dist, entry.name, None)
        if function is None and entry.name in NEW_IN_TORCH_2_13:
            continue  # an older torch: its older alias, next in the table, must exist
        assert callable(function), entry.name
        parameters = list(inspect.signature(function).parameters)
        if entry.sized is None:
            assert entry.form in (Form.OBJECT, Form.SYNC), entry
        else:
            sized = parameters[entry.sized]
            assert ("list" in sized) == (entry.form is Form.LIST), (entry, sized)


def test_families_map_and_lookups():
    assert COLLECTIVE_FAMILIES["all_gather"][:4] == (
        "all_gather_single",
        "all_gather_into_tensor",
        "_all_gather_base",
        "all_gather",
    )
    assert [s.name for s in spellings("reduce_scatter", [Form.TENSOR])] == [
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
    ]
    assert family_of("all_gather_into_tensor") == "all_gather"
    assert family_of("isend") == "send"
    assert family_of("get_rank") is None and spelling("get_rank") is None
    assert sorted(COLLECTIVE_NAMES) == sorted(
        n for names in COLLECTIVE_FAMILIES.values() for n in names
    )
    with pytest.raises(TypeError):
        COLLECTIVE_FAMILIES["all_reduce"] = ("all_reduce",)  # type: ignore[index]
    with pytest.raises(
        ValueError, match="unknown collective family 'allgather'; one of all_gather"
    ):
        spellings("allgather")


def test_the_table_imports_no_torch():
    code = "import sys, fsdp_testing.collectives; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _collective_names_in(path: pathlib.Path) -> list[str]:
    """Names of torch.distributed collectives that ``path`` calls (``dist.all_reduce``) or
    looks up (``getattr(dist, "all_gather_single")``), in order of first appearance."""
    c10d = dist.distributed_c10d
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            name = node.attr if node.value.id == "dist" else ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        if name in NEW_IN_TORCH_2_13:  # a collective, whether or not this torch has it
            found.append((node.lineno, node.col_offset, name))
            continue
        function = getattr(c10d, name, None) if name.isidentifier() else None
        if not inspect.isfunction(function):
            continue
        parameters = inspect.signature(function).parameters
        if "group" in parameters and (
            "async_op" in parameters or name.endswith(("_object", "_object_list"))
        ):
            found.append((node.lineno, node.col_offset, name))
    return list(dict.fromkeys(name for _, _, name in sorted(found)))


def test_fsdp_core_calls_only_table_names_newest_first():
    """fsdp_core cannot import this table; every collective it calls is a spelling of the
    table, and where it picks a spelling by what torch has, it tries the table's names of that
    family newest first (the current name, then its older alias)."""
    names = [n for path in sorted(CORE.rglob("*.py")) for n in _collective_names_in(path)]
    assert {"all_gather_single", "reduce_scatter_single", "all_reduce"} <= set(names)
    assert set(names) <= set(COLLECTIVE_NAMES), sorted(set(names) - set(COLLECTIVE_NAMES))
    collectives = CORE / "_collectives.py"
    used = _collective_names_in(collectives)
    for family in dict.fromkeys(f for n in used if (f := family_of(n)) is not None):
        mine = [n for n in used if family_of(n) == family and spelling(n).form is Form.TENSOR]  # type: ignore[union-attr]
        table = [s.name for s in spellings(family, [Form.TENSOR])]
        assert mine == table[: len(mine)], (family, mine, table)
