"""A test written for torch's private harness, changed only in its imports.

Before (torch):
    from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
    from torch.testing._internal.common_fsdp import (
        DEVICEInitMode, FSDPInitMode, FSDPTest, NestedWrappedModule, TransformerWithSharedParams,
    )
    from torch.testing._internal.common_utils import (
        instantiate_parametrized_tests, parametrize, run_tests,
    )

With torch's harness every test below is skipped on a machine without 2 GPUs. Here each runs on
CPU ranks over gloo, in the warm pool; the models are sharded with torch's FSDP, as in torch, or
with the engine chosen by --fsdp-engine (e.g. fsdp_core).
"""

from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

from fsdp_testing.common_distributed import skip_if_lt_x_gpu
from fsdp_testing.common_fsdp import (
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTest,
    MixtureOfExperts,
    NestedWrappedModule,
    TransformerWithSharedParams,
)
from fsdp_testing.common_utils import instantiate_parametrized_tests, parametrize, run_tests


class TestParityWithDDP(FSDPTest):
    @property
    def world_size(self):
        return 2

    @skip_if_lt_x_gpu(2)
    @parametrize("sharding_strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP])
    def test_nested_wrapped_model(self, sharding_strategy):
        self._test_fsdp_parity(
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            sharding_strategy=sharding_strategy,
        )

    @skip_if_lt_x_gpu(2)
    def test_transformer_backward_prefetch(self):
        self.run_subtests(
            {
                "backward_prefetch": [
                    None,
                    BackwardPrefetch.BACKWARD_PRE,
                    BackwardPrefetch.BACKWARD_POST,
                ]
            },
            self._test_fsdp_parity,
            TransformerWithSharedParams,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
        )

    @skip_if_lt_x_gpu(2)
    def test_mixture_of_experts(self):
        self._test_fsdp_parity(
            MixtureOfExperts,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            ref_init_fn=self._dummy_ddp_fn,
        )

    def _dummy_ddp_fn(self, model):
        from fsdp_testing.common_fsdp import DummyDDP

        return DummyDDP(model)


instantiate_parametrized_tests(TestParityWithDDP)

if __name__ == "__main__":
    run_tests()
