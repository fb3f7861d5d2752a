"""DistributedAttentionLayer (paper App. F, Figs. 11 and 13)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from smp_tp.group import ProcessGroup
from smp_tp.layers.config import TransformerConfig, build_config
from smp_tp.layers.context import context_parallel_attention
from smp_tp.layers.region import RegionModule, affine, region_layer_norm
from smp_tp.layers.sequence import check_sequence_parallel, gathered_linear
from smp_tp.mappings import bwd_allreduce_for_tp, fwd_allreduce_for_tp, reduce_scatter_for_tp
from smp_tp.params import (
    initialize_with_input_partition,
    initialize_with_output_partition,
    parameter_creation_scope,
)
from smp_tp.random import MaskTape, get_generator, tp_dropout
from smp_tp.recompute import memory_dropout, recomputed_linear


def _rank_major(w: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """Reorder the rows of ``[W_q; W_k; W_v]`` (``parts`` blocks) so that a reduce-scatter of
    the output channels leaves rank j with *its* heads of every block."""
    rows = w.shape[0] // parts
    return w.reshape(parts, tp, rows // tp, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


class DistributedAttentionLayer(RegionModule):
    """Multi-head attention block with residual and layer norm, heads split over TP ranks.

    ``post_layernorm`` (BERT): ``LN(x + drop(attn(x)))``; ``pre_layernorm`` (GPT-2):
    ``x + drop(attn(LN(x)))``. ``causal_mask_size`` not None makes self-attention causal.
    ``cross_attention=True`` takes keys and values from ``cross_states``.

    Full (unsharded) parameter keys: ``query|key|value.weight (A, h)``, ``.bias (A)``,
    ``dense.weight (h, A)``, ``dense.bias (h)``, ``pre_layernorm|post_layernorm.weight|bias``
    with ``A = num_attention_heads * attention_head_size``.

    ``recompute_activations`` (default True; ``optimize="memory"`` only): keep only q, k, v
    and the dropout generator state of the attention core and recompute scores, softmax,
    dropout and the context in backward (local to this rank's heads: no collective), and
    redraw the hidden-dropout mask instead of storing it. Results are identical either way;
    see :mod:`smp_tp.recompute`.

    ``recompute_attention`` (default False; ``optimize="speed"``): selective recomputation of
    the attention core only — scores, softmax, attention dropout and the context are
    recomputed in backward from the saved q, k, v (no ``(batch, heads, seq, seq)`` tensor is
    stored); bit-for-bit the same results, one more run of the core in backward.

    ``sequence_parallel`` (default False; ``optimize="speed"``, scaled batch): layer norm,
    residual and hidden dropout on this rank's own samples, q/k/v input gathered by sample
    (stored per rank), output reduce-scattered by sample; see :mod:`smp_tp.layers.sequence`.

    ``context_group`` (attribute, default None): a process group over which the *sequence* is
    split (context parallelism, as :func:`~smp_tp.split_sequence` cuts it, balanced layout):
    the attention core then runs as ring attention
    (:func:`~smp_tp.context_parallel_attention`) over this rank's heads. Self-attention only,
    without a mask or attention dropout (``ValueError`` otherwise).
    """

    #: Context parallelism: the group the sequence is split over (None: not split).
    context_group: Any = None

    # parameter containers (plain nn.Module holding weight/bias)
    query: Any
    key: Any
    value: Any
    dense: Any
    pre_layernorm: Any
    post_layernorm: Any

    # the older call form: positional order, then keyword-only options (see build_config)
    _POSITIONAL: ClassVar[tuple[str, ...]] = (
        "num_attention_heads", "attention_head_size", "hidden_size", "attention_dropout_prob",
        "hidden_dropout_prob", "layernorm_epsilon", "initializer_range", "use_normal_initialization",
        "cross_attention", "causal_mask_size", "pre_layernorm", "post_layernorm")
    _KEYWORDS: ClassVar[tuple[str, ...]] = (
        "optimize", "recompute_activations", "recompute_attention", "sequence_parallel")

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
        """``DistributedAttentionLayer(config, tp_group=..., ...)`` with a
        :class:`~smp_tp.TransformerConfig`, or the older form with the config's fields as
        arguments (positional order: ``num_attention_heads, attention_head_size,
        hidden_size, attention_dropout_prob, hidden_dropout_prob, layernorm_epsilon,
        initializer_range, use_normal_initialization, cross_attention, causal_mask_size,
        pre_layernorm, post_layernorm``; keyword-only: ``optimize, recompute_activations,
        recompute_attention, sequence_parallel``)."""
        c = build_config(type(self).__name__, self._POSITIONAL, self._KEYWORDS, args, kwargs, config)
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=c.optimize)
        self.config = c
        self.recompute_activations = bool(c.recompute_activations)
        self.recompute_attention = bool(c.recompute_attention)
        self.sequence_parallel = check_sequence_parallel(self, c.sequence_parallel)
        num_attention_heads, attention_head_size, hidden_size = (
            c.num_attention_heads, c.attention_head_size, c.hidden_size)
        self._require_divisible(num_attention_heads=num_attention_heads)
        if self.optimize == "memory":
            self._require_divisible(hidden_size=hidden_size)
        T, h = self.tp_size, hidden_size
        A = num_attention_heads * attention_head_size
        self.num_attention_heads, self.attention_head_size, self.hidden_size = (
            num_attention_heads, attention_head_size, hidden_size)
        self.local_heads = num_attention_heads // T
        self.attention_dropout_prob, self.hidden_dropout_prob = c.attention_dropout_prob, c.hidden_dropout_prob
        self.eps = c.layernorm_epsilon
        self.cross_attention = c.cross_attention
        self.causal = c.causal_mask_size is not None and not c.cross_attention
        self.causal_mask_size = c.causal_mask_size
        self.pre_ln, self.post_ln = c.pre_layernorm, c.post_layernorm
        kw: dict[str, Any] = {"device": device}
        speed = self.optimize == "speed"
        with parameter_creation_scope(  # sequence parallel: norms and biases see own samples
            self, scaled_batch=not self.sequence_parallel, dtype=dtype, use_normal=c.use_normal_initialization,
            initializer_range=c.initializer_range,
        ):
            if speed:  # column-parallel q/k/v (heads), row-parallel dense (Megatron)
                with initialize_with_output_partition(self):
                    for name in ("query", "key", "value"):
                        setattr(self, name, affine(torch.empty(A // T, h, **kw), torch.zeros(A // T, **kw)))
                with initialize_with_input_partition(self):
                    self.dense = affine(torch.empty(h, A // T, **kw), None)
                self.dense.bias = torch.nn.Parameter(torch.zeros(h, **kw))
                ln_size = h
            else:  # every linear split over its input channels, outputs reduce-scattered
                with initialize_with_input_partition(self):
                    for name in ("query", "key", "value"):
                        setattr(self, name, affine(torch.empty(A, h // T, **kw), None))
                    self.dense = affine(torch.empty(h, A // T, **kw), None)
                with initialize_with_output_partition(self):
                    for name in ("query", "key", "value"):
                        getattr(self, name).bias = torch.nn.Parameter(torch.zeros(A // T, **kw))
                    self.dense.bias = torch.nn.Parameter(torch.zeros(h // T, **kw))
                ln_size = h // T
            # speed: replicated layer norms (scope default); memory: sharded
            with nullcontext() if speed else initialize_with_output_partition(self):
                if c.pre_layernorm:
                    self.pre_layernorm = affine(torch.ones(ln_size, **kw), torch.zeros(ln_size, **kw))
                if c.post_layernorm:
                    self.post_layernorm = affine(torch.ones(ln_size, **kw), torch.zeros(ln_size, **kw))

    def _core_and_gen(self, device: torch.device) -> tuple[Any, torch.Generator | None]:
        p = self.attention_dropout_prob if self.training else 0.0
        # local heads exist on this rank only: per-rank stream
        gen = get_generator(device, "tp_rank", self.tp_group) if 0.0 < p < 1.0 else None
        return partial(self._core, p), gen

    def _attend_project(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's partial output projection of the attention context (before combining)."""
        if self.context_group is not None:
            return F.linear(self._ring_core(q, k, v, mask), self.dense.weight)
        core, gen = self._core_and_gen(q.device)
        if self._recompute_active() and torch.is_grad_enabled():
            return recomputed_linear(core, gen, self.dense.weight, q, k, v, mask)
        return F.linear(core(gen, q, k, v, mask), self.dense.weight)

    def _ring_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """The attention core over a sequence split across ``context_group`` (ring attention:
        no score matrix is kept, so recomputation has nothing to add)."""
        p = self.attention_dropout_prob if self.training else 0.0
        if self.cross_attention or mask is not None or p > 0.0:
            raise ValueError(
                "DistributedAttentionLayer with a context_group (context parallelism) supports "
                "self-attention without a mask or attention dropout; got "
                f"cross_attention={self.cross_attention}, mask={'given' if mask is not None else None}, "
                f"attention dropout {p}"
            )
        B, sq, _ = q.shape
        H, d = self.local_heads, self.attention_head_size

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(B, sq, H, d).transpose(1, 2)

        out = context_parallel_attention(heads(q), heads(k), heads(v), self.context_group,
                                         causal=self.causal, scale=1.0 / math.sqrt(d))
        return out.transpose(1, 2).reshape(B, sq, H * d)

    def _recompute_active(self) -> bool:
        if self.optimize == "memory":
            return self.recompute_activations
        return self.recompute_attention

    def _core(
        self, p: float, gen: torch.Generator | MaskTape | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Scores, softmax, dropout and ``probs @ v`` over this rank's heads (no collective)."""
        B, sq, _ = q.shape
        sk = k.shape[1]
        H, d = self.local_heads, self.attention_head_size
        q = q.reshape(B, sq, H, d).transpose(1, 2)
        k = k.reshape(B, sk, H, d).transpose(1, 2)
        v = v.reshape(B, sk, H, d).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        neg = torch.finfo(scores.dtype).min
        if mask is not None:
            if mask.shape[1] not in (1, H):  # a per-head mask over all heads: keep ours
                mask = mask.narrow(1, self.tp_rank * H, H)
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, neg)
            else:
                scores = scores + mask.to(scores.dtype)
        if self.causal:
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            scores = scores.masked_fill(~keep, neg)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        probs = tp_dropout(probs, p, p > 0.0, "tp_rank", self.tp_group, generator=gen)
        return torch.matmul(probs, v).transpose(1, 2).reshape(B, sq, H * d)

    def _projections(self, a: torch.Tensor, kv_src: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        g, T = self.tp_group, self.tp_size
        names = ("query", "key", "value")
        ws = [getattr(self, n).weight for n in names]
        bs = torch.cat([getattr(self, n).bias for n in names])
        if self.sequence_parallel:
            if kv_src is None:
                return gathered_linear(a, ws, bs, g).chunk(3, dim=-1)
            q = gathered_linear(a, ws[0], self.query.bias, g)
            kv = gathered_linear(kv_src, ws[1:], bs[bs.shape[0] // 3:], g)
            return (q, *kv.chunk(2, dim=-1))
        if self.optimize == "speed":
            a = bwd_allreduce_for_tp(a, g)
            if kv_src is None:
                return F.linear(a, torch.cat(ws), bs).chunk(3, dim=-1)
            kv_src = bwd_allreduce_for_tp(kv_src, g)
            q = F.linear(a, ws[0], self.query.bias)
            kv = F.linear(kv_src, torch.cat(ws[1:]), bs[bs.shape[0] // 3:])
            return (q, *kv.chunk(2, dim=-1))
        if kv_src is None:
            y = reduce_scatter_for_tp(F.linear(a, _rank_major(torch.cat(ws), 3, T)), -1, g)
            return (y + bs).chunk(3, dim=-1)
        q = reduce_scatter_for_tp(F.linear(a, ws[0]), -1, g) + self.query.bias
        kv = reduce_scatter_for_tp(F.linear(kv_src, _rank_major(torch.cat(ws[1:]), 2, T)), -1, g)
        return (q, *(kv + bs[bs.shape[0] // 3:]).chunk(2, dim=-1))

    def forward_region(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cross: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.cross_attention and cross is None:
            raise ValueError("DistributedAttentionLayer(cross_attention=True) needs cross_states")
        a = region_layer_norm(x, self.pre_layernorm, self.eps, self.hidden_size, self) if self.pre_ln else x
        q, k, v = self._projections(a, cross if self.cross_attention else None)
        part = self._attend_project(q, k, v, cross_mask if self.cross_attention else mask)
        g = self.tp_group
        if self.sequence_parallel:  # own samples: a per-rank dropout stream
            o = reduce_scatter_for_tp(part, 0, g) + self.dense.bias
            o = tp_dropout(o, self.hidden_dropout_prob, self.training, "tp_rank", g)
        elif self.optimize == "speed":
            o = fwd_allreduce_for_tp(part, g) + self.dense.bias
            o = tp_dropout(o, self.hidden_dropout_prob, self.training, "tp_shared", g)
        else:
            o = reduce_scatter_for_tp(part, -1, g) + self.dense.bias
            o = memory_dropout(o, self.hidden_dropout_prob, self.training, self.recompute_activations, g)
        out = x + o
        if self.post_ln:
            out = region_layer_norm(out, self.post_layernorm, self.eps, self.hidden_size, self)
        return out


