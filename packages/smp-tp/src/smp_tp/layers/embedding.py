"""DistributedEmbedding: the table is split over the embedding dimension (paper §5.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smp_tp.group import ProcessGroup
from smp_tp.mappings import allgather_no_grad, gather_replicated_for_tp, scatter_and_merge_for_tp
from smp_tp.module import DistributedModule
from smp_tp.params import initialize_with_input_partition, parameter_creation_scope


class DistributedEmbedding(DistributedModule):
    """Distributed ``nn.Embedding``; rank i holds columns ``i*d/T:(i+1)*d/T`` of the table.

    Scaled batch: all-gather the indices of the whole TP group, look up the local slice of
    every row, all-to-all back so each rank gets full rows for its own indices. Prescaled
    (or ``_skip_allgather=True``, meaning the indices are already the same on every rank):
    look up locally and all-gather the slices. ``max_norm`` needs whole-row norms and is
    rejected.
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
        initializer_range: float = 0.02,
        _skip_allgather: bool = False,
        *,
        use_normal_initialization: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        self._require_divisible(embedding_dim=embedding_dim)
        if max_norm is not None:
            raise ValueError(
                "DistributedEmbedding: max_norm renormalises whole rows, which no rank holds; "
                "leave this embedding unreplaced or drop max_norm"
            )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"DistributedEmbedding: padding_idx={padding_idx} outside [0, {num_embeddings})"
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.scale_grad_by_freq, self.sparse = padding_idx, scale_grad_by_freq, sparse
        self.skip_allgather = _skip_allgather
        local = embedding_dim // self.tp_size
        with parameter_creation_scope(
            self, dtype=dtype, use_normal=use_normal_initialization, initializer_range=initializer_range
        ):
            with initialize_with_input_partition(self):
                self.weight = nn.Parameter(torch.empty(num_embeddings, local, device=device))
        with torch.no_grad():
            if _weight is not None:
                if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                    raise ValueError(
                        f"DistributedEmbedding: _weight has shape {tuple(_weight.shape)}, "
                        f"expected {(num_embeddings, embedding_dim)}"
                    )
                self.weight.copy_(_weight.chunk(self.tp_size, 1)[self.tp_rank])
            if padding_idx is not None:
                self.weight[padding_idx].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(
            ids, self.weight, self.padding_idx, None, 2.0, self.scale_grad_by_freq, self.sparse
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.scaled_batch and not self.skip_allgather:
            every = allgather_no_grad(flat, 0, self.tp_group)
            out = scatter_and_merge_for_tp(self._lookup(every), 0, -1, self.tp_group)
        else:
            out = gather_replicated_for_tp(self._lookup(flat), -1, self.tp_group)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()
