"""Torch-style pipelining tests changed only in their imports, as torch's
test/distributed/pipelining files are written; run by tests/unittest_compat/test_torch_pipelining.py."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from fsdp_testing.common_distributed import MultiProcContinuousTest, MultiProcessTestCase
from fsdp_testing.common_utils import (
    TEST_MULTIACCELERATOR,
    check_leaked_tensors,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    skip_but_pass_in_sandcastle_if,
)

D_HID, BATCH, CHUNKS = 8, 8, 4


def two_stage_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_HID, D_HID), nn.Linear(D_HID, D_HID))


class ScheduleTest(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @parametrize("ScheduleClass", [ScheduleGPipe, Schedule1F1B])
    def test_grads_match_one_process(self, ScheduleClass):
        full = two_stage_model()
        ref = copy.deepcopy(full)
        x = torch.randn(BATCH, D_HID, generator=torch.Generator().manual_seed(1))
        target = torch.randn(BATCH, D_HID, generator=torch.Generator().manual_seed(2))
        loss_fn = nn.MSELoss(reduction="sum")
        stage = PipelineStage(full[self.rank], self.rank, self.world_size, torch.device("cpu"))
        schedule = ScheduleClass(stage, CHUNKS, loss_fn=loss_fn, scale_grads=False)
        with check_leaked_tensors() as garbage_tensors:
            if self.rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=target)
        self.assertEqual(len(garbage_tensors), 0, "Found leaked tensors")
        loss_fn(ref(x), target).backward()
        for name, param in full[self.rank].named_parameters():
            torch.testing.assert_close(param.grad, ref[self.rank].get_parameter(name).grad)

    @skip_but_pass_in_sandcastle_if(not TEST_MULTIACCELERATOR, "gloo test requires 2+ GPUs")
    def test_gated_on_two_accelerators(self):
        raise AssertionError("runs only where torch.accelerator finds two devices")


instantiate_parametrized_tests(ScheduleTest)


class StageNegativeTest(MultiProcessTestCase):
    """torch's pattern: the parent's setUp makes self.file_name, the ranks build a FileStore on
    it and join the group themselves, the parent's tearDown removes the file."""

    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        assert os.path.exists(self.file_name), self.file_name
        with open(os.environ["PARENT_FILE_LOG"], "a") as log:
            log.write(f"{self.file_name}\n")
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:  # the ranks' FileStore removes it when the last store closes
            pass

    def test_ranks_rendezvous_on_the_parents_file(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        with open(os.environ["PARENT_FILE_LOG"], "a") as log:
            log.write(f"rank {self.rank}: {self.file_name}\n")
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)


if __name__ == "__main__":
    run_tests()
