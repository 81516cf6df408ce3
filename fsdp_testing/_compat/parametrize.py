"""``parametrize``, ``subtest`` and ``instantiate_parametrized_tests`` with torch's test names.

[Note: parametrized test names]
A generated method is named ``<test>_<suffix>``; every rank looks the method up by that name, so
it must be the same string in every process. As torch's: the suffix is ``name_fn(*values)``
when given, a ``subtest``'s ``name``, else one part per argument: a dtype's name
(``float32``), a device's string, ``<arg>_<value>`` for an int, float or str (dots become
underscores), and ``<arg><index>`` for any other object (an enum, a config object), never the
object's repr, which can hold a memory address. Stacked decorators join their suffixes top to
bottom.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
import unittest
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from .env import IS_SANDCASTLE, TEST_WITH_ROCM

__all__ = [
    "find_free_port",
    "get_cycles_per_ms",
    "instantiate_parametrized_tests",
    "parametrize",
    "retry_on_connect_failures",
    "run_tests",
    "skipIfRocm",
    "skipIfTorchDynamo",
    "skip_but_pass_in_sandcastle",
    "skip_but_pass_in_sandcastle_if",
    "subtest",
    "xfailIf",
]

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])
_SPECS = "_fsdp_testing_parametrize"
_GENERATED = "_fsdp_testing_parametrized_in"  # on a generated case: the class it was made for


class subtest:
    """One explicit case of :class:`parametrize`: its values, an optional test-name suffix and
    decorators applied to that case only.

    Args:
        arg_values: the value (one argument) or tuple of values.
        name: the suffix of the generated test's name (default: derived from the values).
        decorators: applied to the generated test, e.g. ``[unittest.expectedFailure]``.
    """

    __slots__ = ("arg_values", "decorators", "name")

    def __init__(
        self, arg_values: Any, name: str | None = None, decorators: Iterable[Any] | None = None
    ) -> None:
        self.arg_values = arg_values
        self.name = name
        self.decorators = list(decorators) if decorators else []


def _value_part(index: int, arg: str, value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (int, float, str)):
        return f"{arg}_{str(value).replace('.', '_')}"
    return f"{arg}{index}"


class parametrize:
    """Expand a test method once per value (see [Note: parametrized test names]); the class must
    be passed to :func:`instantiate_parametrized_tests`.

    Args:
        arg_str: the argument name, or several separated by commas (values are then tuples).
        arg_values: the values, tuples of values, or :class:`subtest` cases.
        name_fn: makes the name suffix from one case's values (default: see the note).
    """

    def __init__(
        self, arg_str: str, arg_values: Iterable[Any], name_fn: Callable[..., str] | None = None
    ) -> None:
        self.arg_names = [s.strip() for s in arg_str.split(",") if s.strip()]
        self.arg_values = arg_values
        self.name_fn = name_fn

    def __call__(self, fn: _F) -> _F:
        specs = list(getattr(fn, _SPECS, []))
        specs.insert(0, self)
        setattr(fn, _SPECS, specs)
        return fn

    def cases(self, test_name: str) -> list[tuple[str, dict[str, Any], list[Any]]]:
        """``(suffix, keyword arguments, decorators)`` per case, in order."""
        if not self.arg_names:
            return [("", {}, [])]
        found = []
        for index, raw in enumerate(self.arg_values):
            explicit, decorators, values = None, [], raw
            if isinstance(raw, subtest):
                explicit, decorators, values = raw.name, raw.decorators, raw.arg_values
            parts: Sequence[Any] = list(values) if len(self.arg_names) > 1 else [values]
            if len(parts) != len(self.arg_names):
                raise ValueError(
                    f"parametrize({', '.join(self.arg_names)!r}) on {test_name}: case {index} "
                    f"has {len(parts)} values for {len(self.arg_names)} names: {values!r}"
                )
            if explicit:
                suffix = explicit
            elif self.name_fn is not None:
                suffix = str(self.name_fn(*parts))
            else:
                suffix = "_".join(
                    _value_part(index, a, v) for a, v in zip(self.arg_names, parts, strict=True)
                )
            found.append((suffix, dict(zip(self.arg_names, parts, strict=True)), decorators))
        if not found:
            raise ValueError(
                f"parametrize on {test_name}: arg_values is empty (a generator used twice?)"
            )
        return found


def _combinations(
    test_name: str, specs: Sequence[parametrize]
) -> list[tuple[str, dict[str, Any], list[Any]]]:
    combos: list[tuple[str, dict[str, Any], list[Any]]] = [("", {}, [])]
    for spec in specs:
        grown = []
        for name, kwargs, decorators in combos:
            for suffix, more, extra in spec.cases(test_name):
                twice = set(kwargs) & set(more)
                if twice:
                    raise ValueError(
                        f"{test_name}: parametrized twice over {sorted(twice)}; each argument "
                        "may be parametrized by one decorator"
                    )
                joined = "_".join(p for p in (name, suffix) if p)
                grown.append((joined, {**kwargs, **more}, decorators + list(extra)))
        combos = grown
    return combos


def _instantiate(
    cls: type, test: Callable[..., Any], name: str, kwargs: dict[str, Any], decorators: list[Any]
) -> Callable[..., Any]:
    if decorators:
        # A fresh function per case: decorators such as expectedFailure set attributes on
        # the function they get, which must not leak into the other cases.
        @functools.wraps(test)
        def case_function(*args: Any, **kw: Any) -> Any:
            return test(*args, **kw)

        for decorator in decorators:
            case_function = decorator(case_function)
        test = case_function

    @functools.wraps(test)
    def method(self: Any) -> Any:
        return test(self, **kwargs)

    method.__dict__.pop(_SPECS, None)
    method.__dict__.pop("__wrapped__", None)
    setattr(method, _GENERATED, cls)
    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    return method


def _reject_inherited(generic_cls: type) -> None:
    """[Note: inherited parametrized tests]
    torch's ``instantiate_parametrized_tests`` walks ``dir(cls)``, inherited attributes
    included, and deletes each parametrized test from the class before adding its cases. A
    parametrized test inherited from a base class (generic, or one of the cases generated
    there, which keep torch's ``parametrize_fn``) is not the class's own attribute, so torch's
    ``delattr`` raises ``AttributeError: type object 'Sub' has no attribute 'test_x'`` and the
    test file fails to import. The same class raises the same error here, before changing the
    class, with what to do about it."""
    for attr in dir(generic_cls):
        if attr in vars(generic_cls):
            continue
        value = getattr(generic_cls, attr, None)
        owner = getattr(value, _GENERATED, None)
        if getattr(value, _SPECS, None) is None and owner is None:
            continue
        defined = next(
            (base.__name__ for base in generic_cls.__mro__[1:] if attr in vars(base)), "a base"
        )
        fix = (
            f"{attr} was generated by instantiate_parametrized_tests({defined}): the subclass "
            "inherits it as it is, so leave the subclass out of instantiate_parametrized_tests"
            if owner is not None
            else f"call instantiate_parametrized_tests({defined}) on the class that defines it "
            "(the subclass then inherits the generated tests) and leave the subclass out, or "
            "define the parametrized test on the subclass itself"
        )
        raise AttributeError(
            f"type object {generic_cls.__name__!r} has no attribute {attr!r}: "
            f"instantiate_parametrized_tests({generic_cls.__name__}) found {attr}, a "
            f"parametrized test inherited from {defined}, which torch's "
            f"instantiate_parametrized_tests cannot remove from {generic_cls.__name__} either "
            f"(it raises this error). Fix: {fix}"
        )


def instantiate_parametrized_tests(generic_cls: type[_T]) -> type[_T]:
    """Replace each :class:`parametrize`-decorated method of ``generic_cls`` with one method
    per combination (see [Note: parametrized test names]); usable as a class decorator.

    Args:
        generic_cls: the test class.

    Raises:
        AttributeError: ``generic_cls`` inherits a parametrized test (generic, or generated by
            an earlier call on a base class), as torch's raises (see [Note: inherited
            parametrized tests]).
    """
    _reject_inherited(generic_cls)
    for attr, test in list(vars(generic_cls).items()):
        specs = getattr(test, _SPECS, None)
        if not specs:
            continue
        delattr(generic_cls, attr)
        for suffix, kwargs, decorators in _combinations(attr, specs):
            name = f"{attr}_{suffix}" if suffix else attr
            if hasattr(generic_cls, name):
                raise ValueError(
                    f"instantiate_parametrized_tests: {generic_cls.__name__}.{name} is defined "
                    "twice; give the cases distinct names (name_fn= or subtest(name=...))"
                )
            setattr(generic_cls, name, _instantiate(generic_cls, test, name, kwargs, decorators))
    return generic_cls


def xfailIf(condition: bool) -> Callable[[_F], _F]:
    """``unittest.expectedFailure`` when ``condition`` holds, else the test unchanged."""

    def decorator(fn: _F) -> _F:
        return unittest.expectedFailure(fn) if condition else fn

    return decorator


def skip_but_pass_in_sandcastle(reason: str) -> Callable[[_F], _F]:
    """Skip the test with ``reason``; on Meta's internal CI (sandcastle) it passes instead."""
    return skip_but_pass_in_sandcastle_if(True, reason)


