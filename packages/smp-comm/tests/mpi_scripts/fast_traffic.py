"""The small-message fast path under real traffic (3 ranks).

Several sender threads per rank each send one stream per peer, on a tag of their own,
mixing fast-path messages (lone small tensors/arrays of many kinds) with general-path ones
(large tensors through shm, small structures, tensors just over the limit). Receivers check
every message byte for byte and that each stream arrives in the order it was sent.
Then: ANY_SOURCE streams, first-posted-wins across fast and general messages, a timeout
that names the peer and tag, stats, a communicator whose fast path is off on one rank, and
one whose fast path is compiled on rank 0 only (frames are the same either way).

``EXPECT_FAST_PATH`` (compiled / python) names the fast path the main communicator must use.
"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import torch
from mpi4py import MPI
from payloads import case_ok, guarded_by, main_guard, run_threads
from smp_comm import ANY_SOURCE, ANY_TAG, CommTimeoutError, Communicator

THREADS = 3
PER_STREAM = 40
LIMIT = 4096


def make(src: int, dst: int, tag: int, i: int):
    """Message ``i`` of stream (src -> dst, tag); its kind is drawn from the same seed.
    Returns ``(obj, fast)``: whether it should take the fast path."""
    seed = src * 1000003 + dst * 10007 + tag * 101 + i
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kind = rng.randrange(10)
    if kind == 0:
        return torch.randn(rng.randrange(1, LIMIT // 4 + 1), generator=g), True
    if kind == 1:
        return torch.randn(5, 7, generator=g).to(torch.bfloat16).requires_grad_(), True
    if kind == 2:
        return np.random.default_rng(seed).integers(-9, 9, size=(2, 3, 4)), True
    if kind == 3:
        return torch.randn(8, 6, generator=g).t(), True  # non-contiguous
    if kind == 4:
        return (torch.empty(0, 3) if rng.random() < 0.5 else torch.tensor(float(i))), True
    if kind == 5:
        return torch.randn(1 << 16, generator=g), False  # 256 KiB: shm
    if kind == 6:
        return {"i": i, "t": torch.randn(3, generator=g)}, False  # a structure
    if kind == 7:
        return torch.randn(LIMIT // 4 + 1, generator=g), False  # just over the limit
    if kind == 8:
        return torch.randint(0, 255, (64,), generator=g, dtype=torch.uint8), True
    return np.arange(i, i + 10, dtype=np.float64), True


def same(a, b, what: str) -> None:
    assert type(a) is type(b), f"{what}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what}: {a.dtype}{a.shape} {b.dtype}{b.shape}"
        )
        assert a.requires_grad == b.requires_grad, what
        x, y = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{what}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), what
    else:
        assert a.keys() == b.keys() and a["i"] == b["i"], what
        same(a["t"], b["t"], what)


def main() -> None:
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = Communicator(world, small_message_bytes=LIMIT)
    rank, size = comm.rank, comm.size
    expect = os.environ.get("EXPECT_FAST_PATH")
    if expect:
        from smp_comm import compiled

        assert comm.fast_path == expect, (comm.fast_path, compiled.why_not())
    peers = [p for p in range(size) if p != rank]
    errors: list[BaseException] = []
    fast_per_thread = [0] * THREADS

    guarded = guarded_by(errors)

    @guarded
    def sender(k: int) -> None:
        # Thread k sends stream (rank -> p, tag k) to every peer, interleaved at random;
        # each stream in its own order. Some sends are waited at once, some at the end.
        order = [p for p in peers for _ in range(PER_STREAM)]
        random.Random(rank * 17 + k).shuffle(order)
        nxt = dict.fromkeys(peers, 0)
        handles = []
        for p in order:
            obj, fast = make(rank, p, k, nxt[p])
            nxt[p] += 1
            fast_per_thread[k] += fast
            h = comm.isend(obj, dest=p, tag=k)
            if random.random() < 0.3:
                assert h.wait(timeout=60) is None
            else:
                handles.append(h)
        for h in handles:
            assert h.wait(timeout=60) is None

    @guarded
    def receiver(p: int, k: int) -> None:
        for i in range(PER_STREAM):
            # One receiver thread per stream: its messages must come in the order sent,
            # whichever path (and whichever thread on this rank) carried each.
            got, src, tag = comm.irecv(source=p, tag=k).wait(timeout=60)
            assert (src, tag) == (p, k), (src, tag, p, k)
            same(got, make(p, rank, k, i)[0], f"stream {p}->{rank} tag {k} #{i}")

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(THREADS)]
    threads += [
        threading.Thread(target=receiver, args=(p, k)) for p in peers for k in range(THREADS)
    ]
    run_threads(threads, errors)
    case_ok("threaded-streams")

    # ANY_SOURCE: every peer sends a stream on tag 50; one thread receives them all with
    # ANY_SOURCE and checks per-source order.
    world.Barrier()
    sends = [
        comm.isend(torch.full((3,), float(i)), dest=p, tag=50) for i in range(20) for p in peers
    ]
    seen = dict.fromkeys(peers, 0)
    for _ in range(20 * len(peers)):
        got, src, tag = comm.irecv(source=ANY_SOURCE, tag=50).wait(timeout=60)
        assert tag == 50 and torch.equal(got, torch.full((3,), float(seen[src]))), (src, got)
        seen[src] += 1
    for h in sends:
        h.wait(timeout=60)
    case_ok("any-source")

    # First posted receive wins, fast and general messages alike, in send order.
    world.Barrier()
    if rank == 1:
        first = comm.irecv(ANY_SOURCE, ANY_TAG)
        second = comm.irecv(0, 7)
        world.Barrier()  # rank 0 sends tag 7 (fast), tag 8 (general), tag 7 (fast)
        a, src, tag = first.wait(timeout=30)
        assert (src, tag) == (0, 7) and torch.equal(a, torch.tensor([1.0])), (a, src, tag)
        c, src, tag = second.wait(timeout=30)
        assert (src, tag) == (0, 7) and torch.equal(c, torch.tensor([3.0])), (c, src, tag)
        b = comm.irecv(0, ANY_TAG).wait(timeout=30)
        assert b[0] == {"b": 2} and b[1:] == (0, 8), b
    elif rank == 0:
        world.Barrier()
        for obj, tag in ((torch.tensor([1.0]), 7), ({"b": 2}, 8), (torch.tensor([3.0]), 7)):
            comm.isend(obj, dest=1, tag=tag).wait(timeout=30)
    else:
        world.Barrier()
    case_ok("first-posted-wins")

    # A receive nobody sends to times out naming the peer and the tag, then is withdrawn.
    peer = (rank + 1) % size
    h = comm.irecv(source=peer, tag=999)
    try:
        h.wait(timeout=0.2)
    except CommTimeoutError as exc:
        assert f"rank {peer}" in str(exc) and "tag 999" in str(exc), str(exc)
        assert (exc.peer, exc.tag) == (peer, 999)
    else:
        raise AssertionError("expected CommTimeoutError")
    assert h.cancel()
    case_ok("timeout-names-peer")

    stats = comm.stats()["mpi"]
    assert stats["fast_sent"] == sum(fast_per_thread) + 20 * len(peers) + (rank == 0) * 2, stats
    assert stats["fast_received"] > 0 and stats["messages_received"] >= stats["fast_received"]
    # Nobody closes while a peer may still be inside its timeout check above (a BYE arriving
    # then turns the expected CommTimeoutError into PeerClosedError).
    world.Barrier()
    comm.close()
    case_ok("stats")

    # Fast path off on rank 0 only: everything still arrives (frames are probed anyway).
    off = Communicator(world, small_message_bytes=0 if rank == 0 else LIMIT)
    hs = [off.isend(torch.arange(4) + rank, dest=p, tag=1) for p in peers]
    for p in peers:
        got, _, _ = off.irecv(source=p, tag=1).wait(timeout=30)
        assert torch.equal(got, torch.arange(4) + p), got
    for h in hs:
        h.wait(timeout=30)
    st = off.stats()["mpi"]
    assert st["fast_sent"] == (0 if rank == 0 else len(peers)), st
    off.close()
    case_ok("fast-path-off-on-one-rank")

    # Compiled on rank 0, Python elsewhere: every kind of message both ways, in order.
    mixed = Communicator(world, small_message_bytes=LIMIT, compiled=rank == 0)
    assert mixed.fast_path in (("compiled", "python") if rank == 0 else ("python",)), mixed.fast_path
    hs = [mixed.isend(make(rank, p, 9, i)[0], dest=p, tag=9) for i in range(30) for p in peers]
    for i in range(30):
        for p in peers:
            got, _, _ = mixed.irecv(source=p, tag=9).wait(timeout=30)
            same(got, make(p, rank, 9, i)[0], f"mixed {p}->{rank} #{i}")
    for h in hs:
        h.wait(timeout=30)
    kinds = world.allgather(mixed.fast_path)
    assert expect != "compiled" or kinds == ["compiled"] + ["python"] * (size - 1), kinds
    mixed.close()
    case_ok("compiled-and-python")
    print(f"rank {rank} OK fast_traffic {stats}")


main_guard(main)
