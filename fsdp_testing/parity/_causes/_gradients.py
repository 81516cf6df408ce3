"""Causes in the gradients each side applied: one constant factor (summed, divided twice,
accumulation), a factor per rank's slice, a low-precision grid (see [Note: likely causes])."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ._evidence import Cause, CauseKind, ParamStep, StepEvidence
from ._math import (
    FACTOR_MATCH,
    MIN_FACTOR_GAP,
    Gradients,
    chunk_spans,
    close,
    concat,
    fit,
    name_list,
    plural,
    ulp,
)


def factor_cause(
    evidence: StepEvidence, grads: Mapping[str, Gradients], gross: Sequence[str]
) -> Cause | None:
    """One constant ``k`` between the applied gradients of every grossly diverging parameter
    and the reference's, named by what it matches (``W``, ``1/W``, ``accum_steps``, ...)."""
    used = [n for n in gross if n in grads]
    merged = concat(grads[n] for n in used)
    if merged is None or len(used) < len(gross):
        return None
    whole = fit(merged)
    if whole is None or not whole.good or whole.error > 0.05:
        return None
    k = whole.k
    if k < 0.05 or abs(k - 1) <= MIN_FACTOR_GAP + whole.error:
        return None
    for name in used:  # each parameter on its own, where its numbers can tell
        own = fit(grads[name])
        if (
            own is not None
            and own.error < 0.05
            and not close(own.k, k, 2 * FACTOR_MATCH + own.error)
        ):
            return None
    world, accum = evidence.world_size, evidence.accum_steps
    size = "world size"
    mesh = evidence.mesh
    if mesh is not None and mesh.dp_dims and mesh.model_parallel:
        # Only the data-parallel ranks average gradients (see [Note: shards on a mesh]).
        world, size = mesh.dp_world, "data-parallel world size"
    total = len(evidence.params)
    if len(used) == total:
        subject = "every gradient"
    else:
        others = plural(total - len(used), "other parameter")
        subject = f"every diverging gradient ({name_list(used)}; {others} match)"
    base = f"{subject} is {k:.3f}x the reference's"
    err = whole.error
    if world > 1 and close(k, world, err):
        also = f"; or accum_steps {accum} not divided" if accum == world else ""
        return Cause(
            CauseKind.GRADIENTS_SUMMED,
            f"{base} ({size} {world})",
            f"gradients summed, not averaged{also}",
        )
    if world > 1 and close(k, 1 / world, err):
        return Cause(
            CauseKind.GRADIENTS_DIVIDED_TWICE,
            f"{base} (1/{world}, {size} {world})",
            "gradients divided by the world size twice (averaged, then divided again)",
        )
    if accum > 1 and close(k, accum, err):
        return Cause(
            CauseKind.ACCUMULATION_NOT_SCALED,
            f"{base} (accum_steps {accum})",
            f"gradient accumulation not scaled (each of the {accum} micro-batch losses must be "
            f"divided by {accum})",
        )
    known = []
    if accum > 1 and close(k, 1 / accum, err):
        known.append(f"1/accum_steps: each micro-batch loss divided by {accum} twice")
    if accum > 1 and world > 1 and close(k, world * accum, err):
        known.append(f"{size} x accum_steps = {world * accum}: summed over ranks and micro-batches")
    rounded = round(k)
    if not known and rounded >= 2 and close(k, rounded, err):
        known.append(f"a sum of {rounded} terms where their mean was meant")
    hint = f" ({'; '.join(known)})" if known else ""
    return Cause(
        CauseKind.CONSTANT_FACTOR,
        f"{base}, not a factor of {size} {world} or accum_steps {accum}{hint}",
        "a constant gradient scale (a loss or gradient scaled, or the learning rate differs)",
    )


def _mesh_blocks(
    evidence: StepEvidence, ordered: list[tuple[ParamStep, Gradients]]
) -> list[tuple[str, Gradients]]:
    """Each rank of this rank's replica: its chunks of the split parameters (their real
    extents; see [Note: shards on a mesh]), named by rank."""
    mesh = evidence.mesh
    assert mesh is not None  # for mypy: called with a mesh
    per_rank: dict[int, list[Gradients]] = {}
    for p, g in ordered:
        count = mesh.count(p.name)
        shape = p.after.shape
        if count < 2 or len(shape) <= mesh.splits[p.name][0]:
            continue
        dim = mesh.splits[p.name][0]
        for i, (s, e) in enumerate(chunk_spans(shape[dim], count)):
            holder = mesh.peer(evidence.rank, p.name, i)
            if e > s and holder is not None:
                part = (t.view(shape).narrow(dim, s, e - s).reshape(-1) for t in g)
                per_rank.setdefault(holder, []).append(Gradients(*part))
    blocks = []
    for rank, parts in sorted(per_rank.items()):
        who = f"rank {rank}" if mesh.plain else mesh.ranks_name([rank])
        merged = concat(parts)
        if merged is not None:
            blocks.append((f"{who}'s shards", merged))
    return blocks


