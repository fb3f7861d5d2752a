"""Activation offloading: saved-activation bytes resident on each stage, with and without.

Run: mpiexec -n 2 python benchmarks/bench_offload.py   (or -n 4; CPU is enough)

A chain of 8 checkpointed residual blocks (hidden 512, 32 rows per microbatch) split evenly
over the pipeline ranks, 8 microbatches, both schedules. For each schedule, one step counts
what the checkpoints keep for backward without moving anything (the offloader's counting
mode: the baseline, every saved input held until its backward), then steps with offloading
at horizons 1, 2 and 4. Prints, per pipeline rank, the peak bytes of saved tensors on the
device (``peak_device_bytes``: the baseline's held tensors, or the offloader's loaded copies
not yet consumed), the peak of the host pool, and the prefetch hits and misses.

On CPU the "device" is host memory too: the numbers are the saved-activation bytes each
mechanism keeps resident (from the counters, exact), not a process's RSS. On CUDA the same
counters describe GPU memory held for backward.

``BENCH_OFFLOAD_DEVICE=cuda`` runs the model on ``cuda:0`` (every rank on the same GPU: two
processes may share one) with 4,096 rows per microbatch (one saved input 8 MiB;
``BENCH_OFFLOAD_ROWS`` sets it), and adds each rank's measured peak of GPU memory allocated
during the step (``torch.cuda.max_memory_allocated``: parameters, activations, gradients,
the offloader's loaded copies) and the step's time, so offloading's saving and its cost are
read side by side.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI
from smp_comm import Communicator
from smp_pipeline import PipelineRuntime
from torch import nn

DEVICE = os.environ.get("BENCH_OFFLOAD_DEVICE", "cpu")
CUDA = DEVICE.startswith("cuda")
HIDDEN, BLOCKS, M = 512, 8, 8
ROWS = int(os.environ.get("BENCH_OFFLOAD_ROWS", "4096" if CUDA else "32"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


def measure(comm: Communicator, schedule: str, horizon: int, move: bool, tag: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(HIDDEN, 1)).to(DEVICE)
    per = BLOCKS // comm.size
    assignment = {str(i): i // per for i in range(BLOCKS)} | {str(BLOCKS): comm.size - 1}
    rt = PipelineRuntime(
        model, comm, comm.rank, comm.size, assignment=assignment, schedule=schedule,
        checkpointing={str(i): None for i in range(BLOCKS)}, tag=tag,
        offload_activations=True, activation_loading_horizon=horizon,
    )  # fmt: skip
    assert rt.offloader is not None
    rt.offloader.move = move  # False: count only (the baseline)
    x, y = torch.randn(M * ROWS, HIDDEN, device=DEVICE), torch.randn(M * ROWS, 1, device=DEVICE)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        rt.backward(loss)
        return loss

    rt.run_step(step, (x, y), num_microbatches=M)  # warm-up
    rt.offloader.reset_stats()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rt.run_step(step, (x, y), num_microbatches=M)
    stats: dict = rt.offloader.stats.as_dict()
    if CUDA:
        torch.cuda.synchronize()
        stats["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        times = []
        for _ in range(3):
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            rt.run_step(step, (x, y), num_microbatches=M)
            torch.cuda.synchronize()
            times.append(MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        stats["step_s"] = statistics.median(times)
    rt.close()
    return stats


def main() -> None:
    comm = Communicator(MPI.COMM_WORLD)
    tag = 9100
    if comm.rank == 0:
        mib = ROWS * HIDDEN * 4 / 2**20
        print(f"pp={comm.size}, {BLOCKS} checkpointed blocks, {M} microbatches, "
              f"one saved input = {mib:.3f} MiB, device {DEVICE}")  # fmt: skip
    if CUDA:
        if not torch.cuda.is_available():
            raise SystemExit(f"bench_offload: BENCH_OFFLOAD_DEVICE={DEVICE} but torch sees no GPU")
        torch.cuda.set_device(0)  # every rank on one GPU
    for schedule in ("interleaved", "simple"):
        for horizon, move in ((1, False), (1, True), (2, True), (4, True)):
            stats = measure(comm, schedule, horizon, move, tag)
            tag += 10
            rows = MPI.COMM_WORLD.gather(stats, root=0)
            if comm.rank != 0:
                continue
            what = "no offloading (counted)" if not move else f"offloading, horizon {horizon}"
            cells = "; ".join(
                f"rank {r}: device peak {s['peak_device_bytes'] / 2**20:.2f} MiB, "
                f"host peak {s['peak_host_bytes'] / 2**20:.2f} MiB, "
                f"hits/misses {s['prefetch_hits']}/{s['prefetch_misses']}, "
                f"ahead {s['max_ahead']}"
                + (f", GPU peak allocated {s['gpu_peak_bytes'] / 2**20:.1f} MiB" if CUDA else "")
                for r, s in enumerate(rows or [])
            )
            step = f" | step {rows[0]['step_s'] * 1e3:.1f} ms" if CUDA and rows else ""
            print(f"{schedule:>11} | {what:<24} | {cells}{step}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
