"""``context_parallel_degree`` (issue 46) through ``smp.init`` / ``smp.DistributedModel``.

One MPI job per group of cases (``scripts/context_parallel.py``): tiny Llama, Qwen2 and
Mistral models built from configs, sequences of 64 tokens split over the cp group, 3 steps
of Adam checked after every step against one process training on the full sequences of the
global batch (the loss, gathered gradients and parameters: see the script for the bounds).
cp = 2, cp = 4, cp x dp under both placements, cp x tp, cp x pp (tied embeddings, both
schedules) with a checkpoint resumed at cp = 1. Bad degrees, unsupported models and
sequences raise ``ConfigError`` (or a named error) on every rank; two broken variants (the
gradients averaged over cp instead of summed, the labels split without the shift) must fail
the checks. The 2-rank job also bounds the bytes autograd saves per rank at cp = 2 by 0.6x
one process's on the same batch.
"""

from __future__ import annotations

import pytest
from conftest import SharedJob, launch, ok_cases

pytest.importorskip("transformers")


def _case(name: str, model: str = "llama", **config: object) -> dict:
    return {"name": name, "model": model, "config": config}


CP2 = {"context_parallel_degree": 2}

TWO_RANKS = [
    # "auto": the all-to-all over heads where cp divides them (here), the ring elsewhere.
    {**_case("llama-cp2", **CP2), "saved_limit": 0.6, "attention": "all_to_all"},
    {**_case("llama-cp2-ring", **CP2, context_parallel_attention="ring"), "saved_limit": 0.6, "attention": "ring"},
    _case("qwen2-cp2", "qwen2", **CP2),
    # Mistral's sliding window, longer than the sequence: no effect, accepted.
    {**_case("mistral-cp2", "mistral", **CP2), "steps": 1},
    # The checks fail on the bugs they guard.
    {**_case("broken-sum", **CP2), "broken": "sum", "steps": 1},
    {**_case("broken-shift", **CP2), "broken": "shift", "steps": 1},
    # A model of one's own from smp-tp's attention layers: each gets the cp group; its loss
    # from smp.sequence_share / smp.sequence_mean. Without the group the check fails.
    _case("smp-tp-layers-cp2", "smptp", **CP2),
    {**_case("broken-unrouted", "smptp", **CP2), "broken": "unrouted", "steps": 1},
    # Refusals, named: attention soft-capping, a model whose attention smp cannot route.
    {**_case("gemma2-softcap", "gemma2", **CP2), "error": "context_parallel_degree"},
    {**_case("not-hf", "mlp", **CP2), "error": "context_parallel_degree"},
    # An unknown attention choice is named (the all-to-all's head condition: see FOUR_RANKS).
    {**_case("bad-choice", **CP2, context_parallel_attention="ulysses"), "error": "context_parallel_attention"},
]

# Refused at the first call, on every rank (a failed step ends the job's use of smp: one per
# job, its last case): a sequence not divisible by 2 x cp, a sliding window shorter than the sequence.
STEP_ERRORS = [
    {**_case("odd-sequence", **CP2), "seq": 66,
     "step_error": "ConfigError: smp config key 'context_parallel_degree': the sequence length 66"},
    {**_case("mistral-window16", "mistral-window16", **CP2), "step_error": "a sliding window of 16 tokens"},
]

FOUR_RANKS = {
    "cp-dp": [
        # 2 key/value heads, cp=4: "auto" takes the ring; the all-to-all is refused by name.
        {**_case("llama-cp4", context_parallel_degree=4), "attention": "ring"},
        {**_case("llama-cp4-all-to-all", context_parallel_degree=4, context_parallel_attention="all_to_all"),
         "error": "context_parallel_attention"},
        _case("llama-cp2-dp2", **CP2),
        _case("llama-cp2-dp2-spread", **CP2, placement_strategy="spread"),
        {**_case("bad-cp3", context_parallel_degree=3), "error": "context_parallel_degree"},
    ],
    "cp-tp-pp": [
        {**_case("llama-cp2-tp2", **CP2, tensor_parallel_degree=2), "attention": "ring"},  # (1 kv head per TP rank)
        # The ranks of a stage's cp group sit in different pipelines and must run the ring's
        # exchanges in one order (one order-channel leader per TP x CP block): with the leader
        # over the TP group only, 2 of 3 runs of this case timed out or aborted.
        {**_case("llama-tied-cp2-pp2-mb4", "llama-tied", **CP2, pipeline_parallel_degree=2, microbatches=4),
         "batch": 8, "resume": {"ddp": True}},
        _case("qwen2-cp2-pp2-simple", "qwen2", **CP2, pipeline_parallel_degree=2, microbatches=2, pipeline="simple"),
    ],
}


