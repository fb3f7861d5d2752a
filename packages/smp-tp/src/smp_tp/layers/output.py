"""DistributedTransformerOutputLayer: the MLP block (paper App. F, Figs. 12 and 14)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from smp_tp.group import ProcessGroup
from smp_tp.layers.config import TransformerConfig, build_config
from smp_tp.layers.region import ACTIVATIONS, RegionModule, affine, region_layer_norm
from smp_tp.layers.sequence import check_sequence_parallel, gathered_linear
from smp_tp.mappings import bwd_allreduce_for_tp, fwd_allreduce_for_tp, reduce_scatter_for_tp
from smp_tp.params import (
    initialize_with_input_partition,
    initialize_with_output_partition,
    parameter_creation_scope,
)
from smp_tp.random import tp_dropout
from smp_tp.recompute import activation_linear, memory_dropout


class DistributedTransformerOutputLayer(RegionModule):
    """``dense_h_to_4h → activation → dense_4h_to_h → dropout``, residual, layer norm.

    Full parameter keys: ``dense_h_to_4h.weight (I, h)``, ``.bias (I)``,
    ``dense_4h_to_h.weight (h, I)``, ``.bias (h)``, ``pre_layernorm|post_layernorm.*``.

    ``recompute_activations`` (default True; ``optimize="memory"`` only): save the
    pre-activation instead of ``activation(pre)`` and redraw the dropout mask in backward.
    ``recompute_mlp_activation`` (default False; ``optimize="speed"``, either batch mode):
    the same for the speed layout's MLP — only the pre-activation is stored and the
    activation function (elementwise, no matmul) is rerun in backward; bit-for-bit the same
    results. The memory layout ignores it (``recompute_activations`` covers it there).
    ``sequence_parallel`` (``optimize="speed"``, scaled batch): see
    :class:`~smp_tp.DistributedAttentionLayer`.
    """

    dense_h_to_4h: Any
    dense_4h_to_h: Any
    pre_layernorm: Any
    post_layernorm: Any

    # the older call form: positional order, then keyword-only options (see build_config)
    _POSITIONAL: ClassVar[tuple[str, ...]] = (
        "hidden_size", "intermediate_size", "hidden_dropout_prob", "activation", "layernorm_epsilon",
        "initializer_range", "use_normal_initialization", "pre_layernorm", "post_layernorm")
    _KEYWORDS: ClassVar[tuple[str, ...]] = (
        "optimize", "recompute_activations", "recompute_mlp_activation", "sequence_parallel")

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
        """``DistributedTransformerOutputLayer(config, tp_group=..., ...)`` with a
        :class:`~smp_tp.TransformerConfig`, or the older form with the config's fields as
        arguments (positional order: ``hidden_size, intermediate_size, hidden_dropout_prob,
        activation, layernorm_epsilon, initializer_range, use_normal_initialization,
        pre_layernorm, post_layernorm``; keyword-only: ``optimize, recompute_activations,
        recompute_mlp_activation, sequence_parallel``)."""
        c = build_config(type(self).__name__, self._POSITIONAL, self._KEYWORDS, args, kwargs, config)
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=c.optimize)
        self.config = c
        self.recompute_activations = bool(c.recompute_activations)
        self.recompute_mlp_activation = bool(c.recompute_mlp_activation)
        self.sequence_parallel = check_sequence_parallel(self, c.sequence_parallel)
        hidden_size, intermediate_size, activation = c.hidden_size, c.intermediate_size, c.activation
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"DistributedTransformerOutputLayer: activation {activation!r} not in {sorted(ACTIVATIONS)}"
            )
        self._require_divisible(intermediate_size=intermediate_size)
        if self.optimize == "memory":
            self._require_divisible(hidden_size=hidden_size)
        T, h, inter = self.tp_size, hidden_size, intermediate_size
        self.hidden_size, self.intermediate_size, self.activation = h, inter, activation
        self.hidden_dropout_prob, self.eps = c.hidden_dropout_prob, c.layernorm_epsilon
        self.pre_ln, self.post_ln = c.pre_layernorm, c.post_layernorm
        kw: dict[str, Any] = {"device": device}
        speed = self.optimize == "speed"
        with parameter_creation_scope(  # sequence parallel: norms and biases see own samples
            self, scaled_batch=not self.sequence_parallel, dtype=dtype, use_normal=c.use_normal_initialization,
            initializer_range=c.initializer_range,
        ):
            if speed:
                with initialize_with_output_partition(self):
                    self.dense_h_to_4h = affine(torch.empty(inter // T, h, **kw), torch.zeros(inter // T, **kw))
                with initialize_with_input_partition(self):
                    self.dense_4h_to_h = affine(torch.empty(h, inter // T, **kw), None)
                self.dense_4h_to_h.bias = torch.nn.Parameter(torch.zeros(h, **kw))
                ln_size = h
            else:
                with initialize_with_input_partition(self):
                    self.dense_h_to_4h = affine(torch.empty(inter, h // T, **kw), None)
                    self.dense_4h_to_h = affine(torch.empty(h, inter // T, **kw), None)
                with initialize_with_output_partition(self):
                    self.dense_h_to_4h.bias = torch.nn.Parameter(torch.zeros(inter // T, **kw))
                    self.dense_4h_to_h.bias = torch.nn.Parameter(torch.zeros(h // T, **kw))
                ln_size = h // T
            with nullcontext() if speed else initialize_with_output_partition(self):
                if c.pre_layernorm:
                    self.pre_layernorm = affine(torch.ones(ln_size, **kw), torch.zeros(ln_size, **kw))
                if c.post_layernorm:
                    self.post_layernorm = affine(torch.ones(ln_size, **kw), torch.zeros(ln_size, **kw))

    def forward_region(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cross: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        g = self.tp_group
        a = region_layer_norm(x, self.pre_layernorm, self.eps, self.hidden_size, self) if self.pre_ln else x
        act = ACTIVATIONS[self.activation]
        if self.optimize == "speed":
            if self.sequence_parallel:
                pre = gathered_linear(a, self.dense_h_to_4h.weight, self.dense_h_to_4h.bias, g)
            else:
                pre = F.linear(bwd_allreduce_for_tp(a, g), self.dense_h_to_4h.weight, self.dense_h_to_4h.bias)
            if self.recompute_mlp_activation and torch.is_grad_enabled():  # keep pre, not act(pre)
                part = activation_linear(pre, self.dense_4h_to_h.weight, act)
            else:
                part = F.linear(act(pre), self.dense_4h_to_h.weight)
            if self.sequence_parallel:
                o = reduce_scatter_for_tp(part, 0, g) + self.dense_4h_to_h.bias
                o = tp_dropout(o, self.hidden_dropout_prob, self.training, "tp_rank", g)
            else:
                o = fwd_allreduce_for_tp(part, g) + self.dense_4h_to_h.bias
                o = tp_dropout(o, self.hidden_dropout_prob, self.training, "tp_shared", g)
        else:
            pre = reduce_scatter_for_tp(F.linear(a, self.dense_h_to_4h.weight), -1, g) + self.dense_h_to_4h.bias
            if self.recompute_activations and torch.is_grad_enabled():  # keep pre, not act(pre)
                part = activation_linear(pre, self.dense_4h_to_h.weight, act)
            else:
                part = F.linear(act(pre), self.dense_4h_to_h.weight)
            o = reduce_scatter_for_tp(part, -1, g) + self.dense_4h_to_h.bias
            o = memory_dropout(o, self.hidden_dropout_prob, self.training, self.recompute_activations, g)
        out = x + o
        if self.post_ln:
            out = region_layer_norm(out, self.post_layernorm, self.eps, self.hidden_size, self)
        return out
