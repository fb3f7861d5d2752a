"""Random-order traffic from several threads in both directions, one path forced by argv.

usage: traffic.py MODE   with MODE in shm | rma | mpi-disabled | mpi-tiny | mixed |
                         stream | stream-copy | stream-rma | stream-mpi | stream-both

The ``stream`` modes send ~10 MiB payloads that go through the direct path in chunks
(smp_comm.stream): ``stream``, a shm buffer slice smaller than one payload; ``stream-copy``,
receivers that copy out (``shm_zero_copy=False``); ``stream-rma``, every rank its own node;
``stream-mpi``, no chunk ever finds room, so every chunk follows over MPI. These four stream
even while the rank receives streams itself (``STREAM_WHILE_RECEIVING``: they test the
mechanism under all-to-all traffic); ``stream-both`` keeps the default, where a payload that
finds no room while this rank receives a stream takes the MPI fallback instead, so each
message is streamed or falls back, depending on timing.
"""

from __future__ import annotations

import random
import sys
import threading

from mpi4py import MPI
from payloads import case_ok, check, guarded_by, main_guard, make, own_shm_files, run_threads
from smp_comm import ANY_SOURCE, ANY_TAG, Communicator

MODE = sys.argv[1]
THREADS = 3
PER_THREAD = 4  # messages per sender thread per peer
# Bytes of each of the two big tensors of a payload: past stream_min_bytes (1 MiB here) and 2 chunks.
BIG = (5 << 20) if MODE.startswith("stream") else (1 << 18)


