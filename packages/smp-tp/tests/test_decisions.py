"""``parallelize(record=...)``: one decision per module replaced or left whole, with the
reason and the remedy; with a record, the warnings are left to the caller (one process)."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Iterator

import pytest
import smp_tp
import torch
import torch.distributed as dist
from smp_tp import Cause, Treatment
from torch import nn


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group: parallelize's layers need a process group."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class ScaledEmbedding(nn.Embedding):
    """Like Gemma2's: a subclass of a replaceable type, with other maths."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 2.0


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ScaledEmbedding(10, 4)
        self.block = Block()
        self.scale = Scale()
        self.capped = nn.Embedding(10, 4, max_norm=1.0)  # the built-in converter declines it
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_decisions_name_each_treatment_and_remedy() -> None:
    model = smp_tp.set_tensor_parallelism(Model())
    record: list[smp_tp.TPDecision] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp_tp.parallelize(model, record=record)
    assert [str(w.message) for w in caught] == []  # the caller tells the user
    got = {d.path: (d.treatment, d.cause, d.remedy) for d in record}
    assert got == {
        "emb": (Treatment.REPLICATED, Cause.SUBCLASS, "tp_register_with_module"),
        "block.up": (Treatment.PER_LINEAR, None, "tp_register_block"),
        "block.down": (Treatment.PER_LINEAR, None, "tp_register_block"),
        "scale": (Treatment.REPLICATED, Cause.NO_MAPPING, None),
        "capped": (Treatment.REPLICATED, Cause.DECLINED, "tp_register_with_module"),
        "head": (Treatment.REPLICATED, Cause.SHARED, "tp_register_vocab_parallel"),
    }
    reasons = {d.path: d.reason for d in record}
    assert "subclass of Embedding" in reasons["emb"]
    assert "tp_register_block(Block," in reasons["block.up"]
    assert "shares parameters with emb" in reasons["head"]
    assert "max_norm" in reasons["capped"]  # the converter's own warning, as the reason


def test_without_a_record_smp_tp_still_warns() -> None:
    model = smp_tp.set_tensor_parallelism(Model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp_tp.parallelize(model)
    assert any("shares parameters or is reused" in str(w.message) for w in caught)
