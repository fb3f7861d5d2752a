"""Built-in replacements for ``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm``."""

from __future__ import annotations

import warnings

from torch import nn

from smp_tp.checkpoint import load_full_into
from smp_tp.layers.embedding import DistributedEmbedding
from smp_tp.layers.layernorm import DistributedLayerNorm
from smp_tp.layers.linear import DistributedLinear
from smp_tp.module import DistributedModule
from smp_tp.registry import register_builtin


def _identity(sd: dict) -> dict:
    return dict(sd)


def finish(dist: DistributedModule, original: nn.Module, to_full=_identity, from_full=_identity) -> DistributedModule:
    """Copy the original's weights (this rank's slices) in and remember the key mapping."""
    load_full_into(dist, to_full(original.state_dict()))
    dist.train(original.training)
    object.__setattr__(dist, "_smp_tp_to_full", to_full)
    object.__setattr__(dist, "_smp_tp_from_full", from_full)
    return dist


def _linear(m: nn.Linear) -> DistributedModule:
    w = m.weight
    dist = DistributedLinear(m.in_features, m.out_features, m.bias is not None, dtype=w.dtype, device=w.device)
    return finish(dist, m)


def _embedding(m: nn.Embedding) -> DistributedModule | None:
    if m.max_norm is not None:
        warnings.warn("smp_tp: nn.Embedding with max_norm is left unreplaced", stacklevel=3)
        return None
    w = m.weight
    dist = DistributedEmbedding(
        m.num_embeddings, m.embedding_dim, m.padding_idx, None, m.norm_type,
        m.scale_grad_by_freq, m.sparse, dtype=w.dtype, device=w.device,
    )
    return finish(dist, m)


def _layernorm(m: nn.LayerNorm) -> DistributedModule | None:
    if len(m.normalized_shape) != 1:
        warnings.warn("smp_tp: nn.LayerNorm over several dimensions is left unreplaced", stacklevel=3)
        return None
    w = m.weight
    dist = DistributedLayerNorm(
        m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None,
        dtype=w.dtype if w is not None else None, device=w.device if w is not None else None,
    )
    return finish(dist, m)


register_builtin(nn.Linear, DistributedLinear, _linear)  # type: ignore[arg-type]
register_builtin(nn.Embedding, DistributedEmbedding, _embedding)  # type: ignore[arg-type]
register_builtin(nn.LayerNorm, DistributedLayerNorm, _layernorm)  # type: ignore[arg-type]
