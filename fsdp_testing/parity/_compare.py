"""Comparing a model under test with its reference: which tensors diverge and by how much, and the
one rule for how close a sharded model must stay to its reference.

[Note: parity rule]
A lockstep comparison (``check_fsdp_parity``, ``fsdp-testing check``, the core's tests) compares
after every step the loss and every full parameter of the sharded model with its reference's,
each in its own dtype (a dtype that differs is a divergence). :class:`ParityRule` says how close
they must be:

- ``exact``: bitwise equal (``torch.equal``). Valid where both sides do the same arithmetic in
  the same order: on the CPU at world size 2 every gradient element is a sum of two terms, which
  is order independent, so a correct engine matches to the bit, in full and in mixed precision
  (the core's tests demand it there).
- otherwise the tolerances below, ``(rtol, atol)`` as in ``torch.testing.assert_close``, chosen
  by the dtype the difference can come from:

  - full precision: :data:`FP32_TOLERANCE` for losses and parameters. Gloo sums the
    contributions of more than two ranks in a different order for a reduce-scatter than for an
    all-reduce, so at world size 4 results differ in the last bits; 1e-5 relative is ~100 ulps,
    far above the few ulps three steps accumulate.
  - mixed precision (see [Note: mixed precision parity] in ``_reference``): parameters are fp32
    masters updated from gradients summed in the reduce dtype, so one summation-order ulp of a
    gradient element g is |g| * 2^-8 (bf16) or |g| * 2^-11 (fp16); SGD with momentum 0.9 applies
    it 1 + 1.9 + 2.71 times over three steps, so with |g| <= 1 and lr <= 0.05 a parameter moves by
    up to 0.05 * 5.6 * ulp, about 1.1e-3 (bf16) and 1.4e-4 (fp16), and the next steps'
    gradients, computed from the moved parameters, add to it. Measured maxima (the core's models,
    world size 4): 2.1e-3 (bf16) and 9.3e-5 (fp16); :data:`PARAM_TOLERANCE` allows 5e-3 and 5e-4,
    absolute, because parameters near zero make any relative bound meaningless; an fp32 reduce
    dtype keeps :data:`FP32_TOLERANCE`. Losses are computed in ``param_dtype`` from such
    parameters: a few ulps of the loss dtype (bf16 ulp 2^-8 ~ 3.9e-3 relative, fp16 2^-11 ~
    4.9e-4); measured maxima 9.4e-3 and 8.9e-4 relative; :data:`LOSS_TOLERANCE` allows 2e-2 and
    4e-3.
  - pure fp16 (``use_pure_fp16``: both models in fp16): losses by :data:`LOSS_TOLERANCE`;
    parameters are not compared (fp16 parameters near 1 have an ulp of 1e-3).

A gradient that is not averaged, or a unit that skips its reduction, moves parameters by orders
of magnitude more than any of these (``tests/cli``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "FP32_TOLERANCE",
    "LOSS_TOLERANCE",
    "PARAM_TOLERANCE",
    "Divergence",
    "ParityRule",
    "Tolerance",
    "align_named",
    "compare_named",
    "format_divergences",
    "max_abs_diff",
    "tensor_divergence",
]


class Tolerance(NamedTuple):
    """``torch.testing.assert_close``'s ``rtol`` and ``atol``."""

    rtol: float
    atol: float


#: Full precision at world sizes above 2. See [Note: parity rule].
FP32_TOLERANCE = Tolerance(1e-5, 1e-6)
#: Parameters (fp32 masters) whose gradients were summed in a low-precision reduce dtype, by
#: that dtype. See [Note: parity rule].
PARAM_TOLERANCE: Mapping[torch.dtype, Tolerance] = {
    torch.bfloat16: Tolerance(0.0, 5e-3),
    torch.float16: Tolerance(0.0, 5e-4),
}
#: Losses computed in a low-precision dtype, by that dtype. See [Note: parity rule].
LOSS_TOLERANCE: Mapping[torch.dtype, Tolerance] = {
    torch.bfloat16: Tolerance(2e-2, 1e-5),
    torch.float16: Tolerance(4e-3, 1e-6),
}


class Divergence(NamedTuple):
    """One tensor that differs from its reference."""

    name: str
    #: Largest absolute elementwise difference (``inf`` when shapes or dtypes differ or one is
    #: missing).
    max_abs_diff: float
    #: Extra facts: the shape, or why no numeric difference exists.
    detail: str

    def __str__(self) -> str:
        if self.max_abs_diff == float("inf"):
            return f"{self.name}: {self.detail}"
        return f"{self.name}: max abs diff {self.max_abs_diff:.3e} ({self.detail})"


def tensor_divergence(
    name: str,
    expected: torch.Tensor,
    actual: torch.Tensor,
    *,
    exact: bool = False,
    tolerance: Tolerance | None = None,
) -> Divergence | None:
    """Compares two tensors on the CPU; ``None`` when they match.

    Args:
        name: reported name.
        expected: the reference value.
        actual: the value under test.
        exact: require the same dtype and bitwise equality (``torch.equal``).
        tolerance: require the same dtype and ``torch.testing.assert_close`` with these
            tolerances. Neither: ``assert_close``'s default tolerances for the dtypes, any
            dtypes (as torch's ``_test_fsdp_parity`` compares losses).
    """
    expected = expected.detach().cpu()
    actual = actual.detach().cpu()
    if expected.shape != actual.shape:
        return Divergence(
            name,
            float("inf"),
            f"shape {tuple(actual.shape)}, reference shape {tuple(expected.shape)}",
        )
    strict_dtype = exact or tolerance is not None
    if strict_dtype and expected.dtype != actual.dtype:
        return Divergence(name, float("inf"), f"dtype {actual.dtype}, reference {expected.dtype}")
    if exact:
        matches = torch.equal(expected, actual)
    elif tolerance is not None:
        # assert_close's test, without its checks and messages (this runs every step).
        close = torch.isclose(actual, expected, rtol=tolerance.rtol, atol=tolerance.atol)
        matches = bool(close.all())
    else:
        try:
            torch.testing.assert_close(actual, expected, check_dtype=False)
            matches = True
        except AssertionError:
            matches = False
    if matches:
        return None
    wide = torch.float64
    diff = (actual.to(wide) - expected.to(wide)).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst != worst:  # NaN somewhere
        worst = float("nan")
    return Divergence(name, worst, f"shape {tuple(actual.shape)}")


