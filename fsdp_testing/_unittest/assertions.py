"""torch's tensor-aware ``TestCase.assertEqual``, on the public ``torch.testing.assert_close``.

[Note: torch's assertEqual]
torch's ``TestCase.assertEqual(x, y, msg=None, *, atol=None, rtol=None, equal_nan=True,
exact_dtype=True, exact_device=False, exact_layout=False, exact_stride=False)`` compares:

- tensors (and DTensors, by their local shards) with tolerances that default by dtype (those of
  ``torch.testing.assert_close``: float32 ``rtol=1.3e-6, atol=1e-5``, bfloat16 ``1.6e-2, 1e-5``,
  ...), the dtype checked unless ``exact_dtype=False``, the device only with ``exact_device``;
- a tensor against a sequence of numbers (the sequence becomes a tensor of the tensor's dtype);
- a number against a number or a one-element tensor, with float32's tolerances for floats and
  no dtype check (``1 == 1.0``); a bool against a bool, a number or a one-element tensor;
- sequences (lists, tuples, ``nn.ModuleList``, ...) and mappings element by element;
- anything else with ``==`` (unittest's own messages).

A failure names the element (``item [1]['weight']``). ``msg`` is appended to the generated
message (unittest's ``longMessage``), or, when callable, called with it. ``self.precision`` and
``self.rel_tol`` raise the default tolerances, as torch's ``precisionOverride`` does.
"""

from __future__ import annotations

import collections.abc
import enum
import math
import pathlib
import random
import subprocess
import sys
import unittest
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn

__all__ = ["SEED", "TestCase", "compare", "set_rng_seed"]

# Defaults of torch.testing.assert_close (documented there), by dtype: (rtol, atol).
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}
_SEQUENCES = (collections.abc.Sequence, nn.Sequential, nn.ModuleList, nn.ParameterList)
_MAPPINGS = (collections.abc.Mapping, nn.ModuleDict, nn.ParameterDict)
_NUMBERS = (int, float, complex)


def _is_number(value: object) -> bool:
    return isinstance(value, _NUMBERS) and not isinstance(value, bool)


def _is_sequence(value: object) -> bool:
    return isinstance(value, _SEQUENCES) and not isinstance(value, (str, bytes))


def _one_element(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _as_tensor(value: object) -> object:
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return torch.as_tensor(value)
    return value


def _unwrap_dtensors(x: object, y: object) -> tuple[object, object]:
    if "torch.distributed.tensor" not in sys.modules:
        return x, y
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor) and isinstance(y, DTensor):
        if x.placements != y.placements:
            raise AssertionError(f"DTensor placements differ: {x.placements} != {y.placements}")
        return x.to_local(), y.to_local()
    if isinstance(x, DTensor) != isinstance(y, DTensor):
        raise TypeError(
            "assertEqual: comparing a DTensor with a plain tensor is ambiguous; compare "
            ".full_tensor() (the whole tensor) or .to_local() (this rank's shard)"
        )
    return x, y


class _Options:
    def __init__(self, **kwargs: Any) -> None:
        self.atol: float | None = kwargs["atol"]
        self.rtol: float | None = kwargs["rtol"]
        self.atol_floor: float = kwargs["atol_floor"]
        self.rtol_floor: float = kwargs["rtol_floor"]
        self.equal_nan: bool = kwargs["equal_nan"]
        self.exact_dtype: bool = kwargs["exact_dtype"]
        self.exact_device: bool = kwargs["exact_device"]
        self.exact_layout: bool = kwargs["exact_layout"]
        self.exact_stride: bool = kwargs["exact_stride"]
        if (self.atol is None) != (self.rtol is None):
            raise ValueError(
                f"assertEqual: pass both atol and rtol or neither (got atol={self.atol}, "
                f"rtol={self.rtol})"
            )

    def tolerances(self, *dtypes: torch.dtype) -> tuple[float | None, float | None]:
        if self.atol is not None:
            return max(self.rtol or 0.0, self.rtol_floor), max(self.atol, self.atol_floor)
        if not (self.atol_floor or self.rtol_floor):
            return None, None
        pairs = [_TOLERANCES.get(d, (0.0, 0.0)) for d in dtypes]
        rtol, atol = max(p[0] for p in pairs), max(p[1] for p in pairs)
        return max(rtol, self.rtol_floor), max(atol, self.atol_floor)


