"""A user's suite with pytest-xdist and without: ``pytest -n 2`` against serial ``pytest``, in
the same run, alternating.

The generated suite is like a user's (issue 49): many small distributed tests at world sizes 2
and 4, in process mode (the warm pool), beside plain unit tests:

- ``test_collectives.py``: all_reduce, all_gather, broadcast and reduce_scatter of small tensors;
- ``test_ddp.py``: a few DDP steps of a small MLP against the same steps on one process;
- ``test_fsdp.py``: a few steps of torch's ``fully_shard`` on a small MLP against one process;
- ``test_tp.py``: a column-wise and row-wise parallel MLP (DTensor) against the plain one;
- ``test_pipeline.py``: a two- or four-stage send/recv pipeline of an MLP;
- ``test_plain.py``: unit tests that start no ranks.

Each repeat runs one serial session and one with ``-n 2`` (``--dist loadfile``, what the docs
advise, and plain ``-n 2`` with ``--plain-dist``), each a fresh ``pytest`` process. Printed:
each kind's wall time (median over the repeats), the ratio of ``-n 2`` to serial per repeat
(paired: the two ran one after the other), and the first distributed test's setup + call +
teardown (what starting the ranks costs; under ``-n 2``, the slower worker's first test).

Usage: python benchmarks/xdist_speed.py [--repeat N] [--scale K] [--plain-dist] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLLECTIVES = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_all_reduce_2(rank, world_size, i):
    t = torch.full((8,), float(rank + i))
    dist.all_reduce(t)
    assert t[0].item() == sum(range(world_size)) + i * world_size


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("i", range({n}))
def test_all_gather_4(rank, world_size, i):
    out = [torch.empty(3) for _ in range(world_size)]
    dist.all_gather(out, torch.full((3,), float(rank + i)))
    assert [o[0].item() for o in out] == [float(r + i) for r in range(world_size)]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_broadcast_2(rank, i):
    t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    dist.broadcast(t, src=0)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("i", range({n}))
def test_reduce_scatter_4(rank, world_size, i):
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.ones(2 * world_size) * (i + 1))
    assert out.tolist() == [float(world_size * (i + 1))] * 2
"""

CONFTEST = """
import json
import os

DURATIONS = {}


def pytest_runtest_logreport(report):
    DURATIONS[report.nodeid] = DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(os.environ["XDIST_SPEED_OUT"], worker + ".json"), "w") as f:
        json.dump(DURATIONS, f)
"""

MODELS = """
import copy

import torch
import torch.distributed as dist
from torch import nn


def mlp(seed=0, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))


def batch(rank, step, width=16):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, width, generator=g)


def reference_steps(model, world_size, steps, width=16):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.cat([batch(r, step, width) for r in range(world_size)])
        model(x).sum().div(world_size).backward()
        opt.step()
        opt.zero_grad()
    return model
"""

DDP = """
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from models import batch, mlp, reference_steps


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_ddp_2(rank, world_size, i):
    _ddp(rank, world_size, i)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("i", range({n}))
def test_ddp_4(rank, world_size, i):
    _ddp(rank, world_size, i)


def _ddp(rank, world_size, seed):
    model = mlp(seed)
    expected = reference_steps(model, world_size, steps=3)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        ddp(batch(rank, step)).sum().backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(ddp.module.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q)
"""

FSDP = """
import pytest
import torch
from torch.distributed.fsdp import fully_shard

from models import batch, mlp, reference_steps


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_fsdp_2(rank, world_size, i):
    _fsdp(rank, world_size, i)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("i", range({n}))
def test_fsdp_4(rank, world_size, i):
    _fsdp(rank, world_size, i)


def _fsdp(rank, world_size, seed):
    model = mlp(seed)
    expected = reference_steps(model, world_size, steps=2)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(batch(rank, step)).sum().backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p.full_tensor(), q)
"""

TP = """
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from models import mlp


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_tp_2(world_size, i):
    _tp(world_size, i)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("i", range({n}))
def test_tp_4(world_size, i):
    _tp(world_size, i)


def _tp(world_size, seed):
    mesh = init_device_mesh("cpu", (world_size,))
    model = mlp(seed)
    expected = mlp(seed)(torch.ones(2, 16))
    parallelize_module(model, mesh, {{"0": ColwiseParallel(), "2": RowwiseParallel()}})
    torch.testing.assert_close(model(torch.ones(2, 16)), expected)
"""

