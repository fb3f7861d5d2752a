"""fp16 loss scaling (overflow skipped on every rank), bf16, delayed initialisation (pp=1 and
pp=2), gradient clipping over the whole model, evaluation steps with non-split inputs, and
activation checkpointing strategies of nn.Sequential — one 2-rank MPI job."""

from __future__ import annotations

from conftest import launch, ok_cases

EXPECTED = [
    "tp-dropout-checkpointing-tp2",
    "fp16-loss-scaling",
    "bf16-autocast",
    "delayed-init-pp1",
    "delayed-init-pp2",
    "clip-and-eval",
    "sequential-checkpointing-each",
    "sequential-checkpointing-contiguous",
    "sequential-checkpointing-group_3",
]


def test_features_2_ranks() -> None:
    out = launch("features.py", 2, timeout=240)
    assert ok_cases(out) == EXPECTED, out


def test_tp_dropout_checkpointing_in_pipeline_stages() -> None:
    """pp=2 x tp=2: a checkpointed tensor-parallel block recomputed on its stage draws the
    forward's dropout masks (smp-tp's streams replayed), so gradients equal no checkpointing."""
    out = launch("features.py", 4, "pp2tp2", timeout=240)
    assert ok_cases(out) == ["tp-dropout-checkpointing-pp2tp2"], out
