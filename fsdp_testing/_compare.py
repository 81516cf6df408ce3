"""Naming differences between tensors: which names diverge and by how much."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Divergence", "align_named", "compare_named", "format_divergences", "rank_prefix"]


class Divergence(NamedTuple):
    """One tensor that differs from its reference."""

    name: str
    #: Largest absolute elementwise difference (``inf`` when shapes differ or one is missing).
    max_abs_diff: float
    #: Extra facts: the shape, or why no numeric difference exists.
    detail: str

    def __str__(self) -> str:
        if self.max_abs_diff == float("inf"):
            return f"{self.name}: {self.detail}"
        return f"{self.name}: max abs diff {self.max_abs_diff:.3e} ({self.detail})"


def rank_prefix() -> str:
    """``"[rank N] "`` inside a process group, else empty."""
    return f"[rank {dist.get_rank()}] " if dist.is_available() and dist.is_initialized() else ""


def tensor_divergence(
    name: str,
    expected: torch.Tensor,
    actual: torch.Tensor,
    *,
    exact: bool = False,
) -> Divergence | None:
    """Compares two tensors on the CPU; ``None`` when they match.

    Args:
        name: reported name.
        expected: the reference value.
        actual: the value under test.
        exact: require bitwise equality (``torch.equal``) instead of ``torch.testing``'s
            dtype-based tolerances.
    """
    expected = expected.detach().cpu()
    actual = actual.detach().cpu()
    if expected.shape != actual.shape:
        return Divergence(
            name,
            float("inf"),
            f"shape {tuple(actual.shape)}, reference shape {tuple(expected.shape)}",
        )
    if exact:
        matches = torch.equal(expected, actual)
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
) -> list[Divergence]:
    """All divergences between two named tensor lists (see :func:`align_named`)."""
    found = []
    for name, ref, value in align_named(expected, actual):
        if ref is None:
            found.append(Divergence(name, float("inf"), "missing from the reference"))
        elif value is None:
            found.append(Divergence(name, float("inf"), "missing from the model under test"))
        else:
            divergence = tensor_divergence(name, ref, value, exact=exact)
            if divergence is not None:
                found.append(divergence)
    return found


def format_divergences(divergences: Iterable[Divergence], *, limit: int = 20) -> str:
    """One indented line per divergence, largest first, at most ``limit`` lines."""
    # NaN first (worst), then by decreasing difference.
    ordered = sorted(divergences, key=lambda d: (d.max_abs_diff == d.max_abs_diff, -d.max_abs_diff))
    lines = [f"  {d}" for d in ordered[:limit]]
    if len(ordered) > limit:
        lines.append(f"  ... and {len(ordered) - limit} more")
    return "\n".join(lines)


def as_named_list(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``dict`` to the list form used above."""
    return list(tensors.items())
