"""What each per-test reset of a warm rank costs, timed one by one.

Between two tests a warm rank resets its flight recorder (before the task) and restores what a
test may change in its process (``RankState.restore``, after it has sent its result; see
[Note: warm pool isolation] in ``fsdp_testing/_launch/pool.py``). This runs them in one
process set up as a rank is after a DTensor test: a gloo group of one, DTensor imported and
used, 40 collectives in the flight record. Each figure is the median of ``--repeat`` calls in a
warm loop, in microseconds; a rank woken for its next task runs them with cold caches, several
times slower (``docs/benchmarks.md``, "Harness overhead").

Usage: python benchmarks/rank_resets.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable


def _median_us(call: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        begin = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - begin)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3000, help="calls per reset (median)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_testing._rank import comm_observer
    from fsdp_testing._rank.state_reset import RankState
    from fsdp_testing._report import collective_log
    from fsdp_testing.cli._render import make_console, print_table

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            recorder = collective_log.FlightRecorder(path=os.path.join(tmp, "rank0.flight"))
            comm_observer.install(lambda: recorder)
            mesh = init_device_mesh("cpu", (1,))
            (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2).to_local()
            for _ in range(40):
                dist.all_reduce(torch.ones(1))
            state = RankState()
            rows = [("flight recorder (before the task)", recorder.reset)]
            rows += [(f"RankState: {name}", step) for name, step in state.steps()]
            rows.append(("RankState.restore, all of it", state.restore))
            table = [[name, f"{_median_us(call, args.repeat):.1f}"] for name, call in rows]
        finally:
            dist.destroy_process_group()
    print_table(make_console(), ["reset", "median us"], table)


if __name__ == "__main__":
    main()
