"""Stall diagnosis: a request that times out raises, on every rank, the chain of waits
behind it (:mod:`smp_pipeline.diagnosis`, :mod:`smp_pipeline.stall`).

The loopback case runs ranks as threads (see ``test_loopback.py``): a chain of nested modules
over four ranks whose last one blocks in user code. The other cases word chains from
hand-made reports: a cycle, a rank that does not answer, a request queued behind the token.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from smp_comm.testing import LoopbackCommunicator
from smp_pipeline import PipelineRuntime, PipelineTimeoutError
from smp_pipeline.stall import RUNNING, WAITING, Queued, RankState, Request, TaskState, explain
from test_loopback import DEADLINE_S, PROMPT_S, assert_workers_end, run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    """Intra-op threads would compete with the rank threads (and other jobs) for 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Scale(nn.Module):
    """``x * w`` with ``w`` = 1: values pass unchanged (the last module reads its microbatch
    from them), yet every stage has a parameter and a backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class Nest(nn.Module):
    """``inner(scale(x))``: nested, so each stage's forward calls the next stage's."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.scale = Scale()
        self.inner = inner


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.scale(x))


class Blocker(nn.Module):
    """Calls ``hook(microbatch)`` (read from the input: microbatch i carries i + 1), then
    doubles its input. (A plain function attribute: every rank's deep copy shares it.)"""

    def __init__(self, hook: Callable[[int], None]) -> None:
        super().__init__()
        self.hook = hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hook(int(x[0, 0].item()) - 1)
        return x * 2


def test_stalled_module_names_the_chain_on_every_rank() -> None:
    """Four ranks, each stage's forward calls the next: ``inner`` (rank 1) calls
    ``inner.inner`` (rank 2), which calls ``inner.inner.inner`` (rank 3), which blocks in user
    code for microbatch 1. A request times out after ``timeout_s``; every rank raises a
    timeout whose message holds the chain from rank 0's step function to the blocked module,
    its microbatch, and where its thread is, and names it on the first line. Rank 3 answers
    the stall query while its worker is stuck."""
    timeout_s, pp, blocked_mb = 2.5, 4, 1  # (a healthy request takes milliseconds)
    gate, entered = threading.Event(), threading.Event()

    def hook(mb: int) -> None:
        if mb == blocked_mb:
            entered.set()
            gate.wait(DEADLINE_S)  # the stall: released once rank 3 has raised

    base = Nest(Nest(Nest(Blocker(hook))))
    copies = [copy.deepcopy(base) for _ in range(pp)]
    assignment = {"inner": 1, "inner.inner": 2, "inner.inner.inner": 3}
    # Microbatch i (of 2, two rows each) is filled with i + 1.
    x = torch.arange(1.0, 3.0).repeat_interleave(2)[:, None].expand(4, 4).contiguous()
    runtimes: list[PipelineRuntime] = []

    def rank_main(comm: LoopbackCommunicator) -> None:
        model = copies[comm.rank]
        rt = PipelineRuntime(
            model, comm, comm.rank, pp, assignment=assignment, timeout_s=timeout_s
        )
        runtimes.append(rt)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).sum()
            rt.backward(loss)
            return loss

        try:
            rt.run_step(step, (x,), num_microbatches=2)
        finally:
            if comm.rank == 3:
                gate.set()  # the stuck worker may end now (close() does not wait for it)
            rt.close()

    outcomes = run_ranks(pp, rank_main)
    assert entered.is_set(), "the module never blocked"
    blocked = "the forward of module 'inner.inner.inner' (microbatch 1)"
    chain = [
        "pp rank 0: the step function's forward (microbatch 1) waits (",
        "for the forward of module 'inner' (microbatch 1) on pp rank 1",
        "pp rank 1: the forward of module 'inner' (microbatch 1) waits (",
        "for the forward of module 'inner.inner' (microbatch 1) on pp rank 2",
        "pp rank 2: the forward of module 'inner.inner' (microbatch 1) waits (",
        f"for {blocked} on pp rank 3",
        f"pp rank 3: {blocked} has held the execution token for ",
        "at hook (test_stall.py:",  # where rank 3's worker is: in the hook
    ]
    for rank, o in enumerate(outcomes):
        assert isinstance(o.error, PipelineTimeoutError), (rank, o.error)
        text = str(o.error)
        first = text.splitlines()[0]
        assert f"the chain of waits ends at pp rank 3: {blocked} runs for " in first, text
        at = 0
        for part in chain:  # in this order
            found = text.find(part, at)
            assert found >= 0, f"rank {rank}: {part!r} missing (or out of order) in:\n{text}"
            at = found + len(part)
        assert o.seconds < timeout_s + PROMPT_S, f"rank {rank} raised after {o.seconds:.1f}s"
    assert min(o.seconds for o in outcomes) >= timeout_s
    assert_workers_end(runtimes)


# ---------------------------------------------------------------------- wording, from reports


def _task(module: str, mb: int, state: str, serves: Any = None, waits: Any = None) -> TaskState:
    age = 3.0 if state == RUNNING else None
    return TaskState(module, mb, "forward", state, serves, waits, age, "")


