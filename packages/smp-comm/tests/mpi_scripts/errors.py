"""Errors name the peer: timeouts, cancelled receives, a peer that closed, bad arguments.

Runs on 4 ranks split into two sub-communicators ({0, 2} and {1, 3}), so it also shows a
Communicator over a sub-communicator uses that communicator's rank numbers.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI
from payloads import case_ok, main_guard, own_shm_files
from smp_comm import (
    ANY_SOURCE,
    ANY_TAG,
    CommClosedError,
    CommError,
    CommTimeoutError,
    Communicator,
    PeerClosedError,
)


def expect(exc_type, fn, *words):
    try:
        fn()
    except exc_type as exc:
        for w in words:
            assert w in str(exc), f"{w!r} not in {exc}"
        return exc
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def main() -> None:
    world = MPI.COMM_WORLD
    sub = world.Split(world.rank % 2, world.rank)
    comm = Communicator(sub, close_timeout=30)
    rank, peer = comm.rank, 1 - comm.rank
    assert comm.size == 2 and rank == world.rank // 2

    # Bad arguments fail at the call, naming the rank or tag.
    expect(ValueError, lambda: comm.isend(1, dest=2), "dest=2")
    expect(ValueError, lambda: comm.isend(np.ones(2), dest=2), "dest=2")  # fast path
    expect(ValueError, lambda: comm.isend(np.ones(2), dest=peer, tag=-3), "tag")
    expect(ValueError, lambda: comm.irecv(source=5), "source=5")
    expect(ValueError, lambda: comm.isend(1, dest=peer, tag=-3), "tag")
    expect(CommError, lambda: comm.isend(lambda: 0, dest=peer, tag=1), f"rank {peer}", "tag 1")
    case_ok("bad-arguments")

    # A timeout is prompt and names the peer and tag; the receive stays posted until
    # cancelled, so the later message for that tag goes to the next receive.
    h = comm.irecv(source=peer, tag=42)
    t0 = time.monotonic()
    err = expect(CommTimeoutError, lambda: h.wait(timeout=0.3), f"rank {peer}", "tag 42")
    assert err.peer == peer and err.tag == 42
    assert time.monotonic() - t0 < 5.0
    assert h.cancel() and not h.cancel()
    expect(CommError, lambda: h.wait(1), "cancelled")
    anything = comm.irecv(ANY_SOURCE, ANY_TAG)
    expect(CommTimeoutError, lambda: anything.wait(0.05), "any rank", "any tag")
    assert anything.cancel()
    case_ok("timeout-and-cancel")

    # Sending to oneself works too.
    comm.isend({"me": np.ones(3)}, dest=rank, tag=9).wait(10)
    obj, src, tag = comm.irecv(rank, 9).wait(10)
    assert np.array_equal(obj["me"], np.ones(3)) and (src, tag) == (rank, 9)
    case_ok("self-send")

    # A message that does arrive after a timed-out wait is still delivered to that handle.
    h2 = comm.irecv(source=peer, tag=43)
    expect(CommTimeoutError, lambda: h2.wait(0.05), "tag 43")
    sub.Barrier()  # both timed out before either sends
    comm.isend(np.arange(5), dest=peer, tag=43).wait(10)
    obj, src, tag = h2.wait(10)
    assert np.array_equal(obj, np.arange(5)) and (src, tag) == (peer, 43)
    case_ok("late-arrival")

    # Peer closes while we wait for it: the wait fails naming that rank, not a hang.
    sub.Barrier()
    if rank == 1:
        comm.close()
    else:
        pending = comm.irecv(source=1, tag=5)
        err = expect(PeerClosedError, lambda: pending.wait(timeout=30), "rank 1")
        assert err.peer == 1
        expect(PeerClosedError, lambda: comm.isend(1, dest=1).wait(5), "rank 1")
        expect(PeerClosedError, lambda: comm.isend(np.ones(2), dest=1).wait(5), "rank 1", "tag 0")
        expect(PeerClosedError, lambda: comm.irecv(source=1).wait(5), "rank 1")
        expect(CommError, lambda: comm.irecv(ANY_SOURCE).wait(5), "closed")
        comm.close()
    comm.close()  # idempotent
    assert comm.closed
    case_ok("peer-closed")
    expect(CommClosedError, lambda: comm.isend(1, dest=peer), "closed")
    expect(CommClosedError, lambda: comm.isend(np.ones(2), dest=peer), "closed")
    expect(CommClosedError, lambda: comm.irecv(), "closed")
    assert not own_shm_files()
    case_ok("closed-errors")
    sub.Free()
    print(f"rank {world.rank} OK errors")


main_guard(main)
