"""Single-process tests of the activation-memory counts: ``smp_pipeline.activation_meter``'s
saved-tensor meter and the W queue's held-bytes counter (``WeightGradQueue.queued_bytes``).

Every expectation is a closed-form byte count of a known stack of layers."""

from __future__ import annotations

import threading

import torch
from smp_pipeline.activation_meter import ActivationMeter
from smp_pipeline.wsplit import deferred_weight_grads
from torch import nn

B, D, L = 6, 8, 3
UNIT = B * D * 4  # one fp32 activation of the stack


def _stack(act: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(L) for m in (nn.Linear(D, D), act())))


def _meter(model: nn.Module, x: torch.Tensor, **kw: object) -> ActivationMeter:
    leaves = [m for m in model.modules() if not list(m.children())]
    return ActivationMeter(leaves, [*model.parameters(), x], **kw)  # type: ignore[arg-type]


def test_counts_saved_bytes_of_a_linear_gelu_stack_until_backward_frees_them() -> None:
    # Each GELU saves its input (the Linear's output), each Linear its input (the previous
    # GELU's output; the first one's is the excluded batch) and its weight (a parameter:
    # excluded): 2L - 1 activations, none shared.
    model, x = _stack(nn.GELU), torch.randn(B, D)
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    meter = _meter(model, x)
    with meter.measure():
        loss = model(x).square().sum()
        assert meter.live_bytes == meter.peak_bytes == (2 * L - 1) * UNIT
        loss.backward()
    assert meter.live_bytes == 0, "saved tensors freed by the backward are still counted"
    assert meter.peak_bytes == (2 * L - 1) * UNIT
    # counting changes nothing the backward computes
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


def test_a_storage_saved_twice_counts_once_and_a_dropped_graph_releases() -> None:
    # ReLU saves its result, which the next Linear saves again as its input: L storages.
    model, x = _stack(nn.ReLU), torch.randn(B, D)
    meter = _meter(model, x)
    with meter.measure():
        loss = model(x).sum()
    assert meter.packed > L and meter.live_bytes == L * UNIT
    del loss  # the graph dies without a backward
    assert meter.live_bytes == 0 and meter.peak_bytes == L * UNIT


def test_counts_a_forward_run_on_another_thread() -> None:
    # saved_tensors_hooks are per thread; a pipeline rank may run its stage on a thread of
    # its own: the meter's hooks are entered by the modules, wherever they run.
    model, x = _stack(nn.GELU), torch.randn(B, D)
    meter, out = _meter(model, x), []
    with meter.measure():
        t = threading.Thread(target=lambda: out.append(model(x)))
        t.start()
        t.join()
    assert meter.live_bytes == (2 * L - 1) * UNIT
    out.clear()
    assert meter.live_bytes == 0


def test_queued_w_tasks_hold_input_and_grad_output_counted_with_the_saved_tensors() -> None:
    model, x = _stack(nn.GELU), torch.randn(B, D)
    with deferred_weight_grads(model) as q:
        meter = _meter(model, x, extra=q.held_storages)
        with meter.measure():
            loss = model(x).square().sum()
        assert q.queued_bytes == 0 and meter.total_bytes() == (2 * L - 1) * UNIT
        loss.backward()
    # Each linear's W task holds its input and grad_output: 2L storages, the batch among
    # them (held by the queue, but not an activation to the meter).
    assert len(q) == L and q.queued_bytes == q.pending_bytes() == 2 * L * UNIT
    assert meter.live_bytes == 0 and meter.total_bytes() == (2 * L - 1) * UNIT
    q.run_next()
    assert q.queued_bytes == q.pending_bytes() == 2 * (L - 1) * UNIT
    q.run()
    assert q.queued_bytes == 0 and meter.total_bytes() == 0
    assert meter.peak_bytes == (2 * L - 1) * UNIT


def test_a_storage_both_saved_and_held_by_a_w_task_counts_once() -> None:
    # ReLU stack, split: a ReLU's result is saved by the ReLU and by the next Linear; the
    # Linear's I pass queues it in a W task while the ReLU still holds it saved. After the
    # whole backward the W tasks hold every ReLU result but the last and every grad_output.
    model, x = _stack(nn.ReLU), torch.randn(B, D)
    during: list[int] = []
    with deferred_weight_grads(model) as q:
        meter = _meter(model, x, extra=q.held_storages)
        with meter.measure():
            h = model[:-2](x)  # the last Linear's input: the ReLU before it saved it too
            # after the last Linear's I pass, before that ReLU's backward: the L - 1 ReLU
            # results still saved (h among them) and the W task's h and grad_output
            h.register_hook(lambda g: during.append(meter.total_bytes()))
            model[-2:](h).sum().backward()
    assert during == [L * UNIT], "a storage saved and held by a W task counted twice"
    assert meter.live_bytes == 0 and meter.total_bytes() == (2 * L - 1) * UNIT
    assert meter.peak_bytes == (2 * L - 1) * UNIT
    q.run()
