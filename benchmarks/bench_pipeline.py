"""Pipeline efficiency of smp_pipeline vs the ideal bubble and torch.distributed.pipelining.

Run: python benchmarks/bench_pipeline.py   (spawns `mpiexec -n 4` of itself)

A simulated model of p=4 stages: each stage sleeps t in forward and 2t in backward (the
backward sleep is in a custom autograd Function), like a GPU kernel that leaves the CPU free,
so 2 CPU cores can stand for 4 devices. The sleeps run inside ``smp_pipeline.device_work()``:
the rank's device is busy (one block at a time per rank, in the order the blocks were
reached, like kernels on one stream) while its server keeps doing other tasks' CPU work
(relaying responses, sending requests), as it would while a real GPU runs asynchronous
kernels. Outside smp_pipeline (the torch.distributed.pipelining run)
``device_work()`` simply runs the sleep. In smp_pipeline each stage calls the next one (a
nested module hierarchy, stage i on pp rank i); the driver computes a mean loss. Prints:

  efficiency: measured m*3t/step_time divided by the ideal m/(m+p-1), for m = 4, 8, 16, 32,
              with active_microbatches = p+2 (the default) and 2p
  vs 1F1B:    smp_pipeline step time / torch.distributed.pipelining Schedule1F1B step time
  Sequential: the same two lines for the stages as one plain ``nn.Sequential`` on the driver
              (default active bound), with fast_mode's relays (each stage hands its output
              straight to the next), with the relays and ``static_mode``, and without
              relays (every stage a request from the driver)
  overhead:   step latency per served request at zero compute, and CPU per request (also
              with ``static_mode``)
              (all threads of all ranks, including the communicator's, while the step
              runs: the MPI Barrier/allreduce that time it busy-wait and are left out);
              beside it Schedule1F1B's CPU per stage-boundary transfer at zero compute
              (as many transfers per microbatch as smp's chain serves requests)

Medians of 5 steps; the two systems' steps alternate so both see the same machine load.

``BENCH_PIPELINE_ONLY=overhead`` runs only the zero-compute part (the two "overhead" lines:
CPU per microbatch and stage against Schedule1F1B's per transfer), for profiling that path
alone and for quick before/after pairs; ``BENCH_PIPELINE_ZERO_STEPS`` sets its number of
timed steps (default 5), ``BENCH_PIPELINE_ZERO`` which of its runs
(comma-separated of ``torch``, ``chain``, ``relayed``, ``static``; default all: a profiler
attached to the ranks then sees one of them alone); ``BENCH_PIPELINE_PYSPY=DIR`` runs
``py-spy record`` (100 Hz, per thread, non-blocking) on each rank over those timed steps
only, into ``DIR/<run>-rank<r>.txt`` (collapsed stacks).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import workers  # (this folder)

P = 4
T = float(os.environ.get("BENCH_PIPELINE_T", "0.02"))  # forward seconds per stage
MBS = (4, 8, 16, 32)
D = 16
MB_SIZE = 2
STEPS = 5
ONLY_OVERHEAD = os.environ.get("BENCH_PIPELINE_ONLY", "") == "overhead"
ZERO_STEPS = int(os.environ.get("BENCH_PIPELINE_ZERO_STEPS", str(STEPS)))
ZERO_RUNS = os.environ.get("BENCH_PIPELINE_ZERO", "torch,chain,relayed,static").split(",")
PYSPY_DIR = os.environ.get("BENCH_PIPELINE_PYSPY", "")


_WORKER_PROFILES: list[Any] = []


def _profile_workers() -> None:
    """``BENCH_PIPELINE_CPROFILE``: each pipeline worker thread runs under its own cProfile
    (CPU clock), so the driver's step tasks show too."""
    import cProfile

    from smp_pipeline import worker

    loop = worker.Worker._loop

    def profiled_loop(self: Any) -> None:
        prof = cProfile.Profile(time.thread_time)
        _WORKER_PROFILES.append(prof)
        prof.enable()
        loop(self)

    worker.Worker._loop = profiled_loop  # type: ignore[method-assign]


