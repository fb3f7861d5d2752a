"""DistributedTransformerLayer, DistributedTransformer and DistributedTransformerLMHead."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from smp_tp.group import ProcessGroup
from smp_tp.layers.attention import DistributedAttentionLayer
from smp_tp.layers.config import TransformerConfig, build_config
from smp_tp.layers.embedding import DistributedEmbedding
from smp_tp.layers.layernorm import DistributedLayerNorm
from smp_tp.layers.linear import input_split_linear
from smp_tp.layers.output import DistributedTransformerOutputLayer
from smp_tp.layers.region import RegionModule
from smp_tp.layers.sequence import check_sequence_parallel
from smp_tp.module import DistributedModule

# keyword-only options every composite class accepted in the older call form
_MODE_KEYWORDS = ("optimize", "recompute_activations", "recompute_attention", "recompute_mlp_activation",
                  "sequence_parallel")


class DistributedTransformerLayer(RegionModule):
    """Attention (+ optional cross-attention) followed by the MLP output layer.

    Children: ``attention``, ``crossattention`` (when ``add_cross_attention``), ``output``.
    ``recompute_activations`` (default True) applies to ``optimize="memory"`` only,
    ``recompute_attention`` (default False: selective recomputation of the attention core)
    and ``recompute_mlp_activation`` (default False: the MLP's activation function) to
    ``optimize="speed"``: see :class:`~smp_tp.DistributedAttentionLayer` and
    :mod:`smp_tp.recompute`. ``sequence_parallel`` (speed layout, scaled batch): layer norms,
    residuals and dropout on this rank's samples; see :mod:`smp_tp.layers.sequence`.
    """

    # the older call form: positional order, then keyword-only options (see build_config)
    _POSITIONAL: ClassVar[tuple[str, ...]] = (
        "num_attention_heads", "attention_head_size", "hidden_size", "intermediate_size",
        "attention_dropout_prob", "hidden_dropout_prob", "activation", "layernorm_epsilon",
        "initializer_range", "use_normal_initialization", "causal_mask_size", "add_cross_attention",
        "pre_layernorm", "post_layernorm")
    _KEYWORDS: ClassVar[tuple[str, ...]] = _MODE_KEYWORDS

    def __init__(
        self,
        *args: Any,
        config: TransformerConfig | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        """``DistributedTransformerLayer(config, tp_group=..., ...)`` with a
        :class:`~smp_tp.TransformerConfig`, or the older form with the config's fields as
        arguments (positional order: ``num_attention_heads, attention_head_size,
        hidden_size, intermediate_size, attention_dropout_prob, hidden_dropout_prob,
        activation, layernorm_epsilon, initializer_range, use_normal_initialization,
        causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm``; keyword-only:
        ``optimize, recompute_activations, recompute_attention, recompute_mlp_activation,
        sequence_parallel``)."""
        c = build_config(type(self).__name__, self._POSITIONAL, self._KEYWORDS, args, kwargs, config)
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=c.optimize)
        self.config = c
        self.recompute_activations = bool(c.recompute_activations)
        self.recompute_attention = bool(c.recompute_attention)
        self.recompute_mlp_activation = bool(c.recompute_mlp_activation)
        self.sequence_parallel = check_sequence_parallel(self, c.sequence_parallel)
        # children get the settings as resolved here, so a layer and its parts never differ
        # when the tp_config default changes between them
        child = replace(c, optimize=self.optimize, sequence_parallel=self.sequence_parallel)
        place: dict[str, Any] = {"tp_group": self.tp_group, "prescaled_batch": self.prescaled_batch,
                                 "dtype": dtype, "device": device}
        self.attention = DistributedAttentionLayer(replace(child, cross_attention=False), **place)
        self.add_cross_attention = c.add_cross_attention
        if c.add_cross_attention:
            # keys and values from the encoder: never causal
            self.crossattention = DistributedAttentionLayer(
                replace(child, cross_attention=True, causal_mask_size=None), **place)
        self.output = DistributedTransformerOutputLayer(child, **place)

    def forward_region(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cross: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.attention.forward_region(x, mask)
        if self.add_cross_attention and cross is not None:
            x = self.crossattention.forward_region(x, None, cross, cross_mask)
        return self.output.forward_region(x)


class DistributedTransformer(RegionModule):
    """A stack of ``num_layers`` :class:`DistributedTransformerLayer` (child ``layers``).

    The stack enters and leaves the tensor-parallel region once, so a layer inside costs
    exactly the Appendix F collectives.
    """

    _POSITIONAL: ClassVar[tuple[str, ...]] = ("num_layers", *DistributedTransformerLayer._POSITIONAL)
    _KEYWORDS: ClassVar[tuple[str, ...]] = _MODE_KEYWORDS

    def __init__(
        self,
        *args: Any,
        config: TransformerConfig | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        """``DistributedTransformer(config, tp_group=..., ...)`` with a
        :class:`~smp_tp.TransformerConfig`, or the older form: ``num_layers`` followed by
        :class:`DistributedTransformerLayer`'s arguments."""
        c = build_config(type(self).__name__, self._POSITIONAL, self._KEYWORDS, args, kwargs, config)
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=c.optimize)
        self.config = c
        self.recompute_activations = bool(c.recompute_activations)
        self.sequence_parallel = check_sequence_parallel(self, c.sequence_parallel)
        self.num_layers = c.num_layers
        child = replace(c, optimize=self.optimize, sequence_parallel=self.sequence_parallel)
        self.layers = nn.ModuleList(
            DistributedTransformerLayer(child, tp_group=self.tp_group, prescaled_batch=self.prescaled_batch,
                                        dtype=dtype, device=device)
            for _ in range(c.num_layers)
        )

    def forward_region(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cross: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for layer in self.layers:
            assert isinstance(layer, DistributedTransformerLayer)
            x = layer.forward_region(x, mask, cross, cross_mask)
        return x


class DistributedTransformerLMHead(DistributedModule):
    """A whole GPT/BERT-style language model: embeddings, transformer, tied LM head.

    ``word_embedding`` (and ``position_embedding``, ``token_type_embedding`` when
    ``num_token_types > 0``) are :class:`DistributedEmbedding`; ``post_layernorm`` models
    (BERT) normalise the embeddings (``embedding_layernorm``), ``pre_layernorm`` models (GPT)
    normalise the transformer output (``layernorm``). With ``add_lm_head`` the logits are
    ``hidden @ word_embedding.weight.T``, computed as an input-split linear on the same
    embedding shards (the vocabulary is never split, so any vocabulary size works).
    """

    _POSITIONAL: ClassVar[tuple[str, ...]] = (
        "num_layers", "num_attention_heads", "attention_head_size", "hidden_size", "intermediate_size",
        "vocab_size", "num_positions", "attention_dropout_prob", "hidden_dropout_prob", "activation",
        "layernorm_epsilon", "num_token_types", "causal_mask_size", "add_cross_attention",
        "add_lm_head", "initializer_range", "use_normal_initialization", "pre_layernorm",
        "post_layernorm")
    _KEYWORDS: ClassVar[tuple[str, ...]] = _MODE_KEYWORDS

    def __init__(
        self,
        *args: Any,
        config: TransformerConfig | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        """``DistributedTransformerLMHead(config, tp_group=..., ...)`` with a
        :class:`~smp_tp.TransformerConfig`, or the older form with the config's fields as
        arguments (positional order: ``num_layers, num_attention_heads,
        attention_head_size, hidden_size, intermediate_size, vocab_size, num_positions,
        attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon,
        num_token_types, causal_mask_size, add_cross_attention, add_lm_head,
        initializer_range, use_normal_initialization, pre_layernorm, post_layernorm``;
        keyword-only as :class:`DistributedTransformerLayer`)."""
        c = build_config(type(self).__name__, self._POSITIONAL, self._KEYWORDS, args, kwargs, config)
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=c.optimize)
        self.config = c
        self.recompute_activations = bool(c.recompute_activations)
        place: dict[str, Any] = {"tp_group": self.tp_group, "prescaled_batch": self.prescaled_batch,
                                 "dtype": dtype, "device": device}
        self.hidden_dropout_prob, self.add_lm_head = c.hidden_dropout_prob, c.add_lm_head
        self.pre_ln, self.post_ln = c.pre_layernorm, c.post_layernorm
        h, init = c.hidden_size, c.initializer_range
        self.word_embedding = DistributedEmbedding(c.vocab_size, h, initializer_range=init, **place)
        self.position_embedding = DistributedEmbedding(c.num_positions, h, initializer_range=init, **place)
        if c.num_token_types > 0:
            self.token_type_embedding = DistributedEmbedding(
                c.num_token_types, h, initializer_range=init, **place)
        if c.post_layernorm and not c.pre_layernorm:
            self.embedding_layernorm = DistributedLayerNorm(h, c.layernorm_epsilon, **place)
        self.transformer = DistributedTransformer(
            replace(c, optimize=self.optimize, recompute_activations=self.recompute_activations), **place)
        if c.pre_layernorm:
            self.layernorm = DistributedLayerNorm(h, c.layernorm_epsilon, **place)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cross_states: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids (batch, seq)`` → logits ``(batch, seq, vocab)`` (or hidden states)."""
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        x = self.word_embedding(input_ids) + self.position_embedding(position_ids)
        if hasattr(self, "token_type_embedding"):
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.token_type_embedding(token_type_ids)
        if hasattr(self, "embedding_layernorm"):
            x = self.embedding_layernorm(x)
        x = F.dropout(x, self.hidden_dropout_prob, self.training)  # per-sample region: DP stream
        x = self.transformer(x, attention_mask, cross_states, cross_mask)
        if hasattr(self, "layernorm"):
            x = self.layernorm(x)
        if not self.add_lm_head:
            return x
        return input_split_linear(x, self.word_embedding.weight, self)