def _req(key: Any, dest: int, path: str, mb: int, age: float = 2.0) -> Request:
    return Request(key, dest, path, mb, age)


A, B = ("fwd", (0, 0)), ("fwd", (1, 0))  # rank 0's request to rank 1, rank 1's to rank 2


def test_chain_through_a_queued_request_to_the_running_task() -> None:
    """A request received but not started: the chain goes on to the task holding the token."""
    reports = {
        0: RankState(0, 1, (_task("<step>", 0, WAITING, waits=A),), (_req(A, 1, "m", 0),), ()),
        1: RankState(1, 1, (_task("n", 1, RUNNING),), (), (Queued(A, 0, "m", 0),)),
    }
    text, culprit = explain("pp rank 0 waited", 0, A, reports, 2.0, [0, 1])
    assert culprit == 1
    assert "pp rank 1: received it, not started: its execution token is held by the " in text
    assert "ends at pp rank 1: the forward of module 'n' (microbatch 1) runs for 3.0 s" in text


def test_chain_follows_a_relay_to_the_owner_that_holds_it() -> None:
    """fast_mode relays pass a request on under the same key: the chain goes from the first
    owner (the request's destination, which has no record of it) to the one serving it."""
    reports = {
        0: RankState(0, 1, (_task("<step>", 0, WAITING, waits=A),), (_req(A, 1, "s.1..s.3", 0),), ()),
        1: RankState(1, 1, (), (), ()),
        2: RankState(2, 1, (_task("s.2", 0, RUNNING, serves=A),), (), ()),
        3: RankState(3, 1, (), (), ()),
    }
    text, culprit = explain("pp rank 0 waited", 0, A, reports, 2.0, [0, 1, 2, 3])
    assert culprit == 2
    assert "pp rank 1: passed it on to pp rank 2 (a relay)" in text
    assert "ends at pp rank 2: the forward of module 's.2' (microbatch 0) runs for 3.0 s" in text


def test_chain_to_a_rank_that_does_not_answer_and_other_work() -> None:
    """A rank that does not answer ends the chain; work off the chain is listed after it;
    communicator ranks are named where they differ from pp ranks."""
    reports: dict[int, RankState | None] = {
        0: RankState(0, 1, (_task("<step>", 0, WAITING, waits=A),), (_req(A, 1, "m", 0),), ()),
        1: RankState(1, 1, (_task("m", 0, WAITING, serves=A, waits=B),), (_req(B, 2, "m.k", 0),), ()),
        2: None,
    }  # fmt: skip
    text, culprit = explain("pp rank 1 waited", 1, B, reports, 2.0, [0, 2, 4])
    assert culprit == 2  # (the pp rank; the transport maps it to its communicator rank)
    lines = text.splitlines()
    assert lines[0].endswith("ends at pp rank 2 (communicator rank 4), which did not answer "
                             "(not serving the pipeline)"), text  # fmt: skip
    # The chain starts at rank 0's step function although rank 1 noticed.
    assert lines[2].startswith("  pp rank 0: the step function's forward (microbatch 0)"), text
    assert "pp rank 2 (communicator rank 4): no answer to the stall query within 2 s" in text
    assert "other pending work" not in text, text


def test_a_cycle_of_requests_is_named_a_deadlock() -> None:
    """Requests that wait on each other: the chain stops where it closes, naming the cycle."""
    reports = {
        0: RankState(0, 1, (_task("a", 0, WAITING, serves=B, waits=A),), (_req(A, 1, "b", 0),), ()),
        1: RankState(1, 1, (_task("b", 0, WAITING, serves=A, waits=B),), (_req(B, 0, "a", 0),), ()),
    }  # fmt: skip
    text, culprit = explain("pp rank 0 waited", 0, A, reports, 2.0, [0, 1])
    assert culprit is None
    assert "closes a cycle" in text and "(a deadlock)" in text.splitlines()[0], text


def test_no_request_waited_for_blames_the_rank_whose_task_runs() -> None:
    """Issue 49: the driver's step function stuck in a module before its first request (a
    stall on stage 0) while pp rank 1 waits for work and times out: the chain ends at pp
    rank 0's running task (with its module), not at the rank that noticed."""
    step = _task("<step>", 0, RUNNING)._replace(where=", in module 'emb', at hook (x.py:3)")
    reports: dict[int, RankState | None] = {
        0: RankState(0, 1, (step,), (), ()),
        1: RankState(1, 1, (), (), ()),
    }
    text, culprit = explain("pp rank 1 made no progress", 1, None, reports, 2.0, [0, 1])
    assert culprit == 0, text
    first = text.splitlines()[0]
    assert "ends at pp rank 0: the step function's forward (microbatch 0) runs for 3.0 s, in module 'emb'" in first, text


def test_no_request_and_a_silent_rank_blames_the_silent_rank() -> None:
    """Nothing runs and a rank did not answer the query (frozen): the chain ends there."""
    reports: dict[int, RankState | None] = {0: RankState(0, 1, (), (), ()), 1: None}
    text, culprit = explain("pp rank 0 made no progress", 0, None, reports, 2.0, [0, 1])
    assert culprit == 1 and "pp rank 1, which did not answer" in text.splitlines()[0], text
