"""Drop-in for ``torch.testing._internal.common_fsdp``: every public name of torch's module
(checked against the installed torch by ``tests/unittest_compat/test_name_coverage.py``) on
fsdp_testing's launcher, engines and patching. Models are sharded with torch's FSDP unless
fsdp_core is chosen (see [Note: the mirror's engine] in ``_compat/fsdp.py``); tests run on CPU
over gloo when there is no GPU. docs/compatibility.md lists what differs from torch."""

from __future__ import annotations

from torch.distributed.fsdp._init_utils import NO_RESHARD_AFTER_FORWARD_STRATEGIES

from fsdp_testing._compat.classes import MultiProcContinuousTest
from fsdp_testing._compat.env import (
    DEVICE_COUNT,
    DEVICE_TYPE,
    DISTRIBUTED_BACKEND,
    FILE_SCHEMA,
    TEST_CUDA,
    TEST_HPU,
    TEST_WITH_ROCM,
    TEST_XPU,
    set_rng_seed,
)
from fsdp_testing._compat.fsdp import (
    DummyProcessGroup,
    FSDPTest,
    FSDPTestContinuous,
    FSDPTestMixin,
    FSDPTestMultiThread,
    _assert_module_states,
    _broadcast_state_dict,
    _get_state_dict,
    _maybe_wrap_fsdp,
    _move_to_device,
    _zero_model,
    check_sharded_parity,
    compiled_fsdp_test,
    get_devtype,
    patch_all_gather,
    patch_all_reduce,
    patch_foreach_all_gather,
    patch_foreach_reduce,
    patch_post_backward,
    patch_reduce_scatter,
    patch_register_post_backward_hook_backward,
    patch_reshard,
    patch_unshard,
    subtest_name,
)
from fsdp_testing._compat.parametrize import get_cycles_per_ms
from fsdp_testing._rank.skips import TEST_SKIPS
from fsdp_testing.models import (
    MLP,
    AlwaysWrapNestedWrappedModule,
    CUDAInitMode,
    DEVICEInitMode,
    DoubleLinear,
    DummyDDP,
    FSDPInitMode,
    FSDPTestModel,
    MixtureOfExperts,
    MLPStack,
    ModuleWithDelay,
    NestedLinear,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    NonUniformReqGradNWM,
    SkipModel,
    SkipModule,
    TransformerWithSharedParams,
)
from fsdp_testing.parity import get_full_params
from fsdp_testing.patching import reduce_scatter_with_assert
from fsdp_testing.testcase import (
    MultiProcessTestCase,
    MultiThreadedTestCase,
    _accelerator_count,
    run_subtests,
)

__all__ = [
    "DEVICE_COUNT",
    "DEVICE_TYPE",
    "DISTRIBUTED_BACKEND",
    "FILE_SCHEMA",
    "MLP",
    "NO_RESHARD_AFTER_FORWARD_STRATEGIES",
    "TEST_CUDA",
    "TEST_HPU",
    "TEST_SKIPS",
    "TEST_WITH_ROCM",
    "TEST_XPU",
    "AlwaysWrapNestedWrappedModule",
    "CUDAInitMode",
    "DEVICEInitMode",
    "DoubleLinear",
    "DummyDDP",
    "DummyProcessGroup",
    "FSDPInitMode",
    "FSDPTest",
    "FSDPTestContinuous",
    "FSDPTestMixin",
    "FSDPTestModel",
    "FSDPTestMultiThread",
    "MLPStack",
    "MixtureOfExperts",
    "ModuleWithDelay",
    "MultiProcContinuousTest",
    "MultiProcessTestCase",
    "MultiThreadedTestCase",
    "NestedLinear",
    "NestedWrappedModule",
    "NestedWrappedModuleWithDelay",
    "NonUniformReqGradNWM",
    "SkipModel",
    "SkipModule",
    "TransformerWithSharedParams",
    "_assert_module_states",
    "_broadcast_state_dict",
    "_get_state_dict",
    "_maybe_wrap_fsdp",
    "_move_to_device",
    "_zero_model",
    "check_sharded_parity",
    "compiled_fsdp_test",
    "device_type",
    "get_cycles_per_ms",
    "get_devtype",
    "get_full_params",
    "patch_all_gather",
    "patch_all_reduce",
    "patch_foreach_all_gather",
    "patch_foreach_reduce",
    "patch_post_backward",
    "patch_reduce_scatter",
    "patch_register_post_backward_hook_backward",
    "patch_reshard",
    "patch_unshard",
    "reduce_scatter_with_assert",
    "run_subtests",
    "set_rng_seed",
    "subtest_name",
]

device_type: str = "cuda" if _accelerator_count() else "cpu"
"""The device type tests place models on: cuda when there is a GPU, else cpu."""
