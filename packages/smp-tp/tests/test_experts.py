"""Expert parallelism of transformers-5 MoE experts (Mixtral, Qwen3-MoE, DeepSeek-V3), 2 gloo ranks."""

from __future__ import annotations

import math

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


CAPACITY_LABELS = [
    f"capacity cf=0.5 impl={impl} grouped_mm={grouped} per_sender_gemm={per_sender}: checked"
    for impl in ("eager", "grouped_mm")
    for grouped, per_sender in ((False, False), (True, False), (False, True))
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


def test_capacity_factor(output: str) -> None:
    """Both ranks: a capacity nothing exceeds is bitwise cf=None; cf=0.5 drops slots and
    matches the unsplit experts with those slots' weights zeroed; cf=0 is refused."""
    assert output.count("capacity cf=8 nothing dropped: checked") == 2
    for label in CAPACITY_LABELS:
        assert output.count(label) == 2, label
    assert output.count("ValueError: capacity_factor must be None or > 0, not 0.0") == 2


def test_degree_not_dividing_experts_is_an_error(output: str) -> None:
    assert output.count("ValueError: distribute_experts: the expert-parallel degree 2 does not divide "
                        "the number of experts 3") == 2


def _mixtral_experts(impl: str) -> torch.nn.Module:
    """transformers' MixtralExperts (8 experts, top-3, hidden 16), weights larger than its init."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3,
                        experts_implementation=impl)
    ref = MixtralExperts(cfg)
    with torch.no_grad():
        ref.gate_up_proj.normal_(0, 0.3)
        ref.down_proj.normal_(0, 0.3)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("grouped", [False, True])
def test_degree_one_is_the_original_bitwise(impl: str, grouped: bool, dtype: torch.dtype) -> None:
    """No process group: the same module (sorting, grouping, combine) without the all-to-alls."""
    ref = _mixtral_experts(impl)
    ref = ref.to(dtype)
    ep = smp_tp.distribute_experts(ref, grouped_mm=grouped)
    x = torch.randn(12, 16).to(dtype)
    idx = torch.rand(12, 8).topk(3, dim=1).indices
    w = torch.rand(12, 3)  # float32, as Mixtral's router returns them
    y, y_ref = ep(x, idx, w), ref(x, idx, w)
    assert y.dtype == y_ref.dtype == dtype
    assert torch.equal(y, y_ref)


def _kept(idx: torch.Tensor, num_experts: int, cf: float) -> torch.Tensor:
    """The capacity rule slot by slot: a slot stays when fewer than ``cap`` earlier slots
    (token order, then top-k order) chose its expert."""
    n, k = idx.shape
    cap = math.ceil(cf * n * k / num_experts)
    seen = [0] * num_experts
    mask = torch.ones(n, k)
    for t in range(n):
        for c in range(k):
            e = int(idx[t, c])
            mask[t, c] = float(seen[e] < cap)
            seen[e] += 1
    return mask


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("grouped", [False, True])
def test_degree_one_capacity(impl: str, grouped: bool) -> None:
    """No process group: the cap applies as with one: the original with the dropped slots'
    weights zeroed; a weight of a dropped slot gets a zero gradient."""
    ref = _mixtral_experts(impl)
    ep = smp_tp.distribute_experts(ref, grouped_mm=grouped, capacity_factor=0.5)
    x = torch.randn(12, 16)
    idx = torch.rand(12, 8).topk(3, dim=1).indices
    w = torch.rand(12, 3, requires_grad=True)
    mask = _kept(idx, 8, 0.5)
    y = ep(x, idx, w)
    y.sum().backward()
    assert ep.dropped_slots == int((mask == 0).sum()) > 0
    torch.testing.assert_close(y, ref(x, idx, w.detach() * mask), rtol=1e-5, atol=1e-6)
    assert w.grad is not None and torch.all(w.grad[mask == 0] == 0)
    assert torch.all(w.grad[mask == 1] != 0)


@pytest.mark.parametrize("cf", [0.0, -1.0, float("nan")])
def test_capacity_factor_not_positive_is_an_error(cf: float) -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    experts = MixtralExperts(MixtralConfig(hidden_size=8, intermediate_size=8, num_local_experts=4))
    with pytest.raises(ValueError, match="capacity_factor"):
        smp_tp.distribute_experts(experts, capacity_factor=cf)


def test_not_fused_experts_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a fused experts module"):
        smp_tp.distribute_experts(torch.nn.Linear(2, 2))
