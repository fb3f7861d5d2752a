"""Cross entropy over vocabulary-parallel logits, without building the full logits.

For every token, the three numbers that involve the whole vocabulary are combined across the
tensor-parallel group: the maximum logit (all-reduce MAX), and in one all-reduce SUM the sum
of ``exp(z - max)`` and the target's logit (held by exactly one rank). The loss is
``log Σ exp(z - max) - (z_target - max)``. Backward needs no collective: with the gradient
``g`` of each token's loss (identical on every rank, see below) each rank forms
``g * (softmax(z) - onehot(target))`` for its own columns from the softmax it saved.

Batch modes: in prescaled mode logits and targets cover the same (shared) tokens and the
per-token losses are identical on every rank. In scaled-batch mode the logits shard covers
the TP group's whole batch (rank-major, as :class:`~smp_tp.VocabParallelLMHead` returns it)
and ``target`` only this rank's samples: the targets are all-gathered, the per-token losses
of the whole group computed (identical everywhere), and this rank's samples taken with
:func:`~smp_tp.split_for_tp`, whose backward all-gathers the per-token gradients - which is
what makes ``g`` identical on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from smp_tp.group import ProcessGroup, tp_rank, tp_size
from smp_tp.mappings import _all_reduce, allgather_no_grad, split_for_tp
from smp_tp.state import current_config

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, z: torch.Tensor, target: torch.Tensor, start: int, vocab_size: int | None,
        ignore_index: int, group: ProcessGroup,
    ) -> torch.Tensor:
        n = z.shape[-1]
        zf = z.float()
        if vocab_size is not None and start + n > vocab_size:  # padding columns never count
            pad = torch.arange(n, device=z.device) >= max(0, vocab_size - start)
            zf = zf.masked_fill(pad, float("-inf"))
        m = zf.max(-1).values
        m = _all_reduce(m, group, "forward", dist.ReduceOp.MAX)
        shifted = zf - m.unsqueeze(-1)
        e = shifted.exp()
        valid = target != ignore_index
        local = valid & (target >= start) & (target < start + n)
        idx = (target - start).clamp(0, n - 1)
        zt = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~local, 0.0)
        stats = _all_reduce(torch.stack([e.sum(-1), zt], -1), group, "forward")
        total = stats[..., 0]
        loss = (total.log() - stats[..., 1]).masked_fill(~valid, 0.0)
        e.div_(total.unsqueeze(-1))  # softmax over the whole vocabulary, own columns
        ctx.save_for_backward(e, idx, local, valid)
        ctx.in_dtype = z.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        probs, idx, local, valid = ctx.saved_tensors
        g = g.float().masked_fill(~valid, 0.0)
        grad = probs * g.unsqueeze(-1)
        grad.scatter_add_(-1, idx.unsqueeze(-1), -(g * local).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def _check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    if target.is_floating_point() or target.dtype == torch.bool:
        raise TypeError(f"vocab_parallel_cross_entropy: targets must be integer class indices, got {target.dtype}")
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if target.device.type == "cpu":
        if bool(bad.any()):
            first = int(target[bad][0])
            raise IndexError(
                f"vocab_parallel_cross_entropy: target {first} out of range [0, {vocab_size}) "
                f"(and not ignore_index={ignore_index})"
            )
    else:
        torch._assert_async(~bad.any())


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    vocab_size: int | None = None,
    tp_group: ProcessGroup = None,
    prescaled_batch: bool | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` over the vocabulary shards of the TP group (see module docstring).

    ``logits``: this rank's shard ``(..., Vp/T)``, rank r holding columns
    ``r*Vp/T:(r+1)*Vp/T`` of the padded vocabulary. Scaled batch (default): leading
    dimension ``T * batch`` (the TP group's batch, rank-major) and ``target`` ``(batch, ...)``
    this rank's own targets; prescaled: ``logits.shape[:-1] == target.shape``.
    ``vocab_size``: the real vocabulary; columns at or beyond it (padding) are excluded.
    ``ignore_index`` targets contribute nothing; ``reduction``: ``"mean"`` over this rank's
    non-ignored targets (as torch), ``"sum"``, or ``"none"`` (per target, shape of ``target``).
    ``tp_group``/``prescaled_batch`` default to :func:`smp_tp.current_config`; pass the
    head's (``head.tp_group``, ``head.prescaled_batch``) when in doubt.

    With the own-sample mean loss on every rank, :func:`smp_tp.sync_gradients` makes the
    gradients those of the mean over the TP group's batch when every rank has the same
    number of non-ignored targets; otherwise use ``reduction="sum"`` divided by the group's
    count over ``T`` (as Hugging Face's ``num_items_in_batch``).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    cfg = current_config()
    group = tp_group if tp_group is not None else cfg.tp_group
    prescaled = cfg.prescaled_batch if prescaled_batch is None else bool(prescaled_batch)
    T, r = tp_size(group), tp_rank(group)
    n = logits.shape[-1]
    if vocab_size is not None and n != -(-vocab_size // T):
        raise ValueError(
            f"vocab_parallel_cross_entropy: a shard of {n} columns on {T} ranks cannot hold a "
            f"vocabulary of {vocab_size} (expected ceil({vocab_size}/{T}) columns); pass "
            f"vocabulary-parallel logits (VocabParallelLMHead with gather_output=False)"
        )
    _check_targets(target, vocab_size if vocab_size is not None else n * T, ignore_index)
    if prescaled or T == 1:
        if tuple(logits.shape[:-1]) != tuple(target.shape):
            raise ValueError(
                f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} do not match targets "
                f"{tuple(target.shape)} (prescaled batch: logits.shape[:-1] == target.shape)"
            )
        every = target
    else:
        if target.dim() == 0 or logits.shape[0] != T * target.shape[0] or tuple(logits.shape[1:-1]) != tuple(target.shape[1:]):
            raise ValueError(
                f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} do not match targets "
                f"{tuple(target.shape)}; in scaled-batch mode the logits shard covers the TP "
                f"group's batch ({T} x this rank's samples along dimension 0)"
            )
        every = allgather_no_grad(target.contiguous(), 0, group)
    losses = _VocabParallelCE.apply(
        logits.reshape(-1, n), every.reshape(-1), r * n, vocab_size, ignore_index, group
    ).view(every.shape)
    if not (prescaled or T == 1):
        losses = split_for_tp(losses, 0, group)
    losses = losses.to(logits.dtype)
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()


class VocabParallelCausalLMLoss:
    """Drop-in for Hugging Face's ``ForCausalLMLoss`` (``model.loss_function``) when the
    model's output head is a :class:`~smp_tp.VocabParallelLMHead`: shifts the labels the same
    way, honours ``ignore_index``, ``shift_labels`` and ``num_items_in_batch``, and takes a
    logits shard (vocabulary-parallel cross entropy) or full logits (plain cross entropy)."""

    def __init__(self, head: Any) -> None:
        self.head = head

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            assert labels is not None
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        shift_labels = shift_labels.to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        head = self.head
        if logits.shape[-1] == vocab_size and vocab_size != head.rows_per_rank:
            loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), shift_labels.reshape(-1),
                                   ignore_index=ignore_index, reduction=reduction)
        else:
            loss = vocab_parallel_cross_entropy(
                logits.float(), shift_labels, ignore_index=ignore_index, reduction=reduction,
                vocab_size=vocab_size, tp_group=head.tp_group, prescaled_batch=head.prescaled_batch,
            )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss
