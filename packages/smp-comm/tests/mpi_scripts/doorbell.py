"""Doorbells: idle trackers sleep on them, senders ring them, and traffic still arrives.

Every receive here waits with ``spin=0``, so no receiving thread polls: the receiving
thread sleeps on its waiter's doorbell at once, and its tracker sleeps on its own while
idle. Rank 0 checks that it rang sleeping peers; the peers check that their trackers slept
and that rings woke their waiting threads (the small messages; the large ones complete on a
backend thread, whose completion rings the waiter too). The same traffic then runs with
doorbells off (by setting, and when ranks pretend to sit on different hosts).
"""

from __future__ import annotations

import time

import numpy as np
import smp_comm
import torch
from mpi4py import MPI
from payloads import case_ok, main_guard


def exchange(comm: smp_comm.Communicator, rounds: int) -> None:
    rank, size = comm.rank, comm.size
    for i in range(rounds):
        time.sleep(0.03)  # idle: the trackers go to sleep
        if rank == 0:
            for dest in range(1, size):
                small = torch.full((16,), float(i * 10 + dest))
                big = np.full(50_000, i + dest, dtype=np.int64)  # general path (shm)
                comm.isend({"small": small, "big": big}, dest=dest, tag=i).wait(timeout=10)
                comm.isend(small, dest=dest, tag=1000 + i).wait(timeout=10)  # fast path
            for src in range(1, size):
                back, _, _ = comm.irecv(src, tag=2000 + i).wait(timeout=10, spin=0)
                assert int(back.sum()) == 16 * (i * 10 + src), (i, src, back)
        else:
            msg, _, _ = comm.irecv(0, tag=i).wait(timeout=10, spin=0)
            assert torch.equal(msg["small"], torch.full((16,), float(i * 10 + rank)))
            assert (msg["big"] == i + rank).all()
            small, _, _ = comm.irecv(0, tag=1000 + i).wait(timeout=10, spin=0)
            assert float(small[0]) == i * 10 + rank
            comm.isend(small.to(torch.int64), dest=0, tag=2000 + i).wait(timeout=10)


def quiet_notes(comm: smp_comm.Communicator, rounds: int) -> None:
    """``isend(..., wake=False)`` rings no doorbell, and the message still arrives."""
    rank, size = comm.rank, comm.size
    bell = comm._bell
    assert bell is not None
    for i in range(rounds):
        time.sleep(0.03)  # idle: the trackers go to sleep
        if rank == 0:
            rings = bell.rings
            for dest in range(1, size):
                note = {"note": i, "big": np.full(50_000, i, dtype=np.int64)}  # shm path
                comm.isend(note, dest=dest, tag=3000 + i, wake=False).wait(timeout=10)
                comm.isend(torch.full((4,), float(i)), dest, 4000 + i, wake=False).wait(timeout=10)
            assert bell.rings == rings, f"wake=False rang {bell.rings - rings} doorbells"
        else:
            note, _, _ = comm.irecv(0, tag=3000 + i).wait(timeout=10, spin=0)
            assert note["note"] == i and (note["big"] == i).all(), note
            small, _, _ = comm.irecv(0, tag=4000 + i).wait(timeout=10, spin=0)
            assert float(small[0]) == i, small


def ping_pong(comm: smp_comm.Communicator, n: int) -> None:
    """Every wait of a ping-pong (``spin=0``: the waiting thread sleeps at once) ends with
    the message taken by that thread right after the ring: one doze per message. A waiter
    whose last look misses a message that landed while the rank made no MPI call dozes a
    second time, until the tracker's 50 ms backstop finds it (two dozes per message)."""
    rank = comm.rank
    bell = comm._bell
    assert bell is not None
    if rank > 1:
        return
    dozes = bell.dozes
    for i in range(n):
        if rank == 0:
            comm.isend(torch.full((8,), float(i)), dest=1, tag=7000).wait(timeout=10)  # fast path
            back, _, _ = comm.irecv(1, tag=7001).wait(timeout=10, spin=0)
            assert float(back[0]) == i
            big, _, _ = comm.irecv(1, tag=7002).wait(timeout=10, spin=0)
            assert (big["pad"] == i).all()
        else:
            x, _, _ = comm.irecv(0, tag=7000).wait(timeout=10, spin=0)
            big = {"x": x, "pad": np.full(8_000, i, dtype=np.int64)}  # general path (shm)
            comm.isend(big, dest=0, tag=7002).wait(timeout=10)
            comm.isend(x, dest=0, tag=7001).wait(timeout=10)
    waits = 2 * n if rank == 0 else n
    took = bell.dozes - dozes
    # (Slack for a stale ring or a descheduled sender: each costs one more doze.)
    assert took <= waits * 1.5, (
        f"rank {rank}: {took} dozes for {waits} waits: woken waiters missed their messages"
    )


