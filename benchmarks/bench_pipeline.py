"""Pipeline efficiency of smp_pipeline vs the ideal bubble and torch.distributed.pipelining.

Run: python benchmarks/bench_pipeline.py   (spawns `mpiexec -n 4` of itself)

A simulated model of p=4 stages: each stage sleeps t in forward and 2t in backward (the
backward sleep is in a custom autograd Function), like a GPU kernel that leaves the CPU free,
so 2 CPU cores can stand for 4 devices. The sleeps run inside ``smp_pipeline.device_work()``:
the rank's device is busy (device work is serialised per rank) while its server keeps doing
other tasks' CPU work (relaying responses, sending requests), as it would while a real GPU
runs asynchronous kernels. Outside smp_pipeline (the torch.distributed.pipelining run)
``device_work()`` simply runs the sleep. In smp_pipeline each stage calls the next one (a
nested module hierarchy, stage i on pp rank i); the driver computes a mean loss. Prints:

  efficiency: measured m*3t/step_time divided by the ideal m/(m+p-1), for m = 4, 8, 16, 32
  vs 1F1B:    smp_pipeline step time / torch.distributed.pipelining Schedule1F1B step time
  overhead:   runtime cost per served request at zero compute (microseconds)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

P = 4
T = float(os.environ.get("BENCH_PIPELINE_T", "0.02"))  # forward seconds per stage
MBS = (4, 8, 16, 32)
D = 16
MB_SIZE = 2
STEPS = 3


def _worker() -> None:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from smp_comm import Communicator
    from smp_pipeline import PipelineRuntime, device_work
    from torch import nn

    torch.set_num_threads(1)

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):  # type: ignore[override]
            ctx.t = t
            if t:
                with device_work():  # the rank keeps serving CPU work, as with a GPU kernel
                    time.sleep(t)
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            if ctx.t:
                with device_work():
                    time.sleep(2 * ctx.t)
            return g, None

    class Stage(nn.Module):
        def __init__(self, t: float, nxt: nn.Module | None = None) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.t = t
            self.next = nxt

        def forward(self, x):
            y = Sleep.apply(self.lin(x), self.t)
            return self.next(y) if self.next is not None else y

    world = MPI.COMM_WORLD
    rank = world.Get_rank()

    def chain(t: float) -> nn.Module:
        m: nn.Module | None = None
        for _ in range(P):
            m = Stage(t, m)
        assert m is not None
        return m

    def smp_times(t: float, ms, tag: int) -> tuple[dict[int, float], int]:
        comm = smp_times.comm  # type: ignore[attr-defined]
        model = chain(t)
        assignment = {".".join(["next"] * i): i for i in range(1, P)}
        rt = PipelineRuntime(model, comm, rank, P, assignment=assignment, tag=tag,
                             active_microbatches=P + 2, timeout_s=120)
        out: dict[int, float] = {}
        served = 0

        def step(x):
            loss = model(x).pow(2).mean()
            rt.backward(loss)
            return loss

        for m in ms:
            x = torch.randn(m * MB_SIZE, D)
            rt.run_step(step, (x,), num_microbatches=m)  # warm-up
            before = rt.requests_served
            times = []
            for _ in range(STEPS):
                world.Barrier()
                t0 = time.perf_counter()
                rt.run_step(step, (x,), num_microbatches=m)
                times.append(time.perf_counter() - t0)
            served = world.allreduce(rt.requests_served - before, op=MPI.MAX) // STEPS
            out[m] = world.allreduce(statistics.median(times), op=MPI.MAX)
        rt.close()
        return out, served

    smp_times.comm = Communicator(world)  # type: ignore[attr-defined]
    ours, _ = smp_times(T, MBS, 7400)
    zero, served = smp_times(0.0, (16,), 7500)
    smp_times.comm.close()  # type: ignore[attr-defined]

    # torch.distributed.pipelining on the same simulated stages (gloo, one stage per rank).
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("BENCH_PIPELINE_PORT", "29517"))
    dist.init_process_group("gloo", rank=rank, world_size=P)
    stage_mod = Stage(T)
    theirs: dict[int, float] = {}
    for m in MBS:
        stage = PipelineStage(stage_mod, rank, P, torch.device("cpu"))
        sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda o, y: F.mse_loss(o, y))
        x = torch.randn(m * MB_SIZE, D)
        y = torch.zeros(m * MB_SIZE, D)

        def run(sched=sched, x=x, y=y) -> None:
            if rank == 0:
                sched.step(x)
            elif rank == P - 1:
                sched.step(target=y, losses=[])
            else:
                sched.step()

        run()  # warm-up (shape inference)
        times = []
        for _ in range(STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        theirs[m] = world.allreduce(statistics.median(times), op=MPI.MAX)
    dist.destroy_process_group()

    if rank == 0:
        eff = []
        for m in MBS:
            measured = m * 3 * T / ours[m]
            ideal = m / (m + P - 1)
            eff.append(f"m={m}: {measured / ideal:.3f}")
        print(f"smp_pipeline p={P} t={T * 1e3:.0f}ms efficiency / ideal m/(m+p-1): " + ", ".join(eff))
        print("smp_pipeline step time / torch.distributed.pipelining Schedule1F1B: "
              + ", ".join(f"m={m}: {ours[m] / theirs[m]:.3f}" for m in MBS))
        per_req = zero[16] / max(served, 1) * 1e6
        print(f"smp_pipeline overhead at zero compute: {per_req:.0f} us per request "
              f"(m=16 step {zero[16] * 1e3:.1f} ms, {served} requests on the busiest rank)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker()
        return
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.access(mpiexec, os.X_OK):
        mpiexec = "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [mpiexec, "-n", str(P), sys.executable, os.path.abspath(__file__), "--worker"]
    sys.exit(subprocess.run(cmd, env=env, timeout=600).returncode)


if __name__ == "__main__":
    main()
