"""fully_shard's runtime as torch's FSDP2 tests use it (issue 23): activation checkpointing and
several forwards before one backward, grouped modules that run only partly in the root's
forward, FSDPModule's iteration controls, the all-reduce hook and HSDP's reduce-scatter-only
accumulation. Every check compares against a reference computed here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint as utils_checkpoint

from fsdp_core import MixedPrecisionPolicy, events, fully_shard


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _averaged_grads(model: nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """A local replica's gradients averaged over the ranks: what a sharded model must hold."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            grads[name] = grad / dist.get_world_size(group)
    return grads


def _assert_grads(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert (p.grad is None) == (name not in expected), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), expected[name], msg=name)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x)))


class _Net(nn.Module):
    def __init__(self, utils: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.utils = utils

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = utils_checkpoint(block, x, use_reentrant=False) if self.utils else block(x)
        return x


@pytest.mark.parametrize("impl", ["composable", "utils"])
@pytest.mark.distributed(world_size=2)
def test_checkpointed_blocks_and_two_forwards_before_backward(impl, rank, process_group):
    """Nested units inside checkpointed blocks (their forward recomputed in backward) and two
    forwards before one backward (DPO): gradients equal the replicas' average."""
    torch.manual_seed(0)
    model = _Net(utils=impl == "utils")
    reference = copy.deepcopy(model)
    mesh = _mesh(process_group)
    for block in model.blocks:
        if impl == "composable":
            composable_checkpoint(block)
        fully_shard(block.lin1, mesh=mesh)
        fully_shard(block.lin2, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x1, x2 = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(rank))
    for m in (reference, model):
        (m(x1).sum() - m(x2).sum()).pow(2).backward()
    _assert_grads(model, _averaged_grads(reference, process_group))


class _ChunkedHead(nn.Module):
    """FSDP2's chunked-loss model: forward(skip_head=True) stops before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _chunked_step(model: nn.Module, tokens: torch.Tensor, chunks: int = 3) -> None:
    """The model's forward without the head, then the head per chunk (forward and backward
    each), then backward through the rest with the chunks' input gradients."""
    h = model(tokens, skip_head=True)
    grads = []
    for chunk in torch.chunk(h.detach(), chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        model.head(chunk).sum().backward()
        grads.append(chunk.grad)
    h.backward(torch.cat(grads, dim=1))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.distributed(world_size=2)
def test_group_that_runs_partly_then_per_chunk_trains_like_the_replicas(
    reshard_after_forward, rank, process_group
):
    """fully_shard([norm, head]) whose head runs outside the root's forward, per chunk: two
    steps give the replicas' average gradients, the unit is gathered where each pass needs
    it and is resharded after each step."""
    torch.manual_seed(0)
    model = _ChunkedHead()
    reference = copy.deepcopy(model)
    mesh = _mesh(process_group)
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    fully_shard(model.embed, **kw)
    fully_shard(model.body, **kw)
    fully_shard([model.norm, model.head], **kw)
    fully_shard(model, **kw)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(rank + step))
        seen: list = []
        with events.subscribe(seen.append):
            _chunked_step(model, tokens)
        _chunked_step(reference, tokens)
        expected = _averaged_grads(reference, process_group)
        _assert_grads(model, expected)
        gathers = [e for e in seen if isinstance(e, events.Unshard) and e.unit == "norm"]
        # Resharding after forward: the forward, each chunk's forward and backward, norm's
        # backward. Keeping them: the forward, then each chunk after the previous chunk's
        # backward resharded (chunk 1 reuses the forward's), then norm's backward.
        assert len(gathers) == (1 + 3 * 2 + 1 if reshard_after_forward else 1 + 2 + 1), gathers
        assert not model.head._get_fsdp_state().unit.is_unsharded
        for name, p in reference.named_parameters():
            p.grad = expected[name]  # the replicas step alike
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()