def _where(path: str) -> str:
    return f"\nThe failure occurred for item {path}" if path else ""


def _unrelated(x: torch.Tensor, y: torch.Tensor) -> bool:
    return not (isinstance(x, type(y)) or isinstance(y, type(x)))


def _compare_tensors(x: torch.Tensor, y: torch.Tensor, opts: _Options, path: str) -> str | None:
    rtol, atol = opts.tolerances(x.dtype, y.dtype)
    if not opts.exact_device and x.device != y.device:
        y = y.to(x.device)
    options: dict[str, Any] = {
        "rtol": rtol,
        "atol": atol,
        "equal_nan": opts.equal_nan,
        "check_device": opts.exact_device,
        "check_dtype": opts.exact_dtype,
        "check_layout": opts.exact_layout,
        "check_stride": opts.exact_stride,
    }
    try:
        if _unrelated(x, y):
            # Two tensor subclasses neither of which is the other's (a LocalTensor against an
            # AsyncCollectiveTensor): assert_close refuses the pair, torch's assertEqual
            # compares their values. See _AnyTensorPair.
            from torch.testing._comparison import not_close_error_metas

            mismatches = not_close_error_metas(x, y, pair_types=(_any_tensor_pair(),), **options)
            if mismatches:
                raise mismatches[0].to_error()
        else:
            torch.testing.assert_close(x, y, **options)
    except AssertionError as error:
        return f"{error}{_where(path)}"
    return None


def _any_tensor_pair() -> type:
    """``assert_close``'s pair for tensors without its check that the two types are related,
    as torch's ``TestCase`` pairs them (its ``TensorOrArrayPair``)."""
    from torch.testing._comparison import TensorLikePair

    class _AnyTensorPair(TensorLikePair):
        def _process_inputs(
            self, actual: Any, expected: Any, *, id: Any, allow_subclasses: bool
        ) -> Any:
            self._check_inputs_isinstance(actual, expected, cls=torch.Tensor)
            for tensor in (actual, expected):
                self._check_supported(tensor, id=id)
            return actual, expected

    return _AnyTensorPair


def _compare_numbers(x: object, y: object, opts: _Options, path: str) -> str | None:
    a = x.item() if isinstance(x, torch.Tensor) else x
    b = y.item() if isinstance(y, torch.Tensor) else y
    a, b = (int(cast(Any, v)) if isinstance(v, (bool, enum.Enum)) else v for v in (a, b))
    assert isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS)
    if isinstance(a, int) and isinstance(b, int):
        rtol, atol = 0.0, 0.0
    elif opts.atol is not None:
        rtol, atol = opts.rtol or 0.0, opts.atol
    else:
        dtype = torch.complex64 if isinstance(a, complex) or isinstance(b, complex) else None
        rtol, atol = _TOLERANCES[dtype or torch.float32]
    rtol, atol = max(rtol, opts.rtol_floor), max(atol, opts.atol_floor)
    if a == b:
        return None
    if opts.equal_nan and all(
        isinstance(v, float) and math.isnan(v) for v in (complex(a).real, complex(b).real)
    ):
        return None
    diff = abs(a - b)
    if diff <= atol + rtol * abs(b):
        return None
    return (
        f"Scalars are not close!\n\nExpected {b} but got {a}.\nAbsolute difference: {diff} (up "
        f"to {atol} allowed)\nRelative difference: {diff / abs(b) if b else math.inf} (up to "
        f"{rtol} allowed){_where(path)}"
    )


