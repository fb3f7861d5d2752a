"""Checkpoints: save -> resume on the same and on a different layout continues exactly."""

from __future__ import annotations

import os

import torch
from conftest import CHECKPOINT_FOUR, launch, ok_cases


def _ck(name: str, save: dict, load: dict, partial: bool, optimizer: str = "adam") -> dict:
    return {"name": name, "save": save, "load": load, "partial": partial, "optimizer": optimizer}


PP2 = {"pipeline_parallel_degree": 2}
CK2 = [
    _ck("full-dp2-to-dp2-shard", {}, {"shard_optimizer_state": True, "microbatches": 2}, False),
    _ck("partial-shard-to-dp2", {"shard_optimizer_state": True}, {}, True, "sgd"),
    _ck("partial-pp2-to-dp2", {**PP2, "microbatches": 2}, {}, True),
    _ck("full-dp2-to-pp2", {}, PP2, False, "sgd"),
    _ck("partial-pp2-to-pp2", PP2, {**PP2, "pipeline": "simple"}, True),
]


def test_save_and_resume_2_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = launch("checkpointing.py", 2, str(tmp_path), CK2, timeout=240)
    assert ok_cases(out) == [c["name"] for c in CK2], out
    # The files hold plain tensors: loadable with weights_only=True, keys of the unwrapped model.
    sd = torch.load(os.path.join(tmp_path, CK2[0]["name"], "step2", "model.pt"), weights_only=True)
    assert "emb.weight" in sd and "head.weight" in sd


TP2 = {"tensor_parallel_degree": 2}
CK4 = [
    _ck("partial-tp2dp2-to-pp2dp2", TP2, PP2, True),
    _ck("full-pp2dp2-to-tp4", {**PP2, "microbatches": 2}, {"tensor_parallel_degree": 4}, False),
    _ck(
        "partial-tp2-shard-to-tp2-prescaled",
        {**TP2, "shard_optimizer_state": True},
        {**TP2, "prescaled_batch": True},
        True,
        "sgd",
    ),
]


CHECKPOINT_FOUR.add("reshard", CK4, timeout=240)  # (one launch with test_sharded's: conftest)


def test_reshard_across_layouts_4_ranks() -> None:
    CHECKPOINT_FOUR.check("reshard")


def test_failed_save_leaves_no_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = launch("checkpoint_failure.py", 2, str(tmp_path), timeout=120, fast_exit=False)
    assert "FAILURE-OK" in out, out
    assert sorted(os.listdir(tmp_path / "ck")) == ["good", "latest"]
