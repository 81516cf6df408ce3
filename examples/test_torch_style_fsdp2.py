"""An FSDP2 test in torch's own style, on our harness by its imports alone.

Before (torch):
    from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
    from torch.testing._internal.common_fsdp import (
        FSDPTest, MLP, check_sharded_parity, patch_all_gather,
    )
    from torch.testing._internal.common_utils import run_tests

With torch's harness every test below is skipped on a machine without 2 GPUs. Here each runs on
2 CPU ranks over gloo, in the warm pool; the body is torch's ``fully_shard`` throughout.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from fsdp_testing.common_distributed import skip_if_lt_x_gpu
from fsdp_testing.common_fsdp import (
    MLP,
    FSDPTest,
    check_sharded_parity,
    get_devtype,
    patch_all_gather,
)
from fsdp_testing.common_utils import instantiate_parametrized_tests, parametrize, run_tests

device_type = torch.device(get_devtype())


class TestFullyShardTraining(FSDPTest):
    @property
    def world_size(self):
        return 2

    def _models(self, num_mlps: int, reshard_after_forward: bool):
        torch.manual_seed(42)
        model = nn.Sequential(*[MLP(16, device_type) for _ in range(num_mlps)])
        ref_model = DistributedDataParallel(copy.deepcopy(model))
        for mlp in model:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        return ref_model, model

    @skip_if_lt_x_gpu(2)
    @parametrize("reshard_after_forward", [True, False])
    def test_train_parity_with_ddp(self, reshard_after_forward):
        ref_model, model = self._models(3, reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank)
        for _ in range(4):
            inp = torch.randn((8, 16), device=device_type)
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad()
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            self.assertEqual(losses[0], losses[1])
        check_sharded_parity(self, ref_model.module, model)

    @skip_if_lt_x_gpu(2)
    def test_one_all_gather_per_unit(self):
        _, model = self._models(3, reshard_after_forward=True)
        orig_all_gather = dist.all_gather_into_tensor
        calls = 0

        def all_gather_with_count(*args, **kwargs):
            nonlocal calls
            calls += 1
            return orig_all_gather(*args, **kwargs)

        inp = torch.randn((8, 16), device=device_type)
        with patch_all_gather(all_gather_with_count):
            loss = model(inp).sum()
            forward_calls = calls
            loss.backward()
        # One all-gather per MLP in forward (the root Sequential owns no parameters of its
        # own, so it gathers nothing), and each MLP, resharded after forward, once again in
        # backward.
        self.assertEqual(forward_calls, 3)
        self.assertEqual(calls - forward_calls, 3)


instantiate_parametrized_tests(TestFullyShardTraining)

if __name__ == "__main__":
    run_tests()
