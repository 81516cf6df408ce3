"""The models of torch's DTensor and tensor-parallel tests (``common_dtensor``'s), with torch's
module names, parameter names, creation order and numerics, so a test that compares a
parallelized copy with the original (or checks ``"layers.0.attention.wv.weight"``) sees what it
sees under torch's harness.

- :class:`MLPModule` / :class:`MLPStacked`: ``net1`` (10 -> 16), ReLU, ``net2`` (16 -> 10),
  seeded with 5 at construction, as torch's are.
- :class:`RMSNormPython`: RMS normalization written with plain tensor ops (a module that
  ``SequenceParallel`` shards without a fused kernel).
- :class:`Transformer` (:class:`ModelArgs`, :class:`TransformerBlock`, :class:`Attention`,
  :class:`FeedForward`): a small decoder with optional weight tying, activation checkpointing
  and mixture-of-experts layers, and ``Transformer.parallelize``, torch's tensor-parallel plan
  for it (with sequence parallelism, local attention outputs and expert parallelism as
  options).

These import DTensor's tensor-parallel API, so they are not re-exported by
``fsdp_testing.models`` (whose FSDP models stay cheap to import); use them from here or from
``fsdp_testing.common_dtensor``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .experts import (
    ExpertLayer,
    ExpertParallel,
    ExpertParallelWithTP,
    TensorParallelForExpert,
)

__all__ = [
    "Attention",
    "FeedForward",
    "MLPModule",
    "MLPStacked",
    "ModelArgs",
    "RMSNormPython",
    "Transformer",
    "TransformerBlock",
]


class RMSNormPython(nn.Module):
    """RMS normalization over the last dimension, in plain tensor ops.

    Args:
        dim: size of the last dimension (the ``weight``'s length).
        eps: added to the mean square before the inverse square root (default 1e-6).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) * self.weight


class MLPModule(nn.Module):
    """``net1`` (Linear 10 -> 16), ReLU, ``net2`` (Linear 16 -> 10). Construction reseeds torch's
    generator with 5 first, so two instances start equal, as torch's do.

    Args:
        device: where the parameters are made.
        bias: give both linears a bias (default True).
    """

    def __init__(self, device: Any, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.net1 = nn.Linear(10, 16, bias=bias, device=device)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))

    def reset_parameters(self) -> None:
        """Re-initialize both linears (after ``to_empty``, say)."""
        self.net1.reset_parameters()
        self.net2.reset_parameters()


