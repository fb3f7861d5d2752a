"""Context parallelism by all-to-all over heads (``ulysses_attention``): 2 gloo ranks (and 4
once) against one process's SDPA, through ``check_context.py ulysses``; the refusals and the
one-rank path in this process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from launch import torchrun
from smp_tp import ulysses_attention

CASES = ["causal balanced", "causal contiguous", "non-causal contiguous", "non-causal balanced",
         "causal balanced gqa", "causal balanced gqa dv"]


@pytest.fixture(scope="module")
def output() -> str:
    return torchrun("check_context.py", 2, "ulysses", timeout=200)


@pytest.mark.parametrize("label", CASES)
def test_matches_one_process(output: str, label: str) -> None:
    assert output.count("ALL OK") == 2
    assert output.count(f"] {label} cp=2: checked") == 2, output


def test_too_few_kv_heads_is_an_error(output: str) -> None:
    msg = ("ValueError: ulysses_attention: the heads are split over the 2 ranks, so 2 must divide both "
           "the 4 query heads and the 1 key/value heads; use the ring (context_parallel_attention) instead")
    assert output.count(msg) == 2, output


def test_odd_shard_is_an_error(output: str) -> None:
    assert output.count("ValueError: ulysses_attention: a balanced shard holds two equal chunks") == 2


def test_four_ranks() -> None:
    out = torchrun("check_context.py", 4, "ulysses", "quick", timeout=200)
    assert out.count("ALL OK") == 4
    assert out.count("] causal balanced gqa cp=4: checked") == 4, out


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_sdpa(causal: bool) -> None:
    # One rank splits nothing, so one kv head is fine here.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 1, 16, 8), torch.randn(2, 1, 16, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert torch.equal(ulysses_attention(q, k, v, None, causal=causal), want)


@pytest.mark.parametrize(("shapes", "match"), [
    (((1, 3, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)), "not a multiple"),
    (((1, 2, 8, 4), (1, 2, 6, 4), (1, 2, 6, 4)), "same sequence shard"),
    (((2, 8, 4), (2, 8, 4), (2, 8, 4)), r"\[batch, heads, sequence, head_dim\]"),
])
def test_bad_shapes_are_errors(shapes: tuple, match: str) -> None:
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        ulysses_attention(q, k, v, None, causal=True)


def test_unknown_layout_is_an_error() -> None:
    x = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        ulysses_attention(x, x, x, None, causal=True, layout="zigzag")
