"""DistributedTransformerLayer, DistributedTransformer and DistributedTransformerLMHead."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_tp.group import ProcessGroup
from smp_tp.layers.attention import DistributedAttentionLayer
from smp_tp.layers.embedding import DistributedEmbedding
from smp_tp.layers.layernorm import DistributedLayerNorm
from smp_tp.layers.linear import input_split_linear
from smp_tp.layers.output import DistributedTransformerOutputLayer
from smp_tp.layers.region import RegionModule
from smp_tp.layers.sequence import check_sequence_parallel
from smp_tp.module import DistributedModule


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

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        *,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
        optimize: str | None = None,
        recompute_activations: bool = True,
        recompute_attention: bool = False,
        recompute_mlp_activation: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=optimize)
        self.recompute_activations = bool(recompute_activations)
        self.sequence_parallel = check_sequence_parallel(self, sequence_parallel)
        mode: dict[str, Any] = {"tp_group": self.tp_group, "prescaled_batch": self.prescaled_batch,
                "optimize": self.optimize, "recompute_activations": self.recompute_activations,
                "sequence_parallel": self.sequence_parallel, "dtype": dtype, "device": device}
        attn: dict[str, Any] = {"num_attention_heads": num_attention_heads, "attention_head_size": attention_head_size,
                "hidden_size": hidden_size, "attention_dropout_prob": attention_dropout_prob,
                "hidden_dropout_prob": hidden_dropout_prob, "layernorm_epsilon": layernorm_epsilon,
                "initializer_range": initializer_range,
                "use_normal_initialization": use_normal_initialization,
                "pre_layernorm": pre_layernorm, "post_layernorm": post_layernorm}
        self.recompute_attention = bool(recompute_attention)
        attn["recompute_attention"] = self.recompute_attention
        self.attention = DistributedAttentionLayer(**attn, causal_mask_size=causal_mask_size, **mode)
        self.add_cross_attention = add_cross_attention
        if add_cross_attention:
            self.crossattention = DistributedAttentionLayer(**attn, cross_attention=True, **mode)
        self.recompute_mlp_activation = bool(recompute_mlp_activation)
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, activation, layernorm_epsilon,
            initializer_range, use_normal_initialization, pre_layernorm, post_layernorm,
            recompute_mlp_activation=self.recompute_mlp_activation, **mode,
        )

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

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        *,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
        optimize: str | None = None,
        recompute_activations: bool = True,
        recompute_attention: bool = False,
        recompute_mlp_activation: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=optimize)
        self.recompute_activations = bool(recompute_activations)
        self.sequence_parallel = check_sequence_parallel(self, sequence_parallel)
        self.num_layers = num_layers
        self.layers = nn.ModuleList(
            DistributedTransformerLayer(
                num_attention_heads, attention_head_size, hidden_size, intermediate_size,
                attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon,
                initializer_range, use_normal_initialization, causal_mask_size,
                add_cross_attention, pre_layernorm, post_layernorm,
                tp_group=self.tp_group, prescaled_batch=self.prescaled_batch,
                optimize=self.optimize, recompute_activations=self.recompute_activations,
                recompute_attention=recompute_attention, recompute_mlp_activation=recompute_mlp_activation,
                sequence_parallel=self.sequence_parallel,
                dtype=dtype, device=device,
            )
            for _ in range(num_layers)
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

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        vocab_size: int = 30522,
        num_positions: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        num_token_types: int = 0,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        add_lm_head: bool = True,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        *,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
        optimize: str | None = None,
        recompute_activations: bool = True,
        recompute_attention: bool = False,
        recompute_mlp_activation: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=optimize)
        self.recompute_activations = bool(recompute_activations)
        mode: dict[str, Any] = {"tp_group": self.tp_group, "prescaled_batch": self.prescaled_batch,
                "dtype": dtype, "device": device}
        self.hidden_dropout_prob, self.add_lm_head = hidden_dropout_prob, add_lm_head
        self.pre_ln, self.post_ln = pre_layernorm, post_layernorm
        self.word_embedding = DistributedEmbedding(
            vocab_size, hidden_size, initializer_range=initializer_range, **mode)
        self.position_embedding = DistributedEmbedding(
            num_positions, hidden_size, initializer_range=initializer_range, **mode)
        if num_token_types > 0:
            self.token_type_embedding = DistributedEmbedding(
                num_token_types, hidden_size, initializer_range=initializer_range, **mode)
        if post_layernorm and not pre_layernorm:
            self.embedding_layernorm = DistributedLayerNorm(hidden_size, layernorm_epsilon, **mode)
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size, intermediate_size,
            attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon,
            initializer_range, use_normal_initialization, causal_mask_size, add_cross_attention,
            pre_layernorm, post_layernorm, optimize=self.optimize,
            recompute_activations=self.recompute_activations, recompute_attention=recompute_attention,
            recompute_mlp_activation=recompute_mlp_activation, sequence_parallel=sequence_parallel, **mode,
        )
        if pre_layernorm:
            self.layernorm = DistributedLayerNorm(hidden_size, layernorm_epsilon, **mode)

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
