"""CPU per pipeline request at zero compute, and where it goes (cProfile per thread).

Run: python benchmarks/profile_requests.py            (spawns `mpiexec -n P` of itself)

The zero-compute chain of ``bench_pipeline.py`` (stage i on pp rank i calls stage i+1; each
stage is one ``Linear(16, 16)``), ``P`` ranks (``PROFILE_REQ_P``, default 2), ``M``
microbatches per step (``PROFILE_REQ_M``, default 16), ``STEPS`` timed steps
(``PROFILE_REQ_STEPS``, default 30). Prints, per step, the CPU time of all threads of all
ranks (``resource.getrusage``, so the communicator's threads count too) divided by the
requests all ranks served, and the median over steps. CPU time stays meaningful on a loaded
machine, where wall-clock latency does not. Per thread it also prints the CPU (``/proc``, 10
ms ticks) and the context switches (voluntary and not) per request, and per rank the time
spent in the cyclic garbage collector (``gc.callbacks``, by generation).

``PROFILE_REQ_GC=freeze`` runs ``gc.freeze()`` after the warm-up, ``=off`` ``gc.disable()``
(to tell the collector's share; it is process-wide, so compare separate runs).

``PROFILE_REQ_AB=<knob>`` adds a runtime with one change of the request-cost work undone
(``_KNOBS``); the two runtimes' steps alternate, so both see the same load, and the CPU
figures are reported for each (the per-thread and profile figures cover both).

``PROFILE_REQ_STATIC=1`` builds the runtimes with ``static_mode=True`` (with
``PROFILE_REQ_AB=static`` the second one serves every request on a worker: static mode's
replay and inlining undone; ``PROFILE_REQ_AB=replay``: only the replay undone, recorded
requests still served inline).

``PROFILE_REQ_CPROFILE=DIR`` also runs every thread of every rank under ``cProfile``, timed
by the thread's CPU clock (its overhead inflates the totals; read it for the shares) and writes ``DIR/rank<r>.pstats``
(all threads merged) plus the top functions by own time to ``DIR/rank<r>.txt``.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import workers  # (this folder)

P = int(os.environ.get("PROFILE_REQ_P", "2"))
M = int(os.environ.get("PROFILE_REQ_M", "16"))
STEPS = int(os.environ.get("PROFILE_REQ_STEPS", "30"))
PROFILE_DIR = os.environ.get("PROFILE_REQ_CPROFILE", "")
AB = os.environ.get("PROFILE_REQ_AB", "")
# PROFILE_REQ_STATIC=1: runtimes in static mode (PROFILE_REQ_AB=static: the second one not).
STATIC = os.environ.get("PROFILE_REQ_STATIC", "") == "1"
# PROFILE_REQ_GC=freeze: gc.freeze() after the warm-up steps; =off: gc.disable().
GC = os.environ.get("PROFILE_REQ_GC", "")
D = 16


def _frames_off(rt: Any) -> None:
    rt.server.transport.frame_limit = 0  # every message as a tuple (the general path)


# PROFILE_REQ_AB=<knob>: a second runtime with this change undone, for before/after figures
# from one run (steps alternate).
def _spin(seconds: float) -> Callable[[Any], None]:
    def set_spin(rt: Any) -> None:
        rt.server.transport.spin_s = seconds

    return set_spin


def _static_off(rt: Any) -> None:
    rt.server.executor.inline_max_s = 0.0  # every request on a worker (dynamic mode)
    rt.server.replay = None


def _replay_off(rt: Any) -> None:
    rt.server.replay = None  # static mode without the replay: recorded requests served inline


_KNOBS: dict[str, Callable[[Any], None]] = {
    "static": _static_off,
    "replay": _replay_off,
    "frames": _frames_off,
    "spin0": _spin(0.0),
    "spin50us": _spin(5e-5),
    "spin1ms": _spin(1e-3),
}


def _cpu_profile():  # type: ignore[no-untyped-def]
    """A profiler that counts the thread's CPU time, not wall-clock time: blocking waits and
    time descheduled by other jobs (this machine is shared) then count nothing."""
    import cProfile
    import time

    return cProfile.Profile(time.thread_time_ns, 1e-9)


def _profile_all_threads() -> list:  # type: ignore[type-arg]
    """Run every thread started from now on under its own cProfile.Profile."""
    import threading

    profiles: list = []  # type: ignore[type-arg]
    run = threading.Thread.run

    def profiled_run(self: threading.Thread) -> None:
        p = _cpu_profile()
        profiles.append(p)
        p.enable()
        try:
            run(self)
        finally:
            p.disable()

    threading.Thread.run = profiled_run  # type: ignore[method-assign]
    return profiles


def _per_thread(read: Callable[[str], float]) -> dict[str, float]:
    """``read(tid)`` summed per live thread of this process, by thread name (/proc, Linux)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            value = read(tid)
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), f"native-{tid}")
        out[name] = out.get(name, 0.0) + value
    return out


