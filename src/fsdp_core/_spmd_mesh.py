"""Parameters that are ``DTensor``s on the full SPMD mesh: ``fully_shard``/``replicate`` with
``dp_mesh_dims``, as FSDP2 takes them.

[Note: SPMD meshes]
With ``dp_mesh_dims`` the ``mesh`` given is the whole device mesh of the job (data parallel,
tensor parallel, ...), and every parameter must already be a ``DTensor`` on that very mesh
object (``distribute_module(model, mesh, partition_fn)``), ``Replicate()`` on each
data-parallel dimension. The unit works on the parameter's local tensor, exactly as for
[Note: tensor-parallel parameters] in ``_tensor_parallel``, over the data-parallel sub-mesh
(:attr:`SpmdMesh.dp_mesh`: the shard dimension(s), flattened into one when several, and for
HSDP the replicate one(s) in front). What differs is how the parameters look:

- unsharded (compute): the original ``DTensor`` spec on the full mesh, so the model computes
  with ``DTensor``s there; its inputs are ``DTensor``s on that mesh too (the caller's, e.g.
  ``DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim)``).
- sharded: on the full mesh, the original placements with each data-parallel shard dimension
  replaced by ``Shard(d)`` (``d`` the dim FSDP shards, or ``_StridedShard(d, split_factor)``
  when later mesh dimensions shard the same dim); with several shard dimensions the spec is on
  the flattened data-parallel mesh followed by the other dimensions (:meth:`sharded_layout`),
  as FSDP2 builds it.
- gradients: redistributed to the original placements on the other dimensions only; on the
  data-parallel ones the unit's reduction does the work (a ``Partial`` there is summed by it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SpmdMesh", "resolve_spmd_mesh"]


@dataclass(frozen=True)
class SpmdMesh:
    """The full mesh, its data-parallel sub-mesh, and which of its dimensions are which."""

    mesh: Any  # the full DeviceMesh the parameters live on
    dp_mesh: Any  # (shard,), (replicate, shard), or (replicate,): what the unit runs over
    shard_dims: tuple[int, ...]
    replicate_dims: tuple[int, ...]

    @property
    def dp_dims(self) -> frozenset[int]:
        return frozenset((*self.shard_dims, *self.replicate_dims))

    def check_param(self, api: str, fqn: str, param: Any) -> None:
        """Raise FSDP2's error if ``param`` cannot be sharded on this mesh."""
        from torch.distributed.tensor import Replicate

        spec = getattr(param, "_spec", None)
        if spec is None:
            raise ValueError(
                f"{api}: When dp_mesh_dims is provided, all parameters must be DTensors on the "
                f"full SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter "
                f"'{fqn}'. Call distribute_module(module, mesh) (or parallelize it) first, or "
                "drop dp_mesh_dims and pass the data-parallel sub-mesh as mesh."
            )
        if spec.mesh is not self.mesh:
            raise ValueError(
                f"{api}: Expected param's DTensor mesh to be the same mesh passed to "
                f"{api}, but got different mesh objects for parameter '{fqn}' ({spec.mesh} "
                f"and {self.mesh}). Distribute the parameters on the mesh you pass."
            )
        names = self.mesh.mesh_dim_names
        for role, dims in (("shard", self.shard_dims), ("replicate", self.replicate_dims)):
            for i in dims:
                if not isinstance(spec.placements[i], Replicate):
                    raise ValueError(
                        f"{api}: Expected Replicate() on DP {role} dim '{names[i]}' (index "
                        f"{i}) but got {spec.placements[i]} for parameter '{fqn}'; FSDP owns "
                        "the data-parallel dimensions: distribute it as Replicate() there."
                    )

    def sharded_layout(self, placements: Sequence[Any], dim: int) -> tuple[Any, tuple[Any, ...]]:
        """The mesh and placements of a sharded parameter whose original placements on the
        full mesh are ``placements`` and whose rows FSDP splits along ``dim``."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh, new = self.mesh, list(placements)
        for i in self.shard_dims:
            # The pieces that later mesh dims cut the same tensor dim into: FSDP's rows of
            # the local tensor are then a strided piece of the global one.
            split = 1
            for j in range(i + 1, mesh.ndim):
                later = placements[j]
                if isinstance(later, (Shard, _StridedShard)) and later.dim == dim:
                    split *= mesh.size(j)
            new[i] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        if len(self.shard_dims) <= 1:
            return mesh, tuple(new)
        # Several shard dims: one flattened dimension for them (FSDP2's spec).
        from torch.distributed.tensor import Replicate

        names, hybrid = mesh.mesh_dim_names, bool(self.replicate_dims)
        parts: list[Any] = []
        out: list[Any] = []
        first = self.shard_dims[0]
        for i, name in enumerate(names):
            if i == first:
                parts.append(self.dp_mesh)
                if hybrid:
                    out.append(Replicate())
                out.append(new[i])
            elif i in self.shard_dims or (hybrid and i in self.replicate_dims):
                continue  # folded into the data-parallel mesh above
            else:
                parts.append(mesh[name])
                out.append(new[i])
        return DeviceMesh._concatenate(parts), tuple(out)

    def grad_placements(self, grad: Sequence[Any], original: Sequence[Any]) -> tuple[Any, ...]:
        """What an unsharded gradient is redistributed to: the original placements, but on the
        data-parallel dims whatever it has (the unit reduces over those)."""
        dp = self.dp_dims
        return tuple(grad[i] if i in dp else original[i] for i in range(len(original)))


def resolve_spmd_mesh(
    api: str,
    mesh: Any,
    shard_names: tuple[str, ...],
    replicate_names: tuple[str, ...],
) -> SpmdMesh:
    """``mesh`` as the full SPMD mesh of ``dp_mesh_dims``, with FSDP2's errors for names it
    lacks; the data-parallel mesh is ``(replicate, shard)``, ``(shard,)`` or ``(replicate,)``,
    each role's names flattened into one dimension when several."""
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(
            f"{api}: mesh must have mesh_dim_names when dp_mesh_dims is provided, got {mesh}; "
            "pass init_device_mesh(..., mesh_dim_names=(...))."
        )
    for name in (*shard_names, *replicate_names):
        if name not in names:
            raise ValueError(
                f"{api}: Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}. "
                "Pass names of the mesh's dimensions in dp_mesh_dims."
            )
    from torch.distributed.device_mesh import DeviceMesh

    def submesh(role: tuple[str, ...]) -> Any:  # several names: flattened into one dimension
        return mesh[role[0]] if len(role) == 1 else mesh[role]._flatten("_".join(role))

    parts = [submesh(role) for role in (replicate_names, shard_names) if role]
    dp_mesh = parts[0] if len(parts) == 1 else DeviceMesh._concatenate(parts)
    return SpmdMesh(
        mesh,
        dp_mesh,
        tuple(names.index(n) for n in shard_names),
        tuple(names.index(n) for n in replicate_names),
    )
