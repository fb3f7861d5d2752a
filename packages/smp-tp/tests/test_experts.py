"""Expert parallelism of transformers-5 MoE experts (Mixtral, Qwen3-MoE, DeepSeek-V3), 2 gloo ranks."""

from __future__ import annotations

import pytest
import smp_tp
import torch
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("grouped", [False, True])
def test_degree_one_is_the_original_bitwise(impl: str, grouped: bool, dtype: torch.dtype) -> None:
    """No process group: the same module (sorting, grouping, combine) without the all-to-alls."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3,
                        experts_implementation=impl)
    ref = MixtralExperts(cfg)
    with torch.no_grad():
        ref.gate_up_proj.normal_(0, 0.3)
        ref.down_proj.normal_(0, 0.3)
    ref = ref.to(dtype)
    ep = smp_tp.distribute_experts(ref, grouped_mm=grouped)
    x = torch.randn(12, 16).to(dtype)
    idx = torch.rand(12, 8).topk(3, dim=1).indices
    w = torch.rand(12, 3)  # float32, as Mixtral's router returns them
    y, y_ref = ep(x, idx, w), ref(x, idx, w)
    assert y.dtype == y_ref.dtype == dtype
    assert torch.equal(y, y_ref)


def test_not_fused_experts_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a fused experts module"):
        smp_tp.distribute_experts(torch.nn.Linear(2, 2))