@pytest.mark.distributed(world_size=2)
def test_two_partial_forwards_then_one_backward(rank, process_group):
    """Two forwards that skip the head, one backward: the grouped unit reduces norm's
    gradients of both, the head gets none."""
    torch.manual_seed(0)
    model = _ChunkedHead()
    reference = copy.deepcopy(model)
    mesh = _mesh(process_group)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    t1, t2 = torch.randint(0, 32, (2, 2, 6), generator=torch.Generator().manual_seed(rank))
    for m in (model, reference):
        (m(t1, skip_head=True).sum() + m(t2, skip_head=True).sum()).backward()
    _assert_grads(model, _averaged_grads(reference, process_group))
    assert model.head.weight.grad is None


@pytest.mark.distributed(world_size=2)
def test_every_module_of_a_group_casts_its_inputs(rank, process_group):
    """cast_forward_inputs applies to the second module of fully_shard([a, b]) too: an fp32
    tensor between them reaches b's bf16 weight as bf16."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).float())

    torch.manual_seed(0)
    model = Pair()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard([model.a, model.b], mesh=_mesh(process_group), mp_policy=policy)
    fully_shard(model, mesh=_mesh(process_group), mp_policy=policy)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.b(reference.a(x.bfloat16()).float().bfloat16()))


@pytest.mark.distributed(world_size=2)
def test_reset_iter_state_recovers_after_an_exception_in_forward(rank, process_group):
    """An exception inside the root's forward leaves units unsharded and mid-forward; after
    reset_iter_state on the root every unit is resharded and the next step trains as the
    replicas do."""

    class Failing(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.armed = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                raise RuntimeError("boom")
            return self.inner(x)

    torch.manual_seed(0)
    model = _ChunkedHead()
    model.body = Failing(model.body)
    reference = copy.deepcopy(model)
    reference.body.armed = False
    mesh = _mesh(process_group)
    fully_shard(model.embed, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(rank))
    with pytest.raises(RuntimeError, match="boom"):
        model(tokens)
    model.body.armed = False
    with pytest.raises(RuntimeError, match="reset_iter_state must be called on the root"):
        model.embed.reset_iter_state()
    assert model._get_fsdp_state().unit.is_unsharded  # the root's, holding body's parameters
    model.reset_iter_state()
    assert not model._get_fsdp_state().unit.is_unsharded
    for m in (model, reference):
        m(tokens).sum().backward()
    _assert_grads(model, _averaged_grads(reference, process_group))


@pytest.mark.distributed(world_size=2)
def test_micro_batches_with_set_is_last_backward(rank, process_group):
    """FSDP2's 1F1B pattern: no gradient sync and set_is_last_backward(False) for all but the
    last micro-batch; the sum equals the replicas' average."""
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    mesh = _mesh(process_group)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    batches = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(rank))
    for i, x in enumerate(batches):
        last = i == len(batches) - 1
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        assert model._get_fsdp_state().is_last_backward is last
        model(x).sum().backward()
        reference(x).sum().backward()
    _assert_grads(model, _averaged_grads(reference, process_group))


@pytest.mark.distributed(world_size=2)
def test_unshard_in_backward_false_skips_the_backward_all_gather(rank, process_group):
    """An embedding's gradient needs no parameters: with set_unshard_in_backward(False) its
    unit is gathered for forward only, and its gradients are still right."""
    torch.manual_seed(0)
    model = _ChunkedHead()
    reference = copy.deepcopy(model)
    mesh = _mesh(process_group)
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.embed.set_unshard_in_backward(False)
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(rank))
    seen: list = []
    with events.subscribe(seen.append):
        model(tokens).sum().backward()
    reference(tokens).sum().backward()
    gathers = [e.reason for e in seen if isinstance(e, events.Unshard) and e.unit == "embed"]
    assert gathers == ["forward"]
    _assert_grads(model, _averaged_grads(reference, process_group))


