"""The planner's memory estimate against a real run: what a training step adds, per rank, on
CPU ranks (gloo).

For each configuration, ``fsdp-testing plan``'s own code (``make_plan``: the model sharded and
stepped on fake tensors in a fake world of 2 ranks) gives "step adds", its peak minus what stays
between steps. Then two gloo rank processes train the same model, built by the planner's own
``shard_model`` with the same optimizer and step, and measure what a step adds as
``benchmarks/graph_mode.py`` does: the kernel's peak RSS (``VmHWM``) is reset after two warm-up
steps (``/proc/self/clear_refs``) and read after the last, minus the RSS at the reset; the ranks
run with glibc's ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set) so that RSS follows the tensors
(every tensor over 128 KiB is its own mapping, returned when freed). The ratio planned /
measured is printed per rank, with whether it is within 15 %.

The configurations: the reference transformer at a width where its tensors are mappings
(``d_model=512``: sharded parameters, unsharded units and gradient buffers dominate; its
inputs are 6 and 4 tokens), under each strategy, mixed precision, offload and both doors, and
``blocks`` below, a stack of ``Linear + ReLU`` blocks on a large batch, where activations
dominate.

    python benchmarks/plan_vs_measured.py [--steps 5] [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TRANSFORMER = "transformer:d_model=512,nhead=8,dim_feedforward=2048,d_vocab=8192"
BLOCKS = "plan_vs_measured:blocks:dim=1024,depth=6"
BLOCKS_INPUT = ("2048,1024",)

#: (name, --model, options, --input-shape)
CONFIGS: tuple[tuple[str, str, dict[str, Any], tuple[str, ...]], ...] = (
    ("transformer FULL_SHARD", TRANSFORMER, {}, ()),
    ("transformer FULL_SHARD prefetch none", TRANSFORMER, {"prefetch": "none"}, ()),
    ("transformer SHARD_GRAD_OP", TRANSFORMER, {"strategy": "SHARD_GRAD_OP"}, ()),
    ("transformer NO_SHARD", TRANSFORMER, {"strategy": "NO_SHARD"}, ()),
    ("transformer FULL_SHARD mp bf16", TRANSFORMER, {"mp": "bf16"}, ()),
    ("transformer FULL_SHARD offload", TRANSFORMER, {"offload": True}, ()),
    ("transformer FULL_SHARD sgd", TRANSFORMER, {"optim": "sgd"}, ()),
    (
        "transformer fully_shard",
        TRANSFORMER,
        {"engine": "fsdp_core_fully_shard", "prefetch": "none"},
        (),
    ),
    ("blocks FULL_SHARD", BLOCKS, {"wrap": ("Block",)}, BLOCKS_INPUT),
    (
        "blocks SHARD_GRAD_OP",
        BLOCKS,
        {"wrap": ("Block",), "strategy": "SHARD_GRAD_OP"},
        BLOCKS_INPUT,
    ),
)
TOLERANCE = 0.15


class Block(nn.Module):
    """``Linear(dim, dim) + ReLU``: one unit under ``--wrap Block``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def blocks(dim: int = 1024, depth: int = 6) -> nn.Module:
    """``depth`` :class:`Block` s of width ``dim`` (the planner's ``--model`` callable)."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block(dim) for _ in range(depth)])


def _request(model: str, options: dict[str, Any], inputs: tuple[str, ...]) -> Any:
    from fsdp_testing.cli._plan_args import PlanRequest, parse_input_shape, parse_model

    return PlanRequest(
        model=parse_model(model),
        world_size=2,
        inputs=tuple(parse_input_shape(text) for text in inputs),
        **options,
    )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rank(rank: int, request: Any, steps: int, store: str, out: Any) -> None:
    from fsdp_testing.cli._plan_build import Built, make_optimizer, shard_model, train_step
    from fsdp_testing.engines import resolve_engine

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    engine = resolve_engine(request.engine)
    model, workload = shard_model(request, engine)
    built = Built(
        model, workload, make_optimizer(request, model), engine, torch.device("cpu"), None
    )
    base = 0
    for step in range(steps + 2):
        if step == 2:  # warmed up: what a step adds is measured from here
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _status_kib("VmRSS")
        dist.barrier()
        train_step(built)
    out.put((rank, (_status_kib("VmHWM") - base) * 1024))
    dist.destroy_process_group()


def _measure(request: Any, steps: int) -> list[int]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, request, steps, store, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    return [adds for _, adds in results]


@dataclasses.dataclass
class Row:
    name: str
    planned: int
    measured: list[int]

    @property
    def ratios(self) -> list[float]:
        return [self.planned / m if m > 0 else float("inf") for m in self.measured]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    parser.add_argument("--only", default="", help="run the configurations whose name has this")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # read by the spawned ranks
    from fsdp_testing.cli.plan import make_plan

    print(
        f"what a step adds over what stays between steps, MiB: planned (make_plan, fake world "
        f"of 2) against measured (2 gloo ranks, VmHWM over {args.steps} steps after 2 warm-up "
        "steps); ratio planned/measured per rank"
    )
    print(
        f"{'configuration':38} {'planned':>8} {'measured r0/r1':>16} {'ratio r0/r1':>12}  "
        "within 15%"
    )
    for name, model, options, inputs in CONFIGS:
        if args.only not in name:
            continue
        request = _request(model, options, inputs)
        plan = make_plan(request)
        row = Row(name, plan.measured.step_adds, _measure(request, args.steps))
        measured = "/".join(f"{m / 2**20:.1f}" for m in row.measured)
        ratios = "/".join(f"{r:.2f}" for r in row.ratios)
        verdict = "yes" if all(abs(r - 1) <= TOLERANCE for r in row.ratios) else "NO"
        print(
            f"{name:38} {row.planned / 2**20:8.1f} {measured:>16} {ratios:>12}  {verdict}",
            flush=True,
        )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