@contextlib.contextmanager
def _sampled(name: str, rank: int) -> Iterator[None]:
    """With ``BENCH_PIPELINE_PYSPY`` set, py-spy samples this process while the block runs."""
    if not PYSPY_DIR:
        yield
        return
    out = os.path.join(PYSPY_DIR, f"{name}-rank{rank}.txt")
    if os.environ.get("BENCH_PIPELINE_CPROFILE"):  # (deterministic: every call, CPU clock)
        import cProfile
        import pstats

        prof = cProfile.Profile(time.thread_time)
        for w in _WORKER_PROFILES:  # (worker threads profile while the run lasts)
            w.clear()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            prof.dump_stats(out.replace(".txt", ".pstats"))
            ws = [p for p in _WORKER_PROFILES if p.getstats()]
            if ws:
                pstats.Stats(*ws).dump_stats(out.replace(".txt", "-workers.pstats"))
        return
    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "-r", "100", "--threads",
           "--nonblocking", "-f", "raw", "-o", out]  # fmt: skip
    if os.environ.get("BENCH_PIPELINE_PERF"):  # (perf's CPU samples, by library and symbol)
        cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", "2000", "-g", "-p",
               str(os.getpid()), "-o", out.replace(".txt", ".data")]  # fmt: skip
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # (it attaches)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


