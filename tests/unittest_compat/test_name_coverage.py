"""Every public name of the installed torch's ``common_fsdp``, ``common_distributed`` and
``distributed._tensor.common_dtensor`` exists in our mirror modules, so the gap cannot reopen
silently when torch is upgraded.

A module's public surface is what it defines at top level (functions, classes, assignments,
also under ``if``/``try``) plus what it re-exports from ``torch.testing._internal`` (names tests
import through it, such as ``common_fsdp.TEST_SKIPS``), less what it deletes again (torch 2.15's
``common_fsdp`` assigns ``acc`` and then ``del acc``); names starting with ``_`` are private.
These tests run under every torch of the supported range (scripts/torch_matrix.sh).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from types import ModuleType

import pytest
import torch

MIRRORS = {
    "torch.testing._internal.common_fsdp": "fsdp_testing.common_fsdp",
    "torch.testing._internal.common_distributed": "fsdp_testing.common_distributed",
    "torch.testing._internal.distributed._tensor.common_dtensor": "fsdp_testing.common_dtensor",
}
# The common_utils names distributed and FSDP test files import (common_utils itself has
# hundreds of names for torch's whole suite; these are the distributed tests' share), with the
# torch release that added each (None: before the supported range's floor). The mirror has
# every one under every release; torch has one exactly from its release on.
COMMON_UTILS_NAMES: dict[str, tuple[int, int] | None] = {
    "TEST_WITH_DEV_DBG_ASAN": None,
    "TEST_XPU": None,
    "TEST_HPU": None,
    "TEST_CUDA": None,
    "TEST_WITH_ROCM": None,
    "xfailIf": None,
    "subtest": None,
    "skipIfRocm": None,
    "run_tests": None,
    "instantiate_parametrized_tests": None,
    "parametrize": None,
    "TestCase": None,
    "find_free_port": None,
    "get_cycles_per_ms": None,
    "set_rng_seed": None,
    "skip_but_pass_in_sandcastle_if": None,
    "retry_on_connect_failures": None,
    "FILE_SCHEMA": None,
    "IS_SANDCASTLE": None,
    # torch's pipelining tests (test/distributed/pipelining/)
    "TEST_ACCELERATOR": None,
    "TEST_MULTIACCELERATOR": None,
    "check_leaked_tensors": None,
    "HardwareClassification": (2, 14),
    "requires_multigpu": (2, 15),
    "requires_accelerator": (2, 15),
    "periodic": (2, 15),
    "TEST_WITH_PERIODIC": (2, 15),
}


def public_surface(module: ModuleType) -> set[str]:
    """The public names ``module``'s source defines or re-exports from torch's harness."""
    return surface_of_source(inspect.getsource(module))


def surface_of_source(source: str) -> set[str]:
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch.testing._internal"
            ):
                names.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.Delete):
                names.difference_update(
                    n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)
                )
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(source).body)
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("torch_name", sorted(MIRRORS))
def test_mirror_has_every_public_name_of_torchs_module(torch_name: str) -> None:
    theirs = importlib.import_module(torch_name)
    ours = importlib.import_module(MIRRORS[torch_name])
    surface = public_surface(theirs)
    assert len(surface) > 30, f"{torch_name}: surface parse found only {sorted(surface)}"
    missing = sorted(name for name in surface if not hasattr(ours, name))
    assert not missing, f"{MIRRORS[torch_name]} lacks {len(missing)} of torch's names: {missing}"
    undeclared = sorted(name for name in surface if name not in ours.__all__)
    assert not undeclared, f"{MIRRORS[torch_name]}.__all__ lacks {undeclared}"


def test_common_utils_mirror_has_the_names_distributed_tests_import() -> None:
    from fsdp_testing import common_utils
    from fsdp_testing._compat.env import TORCH_RELEASE

    torch_utils = importlib.import_module("torch.testing._internal.common_utils")
    for name, since in COMMON_UTILS_NAMES.items():
        expected = since is None or TORCH_RELEASE >= since
        assert hasattr(torch_utils, name) == expected, (
            f"torch {torch.__version__}'s common_utils {'lacks' if expected else 'has'} {name}: "
            f"COMMON_UTILS_NAMES says torch has it from {since}"
        )
        assert hasattr(common_utils, name), f"fsdp_testing.common_utils lacks {name}"
        assert name in common_utils.__all__, f"fsdp_testing.common_utils.__all__ lacks {name}"


def test_surface_parser_sees_definitions_reexports_and_conditionals() -> None:
    source = (
        "from torch.testing._internal.common_utils import TEST_CUDA as FLAG, run_tests\n"
        "from os import path\n"
        "if path:\n    A = 1\nelse:\n    B = 2\n"
        "try:\n    C = 3\nexcept ImportError:\n    D = 4\n"
        "def f(): pass\nclass K: pass\n_private = 5\n"
        "if path:\n    tmp = 6\n    del tmp\n"
        "E = 7\nF = 8\ndel E, F\nF = 9\n"
    )
    assert surface_of_source(source) == {"FLAG", "run_tests", "A", "B", "C", "D", "f", "K", "F"}
