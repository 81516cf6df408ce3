"""fsdp_core's two doors against torch's FSDP2 and DDP on CPU/gloo, measured in one run.

The engines: ``fsdp_core`` (the wrapper door, ``FullyShardedDataParallel``),
``fsdp_core_fully_shard`` (the composable door, ``fsdp_core.fully_shard``), ``torch_fsdp2``
(torch's ``fully_shard``) and ``ddp``.

World size 2, a transformer-like model (pre-norm blocks of multi-head attention and a 4x MLP).
Two phases, both in this run:

- isolated: each engine runs in freshly forked rank processes (one thread each) so that peak
  memory is its own: per engine and rank, the median step time after warm-up, the peak resident
  set size (RSS high-water mark, reset just before the model is built), and the collectives and
  bytes of one step against the theoretical volume (see [Note: theoretical volume] in
  ``fsdp_testing/cli/_measure.py``);
- interleaved: one pair of rank processes builds every engine's copy of the model and steps them
  in turn (round r starts with engine r mod 4), so that the machine's speed drift, which on a
  shared machine is larger than the engines' difference, hits every engine alike. The step-time
  verdict comes from this phase: per round, each fsdp_core door's time over FSDP2's (the slower
  rank's), then the median of those paired ratios.

Wrapping is the same for the three sharded engines: every block is a unit and the root owns the
rest; FULL_SHARD with backward prefetch of one unit; the root keeps its parameters from forward
to backward (both ``fully_shard``s: ``reshard_after_forward=False`` on the root, which is what
the wrapper and FSDP1 do for the root). ``--forward-prefetch`` also prefetches one unit in
forward, for all three alike: the wrapper's ``forward_prefetch=True``; on both ``fully_shard``s
the root and each block name the next block with ``set_modules_to_forward_prefetch`` (FSDP2
prefetches in forward implicitly on CUDA only).

``--order-check-cost`` adds a copy of fsdp_core's model to the interleaved phase with its order
tags switched off (``fsdp_core.debug.set_order_check``, a debugging option), and reports
fsdp_core's paired ratio to it, i.e. what the in-payload order check (see [Note: order check] in
``fsdp_core/_order_check.py``) costs per step.

``--overlap-cost`` adds a copy with its overlap on the CPU switched off
(``fsdp_core.debug.set_cpu_overlap``; see [Note: overlap on the CPU] in
``fsdp_core/_overlap.py``) to the interleaved phase, and reports fsdp_core's paired ratio to it:
what overlapping the collectives with compute gains per step.

The wrapper's copies trade roles every round (:func:`wrapper_roles`): in round r copy
``(r + j) mod n`` plays role j (fsdp_core as is, then each variant asked for), switched by those
two debugging options between steps. Two copies of one model may differ in step time by
themselves (two tagged copies over 450 rounds: 1.0063, 95% interval 0.9964 to 1.0225), which a
fixed copy per role would add to a variant's ratio; rotating the roles makes it cancel out.
fsdp_core's times (and every ratio to FSDP2 and DDP) are those of whichever copy played it that
round.

``--variants-only`` runs the interleaved phase alone with fsdp_core and those variants, so that a
long run (hundreds of rounds) narrows their intervals in a fraction of the time.

``--profile`` adds a third phase: every engine (and fsdp_core with its tags off) profiled with
torch's profiler for ``--steps`` steps, the step's time split into compute, copy, collectives,
optimizer and other (Python and the profiler); see ``_step_profile.py``.

Usage: python benchmarks/core_vs_fsdp2.py [--width 512] [--blocks 4] [--steps 8] [--warmup 3]
       [--rounds 20] [--forward-prefetch] [--order-check-cost] [--overlap-cost]
       [--variants-only] [--profile] [--exact-memory]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

CORE_FULLY_SHARD = "fsdp_core_fully_shard"
ENGINES = ("fsdp_core", CORE_FULLY_SHARD, "torch_fsdp2", "ddp")
# fsdp_core with its order tags off, next to fsdp_core in the interleaved phase only.
CORE_UNTAGGED = "fsdp_core_untagged"
# fsdp_core with its collectives waited on where issued (no overlap on the CPU), likewise.
CORE_NO_OVERLAP = "fsdp_core_no_overlap"


def _build(width: int, blocks: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, 8, batch_first=True)
            self.norm2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj_in = nn.Linear(width, width)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.proj_in(x)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Model(), Block


def _wrap(engine: str, model: Any, block_class: type, forward_prefetch: bool = False) -> Any:
    """``model`` wrapped for ``engine``; with ``forward_prefetch`` every sharded engine gathers
    the next unit in forward order when a unit's forward starts (the wrapper's
    ``forward_prefetch=True``, FSDP2's ``set_modules_to_forward_prefetch``)."""
    import torch.distributed as dist

    if engine in ("fsdp_core", CORE_UNTAGGED, CORE_NO_OVERLAP):
        from fsdp_core import BackwardPrefetch, ShardingStrategy
        from fsdp_core import FullyShardedDataParallel as FSDP
        from fsdp_core.debug import set_cpu_overlap, set_order_check
        from fsdp_core.wrap import ModuleWrapPolicy

        wrapped = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({block_class}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=forward_prefetch,
        )
        set_order_check(wrapped, enabled=engine != CORE_UNTAGGED)
        set_cpu_overlap(wrapped, enabled=engine != CORE_NO_OVERLAP)
        return wrapped
    if engine == CORE_FULLY_SHARD:
        from fsdp_core import fully_shard as core_fully_shard

        for block in model.blocks:  # the default mesh: the world
            core_fully_shard(block, reshard_after_forward=True)
        core_fully_shard(model, reshard_after_forward=False)
        return _prefetch_forward(model) if forward_prefetch else model
    if engine == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return _prefetch_forward(model) if forward_prefetch else model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _prefetch_forward(model: Any) -> Any:
    """A ``fully_shard``-ed model whose root and blocks each prefetch the next block in forward,
    as the wrapper's ``forward_prefetch`` does."""
    modules = [model, *model.blocks]
    for module, following in itertools.pairwise(modules):
        module.set_modules_to_forward_prefetch([following])
    return model


