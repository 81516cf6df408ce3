"""FSDP2's all-gather extensions on the composable door.

[Note: all-gather extensions]
FSDP2 lets a parameter choose what its all-gather moves: when the sharded parameter's local
tensor has ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (a tensor subclass's methods,
or methods set on the local tensor object, as float8 training does to all-gather in float8),
unsharding calls

    inputs, metadata = local.fsdp_pre_all_gather(mesh)  # or, five parameters:
    inputs, metadata = local.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)

all-gathers each input along dim 0 over the shard group (``mesh``: the 1-D shard mesh, also
with HSDP), and calls ``local.fsdp_post_all_gather(outputs, metadata, param_dtype, out=...)``:
the first time without ``out``, returning ``(unsharded, tensors_to_free)``; later with ``out``
the tensor it returned then, to fill in place. The outputs are kept from one unshard to the
next (their storage is freed at reshard and reallocated), so a returned tensor that aliases
them stays valid, as in FSDP2. The module computes with ``unsharded`` cut to the parameter's
rows (the inputs of a rank whose shard is short are padded to the full chunk rows first, so
the blocks line up).

fsdp_core runs the extensions' all-gather as one more all-gather per unit, over the
extension parameters' inputs (bytes when their dtypes differ; see [Note: mixed dtypes in one
unit] in ``_flat``), untagged; the unit's own all-gather still moves those parameters' shards.
Where the result is a plain tensor (the module sees a plain parameter), its storage is freed at
reshard too. Differences from FSDP2: sharding on another dim than 0 with an extension raises
``NotImplementedError``; a tensor subclass parameter keeps its values but not its subclass
(the flat shard holds plain values), so a subclass's own extension methods are not called.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from . import _collectives
from ._flat import FlatLayout
from ._param import _contiguous_stride, local_tensor

if TYPE_CHECKING:
    from ._param import ShardedParam
    from ._unit import FSDPUnit

__all__ = ["GatherExtensions"]


def _extension(p: ShardedParam) -> torch.Tensor | None:
    """The sharded parameter's local tensor if it has both extension methods."""
    local = local_tensor(p.sharded)
    if not callable(getattr(local, "fsdp_pre_all_gather", None)):  # every unshard: one lookup
        return None
    return local if callable(getattr(local, "fsdp_post_all_gather", None)) else None


class _State:
    """One extension parameter's outputs and result, kept across unshards."""

    def __init__(self, own: torch.Tensor) -> None:
        self.own = own  # the unsharded parameter's data before: the unit's storage
        self.outputs: list[torch.Tensor] = []
        self.result: torch.Tensor | None = None  # what ``fsdp_post_all_gather`` returned
        self.nbytes: list[int] = []  # of each kept tensor's storage, to reallocate


