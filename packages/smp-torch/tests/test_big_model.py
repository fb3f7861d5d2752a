"""A model that does not fit a rank's memory budget trains (issue 42), at a size CI affords.

A 369 M-parameter Hugging Face Llama (1.48 GB of fp32 parameters) is built under
``smp.delay_param_initialization()`` on 4 processes and trained 2 SGD steps at
``pipeline_parallel_degree=4`` (``deterministic_accumulation`` off, see below) and at
``sharded_data_parallel_degree=4``. Each rank's peak
RSS growth from building the model to the end (``scripts/big_model.py``: measured from
``/proc``, after a reset of the peak mark) must stay at or below 0.75x the model's fp32
parameter bytes, so no rank ever held the whole model; the losses must equal one process
that built the model normally from the same seed and accumulated the same microbatches.
``benchmarks/bench_big_model.py`` runs the same at 0.66 B parameters.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
from conftest import SCRIPTS
from smp_comm.testing import run_mpi

# 12 layers of 1024 (MLP 8192), an 8000-token vocabulary, untied: 0.369 B parameters, 1.48 GB.
# Not smaller: what a rank holds besides its share of parameters and gradients hardly shrinks
# with the model, so the ratio rises as the model shrinks: at width 768 (MLP 6144, 0.84 GB)
# the peak growth was 0.72-0.73x on sdp4's ranks and 0.73x on pp4-stream's rank 0, at the
# 0.75 budget's edge (one run, 2026-12-01).
SIZE = {
    "hidden_size": 1024,
    "intermediate_size": 8192,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 8000,
}
BUDGET = 0.75
# glibc's malloc raises its mmap threshold (up to 32 MiB) after a large block is freed, and
# from then on keeps freed tensors in its heaps instead of giving them back: measured on the
# sdp=4 run of a 134 M-parameter Llama, peak RSS growth 1.50x the parameters by default,
# 0.77x with the threshold fixed. Fixing the trim threshold turns that adjustment off, as a
# CPU user would (or use jemalloc/tcmalloc); on a GPU the weights live in device memory.
ENV = {"OMP_NUM_THREADS": "1", "SMP_CONFIG": "", "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}


def _result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("BIG-RESULT ")]
    assert lines, out
    return json.loads(lines[-1][len("BIG-RESULT ") :])


@functools.cache
def _reference() -> dict:
    """One process's losses, built normally: the same for both modes (each step's loss is the
    mean over the same four rows: pp4 as 4 one-row microbatches of one data-parallel rank, sdp4
    as 1 on each of 4 ranks, the reference as one pass over all four), so it runs once for the
    module."""
    script = os.path.join(SCRIPTS, "big_model.py")
    return _result(run_mpi([script, json.dumps(SIZE), "sdp4", "reference"], 1, timeout=900, env=ENV, fast_exit=True))


# pp4-stream: deterministic_accumulation off. With it on (the default), a microbatch whose
# backward reaches a parameter before an earlier microbatch's did is held in a gradient-sized
# buffer until its turn; benchmarks/bench_big_model.py measures both.
# pytest-timeout's 300 s default could cut a run on a busy machine; each job is bounded by
# run_mpi's timeout instead, which prints every rank's output.
@pytest.mark.timeout(1900)  # above its two jobs, 900 s each
@pytest.mark.parametrize("mode", ["pp4-stream", "sdp4"])
def test_model_larger_than_a_rank_budget_trains(mode: str) -> None:
    script = os.path.join(SCRIPTS, "big_model.py")
    got = _result(run_mpi([script, json.dumps(SIZE), mode], 4, timeout=900, env=ENV, fast_exit=True))
    ref = _reference()
    total = got["param_bytes"]
    assert total == ref["param_bytes"] and total > 1.4e9, (total, ref["param_bytes"])
    report = [(r["rank"], round(r["peak_growth"] / total, 3)) for r in got["ranks"]]
    print(f"{mode}: peak RSS growth / fp32 parameter bytes per rank: {report}", file=sys.stderr)
    for rank, ratio in report:
        assert ratio <= BUDGET, f"{mode}: rank {rank} grew by {ratio}x the model's parameters: {report}"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b) + 1e-6, f"{mode}: loss at step {step}: {a} vs one process {b}"
