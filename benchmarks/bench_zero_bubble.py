"""Zero-bubble baselines: torch's own schedules against smp_pipeline on real compute, p = 2.

Run: python benchmarks/bench_zero_bubble.py   (spawns `mpiexec -n 2` of itself)

What issue 43's zero-bubble targets are measured against, side by side in one run: torch's
``Schedule1F1B`` (one stage per rank), ``ScheduleInterleavedZeroBubble`` (two stages per
rank, looped: rank r holds stages r and r + 2) and ``ScheduleZBVZeroBubble`` (two stages per
rank in a V: rank 0 holds stages 0 and 3), all on gloo, and smp_pipeline's runtime on the
one-stage-per-rank split (dynamic, ``static_mode``, and ``schedule="zero_bubble"``: weight
gradients deferred into each rank's idle time; its W task counts are printed too). m = 8 microbatches of real compute:
each stage is a stack of ``Linear(D, D)`` + GELU layers, a microbatch of B rows, one thread
per rank, so a stage's forward takes about 5-15 ms here. Two models:

  balanced:    both ranks hold the same number of layers;
  imbalanced:  rank 1 holds 1.5x rank 0's layers (its stages are 1.5x slower).

Printed per schedule: the median step time of STEPS, its ratio to the best of torch's three,
and each rank's bubble fraction 1 - busy / step, where busy is m times the rank's forward +
backward time of one microbatch measured alone (all its layers; both ranks at once, as in a
pipeline), the median of a measurement before the schedules and one after each round of
them (the core's speed drifts on a shared virtual machine: measured once, before, the
ceiling gave negative bubbles).
The **ceiling** line is the busiest rank's busy time: no schedule's step can be shorter.
Schedules alternate step by step so that all see the same machine load.

**Peak activation memory** per rank and schedule, from one more step of each after the timed
ones (counting costs a Python call per saved tensor, so it stays out of the timings):
``smp_pipeline.activation_meter.ActivationMeter`` on the rank's layers (the leaves of its
stages), the same rule for every schedule — the bytes of the storages those layers saved for
backward that are alive at once, each storage once, parameters and the input batch not
counted, and for smp ``zero_bubble`` the storages its queued W tasks hold (a layer's input
and grad_output, kept after the I pass freed the rest). The loss (outside the layers) is not
counted. Printed beside it: zero_bubble / ``Schedule1F1B`` per rank, and the issue's bound,
1F1B's peak plus the most bytes zero_bubble's W queue held (``peak_queued_bytes``, all steps).
A rank that rested in the counted step (split nothing: ``zerobubble.REST_BELOW_IDLE_SHARE``)
is marked. smp keeps ``active_microbatches`` (default p + 2 = 4) microbatches in flight where
1F1B keeps p on the first rank, and zero_bubble's W queue is bounded by that many
microbatches: ``BENCH_ZB_ACTIVE=2`` runs smp with 1F1B's count, to see the schedule's own
memory apart from that setting.
"""

from __future__ import annotations

import os
import statistics
import time

import workers  # (this folder)

P = 2
M = 8
D = int(os.environ.get("BENCH_ZB_D", "512"))
B = int(os.environ.get("BENCH_ZB_B", "64"))
LAYERS = int(os.environ.get("BENCH_ZB_LAYERS", "8"))  # rank 0's layers (balanced: each rank's)
STEPS = int(os.environ.get("BENCH_ZB_STEPS", "5"))
# smp's active_microbatches (None: its default, pp + 2 = 4 in flight; 1F1B keeps p = 2)
ACTIVE = int(os.environ["BENCH_ZB_ACTIVE"]) if os.environ.get("BENCH_ZB_ACTIVE") else None