def per_slice_cause(evidence: StepEvidence, grads: Mapping[str, Gradients]) -> Cause | None:
    """Each rank's chunk of the applied gradients (flat, or its rows of every parameter; on a
    mesh, its shards of the split parameters) a constant of its own times the reference's, the
    constants different."""
    world = evidence.world_size
    ordered = [(p, grads[p.name]) for p in evidence.params if p.name in grads]
    if world < 2 or len(ordered) < len(evidence.params) or not ordered:
        return None
    chunkings: list[tuple[str, list[tuple[str, Gradients]]]] = []
    if evidence.mesh is not None and evidence.mesh.splits:
        chunkings.append(("its shards of the split parameters", _mesh_blocks(evidence, ordered)))
    else:
        flat = concat(g for _, g in ordered)
        assert flat is not None  # for mypy: ordered is not empty
        spans = [(s, e) for s, e in chunk_spans(flat.reference.numel(), world) if e > s]
        chunkings.append(
            (
                "flat elements",
                [
                    (f"elements {s}-{e - 1} (rank {r})", Gradients(*(t[s:e] for t in flat)))
                    for r, (s, e) in enumerate(spans)
                ],
            )
        )
        per_rank: list[list[Gradients]] = [[] for _ in range(world)]
        for p, g in ordered:
            shape = p.after.shape
            if not shape or shape[0] < world:
                continue
            for r, (s, e) in enumerate(chunk_spans(shape[0], world)):
                if e > s:
                    per_rank[r].append(Gradients(*(t.view(shape)[s:e].reshape(-1) for t in g)))
        rows = [concat(parts) for parts in per_rank if parts]
        if len(rows) == world:
            chunkings.append(
                (
                    "rows of each parameter",
                    [(f"rank {r}'s rows", b) for r, b in enumerate(rows) if b is not None],
                )
            )
    for label, blocks in chunkings:
        fits = [fit(b) for _, b in blocks]
        if len(fits) < 2 or any(f is None or not f.good or f.error > 0.02 for f in fits):
            continue
        ks = [f.k for f in fits if f is not None]
        if min(ks) < 0.05 or max(ks) / min(ks) < 1 + MIN_FACTOR_GAP + 2 * max(
            f.error for f in fits if f
        ):
            continue
        if all(abs(k - 1) <= MIN_FACTOR_GAP for k in ks):
            continue
        shown = [f"{who} {k:.3f}x" for (who, _), k in zip(blocks, ks, strict=True)]
        listed = ", ".join(shown[:4]) + (f", ... ({len(shown)} slices)" if len(shown) > 4 else "")
        return Cause(
            CauseKind.PER_SLICE_FACTORS,
            f"each rank's slice of the gradient ({label}) scales by its own constant: "
            f"{listed} the reference's",
            "a scale computed from each rank's own slice, not agreed across ranks (a dropped "
            "MAX or SUM all-reduce, e.g. of a clipping norm)",
        )
    return None


_GRIDS = (("bf16", torch.bfloat16), ("fp16", torch.float16))


def _on_grid(x: torch.Tensor, dtype: torch.dtype, slack: torch.Tensor) -> torch.Tensor:
    rounded = x.to(dtype).to(torch.float64)
    return torch.isfinite(rounded) & ((x - rounded).abs() <= slack)


def low_precision_cause(
    evidence: StepEvidence, grads: Mapping[str, Gradients], diverged: Sequence[str]
) -> Cause | None:
    """The applied gradients on a bf16 (else fp16) grid where the reference's are not, within
    a few of its ulps, for a failure with no gross divergence."""
    if not diverged:
        return None
    flat = concat(grads[p.name] for p in evidence.params if p.name in grads)
    if flat is None:
        return None
    world = evidence.world_size
    for label, dtype in _GRIDS:
        spacing = ulp(flat.actual, dtype)
        # Elements whose inferred value is known to 1/64 of the grid's spacing, so that landing
        # on the grid by chance has a probability of at most ~10%.
        known = (flat.actual != 0) & torch.isfinite(flat.actual) & (64 * flat.noise < spacing)
        count = int(known.sum())
        if count < 32:
            continue
        actual, reference = flat.actual[known], flat.reference[known]
        slack = 3 * flat.noise[known] + 1e-300
        best = None
        for multiplier in sorted({1, world}):  # summed in the low precision, then divided
            frac = float(_on_grid(actual * multiplier, dtype, slack * multiplier).double().mean())
            ref_frac = float(
                _on_grid(reference * multiplier, dtype, slack * multiplier).double().mean()
            )
            if best is None or frac - ref_frac > best[0] - best[1]:
                best = (frac, ref_frac, multiplier)
        assert best is not None  # for mypy: at least one multiplier
        frac, ref_frac, multiplier = best
        ulps = ((actual - reference).abs() / ulp(reference, dtype)).sort().values
        most, worst = float(ulps[int(0.9 * (count - 1))]), float(ulps[-1])
        # On the grid where the reference is not, within a few of its ulps, and off the
        # reference by a visible fraction of one somewhere (fp32 rounding is 2^-16 of one).
        if frac >= 0.95 and ref_frac <= 0.75 and most <= 4 and worst >= 0.1:
            times = f" x {multiplier}" if multiplier != 1 else ""
            return Cause(
                CauseKind.LOW_PRECISION_REDUCTION,
                f"the gradients applied{times} lie on the {label} grid ({frac:.0%} of {count} "
                f"elements; the reference's {ref_frac:.0%}), 90% of them within {most:.2f} "
                f"{label} ulps of the reference's",
                f"a reduction in {label} (cast to {label} before the all-reduce or reduce-scatter)",
            )
    return None