def _wakeups(thread) -> int:  # type: ignore[no-untyped-def]
    """How many times ``thread`` has gone to sleep and been woken (Linux)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def _busy(seconds: float) -> None:
    """Compute without MPI calls (as a pipeline stage between its messages)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _stream(comm: smp_comm.Communicator, payload: torch.Tensor, n: int, lazy: bool) -> tuple[int, float]:
    """Rank 0 streams ``n`` frames to rank 1 with 2 ms of compute between sends; returns
    how many times rank 0 nudged its tracker for them while sending, and how many times the
    tracker was woken per send (rank 1: zeros)."""
    if comm.rank == 1:
        for _ in range(n):
            _busy(0.001)
            got, _, _ = comm.irecv(0, tag=8000).wait(timeout=10)
            assert torch.equal(got, payload)
        return 0, 0.0
    local = comm._local[1]
    comm._local[1] = local and lazy  # (eager: as for a peer on another node)
    try:
        tracker, bell = comm._progress._thread, comm._bell
        before, nudged = _wakeups(tracker), bell.nudges
        handles = []
        for _ in range(n):
            handles.append(comm.isend(payload, dest=1, tag=8000))
            _busy(0.002)
        nudged = bell.nudges - nudged
        for h in handles:
            h.wait(timeout=10)
        return nudged, (_wakeups(tracker) - before) / n
    finally:
        comm._local[1] = local


def lazy_sends(comm: smp_comm.Communicator) -> None:
    """A fast-path frame beyond MPI's eager size stays in flight after ``isend`` returns.
    To a rank on this node it needs no progress from the sender (the receiver finishes the
    transfer), so the sender does not nudge its tracker to poll for it. Streaming 32 KiB
    frames with compute between them: tracked eagerly, each send nudges the sleeping
    tracker; lazily, none does (the tracker's wake-ups per send, printed, were 1.0-5.8
    eagerly against 0.2-0.7 lazily: a count of context switches, which load inflates, so the
    assertion is on the nudges). Every send's ``wait()`` still returns."""
    if comm.rank > 1:
        return
    payload = torch.arange(8 * 1024, dtype=torch.float32)  # 32 KiB: a frame, not eager
    assert payload.nbytes <= comm.settings.small_message_bytes
    nudges = {True: 0, False: 0}
    woke = {True: 0.0, False: 0.0}
    for _ in range(2):  # alternating, so that the machine's load weighs on both alike
        for lazy in (False, True):
            nudged, woken = _stream(comm, payload, 25, lazy)
            nudges[lazy] += nudged
            woke[lazy] += woken / 2
    if comm.rank == 0:
        print(
            f"50 sends: tracker nudged eager {nudges[False]}, lazy {nudges[True]}; woken per "
            f"send eager {woke[False]:.2f}, lazy {woke[True]:.2f}",
            flush=True,
        )
        assert nudges[True] == 0, f"lazily tracked sends nudged rank 0's tracker {nudges[True]} times"
        assert nudges[False] > 0, "eagerly tracked sends never nudged rank 0's tracker"


def main() -> None:
    world = MPI.COMM_WORLD
    rank = world.rank
    with smp_comm.Communicator(world) as comm:
        bell = comm._bell
        assert bell is not None, "one host, default settings: doorbells expected"
        exchange(comm, rounds=6)
        world.Barrier()
        rings, sleeps, rung, woken = bell.rings, bell.sleeps, bell.rung, bell.woken
        quiet_notes(comm, rounds=3)
        world.Barrier()
        ping_pong(comm, 100)
        world.Barrier()
        lazy_sends(comm)
        world.Barrier()
    if rank == 0:
        assert rings > 0, f"rank 0 never rang a sleeping peer (rings={rings})"
    else:
        assert sleeps > 0, f"rank {rank}'s tracker never slept on its doorbell"
        assert rung > 0, f"rank {rank}: no ring ever woke its waiting thread (rung={rung})"
    case_ok("rings-and-sleeps")
    for case, kwargs in (("doorbell-off", {"doorbell": False}), ("own-nodes", {"node_id": "{rank}"})):
        with smp_comm.Communicator(world, **kwargs) as comm:
            assert comm._bell is None, kwargs
            exchange(comm, rounds=2)
        case_ok(case)
    print(f"rank {rank} OK doorbell (rings {rings}, sleeps {sleeps}, rung {rung}, woken {woken})", flush=True)


if __name__ == "__main__":
    main_guard(main)
