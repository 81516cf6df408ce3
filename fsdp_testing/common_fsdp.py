"""Drop-in for ``torch.testing._internal.common_fsdp``: ``FSDPTest``, ``FSDPTestMultiThread``, the
init-mode enums, the reference models and the parity helpers, on fsdp_testing's launcher and
engines (see docs/migration.md). Tests run on CPU over gloo when there is no GPU."""

from __future__ import annotations

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
    TransformerWithSharedParams,
)
from fsdp_testing.parity import (
    FSDPParityMixin,
    _assert_module_states,
    check_sharded_parity,
    get_full_params,
)
from fsdp_testing.testcase import (
    MultiProcessTestCase,
    MultiThreadedTestCase,
    _accelerator_count,
)

__all__ = [
    "MLP",
    "AlwaysWrapNestedWrappedModule",
    "CUDAInitMode",
    "DEVICEInitMode",
    "DoubleLinear",
    "DummyDDP",
    "FSDPInitMode",
    "FSDPTest",
    "FSDPTestModel",
    "FSDPTestMultiThread",
    "MLPStack",
    "MixtureOfExperts",
    "ModuleWithDelay",
    "NestedLinear",
    "NestedWrappedModule",
    "NestedWrappedModuleWithDelay",
    "NonUniformReqGradNWM",
    "SkipModel",
    "TransformerWithSharedParams",
    "_assert_module_states",
    "check_sharded_parity",
    "device_type",
    "get_full_params",
]


device_type: str = "cuda" if _accelerator_count() else "cpu"
"""The device type tests place models on: cuda when there is a GPU, else cpu."""


class FSDPTest(FSDPParityMixin, MultiProcessTestCase):
    """torch's ``FSDPTest``: each ``test_*`` method runs on ``world_size`` rank processes (gloo on
    CPU), with ``_test_fsdp_parity``/``_train_for_several_steps`` using the active engine
    (``fsdp_engine``: None for the session's, see ``--fsdp-engine``)."""

    fsdp_engine: str | None = None

    @property
    def world_size(self) -> int:
        return min(_accelerator_count(), 8) or 4


class FSDPTestMultiThread(FSDPParityMixin, MultiThreadedTestCase):
    """torch's ``FSDPTestMultiThread``: ranks are threads over torch's threaded process group."""

    fsdp_engine: str | None = None

    @property
    def world_size(self) -> int:
        return 4
