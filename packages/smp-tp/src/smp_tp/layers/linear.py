"""DistributedLinear: paper Fig. 6."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smp_tp.group import ProcessGroup
from smp_tp.mappings import (
    fwd_allreduce_for_tp,
    reduce_scatter_for_tp,
    scatter_and_merge_for_tp,
    split_for_tp,
)
from smp_tp.module import DistributedModule
from smp_tp.params import initialize_with_input_partition, parameter_creation_scope


def input_split_linear(
    x: torch.Tensor, weight: torch.Tensor, module: DistributedModule
) -> torch.Tensor:
    """``x @ W.T`` with ``W`` split over its input channels (``weight`` is this rank's slice).

    Scaled batch (paper Fig. 6): all-to-all the input's channel slices so this rank holds
    slice ``tp_rank`` of *every* rank's samples, apply the local weight, reduce-scatter the
    partial outputs back by sample. Prescaled: take the own channel slice of the (replicated)
    input and all-reduce the partial outputs.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if module.scaled_batch:
        y = reduce_scatter_for_tp(
            F.linear(scatter_and_merge_for_tp(x2, -1, 0, module.tp_group), weight), 0, module.tp_group
        )
    else:
        y = fwd_allreduce_for_tp(F.linear(split_for_tp(x2, -1, module.tp_group), weight), module.tp_group)
    return y.reshape(*shape[:-1], weight.shape[0])


class DistributedLinear(DistributedModule):
    """Distributed ``nn.Linear``: the weight is split over input channels.

    The bias is applied after the outputs are combined, on this rank's own samples, so it
    is an ordinary replicated parameter. Leading dimensions are flattened into tokens; in
    scaled-batch mode every TP rank must feed the same number of tokens.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        self._require_divisible(in_features=in_features)
        self.in_features, self.out_features = in_features, out_features
        with parameter_creation_scope(
            self, dtype=dtype, use_normal=use_normal_initialization, initializer_range=initializer_range
        ):
            with initialize_with_input_partition(self):
                self.weight = nn.Parameter(
                    torch.empty(out_features, in_features // self.tp_size, device=device)
                )
            with parameter_creation_scope(self, scaled_batch=False, dtype=dtype):
                self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = input_split_linear(x, self.weight, self)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + super().extra_repr()
