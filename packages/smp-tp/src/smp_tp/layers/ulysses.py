"""Context parallelism by all-to-all over heads (the DeepSpeed-Ulysses scheme).

The alternative to the ring of :mod:`smp_tp.layers.context`, with the same sharding
contract: every rank of a group of ``cp`` holds its shard of the sequence (as
:func:`~smp_tp.layers.context.split_sequence` cuts it, ``balanced`` or ``contiguous``) for
all heads. One all-to-all trades that for the *whole* sequence of ``1 / cp`` of the heads;
each rank then runs plain ``scaled_dot_product_attention`` on its heads (attention heads are
independent, so nothing has to be merged), and a second all-to-all trades the result back to
sequence shards of all heads.

Costs, against the ring. Ulysses moves each of q, k, v and the output once through an
all-to-all (every rank sends ``(cp - 1) / cp`` of each), the ring moves only k and v but
``cp - 1`` times; Ulysses runs one dense kernel per rank instead of ``cp`` block steps with
an online-softmax merge, and its causal work is balanced whatever the layout (every rank
sees the whole sequence). But ``cp`` must divide the number of query heads *and* of key/value
heads: grouped-query attention with fewer kv heads than ranks cannot be split this way (the
ring can). Per rank, ``[B, H/cp, S, D]`` is as large as ``[B, H, S/cp, D]``, so the activations
are the ring's size (plus the exchange buffers); the attention kernel is whatever SDPA picks
for a sequence of ``S``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from smp_tp.layers.context import _check_layout, gather_sequence, split_sequence
from smp_tp.layers.experts import all_to_all_rows

# The sequence axis, counted from the end: tensors here may carry leading stack dims.
_SEQ = -2
# The exchange is the expert layer's differentiable all-to-all with one row per rank: its
# backward sends each row's gradient back to the sender (the reverse all-to-all).


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int, layout: str) -> torch.Tensor:
    """``[..., H, S/cp, D]`` sequence shards (in ``layout``) to ``[..., H/cp, S, D]``: the
    whole sequence, in global order, for this rank's group of ``H/cp`` heads."""
    lead, (h, s, d) = x.shape[:-3], x.shape[-3:]
    # Head group j is bound for rank j: put it first, so the exchange sends row j to rank j.
    send = x.reshape(*lead, cp, h // cp, s, d).movedim(-4, 0)
    recv = all_to_all_rows(send, [1] * cp, [1] * cp, group)
    # Row r is rank r's shard of the sequence: its layout chunks, put back in global order.
    return gather_sequence(list(recv.unbind(0)), _SEQ, layout)


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, cp: int, layout: str) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``[B, H/cp, S, D]`` of this rank's heads back to
    ``[B, H, S/cp, D]``, this rank's sequence shard of every head."""
    send = torch.stack([split_sequence(y, r, cp, _SEQ, layout) for r in range(cp)])
    recv = all_to_all_rows(send, [1] * cp, [1] * cp, group)
    # Row j holds head group j (from rank j): heads back in order along dim 1.
    b, s, d = recv.shape[1], recv.shape[-2], recv.shape[-1]
    return recv.movedim(0, 1).reshape(b, -1, s, d)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, layout: str) -> None:
    _check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ulysses_attention: q, k and v must be [batch, heads, sequence, head_dim]")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv or hkv != v.shape[1]:
        raise ValueError(f"ulysses_attention: {hq} query heads are not a multiple of {hkv} key "
                         f"heads (or k and v differ: {v.shape[1]} value heads)")
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError("ulysses_attention: q, k and v must hold the same sequence shard, got "
                         f"lengths {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if cp > 1 and (hq % cp or hkv % cp):
        raise ValueError(f"ulysses_attention: the heads are split over the {cp} ranks, so {cp} must "
                         f"divide both the {hq} query heads and the {hkv} key/value heads; use "
                         "the ring (context_parallel_attention) instead")
    if cp > 1 and layout == "balanced" and q.shape[2] % 2:
        raise ValueError(f"ulysses_attention: a balanced shard holds two equal chunks; local "
                         f"length {q.shape[2]} is odd")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None, *, causal: bool,
                      scale: float | None = None, layout: str = "balanced") -> torch.Tensor:
    """Scaled-dot-product attention of this rank's query rows over the whole sequence, by
    all-to-all over heads; a drop-in for
    :func:`~smp_tp.layers.context.context_parallel_attention` (same arguments, shards and
    result) when ``cp`` divides the head counts.

    q is ``[B, Hq, S_local, D]``, k and v ``[B, Hkv, S_local, D(v)]``, all sharded as
    :func:`~smp_tp.layers.context.split_sequence` with ``layout`` does it; ``Hq`` a multiple
    of ``Hkv`` and both multiples of ``cp`` (the group's size), else ``ValueError``. Returns
    ``[B, Hq, S_local, Dv]``: the rows full-sequence SDPA would give this rank, in the same
    layout. ``group=None`` or a group of one rank is plain SDPA. Differentiable in q, k and v:
    the backward of each all-to-all is the reverse all-to-all.
    """
    cp = 1 if group is None else dist.get_world_size(group)
    _check(q, k, v, cp, layout)
    gqa = q.shape[1] != k.shape[1]
    if group is None or cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    # Tensors of one shape share an exchange (fewer collectives, each larger).
    if q.shape == k.shape == v.shape:
        qf, kf, vf = _seq_to_heads(torch.stack([q, k, v]), group, cp, layout).unbind(0)
    elif k.shape == v.shape:
        qf = _seq_to_heads(q, group, cp, layout)
        kf, vf = _seq_to_heads(torch.stack([k, v]), group, cp, layout).unbind(0)
    else:
        qf, kf, vf = (_seq_to_heads(x, group, cp, layout) for x in (q, k, v))
    # Rank j holds query heads [j*Hq/cp, (j+1)*Hq/cp) and kv heads [j*Hkv/cp, ...): query head
    # h uses kv head h // (Hq/Hkv), which falls in this rank's kv group, so GQA stays local.
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=scale, enable_gqa=gqa)
    return _heads_to_seq(out, group, cp, layout)


__all__ = ["ulysses_attention"]
