"""A rank caught importing: read from its stack, so that time spent importing a module for the
first time is told apart from a hang (the launchers extend a test's deadline while a rank still
imports, and a report names the import, never a collective the rank did not reach yet).

[Note: importing is not hanging]
The first test that needs a heavy module (DDP imports ``torch._dynamo`` and sympy on first use,
several seconds on a loaded machine) spends that time on its clock: with a tight
``--dist-timeout`` it used to time out as "a hang in user code", and, since killed ranks never
said what they imported, every new set of ranks imported it all again and timed out too. Now,
at the deadline, a rank whose stack is in an import gets more time (``IMPORT_GRACE_S`` at a
time, while its import moves on, up to ``IMPORT_LIMIT_S`` in all); every rank that is stopped
first writes the modules it imported for the fork server to preload before it forks the next
ranks; and a rank still importing at the end is reported as such, with the fix.
"""

from __future__ import annotations

import dataclasses
import os
import sys

__all__ = ["IMPORT_GRACE_S", "IMPORT_LIMIT_S", "Importing", "importing", "module_of"]

IMPORT_GRACE_S = 15.0
"""How much longer a test may run, each time its deadline finds a rank importing."""
IMPORT_LIMIT_S = 120.0
"""The most extra time imports may take in one test."""

_FROZEN = "<frozen importlib"


@dataclasses.dataclass(frozen=True)
class Importing:
    """What a rank's stack says it imports."""

    module: str
    """The module whose import the rank's code started (``torch._dynamo``)."""
    now: str
    """The module being executed right now (``sympy.core.basic``; may equal ``module``)."""
    at: str
    """``path:line`` of the code that started the import."""


def module_of(path: str) -> str:
    """The dotted name of the module in ``path`` (``torch/_dynamo/__init__.py`` ->
    ``torch._dynamo``), from the longest ``sys.path`` entry it is under."""
    best = ""
    for entry in sys.path:
        root = os.path.join(os.path.abspath(entry or "."), "")
        if path.startswith(root) and len(root) > len(best):
            best = root
    rel = path[len(best) :] if best else os.path.basename(path)
    rel = rel.removesuffix(".py").removesuffix("/__init__")
    return rel.replace(os.sep, ".")


def importing(frames: list[tuple[str, int, str]]) -> Importing | None:
    """``frames``: one thread's stack, outermost first, as ``(path, line, function)``. The
    import in progress on it, or None when none is."""
    first = next((i for i, f in enumerate(frames) if f[0].startswith(_FROZEN)), None)
    if first is None:
        return None
    modules = [f for f in frames[first:] if f[2] == "<module>" and not f[0].startswith("<")]
    if not modules:
        return None
    caller = next((f for f in reversed(frames[:first]) if not f[0].startswith("<")), None)
    at = f"{caller[0]}:{caller[1]}" if caller else ""
    return Importing(module_of(modules[0][0]), module_of(modules[-1][0]), at)
