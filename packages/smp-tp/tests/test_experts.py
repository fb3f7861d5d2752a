"""Expert parallelism of transformers-5 MoE experts (Mixtral, Qwen3-MoE, DeepSeek-V3), 2 gloo ranks."""

from __future__ import annotations

import pytest
from launch import torchrun

pytest.importorskip("transformers")

LABELS = [
    f"{name} impl={impl} grouped_mm={grouped} per_sender_gemm={per_sender}: checked"
    for name in ("mixtral", "qwen3_moe", "deepseek_v3")
    for impl in ("eager", "grouped_mm")
    for grouped in (False, True)
    for per_sender in (False, True)
]


@pytest.fixture(scope="module")
def output() -> str:
    return torchrun("check_experts.py", 2, timeout=200)


def test_models_match_original(output: str) -> None:
    assert output.count("ALL OK") == 2
    for label in LABELS:
        assert output.count(label) == 2, label
    for grouped in (False, True):
        assert output.count(f"skewed grouped_mm={grouped}: checked") == 2


def test_degree_not_dividing_experts_is_an_error(output: str) -> None:
    assert output.count("ValueError: distribute_experts: the expert-parallel degree 2 does not divide "
                        "the number of experts 3") == 2
