"""Usage: inject.py FAULT CONFIG VICTIM. A small training job on which rank VICTIM fails on
purpose at step ``FAULT_STEP``; what every rank prints lets ``test_faults.py`` check how the
job ends.

FAULT: ``before_step`` / ``after_step`` (a user exception between steps), ``forward`` /
``backward`` (inside the step, in a module's forward or an autograd hook on the victim),
``optimizer`` (inside the wrapped optimizer's step), ``thread`` (an uncaught exception in a
user thread), ``raw_collective`` (the victim raises between steps while the other ranks block
in a ``torch.distributed`` collective of their own, outside smp), ``kill`` (SIGKILL of the
victim's own process inside a forward), ``stall`` (a module's forward on the victim never
returns: blocked in user code; the job runs with ``timeout_s`` = :data:`STALL_TIMEOUT_S`).

CONFIG: ``pp2`` (2 ranks), ``tp2`` (2), ``dp2`` (2), ``pp2dp2`` (4: drivers 0 and 2, servers
1 and 3).

Printed (one line each): ``RANK r PID p`` and ``RANK r SHM <paths>`` (the ``/dev/shm``
files this process maps) at start, ``FAULT r <fault> t=<unix time> timeout_s=<s>`` on the
victim just before the fault, and ``RANK r EXIT status <s> t=<unix time>`` as the very last thing of an
interpreter exit (an exit handler registered before any other: it runs after smp's, before
mpi4py's ``MPI_Finalize``). A rank still running 90 s after it started prints every
thread's stack.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import threading
import time

RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
FAULT_STEP = 2
# The stall fault's timeout_s: short, yet far above a healthy step's waits (4 s was not, at
# a load average of 29 on 2 cores: a rank still finishing the previous step timed out).
STALL_TIMEOUT_S = 8.0
DUMP_AFTER_S = 90.0  # (the test gives a job 120 s)


def _exit_line() -> None:
    # 1 after an uncaught exception (the status Python exits with), else 0.
    status = 1 if getattr(sys, "last_value", None) is not None else 0
    print(f"RANK {RANK} EXIT status {status} t={time.time():.3f}", flush=True)


atexit.register(_exit_line)  # first registered: runs last (mpi4py finalizes MPI after it)
# A job still running long after its fault shows where every thread of every rank is.
faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=False)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402, F401 - initialises MPI: its shm file exists from here

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402

CONFIGS = {
    "pp2": {"pipeline_parallel_degree": 2},
    "tp2": {"tensor_parallel_degree": 2},
    "dp2": {},
    "pp2dp2": {"pipeline_parallel_degree": 2},
}


def _shm_mapped() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line})


class Injected(RuntimeError):
    """The fault's exception."""


def main() -> None:
    fault, config, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    print(f"RANK {RANK} PID {os.getpid()}", flush=True)
    shm = [p.replace(" (deleted)", "") for p in _shm_mapped()]
    print(f"RANK {RANK} SHM {','.join(shm) or '-'}", flush=True)
    timeout_s = STALL_TIMEOUT_S if fault == "stall" else 120
    cfg = smp.init({**CONFIGS[config], "microbatches": 2, "timeout_s": timeout_s})
    me = smp.rank() == victim
    torch.manual_seed(0)
    model = smp.DistributedModel(models.TinyLM(tp=cfg.tp > 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer = smp.DistributedOptimizer(inner)
    state = {"step": -1}

    def now(step: int, kind: str) -> bool:
        return me and fault == kind and step == FAULT_STEP

    def announce() -> None:
        print(f"FAULT {RANK} {fault} t={time.time():.3f} timeout_s={timeout_s:g}", flush=True)

    def fail() -> None:
        announce()
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise Injected(f"injected {fault} fault on rank {RANK}")

    def forward_hook(module: torch.nn.Module, args: object, output: object) -> None:
        step = state["step"]
        if now(step, "forward") or now(step, "kill"):
            fail()
        if now(step, "stall"):
            announce()
            threading.Event().wait()  # never set: this rank's worker is stuck here for good
        if now(step, "backward") and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: fail())

    for m in model.module.modules():
        m.register_forward_hook(forward_hook)

    original_step = inner.step

    def optimizer_step(*args: object, **kwargs: object) -> object:
        if now(state["step"], "optimizer"):
            fail()
        return original_step(*args, **kwargs)

    inner.step = optimizer_step  # type: ignore[method-assign]

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        model.backward(loss)
        return loss

    def thread_fault() -> None:
        fail()

    for step in range(FAULT_STEP + 3):
        state["step"] = step
        x, y = models.global_batch(step, 8)
        n, i = smp.dp_size(), smp.dp_rank()
        if now(step, "before_step"):
            fail()
        if now(step, "thread"):
            threading.Thread(target=thread_fault, name="loader", daemon=True).start()
        optimizer.zero_grad()
        train_step(x.chunk(n)[i], y.chunk(n)[i])
        optimizer.step()
        if now(step, "after_step") or now(step, "raw_collective"):
            fail()
        if fault == "raw_collective" and step == FAULT_STEP:
            dist.all_reduce(torch.ones(1))  # the victim never joins: blocked outside smp
        print(f"RANK {RANK} finished step {step}", flush=True)
    print(f"RANK {RANK} NO ERROR", flush=True)


if __name__ == "__main__":
    main()
