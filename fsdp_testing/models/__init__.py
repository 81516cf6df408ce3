"""Reference models for sharded-training tests, device agnostic and engine agnostic.

Models with the :class:`FSDPTestModel` interface build themselves through ``init(group,
fsdp_init_mode, device_init_mode, fsdp_kwargs, deterministic, ...)`` and shard with the active
engine (:func:`fsdp_testing.engines.current_engine`).
"""

from ..patching.delays import delayed_calls, sleep_ms
from ._base import (
    CUDAInitMode,
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTestModel,
    as_device_init_mode,
    as_fsdp_init_mode,
    default_device,
)
from .delay import ModuleWithDelay, NestedWrappedModuleWithDelay
from .nested import (
    AlwaysWrapNestedWrappedModule,
    MixtureOfExperts,
    NestedWrappedModule,
    NonUniformReqGradNWM,
)
from .simple import MLP, DoubleLinear, DummyDDP, MLPStack, NestedLinear, SkipModel, SkipModule
from .transformer import TransformerWithSharedParams

__all__ = [
    "MLP",
    "AlwaysWrapNestedWrappedModule",
    "CUDAInitMode",
    "DEVICEInitMode",
    "DoubleLinear",
    "DummyDDP",
    "FSDPInitMode",
    "FSDPTestModel",
    "MLPStack",
    "MixtureOfExperts",
    "ModuleWithDelay",
    "NestedLinear",
    "NestedWrappedModule",
    "NestedWrappedModuleWithDelay",
    "NonUniformReqGradNWM",
    "SkipModel",
    "SkipModule",
    "TransformerWithSharedParams",
    "as_device_init_mode",
    "as_fsdp_init_mode",
    "default_device",
    "delayed_calls",
    "sleep_ms",
]
