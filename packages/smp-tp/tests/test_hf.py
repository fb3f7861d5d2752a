"""Hugging Face GPT-2, BERT and RoBERTa via parallelize(), on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
from launch import torchrun

pytest.importorskip("transformers")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_hf_models_match_original(nprocs: int) -> None:
    out = torchrun("check_hf.py", nprocs, timeout=280)
    assert out.count("ALL OK") == nprocs
    for name in ("gpt2", "bert", "roberta"):
        for prescaled in (False, True):
            for optimize in ("speed", "memory"):
                assert f"{name} prescaled={prescaled} optimize={optimize}: OK (2 layers replaced; " in out
