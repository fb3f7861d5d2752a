"""A rank waiting for a slower peer inside smp's setup must not spin (2 ranks, pp = 2).

Rank 1 sleeps ``SLOW_S`` before ``smp.DistributedModel(...)`` (a peer still building a large
model, or importing); rank 0 enters at once and waits for it there. MPICH's blocking
collectives poll without sleeping, and with more ranks than cores that waiting took the CPU
from the rank it waited for (issue 48's CI failure: a 2 s model build took 23-44 s beside
three waiting ranks on 2 cores). Rank 0 prints the CPU seconds its process used during the
wait (every thread: ``time.process_time``), and the same for the first step, where rank 1
(pp rank 1) waits for rank 0's partition while rank 0 sleeps in its forward's first call.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import smp_torch as smp  # noqa: E402

SLOW_S = 3.0


class Slow(nn.Module):
    """A layer whose first call on rank 0 (the partition's trace) sleeps ``SLOW_S``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1 and smp.rank() == 0:
            time.sleep(SLOW_S)
        return self.lin(x)


def main() -> None:
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = nn.Sequential(Slow(), nn.ReLU(), nn.Linear(8, 8))
    if smp.rank() == 1:
        time.sleep(SLOW_S)
    t0, c0 = time.monotonic(), time.process_time()
    dmodel = smp.DistributedModel(model)
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    print(f"RANK {smp.rank()} MODEL wall {wall:.2f} cpu {cpu:.2f}", flush=True)

    @smp.step
    def step(x: torch.Tensor) -> torch.Tensor:
        out = dmodel(x).sum()
        dmodel.backward(out)
        return out

    t0, c0 = time.monotonic(), time.process_time()
    step(torch.ones(4, 8))
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    print(f"RANK {smp.rank()} STEP wall {wall:.2f} cpu {cpu:.2f}", flush=True)


if __name__ == "__main__":
    main()