PIPELINE = """
import pytest
import torch
import torch.distributed as dist

from models import mlp


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_pipeline_2(rank, world_size, i):
    _pipeline(rank, world_size, i)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("i", range({n}))
def test_pipeline_4(rank, world_size, i):
    _pipeline(rank, world_size, i)


def _pipeline(rank, world_size, seed):
    stages = [mlp(seed + s) for s in range(world_size)]
    x = torch.ones(2, 16)
    with torch.no_grad():
        expected = x
        for stage in stages:
            expected = stage(expected)
        h = x if rank == 0 else torch.empty(2, 16)
        if rank > 0:
            dist.recv(h, src=rank - 1)
        h = stages[rank](h)
        if rank < world_size - 1:
            dist.send(h, dst=rank + 1)
        else:
            torch.testing.assert_close(h, expected)
"""

PLAIN = """
import pytest
import torch

from models import mlp


@pytest.mark.parametrize("i", range({n}))
def test_shapes(i):
    assert mlp(i)(torch.ones(3, 16)).shape == (3, 16)


@pytest.mark.parametrize("i", range({n}))
def test_grads(i):
    model = mlp(i)
    model(torch.ones(3, 16)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
"""

FILES = {
    "test_collectives.py": COLLECTIVES,
    "test_ddp.py": DDP,
    "test_fsdp.py": FSDP,
    "test_tp.py": TP,
    "test_pipeline.py": PIPELINE,
    "test_plain.py": PLAIN,
}


PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly")


def _session(folder: Path, *args: str) -> tuple[float, float, int]:
    """Run pytest in ``folder``: its wall time, the slowest first distributed test of any of
    its workers, and the number of tests."""
    out = folder / "durations"
    out.mkdir(exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    start = time.monotonic()
    proc = subprocess.run(
        [*PYTEST, *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=1800,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]),
            "XDIST_SPEED_OUT": str(out),
        },
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"pytest {' '.join(args)} failed:\n{proc.stdout[-4000:]}")
    first = 0.0
    tests = 0
    for worker in out.iterdir():
        durations = json.loads(worker.read_text())  # in the order the worker ran them
        tests += len(durations)
        distributed = [t for nodeid, t in durations.items() if "test_plain" not in nodeid]
        if distributed:
            first = max(first, distributed[0])
    return wall, first, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="sessions of each kind")
    parser.add_argument("--scale", type=int, default=4, help="tests per parametrized group")
    parser.add_argument(
        "--plain-dist", action="store_true", help="-n 2 with xdist's default --dist load"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    xdist = ["-n", "2"] + ([] if args.plain_dist else ["--dist", "loadfile"])
    kinds = {"serial": [], " ".join(xdist): xdist}
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="xdist-speed-") as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(CONFTEST)
        (folder / "models.py").write_text(MODELS)
        for name, text in FILES.items():
            (folder / name).write_text(text.format(n=args.scale))
        for _ in range(args.repeat):
            for kind, extra in kinds.items():  # alternating, so drift hits both alike
                runs[kind].append(_session(folder, *extra))
    (serial, parallel) = kinds
    ratios = [p[0] / s[0] for s, p in zip(runs[serial], runs[parallel], strict=True)]
    figures = {
        kind: {
            "wall_s": statistics.median(r[0] for r in runs[kind]),
            "first_test_s": statistics.median(r[1] for r in runs[kind]),
            "tests": runs[kind][0][2],
        }
        for kind in kinds
    }
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"kinds": figures, "paired_ratios": ratios, "load_after": load}))
        return
    print(f"{figures[serial]['tests']} tests, {args.repeat} sessions of each kind")
    print(f"{'kind':<22} {'wall':>8} {'first test':>11}")
    for kind, row in figures.items():
        print(f"{kind:<22} {row['wall_s']:>7.1f}s {row['first_test_s']:>10.2f}s")
    print(
        f"{parallel} / serial, paired: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f" (median {statistics.median(ratios):.2f}); load average now {load:.1f}"
    )


if __name__ == "__main__":
    main()
