"""Reading a parity failure's report in tests: the failure's text, and the first line of its
likely-cause section."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def failure_of(check: Callable[[], Any]) -> str:
    """The message of the ``AssertionError`` that ``check()`` must raise."""
    with pytest.raises(AssertionError) as caught:
        check()
    return str(caught.value)


def first_cause(message: str) -> str:
    """The first line of a failure's likely-cause section (``"none"`` when it names none)."""
    lines = message.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("likely cause"))
    if lines[at].startswith("likely cause: none"):
        return "none"
    return lines[at + 1].strip()
