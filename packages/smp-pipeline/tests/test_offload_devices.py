"""Activation offloading on one rank, on CPU and, where present, on CUDA (pinned host copies
and loads on a side stream: the code path the MPI suites cannot reach on a machine without a
GPU). The CPU case runs everywhere, so the test's own logic is checked on every machine.

Invariant: a step with offloading gives bit-identical losses and gradients to the same
runtime without it (offloading moves bytes, never changes them), and the counters show the
tensors really went to the host and came back, prefetched.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import Block, mse_step
from no_peers import NoPeers
from smp_pipeline import PipelineRuntime
from torch import nn

pytestmark = pytest.mark.timeout(120)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


def _steps(model: nn.Module, offload: bool, x: torch.Tensor, y: torch.Tensor, horizon: int):  # type: ignore[no-untyped-def]
    rt = PipelineRuntime(
        model, NoPeers(), 0, 1, assignment={}, checkpointing={"": "each"},
        offload_activations=offload, activation_loading_horizon=horizon, timeout_s=60,
    )  # fmt: skip
    step = mse_step(model, rt.backward)
    losses, grads = [], []
    try:
        for schedule in ("simple", "interleaved"):
            for p in model.parameters():
                p.grad = None
            out = rt.run_step(step, (x, y), num_microbatches=8, schedule=schedule)
            losses.append(torch.stack([o.detach() for o in out]).cpu())
            grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        stats = rt.offload_stats
    finally:
        rt.close()
    return losses, grads, stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("horizon", [1, 4])
def test_offloading_is_bitwise_and_moves_the_saved_inputs(device: str, horizon: int) -> None:
    torch.manual_seed(0)
    width, rows = (64, 16) if device == "cpu" else (1024, 256)
    model = nn.Sequential(*(Block(width) for _ in range(4))).to(device)
    x = torch.randn(8 * rows, width, device=device)
    y = torch.randn(8 * rows, width, device=device)
    plain_losses, plain_grads, none = _steps(copy.deepcopy(model), False, x, y, horizon)
    losses, grads, stats = _steps(copy.deepcopy(model), True, x, y, horizon)
    assert none is None
    for a, b in zip(losses, plain_losses):
        assert torch.equal(a, b), (a, b)
    for step_grads, plain_step in zip(grads, plain_grads):
        for i, (g, pg) in enumerate(zip(step_grads, plain_step)):
            assert torch.equal(g, pg), f"parameter {i}: max diff {(g - pg).abs().max()}"
    assert stats is not None
    # Every checkpointed block saves its input for each microbatch: 4 x 8, twice.
    assert stats.tensors_offloaded == 2 * 4 * 8, stats
    assert stats.bytes_offloaded == stats.tensors_offloaded * rows * width * 4, stats
    assert stats.bytes_reloaded >= stats.bytes_offloaded, stats
    assert stats.prefetch_hits > 0, stats
    assert stats.max_ahead <= horizon, stats