def _switches(tid: str) -> float:
    """Context switches (voluntary + involuntary) of thread ``tid``."""
    with open(f"/proc/self/task/{tid}/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)


def _cpu_seconds(tid: str) -> float:
    """CPU seconds (user + system, 10 ms ticks) of thread ``tid``."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _GcClock:
    """Time this process spends in the cyclic garbage collector, by generation
    (``gc.callbacks``; thread CPU clock, so descheduled time does not count)."""

    def __init__(self) -> None:
        import gc
        import time

        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._t0 = 0.0
        self._clock = time.thread_time
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = self._clock()
        else:
            g = info["generation"]
            self.seconds[g] += self._clock() - self._t0
            self.collections[g] += 1


def _worker() -> None:
    import gc
    import resource

    import torch
    from mpi4py import MPI
    from smp_comm import Communicator
    from smp_pipeline import PipelineRuntime
    from torch import nn

    torch.set_num_threads(1)
    profiles = _profile_all_threads() if PROFILE_DIR else []
    world = MPI.COMM_WORLD
    rank = world.Get_rank()

    class Stage(nn.Module):
        def __init__(self, nxt: nn.Module | None = None) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.next = nxt

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return self.next(y) if self.next is not None else y

    comm = Communicator(world)
    assignment = {".".join(["next"] * i): i for i in range(1, P)}

    def make(tag: int, knob: str) -> tuple[Any, Any]:
        model: nn.Module | None = None
        for _ in range(P):
            model = Stage(model)
        assert model is not None
        rt = PipelineRuntime(
            model, comm, rank, P, assignment=assignment, tag=tag, timeout_s=120,
            static_mode=STATIC,
        )  # fmt: skip
        if knob:
            _KNOBS[knob](rt)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).pow(2).mean()
            rt.backward(loss)
            return loss

        return rt, step

    # The build as it is, and (PROFILE_REQ_AB) the same with one knob turned back: their
    # steps alternate, so both see the same machine load.
    variants = {"current": make(7600, "")}
    if AB:
        variants[f"{AB} off"] = make(7610, AB)
    x = torch.randn(M * 2, D)
    for rt, step in variants.values():
        for _ in range(3):  # warm-up: worker threads, compiled fast path
            rt.run_step(step, (x,), num_microbatches=M)
    if GC == "freeze":  # everything built so far out of the collector's reach
        gc.freeze()
    elif GC == "off":
        gc.disable()
    gc_clock = _GcClock()
    main_profile = None
    if PROFILE_DIR:
        for p in profiles:  # the threads' warm-up calls (imports, first steps) out
            p.clear()
        main_profile = _cpu_profile()
        main_profile.enable()
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    rt = variants["current"][0]
    served_here = rt.requests_served
    threads0 = _per_thread(_cpu_seconds)
    switches0 = _per_thread(_switches)
    for _ in range(STEPS):
        for name, (rt_v, step) in variants.items():
            world.Barrier()  # (busy-waits inside MPI: outside the measured span)
            served0 = rt_v.requests_served
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            rt_v.run_step(step, (x,), num_microbatches=M)
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime
            served = rt_v.requests_served - served0
            total_cpu = world.allreduce(cpu, op=MPI.SUM)
            total_served = world.allreduce(served, op=MPI.SUM)
            per_step[name].append(total_cpu / max(total_served, 1) * 1e6)
    if main_profile is not None:
        main_profile.disable()
    threads1 = _per_thread(_cpu_seconds)
    switches1 = _per_thread(_switches)
    requests_all = sum(
        world.allreduce(r.requests_served - (served_here if r is rt else 0), op=MPI.SUM)
        for r, _ in variants.values()
    )
    by_thread = {
        n: (c - threads0.get(n, 0.0)) / requests_all * 1e6 for n, c in threads1.items()
    }
    switches = {
        n: (c - switches0.get(n, 0)) / requests_all for n, c in switches1.items()
    }
    gc_per_request = (
        [s / requests_all * 1e6 for s in gc_clock.seconds],
        [c / requests_all for c in gc_clock.collections],
    )
    inlined = {name: rt_v.server.executor.inlined for name, (rt_v, _) in variants.items()}
    for rt_v, _ in variants.values():
        rt_v.close()
    if PROFILE_DIR:
        import pstats

        os.makedirs(PROFILE_DIR, exist_ok=True)
        stats = pstats.Stats(main_profile)  # type: ignore[arg-type]
        for p in profiles:
            try:
                stats.add(p)
            except TypeError:  # a thread that never ran a profiled call
                pass
        stats.dump_stats(os.path.join(PROFILE_DIR, f"rank{rank}.pstats"))
        requests = requests_all
        with open(os.path.join(PROFILE_DIR, f"rank{rank}.txt"), "w") as f:
            f.write(f"per request ({requests} served by all ranks): own us, cumulative us, calls\n")
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
            for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows[:60]:
                where = f"{os.path.basename(file)}:{line}({fn})"
                f.write(f"{tt / requests * 1e6:9.1f} {ct / requests * 1e6:9.1f} {nc / requests:6.2f}  {where}\n")
    comm.close()
    shares = world.gather(by_thread, root=0)
    all_inlined = world.gather(inlined, root=0)
    all_switches = world.gather(switches, root=0)
    all_gc = world.gather(gc_per_request, root=0)
    if rank == 0:
        if STATIC:
            print(f"tasks served on the main loop (static mode), by rank: {all_inlined}")
        assert shares is not None
        for r, share in enumerate(shares):
            busy = sorted(share.items(), key=lambda kv: -kv[1])
            print(f"rank {r} CPU per request by thread (us, 10 ms ticks): "
                  + ", ".join(f"{n} {v:.0f}" for n, v in busy if v > 0))
        assert all_gc is not None
        for r, (us, n) in enumerate(all_gc):
            print(f"rank {r} garbage collector per request (gen 0/1/2): "
                  + " / ".join(f"{u:.1f} us in {c:.3f}" for u, c in zip(us, n)))
        assert all_switches is not None
        for r, sw in enumerate(all_switches):
            busy_sw = sorted(sw.items(), key=lambda kv: -kv[1])
            print(f"rank {r} context switches per request by thread: "
                  + ", ".join(f"{n} {v:.1f}" for n, v in busy_sw if v > 0.05))
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        for name, values in per_step.items():
            print(
                f"p={P} m={M} {name}: CPU per request (all ranks, all threads) median "
                f"{statistics.median(values):.0f} us, min {min(values):.0f}, max "
                f"{max(values):.0f} over {STEPS} steps; requests per step "
                f"{total_served}; load {load}"
            )


def main() -> None:
    workers.main_as_job(__file__, P, _worker, timeout=600)


if __name__ == "__main__":
    main()
