"""``irecv(out=tensor)``: a message lands in the caller's tensor, on every path (the small-
message fast path, inline, shm, shm copied out, streamed, MPI), whether the receive was posted
before the message came (the bytes land in place) or after (copied in); a message that does
not fit ``out`` fails that receive with a clear error and leaves the communicator usable;
a bad ``out`` is refused at once. 2 ranks."""

from __future__ import annotations

import smp_comm.paths
import smp_comm.receiver
import torch
from mpi4py import MPI
from payloads import case_ok, main_guard
from smp_comm import Communicator
from smp_comm.errors import CommError

ALLOCATED: list[int] = []  # bytes of every new receive buffer, while counting


def counting(new_buffers):
    def wrapper(stubs, rank):
        ALLOCATED.append(sum(s.nbytes for s in stubs))
        return new_buffers(stubs, rank)
    return wrapper


# Every place a receive allocates its tensors: a receive posted first must allocate none.
smp_comm.receiver.new_buffers = counting(smp_comm.receiver.new_buffers)
smp_comm.paths.new_buffers = counting(smp_comm.paths.new_buffers)

WORLD = MPI.COMM_WORLD
RANK = WORLD.rank
SIZES = {"tiny": 16, "small": 1 << 12, "medium": 1 << 16, "large": 3 << 20}
LAYOUTS = {
    "default": {},
    "copied": {"shm_zero_copy": False, "small_message_bytes": 0},
    "streamed": {"buffer_bytes": "2M", "stream_min_bytes": "1M"},
    "mpi": {"disable": "shm,rma", "small_message_bytes": 0},
}


def payload(numel: int, k: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (k + 1) + 0.5


def one_layout(name: str, comm: Communicator) -> None:
    for i, (size, numel) in enumerate(SIZES.items()):
        for posted_first in (True, False):
            tag = 10 * i + posted_first
            if RANK == 0:
                WORLD.Barrier()  # the receive is posted (or not, on purpose) by now
                comm.isend(payload(numel, tag), dest=1, tag=tag).wait(timeout=60)
                WORLD.Barrier()
            else:
                out = torch.full((numel,), -1.0)
                ptr = out.data_ptr()
                ALLOCATED.clear()
                handle = comm.irecv(0, tag, out=out) if posted_first else None
                WORLD.Barrier()
                WORLD.Barrier()  # sent (and, posted after, waiting here unmatched)
                if handle is None:
                    handle = comm.irecv(0, tag, out=out)
                obj, source, got_tag = handle.wait(timeout=60)
                what = f"{name}/{size}/{'posted first' if posted_first else 'posted after'}"
                assert obj is out and out.data_ptr() == ptr, what
                assert (source, got_tag) == (0, tag), what
                assert torch.equal(out, payload(numel, tag)), what
                if posted_first:
                    assert not ALLOCATED, f"{what}: received into new buffers {ALLOCATED}"
    # A message that does not fit: the receive fails naming both; the next one works.
    if RANK == 0:
        comm.isend(torch.ones(5, dtype=torch.float64), dest=1, tag=90).wait(timeout=60)
        comm.isend({"not": "a tensor"}, dest=1, tag=91).wait(timeout=60)
        comm.isend(torch.ones(4), dest=1, tag=92).wait(timeout=60)
    else:
        for tag, said in ((90, "shape (5,) and dtype torch.float64"), (91, "a dict")):
            try:
                comm.irecv(0, tag, out=torch.empty(4)).wait(timeout=60)
            except CommError as exc:
                assert said in str(exc) and "out is a tensor of shape (4,)" in str(exc), str(exc)
            else:
                raise AssertionError(f"{name}: a message that does not fit out was accepted")
        assert torch.equal(comm.irecv(0, 92, out=torch.empty(4)).wait(timeout=60)[0], torch.ones(4))
    WORLD.Barrier()


def main() -> None:
    for name, settings in LAYOUTS.items():
        comm = Communicator(WORLD, **settings)
        one_layout(name, comm)
        comm.close()
        case_ok(name)
    comm = Communicator(WORLD)
    for bad, error in ((torch.empty(8)[::2], ValueError), (object(), TypeError)):
        try:
            comm.irecv(0, 1, out=bad)
        except error as exc:
            assert "irecv(out=...)" in str(exc), str(exc)
        else:
            raise AssertionError(f"irecv accepted out={type(bad).__name__}")
    comm.close()
    case_ok("bad-out")


if __name__ == "__main__":
    main_guard(main)
