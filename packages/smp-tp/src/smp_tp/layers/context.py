"""Context parallelism: exact attention over a sequence split across ranks (ring attention).

The sequence axis of q, k and v is cut across the ``cp`` ranks of a process group. No rank
ever holds the whole k/v: each step of the ring a rank attends its own query rows to the
k/v block it holds, then passes that block to rank + 1 and takes the next from rank - 1
(``cp - 1`` hops). The per-block results are merged with an online softmax: every block
gives a normalised partial output and the log-sum-exp of its scores per query row, and two
partials combine as ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) +
out_b * exp(lse_b - lse)``, always in float32. The result equals softmax attention over the
whole sequence up to float32 rounding.

Each block is one call of torch's fused attention kernel that also returns the log-sum-exp
(``_scaled_dot_product_flash_attention_for_cpu`` on CPU, the memory-efficient kernel on CUDA),
on float32 copies of q, k and v; the diagonal block is its ``is_causal`` square. A value head
size different from the query's, or another device, takes an explicit float32 matmul,
masked softmax, matmul instead.

The backward pass runs the ring again, from the saved output and log-sum-exp (no score
matrix is kept): the k/v blocks travel as in the forward, each rank adds its queries'
contribution to ``dq`` locally and to a ``dk``/``dv`` accumulator that travels with the
block; after ``cp`` hops each accumulator is back on the rank that owns the block. Each
block's backward is given the final output and log-sum-exp of its query rows, so the
probabilities it rebuilds are the whole softmax's, not the block's.

Layouts. With a causal mask the last rows of the sequence attend to many more keys than
the first, so contiguous shards would leave rank 0 idle while rank ``cp - 1`` works.
``layout="balanced"`` cuts the full sequence into ``2 * cp`` chunks and gives rank ``i``
chunks ``i`` and ``2 * cp - 1 - i`` (in that order along the sequence axis): one early, one
late chunk, the same causal work on every rank. ``layout="contiguous"`` gives rank ``i`` the
``i``-th contiguous ``1 / cp`` of the sequence. The causal mask always follows the global
token positions; pairs of chunks that are wholly in the future are skipped, not masked.
:func:`split_sequence` and :func:`gather_sequence` shard and reassemble tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

LAYOUTS = ("balanced", "contiguous")

#: How a query chunk sees a key chunk under the causal mask.
_FULL, _DIAG, _SKIP = 0, 1, 2
_KV_TAG, _GRAD_TAG = 0, 2


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"context parallelism: layout must be one of {LAYOUTS}, not {layout!r}")


def _chunk_ids(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    """Global chunk numbers held by ``rank``, in the order they sit along its sequence axis."""
    return (rank, 2 * cp - 1 - rank) if layout == "balanced" else (rank,)


def split_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 2,
                   layout: str = "balanced") -> torch.Tensor:
    """This rank's share of the full-sequence tensor ``x``, as :func:`context_parallel_attention`
    expects it; every rank must use the same ``layout``."""
    _check_layout(layout)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"split_sequence: rank {cp_rank} is not in a group of {cp_size}")
    n = 2 * cp_size if layout == "balanced" else cp_size
    length = x.shape[dim]
    if length % n:
        raise ValueError(f"split_sequence: sequence length {length} is not divisible by {n} "
                         f"(the {layout} layout over {cp_size} ranks cuts it into {n} equal chunks)")
    chunks = x.chunk(n, dim)
    return torch.cat([chunks[i] for i in _chunk_ids(cp_rank, cp_size, layout)], dim)


def gather_sequence(parts: Sequence[torch.Tensor], dim: int = 2, layout: str = "balanced") -> torch.Tensor:
    """The full-sequence tensor from every rank's share (``parts[r]`` from rank ``r``): the
    inverse of :func:`split_sequence`. Collecting the parts is the caller's business."""
    _check_layout(layout)
    cp = len(parts)
    per_rank = 2 if layout == "balanced" else 1
    slots: list[torch.Tensor | None] = [None] * (per_rank * cp)
    for r, part in enumerate(parts):
        if part.shape[dim] % per_rank:
            raise ValueError(f"gather_sequence: rank {r}'s part has odd length {part.shape[dim]} "
                             "(the balanced layout holds two equal chunks per rank)")
        for i, chunk in zip(_chunk_ids(r, cp, layout), part.chunk(per_rank, dim), strict=True):
            slots[i] = chunk
    return torch.cat([s for s in slots if s is not None], dim)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """k/v heads repeated for grouped-query attention (query head h uses kv head h // groups,
    as SDPA's ``enable_gqa``); only done on the block in hand, so the ring carries Hkv heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of :func:`_expand`: sum over the query heads that shared a kv head."""
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