def skip_but_pass_in_sandcastle_if(condition: bool, reason: str) -> Callable[[_F], _F]:
    """Skip the test with ``reason`` when ``condition`` holds; on Meta's internal CI the test
    passes instead of skipping (torch's behaviour there; ``IS_SANDCASTLE`` is False elsewhere).
    """

    def decorator(fn: _F) -> _F:
        if not condition:
            return fn
        if not IS_SANDCASTLE:
            return unittest.skip(reason)(fn)

        @functools.wraps(fn)
        def passes(*args: Any, **kwargs: Any) -> None:
            print(f"Skipping {fn.__name__} on sandcastle: {reason}", file=sys.stderr)

        return passes  # type: ignore[return-value]

    return decorator


def skipIfRocm(
    func: Callable[..., Any] | None = None,
    *,
    msg: str = "test doesn't currently work on the ROCm stack",
) -> Any:
    """Skip on ROCm builds (torch's CI); everywhere else the test runs."""

    def decorator(fn: _F) -> _F:
        return unittest.skipIf(TEST_WITH_ROCM, msg)(fn) if TEST_WITH_ROCM else fn

    return decorator(func) if func is not None else decorator


def skipIfTorchDynamo(msg: str = "test doesn't currently work with dynamo") -> Any:
    """Skip when torch's CI runs the suite under dynamo (``PYTORCH_TEST_WITH_DYNAMO=1``)."""
    enabled = os.environ.get("PYTORCH_TEST_WITH_DYNAMO") == "1"
    target = msg if callable(msg) else None
    reason = "test doesn't currently work with dynamo" if callable(msg) else msg

    def decorator(fn: _F) -> _F:
        return unittest.skip(reason)(fn) if enabled else fn

    return decorator(target) if target is not None else decorator


