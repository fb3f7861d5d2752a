"""Sequence parallelism and selective recomputation (attention core, MLP activation) of the speed layout,
on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
from launch import torchrun


@pytest.mark.parametrize("nprocs", [2, 4])
def test_sequence_parallel_matches_single_rank(nprocs: int) -> None:
    out = torchrun("check_sequence.py", nprocs, timeout=240)
    assert out.count("ALL OK") == nprocs
    for name in ("attention_post", "layer_cross", "transformer_pre_causal", "lmhead_gpt"):
        for option in ("sp", "sp+recompute", "sp+recompute+mlp")[:2 if name == "attention_post" else 3]:
            assert f"{name}/{option}: OK" in out
    assert "output_gelu/sp: OK" in out and "output_gelu/mlp: OK" in out
    assert "bitwise: recompute_attention / recompute_mlp_activation / both == stored" in out
    assert ("collectives per layer (speed, sequence_parallel): {'forward': {'all_gather': 2, 'reduce_scatter': 2}, "
            "'backward': {'all_gather': 4, 'reduce_scatter': 2}}") in out
    assert f"saved bytes per rank (tp={nprocs})" in out
