"""Process groups for torch-style unittest classes on warm ranks: the ``FileStore`` file a
``MultiProcessTestCase`` names (``self.file_name``), and tests that join and leave the default
group themselves as torch's harness has them do."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from fsdp_testing._rank.context import RankContext

__all__ = ["CompatibleInitProcessGroup", "fresh_store_file", "remove_if_present"]


def fresh_store_file(*, create: bool) -> str:
    """A new file name in the temporary directory for a ``FileStore`` rendezvous; the file
    exists (empty) when ``create``, as torch's ``setUp`` leaves it."""
    fd, name = tempfile.mkstemp(prefix="fsdp-testing-store-")
    os.close(fd)
    if not create:
        os.unlink(name)
    return name


def remove_if_present(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class CompatibleInitProcessGroup:
    """Tests written for torch's ``MultiProcessTestCase`` join the process group themselves
    (``dist.init_process_group(..., init_method=self.init_method)``) and leave it at the end. On
    a warm rank the group already exists: joining it again with the same rank and world size is
    accepted as a no-op and leaving the default group is deferred to the pool."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        import torch.distributed as dist

        self._init, self._destroy = dist.init_process_group, dist.destroy_process_group
        ctx, real_init, real_destroy = self.ctx, self._init, self._destroy

        def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
            if not dist.is_initialized():
                return real_init(backend, *args, **kwargs)
            rank, ws = kwargs.get("rank", ctx.rank), kwargs.get("world_size", ctx.world_size)
            wanted = str(backend).lower() if backend is not None else None
            if (rank, ws) != (ctx.rank, ctx.world_size) or (
                wanted is not None
                and wanted not in ctx.dist_backend
                and ctx.dist_backend not in wanted
            ):
                raise ValueError(
                    f"init_process_group(backend={backend!r}, rank={rank}, world_size={ws}) on "
                    f"a rank that already belongs to a {ctx.dist_backend} group of "
                    f"{ctx.world_size} as rank {ctx.rank}: set the test class's world_size/"
                    "backend to match instead"
                )

        def destroy_process_group(group: Any = None) -> None:
            if group is None or group is dist.GroupMember.WORLD:
                return
            real_destroy(group)

        dist.init_process_group = init_process_group
        dist.destroy_process_group = destroy_process_group

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.init_process_group = self._init
        dist.destroy_process_group = self._destroy