def _kernel(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """The fused attention kernel that computes the ring's blocks, or None for the float32
    math below. The fused kernels return the block's log-sum-exp and take it back (with the
    final output) in the backward; both want the value head size equal to the query's."""
    if q.shape[-1] != v.shape[-1]:
        return None
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0:
        return "cuda"
    return None


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mode: int) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mode == _DIAG:  # same chunk: global positions differ by the same offset, plain causal
        future = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _block_forward(kernel: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   mode: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised attention of q over one key block and its log-sum-exp per row ``[B, H, Sq]``,
    all float32. A diagonal block is a square, aligned causal mask (the fused kernels'
    ``is_causal``) and always leaves each row its own key, so no row is fully masked."""
    causal = mode == _DIAG
    if kernel == "cpu":  # takes grouped-query k/v as they are
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    k, v = _expand(k, groups), _expand(v, groups)
    if kernel == "cuda":
        # Not run by the tests (no GPU there). The log-sum-exp comes padded to a multiple of 32 rows.
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.shape[2]]
    s = _scores(q, k, scale, mode)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    return torch.matmul(p, v) / den, (m + torch.log(den)).squeeze(-1)


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None,
           new: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if acc is None:
        return new
    (o_a, l_a), (o_b, l_b) = acc, new
    lse = torch.logaddexp(l_a, l_b)
    return o_a * torch.exp(l_a - lse).unsqueeze(-1) + o_b * torch.exp(l_b - lse).unsqueeze(-1), lse


def _block_backward(kernel: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, scale: float, mode: int,
                    groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv (dk, dv with k's heads), given the FINAL output and
    log-sum-exp of these query rows: the probabilities exp(scores - lse) rebuilt from them are
    already normalised over the whole sequence, and rowsum(dO * O) is the whole softmax's."""
    causal = mode == _DIAG
    if kernel == "cpu":
        grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = \
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, out, lse, 0.0, causal, scale=scale)
        return grads
    ke, ve = _expand(k, groups), _expand(v, groups)
    if kernel == "cuda":
        # Not run by the tests (no GPU there). Seed and offset only matter with dropout.
        unused = torch.zeros((), dtype=torch.int64, device=q.device)
        lse = F.pad(lse, (0, -lse.shape[-1] % 32)).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do.contiguous(), q.contiguous(), ke.contiguous(), ve.contiguous(), None, out.contiguous(), lse,
            unused, unused, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        p = torch.exp(_scores(q, ke, scale, mode) - lse.unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, ve.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
        dq, dk = torch.matmul(ds, ke) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, _fold(dk, groups), _fold(dv, groups)


def _mode(q_id: int, k_id: int, causal: bool) -> int:
    if not causal or k_id < q_id:
        return _FULL
    return _DIAG if k_id == q_id else _SKIP


class _Ring:
    """Positions of this rank in the ring and the one point-to-point exchange it needs."""

    def __init__(self, group: dist.ProcessGroup, causal: bool, layout: str) -> None:
        self.group, self.causal = group, causal
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # Without a mask positions do not matter: the local rows are one chunk.
        self.layout = layout if causal else "contiguous"
        self.parts = len(_chunk_ids(0, self.cp, self.layout))

    def ids(self, rank: int) -> tuple[int, ...]:
        return _chunk_ids(rank, self.cp, self.layout)

    def shift(self, tensors: Sequence[torch.Tensor], tag: int) -> tuple[list[torch.Tensor], list[Any]]:
        """Start sending ``tensors`` to rank + 1 and receiving the same shapes from rank - 1.
        Distinct tags keep the k/v hop and the dk/dv hop apart when both are in flight."""
        nxt, prv = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        # Contiguous both ways: a model's k/v are often transposed views, and backends (gloo)
        # refuse to receive into a strided buffer.
        tensors = [t.contiguous() for t in tensors]
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, group=self.group, tag=tag + i, group_peer=nxt)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, b, group=self.group, tag=tag + i, group_peer=prv)
                for i, b in enumerate(bufs)]
        return bufs, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _ring_forward(ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    groups, n, kernel = q.shape[1] // k.shape[1], ring.parts, _kernel(q, v)
    qs = q.float().chunk(n, 2)
    acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n
    kv = [k, v]
    for step in range(ring.cp):
        # Start the next hop before computing, so the transfer overlaps the block's math.
        pending = ring.shift(kv, _KV_TAG) if step < ring.cp - 1 else None
        ks, vs = kv[0].float().chunk(n, 2), kv[1].float().chunk(n, 2)
        for a, q_id in enumerate(ring.ids(ring.rank)):
            for b, k_id in enumerate(ring.ids((ring.rank - step) % ring.cp)):
                mode = _mode(q_id, k_id, ring.causal)
                if mode != _SKIP:
                    acc[a] = _merge(acc[a], _block_forward(kernel, qs[a], ks[b], vs[b], scale, mode, groups))
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    # Step 0 holds the rank's own block, which every query row sees (at least its diagonal).
    done = [x for x in acc if x is not None]
    return torch.cat([o for o, _ in done], 2), torch.cat([s for _, s in done], 2)


def _ring_backward(ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, n, kernel = q.shape[1] // k.shape[1], ring.parts, _kernel(q, v)
    qs, dos = q.float().chunk(n, 2), dout.float().chunk(n, 2)
    outs, lses = out.chunk(n, 2), lse.chunk(n, 2)
    dqs = [torch.zeros_like(x) for x in qs]
    kv = [k, v]
    # The dk/dv accumulator of the block in hand; it travels with the block and after the
    # last step's hop it arrives at the block's owner.
    dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
    for step in range(ring.cp):
        pending = ring.shift(kv, _KV_TAG) if step < ring.cp - 1 else None
        ks, vs = kv[0].float().chunk(n, 2), kv[1].float().chunk(n, 2)
        dks = [torch.zeros_like(x) for x in ks]
        dvs = [torch.zeros_like(x) for x in vs]
        for a, q_id in enumerate(ring.ids(ring.rank)):
            for b, k_id in enumerate(ring.ids((ring.rank - step) % ring.cp)):
                mode = _mode(q_id, k_id, ring.causal)
                if mode == _SKIP:
                    continue
                dq, dk, dv = _block_backward(kernel, qs[a], ks[b], vs[b], dos[a], outs[a], lses[a], scale,
                                             mode, groups)
                dqs[a] += dq
                dks[b] += dk
                dvs[b] += dv
        dkv[0] += torch.cat(dks, 2)
        dkv[1] += torch.cat(dvs, 2)
        dkv_next, works = ring.shift(dkv, _GRAD_TAG)
        _wait(works)
        dkv = dkv_next
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    return torch.cat(dqs, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring,
                scale: float) -> torch.Tensor:
        out, lse = _ring_forward(ring, q, k, v, scale)
        # The float32 output (not the cast one) keeps delta = rowsum(dO * O) exact.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, q, k, v, out, lse, dout, ctx.scale)
        return dq, dk, dv, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: dist.ProcessGroup | None, *, causal: bool,
                               scale: float | None = None, layout: str = "balanced",
                               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Scaled-dot-product attention of this rank's query rows over the whole sequence, whose
    k/v shards live on the ranks of ``group``.

    q is ``[B, Hq, S_local, D]``, k and v ``[B, Hkv, S_local, D(v)]`` with ``Hq`` a multiple of
    ``Hkv`` (grouped-query attention), all sharded as :func:`split_sequence` with the same
    ``layout`` does it. Returns ``[B, Hq, S_local, Dv]``: the rows that full-sequence
    ``scaled_dot_product_attention`` would give this rank. ``group=None`` or a group of one
    rank is no context parallelism: plain SDPA. Differentiable in q, k and v.

    ``window`` (sliding-window attention) and ``softcap`` (tanh soft-capping of the scores)
    are refused: a window needs the mask per block pair and soft-capping changes the
    backward's probabilities, neither of which the ring supports yet.
    """
    _check_layout(layout)
    if window is not None:
        raise ValueError("context_parallel_attention: sliding-window attention (window=) is not "
                         "supported by context parallelism yet")
    if softcap is not None:
        raise ValueError("context_parallel_attention: attention soft-capping (softcap=) is not "
                         "supported by context parallelism yet")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("context_parallel_attention: q, k and v must be [batch, heads, sequence, head_dim]")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"context_parallel_attention: {q.shape[1]} query heads are not a multiple of "
                         f"{k.shape[1]} key heads (or k and v differ: {v.shape[1]} value heads)")
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError("context_parallel_attention: q, k and v must hold the same sequence "
                         f"shard, got lengths {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if layout == "balanced" and q.shape[2] % 2:
        raise ValueError(f"context_parallel_attention: a balanced shard holds two equal chunks; "
                         f"local length {q.shape[2]} is odd")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if group is None or dist.get_world_size(group) == 1:
        # The balanced layout of one rank is chunks 0 and 1 in order: the plain sequence.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    out: torch.Tensor = _RingAttention.apply(q, k, v, _Ring(group, causal, layout), scale)
    return out


class ContextParallelAttention(nn.Module):
    """:func:`context_parallel_attention` with its settings fixed, to stand where a model
    calls its attention kernel on q, k and v (no parameters)."""

    def __init__(self, group: dist.ProcessGroup | None, *, causal: bool, scale: float | None = None,
                 layout: str = "balanced") -> None:
        super().__init__()
        _check_layout(layout)
        self.group, self.causal, self.scale, self.layout = group, causal, scale, layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.group, causal=self.causal, scale=self.scale,
                                          layout=self.layout)

    def extra_repr(self) -> str:
        cp = 1 if self.group is None else dist.get_world_size(self.group)
        return f"cp={cp}, causal={self.causal}, layout={self.layout}"


__all__ = ["ContextParallelAttention", "context_parallel_attention", "gather_sequence", "split_sequence"]
