"""Vocabulary-parallel embedding and output head (Megatron-LM §3), which can share one shard.

The table of ``V`` rows is padded to ``Vp = ceil(V / T) * T`` rows and rank ``r`` holds rows
``r * Vp/T : (r + 1) * Vp/T``. The padding rows (on the last ranks) are zero, never looked up,
masked to ``-inf`` in the logits and dropped from every full (unwrapped-layout) state dict,
gradient dict and gathered logits, so they affect no result; the full state dict keeps the
original ``(V, d)`` shape.

Batch modes (see the package README):

* scaled batch: the embedding all-gathers the TP group's indices, looks up its own rows and
  reduce-scatters the partial rows back by sample (backward: all-gather). The head
  all-gathers its input over samples (backward: reduce-scatter) and returns this rank's
  vocabulary columns for the *whole TP group's batch* (rank-major, ``T * batch`` rows).
* prescaled: the embedding looks up its rows and all-reduces (backward: nothing); the head
  applies Megatron's ``f`` to its input (identity forward, all-reduce backward) and returns
  this rank's columns for the shared batch.

:func:`smp_tp.vocab_parallel_cross_entropy` takes such a logits shard without ever building
the full logits.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from smp_tp.group import ProcessGroup
from smp_tp.loss import vocab_parallel_cross_entropy
from smp_tp.mappings import (
    allgather_no_grad,
    bwd_allreduce_for_tp,
    fused_allgather_for_tp,
    fwd_allreduce_for_tp,
    gather_replicated_for_tp,
    reduce_scatter_for_tp,
    scatter_and_merge_for_tp,
)
from smp_tp.module import DistributedModule
from smp_tp.params import initialize_with_output_partition, parameter_creation_scope


def vocab_partition(num_embeddings: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """``(padded size, rows per rank, first row of this rank)`` of a vocabulary split."""
    per = -(-num_embeddings // tp_size)
    return per * tp_size, per, per * tp_rank


class _UnpadRows:
    """``from_full`` translation: drop the padding rows of the listed keys."""

    def __init__(self, keys: tuple[str, ...], size: int) -> None:
        self.keys, self.size = keys, size

    def __call__(self, sd: dict) -> dict:
        return {k: (v[: self.size] if k in self.keys else v) for k, v in sd.items()}


class _PadRows:
    """``to_full`` translation: append zero padding rows to the listed keys."""

    def __init__(self, keys: tuple[str, ...], size: int, padded: int) -> None:
        self.keys, self.size, self.padded = keys, size, padded

    def __call__(self, sd: dict) -> dict:
        out = dict(sd)
        for k in self.keys:
            v = out.get(k)
            if v is not None and v.shape[0] == self.size:
                pad = v.new_zeros((self.padded - self.size, *v.shape[1:]))
                out[k] = torch.cat([v, pad], 0)
        return out


def _install_padding(module: DistributedModule, keys: tuple[str, ...], size: int, padded: int) -> None:
    if padded != size:
        object.__setattr__(module, "_smp_tp_to_full", _PadRows(keys, size, padded))
        object.__setattr__(module, "_smp_tp_from_full", _UnpadRows(keys, size))


def _check_indices(ids: torch.Tensor, size: int, what: str) -> None:
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{what}: indices must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return
    if ids.device.type == "cpu":
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= size:
            raise IndexError(f"{what}: index out of range [0, {size}) (got min {lo}, max {hi})")
    else:  # no host synchronisation on accelerators
        torch._assert_async(((ids >= 0) & (ids < size)).all())


class VocabParallelEmbedding(DistributedModule):
    """``nn.Embedding`` split over the vocabulary (rows); see the module docstring.

    ``max_norm`` and ``scale_grad_by_freq`` need whole-table information and are rejected.
    Index checks: out-of-range indices raise ``IndexError`` (CPU) or fail an asynchronous
    device assertion, as ``nn.Embedding`` would, instead of silently becoming zero rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        *,
        initializer_range: float = 0.02,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        if max_norm is not None or scale_grad_by_freq:
            raise ValueError(
                "VocabParallelEmbedding: max_norm and scale_grad_by_freq need whole-table "
                "information, which no rank holds; leave this embedding unreplaced"
            )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"VocabParallelEmbedding: padding_idx={padding_idx} outside [0, {num_embeddings})"
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.sparse, self.norm_type = padding_idx, sparse, norm_type
        self.padded_num_embeddings, self.rows_per_rank, self.vocab_start = vocab_partition(
            num_embeddings, self.tp_size, self.tp_rank)
        with parameter_creation_scope(
            self, dtype=dtype, use_normal=True, initializer_range=initializer_range
        ):
            with initialize_with_output_partition(self):
                self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, device=device))
        _install_padding(self, ("weight",), num_embeddings, self.padded_num_embeddings)
        with torch.no_grad():
            if _weight is not None:
                if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                    raise ValueError(
                        f"VocabParallelEmbedding: _weight has shape {tuple(_weight.shape)}, "
                        f"expected {(num_embeddings, embedding_dim)}"
                    )
                self.load_full_weight(_weight)
            self._zero_padding_rows()

    def _zero_padding_rows(self) -> None:
        valid = max(0, min(self.rows_per_rank, self.num_embeddings - self.vocab_start))
        self.weight[valid:].zero_()
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.rows_per_rank:
            self.weight[self.padding_idx - self.vocab_start].zero_()

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full ``(num_embeddings, embedding_dim)`` table."""
        start, n = self.vocab_start, self.rows_per_rank
        rows = weight[start: start + n].to(self.weight.device, self.weight.dtype)
        self.weight.zero_()
        self.weight[: rows.shape[0]].copy_(rows)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        start, n = self.vocab_start, self.rows_per_rank
        outside = (ids < start) | (ids >= start + n)
        local = (ids - start).masked_fill(outside, 0)
        pidx = self.padding_idx
        pidx = pidx - start if pidx is not None and 0 <= pidx - start < n else None
        out = F.embedding(local, self.weight, pidx, None, self.norm_type, False, self.sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_indices(ids, self.num_embeddings, "VocabParallelEmbedding")
        g = self.tp_group
        flat = ids.reshape(-1)
        if self.tp_size == 1:
            out = F.embedding(flat, self.weight, self.padding_idx, None, self.norm_type, False, self.sparse)
        elif self.scaled_batch:
            every = allgather_no_grad(flat.contiguous(), 0, g)
            out = reduce_scatter_for_tp(self._lookup(every), 0, g)
        else:
            out = fwd_allreduce_for_tp(self._lookup(flat), g)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start}:"
                f"{self.vocab_start + self.rows_per_rank} of {self.padded_num_embeddings}, "
                + super().extra_repr())


# Heads whose owning model is computing its loss right now (auto mode: logits stay sharded).
_loss_heads: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "smp_tp_loss_heads", default=frozenset()
)


@contextmanager
def sharded_logits(*heads: VocabParallelLMHead) -> Iterator[None]:
    """Inside the block, heads with ``gather_output=None`` return logits shards."""
    token = _loss_heads.set(_loss_heads.get() | {id(h) for h in heads})
    try:
        yield
    finally:
        _loss_heads.reset(token)


class VocabParallelLMHead(DistributedModule):
    """Output projection ``hidden → logits`` split over the vocabulary (rows of the weight).

    ``tie_to=embedding`` shares the :class:`VocabParallelEmbedding`'s shard (one parameter,
    registered under both modules, as a tied ``nn.Linear`` would be). ``gather_output``:

    * ``False`` — return this rank's logits shard ``(..., Vp/T)`` (scaled batch: for the TP
      group's whole batch, ``T * batch`` rows); feed it to
      :func:`smp_tp.vocab_parallel_cross_entropy`. Padding columns are ``-inf``.
    * ``True`` — return the full logits ``(..., V)`` of this rank's own samples (scaled) or of
      the shared batch (prescaled), as the unwrapped head would (one more collective).
    * ``None`` (what ``parallelize`` installs for Hugging Face causal LMs) — shards while the
      owning model computes its loss from ``labels`` (see :func:`sharded_logits`), full
      logits otherwise.
    """

    def __init__(
        self,
        in_features: int,
        num_embeddings: int,
        bias: bool = False,
        *,
        tie_to: VocabParallelEmbedding | None = None,
        gather_output: bool | None = False,
        initializer_range: float = 0.02,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
    ) -> None:
        if tie_to is not None:
            if (tie_to.num_embeddings, tie_to.embedding_dim) != (num_embeddings, in_features):
                raise ValueError(
                    f"VocabParallelLMHead: cannot tie a ({num_embeddings}, {in_features}) head to "
                    f"a ({tie_to.num_embeddings}, {tie_to.embedding_dim}) embedding"
                )
            tp_group, prescaled_batch = tie_to.tp_group, tie_to.prescaled_batch
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        self.in_features, self.num_embeddings, self.gather_output = in_features, num_embeddings, gather_output
        self.padded_num_embeddings, self.rows_per_rank, self.vocab_start = vocab_partition(
            num_embeddings, self.tp_size, self.tp_rank)
        n = self.rows_per_rank
        with parameter_creation_scope(
            self, dtype=dtype, use_normal=True, initializer_range=initializer_range
        ):
            with initialize_with_output_partition(self):
                if tie_to is None:
                    self.weight = nn.Parameter(torch.empty(n, in_features, device=device))
                self.bias = nn.Parameter(torch.zeros(n, device=device)) if bias else None
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            with torch.no_grad():
                self.weight[self.valid_rows:].zero_()
        _install_padding(self, ("weight", "bias"), num_embeddings, self.padded_num_embeddings)

    @property
    def valid_rows(self) -> int:
        """Rows of this rank's shard that are real vocabulary entries (the rest is padding)."""
        return max(0, min(self.rows_per_rank, self.num_embeddings - self.vocab_start))

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's rows of a full ``(num_embeddings, in_features)`` weight (and bias)."""
        start, n = self.vocab_start, self.rows_per_rank
        for local, full in ((self.weight, weight), (self.bias, bias)):
            if local is None or full is None:
                continue
            rows = full[start: start + n].to(local.device, local.dtype)
            local.zero_()
            local[: rows.shape[0]].copy_(rows)

    def _gathers(self) -> bool:
        if self.gather_output is not None:
            return bool(self.gather_output)
        return id(self) not in _loss_heads.get()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        g = self.tp_group
        x = fused_allgather_for_tp(hidden, 0, g) if self.scaled_batch else bwd_allreduce_for_tp(hidden, g)
        z = F.linear(x, self.weight, self.bias)
        if self.valid_rows < self.rows_per_rank:
            pad = torch.arange(self.rows_per_rank, device=z.device) >= self.valid_rows
            z = z.masked_fill(pad, float("-inf"))
        return self.gather_logits(z) if self._gathers() else z

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits shard → full logits ``(..., V)`` of this rank's own samples (scaled batch)
        or the shared batch (prescaled); differentiable, padding columns dropped."""
        if logits.shape[-1] != self.rows_per_rank:
            raise ValueError(
                f"VocabParallelLMHead.gather_logits: last dimension {logits.shape[-1]} is not "
                f"this rank's vocabulary shard ({self.rows_per_rank})"
            )
        g = self.tp_group
        full = scatter_and_merge_for_tp(logits, 0, -1, g) if self.scaled_batch else gather_replicated_for_tp(logits, -1, g)
        return full[..., : self.num_embeddings]

    def cross_entropy(
        self, logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """:func:`smp_tp.vocab_parallel_cross_entropy` of this head's logits shard, with the
        head's vocabulary size, group and batch mode."""
        return vocab_parallel_cross_entropy(
            logits, target, ignore_index=ignore_index, reduction=reduction,
            vocab_size=self.num_embeddings, tp_group=self.tp_group, prescaled_batch=self.prescaled_batch,
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab={self.num_embeddings}, rows "
                f"{self.vocab_start}:{self.vocab_start + self.rows_per_rank}, "
                f"tied={self.tied}, " + super().extra_repr())


def gather_vocab_parallel_logits(logits: torch.Tensor, head: VocabParallelLMHead) -> torch.Tensor:
    """Full logits from a :class:`VocabParallelLMHead`'s shard (see its ``gather_logits``)."""
    return head.gather_logits(logits)
