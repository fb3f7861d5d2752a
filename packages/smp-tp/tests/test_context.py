"""Context-parallel (ring) attention: 2 gloo ranks (and 4 once) against one process's SDPA;
the layouts, the refusals and the one-rank path in this process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from launch import torchrun
from smp_tp.layers.context import (
    ContextParallelAttention,
    context_parallel_attention,
    gather_sequence,
    split_sequence,
)

CASES = ["causal balanced", "causal contiguous", "non-causal contiguous", "non-causal balanced",
         "causal balanced gqa", "causal contiguous gqa module", "causal balanced gqa dv"]


@pytest.fixture(scope="module")
def output() -> str:
    return torchrun("check_context.py", 2, timeout=200)


@pytest.mark.parametrize("label", CASES)
def test_matches_one_process(output: str, label: str) -> None:
    assert output.count("ALL OK") == 2
    assert output.count(f"] {label} cp=2: checked") == 2, output


def test_odd_shard_is_an_error(output: str) -> None:
    assert output.count("ValueError: context_parallel_attention: a balanced shard holds two equal chunks") == 2


def test_four_ranks() -> None:
    out = torchrun("check_context.py", 4, "quick", timeout=200)
    assert out.count("ALL OK") == 4
    assert out.count("] causal balanced gqa cp=4: checked") == 4, out


def test_balanced_layout_and_inverse() -> None:
    x = torch.arange(16).view(1, 1, 16, 1)
    parts = [split_sequence(x, r, 4, 2, "balanced") for r in range(4)]
    assert parts[0].flatten().tolist() == [0, 1, 14, 15]
    assert parts[3].flatten().tolist() == [6, 7, 8, 9]
    assert torch.equal(gather_sequence(parts, 2, "balanced"), x)
    parts = [split_sequence(x, r, 4, 2, "contiguous") for r in range(4)]
    assert parts[1].flatten().tolist() == [4, 5, 6, 7]
    assert torch.equal(gather_sequence(parts, 2, "contiguous"), x)


@pytest.mark.parametrize(("layout", "length"), [("balanced", 30), ("contiguous", 33)])
def test_indivisible_sequence_is_an_error(layout: str, length: int) -> None:
    with pytest.raises(ValueError, match=f"sequence length {length} is not divisible"):
        split_sequence(torch.zeros(1, 1, length, 2), 0, 2, 2, layout)


def test_unknown_layout_is_an_error() -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        split_sequence(torch.zeros(1, 1, 8, 2), 0, 2, 2, "zigzag")


@pytest.mark.parametrize(("kwargs", "match"), [({"window": 8}, "sliding-window"), ({"softcap": 30.0}, "soft-capping")])
def test_window_and_softcap_are_refused(kwargs: dict, match: str) -> None:
    x = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match=match):
        context_parallel_attention(x, x, x, None, causal=True, **kwargs)


def test_gqa_heads_must_divide() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        context_parallel_attention(torch.zeros(1, 3, 8, 4), torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4),
                                   None, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_sdpa(causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert torch.equal(ContextParallelAttention(None, causal=causal)(q, k, v), want)


@pytest.mark.parametrize("mode", ["full", "diagonal"])
def test_fused_block_matches_math(mode: str) -> None:
    """One ring block through the fused CPU kernel against the float32 math fallback: the
    forward's (out, lse), and the backward given the output and lse merged with a second
    block (as the ring does), with grouped-query k/v."""
    from smp_tp.layers import context as cp

    gen = torch.Generator().manual_seed(3)
    q, do = torch.randn(2, 4, 16, 8, generator=gen), torch.randn(2, 4, 16, 8, generator=gen)
    k, v, k2, v2 = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(4))
    m = cp._DIAG if mode == "diagonal" else cp._FULL
    blocks = {kernel: cp._block_forward(kernel, q, k, v, 0.3, m, 2) for kernel in ("cpu", None)}
    for got, want in zip(blocks["cpu"], blocks[None], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out, lse = cp._merge(blocks[None], cp._block_forward(None, q, k2, v2, 0.3, cp._FULL, 2))
    grads = {kernel: cp._block_backward(kernel, q, k, v, do, out, lse, 0.3, m, 2) for kernel in ("cpu", None)}
    for got, want in zip(grads["cpu"], grads[None], strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_layer_with_a_context_group_refuses_masks_and_dropout() -> None:
    """``DistributedAttentionLayer.context_group`` runs its core as ring attention: what the
    ring cannot do is refused by name before any exchange (no group needed to see it)."""
    from smp_tp import DistributedAttentionLayer

    layer = DistributedAttentionLayer(4, 8, 32, 0.0, 0.0, 1e-5, 0.02, True, False, 16, True, False)
    layer.context_group = object()  # (never reached: refused first)
    x = torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match="without a mask or attention dropout"):
        layer(x, torch.ones(2, 1, 16, 16, dtype=torch.bool))
    dropping = DistributedAttentionLayer(4, 8, 32, 0.1, 0.0, 1e-5, 0.02, True, False, 16, True, False)
    dropping.context_group = object()
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        dropping.train()(x)
