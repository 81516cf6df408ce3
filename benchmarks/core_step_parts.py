"""Where an fsdp_core step's time goes, by the engine's own functions.

World size 2 on gloo, the model of ``core_vs_fsdp2.py`` (the same ``--width`` and ``--blocks``),
one door (``--engine``). Every engine function below is wrapped with a clock: each one's own
time is its time minus that of the wrapped functions it called, and the time spent waiting for a
collective (``fsdp_core._collectives.wait``) is put under the function that waited, e.g. ``wait
in CpuOverlap.make_room`` (a reduce-scatter in flight, finished before the next one) or ``wait in
FSDPUnit.wait_for_unshard`` (an all-gather issued ahead or prefetched). Per rank, milliseconds
per step, calls per step and minor page faults per step (on the stepping thread: a first touch
of a fresh page) over ``--steps`` steps after ``--warmup``, largest first; what is not in a row
(autograd's compute, the optimizer's) is the step minus the rows. ``--engine torch_fsdp2`` or
``ddp`` steps a peer instead: its phases and page faults only, no rows, for comparison.

``core_vs_fsdp2.py --profile`` splits a step by ATen operator (compute, copy, collectives) for
every engine; this script splits fsdp_core's by its own code, which the operators cannot show
(a wait is no operator). The clocks cost a few microseconds per call, under 1% of a step.

Usage: python benchmarks/core_step_parts.py [--engine fsdp_core_fully_shard] [--width 512]
       [--blocks 4] [--steps 8] [--warmup 3]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

WAIT = "wait"
# (module, class or None, function): what is clocked, labelled "Class.function".
PARTS = (
    ("fsdp_core._collectives", None, "wait"),
    ("fsdp_core._runtime", "FSDPState", "pre_forward"),
    ("fsdp_core._runtime", "FSDPState", "post_forward"),
    ("fsdp_core._runtime", "FSDPState", "_pre_backward_hook"),
    ("fsdp_core._runtime", "FSDPState", "post_backward"),
    ("fsdp_core._runtime", "FSDPState", "_final_callback"),
    ("fsdp_core._runtime", "FSDPState", "_prefetch"),
    ("fsdp_core._unit", "FSDPUnit", "unshard"),
    ("fsdp_core._unit", "FSDPUnit", "wait_for_unshard"),
    ("fsdp_core._unit", "FSDPUnit", "gather_ahead"),
    ("fsdp_core._unit", "FSDPUnit", "reshard"),
    ("fsdp_core._unit", "FSDPUnit", "post_backward"),
    ("fsdp_core._unit", "FSDPUnit", "_gather"),
    ("fsdp_core._unit", "FSDPUnit", "_copy_out"),
    ("fsdp_core._unit_grads", "UnitGrads", "_reduce_input"),
    ("fsdp_core._unit_grads", "UnitGrads", "_reduce_later"),
    ("fsdp_core._unit_grads", "UnitGrads", "_reduce"),
    ("fsdp_core._unit_grads", "UnitGrads", "_reduced"),
    ("fsdp_core._overlap", "CpuOverlap", "make_room"),
    ("fsdp_core._overlap", "CpuOverlap", "flush"),
    ("fsdp_core._param", "ShardedParam", "to_unsharded"),
    ("fsdp_core._param", "ShardedParam", "copy_from_gathered"),
    ("fsdp_core._param", "ShardedParam", "to_sharded"),
)


def thread_faults() -> int:
    """Minor page faults of the calling thread so far (a first touch of a fresh page)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


class Clocks:
    """Own time, page faults and calls per label of the wrapped functions (one thread: the
    stepping one)."""

    def __init__(self) -> None:
        self.own: dict[str, float] = collections.defaultdict(float)
        self.faults: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._open: list[list[Any]] = []  # [label, time, faults of wrapped calls inside it]

    def wrap(self, owner: Any, name: str, label: str) -> None:
        function = getattr(owner, name)

        @functools.wraps(function)
        def clocked(*args: Any, **kwargs: Any) -> Any:
            frame = [label, 0.0, 0]
            self._open.append(frame)
            faults = thread_faults()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                faulted = thread_faults() - faults
                self._open.pop()
                key = label
                if label == WAIT:
                    key = f"wait in {self._open[-1][0]}" if self._open else WAIT
                self.own[key] += elapsed - frame[1]
                self.faults[key] += faulted - frame[2]
                self.calls[key] += 1
                if self._open:
                    self._open[-1][1] += elapsed
                    self._open[-1][2] += faulted

        setattr(owner, name, clocked)

    def clear(self) -> None:
        self.own.clear()
        self.faults.clear()
        self.calls.clear()


