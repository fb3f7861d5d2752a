"""Distributed modules vs their single-rank versions, on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
from launch import torchrun


@pytest.mark.parametrize("nprocs", [2, 4])
def test_modules_match_single_rank(nprocs: int) -> None:
    out = torchrun("check_modules.py", nprocs, timeout=240)
    assert out.count("ALL OK") == nprocs
    # Appendix F: per transformer layer
    assert "collectives per layer (speed): {'forward': {'all_reduce': 2}, 'backward': {'all_reduce': 2}}" in out
    assert "collectives per layer (memory)" in out
    # optimize="memory" with recomputation: exact saved-byte counts checked on every rank
    assert f"saved bytes per rank (tp={nprocs})" in out
