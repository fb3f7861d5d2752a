"""Delayed initialization and where a model's weights live (issue 42): real MPI jobs.

Each case builds the model under ``smp.delay_param_initialization()`` on every rank and
checks, before the first step, that every tensor the rank materialised equals a normal
construction with the same seed bitwise (a sharded tensor: its slice), then trains and
compares every step with one process accumulating the same microbatches (SPEC §8,
``scripts/equivalence.py``). ``trace_device`` cases check when partitioning happens.
"""

from __future__ import annotations

from conftest import EQUIVALENCE_FOUR, EQUIVALENCE_TWO

SMALL_UNITS = {"sdp_param_persistence_threshold": 100}

DELAYED_2 = [
    {"name": "delayed-dp2", "config": {"microbatches": 2}, "delayed": True},
    {"name": "delayed-dp2-llama", "config": {"microbatches": 2}, "delayed": True, "model": "llama", "batch": 4, "steps": 2},
    {"name": "delayed-pp2-auto", "config": {"pipeline_parallel_degree": 2, "microbatches": 2},
     "delayed": True, "partitioned_at_wrap": True},
    {"name": "delayed-pp2-manual", "config": {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False},
     "delayed": True, "manual": True, "layers": 2},
    {"name": "delayed-pp2-llama", "config": {"pipeline_parallel_degree": 2, "microbatches": 2},
     "delayed": True, "model": "llama", "batch": 4, "steps": 2},
    {"name": "delayed-sdp2", "config": {"sharded_data_parallel_degree": 2, "microbatches": 2, **SMALL_UNITS},
     "delayed": True},
    {"name": "trace-meta-pp2", "config": {"pipeline_parallel_degree": 2, "microbatches": 2, "trace_device": "meta"},
     "partitioned_at_wrap": True},
    {"name": "trace-cpu-pp2", "config": {"pipeline_parallel_degree": 2, "microbatches": 2, "trace_device": "cpu"},
     "partitioned_at_wrap": False},
    {"name": "trace-arg-meta-pp2", "config": {"pipeline_parallel_degree": 2, "microbatches": 2},
     "wrap": {"trace_device": "meta"}, "partitioned_at_wrap": True},
]  # fmt: skip


# One launch per world size with test_equivalence's cases (conftest.SharedJob).
EQUIVALENCE_TWO.add("delayed-2", DELAYED_2, timeout=300)


def test_delayed_initialization_2_ranks() -> None:
    EQUIVALENCE_TWO.check("delayed-2")


DELAYED_4 = [
    {"name": "delayed-sdp4", "config": {"sharded_data_parallel_degree": 4, "microbatches": 2, **SMALL_UNITS},
     "delayed": True},
    {"name": "delayed-sdp4-llama", "config": {"sharded_data_parallel_degree": 4, "microbatches": 1},
     "delayed": True, "model": "llama", "batch": 4, "steps": 2},
    {"name": "delayed-pp2-sdp2", "config": {"pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 2,
     "microbatches": 2}, "delayed": True},
    {"name": "delayed-pp4", "config": {"pipeline_parallel_degree": 4, "microbatches": 4}, "delayed": True,
     "layers": 4, "tied": False},
    {"name": "delayed-pp2-tp2", "config": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
     "microbatches": 2}, "delayed": True},
]  # fmt: skip


EQUIVALENCE_FOUR.add("delayed-4", DELAYED_4, timeout=400)


def test_delayed_initialization_4_ranks() -> None:
    EQUIVALENCE_FOUR.check("delayed-4")
