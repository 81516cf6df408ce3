"""torch-compatibility layer behind the drop-in modules ``fsdp_testing.common_distributed``,
``fsdp_testing.common_fsdp`` and ``fsdp_testing.common_utils``.

One module per job: ``world`` (how many ranks a torch-style test gets on this machine; no torch
import), ``env`` (torch's environment flags and device constants), ``assertions`` (torch's
tensor-aware ``TestCase.assertEqual``), ``parametrize`` (``parametrize``/``subtest`` and the
``common_utils`` decorators), ``requirements`` (the ``requires_*``/``skip_if_*`` decorators of
``common_distributed``), ``dist_helpers`` (its remaining helpers), ``classes`` (the extra
test-case classes) and ``fsdp`` (``common_fsdp``'s classes and helpers). The mirror modules only
re-export; docs/migration.md and docs/compatibility.md describe what differs from torch.
"""
