"""Activation checkpointing replays the tensor-parallel dropout streams (one process)."""

from __future__ import annotations

import pytest
import smp_tp
import torch
from torch.utils.checkpoint import checkpoint


def run(mode: str, optimize: str) -> list[torch.Tensor]:
    smp_tp.set_tensor_parallel_seed(11)
    torch.manual_seed(0)
    layer = smp_tp.DistributedTransformerLayer(
        4, 8, 32, 64, 0.3, 0.3, optimize=optimize, recompute_activations=False)
    x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    outs = []
    for _ in range(2):  # the second call must draw new masks, checkpointed or not
        if mode == "plain":
            outs.append(layer(x))
        else:
            ctx = smp_tp.checkpoint_context if mode == "replayed" else None
            kwargs = {"context_fn": ctx} if ctx is not None else {}
            outs.append(checkpoint(layer, x, use_reentrant=False, **kwargs))
    (outs[0].pow(2).sum() + outs[1].pow(3).sum()).backward()
    return outs + [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_checkpoint_context_replays_dropout(optimize: str) -> None:
    want = run("plain", optimize)
    got = run("replayed", optimize)
    assert not torch.equal(want[0], want[1])
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"tensor {i} differs by {(g - w).abs().max()}"
    # Without the context the recomputation draws other masks: the gradients differ.
    bare = run("bare", optimize)
    assert torch.equal(bare[0], want[0])  # the forward itself is the same ...
    assert any(not torch.equal(g, w) for g, w in zip(bare[2:], want[2:]))  # ... backward is not


def test_rng_state_round_trip_and_streams_created_later() -> None:
    smp_tp.set_tensor_parallel_seed(3)
    g = smp_tp.get_generator("cpu", "tp_shared")
    state = smp_tp.get_rng_state()
    first = torch.rand(4, generator=g)
    later = smp_tp.get_generator("cpu", "tp_rank")  # created after the snapshot
    a = torch.rand(4, generator=later)
    smp_tp.set_rng_state(state)
    assert torch.equal(torch.rand(4, generator=smp_tp.get_generator("cpu", "tp_shared")), first)
    assert torch.equal(torch.rand(4, generator=smp_tp.get_generator("cpu", "tp_rank")), a)
