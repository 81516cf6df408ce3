"""Parity of sharded parameters themselves: FSDP2-style ``DTensor`` shards against a replicated
reference, module states across ranks, and the full parameters of any engine's model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..engines import engine_for
from ..engines._base import default_process_group
from ..patching import rank_prefix
from ._causes import format_causes, shard_causes
from ._compare import Divergence, compare_named, format_divergences

__all__ = [
    "_assert_module_states",
    "assert_module_states_equal",
    "check_sharded_parity",
    "get_full_params",
]


def _fail(message: str) -> AssertionError:
    return AssertionError(f"{rank_prefix()}{message}")


def get_full_params(model: nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    """Detached copies of the full (unsharded) parameters of ``model``, in
    ``model.parameters()`` order, for any engine (found with ``engine_for``) or a plain module.

    Args:
        model: a sharded or plain module.
        recurse: unshard submodules too (default True); False only the parameters that
            ``model`` itself manages.
    """
    engine = engine_for(model)
    if engine is None:
        return [param.detach().clone() for param in model.parameters()]
    with engine.full_params(model, recurse=recurse, writeback=False):
        return [param.detach().clone() for param in model.parameters()]


def check_sharded_parity(
    replicated_module: Any,
    sharded_module: Any,
    prefixes_to_ignore: Any = (),
    *legacy: Any,
) -> None:
    """Checks FSDP2-style sharded parameters (``DTensor``) and their gradients against a
    replicated reference: each rank's local shard must equal the same slice of the reference.

    Also accepts torch's form ``check_sharded_parity(test_case, replicated, sharded,
    prefixes_to_ignore)``.

    Args:
        replicated_module: the reference, the same on every rank.
        sharded_module: the sharded module; parameters in the same order.
        prefixes_to_ignore: substrings removed from sharded names before matching names.
    """
    if not isinstance(replicated_module, nn.Module) and isinstance(sharded_module, nn.Module):
        # torch's signature: (cls, replicated_module, sharded_module, prefixes_to_ignore=()).
        replicated_module, sharded_module = sharded_module, prefixes_to_ignore
        prefixes_to_ignore = legacy[0] if legacy else ()
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    problems: list[str] = []
    found: list[Divergence] = []
    # The numbers the likely causes read (see [Note: likely causes] in ``_causes``): the
    # diverging shards with the full reference, every local gradient with its expected value.
    shards: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
    grads: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    coordinate: tuple[int, int, str] | None = None  # (rank, size, who) on a 1-D mesh
    pairs = list(
        zip(replicated_module.named_parameters(), sharded_module.named_parameters(), strict=False)
    )
    for (ref_name, ref_param), (name, param) in pairs:
        clean = name
        for prefix in prefixes_to_ignore:
            clean = clean.replace(prefix, "")
        if clean != ref_name:
            problems.append(f"parameter order differs: {name!r} against reference {ref_name!r}")
            continue
        if not isinstance(param, DTensor):
            problems.append(f"{name} is a {type(param).__name__}, not a DTensor")
            continue
        placements = tuple(param.placements)
        if placements == (Shard(0), Shard(0)):
            raise _fail(
                "check_sharded_parity: the (Shard(0), Shard(0)) layout of FSDP differs from "
                f"distribute_tensor()'s, so {name} cannot be compared"
            )
        expected = distribute_tensor(
            ref_param.detach(), param.device_mesh, placements, src_data_rank=None
        )
        divergence = compare_named([(name, expected.to_local())], [(name, param.to_local())])
        found += divergence
        mesh = param.device_mesh
        if mesh.ndim == 1 and isinstance(placements[0], Shard):
            local, who = mesh.get_local_rank(), f"rank {dist.get_rank()}"
            if local != dist.get_rank() or mesh.size() != dist.get_world_size():
                who += f" ({(mesh.mesh_dim_names or ('mesh',))[0]}={local})"  # a sub-mesh
            coordinate = (local, mesh.size(), who)
            if divergence:
                shards.append(
                    (name, ref_param.detach(), param.to_local().detach(), placements[0].dim)
                )
        if ref_param.grad is None:
            if param.grad is not None:
                problems.append(f"{name}.grad exists but the reference has no gradient")
            continue
        if param.grad is None:
            problems.append(f"{name}.grad is None but the reference has a gradient")
            continue
        if not isinstance(param.grad, DTensor):
            problems.append(f"{name}.grad is a {type(param.grad).__name__}, not a DTensor")
            continue
        expected_grad = distribute_tensor(
            ref_param.grad, param.device_mesh, placements, src_data_rank=None
        )
        found += compare_named(
            [(f"{name}.grad", expected_grad.to_local())],
            [(f"{name}.grad", param.grad.to_local())],
        )
        grads.append((name, expected_grad.to_local().detach(), param.grad.to_local().detach()))
    counts = (len(list(replicated_module.parameters())), len(list(sharded_module.parameters())))
    if counts[0] != counts[1]:
        problems.append(f"parameter counts differ: reference {counts[0]}, sharded {counts[1]}")
    if problems or found:
        details = "\n".join(f"  {p}" for p in problems)
        if found:
            details += ("\n" if details else "") + format_divergences(found)
            if coordinate is not None:
                rank, size, who = coordinate
                causes = shard_causes(shards, grads, rank=rank, world_size=size, who=who)
                details += "\n" + format_causes(causes)
        raise _fail(f"check_sharded_parity: sharded module differs from the reference:\n{details}")


def _gather_states(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    states = [*module.named_parameters(), *module.named_buffers()]
    return [
        (name, (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu())
        for name, t in states
    ]


def assert_module_states_equal(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> None:
    """Raises unless every rank holds bitwise-equal parameters and buffers (``DTensor``s are
    compared as full tensors). Every rank raises the same message, naming each differing state
    and the ranks that differ from rank 0.

    Args:
        module: the module to check (call on every rank).
        process_group: the group, default the default group.
    """
    group = process_group if process_group is not None else default_process_group()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, _gather_states(module), group=group)
    reference = gathered[0]
    lines = []
    for other_rank, states in enumerate(gathered[1:], start=1):
        for divergence in compare_named(reference, states, exact=True):
            lines.append(f"  rank {other_rank} vs rank 0: {divergence}")
    if lines:
        raise _fail(
            f"assert_module_states_equal: {type(module).__name__} states differ across ranks:\n"
            + "\n".join(lines)
        )


def _assert_module_states(
    model: nn.Module,
    process_group: dist.ProcessGroup,
    assert_fn: Callable[[torch.Tensor, torch.Tensor], Any],
) -> None:
    """torch's form: calls ``assert_fn(rank0_state, rank_r_state)`` for each state and rank."""
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, _gather_states(model), group=process_group)
    for states in gathered[1:]:
        for (_, first), (_, other) in zip(gathered[0], states, strict=True):
            assert_fn(first, other)