class MLPStacked(nn.Module):
    """``layers``: ``n_layers`` :class:`MLPModule` applied in turn.

    Args:
        device: where the parameters are made.
        n_layers: how many (default 2).
    """

    def __init__(self, device: Any, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPModule(device) for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclasses.dataclass
class ModelArgs:
    """The size and options of :class:`Transformer` (torch's field names and defaults).

    Args:
        n_layers: transformer blocks (default 2).
        vocab_size: token vocabulary (default 8).
        max_seq_len: longest input sequence (default 16).
        dim: model width (default 16).
        n_heads: attention heads; must divide ``dim`` (default 4).
        dropout_p: dropout probability (default 0.1).
        use_attn_mask: causal attention (default True).
        weight_tying: the output projection shares the token embedding (default True).
        checkpoint_activations: recompute each block in backward (default False).
        num_experts: experts per block's feed-forward; 0 for a plain feed-forward (default 0).
    """

    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1
    use_attn_mask: bool = True
    weight_tying: bool = True
    checkpoint_activations: bool = False
    num_experts: int = 0


class Attention(nn.Module):
    """Multi-head self-attention: ``wq``, ``wk``, ``wv``, ``wo`` (no bias) around
    ``scaled_dot_product_attention``. ``n_heads`` is read at every forward, so a
    tensor-parallel plan with local outputs can set it to the heads of one rank.

    Args:
        args: the model's :class:`ModelArgs`.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads != 0:
            raise ValueError(
                f"Attention: ModelArgs.dim={args.dim} is not a multiple of "
                f"n_heads={args.n_heads}; pick n_heads that divides dim"
            )
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.use_attn_mask = args.use_attn_mask
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def _heads(self, x: torch.Tensor, bsz: int, seq_len: int) -> torch.Tensor:
        # (bsz, seq_len, dim) -> (bsz, n_heads, seq_len, head_dim)
        return x.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.size()
        queries = self._heads(self.wq(x), bsz, seq_len)
        keys = self._heads(self.wk(x), bsz, seq_len)
        values = self._heads(self.wv(x), bsz, seq_len)
        attended = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            None,
            self.dropout_p if self.training else 0,
            self.use_attn_mask,
        )
        merged = attended.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(merged))


class FeedForward(nn.Module):
    """``w1``, GELU, ``w2`` and dropout.

    Args:
        dim: input and output width.
        hidden_dim: inner width.
        dropout_p: dropout probability.
    """

    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``attention_norm``, ``attention``, ``ffn_norm``, then ``feed_forward``
    (or ``expert_layer`` when ``args.num_experts > 0``), each with a residual connection.

    Args:
        args: the model's :class:`ModelArgs`.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.has_experts = args.num_experts > 0
        if self.has_experts:
            self.expert_layer = ExpertLayer(args.num_experts, dim=args.dim, hidden_dim=4 * args.dim)
        else:
            self.feed_forward = FeedForward(
                args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        mlp = self.expert_layer if self.has_experts else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """A small decoder (in the spirit of nanoGPT): token and position embeddings, dropout,
    ``layers`` of :class:`TransformerBlock`, a final ``norm`` and the ``output`` projection,
    whose weight is the token embedding's when ``args.weight_tying``. The logits come back in
    float32.

    Args:
        args: its :class:`ModelArgs`.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.vocab_size is None or args.max_seq_len is None:
            raise ValueError(
                f"Transformer: ModelArgs.vocab_size and max_seq_len must be set, got "
                f"vocab_size={args.vocab_size}, max_seq_len={args.max_seq_len}"
            )
        self.model_args = args
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.checkpoint_activations = args.checkpoint_activations

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, seq_len = tokens.size()
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"Transformer: a sequence of {seq_len} tokens is longer than max_seq_len="
                f"{self.max_seq_len}; raise ModelArgs.max_seq_len or shorten the input"
            )
        positions = torch.arange(0, seq_len, device=tokens.device)
        h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for layer in self.layers:
            if self.checkpoint_activations:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h)).float()

    @staticmethod
    def parallelize(
        module: Transformer,
        tp_mesh: Any,
        use_seq_parallel: bool,
        local_output_for_attn: bool = False,
        ep_mesh: Any = None,
    ) -> nn.Module:
        """Apply torch's tensor-parallel plan to ``module`` in place and return it.

        Embeddings are row-wise, the attention projections column-wise in and row-wise out,
        the feed-forward column- then row-wise, and the output column-wise with a replicated
        result; with sequence parallelism the norms are ``SequenceParallel`` and activations
        between blocks stay sharded on the sequence dimension. Expert layers are
        tensor-parallel (:class:`~.experts.TensorParallelForExpert`) on ``tp_mesh`` alone,
        expert-parallel on ``ep_mesh`` alone, or both. A tied output weight is tied again
        after the plan, so parameters and gradients stay shared.

        Args:
            module: a :class:`Transformer`.
            tp_mesh: the tensor-parallel 1-D mesh, or None for expert parallelism only.
            use_seq_parallel: keep activations sharded on the sequence dimension.
            local_output_for_attn: the attention projections return local tensors, and each
                attention module's ``n_heads`` becomes the heads of one rank (default False).
            ep_mesh: the expert-parallel 1-D mesh (default None).
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        if not isinstance(module, Transformer):
            raise TypeError(
                f"Transformer.parallelize needs a Transformer, got {type(module).__name__}"
            )
        if tp_mesh is None and ep_mesh is None:
            raise ValueError("At least one of tp_mesh or ep_mesh must be provided")

        if tp_mesh is not None:
            seq_out = (Shard(1), Shard(0)) if use_seq_parallel else (Replicate(), Replicate())
            root_plan: dict[str, Any] = {
                "tok_embeddings": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=seq_out[0]
                ),
                "pos_embeddings": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=seq_out[1]
                ),
            }
            if use_seq_parallel:
                root_plan["norm"] = SequenceParallel()
            parallelize_module(module, tp_mesh, root_plan)

        for layer in module.layers:
            layer = cast(TransformerBlock, layer)
            if tp_mesh is not None:
                plan: dict[str, Any] = {}
                if use_seq_parallel:
                    plan["attention"] = PrepareModuleInput(
                        input_layouts=Shard(1), desired_input_layouts=Replicate()
                    )
                    plan["attention_norm"] = SequenceParallel()
                    plan["ffn_norm"] = SequenceParallel()
                for name in ("wq", "wk", "wv"):
                    plan[f"attention.{name}"] = ColwiseParallel(
                        use_local_output=local_output_for_attn
                    )
                plan["attention.wo"] = (
                    RowwiseParallel(output_layouts=Shard(1))
                    if use_seq_parallel
                    else RowwiseParallel()
                )
                if not layer.has_experts:
                    plan["feed_forward.w1"] = (
                        ColwiseParallel(input_layouts=Shard(1))
                        if use_seq_parallel
                        else ColwiseParallel()
                    )
                    plan["feed_forward.w2"] = (
                        RowwiseParallel(output_layouts=Shard(1))
                        if use_seq_parallel
                        else RowwiseParallel()
                    )
                elif ep_mesh is None:
                    plan["expert_layer.experts"] = (
                        TensorParallelForExpert(input_layouts=Shard(0), output_layouts=Shard(0))
                        if use_seq_parallel
                        else TensorParallelForExpert()
                    )
                parallelize_module(layer, tp_mesh, plan)
            if ep_mesh is not None and layer.has_experts:
                if tp_mesh is not None:
                    parallelize_module(
                        layer.expert_layer, ep_mesh, ExpertParallelWithTP(ep_mesh, tp_mesh)
                    )
                else:
                    parallelize_module(layer.expert_layer.experts, ep_mesh, ExpertParallel())

        if tp_mesh is not None:
            # A tied output weight costs an all-reduce here (row-wise would not): it must be
            # sharded as the token embedding is.
            parallelize_module(
                module.output,
                tp_mesh,
                ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
                if use_seq_parallel
                else ColwiseParallel(output_layouts=Replicate()),
            )
            if local_output_for_attn:
                for layer in module.layers:
                    cast(TransformerBlock, layer).attention.n_heads = (
                        module.model_args.n_heads // tp_mesh.size()
                    )
            if module.model_args.weight_tying:
                module.output.weight = module.tok_embeddings.weight
        return module
