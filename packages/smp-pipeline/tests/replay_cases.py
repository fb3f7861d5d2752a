"""Run under mpiexec by test_replay.py: static mode's replay against dynamic mode, bitwise.

Usage: python replay_cases.py   (pp = the number of processes: 2 or 4)

Per case every rank builds the model from one seed twice: one runtime in ``static_mode``,
one in dynamic mode (each with its own tags), and trains both on the same batches, step by
step. After each step the per-microbatch losses (on every rank) and the gradients of every
owned parameter must be equal bit for bit, and so must the weights after the SGD step. At
the end each serving rank's replay counters (:attr:`PipelineRuntime.replay_stats`) must say
what the case expects: which steps were replayed, which fell back to dynamic mode.
Prints "CASE-OK <name> ..." per case and "SUITE-OK replay pp<N>" at the end; any failure
raises (every rank's counters in the message).
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from smp_comm import Communicator  # noqa: E402
from smp_pipeline import PipelineRuntime  # noqa: E402

torch.set_num_threads(1)
TAG = [15000]
D = 16


def mlp(blocks: int = 8) -> nn.Sequential:
    """The benchmark's shape, small: ``LayerNorm, Linear(d, 2d), GELU, Linear(2d, d)`` blocks
    and a head."""
    return nn.Sequential(
        *[
            nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
            for _ in range(blocks)
        ],
        nn.Linear(D, 1),
    )


def contiguous(pp: int, blocks: int = 8) -> dict[str, int]:
    """Each rank a contiguous run of the Sequential's children (the head on the last)."""
    per = blocks // pp
    out = {str(i): i // per for i in range(blocks)}
    out[str(blocks)] = pp - 1
    return out


class Sleep(nn.Module):
    """Sleeps in forward (a slow block's compute): the backward request of the microbatch
    before arrives meanwhile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x


def slow_last_stage(pp: int):  # noqa: ANN201
    """``mlp()`` whose last stage's first block sleeps first: the replayed forward meets
    the arrived backward request at its next yield point and serves it nested."""

    def build() -> nn.Sequential:
        net = mlp()
        first = (pp - 1) * (8 // pp)
        net[first] = nn.Sequential(Sleep(), *net[first])
        return net

    return build


def mlp_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, D, generator=g), torch.randn(16, 1, generator=g)


def branch_data(seed: int, flip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """8 samples, m = 4: each microbatch's first sample picks Branch's branch (left, right,
    left, right; ``flip``: the other way round)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 8, generator=g)
    for i in range(0, 8, 2):
        x[i, 0] = 1.0 if ((i // 2) % 2 == 0) != flip else -1.0
    return x, torch.randn(8, 1, generator=g)


def equal(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    if a is None or b is None:
        if a is not b:
            raise AssertionError(f"{what}: one is None ({a is None}, {b is None})")
        return
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: not bitwise equal (max abs diff {(a - b).abs().max():.3g})")


def mse_step(model, rt):  # noqa: ANN001, ANN201
    """The step function: mean squared error of ``model(x)`` against ``y``, backward."""

    def step(x, y):  # noqa: ANN001, ANN202
        loss = F.mse_loss(model(x), y)
        rt.backward(loss)
        return loss.detach()

    return step


def paired_runtimes(comm: Communicator, build, assignment, variants, tag: list[int],  # noqa: ANN001
                    **kw):  # noqa: ANN003, ANN201
    """One runtime per ``variants`` entry (its keyword arguments on top of ``kw``), each over
    its own copy of one ``build()`` model (seed 1234), on a fresh tag from ``tag``; returns
    the runtimes, their models and an SGD optimizer each (for :func:`train_bitwise`)."""
    torch.manual_seed(1234)
    base = build()
    runtimes, models_, optimizers = [], [], []
    for extra in variants:
        model = copy.deepcopy(base)
        tag[0] += 10
        rt = PipelineRuntime(model, comm, comm.rank, comm.size, assignment=assignment,
                             timeout_s=60, tag=tag[0], **kw, **extra)  # fmt: skip
        runtimes.append(rt)
        models_.append(model)
        optimizers.append(torch.optim.SGD(rt.local_parameters(), lr=0.05))
    return runtimes, models_, optimizers


def train_bitwise(name: str, runtimes, models_, optimizers, step_of, batches, m: int,  # noqa: ANN001
                  rank: int) -> None:
    """Train two runtimes (the mode under test first, dynamic second) on the same batches,
    step by step; raise unless losses, local gradients and updated weights are bitwise equal."""
    for s, batch in enumerate(batches):
        outs = [rt.run_step(step_of(mdl, rt), batch, num_microbatches=m)
                for mdl, rt in zip(models_, runtimes)]  # fmt: skip
        for i, (a, b) in enumerate(zip(*outs)):
            equal(a, b, f"{name} step {s}: loss of microbatch {i}")
        grads = [dict(rt.named_local_parameters()) for rt in runtimes]
        for n, p in grads[0].items():
            equal(p.grad, grads[1][n].grad, f"{name} step {s}: grad of {n} (pp rank {rank})")
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for n, p in grads[0].items():
            equal(p.detach(), grads[1][n].detach(), f"{name} step {s}: {n} after SGD")


def run(comm: Communicator, name: str, build, assignment, batches, m: int, *, expect,
        schedule="interleaved", **kw) -> None:  # noqa: ANN001
    """``expect(stats_by_rank)`` checks every serving rank's ReplayStats (raises if wrong)."""
    runtimes, models_, optimizers = paired_runtimes(
        comm, build, assignment, [{"static_mode": True}, {"static_mode": False}], TAG,
        schedule=schedule, **kw,
    )
    train_bitwise(name, runtimes, models_, optimizers, mse_step, batches, m, comm.rank)
    stats = MPI.COMM_WORLD.allgather(runtimes[0].replay_stats)
    if stats[0] is not None:
        raise AssertionError(f"{name}: the driver has replay stats {stats[0]}")
    if any(st is None for st in stats[1:]):
        raise AssertionError(f"{name}: a serving rank has no replay: {stats}")
    if any(rt.replay_stats is not None for rt in runtimes[1:]):
        raise AssertionError(f"{name}: dynamic mode has replay stats")
    mine = runtimes[0].replay_stats
    if kw.get("timeline") and mine is not None:  # each fallback is a span in the timeline
        spans = [e for e in runtimes[0].timeline_events() if "replay fallback" in e[2]]
        if len(spans) != mine.fallbacks:
            raise AssertionError(f"{name}: {mine.fallbacks} fallbacks, timeline spans {spans}")
    problem = expect(stats)
    if problem:
        raise AssertionError(f"{name}: {problem}; replay stats by pp rank: {stats}")
    if comm.rank == 0:
        print(f"CASE-OK {name} {[(st.replayed, st.fallbacks, st.recorded, st.nested) for st in stats[1:]]}",
              flush=True)  # fmt: skip
        for r, st in enumerate(stats[1:], 1):
            for why in st.reasons:
                print(f"  pp rank {r} fell back: {why}", flush=True)
    for rt in runtimes:
        rt.close()


def all_replayed(steps: int):  # noqa: ANN201
    """Every serving rank recorded step 0 and replayed every later one, no fallback."""

    def check(stats) -> str:  # noqa: ANN001
        for r, st in enumerate(stats[1:], 1):
            if (st.replayed, st.fallbacks, st.recorded) != (steps - 1, 0, 1) or not st.requests:
                return f"pp rank {r}: wanted {steps - 1} steps replayed, none fallen back"
        return ""

    return check


def nested_on_last(steps: int):  # noqa: ANN201
    """Every step after the first replayed, and the last rank served backward requests
    nested in its replayed forwards."""

    def check(stats) -> str:  # noqa: ANN001
        problem = all_replayed(steps)(stats)
        if not problem and not stats[-1].nested:
            problem = "the last rank served no backward request nested in a forward"
        return problem

    return check


def every_rank_falls_back_once(stats) -> str:  # noqa: ANN001
    """Four steps, the third differs for every serving rank (a new microbatch size)."""
    for r, st in enumerate(stats[1:], 1):
        if (st.replayed, st.fallbacks, st.recorded) != (2, 1, 2):
            return f"pp rank {r}: wanted steps 1 and 3 replayed, step 2 fallen back"
    return ""


def branch_flip(stats) -> str:  # noqa: ANN001
    """Steps: recorded, replayed, the branches flip (fallback where a rank serves a branch's
    module; replayed where the flip changes nothing here), replayed again."""
    if sum(st.fallbacks for st in stats[1:]) < 1:
        return "the flipped branches caused no fallback on any rank"
    for r, st in enumerate(stats[1:], 1):
        if st.fallbacks > 1 or st.recorded != 1 + st.fallbacks or st.replayed != 3 - st.fallbacks:
            return f"pp rank {r}: wanted step 0 recorded, the others replayed except one fallback"
    return ""


def main() -> None:
    comm = Communicator(MPI.COMM_WORLD)
    pp = comm.size
    steps = 4
    mlp_batches = [mlp_data(s) for s in range(steps)]
    run(comm, f"mlp-pp{pp}", mlp, contiguous(pp), mlp_batches, 8, expect=all_replayed(steps))
    run(comm, f"mlp-pp{pp}-simple", mlp, contiguous(pp), mlp_batches, 4, schedule="simple",
        expect=all_replayed(steps))
    run(comm, f"mlp-pp{pp}-fast-off", mlp, contiguous(pp), mlp_batches[:3], 4, fast_mode=False,
        expect=all_replayed(3))
    # Another shape: step 2's batch is half the size (microbatches of 2 rows, not 4).
    halved = [*mlp_batches[:2], *(tuple(t[:8] for t in b) for b in mlp_batches[2:])]
    run(comm, f"mlp-pp{pp}-new-shape", mlp, contiguous(pp), halved, 4,
        expect=every_rank_falls_back_once)
    # Activation checkpointing: a checkpointed block on every stage (recomputed in backward).
    ckpt = {str(i): None for i in range(1, 8, 2)}
    run(comm, f"mlp-pp{pp}-checkpointing", mlp, contiguous(pp), mlp_batches[:3], 4,
        checkpointing=ckpt, expect=all_replayed(3))
    # A slow block on the last stage: backward requests served at the replayed forward's
    # yield points (as dynamic mode's forward yields to them), still bitwise.
    run(comm, f"mlp-pp{pp}-nested", slow_last_stage(pp), contiguous(pp), mlp_batches[:3], 4,
        expect=nested_on_last(3))
    if pp == 2:
        branch = {"left": 1, "right.1": 1, "out": 1}
    else:
        branch = {"pre": 1, "left": 2, "right.0": 3, "right.1": 2}
    batches = [branch_data(0), branch_data(1), branch_data(2, True), branch_data(3, True)]
    run(comm, f"branch-pp{pp}", models.Branch, branch, batches, 4, expect=branch_flip,
        timeline=True)
    if comm.rank == 0:
        print(f"SUITE-OK replay pp{pp}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
