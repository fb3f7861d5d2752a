"""Run under mpiexec by test_zero_bubble.py: ``schedule="zero_bubble"`` against
``"interleaved"`` (dynamic mode), bitwise.

Usage: python zb_cases.py   (pp = the number of processes: 2 or 4)

Per case every rank builds the model from one seed twice, one runtime per schedule (each
with its own tags), and trains both on the same batches. After each step the per-microbatch
losses and every owned parameter's gradient must be bitwise equal, and so must the weights
after an SGD step. Then the zero-bubble runtimes' counters must show the split really ran:
W tasks ran, on some rank some ran in idle time (not only drained at the step's end),
and every W task queued ran. Prints "CASE-OK <name> ..." per case and "SUITE-OK zero_bubble pp<N>" at the end; any failure raises.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from replay_cases import (  # noqa: E402
    branch_data,
    contiguous,
    mlp,
    mlp_data,
    mse_step,
    paired_runtimes,
    train_bitwise,
)
from smp_comm import Communicator  # noqa: E402
from smp_pipeline import zerobubble  # noqa: E402
from smp_pipeline.actions import ActionKind, validate_programs  # noqa: E402

torch.set_num_threads(1)
TAG = [16000]
# A gradient folded out of microbatch order (a fold that did not wait for its W tasks) fails.
warnings.filterwarnings("error", message="deterministic accumulation", category=RuntimeWarning)
# A weight found with both W tasks and I-pass gradients: the up-front tie check missed it.
warnings.filterwarnings("error", message="zero_bubble, pp rank", category=RuntimeWarning)


class Mixer(nn.Module):
    """Uses a weight it shares with a Linear elsewhere functionally (``x @ w``): the split
    cannot sum that weight's contributions in autograd's order, so the Linear stays unsplit."""

    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


class SharedFunctional(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.lin = nn.Linear(d, d)
        self.mix = Mixer(self.lin.weight)
        self.post = nn.Linear(d, d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.post(self.mix(self.lin(self.pre(x)))))


def tied_step(model, rt):  # noqa: ANN001, ANN201
    def step(ids, target):  # noqa: ANN001, ANN202
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        rt.backward(loss)
        return loss.detach()

    return step


def fancy_step(model, rt):  # noqa: ANN001, ANN201
    def step(x, y, mask):  # noqa: ANN001, ANN202
        loss = F.mse_loss(model(x, mask=mask, scale=0.5), y)
        rt.backward(loss)
        return loss.detach()

    return step


def run(comm: Communicator, name: str, build, assignment, batches, m: int, *,  # noqa: ANN001
        step_of=mse_step, want_ops=("linear",), unsplit=(), **kw) -> None:  # noqa: ANN001
    """``want_ops``: operators some rank must have split; ``unsplit``: parameter names no
    rank may have split (tied with an unsplit module)."""
    runtimes, models_, optimizers = paired_runtimes(
        comm, build, assignment, [{"schedule": "zero_bubble"}, {"schedule": "interleaved"}], TAG,
        timeline=True, **kw,
    )
    train_bitwise(name, runtimes, models_, optimizers, step_of, batches, m, comm.rank)
    zb = runtimes[0]
    assert zb.weight_grads is not None and runtimes[1].weight_grad_stats is None
    split = [path for path, _ in zb.weight_grads.modules]
    st = zb.weight_grad_stats
    assert st is not None
    spans = [e for e in zb.timeline_events() if e[3] == "weight_grad"]
    mine = (split, st.total, st.idle, st.eager, st.drained, dict(st.deferred_ops), len(spans))
    # The last step's W tasks are actions of every rank's program, each after a backward of
    # its microbatch there; the programs validate together.
    programs = MPI.COMM_WORLD.allgather(zb.program())
    problems = validate_programs(programs)
    if problems:
        raise AssertionError(f"{name}: zero-bubble programs: {problems}")
    if not any(a.kind is ActionKind.WEIGHT_GRAD for p in programs for a in p):
        raise AssertionError(f"{name}: no weight-gradient action in any rank's program")
    every = MPI.COMM_WORLD.allgather(mine)
    for r, (paths, total, _idle, _e, _d, ops, nspans) in enumerate(every):
        if sum(ops.values()) != total:
            raise AssertionError(f"{name}: pp rank {r} queued {ops} W tasks, ran {total}")
        if nspans != total:
            raise AssertionError(f"{name}: pp rank {r} ran {total} W tasks, {nspans} spans")
        for bad in unsplit:
            if bad in paths:
                raise AssertionError(f"{name}: pp rank {r} split {bad}, tied to an unsplit op")
    if sum(e[1] for e in every) == 0:
        raise AssertionError(f"{name}: no W task ran on any rank (the split is off?)")
    if sum(e[2] for e in every) == 0:
        raise AssertionError(f"{name}: no W task ran in idle time on any rank: {every}")
    ops = {op for e in every for op in e[5]}
    if not set(want_ops) <= ops:
        raise AssertionError(f"{name}: split operators {ops}, wanted {want_ops}")
    if comm.rank == 0:
        counts = [(e[1], e[2], e[3], e[4]) for e in every]
        print(f"CASE-OK {name} W tasks (total, idle, eager, drained) per rank {counts}", flush=True)
    for rt in runtimes:
        rt.close()


def main() -> None:
    # Every rank splits every step here, whatever idle time it finds (a rank that finds
    # little rests from splitting: tests/test_zero_bubble.py tests that apart), so that each
    # case's counts and last step's program do not depend on this machine's load.
    zerobubble.REST_BELOW_IDLE_SHARE = 0.0
    comm = Communicator(MPI.COMM_WORLD)
    pp = comm.size
    mlp_batches = [mlp_data(s) for s in range(3)]
    run(comm, f"mlp-pp{pp}", mlp, contiguous(pp), mlp_batches, 8, want_ops=("linear", "layer_norm"))
    # Static mode's replay on the serving ranks, in both runtimes (W tasks around replays).
    run(comm, f"mlp-pp{pp}-static", mlp, contiguous(pp), mlp_batches, 4, static_mode=True)
    ckpt = {str(i): None for i in range(1, 8, 2)}
    run(comm, f"mlp-pp{pp}-checkpointing", mlp, contiguous(pp), mlp_batches[:2], 4,
        checkpointing=ckpt)
    # A tied embedding and output head (both split: one group sums their contributions).
    ids = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(4))
    tied_assign = {"": 0, "embed": 1, "head": 1, "blocks.1": pp - 1, "blocks.2": pp - 1}
    if pp == 4:
        tied_assign["blocks.1"] = 2
    run(comm, f"tied-pp{pp}", models.TiedLM, tied_assign, [(ids, tgt)] * 2, 4,
        step_of=tied_step, want_ops=("linear", "embedding"))
    if pp == 2:
        branch = {"left": 1, "right.1": 1, "out": 1}
    else:
        branch = {"pre": 1, "left": 2, "right.0": 3, "right.1": 2}
    run(comm, f"branch-pp{pp}", models.Branch, branch, [branch_data(0), branch_data(2, True)], 4)
    # Non-tensor stage inputs (kwargs, a dataclass, strings), a frozen Linear.
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    mask = (torch.rand(8, 8, generator=g) > 0.3).float()
    run(comm, f"fancy-pp{pp}", models.Fancy, {"enc": 1, "enc.aux": pp - 2, "dec": pp - 1}, [(x, y, mask)] * 2, 4,
        step_of=fancy_step)
    # A Linear's weight also used functionally by another module: that Linear stays unsplit.
    xs, ys = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    run(comm, f"shared-pp{pp}", SharedFunctional, {"lin": 1, "mix": 1, "post": pp - 2, "out": pp - 1},
        [(xs, ys)] * 2, 4, unsplit=("lin",))
    if comm.rank == 0:
        print(f"SUITE-OK zero_bubble pp{pp}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
