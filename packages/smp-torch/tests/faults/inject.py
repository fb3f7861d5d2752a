"""Usage: inject.py FAULT CONFIG VICTIM [DIR]. A small training job on which rank VICTIM fails on
purpose at step ``FAULT_STEP``; what every rank prints lets ``test_faults.py`` check how the
job ends.

FAULT: ``before_step`` / ``after_step`` (a user exception between steps), ``forward`` /
``backward`` (inside the step, in a module's forward or an autograd hook on the victim),
``optimizer`` (inside the wrapped optimizer's step), ``thread`` (an uncaught exception in a
user thread), ``raw_collective`` (the victim raises between steps while the other ranks block
in a ``torch.distributed`` collective of their own, outside smp), ``kill`` (SIGKILL of the
victim's own process inside a forward), ``stall`` (a module's forward on the victim never
returns: blocked in user code; the job runs with ``timeout_s`` = :data:`STALL_TIMEOUT_S`),
``sigstop`` (the victim's process stops itself with SIGSTOP inside a forward: every thread
frozen, the process still alive; ``timeout_s`` as for ``stall``), ``bad_config`` (the victim
passes a misspelt key to ``smp.init``, the others a valid configuration).
The environment variable ``SMP_FAULT_TIMEOUT_S`` overrides ``timeout_s`` for every fault.

Checkpoint faults (DIR: where checkpoints go; every rank saves tag ``ckpt`` with
``user_content={"step": 1}`` after step 1, then at step ``FAULT_STEP``):
``save_kill`` / ``save_error`` (the victim's ``torch.save`` writes half its first file, then
the victim is SIGKILLed / raises), ``save_gather`` (the victim raises while gathering the
state to save, the collective phase), ``truncate`` / ``flip`` / ``no_manifest`` /
``pickle`` (the victim damages the checkpoint — cuts ``model_pp0.pt`` to half, flips 16
bytes in its middle, deletes ``manifest.json``, or replaces ``model_pp0.pt`` by a pickle
that would create ``DIR/PWNED`` and rewrites the manifest to match — then every rank
resumes from it). ``resume`` (VICTIM -1): resume from DIR's latest checkpoint, print
``RANK r RESUMED <user_content>`` and train one step.

Mismatch faults: ``microbatches`` (the victim passes ``microbatches=4`` to ``smp.init``, the
others 2), ``batch`` (at step ``FAULT_STEP`` the victim's step gets half the batch the
others get).

CONFIG: ``pp2`` (2 ranks), ``tp2`` (2), ``dp2`` (2), ``pp2dp2`` (4: drivers 0 and 2, servers
1 and 3), ``dp2smp`` (2: ``dp2`` with ``collective_backend="smp"``).

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
import hashlib
import io
import json
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
    # Data parallelism on smp-comm's torch.distributed backend (collective_backend="smp").
    "dp2smp": {"collective_backend": "smp"},
}


def _shm_mapped() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line})


class Injected(RuntimeError):
    """The fault's exception."""


