"""What a recorder knows about the moment of a call: the phase of the training step it is in
(forward, backward, optimizer step, or outside a step), the dims of a device mesh its group is,
and the DTensor redistributions of the block (counted as torch's ``CommDebugMode`` counts them).

[Note: the phase of a call]
A call is in ``"backward"`` while autograd runs a backward pass on the calling thread (torch's
current graph task), in ``"optimizer"`` while an optimizer's ``step`` runs (torch's global
optimizer step hooks), in ``"forward"`` while a module's forward runs (torch's global module
forward hooks; a forward recomputed inside backward, as activation checkpointing does, is
backward), and ``"outside"`` otherwise (a barrier between steps, a state dict's gather). The
hooks are torch's public global ones, registered for the recorder's block only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["PHASES", "DTensorComms", "MeshDims", "PhaseTracker"]

#: The phases a record can be in; see [Note: the phase of a call].
PHASES = ("forward", "backward", "optimizer", "outside")


class PhaseTracker:
    """The calling thread's phase of the training step (see [Note: the phase of a call])."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _depths(self) -> dict[str, int]:
        depths = getattr(self._local, "depths", None)
        if depths is None:
            depths = self._local.depths = {"forward": 0, "optimizer": 0}
        return depths

    def phase(self) -> str:
        import torch

        if torch._C._current_graph_task_id() != -1:
            return "backward"
        depths = self._depths()
        if depths["optimizer"]:
            return "optimizer"
        if depths["forward"]:
            return "forward"
        return "outside"

    def install(self, stack: contextlib.ExitStack) -> None:
        """Register torch's global forward and optimizer step hooks until ``stack`` closes."""
        from torch.nn.modules import module
        from torch.optim import optimizer

        def enter(kind: str) -> Any:
            def hook(*args: Any, **kwargs: Any) -> None:
                self._depths()[kind] += 1

            return hook

        def leave(kind: str) -> Any:
            def hook(*args: Any, **kwargs: Any) -> None:
                depths = self._depths()
                depths[kind] = max(0, depths[kind] - 1)

            return hook

        handles = [
            module.register_module_forward_pre_hook(enter("forward")),
            module.register_module_forward_hook(leave("forward"), always_call=True),
            optimizer.register_optimizer_step_pre_hook(enter("optimizer")),
            optimizer.register_optimizer_step_post_hook(leave("optimizer")),
        ]
        for handle in handles:
            stack.callback(handle.remove)


class MeshDims:
    """Names a process group by the dims of a device mesh it spans on this rank: the group of
    dim ``"tp"`` is ``("tp",)``, the whole mesh's group every dim name."""

    def __init__(self, mesh: Any) -> None:
        self._by_ranks: dict[tuple[int, ...], tuple[str, ...]] = {}
        if mesh is None:
            return
        import torch.distributed as dist

        names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
        for i, name in enumerate(names):
            group = mesh.get_group(i)
            self._by_ranks[tuple(dist.get_process_group_ranks(group))] = (name,)
        everyone = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
        self._by_ranks.setdefault(everyone, names)

    def of(self, group_ranks: tuple[int, ...]) -> tuple[str, ...]:
        """The mesh dims of a group, by its global ranks (``()``: not a group of the mesh)."""
        found = self._by_ranks.get(tuple(group_ranks))
        if found is None:
            found = self._by_ranks.get(tuple(sorted(group_ranks)), ())
        return found


class DTensorComms:
    """The collectives DTensor issued in a block, per module and phase, as torch's
    ``CommDebugMode`` counts them (opt-in: the mode sees every op of the block)."""

    def __init__(self) -> None:
        self._mode: Any = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from torch.distributed.tensor.debug import CommDebugMode

        self._mode = CommDebugMode()
        _this_thread_only(getattr(self._mode, "advanced_module_tracker", None))
        with self._mode:
            yield

    def counts(self, module: str | None = None, phase: str | None = None) -> dict[str, int]:
        """``{"all_gather_into_tensor": 2, ...}``: the block's DTensor collectives by name, of
        one module (its FQN, ``"mlp.up"``, or CommDebugMode's name for it, the root module's
        class first: ``"Transformer.mlp.up"``; ``"Global"`` is every module) and phase
        (``"forward"`` or ``"backward"``), or all of them."""
        if self._mode is None:
            raise ValueError(
                "dtensor_comms: nothing was counted; record with record_comms(dtensor=True) (or "
                "record_fsdp(..., dtensor=True)) to count DTensor's collectives"
            )
        if module is None and phase is None:
            raw = self._mode.get_comm_counts()
        else:
            per_module = self._mode.comm_module_counts.get(self._module_name(module), {})
            phases = [phase] if phase is not None else ["forward", "backward"]
            raw = {}
            for name in phases:
                for op, count in per_module.get(name, {}).items():
                    raw[op] = raw.get(op, 0) + count
        return {_op_name(op): int(count) for op, count in raw.items() if count}

    def _module_name(self, module: str | None) -> str:
        """CommDebugMode's name for ``module`` (an FQN or its own name)."""
        if module is None or module == "Global":
            return "Global"
        tracker = getattr(self._mode, "advanced_module_tracker", None)
        seen = set(self._mode.comm_module_counts) | set(getattr(tracker, "module_helper_dict", {}))
        if module in seen:
            return module
        by_fqn = [name for name in seen if name.partition(".")[2] == module]
        if len(by_fqn) == 1:
            return by_fqn[0]
        known = ", ".join(sorted(n.partition(".")[2] or n for n in seen if n != "Global"))
        raise ValueError(
            f"dtensor_comms: no module {module!r} ran in the recorded block; the modules that "
            f"did: {known or 'none'} (their FQNs in the root module)"
        )


# CommDebugMode counts a collective for the module whose forward is running, which its module
# tracker learns from torch's global module hooks: global to the process, so in thread and
# local mode (ranks are threads) each rank's tracker also saw the other ranks' modules enter
# and leave, warned "The module hierarchy tracking maybe be messed up" and could count a
# collective for another rank's module. Each tracker now hears only the thread that counts.
_TRACKER_HOOKS = ("_fw_pre_hook", "_fw_post_hook", "_bw_hook")


def _this_thread_only(tracker: Any) -> None:
    owner = threading.get_ident()
    for name in _TRACKER_HOOKS:
        hook = getattr(tracker, name, None)
        if hook is None:  # another torch: its tracker as it is
            continue

        def guarded(*args: Any, _hook: Any = hook) -> Any:
            if threading.get_ident() == owner:
                return _hook(*args)
            return None

        setattr(tracker, name, guarded)  # read by its __enter__, which registers the hooks


def _op_name(op: Any) -> str:
    """``all_gather_into_tensor`` for torch's ``_c10d_functional.all_gather_into_tensor``."""
    name = getattr(op, "__name__", None) or str(op)
    return str(name).split(".")[-1] if "." in str(name) else str(name)
