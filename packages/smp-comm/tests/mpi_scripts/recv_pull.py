"""The pull path (``smp_comm.cma``): a large lone tensor sent to a rank that receives into
``irecv(out=...)`` is read by the receiver straight from the sender's memory. The send
stays open until the receiver has read it (a tensor changed after ``wait`` is not seen);
a message that does not fit ``out``, one that arrives before its receive, and one taken
by a receive without ``out`` still arrive right; when the kernel refuses the read, at the
start or later (forced with ``SMP_COMM_PULL_REFUSE``), the bytes come another way. 2 ranks."""

from __future__ import annotations

import os
import time

import smp_comm.cma
import torch
from mpi4py import MPI
from payloads import case_ok, main_guard
from smp_comm import Communicator
from smp_comm.errors import CommError

WORLD = MPI.COMM_WORLD
RANK = WORLD.rank
NUMEL = 1 << 19  # 2 MiB of float32, over the 1 MiB threshold set below
READS: list[int] = []  # one entry per read attempt on this rank (ok: 1, refused: 0)


def counting(read_from):
    def wrapper(pid, address, dst):
        try:
            read_from(pid, address, dst)
        except OSError:
            READS.append(0)
            raise
        READS.append(1)
    return wrapper


smp_comm.cma.read_from = counting(smp_comm.cma.read_from)
smp_comm.cma.SPLIT_MIN_BYTES = 1 << 20  # every read here in two halves, two threads


def payload(k: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) * (k + 1) + 0.25


def new_comm() -> Communicator:
    return Communicator(WORLD, single_copy_min_bytes="1M", small_message_bytes=0)


def exchange(comm: Communicator, tag: int, out: torch.Tensor | None) -> None:
    """One message 0 -> 1, the receive posted first (``out`` or a new tensor)."""
    if RANK == 0:
        WORLD.Barrier()
        comm.isend(payload(tag), dest=1, tag=tag).wait(timeout=60)
    else:
        handle = comm.irecv(0, tag, out=out)
        WORLD.Barrier()
        obj, _, _ = handle.wait(timeout=60)
        assert out is None or obj is out, tag
        assert torch.equal(obj, payload(tag)), f"message {tag} arrived wrong"


def warm_up(comm: Communicator, out: torch.Tensor) -> None:
    """Receive into ``out`` until a message came by pulling (the first ones tell the
    sender that this rank takes them that way)."""
    for tag in range(20):
        before = len(READS)
        exchange(comm, tag, out)
        if WORLD.bcast(len(READS) > before, root=1):
            return
    raise AssertionError("no message took the pull path within 20")


def pulled_into_out() -> None:
    comm = new_comm()
    out = torch.empty(NUMEL)
    warm_up(comm, out)
    # The send stays open while the receiver has not read the bytes: hold its progress.
    if RANK == 1:
        handle = comm.irecv(0, 50, out=out)
        comm._progress.lock.acquire()
    WORLD.Barrier()
    if RANK == 0:
        sent = payload(50)
        send = comm.isend(sent, dest=1, tag=50)
        time.sleep(0.5)
        assert not send.test(), "the send completed before the receiver read the bytes"
    WORLD.Barrier()
    if RANK == 1:
        comm._progress.lock.release()
    else:
        send.wait(timeout=60)
        sent.fill_(-7.0)  # after completion: the receiver must not see this
    WORLD.Barrier()
    if RANK == 1:
        obj, _, _ = handle.wait(timeout=60)
        assert obj is out and torch.equal(out, payload(50)), "the receiver saw a later write"
        assert READS and all(READS), READS
    # A message that does not fit out: that receive fails naming both; the next works.
    if RANK == 0:
        comm.isend(payload(51), dest=1, tag=51).wait(timeout=60)
    else:
        try:
            comm.irecv(0, 51, out=torch.empty(NUMEL // 2)).wait(timeout=60)
        except CommError as exc:
            assert f"shape ({NUMEL},)" in str(exc) and f"out is a tensor of shape ({NUMEL // 2},)" in str(exc), str(exc)
        else:
            raise AssertionError("a message that does not fit out was accepted")
    exchange(comm, 52, out)
    # Arriving before its receive: read into a new tensor, copied into out later.
    if RANK == 0:
        comm.isend(payload(53), dest=1, tag=53).wait(timeout=60)  # completes unmatched
        WORLD.Barrier()
    else:
        WORLD.Barrier()
        assert comm.irecv(0, 53, out=out).wait(timeout=60)[0] is out
        assert torch.equal(out, payload(53))
    # A receive without out takes one: right, and the sender goes back to the buffer.
    exchange(comm, 54, None)
    for tag in range(55, 60):
        exchange(comm, tag, None)
    comm.close()


def refused(stage: str) -> None:
    os.environ["SMP_COMM_PULL_REFUSE"] = stage
    try:
        comm = new_comm()
        out = torch.empty(NUMEL)
        READS.clear()
        first = 0
        if stage == "read":
            # Until the sender has the receiver's word (want-pull) and sends a message the
            # pull way: how soon depends on when its tracker takes that word (a CI run once
            # took more than 12 messages); up to 40, as warm_up allows 20.
            for first in range(40):
                exchange(comm, first, out)
                if WORLD.bcast(bool(READS), root=1):
                    break
            else:
                raise AssertionError("no read was tried within 40 messages")
            if RANK == 1:
                print(f"rank 1 refused-later: the first read was tried at message {first}", flush=True)
        # Refused at the start: never tried; later: tried once, then never again.
        for tag in range(first + 1, first + 13):
            exchange(comm, tag, out)
        if RANK == 1:
            assert READS == ([] if stage == "probe" else [0]), READS
        comm.close()
    finally:
        del os.environ["SMP_COMM_PULL_REFUSE"]


def main() -> None:
    pulled_into_out()
    case_ok("pulled-into-out")
    refused("probe")
    case_ok("refused-at-start")
    refused("read")
    case_ok("refused-later")


if __name__ == "__main__":
    main_guard(main)