def compare(x: object, y: object, opts: _Options, path: str = "") -> str | None:
    """The first mismatch between ``x`` and ``y`` as a message, or None (see [Note: torch's
    assertEqual])."""
    x, y = _as_tensor(x), _as_tensor(y)
    if isinstance(x, torch.Tensor) and _is_sequence(y):
        y = torch.as_tensor(y, dtype=x.dtype, device=x.device)
    elif _is_sequence(x) and isinstance(y, torch.Tensor):
        x = torch.as_tensor(x, dtype=y.dtype, device=y.device)
    x, y = _unwrap_dtensors(x, y)
    if x is None or y is None:
        return None if x is y else f"None mismatch: {x!r} is not {y!r}{_where(path)}"
    if isinstance(x, bool) or isinstance(y, bool):
        other = y if isinstance(x, bool) else x
        if isinstance(other, bool) or _is_number(other) or _one_element(other):
            a = bool(x.item() if isinstance(x, torch.Tensor) else x)
            b = bool(y.item() if isinstance(y, torch.Tensor) else y)
            return None if a == b else f"Booleans mismatch: {a} is not {b}{_where(path)}"
    if _is_number(x) or _is_number(y):
        other = y if _is_number(x) else x
        if _is_number(other) or _one_element(other) or isinstance(other, enum.IntEnum):
            return _compare_numbers(x, y, opts, path)
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return _compare_tensors(x, y, opts, path)
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (
            f"cannot compare {type(x).__name__} with {type(y).__name__}: a tensor compares with "
            f"a tensor, a sequence of numbers, or (one element) a number{_where(path)}"
        )
    if isinstance(x, _MAPPINGS) and isinstance(y, _MAPPINGS):
        missing, extra = [k for k in y if k not in x], [k for k in x if k not in y]
        if missing or extra:
            return f"keys differ: missing {missing}, unexpected {extra}{_where(path)}"
        for key in x:
            found = compare(x[key], y[key], opts, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if _is_sequence(x) and _is_sequence(y):
        xs, ys = list(cast(Any, x)), list(cast(Any, y))
        if len(xs) != len(ys):
            return f"The length of the sequences mismatch: {len(xs)} != {len(ys)}{_where(path)}"
        for index, (a, b) in enumerate(zip(xs, ys, strict=True)):
            found = compare(a, b, opts, f"{path}[{index}]")
            if found:
                return found
        return None
    try:
        unittest.TestCase().assertEqual(x, y)
    except AssertionError as error:
        return f"{error}{_where(path)}"
    return None


SEED = 1234
"""torch's default test seed."""


def set_rng_seed(seed: int | None = None) -> None:
    """Seed torch, ``random`` and numpy (when installed) with ``seed`` (default :data:`SEED`).

    Args:
        seed: the seed, default 1234.
    """
    value = SEED if seed is None else seed
    torch.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value)


