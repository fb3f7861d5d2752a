"""Hugging Face T5 through parallelize(), on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
from launch import torchrun

pytest.importorskip("transformers")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_t5_matches_original(nprocs: int) -> None:
    out = torchrun("check_t5.py", nprocs, timeout=280)
    assert out.count("ALL OK") == nprocs
    for name in ("t5-relu-tied", "t5-gated-untied", "t5-encoder"):
        for prescaled in (False, True):
            assert f"{name} prescaled={prescaled}: OK" in out
    assert "t5-relu-tied prescaled=False batch=1: OK" in out
    # one collective pair per attention and feed-forward module (check_t5.PER_BLOCK)
    assert "t5 collectives per encoder block (prescaled=False): {'forward': {'all_gather': 2, " in out
    assert "t5 collectives per decoder block (prescaled=True): {'forward': {'all_reduce': 3}, " in out
