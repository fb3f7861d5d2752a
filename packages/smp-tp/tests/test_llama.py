"""Hugging Face Llama, Mistral and Qwen2 through parallelize(), on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
from launch import torchrun

pytest.importorskip("transformers")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_llama_family_matches_original(nprocs: int) -> None:
    out = torchrun("check_llama.py", nprocs, timeout=280)
    assert out.count("ALL OK") == nprocs
    for name in ("llama-tied-gqa", "llama-untied", "mistral-eager", "qwen2-bias-tied"):
        for prescaled in (False, True):
            assert f"{name} prescaled={prescaled}: OK" in out
    assert "llama-base prescaled=False: OK" in out
    assert "llama-tied-gqa prescaled=False batch=1: OK" in out
    # one collective pair per attention block and per MLP block (check_llama.PER_LAYER)
    assert "llama collectives per decoder layer (prescaled=False): {'forward': {'all_gather': 2, " in out
    assert "llama collectives per decoder layer (prescaled=True): {'forward': {'all_reduce': 2}, " in out