def find_free_port() -> int:
    """A TCP port on localhost that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


ADDRESS_IN_USE = "Address already in use"
CONNECT_TIMEOUT = "connect() timed out."


def retry_on_connect_failures(
    func: Callable[..., Any] | None = None,
    connect_errors: tuple[str, ...] = (ADDRESS_IN_USE,),
) -> Any:
    """Retry ``func`` (up to 10 times, 0.1 s apart) while it raises a RuntimeError whose message
    holds one of ``connect_errors`` (a port taken between choosing and binding it)."""
    if func is None:
        return functools.partial(retry_on_connect_failures, connect_errors=connect_errors)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tries = 10
        while True:
            try:
                return func(*args, **kwargs)
            except RuntimeError as error:
                if tries <= 0 or not any(e in str(error) for e in connect_errors):
                    raise
                tries -= 1
                time.sleep(0.1)

    return wrapper


def get_cycles_per_ms(device: str = "cuda") -> float:
    """GPU clock cycles per millisecond, for ``torch.cuda._sleep(cycles)`` delays.

    Measured once per process as torch does (the median of timed ``_sleep`` calls). Without
    that device the calling test is skipped with the reason: a CUDA sleep has no CPU meaning.

    Args:
        device: the device whose clock is measured (default ``"cuda"``).
    """
    if device != "cuda" or not torch.cuda.is_available():
        raise unittest.SkipTest(
            f"get_cycles_per_ms({device!r}) times torch.cuda._sleep, which needs a CUDA device; "
            "this machine has none"
        )
    return _measure_cycles_per_ms()


@functools.lru_cache(maxsize=1)
def _measure_cycles_per_ms() -> float:
    samples = []
    for _ in range(10):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        samples.append(1_000_000 / start.elapsed_time(end))
    samples.sort()
    return float(samples[len(samples) // 2])


def run_tests(argv: list[str] | None = None) -> None:
    """Run the calling module's tests with unittest (torch's ``run_tests``).

    Args:
        argv: command line (default ``sys.argv``).
    """
    unittest.main(module="__main__", argv=argv)
