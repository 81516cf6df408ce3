"""Resolving a :class:`~fsdp_testing._protocol.FunctionRef` inside a rank process.

Test modules are loaded with pytest's assertion rewriting, so a failing ``assert`` on a rank
explains itself the way it would in the parent.

[Note: a test file run as a script]
``python test_x.py`` ending in ``run_tests()`` or ``unittest.main()`` (how torch's own
distributed test files are run) makes the test classes live in ``__main__``. A rank process's
``__main__`` is the fork server, so the rank loads the script from its file, under the name
``__mp_main__`` (as multiprocessing's spawn does): its ``if __name__ == "__main__":`` block does
not run again on the rank, which would start unittest over the fork server's command line. The
rank then points ``__main__`` at that module, and the parent points ``__mp_main__`` at its
``__main__`` (``alias_main_module``), so objects pickled either way resolve.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from fsdp_testing._protocol import FunctionRef

__all__ = ["MAIN_ALIAS", "alias_main_module", "resolve"]


def _same_file(module: ModuleType, path: str | None) -> bool:
    mod_file = getattr(module, "__file__", None)
    if path is None or mod_file is None:
        return True
    try:
        return os.path.samefile(mod_file, path)
    except OSError:
        return False


def _load_rewritten(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot load test module {name!r} from {path}")
    module = importlib.util.module_from_spec(spec)
    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path)
    except Exception:  # pragma: no cover - a pytest without the private API: plain asserts
        pass
    code = compile(tree, path, "exec", dont_inherit=True)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


# See [Note: a test file run as a script].
MAIN_ALIAS = "__mp_main__"


def _import_main(path: str | None) -> ModuleType:
    if path is None:
        raise ImportError(
            "a test defined in __main__ without a file (an interactive session or `python -c`) "
            "cannot run on rank processes: put it in a file, or use mode='thread' or 'local'"
        )
    module = sys.modules.get(MAIN_ALIAS)
    if module is None or not _same_file(module, path):
        module = _load_rewritten(MAIN_ALIAS, path)
    # Pickles from the parent name the script's classes `__main__.X`.
    sys.modules["__main__"] = module
    return module


def _import(name: str, path: str | None) -> ModuleType:
    if name == "__main__":
        return _import_main(path)
    module = sys.modules.get(name)
    if module is not None and _same_file(module, path):
        return module
    if (path is not None and os.path.basename(path).startswith(("test_", "conftest"))) or (
        path is not None and os.path.basename(path).endswith("_test.py")
    ):
        # Test modules: load from their file with asserts rewritten, as pytest did.
        parent = name.rpartition(".")[0]
        if parent:
            importlib.import_module(parent)
        return _load_rewritten(name, path)
    if module is not None:
        del sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        if path is None:
            raise
        return _load_rewritten(name, path)


def alias_main_module() -> None:
    """In the parent: let ``__mp_main__.X``, pickled by a rank, resolve to ``__main__.X``."""
    main = sys.modules.get("__main__")
    if main is not None:
        sys.modules.setdefault(MAIN_ALIAS, main)


def resolve(ref: FunctionRef) -> Any:
    """Import ``ref.module`` (from ``ref.path`` if needed) and return ``ref.qualname`` in it."""
    obj: Any = _import(ref.module, ref.path)
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    return obj