def main() -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    world = MPI.COMM_WORLD
    kwargs: dict = {}
    if MODE == "rma":
        kwargs["node_id"] = f"node{world.rank}"
    elif MODE == "mpi-disabled":
        kwargs["disable"] = "shm,rma"
    elif MODE == "mpi-tiny":
        kwargs["buffer_bytes"] = 4096
    elif MODE == "mixed":
        kwargs["node_id"] = f"node{world.rank // 2}"  # 0,1 share a node; 2,3 the other
    elif MODE in ("stream", "stream-mpi", "stream-both"):
        kwargs["buffer_bytes"] = "8M"  # 4 MiB per writer: less than one payload
    elif MODE == "stream-copy":
        kwargs["shm_zero_copy"] = False
    elif MODE == "stream-rma":
        kwargs["node_id"] = f"node{world.rank}"
    if MODE.startswith("stream"):
        kwargs["stream_min_bytes"] = "1M"
    if MODE in ("stream", "stream-copy", "stream-rma", "stream-mpi"):
        import smp_comm.sender

        smp_comm.sender.STREAM_WHILE_RECEIVING = True
        if MODE == "stream-mpi":
            smp_comm.sender.wait_for_room = lambda *args: None  # never any room for a chunk
    comm = Communicator(world, **kwargs)
    assert not own_shm_files(), own_shm_files()
    rank, size = comm.rank, comm.size
    peers = [p for p in range(size) if p != rank]
    errors: list[BaseException] = []
    kept: list = []  # every received object, checked again once all traffic is done

    guarded = guarded_by(errors)

    # Tags: thread k sends tags k*100 + i. Tags < 200 are received by exact (source, tag)
    # receives, tags >= 200 by ANY_SOURCE receives on that tag.
    @guarded
    def sender(k: int) -> None:
        work = [(p, k * 100 + i) for p in peers for i in range(PER_THREAD)]
        random.Random(rank * 31 + k).shuffle(work)
        handles = [comm.isend(make(rank, p, t, BIG), dest=p, tag=t) for p, t in work]
        for h in handles:
            assert h.wait(timeout=60) is None

    @guarded
    def exact_receiver(seed: int, items: list) -> None:
        random.Random(seed).shuffle(items)
        handles = [(s, t, comm.irecv(source=s, tag=t)) for s, t in items]
        random.Random(seed + 1).shuffle(handles)
        for s, t, h in handles:
            obj, src, tag = h.wait(timeout=60)
            assert (src, tag) == (s, t), f"wanted ({s},{t}) got ({src},{tag})"
            check(obj, s, rank, t, BIG)
            kept.append((obj, s, t))

    @guarded
    def any_source_receiver(tag: int) -> None:
        seen = []
        for _ in peers:
            obj, src, t = comm.irecv(source=ANY_SOURCE, tag=tag).wait(timeout=60)
            assert t == tag
            check(obj, src, rank, t, BIG)
            kept.append((obj, src, t))
            seen.append(src)
        assert sorted(seen) == peers, seen

    exact = [(p, k * 100 + i) for p in peers for k in range(2) for i in range(PER_THREAD)]
    threads = [threading.Thread(target=sender, args=(k,)) for k in range(THREADS)]
    threads += [
        threading.Thread(target=exact_receiver, args=(rank, exact[0::2])),
        threading.Thread(target=exact_receiver, args=(rank + 50, exact[1::2])),
    ]
    threads += [
        threading.Thread(target=any_source_receiver, args=(200 + i,)) for i in range(PER_THREAD)
    ]
    run_threads(threads, errors)
    case_ok("threaded-traffic")
    # Received tensors may be views of the receive buffer: they must still hold their
    # bytes after all later traffic (no region is reused while a view is alive).
    for obj, src, t in kept:
        check(obj, src, rank, t, BIG)
    kept.clear()
    case_ok("views-survive")

    # Matching semantics: the first posted receive that accepts a message gets it.
    world.Barrier()
    if rank == 1:
        first = comm.irecv(ANY_SOURCE, ANY_TAG)
        second = comm.irecv(0, 7)
        world.Barrier()  # rank 0 sends tag 7 (a), then tag 8 (b), then tag 7 (c)
        a = first.wait(timeout=30)
        assert a[0] == "a" and a[1:] == (0, 7), a
        c = second.wait(timeout=30)
        assert c[0] == "c" and c[1:] == (0, 7), c
        b = comm.irecv(0, ANY_TAG).wait(timeout=30)
        assert b == ("b", 0, 8), b
    elif rank == 0:
        world.Barrier()
        for obj, tag in (("a", 7), ("b", 8), ("c", 7)):
            comm.isend(obj, dest=1, tag=tag).wait(timeout=30)
    else:
        world.Barrier()
    case_ok("first-posted-wins")

    stats = comm.stats()
    sent = THREADS * PER_THREAD * len(peers)
    total = sum(stats[p]["messages_sent"] for p in stats)
    assert total >= sent, stats
    if MODE == "shm":
        assert (
            stats["shm"]["messages_sent"] == sent and stats["shm"]["messages_received"] == sent
        ), stats
    elif MODE == "rma":
        assert stats["rma"]["messages_sent"] == sent and stats["shm"]["messages"] == 0, stats
    elif MODE == "mpi-disabled":
        assert stats["mpi"]["messages_received"] >= sent and stats["mpi"]["fallbacks"] == 0, stats
        assert stats["shm"]["messages"] == stats["rma"]["messages"] == 0, stats
    elif MODE == "mpi-tiny":
        assert stats["mpi"]["fallbacks"] == sent and stats["shm"]["messages"] == 0, stats
    elif MODE == "mixed":
        other_node = [p for p in peers if p // 2 != rank // 2]
        same_node = [p for p in peers if p // 2 == rank // 2]
        per_peer = THREADS * PER_THREAD
        assert stats["rma"]["messages_sent"] == per_peer * len(other_node), stats
        assert stats["shm"]["messages_sent"] == per_peer * len(same_node), stats
    elif MODE == "stream-both":
        streamed, fallbacks = stats["shm"]["streamed_sent"], stats["mpi"]["fallbacks"]
        # every message streamed or fell back (a stream that then found no room counts as both)
        assert streamed + fallbacks >= sent and stats["shm"]["messages_sent"] == streamed, stats
        assert streamed <= sent and fallbacks <= sent, stats
        received = stats["shm"]["messages_received"] + stats["mpi"]["messages_received"]
        assert received >= sent, stats
    elif MODE.startswith("stream"):
        path = "rma" if MODE == "stream-rma" else "shm"
        assert stats[path]["streamed_sent"] == sent == stats[path]["messages_received"], stats
        assert (stats["mpi"]["fallbacks"] == sent) == (MODE == "stream-mpi"), stats
    assert stats["cuda_ipc"]["messages"] == 0
    case_ok("path-stats")
    comm.close()
    comm.close()  # idempotent
    assert not own_shm_files(), own_shm_files()
    case_ok("close")
    print(f"rank {rank} OK {MODE} {stats}")


main_guard(main)
