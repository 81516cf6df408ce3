"""Time per training step of a small model at world sizes 8 to 128 in local, thread and process
mode, measured in one run on this machine, and the wall time of a world-size-64 parity check.

Each configuration is one distributed test in its own pytest session: a 4-layer MLP (width
``--dim``) sharded per layer by fsdp_core's ``fully_shard`` trains ``--steps`` SGD steps on a
batch of 4 rows per rank; rank 0 times each step between two barriers (the whole world's step,
whatever runs concurrently) and the figure is the median step after the first. Local mode runs
every rank in one thread at a time (one core); thread mode runs them as concurrent threads over
torch's threaded group (not exact: ranks share one RNG); process mode forks a gloo rank per
rank (the warm pool), only up to ``--process-max`` ranks (each rank is a process with torch
loaded). Ratios are thread and process time against local time in the same run.

The parity row is ``tests/scale``'s body at world size 64: build the model on every rank from
one seed, shard it, train 3 steps on a per-rank slice of one global batch and compare every
full parameter with a single-process reference trained on the whole batch; the figure is the
whole test's wall time as pytest records it (the goal: under 30 s).

Usage: python benchmarks/scale.py [--sizes 8,32,64,128] [--steps 5] [--process-max 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

STEP_TEST = """
import json, os, time

import pytest, torch, torch.distributed as dist, torch.nn as nn

from fsdp_core import fully_shard


@pytest.mark.distributed(world_size={world_size}, mode="{mode}", timeout=1800)
def test_steps(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear({dim}, {dim}) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    batch = torch.randn(4, {dim})
    times = []
    for _ in range({steps}):
        dist.barrier()
        start = time.perf_counter()
        model(batch).square().mean().backward()
        optim.step()
        optim.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(os.environ["SCALE_OUT"], "w") as f:
            json.dump(times, f)
"""

PARITY_TEST = """
import copy

import pytest, torch, torch.distributed as dist, torch.nn as nn

from fsdp_core import fully_shard


@pytest.mark.distributed(world_size={world_size}, mode="local", timeout=1800)
def test_parity(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear({dim}, {dim}) for _ in range(4)])
    reference = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(100 + step)
        batch = torch.randn(2 * world_size, {dim})
        model(batch[2 * rank : 2 * rank + 2]).square().mean().backward()
        reference(batch).square().mean().backward()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref, msg=name)
"""


def _run(work: Path, name: str, source: str) -> tuple[list[float], float]:
    """Run one test file; return rank 0's step times and pytest's wall time for the test."""
    path = work / f"test_{name}.py"
    path.write_text(textwrap.dedent(source))
    out, xml = work / f"{name}.json", work / f"{name}.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            path.name,
        ],
        cwd=work,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "SCALE_OUT": str(out)},
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name}: pytest failed\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
    wall = sum(float(tc.get("time", 0)) for tc in ET.parse(xml).getroot().iter("testcase"))
    times = json.loads(out.read_text()) if out.exists() else []
    return times, wall


def _median_step(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,64,128", help="world sizes (8,32,64,128)")
    parser.add_argument("--modes", default="local,thread,process", help="modes to time")
    parser.add_argument("--steps", type=int, default=5, help="steps per configuration (5)")
    parser.add_argument("--dim", type=int, default=256, help="width of the 4 layers (256)")
    parser.add_argument(
        "--process-max", type=int, default=32, help="largest process-mode world (32)"
    )
    parser.add_argument("--parity-world-size", type=int, default=64, help="parity row (64)")
    args = parser.parse_args()
    from fsdp_testing.cli._render import make_console, print_table

    sizes = [int(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    medians: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size in sizes:
            for mode in modes:
                if mode == "process" and size > args.process_max:
                    continue
                source = STEP_TEST.format(
                    world_size=size, mode=mode, dim=args.dim, steps=args.steps
                )
                times, _ = _run(work, f"{mode}{size}", source)
                medians[(mode, size)] = _median_step(times)
                print(f"{mode:8} ws {size:4}: {medians[(mode, size)] * 1000:9.1f} ms/step")
        _, parity_wall = _run(
            work, "parity", PARITY_TEST.format(world_size=args.parity_world_size, dim=args.dim)
        )
    rows = []
    for size in sizes:
        local = medians.get(("local", size))
        row = [str(size)]
        for mode in modes:
            value = medians.get((mode, size))
            row.append("n/a" if value is None else f"{value * 1000:.1f}")
        for mode in modes:
            if mode == "local":
                continue
            value = medians.get((mode, size))
            row.append("n/a" if value is None or local is None else f"{value / local:.2f}x")
        rows.append(row)
    headers = ["world size", *[f"{m} ms/step" for m in modes]]
    headers += [f"{m} / local" for m in modes if m != "local"]
    print_table(make_console(), headers, rows)
    print(
        f"parity of the 4-layer model at world size {args.parity_world_size} in local mode: "
        f"{parity_wall:.1f} s (goal: under 30 s)"
    )


if __name__ == "__main__":
    main()
