"""The numbers every cause reads: ulps, norms, a factor fitted between two gradients, the
chunks a world splits a tensor into, and the phrases the evidence lines share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ..._report.text import rank_ranges

#: A gradient that differs from the reference's by more than this fraction of its norm is a
#: gross divergence (see [Note: likely causes]).
GROSS = 0.01
#: A constant factor must differ from 1 by more than this to be one.
MIN_FACTOR_GAP = 0.02
#: How close a factor must be to the world size (or 1/W, or the accumulation steps), relative.
FACTOR_MATCH = 0.005


class Gradients(NamedTuple):
    """The gradient each side applied to one tensor (flat, float64), and how well the model
    under test's is known, per element (0 where it was read, not inferred)."""

    reference: torch.Tensor
    actual: torch.Tensor
    noise: torch.Tensor


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64).reshape(-1)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|x|`` (x float64)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.abs())  # |x| in [2^(e-1), 2^e)
    spacing = torch.ldexp(torch.full_like(x, info.eps), exponent - 1)
    tiny = info.smallest_normal * info.eps
    return torch.where(x == 0, torch.full_like(x, tiny), spacing.clamp(min=tiny))


def norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) if t.numel() else 0.0


class Fit(NamedTuple):
    """``actual ~ k * reference``: the factor, whether the residual is only noise, and the
    factor's uncertainty (relative)."""

    k: float
    good: bool
    error: float


def fit(g: Gradients) -> Fit | None:
    ref_sq = float(torch.dot(g.reference, g.reference))
    if ref_sq == 0 or not math.isfinite(ref_sq):
        return None
    k = float(torch.dot(g.actual, g.reference)) / ref_sq
    if not math.isfinite(k):
        return None
    noise = norm(g.noise)
    residual = norm(g.actual - k * g.reference)
    good = residual <= GROSS * norm(g.actual - g.reference) + 3 * noise
    return Fit(k, good, 3 * noise / math.sqrt(ref_sq))


def concat(parts: Iterable[Gradients]) -> Gradients | None:
    items = list(parts)
    if not items:
        return None
    return Gradients(*(torch.cat([getattr(g, f) for g in items]) for f in Gradients._fields))


def close(k: float, target: float, error: float) -> bool:
    return abs(k - target) <= FACTOR_MATCH * abs(target) + error


def name_list(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def rank_list(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


def chunk_spans(n: int, world: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's chunk of ``n`` (``torch.chunk``'s sizes, as FSDP pads:
    trailing ranks may hold nothing)."""
    size = -(-n // world)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(world)]


def equal_within(a: torch.Tensor, b: torch.Tensor, slack: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= slack).all())


def ulp_slack(*tensors: torch.Tensor) -> torch.Tensor:
    """Four ulps (fp32, or the tensors' dtype) of the largest magnitude, per element."""
    dtype = tensors[0].dtype if tensors[0].is_floating_point() else torch.float32
    dtype = dtype if torch.finfo(dtype).eps >= torch.finfo(torch.float32).eps else torch.float32
    biggest = torch.stack([t.detach().to("cpu", torch.float64).abs() for t in tensors]).amax(0)
    return 4 * ulp(biggest, dtype)
