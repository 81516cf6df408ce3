"""Graph mode against eager ``fully_shard``: step time and peak memory on the CPU (gloo).

Each variant runs in a fresh pair of rank processes (peak RSS only grows within a process) on
a model of ``--blocks`` equal ``Linear(dim, dim) + Tanh`` blocks, each block one unit (the
root owns no parameter): eager fsdp_core ``fully_shard``, eager torch FSDP2 ``fully_shard``,
and graph mode (``trace_train_step`` on fsdp_core's ``fully_shard``) with each pass alone and
all together.
A step is forward, loss, backward and an SGD step; the time is the median over ``--steps``
steps after two warm-up steps, the slowest rank's. Peak RSS is each rank's ``ru_maxrss``;
"step adds" is what the measured steps add on top of the resident memory between steps: the
kernel's peak RSS (``VmHWM``) is reset after warm-up (``/proc/self/clear_refs``) and read after
the last step. For that to follow the tensors alive, the ranks run with glibc's
``MALLOC_MMAP_THRESHOLD_=131072`` (unless set): every tensor over 128 KiB is its own mapping,
returned to the system when freed, instead of a heap block glibc keeps (with the default,
dynamic threshold RSS stays at its high-water mark and a step adds nothing measurable). This
costs every variant an mmap and munmap per large tensor, which the step times include.
``peak_memory`` is graph mode's liveness estimate of one step (bytes alive at the worst node);
compare its drops between variants with those of "step adds".

    python benchmarks/graph_mode.py [--blocks 8] [--dim 1024] [--batch 64] [--steps 20]
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

VARIANTS = (
    "eager fsdp_core",
    "eager torch FSDP2",
    "graph: no pass",
    "graph: reshard_after_forward",
    "graph: bucket_all_gathers",
    "graph: bucket_reduce_scatters",
    "graph: prefetch",
    "graph: all four",
)


def _passes(variant: str) -> tuple[Any, ...]:
    from fsdp_core.graph import passes

    big = 1 << 30
    table = {
        "graph: no pass": (),
        "graph: reshard_after_forward": (passes.reshard_after_forward,),
        "graph: bucket_all_gathers": (
            functools.partial(passes.bucket_all_gathers, bucket_bytes=big),
        ),
        "graph: bucket_reduce_scatters": (
            functools.partial(passes.bucket_reduce_scatters, bucket_bytes=big),
        ),
        "graph: prefetch": (passes.prefetch,),
    }
    table["graph: all four"] = tuple(p for name in list(table)[1:] for p in table[name])
    return table[variant]


def _model(args: argparse.Namespace, variant: str) -> nn.Module:
    import torch.distributed.fsdp
    from torch.distributed.device_mesh import DeviceMesh

    import fsdp_core

    fully_shard: Any = (
        torch.distributed.fsdp.fully_shard
        if variant == "eager torch FSDP2"
        else fsdp_core.fully_shard
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(args.dim, args.dim), nn.Tanh()) for _ in range(args.blocks)]
    )
    mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), "cpu")
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank(rank: int, args: argparse.Namespace, variant: str, store: str, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = _model(args, variant)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.batch, args.dim)
    estimate = None
    if variant.startswith("graph"):
        from fsdp_core.graph import peak_memory, trace_train_step

        step = trace_train_step(model, lambda m, x: m(x).square().mean(), (x,))
        step = step.with_passes(*_passes(variant))
        estimate = peak_memory(step.gm)[0]

        def run() -> None:
            step(x)
    else:

        def run() -> None:
            model(x).square().mean().backward()

    times = []
    base = 0.0
    for i in range(args.steps + 2):
        if i == 2:  # warmed up: what a step adds is measured from here
            base = _reset_peak_rss()
        dist.barrier()
        begin = time.perf_counter()
        optim.zero_grad()
        run()
        optim.step()
        elapsed = torch.tensor([time.perf_counter() - begin])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(float(elapsed))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB
    step_peak = _status_mib("VmHWM") - base
    out.put((rank, statistics.median(times), rss, step_peak, estimate))
    dist.destroy_process_group()


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> float:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS and return that RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _run(
    args: argparse.Namespace, variant: str
) -> tuple[float, list[float], list[float], int | None]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, args, variant, store, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    return results[0][1], [r[2] for r in results], [r[3] for r in results], results[0][4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # read by the spawned ranks
    unit = args.dim * (args.dim + 1) * 4
    print(
        f"{args.blocks} x Linear({args.dim}, {args.dim}) + Tanh, batch {args.batch}, fp32, "
        f"2 gloo ranks, one unit {unit / 2**20:.1f} MiB gathered; median of {args.steps} steps"
    )
    print(
        f"{'variant':30} {'step ms':>8} {'peak RSS MiB':>13} {'step adds MiB':>14} "
        f"{'peak_memory MiB':>16}"
    )
    for variant in VARIANTS:
        step_s, rss, adds, estimate = _run(args, variant)
        est = "-" if estimate is None else f"{estimate / 2**20:.1f}"
        rss_text = "/".join(f"{r:.0f}" for r in rss)
        adds_text = "/".join(f"{a:.1f}" for a in adds)
        print(
            f"{variant:30} {step_s * 1e3:8.1f} {rss_text:>13} {adds_text:>14} {est:>16}",
            flush=True,
        )


if __name__ == "__main__":
    main()