# The first refused case ends the 2-rank job (conftest.SharedJob: one launch, whose imports
# cost more than the refusal); the other needs a job of its own.
TWO = SharedJob("context_parallel.py", 2)
TWO.add("two-ranks", TWO_RANKS, timeout=300)
REFUSED = {STEP_ERRORS[0]["name"]: TWO, STEP_ERRORS[1]["name"]: SharedJob("context_parallel.py", 2)}
for _case_refused in STEP_ERRORS:
    REFUSED[_case_refused["name"]].add(_case_refused["name"], [_case_refused], timeout=180)


def test_context_parallel_two_ranks() -> None:
    TWO.check("two-ranks")


@pytest.mark.parametrize("case", STEP_ERRORS, ids=[c["name"] for c in STEP_ERRORS])
def test_context_parallel_refused_at_the_call(case: dict) -> None:
    REFUSED[case["name"]].check(case["name"])


@pytest.mark.parametrize("group", sorted(FOUR_RANKS))
def test_context_parallel_four_ranks(group: str) -> None:
    cases = FOUR_RANKS[group]
    out = launch("context_parallel.py", 4, cases, timeout=600)
    assert ok_cases(out) == [c["name"] for c in cases], out


# -- the sequence split alone (no processes) ---------------------------------------------


def _forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):  # type: ignore[no-untyped-def]
    return None


def _split(cp_rank: int = 0, cp: int = 2, causal_lm: bool = True, **inputs: int):  # type: ignore[no-untyped-def]
    import inspect

    from smp_torch.context_parallel import SEQUENCE_INPUTS, SequenceSplit

    return SequenceSplit(inspect.signature(_forward), cp_rank, cp, {**SEQUENCE_INPUTS, **inputs}, causal_lm)


def test_labels_are_shifted_before_the_split_and_positions_are_global() -> None:
    import torch

    x = torch.arange(8).view(1, 8)
    # balanced layout, cp = 2: chunks of 2, rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    _, kw0 = _split(0).split((x,), {"labels": x})
    _, kw1 = _split(1).split((x,), {"labels": x})
    assert kw0["input_ids"].tolist() == [[0, 1, 6, 7]] and kw1["input_ids"].tolist() == [[2, 3, 4, 5]]
    assert kw0["position_ids"].tolist() == [[0, 1, 6, 7]] and kw1["position_ids"].tolist() == [[2, 3, 4, 5]]
    # token t's target is t + 1 wherever t lands (across the chunk boundary too); the last has none
    assert kw0["labels"].tolist() == [[1, 2, 7, -100]] and kw1["labels"].tolist() == [[3, 4, 5, 6]]


def test_named_inputs_padding_and_lengths() -> None:
    import torch
    from smp_torch import ConfigError

    x = torch.arange(8).view(1, 8)
    extra = torch.arange(16).view(1, 8, 2)
    _, kw = _split(1, extra_states=1).split((), {"input_ids": x, "extra_states": extra, "other": extra})
    assert kw["extra_states"][0, :, 0].tolist() == [4, 6, 8, 10] and kw["other"] is extra
    _, kw = _split().split((x,), {"attention_mask": torch.ones(1, 8)})
    assert kw["attention_mask"] is None  # all ones: no padding, dropped
    with pytest.raises(ConfigError, match="without padding"):
        _split().split((x,), {"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])})
    with pytest.raises(ConfigError, match="sequence length 6 .* not divisible by 2 \\* context_parallel_degree = 4"):
        _split().split((torch.zeros(1, 6, dtype=torch.long),), {})
    with pytest.raises(ConfigError, match="'position_ids' has 4 positions"):
        _split().split((x,), {"position_ids": torch.arange(4).view(1, 4)})
    with pytest.raises(ConfigError, match="found no sequence input"):
        _split().split((), {})
    with pytest.raises(ConfigError, match="causal language models"):
        _split(causal_lm=False).split((x,), {"labels": x})
