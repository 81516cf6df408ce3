"""``check_resume_parity``: a DCP checkpoint resumed at another world size, for fsdp_core and
torch's FSDP2, and that it catches a resumed run that diverges."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import FSDP
from fsdp_testing.parity import ResumeReport, check_resume_parity


def _build() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5))
    gen = torch.Generator().manual_seed(0)  # not the global RNG: thread ranks share it
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randn(12, 8, generator=torch.Generator().manual_seed(step))


def _core_wrapper(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    return FSDP(model, group)


def _torch_fsdp2(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


@pytest.mark.parametrize("shard", [_core_wrapper, _torch_fsdp2], ids=["fsdp_core", "fsdp2"])
@pytest.mark.distributed(world_size=3)
def test_resume_parity_passes_for_correct_engines(shard, process_group, tmp_path):
    """3 -> 2 and 2 -> 3: the report carries the reference's four losses and the resumed
    run's last two, which are close to the reference's."""
    for phase, (a, b) in enumerate([(3, 2), (2, 3)]):
        report = check_resume_parity(
            _build,
            shard,
            _batch,
            process_group=process_group,
            checkpoint_dir=tmp_path / str(phase),
            from_world=a,
            to_world=b,
        )
        assert isinstance(report, ResumeReport) and (report.from_world, report.to_world) == (a, b)
        assert len(report.reference_losses) == 4 and len(report.resumed_losses) == 2
        expected = torch.tensor(report.reference_losses[2:])
        torch.testing.assert_close(torch.tensor(report.resumed_losses), expected)
        assert report.reference_losses[0] != report.reference_losses[3]  # it trained


@pytest.mark.distributed(world_size=2)
def test_resume_parity_catches_a_run_that_diverges(process_group, tmp_path):
    """A loss that depends on the world size (a sum over each rank's rows) makes the resumed
    losses differ: every rank raises naming both loss lists."""
    with pytest.raises(AssertionError, match=r"diverged from the uninterrupted run.*resumed \["):
        check_resume_parity(
            _build,
            _core_wrapper,
            _batch,
            process_group=process_group,
            checkpoint_dir=tmp_path,
            from_world=2,
            to_world=1,
            loss_fn=lambda model, batch: model(batch).pow(2).sum(),
        )


@pytest.mark.distributed(world_size=2)
def test_resume_parity_is_bitwise_at_the_same_world_size(process_group, tmp_path):
    """Unchanged world size: the resumed losses equal the reference's bitwise."""
    report = check_resume_parity(
        _build,
        _core_wrapper,
        _batch,
        process_group=process_group,
        checkpoint_dir=tmp_path,
        from_world=2,
        to_world=2,
        num_steps=3,
        save_after=1,
    )
    assert report.resumed_losses == report.reference_losses[1:]


@pytest.mark.distributed(world_size=2)
def test_resume_parity_rejects_bad_arguments(process_group, tmp_path):
    """World sizes beyond the launch, a save step outside the run and a batch the ranks
    cannot split raise ValueError naming the fix."""
    kwargs = {"process_group": process_group, "checkpoint_dir": tmp_path}
    with pytest.raises(ValueError, match=r"launch max\(from_world, to_world\) = 4 ranks"):
        check_resume_parity(_build, _core_wrapper, _batch, from_world=4, to_world=2, **kwargs)
    with pytest.raises(ValueError, match="save_after=4 must be between 1 and"):
        check_resume_parity(
            _build, _core_wrapper, _batch, from_world=2, to_world=1, save_after=4, **kwargs
        )
    with pytest.raises(ValueError, match="7 rows, which 2 ranks cannot split evenly"):
        check_resume_parity(
            _build,
            _core_wrapper,
            lambda step: torch.randn(7, 8),
            from_world=2,
            to_world=1,
            **kwargs,
        )
    with pytest.raises(ValueError, match=r"tensors of \[4, 12\] rows"):
        check_resume_parity(
            _build,
            _core_wrapper,
            lambda step: (_batch(step), torch.zeros(4)),
            from_world=2,
            to_world=1,
            **kwargs,
        )


@pytest.mark.distributed(world_size=2)
def test_resume_parity_splits_a_structured_batch(process_group, tmp_path):
    """A batch of any structure (here a dict with an input and a target): every tensor's rows
    are split over the ranks, and loss_fn gets the rank's rows in the same structure."""

    def get_batch(step):
        x = _batch(step)
        return {"x": x, "y": x[:, :5] * 2, "note": "kept"}

    def loss_fn(model, batch):
        assert batch["note"] == "kept" and batch["x"].shape[0] == batch["y"].shape[0]
        return nn.functional.mse_loss(model(batch["x"]), batch["y"])

    report = check_resume_parity(
        _build,
        _core_wrapper,
        get_batch,
        process_group=process_group,
        checkpoint_dir=tmp_path,
        from_world=2,
        to_world=1,
        num_steps=3,
        save_after=1,
        loss_fn=loss_fn,
    )
    assert len(report.resumed_losses) == 2
