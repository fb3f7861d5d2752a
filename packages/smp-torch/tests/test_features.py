"""fp16 loss scaling (overflow skipped on every rank), bf16, delayed initialisation (pp=1 and
pp=2), gradient clipping over the whole model, evaluation steps with non-split inputs, and
activation checkpointing strategies of nn.Sequential — one 2-rank MPI job."""

from __future__ import annotations

from conftest import launch, ok_cases

EXPECTED = [
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
