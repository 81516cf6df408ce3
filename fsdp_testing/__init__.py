"""fsdp_testing: a pytest plugin and distributed test harness for sharded-training code.

The public names below are imported on first use, so that loading the pytest plugin (and
``pytest --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # unittest-style API
    "FSDPTest": "fsdp_testing.common_fsdp",
    "FSDPTestMultiThread": "fsdp_testing.common_fsdp",
    "MultiProcessTestCase": "fsdp_testing.testcase",
    "MultiThreadedTestCase": "fsdp_testing.testcase",
    "run_subtests": "fsdp_testing.testcase",
    "skip_if_lt_x_gpu": "fsdp_testing.testcase",
    "TEST_SKIPS": "fsdp_testing._rank.skips",
    "parametrize": "fsdp_testing.common_utils",
    "instantiate_parametrized_tests": "fsdp_testing.common_utils",
    # reference models and init modes
    "FSDPInitMode": "fsdp_testing.models",
    "DEVICEInitMode": "fsdp_testing.models",
    "CUDAInitMode": "fsdp_testing.models",
    "FSDPTestModel": "fsdp_testing.models",
    "NestedWrappedModule": "fsdp_testing.models",
    "AlwaysWrapNestedWrappedModule": "fsdp_testing.models",
    "NonUniformReqGradNWM": "fsdp_testing.models",
    "TransformerWithSharedParams": "fsdp_testing.models",
    "MixtureOfExperts": "fsdp_testing.models",
    "ModuleWithDelay": "fsdp_testing.models",
    "NestedWrappedModuleWithDelay": "fsdp_testing.models",
    "DummyDDP": "fsdp_testing.models",
    "MLP": "fsdp_testing.models",
    "MLPStack": "fsdp_testing.models",
    "DoubleLinear": "fsdp_testing.models",
    "SkipModel": "fsdp_testing.models",
    "NestedLinear": "fsdp_testing.models",
    # parity
    "check_fsdp_parity": "fsdp_testing.parity",
    "check_parity": "fsdp_testing.parity",
    "train_for_several_steps": "fsdp_testing.parity",
    "check_sharded_parity": "fsdp_testing.parity",
    "assert_module_states_equal": "fsdp_testing.parity",
    "get_full_params": "fsdp_testing.parity",
    "FSDPParityMixin": "fsdp_testing.parity",
    # engines
    "FSDPEngine": "fsdp_testing.engines",
    "get_engine": "fsdp_testing.engines",
    "current_engine": "fsdp_testing.engines",
    "use_engine": "fsdp_testing.engines",
    "set_default_engine": "fsdp_testing.engines",
    "available_engines": "fsdp_testing.engines",
    # launching from code
    "run_distributed": "fsdp_testing.launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