def _worker() -> None:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from smp_comm import Communicator
    from smp_pipeline import PipelineRuntime, device_work, seqruns
    from torch import nn

    torch.set_num_threads(1)
    if os.environ.get("BENCH_PIPELINE_CPROFILE"):
        _profile_workers()

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

    import resource

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    comm = Communicator(world)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("BENCH_PIPELINE_PORT", "29517"))
    dist.init_process_group("gloo", rank=rank, world_size=P)
    assignment = {".".join(["next"] * i): i for i in range(1, P)}

    def make_runtime(
        t: float, tag: int, active: int = P + 2, relay: bool | None = None, static: bool = False,
        device_inline: bool = False,
    ):
        """The nested chain; with ``relay`` set, the plain ``nn.Sequential`` of the stages
        instead (fast_mode's relays on or off); ``static``: with ``static_mode``;
        ``device_inline``: its replay serves requests with device work too (synchronously)."""
        if relay is None:
            model, placement = chain(t), assignment
        else:
            model = nn.Sequential(*(Stage(t) for _ in range(P)))
            placement = {str(i): i for i in range(1, P)}
        seqruns.RELAY = relay is not False  # read when the runtime plans the Sequential
        rt = PipelineRuntime(model, comm, rank, P, assignment=placement, tag=tag,
                             active_microbatches=active, timeout_s=120, static_mode=static)
        seqruns.RELAY = True
        if device_inline and rt.server.replay is not None:
            rt.server.replay.device_work_inline = True

        def step(x):
            loss = model(x).pow(2).mean()
            rt.backward(loss)
            return loss

        return rt, step

    # Two settings of the in-flight bound: the default p+2, and 2p (more microbatches in
    # flight hide the request round trips through the stage chain).
    actives = () if ONLY_OVERHEAD else (P + 2, 2 * P)
    mbs = () if ONLY_OVERHEAD else MBS
    runtimes = {a: make_runtime(T, 7400 + 10 * a, a) for a in actives}
    # The same stages as a plain nn.Sequential owned by the driver (default active bound):
    # fast_mode relays each stage's output straight to the next, or (relays off) every stage
    # is a request from the driver and back.
    sequential = {} if ONLY_OVERHEAD else {"relayed": make_runtime(T, 7600, relay=True),
                  "relayed, static_mode": make_runtime(T, 7620, relay=True, static=True),
                  "relayed, static_mode, device work replayed": make_runtime(
                      T, 7630, relay=True, static=True, device_inline=True),
                  "via rank 0": make_runtime(T, 7610, relay=False)}  # fmt: skip
    stage_mod = Stage(T)
    pippy = {}
    for m in mbs:
        stage = PipelineStage(stage_mod, rank, P, torch.device("cpu"))
        pippy[m] = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda o, y: F.mse_loss(o, y))

    def run_schedule(schedule, x, y) -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == P - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    def run_theirs(m: int, x, y) -> None:
        run_schedule(pippy[m], x, y)

    def timed(fn) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    ours: dict[tuple[int, int], list[float]] = {(a, m): [] for a in actives for m in mbs}
    ours_seq: dict[tuple[str, int], list[float]] = {(k, m): [] for k in sequential for m in mbs}
    theirs: dict[int, list[float]] = {m: [] for m in mbs}
    data = {m: (torch.randn(m * MB_SIZE, D), torch.zeros(m * MB_SIZE, D)) for m in mbs}
    for m in mbs:  # warm-up (thread pools, shape inference)
        for rt, step in (*runtimes.values(), *sequential.values()):
            rt.run_step(step, (data[m][0],), num_microbatches=m)
        run_theirs(m, *data[m])
    # Alternate the two systems, so both see the same load on a shared machine.
    for _ in range(STEPS if mbs else 0):
        for m in mbs:
            for a, (rt, step) in runtimes.items():
                ours[(a, m)].append(
                    timed(lambda m=m, rt=rt, step=step: rt.run_step(step, (data[m][0],), num_microbatches=m))
                )
            for k, (rt, step) in sequential.items():
                ours_seq[(k, m)].append(
                    timed(lambda m=m, rt=rt, step=step: rt.run_step(step, (data[m][0],), num_microbatches=m))
                )
            theirs[m].append(timed(lambda m=m: run_theirs(m, *data[m])))
    # static_mode: how many steps each serving rank replayed (and fell back from), and why.
    replays = {}
    for k in ("relayed, static_mode", "relayed, static_mode, device work replayed"):
        if k not in sequential:
            continue
        st = sequential[k][0].replay_stats
        replays[k] = world.gather(None if st is None else (st.replayed, st.fallbacks, st.recorded,
                                                           st.not_replayable), root=0)  # fmt: skip
    for rt, _ in (*runtimes.values(), *sequential.values()):
        rt.close()

    # Per zero-compute run: this rank's CPU seconds by thread name (pipeline workers as one)
    # and its context switches, over the timed steps (the per-component lines).
    by_thread: dict[str, dict[str, float]] = {}

    def step_cpu(fn, run: str = "") -> float:
        """CPU of this process (all its threads) while ``fn`` runs: the Barrier/allreduce
        around a timed step busy-wait inside MPI and are left out."""
        t0 = workers.thread_cpu()
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        fn()
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        t1 = workers.thread_cpu()
        acc = by_thread.setdefault(run, {})
        for tid, (name, ns) in t1.items():
            acc[name] = acc.get(name, 0.0) + (ns - t0.get(tid, (name, 0))[1]) * 1e-9
        acc["switches"] = acc.get("switches", 0.0) + (
            c1.ru_nvcsw + c1.ru_nivcsw - c0.ru_nvcsw - c0.ru_nivcsw)  # fmt: skip
        return c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime

    # The yardstick for smp's CPU per request: Schedule1F1B at zero compute, m = 16. Per
    # microbatch each of its p-1 stage boundaries carries one activation and one gradient,
    # 2(p-1) transfers, as many as the requests smp's chain serves per microbatch.
    x16, y16 = torch.randn(16 * MB_SIZE, D), torch.zeros(16 * MB_SIZE, D)
    zero_stage = PipelineStage(Stage(0.0), rank, P, torch.device("cpu"))
    zero_pippy = Schedule1F1B(zero_stage, n_microbatches=16, loss_fn=lambda o, y: F.mse_loss(o, y))

    theirs_cpu = 0.0

    def zero_theirs() -> None:
        nonlocal theirs_cpu
        theirs_cpu += step_cpu(lambda: run_schedule(zero_pippy, x16, y16), "Schedule1F1B")

    run_schedule(zero_pippy, x16, y16)  # warm-up
    theirs_zero = float("nan")
    if "torch" in ZERO_RUNS:
        with _sampled("torch", rank):
            theirs_zero = statistics.median(timed(zero_theirs) for _ in range(ZERO_STEPS))
    cpu_by_rank: dict[str, list[float]] = {"Schedule1F1B": world.gather(theirs_cpu, root=0)}
    theirs_cpu = world.allreduce(theirs_cpu, op=MPI.SUM)
    theirs_transfers = ZERO_STEPS * 16 * 2 * (P - 1)
    dist.destroy_process_group()

    # Runtime overhead: the same model with zero compute; latency and CPU per request, in
    # dynamic mode (the nested chain), and CPU per microbatch and stage of the relayed
    # nn.Sequential in dynamic mode and with static_mode (the one static mode replays: the
    # chain's stages call modules of other ranks, which no replay can serve).
    def zero_overhead(relay: bool | None, static: bool) -> tuple[float, int, float, float]:
        """(median step, requests served per step on the busiest rank, CPU per request, CPU
        per microbatch and stage)."""
        name = "static" if static else "relayed" if relay else "chain"
        if name not in ZERO_RUNS:
            return float("nan"), 0, float("nan"), float("nan")
        rt0, step0 = make_runtime(0.0, 7500 + 10 * static + 20 * bool(relay), relay=relay,
                                  static=static)  # fmt: skip
        rt0.run_step(step0, (x16,), num_microbatches=16)
        rt0.run_step(step0, (x16,), num_microbatches=16)  # (static mode records)
        before = rt0.requests_served
        cpu = 0.0

        def zero_step() -> None:
            nonlocal cpu
            cpu += step_cpu(lambda: rt0.run_step(step0, (x16,), num_microbatches=16), name)

        with _sampled(name, rank):
            zero = statistics.median(timed(zero_step) for _ in range(ZERO_STEPS))
        served = rt0.requests_served - before
        busiest = world.allreduce(served, op=MPI.MAX) // ZERO_STEPS
        total_served = world.allreduce(served, op=MPI.SUM)
        total_cpu = world.allreduce(cpu, op=MPI.SUM)
        cpu_by_rank[name] = world.gather(cpu, root=0)
        rt0.close()
        return zero, busiest, total_cpu / max(total_served, 1), total_cpu / (ZERO_STEPS * 16 * P)

    zero, busiest, cpu_per_request, _ = zero_overhead(None, False)
    _, _, _, relayed_cpu = zero_overhead(True, False)
    _, _, _, static_cpu = zero_overhead(True, True)
    threads = world.gather(by_thread, root=0)
    comm.close()
    ours_med = {k: statistics.median(v) for k, v in ours.items()}
    seq_med = {k: statistics.median(v) for k, v in ours_seq.items()}
    theirs_med = {m: statistics.median(v) for m, v in theirs.items()}

    if rank == 0 and not ONLY_OVERHEAD:
        for a in actives:
            eff = []
            for m in MBS:
                measured = m * 3 * T / ours_med[(a, m)]
                ideal = m / (m + P - 1)
                eff.append(f"m={m}: {measured / ideal:.3f}")
            print(f"smp_pipeline p={P} t={T * 1e3:.0f}ms active={a}: efficiency / ideal "
                  "m/(m+p-1): " + ", ".join(eff))
            print(f"smp_pipeline active={a} step time / torch.distributed.pipelining "
                  "Schedule1F1B: "
                  + ", ".join(f"m={m}: {ours_med[(a, m)] / theirs_med[m]:.3f}" for m in MBS))
        for k in sequential:
            eff = ", ".join(
                f"m={m}: {m * 3 * T / seq_med[(k, m)] / (m / (m + P - 1)):.3f}" for m in MBS
            )
            vs = ", ".join(f"m={m}: {seq_med[(k, m)] / theirs_med[m]:.3f}" for m in MBS)
            print(f"smp_pipeline nn.Sequential of the {P} stages, {k}, active={P + 2}: "
                  f"efficiency / ideal: {eff}; step time / Schedule1F1B: {vs}")
        for k, per_rank in replays.items():
            print(f"  {k}, per serving rank (replayed, fell back, recorded steps; why not "
                  f"replayable): {per_rank[1:]}")
        ref = ", ".join(
            f"m={m}: {m * 3 * T / theirs_med[m] / (m / (m + P - 1)):.3f}" for m in MBS
        )
        print(f"(for reference) Schedule1F1B efficiency / ideal: {ref}")
    if rank == 0:
        print(f"smp_pipeline overhead at zero compute (m=16): {zero / max(busiest, 1) * 1e6:.0f} us "
              f"step latency per request on the busiest rank ({busiest} requests, step "
              f"{zero * 1e3:.1f} ms), {cpu_per_request * 1e6:.0f} us CPU per request; the relayed "
              f"nn.Sequential: {relayed_cpu * 1e6:.0f} us CPU per microbatch and stage, with "
              f"static_mode {static_cpu * 1e6:.0f} us (target: <= Schedule1F1B's CPU per "
              "transfer, below)")
        print(f"(for reference) Schedule1F1B at zero compute (m=16): "
              f"{theirs_cpu / theirs_transfers * 1e6:.0f} us CPU per stage-boundary transfer, "
              f"{theirs_cpu / (ZERO_STEPS * 16 * P) * 1e6:.0f} us per microbatch and stage "
              f"(2(p-1) per microbatch, as many as smp's requests; step "
              f"{theirs_zero * 1e3:.1f} ms)")
        print("CPU per microbatch by pp rank at zero compute: " + "; ".join(
            f"{k} " + " | ".join(f"{c / (ZERO_STEPS * 16) * 1e6:.0f}" for c in v) + " us"
            for k, v in cpu_by_rank.items()))  # fmt: skip
        for run in by_thread:  # (every rank ran the same runs)
            for r, acc in enumerate(threads):
                per_mb = {k: v / (ZERO_STEPS * 16) for k, v in acc[run].items()}
                sw = per_mb.pop("switches")
                parts = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in
                                  sorted(per_mb.items(), key=lambda kv: -kv[1]) if v >= 5e-6)
                print(f"  {run}, pp rank {r}, CPU per microbatch by thread (us): {parts}; "
                      f"{sw:.1f} context switches")  # fmt: skip


def main() -> None:
    workers.main_as_job(__file__, P, _worker, timeout=600)


if __name__ == "__main__":
    main()
