"""``ShardedGradScaler``: loss scaling for sharded gradients, with found-inf agreed by all ranks.

``torch.amp.GradScaler`` decides per process whether a step overflowed, from the gradients it
sees. Under FSDP each rank sees only its shard of each gradient, so an inf produced by one
element of a reduced gradient lands on the one rank that owns that element: left alone, that
rank would skip the step and lower its scale while the others step, and the replicas of the
model drift apart. This scaler unscales the local shards (``DTensor`` gradients by their local
tensors, fp16 gradients allowed, as mixed precision may keep them), then all-reduces the
found-inf flag with ``MAX`` over the process group, so every rank skips the same steps and keeps
the same scale. It works on the CPU (gloo) as on CUDA (NCCL).

    scaler = ShardedGradScaler(device="cpu")
    with torch.autocast("cpu", dtype=torch.float16): loss = model(x).sum()
    scaler.scale(loss).backward()
    scaler.step(optim)  # skipped on every rank if any rank's shard holds an inf or nan
    scaler.update()
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """A ``GradScaler`` whose skip decision is the same on every rank of ``process_group``.

    Args:
        device: where the scale lives: ``"cuda"``, ``"cpu"``, ... (default ``None``: CUDA when
            available, else the CPU; torch's class defaults to ``"cuda"`` and disables itself
            without CUDA).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        process_group: the ranks that must agree (default ``None``: the whole world). With
            hybrid sharding this is still every rank that steps the same model.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale each rank's local gradients in place; one found-inf flag per device.

        fp16 gradients are allowed whatever ``allow_fp16`` says: sharded mixed precision may keep
        them. Sparse gradients are refused (FSDP never produces them).
        """
        del allow_fp16
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                if local.is_sparse:
                    raise ValueError(
                        "ShardedGradScaler: a parameter has a sparse gradient; sharded "
                        "parameters have dense gradients. Use torch.amp.GradScaler for "
                        "sparse ones."
                    )
                by_device[local.device][local.dtype].append(local)
        flags: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for device, by_dtype in by_device.items():
                flag = found_inf.to(device, copy=True)
                scale = inv_scale.to(device)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, scale)
                flags[device] = flag
        return flags

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradient shards, then agree on found-inf with every rank."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._agree(state["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The path of optimizers that unscale inside their own step (fused ones): agree too.
        flags = super()._check_inf_per_device(optimizer)
        agreed = self._agree(flags)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = agreed
        return agreed

    def _agree(self, flags: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        """Every rank's flags become 1.0 where any rank found an inf or nan, else 0.0.

        A rank without gradients (all of its shards empty) still takes part, so the collective
        never waits on a missing rank; its flag is kept on the scale's device.
        """
        backend = dist.get_backend(self.process_group)
        comm_device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else (torch.device("cpu"))
        )
        local = torch.zeros((), dtype=torch.float32, device=comm_device)
        for flag in flags.values():
            local = torch.maximum(local, flag.to(comm_device).clamp(max=1.0))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group)
        if not flags:
            assert self._scale is not None
            return {self._scale.device: local.to(self._scale.device)}
        for flag in flags.values():
            flag.copy_(local)
        return flags
