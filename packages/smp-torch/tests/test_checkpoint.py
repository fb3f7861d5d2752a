"""Checkpoints: save -> resume on the same and on a different layout continues exactly."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import launch, ok_cases

CK2 = [
    {"name": "full-dp2-to-dp2-shard", "save": {}, "load": {"shard_optimizer_state": True, "microbatches": 2}, "partial": False},
    {"name": "partial-shard-to-dp2", "save": {"shard_optimizer_state": True}, "load": {}, "partial": True, "optimizer": "sgd"},
]


def test_save_and_resume_2_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = launch("checkpointing.py", 2, str(tmp_path), CK2, timeout=180)
    assert ok_cases(out) == [c["name"] for c in CK2], out
    # The files hold plain tensors: loadable with weights_only=True, keys of the unwrapped model.
    sd = torch.load(os.path.join(tmp_path, CK2[0]["name"], "step2", "model.pt"), weights_only=True)
    assert "emb.weight" in sd and "head.weight" in sd


def test_failed_save_leaves_no_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = launch("checkpoint_failure.py", 2, str(tmp_path), timeout=120)
    assert "FAILURE-OK" in out, out
    assert sorted(os.listdir(tmp_path / "ck")) == ["good", "latest"]


pytest  # noqa: B018
