"""What recording each rank's program costs (``PipelineRuntime(record_program=...)``).

Run: python benchmarks/bench_program.py     (spawns ``mpiexec -n 2`` itself; ~2 minutes)

Two measurements:

- the recorder's own cost per action, in this process (``timeit`` of the two calls the
  runtime makes: a task started, a message with one tensor): what recording adds to every
  task and every tensor-carrying message, free of scheduling noise;
- a step loop at pp=2: an ``nn.Sequential`` of 8 blocks (LayerNorm, Linear(w, 4w), GELU,
  Linear(4w, w)), width 128, 64 rows per microbatch, 8 microbatches, blocks 4-7 on pp rank 1;
  ``fast_mode`` on (one request per microbatch and direction) and off (one per block, the
  most actions per step). The four runtimes (fast on/off x recording on/off) live in one job
  and take turns, ``BENCH_PROGRAM_STEPS`` steps each per round, over ``BENCH_PROGRAM_ROUNDS``
  rounds: the median step of each, its range over rounds, and the actions recorded per step.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import timeit

import workers  # (this folder)

WIDTH, ROWS, BLOCKS, MB = 128, 64, 8, 8
ROUNDS = int(os.environ.get("BENCH_PROGRAM_ROUNDS", "5"))
STEPS = int(os.environ.get("BENCH_PROGRAM_STEPS", "10"))


def recorder_cost() -> tuple[float, float, float]:
    """Microseconds per recorded task start, per recorded message (one tensor), and per
    forward request through the transport's whole recording path (kind lookup, module
    label, shapes)."""
    import torch
    from smp_pipeline.actions import ActionKind, ProgramRecorder
    from smp_pipeline.messages import pack
    from smp_pipeline.protocol import FwdReq
    from smp_pipeline.transport import Transport

    rec = ProgramRecorder()
    tensors = [torch.zeros(ROWS, WIDTH)]
    n = 200_000

    def task() -> None:
        rec.task(1, ActionKind.FORWARD, 0, "blocks.3")

    def message() -> None:
        rec.message(1, ActionKind.SEND, 1, "fq", 0, "blocks.3", tensors)

    t_task = min(timeit.repeat(task, number=n, repeat=3)) / n
    rec = ProgramRecorder()
    t_msg = min(timeit.repeat(message, number=n, repeat=3)) / n
    # (the transport only keeps the communicator: nothing is sent here)
    transport = Transport(object(), 0, [0, 1], 1, 1.0, [], lambda: None, recorder=ProgramRecorder())
    req = FwdReq(
        0, (0, 1), "blocks.3", 1, 0, True, [], False, None, (), (), pack(((tensors[0],), {}), True)
    )

    def note() -> None:
        transport._note(ActionKind.SEND, 1, req)

    t_note = min(timeit.repeat(note, number=n, repeat=3)) / n
    return t_task * 1e6, t_msg * 1e6, t_note * 1e6


def worker() -> None:
    """One job of 2 ranks: the four runtimes take turns; rank 0 prints the figures."""
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from smp_comm import Communicator
    from smp_pipeline import PipelineRuntime
    from torch import nn

    torch.set_num_threads(1)
    comm = Communicator(MPI.COMM_WORLD)
    rank = comm.rank

    def block() -> nn.Module:
        return nn.Sequential(
            nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    kinds = {}
    for i, (fast, record) in enumerate([(f, r) for f in (True, False) for r in (True, False)]):
        torch.manual_seed(0)
        model = nn.Sequential(*[block() for _ in range(BLOCKS)])
        rt = PipelineRuntime(
            model, comm, rank, 2, assignment={str(b): 1 for b in range(BLOCKS // 2, BLOCKS)},
            fast_mode=fast, record_program=record, tag=7400 + 10 * i,
        )  # fmt: skip
        kinds[(fast, record)] = (model, rt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS * MB, WIDTH, generator=g)
    y = torch.randn(ROWS * MB, WIDTH, generator=g)

    def one_step(model: nn.Module, rt: PipelineRuntime) -> None:
        def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(a), b)
            rt.backward(loss)
            return loss.detach()

        rt.run_step(step, (x, y), num_microbatches=MB)

    for model, rt in kinds.values():  # warm-up
        for _ in range(2):
            one_step(model, rt)
    per_round: dict[tuple[bool, bool], list[float]] = {k: [] for k in kinds}
    for _ in range(ROUNDS):
        for key, (model, rt) in kinds.items():
            times = []
            for _ in range(STEPS):
                comm_barrier = MPI.COMM_WORLD.Barrier
                comm_barrier()
                t0 = time.perf_counter()
                one_step(model, rt)
                times.append(time.perf_counter() - t0)
            per_round[key].append(statistics.median(times))
    actions = {k: MPI.COMM_WORLD.allgather(len(rt.program())) for k, (_, rt) in kinds.items()}
    if rank == 0:
        for fast in (True, False):
            on, off = per_round[(fast, True)], per_round[(fast, False)]
            ratio = statistics.median(on) / statistics.median(off)
            print(
                f"fast_mode {'on ' if fast else 'off'}: step {statistics.median(on) * 1e3:.2f} ms "
                f"recording (rounds {min(on) * 1e3:.2f}-{max(on) * 1e3:.2f}), "
                f"{statistics.median(off) * 1e3:.2f} ms not ({min(off) * 1e3:.2f}-"
                f"{max(off) * 1e3:.2f}): {ratio:.3f}x; actions per step per rank "
                f"{actions[(fast, True)]} (off: {actions[(fast, False)]})",
                flush=True,
            )
    for _, rt in kinds.values():
        rt.close()
    comm.close()


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    task_us, msg_us, note_us = recorder_cost()
    print(
        f"recorder: {task_us:.2f} us per task start, {msg_us:.2f} us per message recorded, "
        f"{note_us:.2f} us per forward request through the transport's recording path"
    )
    print(f"load average before the step loop: {os.getloadavg()}")
    print(workers.run_self(__file__, 2, [], timeout=900), end="")


if __name__ == "__main__":
    main()
