"""DTensor tests written against torch's common_dtensor, changed only in their imports; run by
tests/unittest_compat/test_dtensor_port.py."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_testing.common_dtensor import (
    DTensorContinuousTestBase,
    DTensorConverter,
    DTensorOpTestBase,
    DTensorTestBase,
    MLPModule,
    ModelArgs,
    Transformer,
    create_local_tensor_test_class,
    map_local_tensor_for_rank,
    skip_unless_torch_gpu,
    with_comms,
)
from fsdp_testing.common_utils import instantiate_parametrized_tests, parametrize, run_tests


class TestDTensorBase(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_mesh_and_seeded_ranks(self):
        mesh = self.build_device_mesh()
        self.assertEqual(self.device_type, "cpu")
        self.assertEqual(mesh.size(), 2)
        self.assertEqual(dist.get_backend(), "gloo")
        # Every rank starts from torch's test seed, as in torch's rank processes.
        drawn = torch.rand(3)
        torch.manual_seed(1234)
        self.assertEqual(drawn, torch.rand(3))
        full = torch.arange(8.0).view(4, 2)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(sharded.to_local(), full[2 * self.rank : 2 * self.rank + 2])
        self.assertEqual(sharded.full_tensor(), full)

    @with_comms(eager_init=True, backend="gloo")
    def test_with_comms_takes_arguments(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2.0)

    @with_comms(backend="nccl")
    def test_accelerator_backend_skips_without_devices(self):
        raise AssertionError("must not run without 2 accelerators")

    @with_comms(backend="fake")
    def test_fake_backend_names_the_local_class(self):
        raise AssertionError("init_pg must refuse a backend the ranks' group does not run")

    @with_comms
    @skip_unless_torch_gpu
    def test_needs_gpus(self):
        raise AssertionError("must not run without GPUs")

    @with_comms
    def test_fails_on_rank_one(self):
        dist.barrier()
        self.assertEqual(self.rank, 0, "rank one is off")

    @with_comms
    def test_a_leaves_a_dtensor_rng_tracker(self):
        # DTensor makes its RNG tracker on the first random op over an accelerator mesh (on a
        # CPU mesh it makes none): a test leaves one behind, holding its mesh.
        from torch.distributed.tensor import _random

        _random._rng_tracker = f"the tracker of rank {self.rank}'s previous test"

    @with_comms
    def test_b_starts_without_rng_tracker(self):
        # A fresh rank process has no DTensor RNG tracker; neither has a warm one.
        self.assertIsNone(torch.distributed.tensor._random._rng_tracker)

    @with_comms
    @parametrize("seq_parallel", [False, True])
    def test_transformer_parallelize(self, seq_parallel):
        # Local attention outputs: DTensor has no sharding strategy for CPU's attention kernel.
        torch.manual_seed(0)
        args = ModelArgs(dropout_p=0.0, max_seq_len=8)
        model = Transformer(args)
        model_tp = Transformer.parallelize(
            copy.deepcopy(model), self.build_device_mesh(), seq_parallel, local_output_for_attn=True
        )
        self.assertEqual(model_tp.layers[0].attention.n_heads, args.n_heads // 2)
        self.assertIs(model_tp.output.weight, model_tp.tok_embeddings.weight)  # tied again
        tokens = torch.randint(args.vocab_size, (2, 8))
        self.assertEqual(model(tokens), model_tp(tokens))

    @with_comms
    def test_mlp_colwise_rowwise(self):
        model = MLPModule(self.device_type)
        model_tp = parallelize_module(
            copy.deepcopy(model),
            self.build_device_mesh(),
            {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
        )
        self.assertIsInstance(model_tp.net1.weight, DTensor)
        x = torch.rand(4, 10)
        self.assertEqual(model(x), model_tp(x))


instantiate_parametrized_tests(TestDTensorBase)


class TestInThreads(DTensorTestBase):
    # The marker's modes as a class attribute, as for the other mirrors' classes.
    dist_mode = "thread"

    @property
    def world_size(self):
        return 2

    @with_comms
    def test_sharded_and_back(self):
        self.assertEqual(dist.get_backend(), "threaded")
        mesh = self.build_device_mesh()
        full = torch.arange(8.0).view(4, 2)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(sharded.to_local(), full[2 * self.rank : 2 * self.rank + 2])
        self.assertEqual(sharded.redistribute(mesh, [Replicate()]).to_local(), full)


class TestInLocalMode(DTensorTestBase):
    dist_mode = "local"  # every rank in this process, exact collectives

    @property
    def world_size(self):
        return 2

    @with_comms
    def test_tensor_parallel_mlp_in_local_mode(self):
        model = MLPModule(self.device_type)
        plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
        model_tp = parallelize_module(copy.deepcopy(model), self.build_device_mesh(), plan)
        x = torch.rand(4, 10)
        self.assertEqual(model(x), model_tp(x))


class TestLocalTensor(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms
    def test_every_rank_in_one_process(self):
        self.assertEqual(dist.get_backend(), "fake")
        mesh = self.build_device_mesh()
        full = torch.arange(16.0).view(4, 4)
        mine = map_local_tensor_for_rank(full, self.rank, lambda t, r: t[r])
        dt = DTensor.from_local(mine.unsqueeze(0), mesh, [Shard(0)])
        self.assertEqual(dt.full_tensor(), full)

    def test_skipped_in_the_copy(self):
        raise AssertionError("create_local_tensor_test_class must skip this")


TestLocalTensorWithLocalTensor = create_local_tensor_test_class(
    TestLocalTensor, skipped_tests=["test_skipped_in_the_copy"]
)
del TestLocalTensor  # only the LocalTensorMode copy runs here


class TestOps(DTensorOpTestBase):
    @property
    def world_size(self):
        return 2

    def test_op_in_every_sharding(self):
        self.assertEqual(dist.get_backend(), "threaded")
        mesh = self.build_device_mesh()
        torch.manual_seed(0)  # the same inputs on every rank
        args = (torch.randn(4, 6), torch.randn(4, 6))
        expected = torch.add(*args)
        converter = DTensorConverter(mesh, args, {})
        shardings = 0
        for d_args, d_kwargs in converter:
            self.assertTrue(converter.successful())
            self.assertEqual(torch.add(*d_args, **d_kwargs).full_tensor(), expected)
            shardings += 1
        self.assertEqual(shardings, 9)  # Replicate, Shard(0), Shard(1) for each argument


class TestContinuous(DTensorContinuousTestBase):
    world_size = 2

    def test_first(self):
        mesh = self.build_device_mesh()
        dt = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
        self.assertEqual(dt.to_local(), torch.ones(4, 2))

    def test_second(self):
        t = torch.full((1,), float(self.rank))
        dist.all_reduce(t)
        self.assertEqual(t.item(), 1.0)


if __name__ == "__main__":
    run_tests()
