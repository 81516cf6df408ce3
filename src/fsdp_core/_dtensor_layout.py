"""How both doors show a sharded parameter: a ``DTensor`` on a mesh (:class:`DTensorLayout`).

[Note: the wrapper's DTensor parameters]
Both doors show ``sharded`` as a ``DTensor`` (a :class:`DTensorLayout`): the composable door on
the mesh it is given, the wrapper on a mesh built from its groups (``Shard(0)`` over the shard
group; ``Replicate()`` over the group of ``NO_SHARD``; ``(Replicate(), Shard(0))`` on the 2-D
``("replicate", "shard")`` mesh of the hybrid strategies). Its local tensor is the view into
the flat shard, so the optimizer's state is ``DTensor``s laid out the same way, which is what
DCP's state dict functions and ``dcp.save`` need to save, gather and reshard each rank's rows
(see [Note: DCP's state dict functions and the wrapper] in ``_state_dict/settings.py``). Gradients
are ``DTensor``s of the same layout, built from the parameter's spec (no ``from_local``);
accumulation and everything else the unit does on shards goes through :func:`local_tensor`,
never through DTensor dispatch. For code written against torch's FSDP1 this means
``p.shape``/``p.numel()`` of a parameter between passes are the full (global) sizes, as for
FSDP2, where FSDP1 shows 1-D local pieces; ``p.to_local()`` is this rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._groups import UnitGroups
from ._spmd_mesh import SpmdMesh

__all__ = ["DTensorLayout"]


@dataclass(frozen=True)
class DTensorLayout:
    """How both doors show a sharded parameter: a ``DTensor`` on ``mesh``.

    The local tensor is still the view into the unit's flat shard, so the optimizer's in-place
    updates land there (see [Note: sharded and unsharded parameters]). The composable door
    takes the mesh it is given; the wrapper builds one from its groups (:meth:`of_groups`).
    """

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple[Any, ...]  # (Shard(0),), (Replicate(),), or (Replicate(), Shard(0)) for HSDP
    # ``dp_mesh_dims``: ``mesh`` is its data-parallel sub-mesh; see [Note: SPMD meshes].
    spmd: SpmdMesh | None = None

    @classmethod
    def of_groups(cls, groups: UnitGroups, device_type: str) -> DTensorLayout:
        """The layout of a unit over ``groups`` (see [Note: unit groups] in ``_groups``):
        ``Shard(0)`` on a 1-D mesh of the shard group, ``Replicate()`` on one of the replicate
        group, or both on a 2-D mesh ``("replicate", "shard")`` of the hybrid grid. A mesh made
        from existing groups costs well under a millisecond, so each wrapper instance makes its
        own (kept by its parameters, none kept beyond them)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # A unit on meta (``device_id="meta"``, planning) gets a CPU mesh: DTensor has no meta
        # device handle. A mesh keeps its ranks in a real tensor, also under a FakeTensorMode.
        with unset_fake_temporarily():
            return cls._of_groups(groups, "cpu" if device_type == "meta" else device_type)

    @classmethod
    def _of_groups(cls, groups: UnitGroups, device_type: str) -> DTensorLayout:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard

        if groups.shard is not None and groups.replicate is not None:
            mesh = DeviceMesh.from_group(
                [groups.replicate, groups.shard],
                device_type,
                mesh=torch.tensor(groups.grid, device="cpu"),  # not a default device's
                mesh_dim_names=("replicate", "shard"),
            )
            return cls(mesh, (Replicate(), Shard(0)))
        if groups.shard is not None:
            return cls(DeviceMesh.from_group(groups.shard, device_type), (Shard(0),))
        if groups.replicate is not None:
            return cls(DeviceMesh.from_group(groups.replicate, device_type), (Replicate(),))
        raise AssertionError(f"[rank {dist.get_rank()}] a unit needs a shard or a replicate group")