class GatherExtensions:
    """A unit's extension parameters. See [Note: all-gather extensions]."""

    def __init__(self) -> None:
        self._states: dict[int, _State] = {}  # by parameter index
        self._mesh: Any = None

    @staticmethod
    def find(unit: FSDPUnit) -> dict[int, torch.Tensor]:
        """The unit's extension parameters now, by index, with their local tensors."""
        found = {}
        for i, p in enumerate(unit.params):
            local = _extension(p)
            if local is not None:
                found[i] = local
        return found

    def unshard(self, unit: FSDPUnit, found: dict[int, torch.Tensor]) -> None:
        """Gather every parameter in ``found`` through its extension and show the result."""
        for index in list(self._states):
            if index not in found:  # its extension went away: back to the unit's storage
                unit.params[index].unsharded.data = self._states.pop(index).own
        gathered: list[tuple[int, list[torch.Tensor], Any]] = []
        for index, local in found.items():
            inputs, metadata = self._pre(unit, unit.params[index], local)
            gathered.append((index, inputs, metadata))
        flat = [t for _, inputs, _ in gathered for t in inputs]
        layout = FlatLayout([t.dtype for t in flat], [t.numel() for t in flat])
        send = torch.zeros(layout.numel, dtype=layout.dtype, device=unit.device)
        for j, t in enumerate(flat):
            layout.segment(send, j).copy_(t.reshape(-1))
        world = unit.shard_world
        if world > 1 and unit.groups.shard is not None:
            out = torch.empty(world * layout.numel, dtype=layout.dtype, device=unit.device)
            _collectives.all_gather_flat(out, send, unit.groups.shard, unit=unit.name)
        else:
            out = send
        blocks = out.view(world, -1)
        j = 0
        for index, inputs, metadata in gathered:
            state = self._states.setdefault(index, _State(unit.params[index].unsharded.data))
            self._realloc(state)
            shapes = [(world * t.shape[0], *t.shape[1:]) if t.dim() else (world,) for t in inputs]
            if len(state.outputs) != len(inputs) or any(
                o.shape != s or o.dtype != t.dtype
                for o, s, t in zip(state.outputs, shapes, inputs, strict=False)
            ):
                state.outputs = [t.new_empty(s) for t, s in zip(inputs, shapes, strict=True)]
                state.result = None
            for output in state.outputs:
                output.view(world, -1).copy_(layout.columns(blocks, j))
                j += 1
            self._post(unit, unit.params[index], found[index], state, metadata)

    def _pre(
        self, unit: FSDPUnit, p: ShardedParam, local: torch.Tensor
    ) -> tuple[list[torch.Tensor], Any]:
        if p.shard_dim != 0:
            raise NotImplementedError(
                f"fully_shard: parameter {p.fqn!r} has all-gather extensions and is sharded on "
                f"dim {p.shard_dim}; fsdp_core runs them only for Shard(0)."
            )
        pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if len(inspect.signature(pre).parameters) == 1:
            inputs, metadata = pre(self._shard_mesh(unit))
        else:
            stride = _contiguous_stride(p.global_shape)
            inputs, metadata = pre(
                self._shard_mesh(unit), p.global_shape, stride, unit.module, unit.mp_policy
            )
        padded = []
        for t in inputs:
            t = t.to(unit.device)
            if t.dim() and t.shape[0] == p.valid_rows != p.chunk_rows:
                pad = t.new_zeros((p.chunk_rows - p.valid_rows, *t.shape[1:]))
                t = torch.cat([t, pad])
            padded.append(t)
        return padded, metadata

    def _post(
        self, unit: FSDPUnit, p: ShardedParam, local: torch.Tensor, state: _State, metadata: Any
    ) -> None:
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        param_dtype = unit.compute_dtype_for(p, p.padded_shard.dtype)
        outputs = tuple(state.outputs)
        if state.result is None:
            returned = post(outputs, metadata, param_dtype)
            if not (isinstance(returned, tuple) and len(returned) == 2):
                raise TypeError(
                    f"fully_shard: fsdp_post_all_gather of {p.fqn!r} returned "
                    f"{type(returned).__name__}; without out= it must return (unsharded, "
                    "tensors_to_free)."
                )
            state.result = returned[0]
        else:
            post(outputs, metadata, param_dtype, out=state.result)
        state.nbytes = [t.untyped_storage().nbytes() for t in self._freeable(state)]
        # ``.data``: the same Parameter object, which autograd hooks are registered on.
        p.unsharded.data = state.result.narrow(0, 0, p.rows)

    def reshard(self) -> None:
        """Free the kept outputs' and plain results' storage (reallocated at the next
        unshard)."""
        for state in self._states.values():
            for t in self._freeable(state):
                t.untyped_storage().resize_(0)

    @staticmethod
    def _freeable(state: _State) -> list[torch.Tensor]:
        kept = list(state.outputs)
        if state.result is not None and type(state.result) is torch.Tensor:
            kept.append(state.result)
        return kept

    @staticmethod
    def _realloc(state: _State) -> None:
        for t, nbytes in zip(GatherExtensions._freeable(state), state.nbytes, strict=False):
            storage = t.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def _shard_mesh(self, unit: FSDPUnit) -> Any:
        """The 1-D mesh of the shard group (FSDP2 passes only that one, also with HSDP)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = unit.groups.shard
            if group is not None:
                self._mesh = DeviceMesh.from_group(group, unit.device.type)
            elif unit.layout is not None:
                self._mesh = unit.layout.mesh
        return self._mesh
