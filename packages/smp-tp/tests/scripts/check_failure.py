"""Usage: check_failure.py MODE. One rank fails during tensor-parallel training; the
others are blocked in a collective it never joins. Under ``torchrun`` the job must end
within seconds (torch's elastic agent tears the group down when a worker exits non-zero or
is killed), not after gloo's 30-minute timeout.

MODE: ``raise`` (rank 1 raises before its step 2's forward) or ``kill`` (rank 1 SIGKILLs
itself there). Every rank prints ``FAULT-AT <unix time>`` just before the fault (rank 1) or
``WAITING`` as it enters the step the fault leaves it blocked in (the others).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import smp_tp
import torch
import torch.distributed as dist
from common import setup
from torch import nn


def main() -> None:
    mode = sys.argv[1]
    rank, _, _ = setup()
    torch.manual_seed(0)
    with smp_tp.tensor_parallelism():
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    smp_tp.parallelize(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for step in range(3):
        if step == 2 and rank == 1:
            print(f"[rank {rank}] FAULT-AT {time.time():.3f}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"boom on rank {rank} in step {step}")
        if step == 2:
            print(f"[rank {rank}] WAITING in step {step}", flush=True)
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        smp_tp.sync_gradients(model)
        opt.step()
        opt.zero_grad()
    print(f"[rank {rank}] NO FAULT SEEN", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