class TestCase(unittest.TestCase):
    """``unittest.TestCase`` with torch's ``assertEqual``/``assertNotEqual`` (see [Note:
    torch's assertEqual]) and torch's seeding: ``setUp`` seeds torch, ``random`` and numpy with
    1234, as torch's ``TestCase`` does."""

    precision: float = 0.0
    """Minimum ``atol`` for comparisons (torch's ``precisionOverride``)."""
    rel_tol: float = 0.0
    """Minimum ``rtol`` for comparisons (torch's ``toleranceOverride``)."""

    def setUp(self) -> None:
        super().setUp()
        set_rng_seed()

    def assertEqual(
        self,
        x: Any,
        y: Any,
        msg: str | Callable[[str], str] | None = None,
        *,
        atol: float | None = None,
        rtol: float | None = None,
        equal_nan: bool = True,
        exact_dtype: bool = True,
        exact_device: bool = False,
        exact_layout: bool = False,
        exact_stride: bool = False,
        exact_is_coalesced: bool = False,
    ) -> None:
        """Fails unless ``x`` and ``y`` are equal as torch's ``TestCase.assertEqual`` defines
        it (see [Note: torch's assertEqual]).

        Args:
            x, y: tensors, numbers, sequences, mappings or other objects.
            msg: appended to the failure message; a callable gets the generated message.
            atol, rtol: tolerances (both or neither; default by dtype).
            equal_nan: NaNs compare equal (default True).
            exact_dtype: tensors must share a dtype (default True).
            exact_device: tensors must share a device (default False).
            exact_layout, exact_stride: also compare layouts / strides (default False).
            exact_is_coalesced: accepted for torch's signature (sparse tensors compare by value).
        """
        __tracebackhide__ = True
        del exact_is_coalesced
        if type(x) is int and type(y) is int:
            super().assertEqual(x, y, msg if not callable(msg) else None)
            return
        opts = _Options(
            atol=atol,
            rtol=rtol,
            atol_floor=self.precision,
            rtol_floor=self.rel_tol,
            equal_nan=equal_nan,
            exact_dtype=exact_dtype,
            exact_device=exact_device,
            exact_layout=exact_layout,
            exact_stride=exact_stride,
        )
        found = compare(x, y, opts)
        if found is None:
            return
        if callable(msg):
            raise self.failureException(msg(found))
        if msg is not None:
            found = f"{found}\n{msg}" if self.longMessage else str(msg)
        raise self.failureException(found)

    def assertNotEqual(  # type: ignore[override]
        self,
        x: Any,
        y: Any,
        msg: str | None = None,
        *,
        atol: float | None = None,
        rtol: float | None = None,
        **kwargs: Any,
    ) -> None:
        """Fails if :meth:`assertEqual` would pass (same arguments)."""
        __tracebackhide__ = True
        try:
            self.assertEqual(x, y, msg, atol=atol, rtol=rtol, **kwargs)
        except AssertionError:
            return
        raise self.failureException(
            msg or f"{x!r} == {y!r} (assertNotEqual expected them to differ)"
        )

    def assertEqualIgnoreType(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`assertEqual` with ``exact_dtype=False``."""
        kwargs.setdefault("exact_dtype", False)
        self.assertEqual(*args, **kwargs)

    def assertNotWarn(self, callable: Callable[[], Any], msg: str = "") -> None:
        """Fails if ``callable()`` warns (every warning counts, torch's warn-once ones each
        time, as torch's ``assertNotWarn`` sets ``torch.set_warn_always``).

        Args:
            callable: called with no arguments.
            msg: the failure message (default empty).
        """
        __tracebackhide__ = True
        always = torch.is_warn_always_enabled()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.set_warn_always(True)
            try:
                callable()
            finally:
                torch.set_warn_always(always)
        if caught:
            found = "; ".join(f"{w.category.__name__}: {w.message}" for w in caught)
            raise self.failureException(f"{msg} (warned: {found})" if msg else f"warned: {found}")

    def _attempt_load_from_subprocess(
        self,
        file: pathlib.Path,
        import_string: str,
        expected_failure_message: str | None = None,
    ) -> None:
        """torch's helper: ``torch.load(file, weights_only=True)`` in a fresh Python process
        after ``import torch;{import_string}``; it must succeed, or, with
        ``expected_failure_message``, fail with that text in its output.

        Args:
            file: the checkpoint to load.
            import_string: statements run before the load, each ending in ``;``.
            expected_failure_message: text the failure must show (default: it must load).
        """
        __tracebackhide__ = True
        script = f"import torch;{import_string}torch.load(r'{file}', weights_only=True)"
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=False
        )
        output = proc.stdout + proc.stderr
        if expected_failure_message is None:
            if proc.returncode != 0:
                raise self.failureException(f"loading {file} in a subprocess failed:\n{output}")
            return
        if proc.returncode == 0:
            raise self.failureException(
                f"loading {file} in a subprocess succeeded; expected it to fail with "
                f"{expected_failure_message!r}"
            )
        if expected_failure_message not in output:
            raise self.failureException(
                f"loading {file} in a subprocess failed without {expected_failure_message!r}:"
                f"\n{output}"
            )
