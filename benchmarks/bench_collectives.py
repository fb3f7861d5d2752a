"""The ``smp`` torch.distributed backend against gloo: 4 ranks on one node, side by side.

Run ``python benchmarks/bench_collectives.py``: it starts ``mpiexec -n 4`` on itself
(``BENCH_COLLECTIVES_RANKS`` changes the 4) and
prints one line per measurement, each with both backends' figures and the ratio:

- ``all_gather_into_tensor`` with a 64 MiB output (16 MiB per rank), ``reduce_scatter_tensor``
  of a 64 MiB float32 input (16 MiB output per rank), ``all_reduce`` of 64 MiB float32 and
  ``all_to_all_single`` of 64 MiB: bus bandwidth (output bytes / time), best of 3 per
  backend, the backends interleaved; and 20 ``all_to_all_single`` of 1.5 MiB: time;
- ``all_reduce`` latency at 64 B, 4 KiB and 64 KiB, and ``barrier``, beside mpi4py's
  ``Allreduce`` / ``Barrier`` (MPICH's shared memory) and gloo: median of 200, in
  interleaved blocks of 20 (targets: <= 1.5x mpi4py, <= 0.1x gloo), and the floor: the same
  torch call on a Python group that does nothing (what torch's wrapper costs alone);
- ``send``/``recv`` of 10 x 64 MiB from rank 0 to rank 1 into a reused tensor, beside mpi4py
  ``Send``/``Recv`` into a reused buffer and gloo: best of 3;
- one FSDP2 (``fully_shard``) training step of a small transformer: median of 5;
- the cross-host path on two pretend hosts (node-identity override), its two stages
  overlapped in 4 MiB pieces against run one after the other (one piece).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

MIB = 1 << 20
RANKS = int(os.environ.get("BENCH_COLLECTIVES_RANKS", "4"))


def launch() -> None:
    here = os.path.dirname(sys.executable)
    mpiexec = os.path.join(here, "mpiexec")
    if not os.access(mpiexec, os.X_OK):
        mpiexec = "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", SMP_BENCH_CHILD="1")
    sys.exit(subprocess.call([mpiexec, "-n", str(RANKS), sys.executable, __file__], env=env))


def _register_noop() -> str:
    """Register a ``torch.distributed`` backend whose Python group does nothing (every
    all-reduce and barrier returns a finished handle): what torch's own call costs around a
    Python group, the floor under the smp backend's latency."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup, Work

    class Done(Work):
        def wait(self, timeout=None) -> bool:
            return True

    done = Done()

    class NoOp(ProcessGroup):
        def allreduce(self, tensors, opts=None):  # noqa: ANN001, ANN201
            return done

        def barrier(self, opts=None):  # noqa: ANN001, ANN201
            return done

        def getBackendName(self) -> str:  # noqa: N802
            return "noop"

    dist.Backend.register_backend(
        "noop", lambda store, rank, size, timeout: NoOp(rank, size), devices=["cpu"]
    )
    return "noop"


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")  # torch's deprecation notes, four ranks' worth
    import smp_comm.torch_backend  # noqa: F401
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    port = world.bcast(29500 + os.getpid() % 1000 if rank == 0 else None)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=120))
    dist.init_process_group("smp", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=300))
    groups = {"smp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    noop = dist.new_group(backend=_register_noop())  # the latency rows' floor

    def timed(fn, group) -> float:
        dist.barrier(group=groups["gloo"])
        t0 = time.perf_counter()
        fn(group)
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    def best(fn, reps: int) -> dict[str, float]:
        out: dict[str, list[float]] = {"smp": [], "gloo": []}
        for name in groups:
            fn(groups[name])  # warm up (first touch of buffers, connections)
        for _ in range(reps):
            for name, group in groups.items():
                out[name].append(timed(fn, group))
        return {k: min(v) for k, v in out.items()}

    def show(what: str, t: dict[str, float], nbytes: int | None, target: float = 0) -> None:
        if rank:
            return
        if nbytes:
            gb = {k: nbytes / v / 1e9 for k, v in t.items()}
            goal = f" (target >= {target}x)" if target else ""
            print(f"{what:<34} smp {gb['smp']:7.2f} GB/s  gloo {gb['gloo']:7.2f} GB/s  "
                  f"smp/gloo {gb['smp'] / gb['gloo']:5.2f}x{goal}", flush=True)
        else:
            print(f"{what:<34} smp {t['smp'] * 1e6:9.1f} us  gloo {t['gloo'] * 1e6:9.1f} us  "
                  f"smp/gloo {t['smp'] / t['gloo']:5.2f}x", flush=True)

    def show_latency(what: str, runs: dict, targets: dict[str, float]) -> None:
        lat: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm up
        for _ in range(10):
            for name, run in runs.items():
                world.Barrier()
                for _ in range(20):
                    t0 = time.perf_counter()
                    run()
                    lat[name].append(time.perf_counter() - t0)
        med = {k: world.allreduce(statistics.median(v), op=MPI.MAX) for k, v in lat.items()}
        if rank == 0:
            ratios = "  ".join(
                f"smp/{k} {med['smp'] / med[k]:.2f}x (target <= {v})" for k, v in targets.items()
            )
            print(f"{what + ' latency (median)':<34} smp {med['smp'] * 1e6:8.1f} us  mpi4py "
                  f"{med['mpi4py'] * 1e6:8.1f} us  gloo {med['gloo'] * 1e6:8.1f} us  {ratios}  "
                  f"[floor: torch's call on a no-op Python group {med['noop'] * 1e6:.1f} us = "
                  f"{med['noop'] / med['mpi4py']:.2f}x mpi4py]", flush=True)

    out = torch.empty(64 * MIB // 4)
    part = torch.full((64 * MIB // 4 // size,), float(rank))
    show("all_gather_into_tensor 64 MiB out",
         best(lambda g: dist.all_gather_into_tensor(out, part, group=g), 3), 64 * MIB, 3)
    whole = torch.rand(64 * MIB // 4)
    show("reduce_scatter_tensor 64 MiB in",
         best(lambda g: dist.reduce_scatter_tensor(part, whole, group=g), 3), 64 * MIB, 2)
    show("all_reduce 64 MiB",
         best(lambda g: dist.all_reduce(whole, group=g), 3), 64 * MIB, 2)
    # all_to_all_single, equal blocks: 64 MiB, and an activation's size (1.5 MiB: what
    # smp-tp's per-linear split exchanges per call for bench_plan's vit at one microbatch)
    swapped = torch.empty_like(whole)
    show("all_to_all_single 64 MiB",
         best(lambda g: dist.all_to_all_single(swapped, whole, group=g), 3), 64 * MIB)
    act = torch.rand(size * (1536 * 1024 // 4 // size))
    act_out = torch.empty_like(act)
    show("all_to_all_single 1.5 MiB x 20",
         best(lambda g: [dist.all_to_all_single(act_out, act, group=g) for _ in range(20)], 5), None)

    # Latency: all_reduce of 64 B, 4 KiB and 64 KiB, and barrier, against mpi4py's Allreduce /
    # Barrier (MPICH's shared memory) and gloo, interleaved in blocks of 20, median of 200.
    import numpy as np

    for nbytes in (64, 4096, 64 * 1024):
        small = torch.rand(nbytes // 4)
        a, b = small.numpy().copy(), np.empty(nbytes // 4, dtype=np.float32)
        runs = {
            "mpi4py": lambda a=a, b=b: world.Allreduce(a, b),
            **{name: (lambda g=g, t=small: dist.all_reduce(t, group=g))
               for name, g in (*groups.items(), ("noop", noop))},
        }
        show_latency(f"all_reduce {nbytes} B", runs, {"mpi4py": 1.5, "gloo": 0.1})
    runs = {"mpi4py": world.Barrier,
            **{name: (lambda g=g: dist.barrier(group=g))
               for name, g in (*groups.items(), ("noop", noop))}}
    show_latency("barrier", runs, {"mpi4py": 1.5, "gloo": 0.1})

    # Point to point: rank 0 streams 10 x 64 MiB to rank 1, which receives into one tensor
    # it reuses (dist.recv into it; mpi4py: Recv into a reused buffer), one message in flight.
    msg, buf = torch.rand(64 * MIB // 4), torch.empty(64 * MIB // 4)
    npmsg, npbuf = msg.numpy(), buf.numpy()

    def stream(send, recv) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            if rank == 0:
                send()
            elif rank == 1:
                recv()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    flows = {
        "mpi4py": (lambda: world.Send(npmsg, 1, 3), lambda: world.Recv(npbuf, 0, 3)),
        **{name: (lambda g=g: dist.send(msg, 1, group=g), lambda g=g: dist.recv(buf, 0, group=g))
           for name, g in groups.items()},
    }
    secs: dict[str, list[float]] = {name: [] for name in flows}
    for send, recv in flows.values():
        stream(send, recv)  # warm up
    for _ in range(3):
        for name, (send, recv) in flows.items():
            secs[name].append(stream(send, recv))
    if rank == 0:
        gbs = {k: 10 * 64 * MIB / min(v) / 1e9 for k, v in secs.items()}
        print(f"{'send/recv 10 x 64 MiB, reused':<34} smp {gbs['smp']:7.2f} GB/s  mpi4py "
              f"{gbs['mpi4py']:7.2f} GB/s  gloo {gbs['gloo']:7.2f} GB/s  smp/mpi4py "
              f"{gbs['smp'] / gbs['mpi4py']:.2f}x (target >= 0.95)  smp/gloo "
              f"{gbs['smp'] / gbs['gloo']:.2f}x", flush=True)

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    steps: dict[str, float] = {}
    for name, group in groups.items():
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Embedding(1000, 256),
            *[torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
              for _ in range(4)],
            torch.nn.Linear(256, 1000),
        )
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        x = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(rank))
        times = []
        for _ in range(6):
            dist.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        steps[name] = statistics.median(times[1:])
    show("FSDP2 step, 4-layer d=256 (median)", steps, None)

    # Two pretend hosts ({0, 1} and {2, 3}, by the node-identity override): the hierarchical
    # path with its host and inter-host stages overlapped (4 MiB pieces) against one piece
    # (the stages one after the other). One machine: the "inter-host" link is loopback TCP.
    if size != 4:
        dist.destroy_process_group()
        return
    os.environ["SMP_COMM_NODE_ID"] = f"pretend-host-{rank // 2}"
    split: dict[str, object] = {}
    for name, chunk in (("overlapped", 4 * MIB), ("sequential", 1 << 40)):
        os.environ["SMP_COMM_COLL_HOST_CHUNK_BYTES"] = str(chunk)
        split[name] = dist.new_group(backend="smp")
    for what, fn in (
        ("all_reduce 64 MiB", lambda g: dist.all_reduce(whole, group=g)),
        ("all_gather_into_tensor 64 MiB out", lambda g: dist.all_gather_into_tensor(out, part, group=g)),
    ):
        fn(split["overlapped"]), fn(split["sequential"])  # warm up
        t = {name: [] for name in split}
        for _ in range(3):
            for name, group in split.items():
                t[name].append(timed(fn, group))
        if rank == 0:
            o, q = min(t["overlapped"]), min(t["sequential"])
            print(f"2 pretend hosts x 2 ranks, {what}: overlapped {64 * MIB / o / 1e9:.2f} GB/s, "
                  f"sequential stages {64 * MIB / q / 1e9:.2f} GB/s, overlapped/sequential "
                  f"time {o / q:.2f}x", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("SMP_BENCH_CHILD"):
        main()
    else:
        launch()
