"""Data-parallel reduction overlapped with pipelined backward vs reduced after the step.

Run: python benchmarks/bench_dp_overlap.py   (spawns `mpiexec -n 4` of itself; ~1-2 minutes)

smp-torch on 4 processes, ``pipeline_parallel_degree=2`` x data-parallel 2, 8 microbatches.
The model is 8 blocks of ``Linear(512, 512)`` + ReLU and a linear head: each stage's gradients
(about 4 MB) are all-reduced over its data-parallel pair every step. Each block also sleeps
in forward (t) and backward (2t, in a custom autograd Function) inside
``smp_pipeline.device_work()``, like a GPU kernel that leaves the CPU free, so 2 CPU cores can
stand for 4 devices and the measurement is about scheduling, not CPU contention.

Two models are compared in the same run, their rounds alternating so that both see the same
machine load:

- ``overlap``: the default (``DistributedModel(..., overlap_grad_reduction=True)``): each
  stage starts all-reducing a gradient bucket as soon as its last backward touching it is
  done, while the other stage still runs backward;
- ``at end``: ``overlap_grad_reduction=False``: every bucket is reduced after the step.

Each pair runs with ``deterministic_accumulation`` off and on (the default): in-order
accumulation makes a stage's gradients final only when the driver's last microbatch ends,
which left the overlap nothing to hide until a stage folded its last microbatch as soon as
its own backward of it ended (issue 20). Prints the median step time of each and the ratio
(at end / overlap: above 1 means the overlap is faster), then, per stage, the median time
the step spends in the reducer's ``finish`` (waiting for the buckets still in flight, and
launching the rest): the reduction the overlap did not hide. Step times on a loaded machine
vary by several percent between runs; this one measures the overlap itself.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

T = float(os.environ.get("BENCH_DP_OVERLAP_T", "0.004"))  # forward sleep per block, seconds
WIDTH, BLOCKS, MB, BATCH = 512, 8, 8, 32  # BATCH: per data-parallel rank
WARMUP, STEPS, ROUNDS = 2, 6, 3
# One bucket per block (a block's weight is 1 MB): the bucket of a stage's last block can
# leave while the stage still runs backward through its earlier blocks.
BUCKET = int(os.environ.get("BENCH_DP_OVERLAP_BUCKET", str(1 << 20)))


def _worker() -> None:
    import smp_torch as smp
    import torch
    import torch.nn.functional as F  # noqa: N812
    from smp_pipeline import device_work
    from torch import nn

    torch.set_num_threads(1)

    class _Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def,override]
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def,override]
            with device_work():
                time.sleep(2 * T)
            return g

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with device_work():
                time.sleep(T)
            return _Sleep.apply(torch.relu(self.fc(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

    # (deterministic_accumulation, overlap_grad_reduction) -> step times
    variants = [(False, True), (False, False), (True, True), (True, False)]
    times: dict[tuple[bool, bool], list[float]] = {v: [] for v in variants}
    exposed: dict[tuple[bool, bool], list[float]] = {v: [] for v in variants}
    for _ in range(ROUNDS):
        for det, overlap in variants:
            smp.init({
                "pipeline_parallel_degree": 2, "microbatches": MB, "auto_partition": False,
                "deterministic_accumulation": det,
            })
            torch.manual_seed(0)
            net = Net()
            for i in range(BLOCKS // 2, BLOCKS):
                smp.set_partition(net.blocks[i], 1)
            smp.set_partition(net.head, 1)
            model = smp.DistributedModel(
                net, overlap_grad_reduction=overlap, bucket_bytes=BUCKET
            )
            opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

            @smp.step
            def train_step(x: torch.Tensor, y: torch.Tensor, model=model) -> torch.Tensor:  # type: ignore[no-untyped-def]
                loss = F.mse_loss(model(x), y)
                model.backward(loss)
                return loss

            g = torch.Generator().manual_seed(smp.dp_rank())
            x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)
            finish_s: list[float] = []
            for step in range(WARMUP + STEPS):
                reducer = model.grad_reducer
                if step == WARMUP and reducer is not None:

                    def timed_finish(orig=reducer.finish, out=finish_s) -> None:  # type: ignore[no-untyped-def]
                        t = time.perf_counter()
                        orig()
                        out.append(time.perf_counter() - t)

                    reducer.finish = timed_finish  # type: ignore[method-assign]
                smp.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                train_step(x, y)
                opt.step()
                smp.barrier()
                if step >= WARMUP:
                    times[(det, overlap)].append(time.perf_counter() - t0)
            exposed[(det, overlap)] += finish_s
    if smp.rank() == 0:
        for det in (False, True):
            on = statistics.median(times[(det, True)])
            off = statistics.median(times[(det, False)])
            print(
                f"dp overlap (pp=2 x dp=2, {BLOCKS} x Linear({WIDTH},{WIDTH}), {MB} microbatches, "
                f"t={T * 1e3:.0f} ms, buckets {BUCKET >> 10} KiB, deterministic_accumulation={det}): "
                f"step overlap {on * 1e3:.1f} ms, at end {off * 1e3:.1f} ms, "
                f"ratio at-end/overlap {off / on:.3f}",
                flush=True,
            )
    smp.barrier()
    for stage in range(2):
        if smp.pp_rank() == stage and smp.dp_rank() == 0:
            for det in (False, True):
                on = statistics.median(exposed[(det, True)])
                off = statistics.median(exposed[(det, False)])
                print(
                    f"  stage {stage}, deterministic_accumulation={det}: time in the reducer's "
                    f"finish, overlap {on * 1e3:.1f} ms, at end {off * 1e3:.1f} ms",
                    flush=True,
                )
        time.sleep(0.5)  # (stage 0's lines first)
        smp.barrier()


def main() -> None:
    from smp_comm.testing import mpiexec_path

    mpiexec = mpiexec_path()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMP_CONFIG": ""}
    cmd = [mpiexec, "-n", "4", sys.executable, os.path.abspath(__file__), "--worker"]
    subprocess.run(cmd, env=env, check=True, timeout=600)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        main()