def align_named(
    expected: list[tuple[str, torch.Tensor]], actual: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor | None, torch.Tensor | None]]:
    """Pairs tensors by name; if the name sets differ but the counts match, pairs by position
    (named as in ``actual``), which covers wrappers that rename parameters."""
    expected_map, actual_map = dict(expected), dict(actual)
    if expected_map.keys() == actual_map.keys():
        return [(name, expected_map[name], actual_map[name]) for name in actual_map]
    if len(expected) == len(actual):
        return [(a_name, e, a) for (_, e), (a_name, a) in zip(expected, actual, strict=True)]
    names = list(dict.fromkeys([*actual_map, *expected_map]))
    return [(name, expected_map.get(name), actual_map.get(name)) for name in names]


def compare_named(
    expected: list[tuple[str, torch.Tensor]],
    actual: list[tuple[str, torch.Tensor]],
    *,
    exact: bool = False,
    tolerance: Tolerance | None = None,
) -> list[Divergence]:
    """All divergences between two named tensor lists (see :func:`align_named`), compared as
    :func:`tensor_divergence` does with ``exact`` and ``tolerance``."""
    found = []
    for name, ref, value in align_named(expected, actual):
        if ref is None:
            found.append(Divergence(name, float("inf"), "missing from the reference"))
        elif value is None:
            found.append(Divergence(name, float("inf"), "missing from the model under test"))
        else:
            divergence = tensor_divergence(name, ref, value, exact=exact, tolerance=tolerance)
            if divergence is not None:
                found.append(divergence)
    return found


def max_abs_diff(
    expected: list[tuple[str, torch.Tensor]], actual: list[tuple[str, torch.Tensor]]
) -> float:
    """The largest absolute elementwise difference over all pairs (``inf`` when a tensor is
    missing or shapes differ, NaN when a difference is NaN)."""
    worst = 0.0
    for _, ref, value in align_named(expected, actual):
        if ref is None or value is None or ref.shape != value.shape:
            return float("inf")
        if ref.numel():
            wide = torch.float64
            diff = (value.detach().cpu().to(wide) - ref.detach().cpu().to(wide)).abs().max()
            worst = max(worst, float(diff)) if not torch.isnan(diff) else float("nan")
    return worst


def format_divergences(divergences: Iterable[Divergence], *, limit: int = 20) -> str:
    """One indented line per divergence, largest first, at most ``limit`` lines."""
    # NaN first (worst), then by decreasing difference.
    ordered = sorted(divergences, key=lambda d: (d.max_abs_diff == d.max_abs_diff, -d.max_abs_diff))
    lines = [f"  {d}" for d in ordered[:limit]]
    if len(ordered) > limit:
        lines.append(f"  ... and {len(ordered) - limit} more")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityRule:
    """How close a sharded model's losses and full parameters must stay to its reference's.
    See [Note: parity rule]; build it with :meth:`for_training`.

    Args:
        exact: bitwise equality of losses and parameters.
        loss: tolerance for losses (ignored when ``exact``).
        params: tolerance for parameters (ignored when ``exact``); None: parameters are not
            compared.
    """

    exact: bool = False
    loss: Tolerance = FP32_TOLERANCE
    params: Tolerance | None = FP32_TOLERANCE

    @classmethod
    def for_training(
        cls, mixed_precision: Any = None, *, exact: bool = False, use_pure_fp16: bool = False
    ) -> ParityRule:
        """The rule for training under ``mixed_precision`` (a ``MixedPrecision`` policy or
        None) or pure fp16.

        Args:
            mixed_precision: the sharded model's policy; its ``param_dtype`` and
                ``reduce_dtype`` (default ``param_dtype``) choose the tolerances.
            exact: demand bitwise equality (default False).
            use_pure_fp16: both models are in fp16: losses in fp16, parameters not compared.
        """
        if use_pure_fp16:
            return cls(exact=exact, loss=LOSS_TOLERANCE[torch.float16], params=None)
        if mixed_precision is None:
            return cls(exact=exact)
        param_dtype = getattr(mixed_precision, "param_dtype", None) or torch.float32
        reduce_dtype = getattr(mixed_precision, "reduce_dtype", None) or param_dtype
        return cls(
            exact=exact,
            loss=LOSS_TOLERANCE.get(param_dtype, FP32_TOLERANCE),
            params=PARAM_TOLERANCE.get(reduce_dtype, FP32_TOLERANCE),
        )

    def divergences(
        self,
        ref_loss: torch.Tensor,
        loss: torch.Tensor,
        ref_params: list[tuple[str, torch.Tensor]],
        params: list[tuple[str, torch.Tensor]],
    ) -> list[Divergence]:
        """The loss's divergence (if any), then each parameter's, in ``params`` order."""
        found = compare_named(
            [("loss", ref_loss)], [("loss", loss)], exact=self.exact, tolerance=self.loss
        )
        if self.params is not None:
            found += compare_named(ref_params, params, exact=self.exact, tolerance=self.params)
        return found
