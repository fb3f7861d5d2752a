"""The in-process loopback communicator (threads as ranks): the real Communicator's rules."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from smp_comm import (
    ANY_SOURCE,
    ANY_TAG,
    CommClosedError,
    CommError,
    CommTimeoutError,
    PeerClosedError,
)
from smp_comm.testing import LoopbackWorld

torch = pytest.importorskip("torch")


def test_roundtrip_is_a_copy() -> None:
    world = LoopbackWorld(2)
    a, b = world.communicator(0), world.communicator(1)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # non-contiguous
    w = torch.ones(2, requires_grad=True)
    arr = np.arange(4, dtype=np.int16)
    msg = {"x": x, "w": w, "arr": arr, "again": x, "bf": torch.ones(3, dtype=torch.bfloat16)}
    assert a.isend(msg, dest=1, tag=3).wait(timeout=1) is None
    x.mul_(0)  # later changes do not travel
    arr[:] = 0
    msg["x"] = None
    obj, source, tag = b.irecv().wait(timeout=1)
    assert (source, tag) == (0, 3)
    assert torch.equal(obj["x"], torch.arange(6, dtype=torch.float32).reshape(2, 3).t())
    assert obj["again"] is obj["x"]  # one tensor referenced twice arrives once
    assert obj["w"].requires_grad and obj["w"] is not w
    assert obj["arr"].tolist() == [0, 1, 2, 3]
    assert obj["bf"].dtype == torch.bfloat16
    assert a.stats()["mpi"]["messages_sent"] == 1 == b.stats()["mpi"]["messages_received"]


def test_per_pair_order_from_many_threads() -> None:
    world = LoopbackWorld(3)
    n = 200

    def sender(r: int) -> None:
        c = world.communicator(r)
        for i in range(n):
            c.isend((r, i), dest=0, tag=i % 3)

    threads = [threading.Thread(target=sender, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    dest = world.communicator(0)
    seen = {1: [], 2: []}
    for _ in range(2 * n):
        (r, i), source, _ = dest.irecv(ANY_SOURCE, ANY_TAG).wait(timeout=10)
        assert r == source
        seen[r].append(i)
    for t in threads:
        t.join(timeout=10)
    assert seen == {1: list(range(n)), 2: list(range(n))}


def test_tag_and_source_matching_first_posted_wins() -> None:
    world = LoopbackWorld(3)
    c0, c1, c2 = (world.communicator(r) for r in range(3))
    any_recv = c0.irecv(ANY_SOURCE, ANY_TAG)
    tag7 = c0.irecv(1, 7)
    c1.isend("first", dest=0, tag=7)
    assert any_recv.wait(timeout=1) == ("first", 1, 7)  # posted first: it wins
    assert not tag7.test()
    c2.isend("other", dest=0, tag=7)  # wrong source for tag7
    c1.isend("tag5", dest=0, tag=5)  # wrong tag
    assert not tag7.test()
    c1.isend("second", dest=0, tag=7)
    assert tag7.wait(timeout=1) == ("second", 1, 7)
    # Unexpected messages: a later receive takes the oldest one it accepts.
    assert c0.irecv(1, ANY_TAG).wait(timeout=1) == ("tag5", 1, 5)
    assert c0.irecv(ANY_SOURCE, 7).wait(timeout=1) == ("other", 2, 7)


def test_timeout_leaves_receive_posted_and_cancel() -> None:
    world = LoopbackWorld(2)
    a, b = world.communicator(0), world.communicator(1)
    h = b.irecv(0, 1)
    with pytest.raises(CommTimeoutError) as info:
        h.wait(timeout=0.01)
    assert info.value.peer == 0 and info.value.tag == 1
    with pytest.raises(CommTimeoutError):
        h.wait(timeout=0)
    a.isend("late", dest=1, tag=1)
    assert h.wait(timeout=1) == ("late", 0, 1)
    assert h.wait(0) == ("late", 0, 1)  # done: returns again at once
    assert not h.cancel()  # matched already
    c = b.irecv(0, 2)
    assert c.cancel() and c.test()
    with pytest.raises(CommError, match="cancelled"):
        c.wait(timeout=1)
    a.isend("kept", dest=1, tag=2)  # a cancelled receive does not take it
    assert b.irecv(0, 2).wait(timeout=1) == ("kept", 0, 2)


def test_callback_runs_on_completing_thread() -> None:
    world = LoopbackWorld(2)
    a, b = world.communicator(0), world.communicator(1)
    got: list[tuple[object, str]] = []
    h = b.irecv()
    h.add_done_callback(lambda hh: got.append((hh, threading.current_thread().name)))
    assert got == []
    t = threading.Thread(target=lambda: a.isend(1, dest=1), name="sender-thread")
    t.start()
    t.join(timeout=10)
    assert got == [(h, "sender-thread")]
    late: list[object] = []
    h.add_done_callback(late.append)  # already done: called at once
    assert late == [h]


def test_blocked_waiter_is_woken() -> None:
    world = LoopbackWorld(2)
    a, b = world.communicator(0), world.communicator(1)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(b.irecv(0, 0).wait(timeout=10)))
    t.start()
    a.isend([1, 2], dest=1)
    t.join(timeout=10)
    assert out == [([1, 2], 0, 0)]


def test_close_semantics() -> None:
    world = LoopbackWorld(3)
    c0, c1, c2 = (world.communicator(r) for r in range(3))
    c1.isend("before", dest=0, tag=0)
    mine = c1.irecv(0, 0)
    from_1 = c0.irecv(1, 9)
    from_any = c0.irecv(ANY_SOURCE, 9)
    with c1:
        pass  # context manager closes
    assert c1.closed and not c0.closed
    with pytest.raises(CommClosedError):
        mine.wait(timeout=1)
    with pytest.raises(PeerClosedError) as info:
        from_1.wait(timeout=1)
    assert info.value.peer == 1
    assert not from_any.test()  # rank 2 may still send
    assert c0.irecv(1, 0).wait(timeout=1) == ("before", 1, 0)  # sent before close: kept
    with pytest.raises(PeerClosedError):
        c0.isend("x", dest=1).wait(timeout=1)
    with pytest.raises(CommClosedError):
        c1.isend("x", dest=0)
    with pytest.raises(CommClosedError):
        c1.irecv()
    c1.close()  # idempotent
    c2.close()
    with pytest.raises(CommError, match="every other rank"):
        from_any.wait(timeout=1)
    world.close()
    assert c0.closed


def test_bad_arguments() -> None:
    world = LoopbackWorld(2)
    c = world.communicator(0)
    with pytest.raises(ValueError, match="dest"):
        c.isend(1, dest=2)
    with pytest.raises(ValueError, match="tag"):
        c.isend(1, dest=1, tag=-1)
    with pytest.raises(ValueError, match="source"):
        c.irecv(source=5)
    with pytest.raises(CommError, match="serialize"):
        c.isend(threading.Lock(), dest=1)
    with pytest.raises(ValueError):
        LoopbackWorld(0)
    with pytest.raises(ValueError):
        world.communicator(2)
    assert world.communicator(1) is world.communicator(1)
    assert c.isend("self", dest=0).test()
    assert c.irecv(0).wait(timeout=1) == ("self", 0, 0)
