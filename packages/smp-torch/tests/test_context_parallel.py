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
from conftest import launch, ok_cases

pytest.importorskip("transformers")


def _case(name: str, model: str = "llama", **config: object) -> dict:
    return {"name": name, "model": model, "config": config}


CP2 = {"context_parallel_degree": 2}

TWO_RANKS = [
    {**_case("llama-cp2", **CP2), "saved_limit": 0.6},
    _case("qwen2-cp2", "qwen2", **CP2),
    # Mistral's sliding window, longer than the sequence: no effect, accepted.
    {**_case("mistral-cp2", "mistral", **CP2), "steps": 1},
    # The checks fail on the bugs they guard.
    {**_case("broken-sum", **CP2), "broken": "sum", "steps": 1},
    {**_case("broken-shift", **CP2), "broken": "shift", "steps": 1},
    # Refusals, named: attention soft-capping, a model whose attention smp cannot route.
    {**_case("gemma2-softcap", "gemma2", **CP2), "error": "context_parallel_degree"},
    {**_case("not-hf", "mlp", **CP2), "error": "context_parallel_degree"},
]

# Refused at the first call, on every rank (a failed step ends the job's use of smp: one per
# job): a sequence not divisible by 2 x cp, a sliding window shorter than the sequence.
STEP_ERRORS = [
    {**_case("odd-sequence", **CP2), "seq": 66,
     "step_error": "ConfigError: smp config key 'context_parallel_degree': the sequence length 66"},
    {**_case("mistral-window16", "mistral-window16", **CP2), "step_error": "a sliding window of 16 tokens"},
]

FOUR_RANKS = {
    "cp-dp": [
        _case("llama-cp4", context_parallel_degree=4),
        _case("llama-cp2-dp2", **CP2),
        _case("llama-cp2-dp2-spread", **CP2, placement_strategy="spread"),
        {**_case("bad-cp3", context_parallel_degree=3), "error": "context_parallel_degree"},
    ],
    "cp-tp-pp": [
        _case("llama-cp2-tp2", **CP2, tensor_parallel_degree=2),
        {**_case("llama-tied-cp2-pp2", "llama-tied", **CP2, pipeline_parallel_degree=2, microbatches=2),
         "resume": {"ddp": True}},
        _case("qwen2-cp2-pp2-simple", "qwen2", **CP2, pipeline_parallel_degree=2, microbatches=2, pipeline="simple"),
    ],
}


def test_context_parallel_two_ranks() -> None:
    out = launch("context_parallel.py", 2, TWO_RANKS, timeout=300)
    assert ok_cases(out) == [c["name"] for c in TWO_RANKS], out


@pytest.mark.parametrize("case", STEP_ERRORS, ids=[c["name"] for c in STEP_ERRORS])
def test_context_parallel_refused_at_the_call(case: dict) -> None:
    out = launch("context_parallel.py", 2, [case], timeout=180)
    assert ok_cases(out) == [case["name"]], out


@pytest.mark.parametrize("group", sorted(FOUR_RANKS))
def test_context_parallel_four_ranks(group: str) -> None:
    cases = FOUR_RANKS[group]
    out = launch("context_parallel.py", 4, cases, timeout=600)
    assert ok_cases(out) == [c["name"] for c in cases], out
