"""Run under mpiexec by test_program.py: every rank's recorded program, gathered and checked.

Usage: python program_cases.py   (pp = the number of processes: 2 or 4)

Per case, each rank runs a few training steps and, after each, every rank's program
(:meth:`PipelineRuntime.program`) travels to every rank in its printed form and is parsed
back. Checked: :func:`validate_programs` finds nothing wrong; each rank recorded something;
two consecutive steps whose control flow is the same record identical programs; a step whose
data takes the other branch of :class:`models.Branch` records a different one. Schedules
that run one microbatch at a time make the order of a rank's actions independent of timing;
an overlapping (interleaved) schedule is only validated (its order may depend on timing).
Prints "CASE-OK <name>" per case; any failure raises with every rank's programs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from smp_comm import Communicator  # noqa: E402
from smp_pipeline import (  # noqa: E402
    Action,
    PipelineRuntime,
    format_program,
    parse_program,
    validate_programs,
)

torch.set_num_threads(1)
TAG = [12000]


def custom(m: int) -> list[tuple[int, str]]:
    """Forward, backward, forward, ... (old string phases: the public entry point accepts
    them). Not serial: microbatch 1's forward starts once 0's backward has started."""
    return [(mb, phase) for mb in range(m) for phase in ("forward", "backward")]


SERIAL = {"schedule": "interleaved", "active": 1}  # one microbatch at a time


def gather_programs(rt: PipelineRuntime) -> list[tuple[Action, ...]]:
    """Every rank's program of the last step, sent as text and parsed back."""
    texts = MPI.COMM_WORLD.allgather(format_program(rt.program()))
    return [parse_program(t) for t in texts]


def shown(programs: list[tuple[Action, ...]]) -> str:
    return "\n".join(f"--- pp rank {r}\n{format_program(p)}" for r, p in enumerate(programs))


def checked(name: str, step: int, programs: list[tuple[Action, ...]]) -> None:
    problems = validate_programs(programs)
    if problems:
        raise AssertionError(f"{name} step {step}: {problems}\n{shown(programs)}")
    for r, p in enumerate(programs):
        if not p:
            raise AssertionError(f"{name} step {step}: pp rank {r} recorded nothing\n{shown(programs)}")


def run(comm, name, build, assignment, batches, m, schedule, active=None, *, same, differ,
        **kw) -> None:
    """Train on ``batches`` (one step each); ``same``/``differ``: pairs of step indices whose
    programs must be equal / must differ."""
    torch.manual_seed(1234)
    model = build()
    TAG[0] += 10
    rt = PipelineRuntime(model, comm, comm.rank, comm.size, assignment=assignment,
                         schedule=schedule, active_microbatches=active, timeout_s=60,
                         tag=TAG[0], **kw)  # fmt: skip
    opt = torch.optim.SGD(rt.local_parameters(), lr=0.05)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        rt.backward(loss)
        return loss.detach()

    programs = []
    for s, batch in enumerate(batches):
        rt.run_step(step, batch, num_microbatches=m)
        opt.step()
        opt.zero_grad()
        programs.append(gather_programs(rt))
        checked(name, s, programs[-1])
    for a, b in same:
        if programs[a] != programs[b]:
            raise AssertionError(
                f"{name}: steps {a} and {b} have the same control flow but recorded different "
                f"programs\n{shown(programs[a])}\n=== step {b}\n{shown(programs[b])}"
            )
    for a, b in differ:
        if programs[a] == programs[b]:
            raise AssertionError(f"{name}: steps {a} and {b} took other branches, same program\n"
                                 f"{shown(programs[a])}")  # fmt: skip
    if comm.rank == 0:
        sizes = [len(p) for p in programs[-1]]
        print(f"CASE-OK {name} actions per rank {sizes}", flush=True)
        print(f"  rank 0 program of the last step:\n{format_program(programs[-1][0])}", flush=True)
    rt.close()


def data(seed: int = 0, flip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """8 samples; the first sample of each pair of rows decides Branch's branch for its
    microbatch (m = 4): left, right, left, right (``flip``: the other way round)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 8, generator=g)
    for i in range(0, 8, 2):
        left = (i // 2) % 2 == 0
        x[i, 0] = 1.0 if left != flip else -1.0
    return x, torch.randn(8, 1, generator=g)


def main() -> None:
    comm = Communicator(MPI.COMM_WORLD)
    pp = comm.size
    if pp == 2:
        chain = {"blocks.1": 1, "blocks.3": 1, "head": 1}
        branch = {"left": 1, "right.1": 1, "out": 1}
    else:
        chain = {"blocks.0": 1, "blocks.1": 2, "blocks.2": 3, "blocks.3": 3, "head": 2}
        branch = {"pre": 1, "left": 2, "right.0": 3, "right.1": 2}
    # Step 0 of a ModuleList loop runs its blocks one request each; fast_mode chains them
    # from step 1 on: steps 1 and 2 are compared.
    run(comm, f"chain-pp{pp}", models.Chain, chain, [data(s) for s in range(3)], 4, **SERIAL,
        same=[(1, 2)], differ=[])
    run(comm, f"chain-pp{pp}-fast-off", models.Chain, chain, [data(s) for s in range(2)], 4,
        **SERIAL, same=[(0, 1)], differ=[], fast_mode=False)
    branch_batches = [data(0), data(1), data(2, flip=True), data(3, flip=True)]
    for mode in ("joined", "segments"):
        run(comm, f"branch-pp{pp}-{mode}", models.Branch, branch, branch_batches, 4, **SERIAL,
            same=[(0, 1), (2, 3)], differ=[(1, 2)], backward_mode=mode)
    # Overlapping microbatches: validated only.
    run(comm, f"chain-pp{pp}-custom", models.Chain, chain, [data(s) for s in range(2)], 4,
        custom(4), same=[], differ=[])
    run(comm, f"chain-pp{pp}-interleaved", models.Chain, chain, [data(s) for s in range(2)], 4,
        "interleaved", same=[], differ=[])
    run(comm, f"branch-pp{pp}-interleaved", models.Branch, branch, branch_batches[1:3], 4,
        "interleaved", same=[], differ=[])
    if comm.rank == 0:
        print(f"SUITE-OK program pp{pp}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
