"""Testing your own sharded-training code: the ZeRO-2 wrapper of ``zero2_wrapper.py``, with the
marker, the parity helper, recording, a fault and local mode. Copy this page first.

Run it with ``pytest examples/test_zero2_wrapper.py`` or ``python examples/test_zero2_wrapper.py``.
"""

import pytest
import torch
from zero2_wrapper import ZeRO2, batch, build, mse, sgd

from fsdp_testing import faults
from fsdp_testing.parity import check_parity
from fsdp_testing.recording import record_fsdp


def zero2(module, group):
    return ZeRO2(module, group, optimizer=sgd)


# 1. Parity: the wrapper trains exactly as DDP does (bitwise at 2 CPU ranks). A wrong gradient
#    scaling fails here, naming the step, both losses and each parameter with its largest
#    difference.
@pytest.mark.distributed(world_size=2)
def test_zero2_matches_ddp(process_group):
    check_parity(
        build,
        zero2,
        batch,  # batch(i, rank): rank's batch of the i-th forward
        process_group=process_group,
        loss_fn=mse,
        make_optimizer=sgd,  # the reference's optimizer
        wrapped_optimizer=lambda model: model,  # ZeRO2 steps its own slice: model.step()
        num_steps=3,
        exact=True,
    )


# 2. On 3 thread ranks against a single-process reference (no communication: every rank's
#    batch in one process, the losses averaged), accumulating gradients over 2 micro-batches
#    per step. Uneven slices: 808 elements over 3 ranks. Within FP32_TOLERANCE: 3 ranks sum in
#    another order than one process.
@pytest.mark.distributed(world_size=3, mode="thread")
def test_zero2_matches_one_process_on_uneven_slices(process_group):
    check_parity(
        build,
        zero2,
        batch,
        process_group=process_group,
        reference="local",
        loss_fn=mse,
        make_optimizer=sgd,
        wrapped_optimizer=lambda model: model,
        accum_steps=2,
    )


# 3. Recording: one reduce-scatter and one all-gather per step, of the padded flat buffer.
@pytest.mark.distributed(world_size=2)
def test_zero2_sends_one_reduce_scatter_and_one_all_gather_per_step(rank, process_group):
    torch.manual_seed(0)
    model = zero2(build(), process_group)
    with record_fsdp() as rec:
        for step in range(2):
            mse(model, batch(step, rank)).backward()
            model.step()
            model.zero_grad()
            rec.next_step()
    flat_bytes = model.shard.numel() * 2 * 4  # 2 slices of fp32
    for step in range(2):
        rec.assert_count("reduce_scatter", 1, step=step)
        rec.assert_count("all_gather", 1, step=step)
        assert [c.bytes for c in rec.collectives("reduce_scatter", step=step)] == [flat_bytes]


# 4. A fault: rank 1 dies in its first all-gather (after the first optimizer step).
#    faults.expect passes only if rank 1 is the one that fails, with this report; any other
#    failure (or none) fails the test.
@faults.expect(rank=1, match=r"rank 1 killed by SIGKILL at all_gather\w* #1")
@pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=1, op="all_gather")])
def test_zero2_when_a_rank_dies(rank, process_group):
    model = zero2(build(), process_group)
    mse(model, batch(0, rank)).backward()
    model.step()


# 5. Local mode: all 8 ranks in this process, one at a time, with exact collectives.
@pytest.mark.distributed(world_size=8, mode="local")
def test_zero2_matches_ddp_at_8_ranks(process_group):
    check_parity(
        build,
        zero2,
        batch,
        process_group=process_group,
        loss_fn=mse,
        make_optimizer=sgd,
        wrapped_optimizer=lambda model: model,
    )


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