class Pwn:
    """Unpickling this creates a marker file (what a malicious checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mknod, (self.marker,))


LOAD_FAULTS = ("truncate", "flip", "no_manifest", "pickle")
SAVE_FAULTS = ("save_kill", "save_error", "save_gather")


def damage(fault: str, root: str) -> None:
    """The load faults: damage ``root/ckpt`` (see the module docstring)."""
    ck = os.path.join(root, "ckpt")
    target = os.path.join(ck, "model_pp0.pt")
    data = open(target, "rb").read()
    if fault == "truncate":
        open(target, "wb").write(data[: len(data) // 2])
    elif fault == "flip":
        mid = len(data) // 2
        flipped = bytes(b ^ 0xFF for b in data[mid : mid + 16])
        open(target, "wb").write(data[:mid] + flipped + data[mid + 16 :])
    elif fault == "no_manifest":
        os.remove(os.path.join(ck, "manifest.json"))
    elif fault == "pickle":
        import pickle

        evil = pickle.dumps({"emb.weight": Pwn(os.path.join(root, "PWNED"))}, protocol=2)
        open(target, "wb").write(evil)
        # A thorough attacker fixes the manifest up too: only weights_only stands in the way.
        mpath = os.path.join(ck, "manifest.json")
        manifest = json.load(open(mpath))
        manifest["files"]["model_pp0.pt"] = {
            "sha256": hashlib.sha256(evil).hexdigest(), "bytes": len(evil)
        }
        body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
        manifest["manifest_sha256"] = hashlib.sha256(
            json.dumps(body, sort_keys=True).encode()
        ).hexdigest()
        json.dump(manifest, open(mpath, "w"))


def main() -> None:
    fault, config, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
    root = sys.argv[4] if len(sys.argv) > 4 else ""
    torch.set_num_threads(1)
    print(f"RANK {RANK} PID {os.getpid()}", flush=True)
    shm = [p.replace(" (deleted)", "") for p in _shm_mapped()]
    print(f"RANK {RANK} SHM {','.join(shm) or '-'}", flush=True)
    microbatches = 2
    if fault == "microbatches" and RANK == victim:
        print(f"FAULT {RANK} {fault} t={time.time():.3f}", flush=True)
        microbatches = 4
    timeout_s = STALL_TIMEOUT_S if fault in ("stall", "sigstop") else 120
    timeout_s = float(os.environ.get("SMP_FAULT_TIMEOUT_S", timeout_s))
    config_dict = {**CONFIGS[config], "microbatches": microbatches, "timeout_s": timeout_s}
    if fault == "bad_config" and RANK == victim:
        print(f"FAULT {RANK} {fault} t={time.time():.3f}", flush=True)
        config_dict["microbatchs"] = 2  # a typo, on this rank only
    cfg = smp.init(config_dict)
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
        if fault in ("kill", "save_kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise Injected(f"injected {fault} fault on rank {RANK}")

    def forward_hook(module: torch.nn.Module, args: object, output: object) -> None:
        step = state["step"]
        if now(step, "forward") or now(step, "kill"):
            fail()
        if now(step, "stall"):
            announce()
            threading.Event().wait()  # never set: this rank's worker is stuck here for good
        if now(step, "sigstop"):
            announce()
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread of the process freezes
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

    if fault == "resume":
        user = smp.resume_from_checkpoint(root)
        print(f"RANK {RANK} RESUMED {user}", flush=True)

    original_save = torch.save

    def breaking_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        torch.save = original_save  # (once: the first file)
        buf = io.BytesIO()
        original_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])  # type: ignore[attr-defined]
        f.flush()  # type: ignore[attr-defined]
        fail()

    def breaking_gather() -> None:
        fail()

    def save(step: int) -> None:
        if now(step, "save_kill") or now(step, "save_error"):
            torch.save = breaking_save
        if now(step, "save_gather"):
            model.stage_full_state = breaking_gather
        smp.save_checkpoint(root, "ckpt", partial=True, user_content={"step": step})

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        model.backward(loss)
        return loss

    def thread_fault() -> None:
        fail()

    for step in range(1 if fault == "resume" else FAULT_STEP + 3):
        state["step"] = step
        x, y = models.global_batch(step, 8)
        n, i = smp.dp_size(), smp.dp_rank()
        x, y = x.chunk(n)[i], y.chunk(n)[i]
        if now(step, "batch"):
            announce()
            x, y = x[: len(x) // 2], y[: len(y) // 2]
        if now(step, "before_step"):
            fail()
        if now(step, "thread"):
            threading.Thread(target=thread_fault, name="loader", daemon=True).start()
        optimizer.zero_grad()
        train_step(x, y)
        optimizer.step()
        if now(step, "after_step") or now(step, "raw_collective"):
            fail()
        if fault == "raw_collective" and step == FAULT_STEP:
            dist.all_reduce(torch.ones(1))  # the victim never joins: blocked outside smp
        if fault in SAVE_FAULTS + LOAD_FAULTS and step in (FAULT_STEP - 1, FAULT_STEP):
            if step == FAULT_STEP - 1 or fault in SAVE_FAULTS:
                save(step)
            else:
                if me:
                    announce()
                    damage(fault, root)
                smp.barrier()
                smp.resume_from_checkpoint(root)
        print(f"RANK {RANK} finished step {step}", flush=True)
    print(f"RANK {RANK} NO ERROR", flush=True)


if __name__ == "__main__":
    main()