def _worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from smp_comm import Communicator
    from smp_pipeline import PipelineRuntime
    from smp_pipeline.activation_meter import ActivationMeter
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank = world.rank
    comm = Communicator(world)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("BENCH_ZB_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=P)

    def layers(n: int) -> nn.Sequential:
        torch.manual_seed(n)
        return nn.Sequential(*(m for _ in range(n) for m in (nn.Linear(D, D), nn.GELU())))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    def rank_layers(r: int, imbalanced: bool) -> int:
        return LAYERS * 3 // 2 if imbalanced and r == 1 else LAYERS

    def busy_alone(n: int) -> float:
        """Forward + backward of one microbatch through n layers, alone (median of 5)."""
        mod, x = layers(n), torch.randn(B, D, requires_grad=True)
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            mod(x).pow(2).mean().backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    x_all, y_all = torch.randn(M * B, D), torch.zeros(M * B, D)

    def torch_schedules(imbalanced: bool) -> dict:
        mine = rank_layers(rank, imbalanced)
        one = PipelineStage(layers(mine), rank, P, torch.device("cpu"))
        out = {"torch Schedule1F1B": (Schedule1F1B(one, n_microbatches=M, loss_fn=loss_fn),
                                      rank == 0, rank == P - 1, [one.submod])}
        # Two stages per rank, each with half the rank's layers.
        for name, cls, stage_ids in (
            ("torch ScheduleInterleavedZeroBubble", ScheduleInterleavedZeroBubble,
             (rank, rank + P)),
            ("torch ScheduleZBVZeroBubble", ScheduleZBVZeroBubble, (rank, 2 * P - 1 - rank)),
        ):  # fmt: skip
            stages = [PipelineStage(layers(mine // 2), s, 2 * P, torch.device("cpu"))
                      for s in stage_ids]
            out[name] = (cls(stages, n_microbatches=M, loss_fn=loss_fn),
                         0 in stage_ids, 2 * P - 1 in stage_ids, [s.submod for s in stages])
        return out

    def run_torch(entry) -> None:
        schedule, first, last, _ = entry
        kwargs = {"target": y_all, "losses": []} if last else {}
        if first:
            schedule.step(x_all, **kwargs)
        else:
            schedule.step(**kwargs)

    def smp_runtimes(imbalanced: bool, tag: int) -> dict:
        out = {}
        for name, static, schedule in (("smp dynamic", False, "interleaved"),
                                       ("smp static_mode", True, "interleaved"),
                                       ("smp zero_bubble", False, "zero_bubble")):
            model = nn.Sequential(layers(rank_layers(0, imbalanced)),
                                  layers(rank_layers(1, imbalanced)))
            rt = PipelineRuntime(model, comm, rank, P, assignment={"1": 1}, tag=tag,
                                 timeout_s=300, static_mode=static, schedule=schedule,
                                 active_microbatches=ACTIVE)
            tag += 10

            def step(x, model=model, rt=rt):
                loss = loss_fn(model(x), torch.zeros_like(x))
                rt.backward(loss)
                return loss

            out[name] = (rt, step)
        return out

    def peak_bytes(modules, fn, extra=None) -> int:
        """One step of ``fn`` with the rank's layers' saved tensors counted: the peak."""
        leaves = [m for mod in modules for m in mod.modules() if not list(m.children())]
        params = [p for mod in modules for p in mod.parameters()]
        meter = ActivationMeter(leaves, [*params, x_all], extra)
        world.Barrier()
        with meter.measure():
            fn()
        world.Barrier()
        return meter.peak_bytes

    def timed(fn) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    for k, imbalanced in enumerate((False, True)):
        mine = rank_layers(rank, imbalanced)
        busy_rounds = [world.allgather(M * busy_alone(mine))]
        theirs = torch_schedules(imbalanced)
        ours = smp_runtimes(imbalanced, 7800 + 100 * k)
        runs = {**{n: (lambda e=e: run_torch(e)) for n, e in theirs.items()},
                **{n: (lambda rt=rt, step=step: rt.run_step(step, (x_all,), num_microbatches=M))
                   for n, (rt, step) in ours.items()}}  # fmt: skip
        for fn in runs.values():  # warm-up: shape inference, thread pools, recordings
            fn()
            fn()
        times: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(STEPS):
            for n, fn in runs.items():
                times[n].append(timed(fn))
            # the compute alone once per round too: the core's speed drifts on a shared host
            # (a fixed kernel 99-126 ms within minutes, 2 Dec), and a ceiling measured once,
            # before the schedules, gave bubbles of -0.18 to -0.35
            world.Barrier()
            busy_rounds.append(world.allgather(M * busy_alone(mine)))
        busy = [statistics.median(r[i] for r in busy_rounds) for i in range(P)]
        zb_rt = ours["smp zero_bubble"][0]
        zb = zb_rt.weight_grad_stats
        assert zb is not None and zb_rt.weight_grads is not None
        peaks: dict[str, int] = {}
        rested_before = zb.rested_steps
        for n, fn in runs.items():
            if n.startswith("torch"):
                peaks[n] = peak_bytes(theirs[n][3], fn)
            else:
                wq = ours[n][0].weight_grads
                peaks[n] = peak_bytes([ours[n][0].module[rank]], fn,
                                      None if wq is None else wq.queue.held_storages)
        w = world.gather((zb.idle, zb.eager, zb.drained, zb.mean_s, zb.peak_queued_bytes,
                          zb.rested_steps > rested_before, peaks), root=0)
        for rt, _ in ours.values():
            rt.close()
        if rank == 0:
            med = {n: statistics.median(v) for n, v in times.items()}
            best = min(v for n, v in med.items() if n.startswith("torch"))
            what = "imbalanced (rank 1 1.5x)" if imbalanced else "balanced"
            print(f"\n{what}: p={P}, m={M}, D={D}, B={B}, layers per rank {LAYERS}"
                  f"/{rank_layers(1, imbalanced)}, smp active_microbatches "
                  f"{ACTIVE or P + 2}; load {os.getloadavg()[0]:.1f}")
            print(f"  ceiling (busiest rank's compute, m x its F+B alone): {max(busy) * 1e3:.1f} ms")
            for n, v in med.items():
                bubbles = " ".join(f"{1 - b / v:5.2f}" for b in busy)
                print(f"  {n:<38} {v * 1e3:8.1f} ms  / best torch {v / best:5.3f}x  "
                      f"/ ceiling {v / max(busy):5.3f}x  bubble per rank {bubbles}", flush=True)
            print("  smp zero_bubble W tasks per rank (idle, eager, drained; mean ms), all steps: "
                  + "; ".join(f"{i}, {e}, {d}; {t * 1e3:.2f}" for i, e, d, t, *_ in w), flush=True)
            _print_memory(w, os.getloadavg()[0])
    dist.destroy_process_group()


def _print_memory(w: list, load: float) -> None:
    """The peak activation memory table of one model (rank 0; module doc)."""
    mib = 1 / 2**20
    peaks = [r[6] for r in w]  # per rank: schedule -> peak bytes
    print(f"  peak activation memory per rank (MiB; saved by the layers + queued W inputs, "
          f"one counted step; load {load:.1f}):")
    for n in peaks[0]:
        print(f"    {n:<36} " + " / ".join(f"{p[n] * mib:7.2f}" for p in peaks))
    one = "torch Schedule1F1B"
    zb, dyn = "smp zero_bubble", "smp dynamic"
    ratio = " / ".join(f"{p[zb] / p[one]:.2f}x" for p in peaks)
    vs_dyn = " / ".join(f"{p[zb] / p[dyn]:.2f}x" for p in peaks)
    bound = [p[one] + r[4] for p, r in zip(peaks, w)]
    within = " / ".join("within" if p[zb] <= b else "OVER" for p, b in zip(peaks, bound))
    rested = ", ".join(f"rank {i} rested (split nothing)" for i, r in enumerate(w) if r[5])
    print(f"    zero_bubble / Schedule1F1B per rank {ratio} (/ smp dynamic {vs_dyn}); bound "
          f"1F1B + most queued W bytes (" + " / ".join(f"{r[4] * mib:.2f}" for r in w)
          + ") = " + " / ".join(f"{b * mib:.2f}" for b in bound) + f" MiB: {within}"
          + (f"; in the counted step {rested}" if rested else ""), flush=True)


def main() -> None:
    workers.main_as_job(__file__, P, _worker, timeout=900)


if __name__ == "__main__":
    main()
