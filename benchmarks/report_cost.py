"""What a failure report costs: a failing local-mode test against the same test passing, at 8
and 64 ranks, and the size of the report (lines, longest line).

Two bodies, each run passing and failing, each in its own pytest session:

- ``same``: every rank all-reduces a tensor and asserts on the result with a message
  (``assert t.item() == 0, "the sum is not zero"`` fails alike on every rank);
- ``model``: a user's training step (a small model, a reduce-scatter of its gradients, an
  all-gather of the updated shard) checked against a reference with
  ``torch.testing.assert_close``, which fails on every rank with numbers of its own (a forgotten
  division by the world size).

The figure is the test's call phase as pytest reports it (``report.duration``), so interpreter
start and collection are not counted; the failing call includes writing the report.

Usage: python benchmarks/report_cost.py [--worlds 8 64] [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

TEST = """
import pytest
import torch
import torch.distributed as dist
from torch import nn

WORLD = {world}
FAIL = {fail}


@pytest.mark.distributed(world_size=WORLD, mode="local")
def test_same(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    expected = 0 if FAIL else WORLD
    assert t.item() == expected, "the sum is not zero"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.mark.distributed(world_size=WORLD, mode="local")
def test_model(rank, world_size):
    model, ref = _model(), _model()
    torch.manual_seed(1)
    inputs = [torch.randn(4, 16) for _ in range(world_size)]
    model(inputs[rank]).pow(2).mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    pad = -flat.numel() % world_size
    flat = torch.nn.functional.pad(flat, (0, pad))
    shard = torch.empty(flat.numel() // world_size)
    dist.reduce_scatter_tensor(shard, flat)
    if not FAIL:
        shard /= world_size  # the step the failing variant forgets
    params = torch.nn.functional.pad(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]), (0, pad)
    )
    mine = params.chunk(world_size)[rank] - 0.1 * shard
    full = torch.empty_like(params)
    dist.all_gather_into_tensor(full, mine)
    sum(ref(x).pow(2).mean() for x in inputs).div(world_size).backward()
    offset = 0
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        updated = full[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        expected = r.detach() - 0.1 * r.grad
        torch.testing.assert_close(updated, expected, msg=lambda m: f"{{name}}: {{m}}")
"""

PHASES_PLUGIN = """
import json, os

_calls = {}


def pytest_runtest_logreport(report):
    if report.when == "call":
        text = report.longreprtext if report.failed else ""
        _calls[report.nodeid.split("::")[-1]] = {
            "seconds": report.duration,
            "lines": len(text.splitlines()),
            "longest": max((len(line) for line in text.splitlines()), default=0),
        }


def pytest_sessionfinish(session):
    with open(os.environ["REPORT_COST_OUT"], "w") as f:
        json.dump(_calls, f)
"""


def _session(root: Path, world: int, fail: bool, body: str) -> dict[str, float]:
    name = f"test_{body}_{world}_{'fail' if fail else 'pass'}.py"
    (root / name).write_text(TEST.format(world=world, fail=fail))
    out = root / f"{name}.json"
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "REPORT_COST_OUT": str(out), "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "report_cost_phases"]
    cmd += [f"{name}::test_{body}", "--dist-timeout", "600"]
    subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    return json.loads(out.read_text())[f"test_{body}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--bodies", nargs="+", default=["same", "model"])
    parser.add_argument("--repeat", type=int, default=3, help="sessions per figure (median)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "report_cost_phases.py").write_text(textwrap.dedent(PHASES_PLUGIN))
        for body in args.bodies:
            for world in args.worlds:
                runs = {
                    fail: [_session(root, world, fail, body) for _ in range(args.repeat)]
                    for fail in (False, True)
                }
                passing = statistics.median(r["seconds"] for r in runs[False])
                failing = statistics.median(r["seconds"] for r in runs[True])
                rows.append(
                    {
                        "body": body,
                        "world": world,
                        "passing_s": round(passing, 3),
                        "failing_s": round(failing, 3),
                        "ratio": round(failing / passing, 1),
                        "report_lines": runs[True][0]["lines"],
                        "longest_line": runs[True][0]["longest"],
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    head = ("body", "ranks", "passing", "failing", "ratio", "lines", "longest")
    print("{:6} {:>5} {:>9} {:>9} {:>6} {:>6} {:>8}".format(*head))
    for r in rows:
        print(
            f"{r['body']:6} {r['world']:>5} {r['passing_s']:>8.2f}s {r['failing_s']:>8.2f}s "
            f"{r['ratio']:>5.1f}x {r['report_lines']:>6} {r['longest_line']:>8}"
        )


if __name__ == "__main__":
    main()
