"""Drop-in for ``torch.testing._internal.distributed._tensor.common_dtensor``: every public name
of torch's module (checked against the installed torch by
``tests/unittest_compat/test_name_coverage.py``), the test classes running on fsdp_testing's
launcher (warm gloo ranks on CPU, the accelerator's backend with one device per rank, thread
ranks for ``DTensorOpTestBase``, fake mode for the ``LocalTensorMode`` classes; see
[Note: DTensor classes on warm ranks] in ``_compat/dtensor.py`` and [Note: LocalTensorMode
classes in fake mode] in ``_compat/dtensor_local.py``). docs/compatibility.md lists
what differs from torch, with a measurement on torch's own tensor-parallel and DTensor tests.
"""

from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_testing._compat.classes import MultiProcContinuousTest
from fsdp_testing._compat.dtensor import (
    DEVICE_COUNT,
    DEVICE_TYPE,
    NUM_DEVICES,
    PG_BACKEND,
    TEST_PRIVATEUSE1,
    DTensorContinuousTestBase,
    DTensorOpTestBase,
    DTensorTestBase,
    DTensorTestMixin,
    T,
    TestFunc,
    skip_unless_torch_gpu,
    with_comms,
)
from fsdp_testing._compat.dtensor_helpers import (
    DTensorConverter,
    generate_shard_orders,
    make_full_tensor,
    map_local_for_rank,
    map_local_tensor_for_rank,
    patched_distribute_tensor,
    redistribute,
    reduce_local_int,
    shard_order_to_placement,
)
from fsdp_testing._compat.dtensor_local import (
    LocalDTensorContinuousTestBase,
    LocalDTensorOpTestBase,
    LocalDTensorTestBase,
    create_local_tensor_test_class,
    make_wrapped,
)
from fsdp_testing._compat.dtensor_rules import (
    op_strategy_context,
    validate_sharding_rule_sample,
    validate_sharding_rule_sample_backward,
)
from fsdp_testing._compat.env import TEST_CUDA, TEST_HPU, TEST_WITH_ROCM, TEST_XPU
from fsdp_testing._compat.requirements import ACCELERATOR_DIST_BACKENDS
from fsdp_testing._rank.skips import TEST_SKIPS
from fsdp_testing.models.experts import (
    ExpertLayer,
    ExpertParallel,
    ExpertParallelWithTP,
    Experts,
    TensorParallelForExpert,
)
from fsdp_testing.models.tensor_parallel import (
    Attention,
    FeedForward,
    MLPModule,
    MLPStacked,
    ModelArgs,
    RMSNormPython,
    Transformer,
    TransformerBlock,
)
from fsdp_testing.testcase import (
    MultiProcessTestCase,
    MultiThreadedTestCase,
    run_subtests,
    skip_if_lt_x_gpu,
)

__all__ = [
    "ACCELERATOR_DIST_BACKENDS",
    "DEVICE_COUNT",
    "DEVICE_TYPE",
    "NUM_DEVICES",
    "PG_BACKEND",
    "TEST_CUDA",
    "TEST_HPU",
    "TEST_PRIVATEUSE1",
    "TEST_SKIPS",
    "TEST_WITH_ROCM",
    "TEST_XPU",
    "Attention",
    "DTensorContinuousTestBase",
    "DTensorConverter",
    "DTensorOpTestBase",
    "DTensorTestBase",
    "DTensorTestMixin",
    "ExpertLayer",
    "ExpertParallel",
    "ExpertParallelWithTP",
    "Experts",
    "FakeStore",
    "FeedForward",
    "LocalDTensorContinuousTestBase",
    "LocalDTensorOpTestBase",
    "LocalDTensorTestBase",
    "MLPModule",
    "MLPStacked",
    "ModelArgs",
    "MultiProcContinuousTest",
    "MultiProcessTestCase",
    "MultiThreadedTestCase",
    "RMSNormPython",
    "T",
    "TensorParallelForExpert",
    "TestFunc",
    "Transformer",
    "TransformerBlock",
    "create_local_tensor_test_class",
    "generate_shard_orders",
    "make_full_tensor",
    "make_wrapped",
    "map_local_for_rank",
    "map_local_tensor_for_rank",
    "op_strategy_context",
    "patched_distribute_tensor",
    "redistribute",
    "reduce_local_int",
    "run_subtests",
    "shard_order_to_placement",
    "skip_if_lt_x_gpu",
    "skip_unless_torch_gpu",
    "validate_sharding_rule_sample",
    "validate_sharding_rule_sample_backward",
    "with_comms",
]
