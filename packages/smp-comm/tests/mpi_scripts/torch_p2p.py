"""Point to point on ``smp`` groups under MPI (smp_comm.torch_p2p): sends from and receives
into the callers' tensors, every dtype's bytes, strided tensors, any-source receives,
``batch_isend_irecv``, subgroups, size mismatches and a sender that never comes. 2 or more
ranks."""

from __future__ import annotations

import time
from datetime import timedelta

import smp_comm.torch_backend  # noqa: F401
import torch
import torch.distributed as dist
from mpi4py import MPI
from payloads import case_ok, init_smp_world, main_guard
from smp_comm.collectives.shm import PeerFailedError

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
DTYPES = [torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.int64, torch.uint8]
HANG_BOUND_S = 60  # a bound on a hang, not a latency target


def value(src: int, dst: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.float64) * (src + 1) + 100 * dst
    return (x % 2).to(dtype) if dtype == torch.bool else x.to(dtype)


def ring(group: dist.ProcessGroup | None = None) -> None:
    """Each rank sends to the next and receives from the previous, every dtype and size,
    contiguous and strided, asynchronously (both posted before either is waited)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(SIZE))
    me = ranks.index(RANK)
    nxt, prv = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
    for dtype in DTYPES:
        for n in (0, 1, 37, 70000):
            got = torch.empty(n, dtype=dtype)
            recv = dist.irecv(got, src=prv, group=group, tag=n % 7)
            send = dist.isend(value(RANK, nxt, n, dtype), dst=nxt, group=group, tag=n % 7)
            recv.wait()
            send.wait()
            assert torch.equal(got, value(prv, RANK, n, dtype)), (dtype, n)
            # strided on both sides: every other element of a longer tensor
            wide = torch.zeros(2 * n, dtype=dtype)
            recv = dist.irecv(wide[::2], src=prv, group=group)
            src = torch.zeros(2 * n, dtype=dtype)
            src[1::2] = value(RANK, nxt, n, dtype)
            dist.send(src[1::2], dst=nxt, group=group)
            recv.wait()
            assert torch.equal(wide[::2], value(prv, RANK, n, dtype)) and not wide[1::2].any()


def main() -> None:
    init_smp_world(60)
    pg = dist.group.WORLD
    assert pg._p2p is not None, "an smp group under MPI did not get its MPI point to point"
    ring()
    case_ok("p2p-ring")

    # Any source: rank 0 receives one message from each other rank, in whatever order.
    if RANK == 0:
        seen = set()
        for _ in range(SIZE - 1):
            t = torch.empty(3)
            src = dist.recv(t, tag=5)
            assert t.tolist() == [float(src)] * 3, (src, t)
            seen.add(src)
        assert seen == set(range(1, SIZE)), seen
    else:
        dist.send(torch.full((3,), float(RANK)), dst=0, tag=5)
    case_ok("p2p-anysource")

    # batch_isend_irecv (what torch.distributed.pipelining's schedules call): a ring.
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.empty(5, dtype=torch.bfloat16)
    ops = [dist.P2POp(dist.isend, value(RANK, nxt, 5, torch.bfloat16), nxt),
           dist.P2POp(dist.irecv, got, prv)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert torch.equal(got, value(prv, RANK, 5, torch.bfloat16)), got
    case_ok("p2p-batch")

    # A subgroup of the first and last rank: dst/src are job-wide ranks, translated by torch.
    sub = dist.new_group([0, SIZE - 1], backend="smp")
    if RANK in (0, SIZE - 1):
        ring(sub)
    case_ok("p2p-subgroup")

    # Sizes that disagree: an error naming the sender, never a partly filled tensor.
    if RANK == 1:
        dist.send(torch.ones(10), dst=0, tag=1)  # into 12 elements: too short
        dist.send(torch.ones(10), dst=0, tag=2)  # into 8 elements: too long
    if RANK == 0:
        for n, tag, words in ((12, 1, "sent 40 bytes, the receiving tensor has 48"),
                              (8, 2, "longer than the receiving tensor's 32 bytes")):
            try:
                dist.recv(torch.zeros(n), src=1, tag=tag)
            except ValueError as exc:
                assert words in str(exc), str(exc)
                print(f"rank 0 [size {n}] raised: {exc}", flush=True)
            else:
                raise AssertionError(f"a 10-element message into {n} elements was accepted")
    WORLD.Barrier()
    case_ok("p2p-size")

    # A sender that never comes: the receive raises within the group's timeout, naming it.
    short = dist.new_group(backend="smp", timeout=timedelta(seconds=2))
    if RANK == 0:
        start = time.monotonic()
        try:
            dist.recv(torch.zeros(4), src=1, tag=9, group=short)
        except PeerFailedError as exc:
            assert "waiting for rank 1" in str(exc), str(exc)
            print(f"rank 0 [absent sender] raised after {time.monotonic() - start:.2f} s: {exc}",
                  flush=True)
        else:
            raise AssertionError("a receive from a rank that never sent returned")
        assert time.monotonic() - start < HANG_BOUND_S
    WORLD.Barrier()
    case_ok("p2p-absent")
    dist.destroy_process_group()


if __name__ == "__main__":
    main_guard(main)