@pytest.mark.distributed(world_size=4)
def test_all_reduce_hook_replicates_across_a_group_of_its_own(rank, process_group):
    """FSDP over pairs of ranks plus a hook that averages the reduced shard across the pairs
    is HSDP by hand: gradients equal the four replicas' average. With a 2-D mesh a stream is
    refused with FSDP2's message."""
    ranks = dist.get_process_group_ranks(process_group)
    pairs = [dist.new_group(ranks[i : i + 2]) for i in (0, 2)]
    across = [dist.new_group([ranks[i], ranks[i + 2]]) for i in (0, 1)]
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    fully_shard(model, mesh=DeviceMesh.from_group(pairs[rank // 2], "cpu"))
    calls = []

    def hook(reduced: torch.Tensor) -> None:
        calls.append(reduced.numel())
        dist.all_reduce(reduced, group=across[rank % 2])
        reduced.div_(2)

    model.set_all_reduce_hook(hook)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    reference(x).sum().backward()
    assert len(calls) == 1
    _assert_grads(model, _averaged_grads(reference, process_group))
    hybrid = DeviceMesh("cpu", torch.tensor(ranks).view(2, 2), mesh_dim_names=("r", "s"))
    fully_shard(hsdp := _Net(), mesh=hybrid)
    with pytest.raises(ValueError, match=r"^stream cannot be set when using native HSDP$"):
        hsdp.set_all_reduce_hook(hook, stream=torch.cpu.Stream())


@pytest.mark.distributed(world_size=4)
def test_requires_all_reduce_false_reduce_scatters_only_until_the_last(rank, process_group):
    """HSDP micro-batches with set_requires_all_reduce(False): one reduce-scatter each and a
    single all-reduce at the last, whose result equals the replicas' average of the sum."""
    ranks = dist.get_process_group_ranks(process_group)
    mesh = DeviceMesh("cpu", torch.tensor(ranks).view(2, 2), mesh_dim_names=("r", "s"))
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    seen: list = []
    with events.subscribe(seen.append):
        for i, x in enumerate(torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(rank))):
            model.set_requires_all_reduce(i == 2)
            model(x).sum().backward()
            reference(x).sum().backward()
    ops = [e.op for e in seen if isinstance(e, events.Collective)]
    assert sum("reduce_scatter" in op for op in ops) == 3
    assert sum("all_reduce" in op for op in ops) == 1
    _assert_grads(model, _averaged_grads(reference, process_group))


@pytest.mark.parametrize("door", ["fully_shard", "wrapper"])
@pytest.mark.distributed(world_size=2)
def test_the_runtime_reshards_only_units_holding_unsharded_parameters(
    door, rank, process_group, monkeypatch
):
    """Every FSDPUnit.reshard call frees something: once per unit in backward, as FSDP1's
    _reshard (a delay patched on reshard, as test_fsdp_core's mixture of experts does, used
    to sleep twice per unit and step)."""
    from fsdp_core import FSDP
    from fsdp_core._unit import FSDPUnit

    calls: list[bool] = []
    original = FSDPUnit.reshard

    def counting(self: FSDPUnit, *args: object, **kwargs: object) -> None:
        calls.append(self.is_unsharded)
        original(self, *args, **kwargs)

    monkeypatch.setattr(FSDPUnit, "reshard", counting)
    torch.manual_seed(0)
    model = _Net()
    if door == "wrapper":
        for block in model.blocks:
            block.lin1 = FSDP(block.lin1, process_group)
        model = FSDP(model, process_group)
    else:
        for block in model.blocks:
            fully_shard(block.lin1, mesh=_mesh(process_group))
        fully_shard(model, mesh=_mesh(process_group))
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    # Per step: each lin1 after its forward and after its backward, the root after backward.
    assert calls == [True] * 2 * (2 + 2 + 1)


@pytest.mark.distributed(world_size=4, mode="thread")
def test_int_reshard_after_forward_with_thread_ranks(rank, process_group):
    """reshard_after_forward=2 builds groups of two ranks, cached per rank: with thread ranks
    (one process) each rank must find its own groups, not another thread's (rank 0 used to
    create them again alone and hang the others)."""
    mesh = _mesh(process_group)
    for _ in range(2):
        model = _Net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=2)
        fully_shard(model, mesh=mesh, reshard_after_forward=2)
        model(torch.randn(2, 8)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.distributed(world_size=2)
def test_inputs_are_cast_to_param_dtype_even_when_it_is_the_parameters_dtype(rank, process_group):
    """FSDP2 casts forward inputs to param_dtype whenever it is set: with param_dtype=float32
    and output_dtype=bfloat16 the next unit gets its bf16 input back in float32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    model = _Net()
    for block in model.blocks:
        fully_shard(block, mesh=_mesh(process_group), mp_policy=policy)
    fully_shard(model, mesh=_mesh(process_group), mp_policy=policy)
    out = model(torch.randn(2, 8))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()


@pytest.mark.distributed(world_size=2)
def test_gradient_divide_factor_gives_the_sum_over_the_factor(rank, process_group):
    """``set_gradient_divide_factor(f)``: gradients are the ranks' sum divided by f (1: the
    sum), on that module only; bad factors are refused naming the method."""
    torch.manual_seed(0)
    model = _Net()
    replica = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=_mesh(process_group))
    fully_shard(model, mesh=_mesh(process_group))
    model.blocks[0].set_gradient_divide_factor(4.0)
    model.blocks[1].set_gradient_divide_factor(1)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    replica(x).sum().backward()
    averaged = _averaged_grads(replica, process_group)
    # The average is the sum over 2: a factor of 4 halves it, a factor of 1 doubles it.
    expected = {
        name: grad / (2.0 if name.startswith("blocks.0.") else 0.5)
        for name, grad in averaged.items()
    }
    _assert_grads(model, expected)
    for bad in (0, -2.0, True, "2"):
        with pytest.raises(ValueError, match="set_gradient_divide_factor takes a positive"):
            model.set_gradient_divide_factor(bad)


@pytest.mark.distributed(world_size=2)
def test_reduce_scatter_max_input_buffers_is_validated_and_changes_no_number(rank, process_group):
    torch.manual_seed(0)
    model, other = _Net(), _Net()
    other.load_state_dict(model.state_dict())
    for net in (model, other):
        for block in net.blocks:
            fully_shard(block, mesh=_mesh(process_group))
        fully_shard(net, mesh=_mesh(process_group))
    with pytest.raises(ValueError, match="must be a positive int, got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    for bad in (2.5, True):
        with pytest.raises(TypeError, match="must be an int"):
            model.set_reduce_scatter_max_input_buffers(bad)
    model.set_reduce_scatter_max_input_buffers(2)
    other.blocks[0].set_reduce_scatter_max_input_buffers(3, recurse=False)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    for net in (model, other):
        net(x).sum().backward()
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a.grad.to_local(), b.grad.to_local())
    model.set_force_sum_reduction_for_comms(True)
    with pytest.raises(TypeError, match="takes a bool"):
        model.set_force_sum_reduction_for_comms(1)


@pytest.mark.distributed(world_size=2)
def test_torchs_ddp_replicate_leaves_the_fully_shard_modules_to_it(rank, process_group):
    """torch's DDP-based composable ``replicate`` on a root whose submodules ``fully_shard``
    manages (torch's FSDP2 tests use it as their reference) finds them in torch's registry of
    composable APIs and all-reduces only the root's own parameters: every gradient is the
    average of the replicas'."""
    from torch.distributed._composable import replicate as torch_replicate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Net())
    replica = copy.deepcopy(model)
    for block in model[1].blocks:
        fully_shard(block, mesh=_mesh(process_group))
    fully_shard(model[1], mesh=_mesh(process_group))
    torch_replicate(model, process_group=process_group)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    replica(x).sum().backward()
    expected = _averaged_grads(replica, process_group)
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, expected[name], msg=name)
