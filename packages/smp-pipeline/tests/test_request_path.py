"""Per-message work on the pipeline's request path, counted (no processes, no timing)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from smp_pipeline import transport as transport_mod
from smp_pipeline.frames import decode
from smp_pipeline.messages import pack
from smp_pipeline.protocol import MbDone, StepEnd
from smp_pipeline.transport import Transport


class _Sends:
    """A communicator that only records what is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, int, bool]] = []

    def isend(self, obj: Any, dest: int, tag: int = 0, *, wake: bool = True) -> Any:
        self.sent.append((obj, dest, wake))
        return _Done()


class _Done:
    def test(self) -> bool:
        return True


@pytest.mark.parametrize(
    "msg",
    [MbDone(0, 3, 5), StepEnd(0, 3, pack([torch.ones(2), None], False))],
    ids=["MbDone", "StepEnd"],
)
def test_send_all_encodes_once(monkeypatch: pytest.MonkeyPatch, msg: Any) -> None:
    encoded: list[Any] = []
    real = transport_mod.encode

    def counting(m: Any, limit: int = 0) -> Any:
        encoded.append(m)
        return real(m, limit)

    monkeypatch.setattr(transport_mod, "encode", counting)
    comm = _Sends()
    t = Transport(comm, 0, [10, 11, 12, 13], 7, 5.0, [], wake=lambda: None)
    t.send_all(msg, wake=False)
    assert len(encoded) == 1  # (one per destination before: 3 for 4 ranks)
    assert [d for _, d, _ in comm.sent] == [11, 12, 13]
    assert all(w is False for _, _, w in comm.sent)
    for obj, _, _ in comm.sent:
        got = decode(obj)
        assert type(got) is type(msg) and got.step == 3
