"""Torch-style tests changed only in their imports; run by tests/unittest_compat/test_torch_port.py."""

import os
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from fsdp_testing.common_distributed import (
    DistributedTestBase,
    MultiProcContinuousTest,
    skip_if_lt_x_gpu,
)
from fsdp_testing.common_fsdp import (
    CUDAInitMode,
    FSDPInitMode,
    FSDPTest,
    NestedWrappedModule,
    TransformerWithSharedParams,
    compiled_fsdp_test,
)
from fsdp_testing.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
    xfailIf,
)


class Config:
    """An object without a useful repr: names must not carry its address."""


class TestSizedByGpus(FSDPTest):
    @property
    def world_size(self):
        return torch.cuda.device_count()

    def test_world_comes_from_the_cpu_world_size(self):
        expected = int(os.environ.get("EXPECTED_WORLD", "2"))
        self.assertEqual(dist.get_world_size(), expected)
        self.assertEqual(self.world_size, expected)

    @skip_if_lt_x_gpu(3)
    def test_skip_if_lt_x_gpu_guarantees_its_ranks(self):
        self.assertGreaterEqual(dist.get_world_size(), 3)

    def test_cuda_call_skips_with_the_reason(self):
        torch.ones(2).cuda()

    def test_tensor_assertions_are_torchs(self):
        t = torch.full((4,), float(self.rank))
        dist.all_reduce(t)
        self.assertEqual(t, [1.0, 1.0, 1.0, 1.0])
        self.assertEqual([t, t + 1e-7], [t, t])
        self.assertEqual(t.sum(), 4)
        self.assertNotEqual(t, t + 1)

    def test_models_shard_with_torchs_fsdp_by_default(self):
        model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, CUDAInitMode.CUDA_BEFORE
        )
        self.assertIsInstance(model, FullyShardedDataParallel)

    def test_parity_accepts_the_old_keyword(self):
        self._test_fsdp_parity(
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            cuda_init_mode=CUDAInitMode.CUDA_BEFORE,
            num_iters=1,
        )

    @parametrize(
        "config",
        [
            subtest(Config(), name="first"),
            Config(),
            subtest(None, name="expected_to_fail", decorators=[xfailIf(True)]),
        ],
    )
    def test_subtest_values(self, config):
        if config is None:
            raise AssertionError("this case is expected to fail")
        self.assertIsInstance(config, Config)


instantiate_parametrized_tests(TestSizedByGpus)


class TestCompiled(FSDPTest):
    world_size = 2

    def test_eager_then_compiled(self):
        runs = []
        self._train_once(runs)
        self.assertEqual(runs, [False, True])

    @compiled_fsdp_test(compile_compute_on_module=nn.Linear)
    def _train_once(self, runs):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        model(torch.randn(4, 8)).sum().backward()
        runs.append(model[0]._compiled_call_impl is not None)


class TestContinuous(MultiProcContinuousTest):
    world_size = 2

    def test_a_fails(self):
        self.assertEqual(self.rank, -1)

    def test_b_still_runs(self):
        t = torch.ones(1)
        dist.all_reduce(t, group=self.pg)
        self.assertEqual(t.item(), 2.0)

    def test_c_skips_on_the_ranks(self):
        self.skipTest(f"rank {self.rank} has no widget")

    def test_d_runs_after_the_skip(self):
        dist.barrier(group=self.pg)


class TestContinuousMissingBackend(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return os.environ.get("MISSING_BACKEND", "mpi")

    def test_never_runs(self):
        raise AssertionError("a class whose backend is missing must be skipped")


class TestCreatePg(DistributedTestBase):
    world_size = 2

    def test_create_pg_with_a_backend(self):
        pg = self.create_pg("cpu", backend="gloo")
        self.assertEqual(dist.get_backend(pg), "gloo")
        t = torch.ones(1)
        dist.all_reduce(t, group=pg)
        self.assertEqual(t.item(), 2.0)
        self.assertIs(self.create_pg("cpu"), self.process_group)


class TestPlainAssert(unittest.TestCase):
    def test_module_imports_without_ranks(self):
        self.assertTrue(issubclass(nn.Linear, nn.Module))


if __name__ == "__main__":
    run_tests()
