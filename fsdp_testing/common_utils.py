"""The parts of ``torch.testing._internal.common_utils`` that distributed tests use:
``parametrize``, ``instantiate_parametrized_tests`` and ``run_tests``, without torch's dev-only
dependencies (``expecttest``)."""

from __future__ import annotations

import itertools
import re
import unittest
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = ["TestCase", "instantiate_parametrized_tests", "parametrize", "run_tests"]

_T = TypeVar("_T")
_ATTR = "_fsdp_testing_parametrize"
TestCase = unittest.TestCase


def parametrize(
    arg_str: str,
    arg_values: Iterable[Any],
    name_fn: Callable[..., str] | None = None,
) -> Callable[[_T], _T]:
    """Mark a test method to be expanded once per value by :func:`instantiate_parametrized_tests`.

    Args:
        arg_str: one argument name, or several separated by commas (values are then tuples).
        arg_values: the values.
        name_fn: makes the test-name suffix from the value(s) (default: ``name_value``).
    """
    names = [n.strip() for n in arg_str.split(",") if n.strip()]
    values = list(arg_values)
    if not names:
        raise ValueError(f"parametrize: no argument name in {arg_str!r}")

    def decorator(fn: _T) -> _T:
        stacked = list(getattr(fn, _ATTR, []))
        stacked.insert(0, (names, values, name_fn))
        setattr(fn, _ATTR, stacked)
        return fn

    return decorator


def _suffix(names: Sequence[str], value: Any, name_fn: Callable[..., str] | None) -> str:
    vals = value if len(names) > 1 else (value,)
    if len(vals) != len(names):
        raise ValueError(f"parametrize: {names} expects {len(names)} values, got {value!r}")
    if name_fn is not None:
        text = name_fn(*vals)
    else:
        text = "_".join(f"{n}_{v}" for n, v in zip(names, vals, strict=True))
    return re.sub(r"\W+", "_", str(text)).strip("_")


def instantiate_parametrized_tests(cls: type[_T]) -> type[_T]:
    """Replace every ``@parametrize``-marked method of ``cls`` by one method per combination,
    named ``<method>_<suffix>``; returns ``cls``."""
    for attr, fn in list(vars(cls).items()):
        specs = getattr(fn, _ATTR, None)
        if not specs:
            continue
        delattr(cls, attr)
        for combo in itertools.product(*(values for _, values, _ in specs)):
            kwargs: dict[str, Any] = {}
            parts = []
            for (names, _, name_fn), value in zip(specs, combo, strict=True):
                vals = value if len(names) > 1 else (value,)
                kwargs.update(zip(names, vals, strict=True))
                parts.append(_suffix(names, value, name_fn))
            name = f"{attr}_{'_'.join(parts)}"
            if hasattr(cls, name):
                raise ValueError(
                    f"instantiate_parametrized_tests: {cls.__name__}.{name} exists twice"
                )
            setattr(cls, name, _bind(fn, kwargs, name))
    return cls


def _bind(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Callable[..., Any]:
    def method(self: Any) -> Any:
        return fn(self, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = fn.__doc__
    for attr in ("_fsdp_testing_gpus",):
        if hasattr(fn, attr):
            setattr(method, attr, getattr(fn, attr))
    return method


def run_tests() -> None:
    """Run the calling module's tests with unittest (torch's ``run_tests``)."""
    unittest.main(module="__main__")
