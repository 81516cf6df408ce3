"""benchmarks/torch_compat.py's port: torch's four harness modules become fsdp_testing's, in
every spelling of the import, and nothing else changes (names a mirror lacks stay torch's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_compat.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_compat_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_harness_import_is_ported_and_nothing_else() -> None:
    source = (
        "import torch.testing._internal.common_fsdp\n"
        "from torch.testing._internal.common_distributed import skip_if_lt_x_gpu\n"
        "from torch.testing._internal.common_utils import run_tests, skipIfHpu\n"
        "from torch.testing._internal.distributed._tensor.common_dtensor import (\n"
        "    DTensorTestBase,\n"
        "    with_comms,\n"
        ")\n"
        "from torch.testing._internal.distributed._tensor import common_dtensor\n"
        "from torch.testing._internal import common_utils, logging_utils\n"
        "from torch.testing._internal.distributed import fake_pg\n"
        "from torch.testing._internal.common_device_type import instantiate_device_type_tests\n"
    )
    assert _script().port_source(source) == (
        "import fsdp_testing.common_fsdp\n"
        "from fsdp_testing.common_distributed import skip_if_lt_x_gpu\n"
        # skipIfHpu is a common_utils name the mirror does not have: it stays torch's.
        "from torch.testing._internal.common_utils import skipIfHpu\n"
        "from fsdp_testing.common_utils import run_tests\n"
        "from fsdp_testing.common_dtensor import (\n"
        "    DTensorTestBase,\n"
        "    with_comms,\n"
        ")\n"
        "from fsdp_testing import common_dtensor\n"
        "from fsdp_testing import common_utils\n"
        "from torch.testing._internal import logging_utils\n"
        "from torch.testing._internal.distributed import fake_pg\n"
        "from torch.testing._internal.common_device_type import instantiate_device_type_tests\n"
    )