def run_rank(
    engine: str,
    width: int,
    blocks: int,
    steps: int,
    warmup: int,
    out_dir: str,
    forward_prefetch: bool = False,
) -> None:
    """One engine on one rank; writes ``{engine}-rank{N}.json`` into ``out_dir``."""
    import torch
    import torch.distributed as dist

    from fsdp_testing.cli._measure import (
        CollectiveLog,
        current_rss_bytes,
        peak_rss_bytes,
        reset_peak_rss,
        theoretical_volume,
    )
    from fsdp_testing.engines import get_engine

    torch.set_num_threads(1)
    rank = dist.get_rank()
    reset_peak_rss()
    rss_start = current_rss_bytes()
    model, block_class = _build(width, blocks)
    model = _wrap(engine, model, block_class, forward_prefetch)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batch = torch.randn(4, 64, width, generator=torch.Generator().manual_seed(rank))
    log = CollectiveLog()
    times: list[float] = []
    per_step: list[dict[str, tuple[int, int]]] = []
    for step in range(warmup + steps):
        log.clear()
        with log.watching():
            begin = time.perf_counter()
            optim.zero_grad(set_to_none=True)
            loss = model(batch).pow(2).mean()
            loss.backward()
            optim.step()
            elapsed = time.perf_counter() - begin
        if step >= warmup:
            times.append(elapsed)
            per_step.append(log.totals())
    # DDP all-reduces its buckets from its C++ Reducer, below the Python API that
    # CollectiveLog watches: its collectives are not counted (shown as "not visible").
    # Named, not found: the wrapper's engine also recognizes the composable door's modules.
    variant = engine in (CORE_UNTAGGED, CORE_NO_OVERLAP)  # the wrapper's, switched
    named = get_engine("fsdp_core" if variant else engine) if engine.startswith("fsdp") else None
    theory = theoretical_volume(model, full_shard=True, engine=named)
    theory_totals = theory.totals() if theory is not None else {}
    result = {
        "engine": engine,
        "rank": rank,
        "step_s": statistics.median(times),
        "step_times_s": times,
        "peak_rss": peak_rss_bytes(),
        "rss_start": rss_start,
        "comm": {k: list(v) for k, v in per_step[-1].items()},
        "comm_consistent": all(c == per_step[-1] for c in per_step),
        "theory": {k: list(v) for k, v in theory_totals.items()},
        "params": sum(p.numel() for p in model.parameters()) * dist.get_world_size()
        if engine != "ddp"
        else sum(p.numel() for p in model.parameters()),
    }
    with open(os.path.join(out_dir, f"{engine}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_rank_interleaved(
    width: int,
    blocks: int,
    rounds: int,
    warmup: int,
    out_dir: str,
    order_check_cost: bool = False,
    overlap_cost: bool = False,
    forward_prefetch: bool = False,
    variants_only: bool = False,
) -> None:
    """Every engine's model in this rank, stepped in turn; writes ``interleaved-rank{N}.json``.

    Each engine gets its own copy of the same initial model and its own optimizer. Warm-up
    steps run every engine ``warmup`` times first; then each round steps every engine once,
    starting with a different engine each round. With ``order_check_cost`` fsdp_core with its
    order tags off (:data:`CORE_UNTAGGED`) is one more engine, with ``overlap_cost`` fsdp_core
    without overlap (:data:`CORE_NO_OVERLAP`); ``variants_only`` steps fsdp_core and those
    variants only. The wrapper's copies trade these roles every round (:func:`wrapper_roles`).
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    # Next to fsdp_core, so that most rounds step them back to back.
    roles = (ENGINES[0],) + (CORE_UNTAGGED,) * order_check_cost
    roles += (CORE_NO_OVERLAP,) * overlap_cost
    engines = (*roles, *(() if variants_only else ENGINES[1:]))
    built: dict[str, tuple[Any, Any]] = {}
    for engine in engines:
        model, block_class = _build(width, blocks)
        model = _wrap(engine, model, block_class, forward_prefetch)
        optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        built[engine] = (model, optim)
    copies = [built[role] for role in roles]  # the wrapper's copies, in the order built
    steppers = dict(built)
    batch = torch.randn(4, 64, width, generator=torch.Generator().manual_seed(rank))

    def step(engine: str) -> float:
        model, optim = steppers[engine]
        begin = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        model(batch).pow(2).mean().backward()
        optim.step()
        return time.perf_counter() - begin

    for _ in range(warmup):
        for engine in engines:
            step(engine)
    times: dict[str, list[float]] = {engine: [] for engine in engines}
    for r in range(rounds):
        for role, copy in wrapper_roles(r, roles).items():
            steppers[role] = copies[copy]
            _switch_variant(copies[copy][0], role)
        for i in range(len(engines)):
            engine = engines[(r + i) % len(engines)]
            times[engine].append(step(engine))
    with open(os.path.join(out_dir, f"interleaved-rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "times": times}, f)


def wrapper_roles(round_index: int, roles: tuple[str, ...]) -> dict[str, int]:
    """Which of the wrapper's copies plays each role in round ``round_index``: role ``j`` goes
    to copy ``(round_index + j) mod len(roles)``, so over ``len(roles)`` rounds every copy plays
    every role once."""
    return {role: (round_index + j) % len(roles) for j, role in enumerate(roles)}


def _switch_variant(model: Any, role: str) -> None:
    """Make one of the wrapper's copies ``role``: fsdp_core as is, or one variant of it."""
    from fsdp_core.debug import set_cpu_overlap, set_order_check

    set_order_check(model, enabled=role != CORE_UNTAGGED)
    set_cpu_overlap(model, enabled=role != CORE_NO_OVERLAP)


def run_rank_profile(
    width: int, blocks: int, steps: int, warmup: int, out_dir: str, forward_prefetch: bool = False
) -> None:
    """Every engine (fsdp_core with its order tags off too) profiled for ``steps`` steps after
    ``warmup``, one after another; writes ``profile-rank{N}.json``. See ``_step_profile.py``."""
    import torch
    import torch.distributed as dist
    from _step_profile import profile_steps

    torch.set_num_threads(1)
    batch = torch.randn(4, 64, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    profiles = {}
    for engine in (ENGINES[0], CORE_UNTAGGED, *ENGINES[1:]):
        model, block_class = _build(width, blocks)
        model = _wrap(engine, model, block_class, forward_prefetch)
        optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step(model: Any = model, optim: Any = optim) -> None:
            optim.zero_grad(set_to_none=True)
            model(batch).pow(2).mean().backward()
            optim.step()

        for _ in range(warmup):
            step()
        profiles[engine] = profile_steps(step, steps)
    with open(os.path.join(out_dir, f"profile-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(profiles, f)


def _launch(function: str, label: str, kwargs: dict[str, Any], *, script: str = __file__) -> None:
    """Run ``function`` of the benchmark ``script`` (this one by default) on two fresh gloo
    ranks."""
    from fsdp_testing._launch.spec import DistSpec, Mode
    from fsdp_testing._protocol import FunctionRef, Task
    from fsdp_testing.launcher import LaunchSettings, run_distributed

    module = os.path.splitext(os.path.basename(script))[0]
    ref = FunctionRef(module=module, path=os.path.abspath(script), qualname=function)
    task = Task(ref, kwargs, test_id=f"benchmark {label}")
    spec = DistSpec(2, backend="gloo", mode=Mode.PROCESS, timeout=1800)
    verdict = run_distributed(task, spec, LaunchSettings(timeout=1800), pool=False)
    if verdict.outcome != "passed":
        raise SystemExit(f"{label}: the ranks {verdict.outcome}\n{verdict.message}")


def paired_ratios(times: list[dict[str, list[float]]], num: str, den: str) -> list[float]:
    """Per round, ``num``'s step time over ``den``'s, each the slower rank's time that round."""
    rounds = len(times[0][num])
    return [max(t[num][r] for t in times) / max(t[den][r] for t in times) for r in range(rounds)]


def median_interval(ratios: list[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median of ``ratios`` that assumes nothing of their
    distribution: the order statistics ``n/2 -+ 0.98 sqrt(n)`` (the normal approximation of
    the binomial count of values below the median)."""
    ordered = sorted(ratios)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return ordered[low], ordered[high]


def variant_ratio(
    interleaved: list[dict[str, list[float]]], variant: str = CORE_UNTAGGED
) -> dict[str, Any]:
    """fsdp_core's paired ratio to ``variant`` of itself (the order tags off, or the overlap):
    median, quartiles, a 95% interval of the median, ratios."""
    ratios = sorted(paired_ratios(interleaved, "fsdp_core", variant))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    low, high = median_interval(ratios)
    return {"median": median, "q1": q1, "q3": q3, "ci95": [low, high], "ratios": ratios}


def _print_variants(
    args: argparse.Namespace,
    summary: dict[str, dict[str, Any]],
    interleaved: list[dict[str, list[float]]],
) -> None:
    """Print fsdp_core's paired ratio to each variant asked for; add it to ``summary``."""
    variants = [
        (CORE_UNTAGGED, args.order_check_cost, "order check", "the tags off"),
        (CORE_NO_OVERLAP, args.overlap_cost, "overlap", "no overlap on the CPU"),
    ]
    for variant, asked, label, other in variants:
        if not asked:
            continue
        cost = summary[variant] = variant_ratio(interleaved, variant)
        print(
            f"{label}: fsdp_core / fsdp_core with {other} = {cost['median']:.4f} (median "
            f"of {len(cost['ratios'])} paired rounds; quartiles {cost['q1']:.4f} to "
            f"{cost['q3']:.4f}; 95% interval of the median {cost['ci95'][0]:.4f} to "
            f"{cost['ci95'][1]:.4f})"
        )


def _load(out_dir: str, name: str) -> Any:
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _slower(interleaved: list[dict[str, list[float]]], engine: str) -> list[float]:
    """Per interleaved round, the slower rank's step time of ``engine``."""
    rounds = len(interleaved[0][engine])
    return [max(t[engine][r] for t in interleaved) for r in range(rounds)]


def _print_report(
    args: argparse.Namespace,
    results: dict[str, list[dict[str, Any]]],
    interleaved: list[dict[str, list[float]]],
) -> dict[str, dict[str, Any]]:
    """Print both phases' tables and ratios (rich on a terminal, plain lines elsewhere); returns
    the paired ratios of the interleaved phase."""
    from fsdp_testing.cli._render import echo, make_console, print_table

    console = make_console()
    params = results["ddp"][0]["params"]
    echo(
        console,
        f"\nmodel: {args.blocks} blocks of width {args.width}, {params / 1e6:.2f} M parameters "
        f"({_mib(params * 4)} MiB fp32); batch 4 x 64 tokens per rank; world size 2 (gloo, "
        f"1 thread per rank); sharded engines prefetch one unit in backward"
        f"{' and forward' if args.forward_prefetch else ' only'}"
        f"{'; peak RSS follows the tensors (--exact-memory)' if args.exact_memory else ''}\n",
    )
    rows = []
    differs = []
    for engine, ranks in results.items():
        step = max(r["step_s"] for r in ranks)
        comm = ranks[0]["comm"]
        text = ", ".join(f"{v[0]} {k} {v[1]:,} B" for k, v in sorted(comm.items()))
        same = comm == ranks[0]["theory"] and all(r["comm_consistent"] for r in ranks)
        verdict = "exact" if same else "DIFFERS"
        if engine == "ddp":
            text, verdict = "not visible (C++ Reducer)", "-"
        if verdict == "DIFFERS":
            differs.append(f"{engine} theory: {ranks[0]['theory']}")
        peaks = f"{_mib(ranks[0]['peak_rss'])}/{_mib(ranks[1]['peak_rss'])}"
        rows.append(
            [engine, f"{step * 1e3:.1f}", peaks, _mib(ranks[0]["rss_start"]), text, verdict]
        )
    print_table(
        console,
        ["engine", "step ms", "peak RSS MiB r0/r1", "RSS at start", "collectives/step",
         "vs theory"],
        rows,
        title=f"isolated (fresh ranks per engine): median of {args.steps} steps after "
        f"{args.warmup} warm-up steps",
    )  # fmt: skip
    for line in differs:
        echo(console, line, style="bold red")
    step = {e: max(r["step_s"] for r in results[e]) for e in ENGINES}
    echo(console, "\nisolated: the engines ran one after another, so drift is included")
    peak = {e: max(r["peak_rss"] for r in results[e]) for e in ENGINES}
    for door in ("fsdp_core", CORE_FULLY_SHARD):
        echo(
            console,
            f"isolated step time  {door} / FSDP2 = {step[door] / step['torch_fsdp2']:.3f}   "
            f"{door} / DDP = {step[door] / step['ddp']:.3f}",
        )
    for door in ("fsdp_core", CORE_FULLY_SHARD):
        echo(
            console,
            f"peak RSS            {door} / FSDP2 = {peak[door] / peak['torch_fsdp2']:.3f}   "
            f"{door} / DDP = {peak[door] / peak['ddp']:.3f}",
        )
    echo(console, "")
    rows = []
    for engine in ENGINES:
        slower = _slower(interleaved, engine)
        figures = (statistics.median(slower), min(slower), max(slower))
        rows.append([engine, *(f"{v * 1e3:.1f}" for v in figures)])
    print_table(
        console,
        ["engine", "median ms", "min ms", "max ms"],
        rows,
        title=f"interleaved (one pair of ranks, engines stepped in turn): {args.rounds} rounds "
        f"after {args.warmup} warm-up rounds; the slower rank's time per step",
    )
    # fsdp_core's ratios are keyed by the other engine; the composable door's by "door/other".
    summary = {}
    pairs = [("fsdp_core", "torch_fsdp2"), ("fsdp_core", "ddp"), (CORE_FULLY_SHARD, "torch_fsdp2")]
    for door, other in pairs:
        ratios = sorted(paired_ratios(interleaved, door, other))
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        key = other if door == "fsdp_core" else f"{door}/{other}"
        summary[key] = {"median": median, "q1": q1, "q3": q3, "ratios": ratios}
        if door == CORE_FULLY_SHARD:
            summary[key]["peak_rss_ratio"] = peak[door] / peak[other]
        echo(
            console,
            f"step time  {door} / {'FSDP2' if other == 'torch_fsdp2' else 'DDP':5} = "
            f"{median:.3f} (median of {len(ratios)} paired rounds; quartiles {q1:.3f} to {q3:.3f})",
            style="bold",
        )
    return summary


def _write_png(
    path: str,
    args: argparse.Namespace,
    results: dict[str, list[dict[str, Any]]],
    interleaved: list[dict[str, list[float]]],
) -> None:
    """Bar charts of step time (interleaved median and isolated) and peak RSS per rank, per
    engine."""
    from fsdp_testing.cli._plot import BarPanel, draw_bars, save_png

    engines = list(ENGINES)
    step = BarPanel(
        title="step time (the slower rank)",
        unit="ms",
        groups=engines,
        series={
            "interleaved median": [
                statistics.median(_slower(interleaved, e)) * 1e3 for e in engines
            ],
            "isolated median": [max(r["step_s"] for r in results[e]) * 1e3 for e in engines],
        },
    )
    memory = BarPanel(
        title="peak resident memory",
        unit="MiB",
        groups=engines,
        series={
            f"rank {rank}": [results[e][rank]["peak_rss"] / 2**20 for e in engines]
            for rank in (0, 1)
        },
    )
    figure = draw_bars(
        [step, memory],
        title=f"fsdp_core (both doors), FSDP2 and DDP: {args.blocks} blocks of width "
        f"{args.width}, world size 2 (gloo, CPU)",
    )
    save_png(figure, path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per engine")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.add_argument(
        "--rounds", type=int, default=20, help="interleaved rounds (one step of each engine)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--order-check-cost",
        action="store_true",
        help="also step fsdp_core with its order tags off in the interleaved phase and report "
        "the paired ratio: the cost of the in-payload order check",
    )
    parser.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="every sharded engine also prefetches the next block in forward (the wrapper's "
        "forward_prefetch=True, FSDP2's set_modules_to_forward_prefetch)",
    )
    parser.add_argument(
        "--overlap-cost",
        action="store_true",
        help="also step fsdp_core without overlap on the CPU in the interleaved phase and "
        "report the paired ratio: what overlapping collectives with compute gains",
    )
    parser.add_argument(
        "--variants-only",
        action="store_true",
        help="run only the interleaved phase, with fsdp_core and the variants asked for "
        "(--order-check-cost, --overlap-cost): a long run narrows their intervals",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile --steps steps of every engine and print where a step's time goes "
        "(compute, copy, collectives, optimizer, other)",
    )
    parser.add_argument(
        "--exact-memory",
        action="store_true",
        help="rank processes map every allocation over 128 KiB on its own (glibc's "
        "MALLOC_MMAP_THRESHOLD_), so peak RSS follows the live tensors instead of the heap's "
        "history, whose noise between runs and ranks is several percent; steps run about 1.7x "
        "slower (every large allocation faults its pages in), so read step times without it",
    )
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="also draw step time and peak memory per engine (matplotlib: the 'plot' extra)",
    )
    args = parser.parse_args()
    if args.variants_only and not (args.order_check_cost or args.overlap_cost):
        parser.error("--variants-only needs --order-check-cost, --overlap-cost or both")
    if args.variants_only and (args.png or args.profile or args.json):
        parser.error("--variants-only runs the interleaved phase alone: no --png/--profile/--json")
    if args.png:
        from fsdp_testing.cli._plot import require_matplotlib

        try:
            require_matplotlib("core_vs_fsdp2.py --png")
        except ImportError as error:
            parser.error(str(error))
    if args.exact_memory:  # read by glibc when the fork server starts; the ranks inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    out_dir = tempfile.mkdtemp(prefix="fsdp-bench-")
    try:
        common = dict(
            width=args.width,
            blocks=args.blocks,
            warmup=args.warmup,
            out_dir=out_dir,
            forward_prefetch=args.forward_prefetch,
        )
        interleaved_kwargs = dict(
            rounds=args.rounds,
            order_check_cost=args.order_check_cost,
            overlap_cost=args.overlap_cost,
            variants_only=args.variants_only,
        )
        if args.variants_only:
            print("running fsdp_core and its variants interleaved ...", flush=True)
            _launch("run_rank_interleaved", "interleaved", dict(**interleaved_kwargs, **common))
            interleaved = [_load(out_dir, f"interleaved-rank{r}.json")["times"] for r in (0, 1)]
            _print_variants(args, {}, interleaved)
            return
        for engine in ENGINES:
            print(f"running {engine} (isolated) ...", flush=True)
            _launch("run_rank", engine, dict(engine=engine, steps=args.steps, **common))
        print("running every engine interleaved ...", flush=True)
        _launch("run_rank_interleaved", "interleaved", dict(**interleaved_kwargs, **common))
        results = {
            engine: [_load(out_dir, f"{engine}-rank{r}.json") for r in (0, 1)] for engine in ENGINES
        }
        interleaved = [_load(out_dir, f"interleaved-rank{r}.json")["times"] for r in (0, 1)]
        profiles = None
        if args.profile:
            print("profiling every engine ...", flush=True)
            _launch("run_rank_profile", "profile", dict(steps=args.steps, **common))
            by_rank = [_load(out_dir, f"profile-rank{r}.json") for r in (0, 1)]
            profiles = {e: [ranks[e] for ranks in by_rank] for e in by_rank[0]}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        from fsdp_testing.launcher import shutdown

        shutdown()
    summary = _print_report(args, results, interleaved)
    _print_variants(args, summary, interleaved)
    if profiles is not None:
        from _step_profile import print_profile

        from fsdp_testing.cli._render import make_console

        print()
        print_profile(make_console(), profiles)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "results": results,
                    "interleaved": interleaved,
                    "paired_ratios": summary,
                    "profile": profiles,
                },
                f,
                indent=2,
            )
    if args.png:
        _write_png(args.png, args, results, interleaved)


if __name__ == "__main__":
    main()
