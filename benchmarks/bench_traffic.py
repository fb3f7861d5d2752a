"""smp-comm under the traffic a pipeline makes, against raw mpi4py doing the same.

Run ``python benchmarks/bench_traffic.py``: it starts ``mpiexec`` on itself (2 ranks, then 4
for the many-to-one pattern) and prints one line per pattern with both bandwidths and the
ratio. Every message is a 64 MiB float32 CPU tensor; every receiver drops each tensor once
it has it (as a pipeline stage does after using an activation), so the raw mpi4py receiver
allocates a fresh buffer per message (``np.empty``, as ``torch.empty`` would) and smp-comm
runs with flow control on (``stream_min_bytes="1M"``: payloads that find no room stream
through the zero-copy shm receive buffer of 128 MiB per rank) and with its defaults
(flow control off: what finds no room takes the MPI fallback).

Patterns (each a batch of :data:`COUNT` messages per sender; the best of :data:`REPS`
batches, contenders alternating batch by batch so both see the same load):

``stream k=K``   rank 0 sends to rank 1 with K messages in flight (a sliding window: a new
                 ``isend`` as soon as the oldest completes); the receiver keeps K receives
                 posted.
``both ways``    each rank streams to the other at once, 4 in flight each way.
``3 -> 1``       ranks 1, 2, 3 stream to rank 0 at once, 4 in flight each (the receive
                 buffer is split three ways: 42 MiB each, less than one message).
``reused k=K``   ``stream k=K`` with the receiver reusing K tensors it already has
                 (``irecv(out=...)``; mpi4py: ``Irecv`` into K reused buffers), the way a
                 pipeline stage with fixed activation shapes would receive.
``copy-out``     ``stream k=1`` with ``shm_zero_copy=False`` (the receiver copies each
                 payload out of the shm buffer) against one ``memcpy`` of 64 MiB into a
                 fresh buffer on one core (``np.copyto``), the bound a copy-out receive
                 approaches.

Bandwidth is payload bytes received per second at the receiver (all senders together).
``SMP_COMM_BENCH_ONLY=reused`` (a comma-separated list of name prefixes) runs only the
patterns whose name starts with one of them, on 2 ranks, without the copy-out line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque

MIB = 1 << 20
BIG = 64 * MIB
COUNT = 10
REPS = 5


def _stream_smp(
    comm, rank: int, senders: list[int], receiver: int, k: int, t, reuse: bool = False
) -> None:
    """Every sender streams COUNT messages to ``receiver`` with ``k`` in flight; with
    ``reuse`` the receiver receives into ``k`` tensors of its own, over and over."""
    if rank in senders:
        window: deque = deque()
        for _ in range(COUNT):
            if len(window) == k:
                window.popleft().wait(120)
            window.append(comm.isend(t, dest=receiver, tag=7))
        while window:
            window.popleft().wait(120)
    if rank == receiver:
        import torch

        posted: deque = deque()
        total = COUNT * len(senders)
        got = 0
        pool = deque(torch.empty_like(t) for _ in range(k * len(senders))) if reuse else None

        def post() -> None:
            if pool is None:
                posted.append((comm.irecv(tag=7), None))
            else:
                out = pool.popleft()
                posted.append((comm.irecv(tag=7, out=out), out))

        for _ in range(min(k * len(senders), total)):
            post()
        while got < total:
            handle, mine = posted.popleft()
            out = handle.wait(120)
            del out  # dropped after use
            if pool is not None:
                pool.append(mine)
            got += 1
            if got + len(posted) < total:
                post()


def _stream_mpi(
    world, rank: int, senders: list[int], receiver: int, k: int, buf, reuse: bool = False
) -> None:
    import numpy as np
    from mpi4py import MPI

    pool = deque(np.empty_like(buf) for _ in range(k * len(senders))) if reuse else None

    def fresh() -> np.ndarray:
        return np.empty_like(buf) if pool is None else pool.popleft()

    if rank in senders:
        window: deque = deque()
        for _ in range(COUNT):
            if len(window) == k:
                window.popleft().Wait()
            window.append(world.Isend([buf, MPI.BYTE], dest=receiver, tag=7))
        while window:
            window.popleft().Wait()
    if rank == receiver:
        total = COUNT * len(senders)
        posted: deque = deque()
        got = 0
        for _ in range(min(k * len(senders), total)):
            out = fresh()
            posted.append((world.Irecv([out, MPI.BYTE], source=MPI.ANY_SOURCE, tag=7), out))
        while got < total:
            req, out = posted.popleft()
            req.Wait()
            if pool is not None:
                pool.append(out)
            del out
            got += 1
            if got + len(posted) < total:
                out = fresh()
                posted.append((world.Irecv([out, MPI.BYTE], source=MPI.ANY_SOURCE, tag=7), out))


def worker() -> None:
    import numpy as np
    import torch
    from mpi4py import MPI
    from smp_comm import Communicator

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    # Flow control on (streaming through the buffer; opt-in, smp_comm.stream), and the
    # default without it (what finds no room takes the MPI fallback).
    comm = Communicator(world, stream_min_bytes="1M")
    plain_comm = Communicator(world)
    copy_comm = Communicator(world, shm_zero_copy=False, stream_min_bytes="1M")
    t = torch.randn(BIG // 4)
    buf = t.numpy()
    if size == 2:
        patterns = {
            "stream k=1": ([0], 1, 1),
            "stream k=4": ([0], 1, 4),
            "stream k=10": ([0], 1, 10),
            "both ways k=4": (None, None, 4),
            "reused k=1": ([0], 1, 1, True),
            "reused k=4": ([0], 1, 4, True),
        }
    else:
        patterns = {"3 -> 1 k=4": ([1, 2, 3], 0, 4)}
    only = [p.strip() for p in os.environ.get("SMP_COMM_BENCH_ONLY", "").split(",") if p.strip()]
    if only:
        patterns = {n: p for n, p in patterns.items() if any(n.startswith(o) for o in only)}

    def run(kind: str, pattern: tuple, c=comm) -> None:
        senders, receiver, k, *rest = pattern
        reuse = bool(rest and rest[0])
        if kind == "plain":
            kind, c = "smp", plain_comm
        if senders is None:  # both ways: two streams at once, one per direction
            import threading

            fn = _stream_smp if kind == "smp" else _stream_mpi
            target = c if kind == "smp" else world
            data = t if kind == "smp" else buf
            other = threading.Thread(target=fn, args=(target, rank, [rank], 1 - rank, k, data))
            other.start()
            fn(target, rank, [1 - rank], rank, k, data)
            other.join()
        elif kind == "smp":
            _stream_smp(c, rank, senders, receiver, k, t, reuse)
        else:
            _stream_mpi(world, rank, senders, receiver, k, buf, reuse)

    results: dict[str, dict[str, float]] = {}
    for name, pattern in patterns.items():
        best = {"smp": float("inf"), "plain": float("inf"), "mpi": float("inf")}
        for rep in range(REPS + 1):  # the first round warms them up
            for kind in best:
                world.Barrier()
                t0 = time.perf_counter()
                run(kind, pattern)
                world.Barrier()
                if rep:
                    best[kind] = min(best[kind], time.perf_counter() - t0)
        results[name] = best
    stats = comm.stats()
    copy_line = None
    if size == 2 and not only:
        best_copy = float("inf")
        best_memcpy = float("inf")
        for rep in range(REPS + 1):
            world.Barrier()
            t0 = time.perf_counter()
            run("smp", ([0], 1, 1), copy_comm)
            world.Barrier()
            took = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(COUNT):
                out = np.empty_like(buf)
                np.copyto(out, buf)
                del out
            mem = time.perf_counter() - t0
            if rep:
                best_copy, best_memcpy = min(best_copy, took), min(best_memcpy, mem)
        copy_line = (best_copy, best_memcpy)
    comm.close()
    plain_comm.close()
    copy_comm.close()
    if rank == 0:
        for name, best in results.items():
            senders = patterns[name][0]
            streams = 2 if senders is None else len(senders)
            nbytes = COUNT * BIG * streams
            smp_gbs, mpi_gbs = nbytes / best["smp"] / 1e9, nbytes / best["mpi"] / 1e9
            plain_gbs = nbytes / best["plain"] / 1e9
            print(
                f"traffic {name} ({size} ranks, 64MiB x {COUNT} per stream): smp_comm "
                f"{smp_gbs:.2f} GB/s | default (no flow control) {plain_gbs:.2f} GB/s | mpi4py "
                f"{mpi_gbs:.2f} GB/s | smp/mpi {smp_gbs / mpi_gbs:.2f}x "
                f"(target >={0.95 if len(patterns[name]) > 3 else 1.0}), "
                f"default {plain_gbs / mpi_gbs:.2f}x"
            )
        print(
            f"traffic paths on rank 0 ({size} ranks, all patterns, flow control on): "
            f"shm messages {stats['shm']['messages']}, MPI messages {stats['mpi']['messages']}, "
            f"of which fallbacks (buffer full) {stats['mpi']['fallbacks']}"
        )
        if copy_line is not None:
            copy_gbs = COUNT * BIG / copy_line[0] / 1e9
            mem_gbs = COUNT * BIG / copy_line[1] / 1e9
            print(
                f"traffic copy-out k=1 (shm_zero_copy=False, streamed): smp_comm {copy_gbs:.2f} GB/s | "
                f"memcpy into a fresh buffer {mem_gbs:.2f} GB/s | copy/memcpy "
                f"{copy_gbs / mem_gbs:.2f}x (target >=0.8)"
            )


def main() -> None:
    from smp_comm.testing import mpiexec_path

    mpiexec = mpiexec_path()
    env = dict(os.environ, OMP_NUM_THREADS="1", SMP_COMM_BENCH_WORKER="1")
    print(f"(load average before: {os.getloadavg()[0]:.1f})", flush=True)
    for n in (2,) if os.environ.get("SMP_COMM_BENCH_ONLY") else (2, 4):
        cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__)]
        subprocess.run(cmd, env=env, check=True, timeout=900)


if __name__ == "__main__":
    if os.environ.get("SMP_COMM_BENCH_WORKER"):
        worker()
    else:
        main()
