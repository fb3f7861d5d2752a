"""DistributedLayerNorm: normalisation from all-reduced first and second moments (App. F.2)."""

from __future__ import annotations

import torch
from torch import nn

from smp_tp.group import ProcessGroup
from smp_tp.mappings import (
    _all_reduce,
    gather_replicated_for_tp,
    scatter_and_merge_for_tp,
    split_for_tp,
)
from smp_tp.module import DistributedModule
from smp_tp.params import initialize_with_output_partition, parameter_creation_scope


class _ShardedLayerNorm(torch.autograd.Function):
    """Layer norm over a channel-split last dimension, saving only ``x_hat`` and ``rstd``.

    Forward all-reduces ``[sum x, sum x^2]`` per token; backward all-reduces
    ``[sum g, sum g*x_hat]`` (``g = dy * weight``), the two channel sums the input gradient
    needs. Moments are accumulated and reduced in float64: they are tiny, and
    ``E[x^2] - E[x]^2`` cancels badly in float32.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, full_dim, group):  # type: ignore[override]
        xd = x.double()
        stats = _all_reduce(torch.stack([xd.sum(-1), (xd * xd).sum(-1)], dim=-1), group, "forward")
        mean = stats[..., 0:1] / full_dim
        var = (stats[..., 1:2] / full_dim - mean * mean).clamp_min(0.0)
        rstd = torch.rsqrt(var + eps)
        x_hat = ((xd - mean) * rstd).to(x.dtype)
        ctx.save_for_backward(x_hat, rstd.float(), weight)
        ctx.full_dim, ctx.group, ctx.has_bias = full_dim, group, bias is not None
        y = x_hat * weight if weight is not None else x_hat.clone()
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x_hat, rstd, weight = ctx.saved_tensors
        dyf, xf = dy.float(), x_hat.float()
        g = dyf * weight.float() if weight is not None else dyf
        sums = _all_reduce(torch.stack([g.sum(-1), (g * xf).sum(-1)], dim=-1), ctx.group, "backward")
        mean_g = sums[..., 0:1] / ctx.full_dim
        mean_gx = sums[..., 1:2] / ctx.full_dim
        dx = ((g - mean_g - xf * mean_gx) * rstd).to(dy.dtype)
        lead = tuple(range(dy.dim() - 1))
        dw = (dyf * xf).sum(lead).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = dyf.sum(lead).to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def sharded_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    full_dim: int,
    tp_group: ProcessGroup,
) -> torch.Tensor:
    """Layer norm of a tensor whose last dimension is split over the TP group.

    The local sums of ``x`` and ``x**2`` are all-reduced together (one small collective),
    giving the global mean and variance; the normalisation itself is element-wise on the
    local slice (paper App. F.2). Under autocast it runs in float32, like ``layer_norm``.
    """
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return _ShardedLayerNorm.apply(
                x.float(), None if weight is None else weight.float(),
                None if bias is None else bias.float(), eps, full_dim, tp_group)
    return _ShardedLayerNorm.apply(x, weight, bias, eps, full_dim, tp_group)


class DistributedLayerNorm(DistributedModule):
    """Distributed ``nn.LayerNorm`` over the last dimension; weight and bias are sharded.

    Scaled batch: all-to-all to "all samples, own channels", normalise with all-reduced
    moments, all-to-all back. Prescaled: take the own channel slice, normalise, all-gather.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...] | list[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(
                f"DistributedLayerNorm: only normalisation over the last dimension is "
                f"supported, got normalized_shape={shape}"
            )
        self.normalized_shape = shape
        self.hidden = shape[0]
        self._require_divisible(normalized_shape=self.hidden)
        self.eps = eps
        local = self.hidden // self.tp_size
        with parameter_creation_scope(self, dtype=dtype), initialize_with_output_partition(self):
            self.weight = nn.Parameter(torch.ones(local, device=device)) if elementwise_affine else None
            self.bias = (
                nn.Parameter(torch.zeros(local, device=device)) if elementwise_affine and bias else None
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        g = self.tp_group
        if self.scaled_batch:
            local = scatter_and_merge_for_tp(x2, -1, 0, g)
        else:
            local = split_for_tp(x2, -1, g)
        y = sharded_layer_norm(local, self.weight, self.bias, self.eps, self.hidden, g)
        y = scatter_and_merge_for_tp(y, 0, -1, g) if self.scaled_batch else gather_replicated_for_tp(y, -1, g)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, " + super().extra_repr()
