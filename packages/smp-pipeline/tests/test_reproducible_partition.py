"""The automatic partition is reproducible: five constructions of the same model (Hugging Face
Llama and Gemma2, built from a seed) traced with the same inputs give the same module graph,
hence the same partition, with the default counted costs; timed costs do not."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from smp_pipeline.partition import auto_assignment, partition_model, trace_dict
from torch import nn

pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="sdpa", pad_token_id=0, bos_token_id=0, eos_token_id=0,
    ))  # fmt: skip


def gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="eager", pad_token_id=0, bos_token_id=0, eos_token_id=0,
    ))  # fmt: skip


def graphs(build: Callable[[], nn.Module], costs: str, runs: int = 5) -> list[dict[str, Any]]:
    ids = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    out = []
    for _ in range(runs):
        torch.manual_seed(0)
        model = build().eval()
        out.append(trace_dict(model, kwargs={"input_ids": ids, "labels": ids}, costs=costs))
    return out


@pytest.mark.parametrize("build", [llama, gemma2], ids=["llama", "gemma2"])
def test_five_constructions_give_one_partition(build: Callable[[], nn.Module]) -> None:
    found = graphs(build, "flops")
    assert all(g == found[0] for g in found[1:])  # the costs themselves, not only the split
    costs = [m["forward_ms"] for m in found[0]["modules"]]
    assert all(c is not None and c >= 0 for c in costs) and max(costs) > 0
    for stages in (2, 3, 4):
        splits = [auto_assignment(g, stages, alpha=0.8) for g in found]
        assert all(s == splits[0] for s in splits[1:]), stages
        assert len(set(splits[0].values())) == stages


def test_partition_model_uses_counted_costs_by_default() -> None:
    torch.manual_seed(0)
    model = llama().eval()
    ids = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    first, second = (
        partition_model(model, 2, lambda obj: obj, root=True, kwargs={"input_ids": ids})
        for _ in range(2)
    )
    assert first.assignment == second.assignment
    assert first.graph.to_dict() == second.graph.to_dict()


def test_timed_costs_vary_which_is_why_they_are_not_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy machine, made reproducible: each clock reading late by a varying amount.
    real = time.perf_counter
    tick = iter(range(10**9))
    monkeypatch.setattr(time, "perf_counter", lambda: real() + (next(tick) % 7) * 1e-3)
    timed = graphs(llama, "measured", runs=2)
    assert timed[0] != timed[1]
    counted = graphs(llama, "flops", runs=2)
    assert counted[0] == counted[1]


def test_unknown_costs_are_refused() -> None:
    from smp_pipeline import PipelineConfigError

    with pytest.raises(PipelineConfigError, match="costs"):
        trace_dict(nn.Linear(2, 2), (torch.randn(1, 2),), costs="guess")
