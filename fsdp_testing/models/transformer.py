"""A tiny encoder-decoder transformer whose output projection shares the embedding weight."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..engines import current_engine, has_nested_units
from ._base import (
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTestModel,
    as_device_init_mode,
    as_fsdp_init_mode,
    finish_placement,
    group_rank_and_size,
    resolve_device,
)

__all__ = ["TransformerWithSharedParams"]

_HYBRID = {"HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"}


class TransformerWithSharedParams(FSDPTestModel):
    """``embed_tokens -> transformer (2 encoder + 2 decoder layers) -> output_proj`` with
    ``output_proj.weight`` tied to ``embed_tokens.weight``, a float and a long buffer, and an
    optional ``BatchNorm1d``. Sized for CPU tests (``d_model=16``, vocabulary 23) unless the
    size arguments say otherwise (``fsdp-testing plan --model transformer:d_model=2048,...``).

    Args:
        group: the process group (or a tuple of groups for hybrid sharding).
        device_init_mode: ``DEVICE_BEFORE`` moves the model to ``device`` on construction.
        add_bn: include ``BatchNorm1d`` on the target embeddings (else ``Identity``).
        deterministic: seed the initialization and switch to eval mode (no dropout).
        device: compute device, default CUDA if available else CPU.
        d_model: embedding width (default 16).
        nhead: attention heads, dividing ``d_model`` (default 2).
        num_encoder_layers: encoder layers (default 2).
        num_decoder_layers: decoder layers (default 2).
        dim_feedforward: hidden width of every layer's feed-forward block (default 8).
        d_vocab: vocabulary size (default 23).
    """

    d_vocab = 23
    d_model = 16
    batch_size = 2

    def __init__(
        self,
        group: Any,
        device_init_mode: DEVICEInitMode,
        add_bn: bool,
        deterministic: bool,
        *,
        device: torch.device | str | None = None,
        d_model: int = 16,
        nhead: int = 2,
        num_encoder_layers: int = 2,
        num_decoder_layers: int = 2,
        dim_feedforward: int = 8,
        d_vocab: int = 23,
    ) -> None:
        super().__init__()
        self.rank, self.world_size = group_rank_and_size(group)
        self.bs = self.batch_size
        self.d_model, self.d_vocab = d_model, d_vocab
        if deterministic:
            torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(self.d_vocab, self.d_model)
        with warnings.catch_warnings():
            # Sequence-first layout (as torch's model) disables the nested-tensor fast path.
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = nn.Transformer(
                d_model=self.d_model,
                nhead=nhead,
                num_encoder_layers=num_encoder_layers,
                num_decoder_layers=num_decoder_layers,
                dim_feedforward=dim_feedforward,
                dropout=0.1,
            )
        self.output_proj = nn.Linear(self.d_model, self.d_vocab)
        self.output_proj.weight = self.embed_tokens.weight  # tied: one parameter, two uses
        self.register_buffer("vocab_bias", torch.ones(self.d_model))
        self.register_buffer("long_buffer", torch.zeros(self.d_model, dtype=torch.long))
        self.bn: nn.Module = nn.BatchNorm1d(self.bs) if add_bn else nn.Identity()
        if as_device_init_mode(device_init_mode) is DEVICEInitMode.DEVICE_BEFORE:
            self.to(resolve_device(device))
        if deterministic:
            self.eval()

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        # Sequence-first token ids, the same on every rank: source 6 x B, target 4 x B.
        source = torch.arange(6 * self.bs, device=device).reshape(6, self.bs)
        target = torch.arange(4 * self.bs, device=device).reshape(4, self.bs)
        return (source, target)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        source = self.embed_tokens(src_ids)
        # Buffers in the activations' dtype: under parameter-only mixed precision the float32
        # ``vocab_bias`` would otherwise promote ``source`` to float32 ahead of bf16 layers.
        source = source + self.vocab_bias.to(source.dtype) + self.long_buffer.to(source.dtype)
        target = self.bn(self.embed_tokens(tgt_ids))
        hidden = self.transformer(source, target)
        return self.output_proj(hidden)

    def get_loss(self, input: Any, output: torch.Tensor) -> torch.Tensor:
        target = input[1]
        logits = output.reshape(-1, output.shape[-1])
        return F.cross_entropy(logits, target.reshape(-1), reduction="sum")

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def get_ignored_modules(self) -> list[nn.Module]:
        """The modules a test may pass as ``ignored_modules``: the transformer body."""
        return [self.transformer]

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DEVICEInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        add_bn: bool = True,
        *,
        device: torch.device | str | None = None,
        **sizes: int,
    ) -> nn.Module:
        """Builds the model; ``RECURSIVE`` shards the root with the active engine, each encoder
        and decoder layer a unit unless ``fsdp_kwargs`` names another ``auto_wrap_policy`` (the
        root alone for a root-only engine).

        Args:
            group: the process group, or a (shard, replicate) tuple for hybrid sharding.
            fsdp_init_mode: ``NO_FSDP`` or ``RECURSIVE``.
            device_init_mode: when to move to ``device``.
            fsdp_kwargs: engine options for the root, default none (not modified).
            deterministic: seed the initialization, eval mode (default False).
            add_bn: include batch norm (default True).
            device: compute device, default CUDA if available else CPU.
            sizes: ``d_model``, ``nhead``, ``num_encoder_layers``, ``num_decoder_layers``,
                ``dim_feedforward``, ``d_vocab`` (defaults: the class docstring's).
        """
        placement = as_device_init_mode(device_init_mode)
        model_group = group[0] if isinstance(group, tuple) else group
        model = TransformerWithSharedParams(
            model_group, placement, add_bn, deterministic, device=device, **sizes
        )
        if as_fsdp_init_mode(fsdp_init_mode) is FSDPInitMode.NO_FSDP:
            return model
        engine = current_engine()
        kwargs = dict(fsdp_kwargs or {})
        strategy = getattr(kwargs.get("sharding_strategy"), "name", None)
        # Hybrid sharding with a single group lets the engine build the 2D groups itself.
        wrap_group = None if strategy in _HYBRID and not isinstance(group, tuple) else group
        if not has_nested_units(engine):  # see [Note: root-only engines]
            kwargs.pop("auto_wrap_policy", None)
            sharded = engine.wrap(model, wrap_group, **kwargs)
            return finish_placement(sharded, placement, resolve_device(device), True)
        if _keeps_batch_norm_in_full_precision(engine, model, kwargs):
            model.bn = engine.wrap(model.bn, wrap_group, **{**kwargs, "mixed_precision": None})
        if kwargs.get("auto_wrap_policy") is None:
            layers = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
            kwargs["auto_wrap_policy"] = engine.module_wrap_policy(layers)
        sharded = engine.wrap(model, wrap_group, **kwargs)
        return finish_placement(sharded, placement, resolve_device(device), True)


def _keeps_batch_norm_in_full_precision(
    engine: Any, model: TransformerWithSharedParams, kwargs: Mapping[str, Any]
) -> bool:
    """Whether ``init`` must make the batch norm its own unit without mixed precision.

    Parameter mixed precision casts a batch norm's affine parameters but not its float32
    running statistics (buffers are cast only with ``buffer_dtype``), and ``batch_norm``
    rejects bf16 weights with float32 statistics. torch's FSDP1 therefore wraps batch norms
    separately with mixed precision off (``MixedPrecision._module_classes_to_ignore``); this
    does the same for the engines that do not (``engine.full_precision_classes``), so the model
    runs under every engine's mixed precision with the same numerics.
    """
    policy = kwargs.get("mixed_precision")
    return (
        getattr(policy, "param_dtype", None) is not None
        and getattr(policy, "buffer_dtype", None) is None
        and isinstance(model.bn, nn.modules.batchnorm._BatchNorm)
        and not isinstance(model.bn, engine.full_precision_classes(policy))
    )
