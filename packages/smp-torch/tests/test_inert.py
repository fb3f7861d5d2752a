"""Accepted-but-inert settings: which are inert, and the warning (once, rank 0 only)."""

from __future__ import annotations

import warnings

import pytest
import smp_torch as smp
from conftest import launch, ok_cases
from smp_torch import inert
from smp_torch.config import parse_config
from torch import nn


def keys(config: dict, world: int, device: str = "cpu", checkpointed: bool = False) -> list[str]:
    return [k for k, _ in inert.inert_settings(parse_config(config, world), device, checkpointed)]


def test_static_mode_is_inert_only_without_a_pipeline() -> None:
    assert keys({"static_mode": True}, 2) == ["static_mode"]
    # (Under tensor parallelism a stage's leader replays; its followers run what it inlined.)
    assert keys({"static_mode": True, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 4) == []
    assert keys({"static_mode": True, "pipeline_parallel_degree": 2}, 2) == []


def test_offload_activations_is_inert_without_checkpointed_modules() -> None:
    assert keys({"offload_activations": True}, 1) == ["offload_activations"]
    assert keys({"offload_activations": True}, 1, checkpointed=True) == []
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert not inert.has_checkpointed_module(seq)
    smp.set_activation_checkpointing(seq[1])
    assert inert.has_checkpointed_module(seq)


def test_sdp_max_live_parameters_is_inert_on_cpu_only_when_set() -> None:
    cfg = {"sharded_data_parallel_degree": 2, "sdp_max_live_parameters": 1000}
    assert keys(cfg, 2) == ["sdp_max_live_parameters"]
    assert keys(cfg, 2, device="cuda") == []
    assert keys({"sharded_data_parallel_degree": 2}, 2) == []  # the default: not set by the user


def test_warns_once_per_key_on_rank_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inert, "_warned", set())
    found = [("static_mode", "because"), ("offload_activations", "also because")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inert.warn_inert(found, rank=1)
        inert.warn_inert(found, rank=0)
        inert.warn_inert(found, rank=0)
    assert [str(w.message) for w in caught] == [
        "smp: 'static_mode' has no effect here: because",
        "smp: 'offload_activations' has no effect here: also because",
    ]
    assert all(w.category is smp.InertSettingWarning for w in caught)


def test_distributed_model_warns_on_rank_0_once() -> None:
    out = launch("inert.py", 2, timeout=240)
    assert ok_cases(out) == ["no_pipeline_no_checkpoints", "sharded_on_cpu"], out
