"""Accepted-but-inert settings warn once, on rank 0 only, through DistributedModel (2 ranks).
Prints ``CASE-OK <name>`` for each case."""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402


def wrapped_warnings() -> list[str]:
    """The InertSettingWarning messages of wrapping a fresh model."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        smp.DistributedModel(models.TinyLM())
    return [str(w.message) for w in caught if issubclass(w.category, smp.InertSettingWarning)]


def ok(name: str) -> None:
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-OK {name}", flush=True)


def no_pipeline_no_checkpoints() -> None:
    smp.init({"static_mode": True, "offload_activations": True})
    first, second = wrapped_warnings(), wrapped_warnings()
    if smp.rank() == 0:
        assert len(first) == 2, first
        assert "'static_mode'" in first[0] and "pipeline_parallel_degree is 1" in first[0], first
        assert "'offload_activations'" in first[1] and "set_activation_checkpointing" in first[1], first
    else:
        assert first == [], first
    assert second == [], second  # once per process
    ok("no_pipeline_no_checkpoints")


def sharded_on_cpu() -> None:
    smp.init({"sharded_data_parallel_degree": 2, "sdp_max_live_parameters": 1000})
    got = wrapped_warnings()
    if smp.rank() == 0:
        assert len(got) == 1 and "'sdp_max_live_parameters'" in got[0] and "CPU" in got[0], got
    else:
        assert got == [], got
    ok("sharded_on_cpu")


if __name__ == "__main__":
    no_pipeline_no_checkpoints()
    sharded_on_cpu()
