"""Where a training step's time goes, by category, from torch's profiler.

Used by ``core_vs_fsdp2.py --profile``. The step runs under ``torch.profiler.profile`` (CPU
activity) and each operator event on the stepping thread is put in one category by its own
name, or by the label of the optimizer's step around it; its *self* time (its own time without
the operators it called) is added to that category, so the categories add up to the operators'
time without counting anything twice:

- ``compute``: every other ATen operator (matrix products, activations, norms, gradient kernels);
- ``copy``: copies and fills (``copy_``, ``cat``, ``_to_copy``, ``split_with_sizes_copy``,
  ``fill_``, ``zero_``, ...): what the engines do to copy shards in and gathered or reduced
  data out, and the casts of mixed precision;
- ``collectives``: c10d and gloo operators on the stepping thread, issuing each collective, and
  the time in ``Work.wait()`` (gloo moves the data on its own threads; a wait is no operator, so
  while profiling ``torch.distributed.Work.wait`` runs under a ``c10d::wait`` label);
- ``optimizer``: everything under ``Optimizer.step`` and ``Optimizer.zero_grad``;
- ``other``: the step's wall time minus the operators' time: Python (hooks, the engines' own
  bookkeeping, autograd's engine) and the profiler's own cost, which inflates this row most.

The profiler's overhead makes every figure larger than an unprofiled step; compare the
categories across engines measured the same way, not with the step times of the other phases.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CATEGORIES = ("compute", "copy", "collectives", "optimizer", "other")

_COPIES = frozenset(
    "aten::" + name
    for name in (
        "copy_",
        "_to_copy",
        "cat",
        "_chunk_cat",
        "split_with_sizes_copy",
        "narrow_copy",
        "clone",
        "fill_",
        "zero_",
        "zeros",
        "new_zeros",
        "index_copy_",
        "_foreach_copy_",
    )
)
_COLLECTIVE_MARKS = ("c10d::", "gloo", "record_param_comms", "ProcessGroup", "nccl:")
_OPTIMIZER_MARKS = ("Optimizer.step", "Optimizer.zero_grad")
_STEP = "fsdp_bench::step"


def category_of(name: str, under_optimizer: bool) -> str | None:
    """The category of an event named ``name`` (None: not an operator, e.g. a label)."""
    if under_optimizer:
        return "optimizer"
    if any(mark in name for mark in _COLLECTIVE_MARKS):
        return "collectives"
    if name in _COPIES:
        return "copy"
    if name.startswith("aten::"):
        return "compute"
    return None


def profile_steps(step: Callable[[], None], steps: int) -> dict[str, float]:
    """Run ``step`` ``steps`` times under the profiler; return the mean seconds per step of
    each category, and ``"step"``: the mean wall time of a profiled step."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    wait = dist.Work.wait

    def labelled_wait(work: dist.Work, *args: object, **kwargs: object) -> bool:
        with record_function("c10d::wait"):
            return wait(work, *args, **kwargs)

    dist.Work.wait = labelled_wait  # type: ignore[method-assign]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            begin = time.perf_counter()
            for _ in range(steps):
                with record_function(_STEP):
                    step()
            wall = time.perf_counter() - begin
    finally:
        dist.Work.wait = wait  # type: ignore[method-assign]
    events = prof.events()
    threads = {event.thread for event in events if event.name == _STEP}
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if event.thread not in threads:
            continue  # gloo's and other threads: their time overlaps the step's
        under_optimizer = False
        parent = event
        while parent is not None:
            if any(parent.name.startswith(mark) for mark in _OPTIMIZER_MARKS):
                under_optimizer = True
                break
            parent = parent.cpu_parent
        category = category_of(event.name, under_optimizer)
        if category is not None:
            totals[category] += event.self_cpu_time_total / 1e6
    operators = sum(totals.values())
    totals["other"] = max(0.0, wall - operators)
    result = {name: seconds / steps for name, seconds in totals.items()}
    result["step"] = wall / steps
    return result


def print_profile(console: object, profiles: dict[str, list[dict[str, float]]]) -> None:
    """One row per engine: the slower rank's profiled step and each category's milliseconds per
    step and share of it (the rank of the slower step's figures)."""
    from fsdp_testing.cli._render import print_table

    rows = []
    for engine, ranks in profiles.items():
        slower = max(ranks, key=lambda r: r["step"])
        cells = [f"{slower[c] * 1e3:.1f} ({slower[c] / slower['step']:.0%})" for c in CATEGORIES]
        rows.append([engine, f"{slower['step'] * 1e3:.1f}", *cells])
    print_table(
        console,
        ["engine", "step ms", *(f"{c} ms" for c in CATEGORIES)],
        rows,
        title="profile (torch.profiler, the stepping thread of the slower rank): milliseconds "
        "per step and share of it; see benchmarks/_step_profile.py for the categories",
    )