def run_rank_parts(
    width: int, blocks: int, engine: str, steps: int, warmup: int, out_dir: str
) -> None:
    """Step ``engine`` with every part clocked; write ``parts-rank{N}.json``."""
    import importlib

    import torch
    import torch.distributed as dist
    from core_vs_fsdp2 import _build, _wrap

    torch.set_num_threads(1)
    clocks = Clocks()
    for module, cls, name in PARTS:
        owner = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
        clocks.wrap(owner, name, WAIT if cls is None else f"{cls}.{name}")
    model, block_class = _build(width, blocks)
    model = _wrap(engine, model, block_class)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batch = torch.randn(4, 64, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    phases = dict.fromkeys(("step", "forward", "backward", "optimizer"), 0.0)

    def step() -> None:
        start = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        loss = model(batch).pow(2).mean()
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optim.step()
        end = time.perf_counter()
        for phase, seconds in zip(
            phases, (end - start, forward - start, backward - forward, end - backward), strict=True
        ):
            phases[phase] += seconds

    for _ in range(warmup):
        step()
    clocks.clear()
    phases.update(dict.fromkeys(phases, 0.0))
    faults = {"thread": 0, "process": 0}
    for _ in range(steps):
        dist.barrier()
        before = thread_faults(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults["thread"] += thread_faults() - before[0]
        faults["process"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before[1]
    result = {
        "phases": {k: v / steps for k, v in phases.items()},
        "step_faults": {k: n / steps for k, n in faults.items()},
        "own": {k: v / steps for k, v in clocks.own.items()},
        "faults": {k: n / steps for k, n in clocks.faults.items()},
        "calls": {k: n / steps for k, n in clocks.calls.items()},
    }
    with open(os.path.join(out_dir, f"parts-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def report(results: list[dict[str, Any]], engine: str, steps: int, warmup: int) -> str:
    """The table of both ranks' parts, largest first (by the larger rank's time)."""
    ms = [{k: v * 1000 for k, v in r["phases"].items()} for r in results]
    lines = [
        f"{engine}, world size 2, {steps} steps after {warmup}; ms per step, ranks 0 / 1:",
        "step {:.1f} / {:.1f} (forward {:.1f} / {:.1f}, backward {:.1f} / {:.1f}, "
        "optimizer {:.1f} / {:.1f})".format(
            *(m[p] for p in ("step", "forward", "backward", "optimizer") for m in ms)
        ),
        "minor page faults per step, ranks 0 / 1: {:.0f} / {:.0f} on the stepping thread, "
        "{:.0f} / {:.0f} in the process".format(
            *(r["step_faults"][k] for k in ("thread", "process") for r in results)
        ),
        "",
        f"{'part':44s} {'rank 0 ms':>9s} {'rank 1 ms':>9s} {'calls/step':>10s} "
        f"{'faults r0/r1':>13s}",
    ]
    labels = sorted(
        {k for r in results for k in r["own"]},
        key=lambda k: -max(r["own"].get(k, 0.0) for r in results),
    )
    for label in labels:
        own = [r["own"].get(label, 0.0) * 1000 for r in results]
        calls = max(r["calls"].get(label, 0.0) for r in results)
        faults = "/".join(f"{r['faults'].get(label, 0.0):.0f}" for r in results)
        lines.append(f"{label:44s} {own[0]:9.1f} {own[1]:9.1f} {calls:10.1f} {faults:>13s}")
    totals = [sum(r["own"].values()) * 1000 for r in results]
    lines.append(f"{'all of the above':44s} {totals[0]:9.1f} {totals[1]:9.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine",
        choices=("fsdp_core", "fsdp_core_fully_shard", "torch_fsdp2", "ddp"),
        default="fsdp_core_fully_shard",
    )
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from core_vs_fsdp2 import _launch

    out_dir = tempfile.mkdtemp(prefix="fsdp-parts-")
    try:
        kwargs = dict(
            width=args.width,
            blocks=args.blocks,
            engine=args.engine,
            steps=args.steps,
            warmup=args.warmup,
            out_dir=out_dir,
        )
        _launch("run_rank_parts", "core_step_parts", kwargs, script=__file__)
        results = []
        for rank in range(2):
            with open(os.path.join(out_dir, f"parts-rank{rank}.json")) as f:
                results.append(json.load(f))
        print(report(results, args.engine, args.steps, args.warmup))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
