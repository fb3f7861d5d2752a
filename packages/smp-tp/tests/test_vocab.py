"""Vocabulary-parallel embedding, head and cross entropy, on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
from launch import torchrun


@pytest.mark.parametrize("nprocs", [2, 4])
def test_vocab_parallel_matches_plain_torch(nprocs: int) -> None:
    out = torchrun("check_vocab.py", nprocs, timeout=240)
    assert out.count("ALL OK") == nprocs
    assert "vocab collectives per step: scaled" in out
    for prescaled in (False, True):
        assert f"new architecture via tp_register_block/tp_register_vocab_parallel, prescaled={prescaled}: OK" in out
