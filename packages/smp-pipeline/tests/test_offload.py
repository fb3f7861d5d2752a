"""Activation offloading in one process: the pool, the prefetch window, exactness.

The pipeline's own schedule drives the offloader through the executor (tests/mpi_cases.py,
suites ``offload`` and ``offload4``); here a test plays the schedule by hand: forwards of
every microbatch, then their backwards, telling the offloader when each backward starts.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from smp_pipeline import ActivationOffloader, PipelineConfigError
from smp_pipeline.checkpointing import checkpoint_in_place
from smp_pipeline.offload import offloading
from torch import nn

D, M, BLOCKS = 8, 4, 3


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(BLOCKS)])


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, D, generator=g) for _ in range(M)]


def run(
    offloader: ActivationOffloader | None,
    order: list[int] | None = None,
    announce: bool = True,
    config: dict[str, str | None] | None = None,
    together: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward every microbatch, then backward in ``order``; grads and losses. The
    offloader is told of each backward's start (``announce``) as the executor would, or
    of all of them before the first (``together``)."""
    net = model()
    checkpoint_in_place(net, config if config is not None else {"": "each"})
    current: list[int | None] = [None]
    if offloader is not None:
        # What the executor says: the forward task's microbatch, None during backward.
        offloader._key = lambda: None if current[0] is None else (1, current[0])
    losses = []
    with offloading(offloader):
        for mb, x in enumerate(batches()):
            current[0] = mb
            losses.append(net(x).square().mean() / M)
        current[0] = None
        if offloader is not None and together:
            for mb in order or range(M):
                offloader.backward_started(1, mb)
        for mb in order or range(M):
            if offloader is not None and announce:
                offloader.backward_started(1, mb)
            losses[mb].backward()
    return [p.grad for p in net.parameters()], [loss.detach() for loss in losses]


def reference() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return run(None)


def assert_same(got: tuple[list[torch.Tensor], ...], want: tuple[list[torch.Tensor], ...]) -> None:
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)


def test_offloading_is_exact_and_prefetches_within_the_horizon() -> None:
    off = ActivationOffloader(1, lambda: None)
    assert_same(run(off), reference())
    s = off.stats
    saved_per_mb = BLOCKS * 2 * D * 4  # each block's input: 2 x D float32
    assert s.tensors_offloaded == M * BLOCKS and s.bytes_offloaded == M * saved_per_mb
    assert s.bytes_reloaded == s.bytes_offloaded
    assert s.prefetch_hits == M * BLOCKS and s.prefetch_misses == 0
    assert s.max_ahead == 1  # the horizon: one microbatch loaded ahead of its backward
    # mb's own and the next one's: at most two microbatches on the device at once.
    assert s.peak_device_bytes == 2 * saved_per_mb
    assert s.peak_host_bytes == M * saved_per_mb
    assert off.pooled_microbatches == [] and off.host_bytes == 0 and off.device_bytes == 0


@pytest.mark.parametrize("horizon", [2, 4])
def test_larger_horizons_load_more_ahead(horizon: int) -> None:
    off = ActivationOffloader(horizon, lambda: None)
    assert_same(run(off), reference())
    assert off.stats.max_ahead == min(horizon, M - 1)
    assert off.stats.prefetch_misses == 0


def test_counting_mode_measures_the_baseline() -> None:
    off = ActivationOffloader(1, lambda: None, move=False)
    assert_same(run(off), reference())
    s = off.stats
    assert s.tensors_offloaded == 0 and s.bytes_reloaded == 0
    assert s.peak_device_bytes == M * BLOCKS * 2 * D * 4  # every microbatch's inputs held


def test_unannounced_backwards_load_synchronously() -> None:
    """Nobody says a backward started: the first microbatch loads in unpack; once it is
    consumed, the window moves on and the next ones are prefetched."""
    off = ActivationOffloader(2, lambda: None)
    assert_same(run(off, announce=False), reference())
    assert off.stats.prefetch_misses == BLOCKS
    assert off.stats.prefetch_hits == (M - 1) * BLOCKS


def test_backwards_started_together_load_one_window() -> None:
    """A driver admits several backwards at once (simple schedule): only the window is
    loaded, the others wait on the host until consumption moves it."""
    off = ActivationOffloader(1, lambda: None)
    assert_same(run(off, together=True), reference())
    saved_per_mb = BLOCKS * 2 * D * 4
    assert off.stats.peak_device_bytes == 2 * saved_per_mb
    assert off.stats.prefetch_misses == 0 and off.stats.max_ahead == 1


def test_out_of_order_backwards_evict_to_keep_the_horizon() -> None:
    off = ActivationOffloader(1, lambda: None)
    # 0 loads 1 ahead; 3 then wants nothing ahead but 1 (the next unstarted): 2 stays out.
    got = run(off, order=[0, 3, 2, 1])
    want = reference()
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    for a, b in zip(got[0], want[0]):  # another summation order than the reference
        torch.testing.assert_close(a, b)
    assert off.stats.max_ahead <= 1
    assert off.stats.prefetch_hits + off.stats.prefetch_misses == M * BLOCKS


def test_the_original_storage_is_released() -> None:
    """Block 0's output is only kept by block 1's checkpoint: offloaded, it is freed."""
    for offload in (False, True):
        net = model()
        checkpoint_in_place(net, {"": "each"})
        refs: list[weakref.ref[torch.Tensor]] = []
        net[0].register_forward_hook(lambda _m, _a, out, refs=refs: refs.append(weakref.ref(out)))
        off = ActivationOffloader(1, lambda: (0, 0)) if offload else None
        with offloading(off):
            loss = net(batches()[0]).sum()
        assert (refs[0]() is None) == offload
        loss.backward()


def test_nested_checkpoints_offload_the_outer_inputs_only() -> None:
    """A checkpointed container with checkpointed children: recomputation stays consistent."""
    config = {"": "each", "0": "each"}
    off = ActivationOffloader(1, lambda: None)
    assert_same(run(off, config=config), run(None, config=config))
    assert off.stats.tensors_offloaded == M * BLOCKS


def test_recomputation_and_unknown_microbatches_keep_their_tensors() -> None:
    net = model()
    checkpoint_in_place(net, {"": "each"})
    off = ActivationOffloader(1, lambda: None)  # no forward microbatch known
    with offloading(off):
        net(batches()[0]).sum().backward()
    assert off.stats.tensors_offloaded == 0


def test_bad_horizons_are_refused() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(PipelineConfigError, match="activation_loading_horizon"):
            ActivationOffloader(bad, lambda: None)  # type: ignore[arg-type]


def test_deep_copy_of_reference_is_unaffected() -> None:
    """Offloading changes nothing outside checkpointed calls."""
    net = model()
    ref = copy.deepcopy(net)
    off = ActivationOffloader(1, lambda: (0, 0))
    with offloading(off):
        net(batches()[0]).sum().backward()
    ref(batches()[0]).sum().backward()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert off.stats.tensors_offloaded == 0
