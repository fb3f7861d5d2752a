"""The pipeline server with ranks as threads of this process (smp-comm's loopback world).

Each test builds one :class:`~smp_pipeline.PipelineRuntime` per thread-rank of a
:class:`~smp_comm.testing.LoopbackWorld` and runs real steps through the server: forward
requests and responses, cross-rank autograd, aborts, timeouts. No MPI job, so the whole file
takes seconds where the MPI suites of test_mpi.py take minutes, and a failure's traceback is
this process's own.

Every rank thread is joined against a deadline: a hang fails the test naming the ranks that
did not finish (and closes the world, so the hung servers' receives fail and they end too).
Models are built on the main thread (``torch.manual_seed`` seeds one process-wide
generator) and each rank gets a deep copy, as every MPI rank builds the same model.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import models
import pytest
import torch
import torch.nn.functional as F
from smp_comm.testing import LoopbackCommunicator, LoopbackWorld
from smp_pipeline import (
    PipelineRemoteError,
    PipelineRuntime,
    PipelineTimeoutError,
    device_work,
    split_microbatches,
)
from torch import nn

DEADLINE_S = 20.0  # a rank thread still running after this is hung
PROMPT_S = 5.0  # an error must reach every rank well within this

pytestmark = pytest.mark.timeout(60)  # backstop, above DEADLINE_S


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    """Intra-op threads would compete with the rank threads (and other jobs) for 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------- running ranks


@dataclass
class Outcome:
    """What one rank's function returned, or raised, and when it ended."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


def run_ranks(
    size: int, fn: Callable[[LoopbackCommunicator], Any], deadline_s: float = DEADLINE_S
) -> list[Outcome]:
    """Run ``fn(comm)`` on one thread per rank of a fresh loopback world; every rank's outcome.

    Fails the test, naming them, if ranks are still running after ``deadline_s``.
    """
    world = LoopbackWorld(size)
    outcomes = [Outcome() for _ in range(size)]
    t0 = time.monotonic()

    def main(rank: int) -> None:
        try:
            outcomes[rank].value = fn(world.communicator(rank))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcomes[rank].error = exc
        outcomes[rank].seconds = time.monotonic() - t0

    threads = [
        threading.Thread(target=main, args=(r,), name=f"loopback-rank-{r}", daemon=True)
        for r in range(size)
    ]
    for t in threads:
        t.start()
    end = t0 + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    world.close()  # fails the hung ranks' pending receives: a waiting server raises and ends
    if hung:
        for r in hung:
            threads[r].join(1.0)
        after = {
            r: "still blocked" if threads[r].is_alive() else repr(outcomes[r].error) for r in hung
        }
        pytest.fail(
            f"rank(s) {hung} of {size} still running after {deadline_s:g}s; once the world "
            f"was closed: {after}"
        )
    return outcomes


def values(outcomes: Sequence[Outcome]) -> list[Any]:
    """Every rank's return value; raises (naming the ranks) if any rank raised."""
    failed = [r for r, o in enumerate(outcomes) if o.error is not None]
    if failed:
        first = outcomes[failed[0]].error
        raise AssertionError(f"rank(s) {failed} raised; rank {failed[0]}: {first!r}") from first
    return [o.value for o in outcomes]


def assert_close(actual: Any, expected: Any, what: str) -> None:
    """torch.testing.assert_close (default tolerances), its message prefixed with ``what``."""
    torch.testing.assert_close(actual, expected, msg=lambda detail: f"{what}: {detail}")


def assert_workers_end(runtimes: Sequence[PipelineRuntime], timeout: float = 5.0) -> None:
    """After ``close()``, every worker thread of every runtime ends."""
    deadline = time.monotonic() + timeout
    for rt in runtimes:
        for t in rt.threads():
            t.join(max(0.0, deadline - time.monotonic()))
    alive = [(rt.pp_rank, t.name) for rt in runtimes for t in rt.threads() if t.is_alive()]
    assert not alive, f"worker threads still alive after close(): {alive}"


# ---------------------------------------------------------------------- equivalence


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def token_ce(model: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def relu_mlp() -> nn.Sequential:
    """Children 2-4 on rank 1 travel as one span request; the last Linear is a second run."""
    return nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 1),
    )  # fmt: skip


def regression(n: int = 8, seed: int = 0, sign_pattern: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    if sign_pattern:  # Branch: the first sample of each pair of rows picks the branch
        for i in range(0, n, 2):
            x[i, 0] = 1.0 if (i // 2) % 2 == 0 else -1.0
    return x, torch.randn(n, 1, generator=g)


def tokens() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, ...]]
    assignment: dict[str, int]
    pp: int = 2
    m: int = 4
    schedule: str = "interleaved"
    loss: Callable[..., torch.Tensor] = mse
    backward_mode: str = "auto"
    served: tuple[int, ...] | None = None  # requests each rank serves over the test's steps
    fast_mode: bool = True


CASES = {
    # Rank 1 serves two forward requests per microbatch (children 2-4 as one span, then 6)
    # and their two backward requests: 2 steps x 4 microbatches x 4.
    "seq-relu-simple": Case(
        relu_mlp, regression, {"2": 1, "3": 1, "4": 1, "6": 1}, schedule="simple", served=(0, 32)
    ),
    "seq-relu-interleaved": Case(
        relu_mlp, regression, {"2": 1, "3": 1, "4": 1, "6": 1}, served=(0, 32)
    ),
    # fast_mode off: one request per child (2-4 and 6): 2 steps x 4 microbatches x 4 x 2.
    "seq-relu-fast-off": Case(
        relu_mlp, regression, {"2": 1, "3": 1, "4": 1, "6": 1}, served=(0, 64), fast_mode=False
    ),
    # The placement cuts inside block 1: fast_mode flattens the nested Sequential, so
    # 1.1, 1.2, 2 and 3 are one request (forward + backward: 2 x 4 x 2) ...
    "nested-seq": Case(
        models.nested_seq_model, regression, {"1.1": 1, "1.2": 1, "2": 1, "3": 1}, served=(0, 16)
    ),
    # ... one per child without fast_mode (1.1, 1.2, 2, 3: 2 x 4 x 8) ...
    "nested-seq-fast-off": Case(
        models.nested_seq_model, regression, {"1.1": 1, "1.2": 1, "2": 1, "3": 1},
        served=(0, 64), fast_mode=False,
    ),  # fmt: skip
    # ... and two runs when block 1 has a forward hook (its call cannot be skipped): 1.1-1.2
    # inside block 1, then 2-3 (2 x 4 x 4); the hook halves block 1's output on rank 0.
    "nested-seq-hooked": Case(
        models.hooked_nested_seq_model, regression, {"1.1": 1, "1.2": 1, "2": 1, "3": 1},
        served=(0, 32),
    ),  # fmt: skip
    # Three runs on three ranks: one forward and one backward request each per microbatch.
    "seq-pp4-runs": Case(
        lambda: models.nested_seq_model(n=7), regression,
        {"1": 1, "2": 1, "3": 2, "4": 2, "5": 3, "6": 3}, pp=4, served=(0, 16, 16, 16),
    ),  # fmt: skip
    # embed and head share one weight, both on rank 1; rank 0 keeps the middle block.
    "tied": Case(
        models.TiedLM, tokens, {"": 0, "embed": 1, "head": 1, "blocks.1": 0}, loss=token_ce
    ),
    "reuse": Case(models.Reuse, regression, {"shared": 1, "out": 1}),
    "reuse-segments": Case(
        models.Reuse, regression, {"shared": 1, "out": 1}, backward_mode="segments"
    ),
    "branch": Case(models.Branch, lambda: regression(sign_pattern=True), {"left": 1, "right.1": 1}),
    "reuse-pp3": Case(models.Reuse, regression, {"a": 1, "shared": 2, "out": 2}, pp=3),
    "chain-pp4-m8": Case(
        models.Chain,
        lambda: regression(n=16),
        {"blocks.0": 1, "blocks.1": 2, "blocks.2": 3, "blocks.3": 3, "head": 2},
        pp=4,
        m=8,
    ),
}


def reference_steps(
    model: nn.Module,
    case: Case,
    steps: int,
    configure: Callable[[nn.Module, int], None] | None = None,
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor | None]]]:
    """One thread, the unwrapped model: per step, the per-microbatch losses and every
    parameter's gradient, accumulating the pipeline's microbatches in order with each loss
    scaled by 1/m (what the pipeline computes); then an SGD step. ``configure(model, s)``
    runs before step ``s``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for s in range(steps):
        if configure is not None:
            configure(model, s)
        opt.zero_grad()
        losses = []
        for args, _ in split_microbatches(None, case.batch(), None, case.m):
            loss = case.loss(model, *args)
            (loss / case.m).backward()
            losses.append(loss.detach())
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        out.append((torch.stack(losses), grads))
        opt.step()
    return out


def pipeline_steps(
    comm: LoopbackCommunicator,
    model: nn.Module,
    case: Case,
    steps: int,
    deterministic_accumulation: bool = True,
    static_mode: bool = False,
    before_step: Callable[[PipelineRuntime, int], None] | None = None,
) -> tuple[list[Any], PipelineRuntime]:
    """One rank: the same steps through a PipelineRuntime (the step function does not scale
    the loss: the runtime owns 1/m); per step the outputs and the local gradients."""
    rt = PipelineRuntime(
        model,
        comm,
        comm.rank,
        comm.size,
        assignment=case.assignment,
        schedule=case.schedule,
        timeout_s=10,
        backward_mode=case.backward_mode,
        deterministic_accumulation=deterministic_accumulation,
        fast_mode=case.fast_mode,
        static_mode=static_mode,
    )
    if static_mode:
        # The 2 ms gate is a speed heuristic (a longer task stays where it can yield); here
        # every straight-through task qualifies, so what is served inline does not depend on
        # how loaded the machine is.
        rt.server.executor.inline_max_s = 60.0

    def step(*args: torch.Tensor) -> torch.Tensor:
        loss = case.loss(model, *args)
        rt.backward(loss)
        return loss

    try:
        params = rt.local_parameters()
        opt = torch.optim.SGD(params, lr=0.1) if params else None
        out = []
        for s in range(steps):
            if before_step is not None:
                before_step(rt, s)
            for p in params:
                p.grad = None
            outs = rt.run_step(step, case.batch(), num_microbatches=case.m)
            grads = {
                n: None if p.grad is None else p.grad.clone()
                for n, p in rt.named_local_parameters()
            }
            out.append((outs, grads))
            if opt is not None:
                opt.step()
        return out, rt
    finally:
        rt.close()


@pytest.mark.parametrize("deterministic", [True, False], ids=["in-order", "autograd-order"])
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_one_thread(name: str, deterministic: bool) -> None:
    """Losses (on every rank) and gradients equal one thread accumulating the same
    microbatches; after an SGD step, the second step's too. Every parameter has one owner.
    With ``deterministic_accumulation=False`` autograd sums the microbatches in whatever
    order their backward runs: equal within the default tolerances, not bitwise."""
    case = CASES[name]
    torch.manual_seed(1234)
    base = case.build()
    copies = [copy.deepcopy(base) for _ in range(case.pp)]
    steps = 2
    expected = reference_steps(copy.deepcopy(base), case, steps)
    results = values(
        run_ranks(
            case.pp, lambda c: pipeline_steps(c, copies[c.rank], case, steps, deterministic)
        )
    )
    runtimes = [rt for _, rt in results]
    assert_workers_end(runtimes)
    if case.served is not None:
        assert tuple(rt.requests_served for rt in runtimes) == case.served

    owners: dict[str, int] = {}
    for rank, (per_step, rt) in enumerate(results):
        assert sorted(set(rt.assignment.values())) == list(range(case.pp)), rt.assignment
        for s, ((outs, grads), (ref_losses, ref_grads)) in enumerate(zip(per_step, expected)):
            # Every rank got the driver's outputs (outputs_to_all).
            assert_close(torch.stack(outs), ref_losses, f"losses on rank {rank}, step {s}")
            for n, g in grads.items():
                owners.setdefault(n, rank)
                ref = ref_grads[n]
                if ref is None:
                    assert g is None or not g.any(), f"{n} has an unexpected gradient"
                    continue
                assert g is not None, f"step {s}: {n} got no gradient on rank {rank}"
                assert_close(g, ref, f"gradient of {n} on rank {rank}, step {s}")
        for n in grads:
            assert owners[n] == rank, f"{n} is local on ranks {owners[n]} and {rank}"
    assert set(owners) == set(expected[0][1]), "parameters owned by no rank"


# ---------------------------------------------------------------------- static mode

# Cases where some rank serves requests whose modules all live on it: static mode serves them
# on its main loop from the second step on (inline > 0 somewhere).
STATIC_CASES = [
    "seq-relu-interleaved", "seq-relu-simple", "nested-seq", "nested-seq-hooked",
    "seq-pp4-runs", "tied", "reuse", "reuse-segments", "branch", "reuse-pp3", "chain-pp4-m8",
]  # fmt: skip


@pytest.mark.parametrize("name", STATIC_CASES)
def test_static_mode_is_bitwise_dynamic_mode(name: str) -> None:
    """``static_mode`` serves a request that ran straight through before on the serving
    rank's main loop: same code, same order, so losses and gradients equal dynamic mode's
    bit for bit, every step (the first records, the later ones replay)."""
    case = CASES[name]
    torch.manual_seed(1234)
    base = case.build()
    steps = 3
    runs = {}
    for static in (False, True):
        copies = [copy.deepcopy(base) for _ in range(case.pp)]
        runs[static] = values(
            run_ranks(
                case.pp,
                lambda c, s=static, k=copies: pipeline_steps(c, k[c.rank], case, steps, True, s),
            )
        )
        assert_workers_end([rt for _, rt in runs[static]])
    for rank in range(case.pp):
        dyn, rt_dyn = runs[False][rank]
        sta, rt_sta = runs[True][rank]
        assert rt_dyn.server.executor.inlined == 0
        assert rt_sta.requests_served == rt_dyn.requests_served
        for s in range(steps):
            assert torch.equal(torch.stack(sta[s][0]), torch.stack(dyn[s][0])), (rank, s)
            assert sta[s][1].keys() == dyn[s][1].keys()
            for n, g in dyn[s][1].items():
                h = sta[s][1][n]
                assert (g is None) == (h is None), (n, rank, s)
                assert g is None or torch.equal(g, h), f"step {s}: gradient of {n} on rank {rank}"
    inlined = [rt.server.executor.inlined for _, rt in runs[True]]
    assert inlined[0] == 0, inlined  # the driver serves nothing
    assert sum(inlined) > 0, f"{name}: nothing served inline: {inlined}"
    # The first request of each kind is recorded on a worker, never inline.
    served = sum(rt.requests_served for _, rt in runs[True])
    assert sum(inlined) < served, (inlined, served)


class SometimesDeviceWork(nn.Module):
    """A linear layer that does its work inside ``device_work()`` once ``on`` is set."""

    on = False

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if SometimesDeviceWork.on:
            with device_work():
                return self.lin(x)
        return self.lin(x)


def test_static_mode_divergence_falls_back_exactly(caplog: pytest.LogCaptureFixture) -> None:
    """A request recorded as running straight through that now does device work (it ran
    inline, synchronously: still exact) is said once in the log and goes back to a worker;
    results equal one thread's throughout."""
    torch.manual_seed(7)
    base = nn.Sequential(nn.Linear(8, 8), SometimesDeviceWork(), nn.Linear(8, 1))
    case = Case(lambda: base, regression, {"1": 1})
    steps = 4
    expected = reference_steps(copy.deepcopy(base), case, steps)
    copies = [copy.deepcopy(base) for _ in range(2)]
    inlined: list[int] = []  # rank 1's count before each step

    def before_step(rt: PipelineRuntime, s: int) -> None:
        if rt.pp_rank == 1:  # only rank 1 runs '1'
            SometimesDeviceWork.on = s >= 2
            inlined.append(rt.server.executor.inlined)

    with caplog.at_level("WARNING", logger="smp_pipeline"):
        results = values(
            run_ranks(
                2, lambda c: pipeline_steps(c, copies[c.rank], case, steps, True, True, before_step)
            )
        )
    SometimesDeviceWork.on = False
    for rank, (per_step, _rt) in enumerate(results):
        for s, ((outs, grads), (ref_losses, ref_grads)) in enumerate(zip(per_step, expected)):
            assert torch.equal(torch.stack(outs), ref_losses), (rank, s)
            for n, g in grads.items():
                assert torch.equal(g, ref_grads[n]), f"step {s}: gradient of {n} on rank {rank}"
    rt1 = results[1][1]
    inlined = [*inlined[1:], rt1.server.executor.inlined]  # after each step
    # Microbatch 0 records; the rest of step 0 and step 1 replay (forward and backward of
    # '1', m = 4: 6 + 8 inline); step 2's first forward diverges (device work, run
    # inline: counted) and from then on the forwards go to a worker.
    assert inlined[:2] == [6, 14], inlined
    assert inlined[2] <= 14 + 1 + 4 and inlined[3] - inlined[2] <= 4, inlined
    assert rt1.server.executor.diverged >= 1
    warnings = [r for r in caplog.records if "static mode" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "forward of module '1'" in warnings[0].getMessage()


# ---------------------------------------------------------------------- failures


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom inside a module")


class _FailingGrad(torch.autograd.Function):
    """Identity whose backward raises."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom inside a module's backward")


class BoomInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingGrad.apply(x)


class Stages(nn.Module):
    """``post(inner(pre(x)))``: three modules to spread over up to three ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = inner
        self.post = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(self.pre(x)))


@pytest.mark.parametrize(
    "pp, assignment, inner, during",
    [
        (2, {"inner": 1}, Boom, "forward"),
        (3, {"inner": 1, "post": 2}, Boom, "forward"),
        (3, {"inner": 1, "post": 2}, BoomInBackward, "backward"),
    ],
    ids=["pp2-last-stage", "pp3-middle-stage", "pp3-middle-stage-backward"],
)
def test_module_error_raises_on_every_rank(
    pp: int, assignment: dict[str, int], inner: type[nn.Module], during: str
) -> None:
    """An exception in a module on rank 1 (its forward, or its backward segment) aborts the
    step: every rank raises PipelineRemoteError with the original message and what failed,
    promptly; on rank 1 the original exception is its cause. close() then ends every worker
    thread, including those left waiting for an answer."""
    base = Stages(inner())
    copies = [copy.deepcopy(base) for _ in range(pp)]
    runtimes: list[PipelineRuntime] = []

    def rank_main(comm: LoopbackCommunicator) -> None:
        model = copies[comm.rank]
        rt = PipelineRuntime(model, comm, comm.rank, pp, assignment=assignment, timeout_s=30)
        runtimes.append(rt)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().mean()
            rt.backward(loss)
            return loss

        try:
            rt.run_step(step, (torch.ones(4, 4),), num_microbatches=2)
        finally:
            rt.close()

    outcomes = run_ranks(pp, rank_main)
    for rank, o in enumerate(outcomes):
        assert isinstance(o.error, PipelineRemoteError), (rank, o.error)
        text = str(o.error)
        assert "boom inside a module" in text, text
        assert f"during {during} of module 'inner' (microbatch 0)" in text, text
        assert o.seconds < PROMPT_S, f"rank {rank} raised only after {o.seconds:.1f}s"
        if rank == 1:
            assert isinstance(o.error.__cause__, ValueError), o.error.__cause__
        else:
            assert "reported by pp rank 1" in text, text
    assert_workers_end(runtimes)


def test_rank_that_stops_serving_times_out() -> None:
    """Rank 1 does not serve (it joins the step only once rank 0 has given up): rank 0's
    request times out after ``timeout_s`` with an error naming the module, the microbatch and
    rank 1; rank 1 then raises the same timeout, reported by rank 0."""
    timeout_s = 0.5
    base = Stages(nn.Identity())
    copies = [copy.deepcopy(base) for _ in range(2)]
    rank0_done = threading.Event()
    runtimes: list[PipelineRuntime] = []

    def rank_main(comm: LoopbackCommunicator) -> None:
        model = copies[comm.rank]
        rt = PipelineRuntime(
            model, comm, comm.rank, 2, assignment={"inner": 1}, timeout_s=timeout_s
        )
        runtimes.append(rt)
        try:
            if comm.rank == 1:
                assert rank0_done.wait(DEADLINE_S), "rank 0 never gave up"
            rt.run_step(lambda x: model(x).sum(), (torch.ones(4, 4),), num_microbatches=2)
        finally:
            rank0_done.set()
            rt.close()

    outcomes = run_ranks(2, rank_main)
    waited = (
        f"pp rank 0 waited more than {timeout_s:g}s for the forward of module 'inner' "
        "(microbatch 0) on pp rank 1"
    )
    for rank, o in enumerate(outcomes):
        assert isinstance(o.error, PipelineTimeoutError), (rank, o.error)
        text = str(o.error)
        assert waited in text, text
        if rank == 1:
            assert "reported by pp rank 0" in text, text
    assert timeout_s <= outcomes[0].seconds < timeout_s + PROMPT_S, outcomes[0].seconds
    assert outcomes[1].seconds - outcomes[0].seconds < PROMPT_S
    assert_workers_end(runtimes)


# ---------------------------------------------------------------------- run_microbatches


@pytest.mark.parametrize(
    "active, schedule, max_in_flight",
    [(1, "interleaved", 1), (1, "simple", 1), (None, "simple", 3), (2, "simple", 2)],
)
def test_run_microbatches_order_limit_and_scaling(
    active: int | None, schedule: str, max_in_flight: int
) -> None:
    """``run_microbatches`` runs the caller's microbatches (positional and keyword arguments,
    unequal sizes) with at most ``active_microbatches`` in flight, and the runtime alone
    scales each microbatch's gradient by 1/m: the gradients are the sum of the per-microbatch
    loss gradients over 3, whatever the sizes. The other rank gets the outputs, or Nones with
    ``outputs_to_all=False``."""
    torch.manual_seed(7)
    base = relu_mlp()
    ref = copy.deepcopy(base)
    copies = [copy.deepcopy(base) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    sizes = [3, 1, 2]
    mbs = [
        ((torch.randn(n, 8, generator=g), i), {"y": torch.randn(n, 1, generator=g)})
        for i, n in enumerate(sizes)
    ]
    m = len(mbs)
    events: list[tuple[str, int]] = []

    def rank_main(comm: LoopbackCommunicator) -> tuple[list[Any], Any, Any, PipelineRuntime]:
        model = copies[comm.rank]
        rt = PipelineRuntime(
            model, comm, comm.rank, 2, assignment={"2": 1, "3": 1, "4": 1}, timeout_s=10
        )

        def step(x: torch.Tensor, i: int, *, y: torch.Tensor) -> torch.Tensor:
            events.append(("start", i))
            loss = F.mse_loss(model(x), y)
            rt.backward(loss)
            events.append(("end", i))
            return loss

        given = mbs if comm.rank == 0 else []
        try:
            kw = {"schedule": schedule, "active_microbatches": active}
            first = rt.run_microbatches(step, given, **kw)
            grads = {n: p.grad.clone() for n, p in rt.named_local_parameters()}
            # No zero_grad: the second step's gradients add to the first's.
            second = rt.run_microbatches(step, given, **kw, outputs_to_all=False)
            twice = {n: p.grad.clone() for n, p in rt.named_local_parameters()}
            return first, grads, (second, twice), rt
        finally:
            rt.close()

    results = values(run_ranks(2, rank_main))
    assert_workers_end([rt for *_, rt in results])

    losses = []
    for (x, _), kw in mbs:
        loss = F.mse_loss(ref(x), kw["y"])
        (loss / m).backward()
        losses.append(loss.detach())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for rank, (first, grads, (second, twice), _) in enumerate(results):
        assert_close(torch.stack(first), torch.stack(losses), f"losses on rank {rank}")
        assert (second == [None] * m) == (rank == 1), second
        for n, grad in grads.items():
            assert_close(grad, ref_grads[n], f"gradient of {n} on rank {rank}")
            assert_close(twice[n], 2 * ref_grads[n], f"{n} after two steps, rank {rank}")

    first_step = events[: 2 * m]
    assert sorted(first_step) == sorted([(e, i) for i in range(m) for e in ("start", "end")])
    assert [i for e, i in first_step if e == "start"] == list(range(m)), first_step
    in_flight, most = 0, 0
    for e, _ in first_step:
        in_flight += 1 if e == "start" else -1
        most = max(most, in_flight)
    assert most == max_in_flight, first_step


# ---------------------------------------------------------------------- deterministic accumulation


class _Jitter(torch.autograd.Function):
    """Exact identity whose forward and backward sleep a random time as device work (the
    token goes back meanwhile), so microbatches finish in a different order every run.
    With ``keep_token`` the backward sleeps holding the token (as a CUDA backward segment
    would: it never gives the token back midway)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rng: Any, keep_token: bool) -> torch.Tensor:
        ctx.rng = rng
        ctx.keep_token = keep_token
        with device_work():
            time.sleep(rng.uniform(0.0, 0.004))
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        if ctx.keep_token:
            time.sleep(ctx.rng.uniform(0.0, 0.004))
        else:
            with device_work():
                time.sleep(ctx.rng.uniform(0.0, 0.004))
        return g, None, None


def add_jitter(
    model: nn.Module, paths: Sequence[str], rng: random.Random, keep_token: bool = False
) -> None:
    """Forward hooks (they run on the module's owner) that pass each output through _Jitter."""
    mods = dict(model.named_modules())
    for path in paths:

        def hook(_m: nn.Module, _i: Any, out: Any) -> Any:
            if not isinstance(out, torch.Tensor):
                return out
            return _Jitter.apply(out, rng, keep_token)

        mods[path].register_forward_hook(hook)


@dataclass(frozen=True)
class DetCase:
    case: Case
    jitter: tuple[str, ...]  # modules whose outputs sleep a random time, forward and backward
    # Bitwise equal to the in-order reference. Not with backward segments around a residual
    # (Reuse): the graph below a remote call is differentiated once per segment, so a
    # parameter there gets g1*x + g2*x where one process computes (g1 + g2)*x; nor where a
    # tensor's three or more consumers are split across ranks (their gradients are summed
    # in another order). Deterministic all the same (equal across runs), and close.
    exact: bool = True
    # Backward jitter keeps the token. Segment mode needs it: segments of one microbatch
    # that overlap on a rank (one gives the token back midway) split a call's input gradient
    # between its responses by timing (docs/packages/smp-pipeline.md, Deterministic accumulation).
    keep_token: bool = False


DET_CASES = {
    "reuse-pp2-m8": DetCase(
        Case(models.Reuse, lambda: regression(n=16), {"shared": 1, "out": 1}, m=8),
        ("a", "shared", "b"),
    ),
    "reuse-segments-pp2-m6": DetCase(
        Case(
            models.Reuse, lambda: regression(n=12), {"shared": 1, "out": 1}, m=6,
            backward_mode="segments",
        ),
        ("a", "shared", "b"),
        exact=False,
        keep_token=True,
    ),  # fmt: skip
    "reuse-pp3-m8": DetCase(
        Case(models.Reuse, lambda: regression(n=16), {"a": 1, "shared": 2, "out": 2}, pp=3, m=8),
        ("a", "shared", "b", "out"),
    ),
    # h (shared's first output, on rank 0) has three consumers: b's linear and b's residual
    # (on rank 3, summed there first) and the outer residual; one process's engine sums the
    # three in another order. Reproducible all the same.
    "reuse-pp4-m8": DetCase(
        Case(models.Reuse, lambda: regression(n=16), {"a": 1, "shared": 2, "b": 3}, pp=4, m=8),
        ("a", "shared", "b", "out"),
        exact=False,
    ),
    "tied-pp2-m4": DetCase(
        Case(models.TiedLM, tokens, {"": 0, "embed": 1, "head": 1, "blocks.1": 0}, loss=token_ce),
        ("embed", "blocks.0", "blocks.1", "blocks.2"),
    ),
    "branch-pp3-m4": DetCase(
        Case(
            models.Branch, lambda: regression(sign_pattern=True),
            {"pre": 1, "left": 2, "right.1": 2, "out": 1}, pp=3,
        ),
        ("pre", "left", "right.0", "right.1"),
    ),  # fmt: skip
    "chain-pp4-m8": DetCase(
        Case(
            models.Chain, lambda: regression(n=16),
            {"blocks.0": 1, "blocks.1": 2, "blocks.2": 3, "blocks.3": 3, "head": 2}, pp=4, m=8,
        ),
        ("inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3"),
    ),  # fmt: skip
}


def jittered_steps(
    comm: LoopbackCommunicator, model: nn.Module, case: Case, steps: int
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor | None]]]:
    """One rank: ``steps`` steps without zeroing gradients in between (they accumulate
    across steps), every microbatch in flight at once; per step the losses and local grads."""
    rt = PipelineRuntime(
        model, comm, comm.rank, comm.size, assignment=case.assignment, timeout_s=10,
        active_microbatches=case.m, backward_mode=case.backward_mode,
    )  # fmt: skip

    def step(*args: torch.Tensor) -> torch.Tensor:
        loss = case.loss(model, *args)
        rt.backward(loss)
        return loss

    try:
        out = []
        for _ in range(steps):
            losses = torch.stack(rt.run_step(step, case.batch(), num_microbatches=case.m))
            grads = {
                n: None if p.grad is None else p.grad.clone()
                for n, p in rt.named_local_parameters()
            }
            out.append((losses, grads))
        return out
    finally:
        rt.close()


def accumulating_reference(
    model: nn.Module, case: Case, steps: int
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor | None]]]:
    """One thread: each microbatch's ``(loss_i / m).backward()`` in order i = 0..m-1, for
    ``steps`` steps without zeroing in between."""
    out = []
    for _ in range(steps):
        losses = []
        for args, _ in split_microbatches(None, case.batch(), None, case.m):
            loss = case.loss(model, *args)
            (loss / case.m).backward()
            losses.append(loss.detach())
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        out.append((torch.stack(losses), grads))
    return out


# A gradient arriving after its microbatch was folded (a rank judged its backward complete
# too early) warns: here it fails the rank that saw it.
@pytest.mark.filterwarnings("error:deterministic accumulation")
@pytest.mark.parametrize("name", list(DET_CASES))
def test_accumulation_is_deterministic_under_jitter(name: str) -> None:
    """Gradients are accumulated in microbatch order whatever the timing: three runs with
    differently perturbed timing give bit-identical losses and gradients, equal (torch.equal)
    to one thread accumulating the microbatches in order (``exact``; else close to it), over
    two steps without zeroing (the second step's gradients add to the first's)."""
    det = DET_CASES[name]
    case = det.case
    torch.manual_seed(4321)
    base = case.build()
    steps = 2
    expected = accumulating_reference(copy.deepcopy(base), case, steps)
    runs = []
    for run in range(3):
        copies = [copy.deepcopy(base) for _ in range(case.pp)]
        for r, mdl in enumerate(copies):
            add_jitter(mdl, det.jitter, random.Random(1000 * run + r), det.keep_token)
        runs.append(
            values(
                run_ranks(
                    case.pp, lambda c, cs=copies: jittered_steps(c, cs[c.rank], case, steps)
                )
            )
        )
    for run, per_rank in enumerate(runs[1:], 1):  # every run equals the first, bit for bit
        for rank, per_step in enumerate(per_rank):
            for s, ((losses, grads), (losses0, grads0)) in enumerate(zip(per_step, runs[0][rank])):
                assert torch.equal(losses, losses0), f"run {run} rank {rank} step {s}: losses"
                assert grads.keys() == grads0.keys()
                for n, g in grads.items():
                    g0 = grads0[n]
                    where = f"rank {rank}, step {s}: gradient of {n}, run {run} vs run 0"
                    if g is None or g0 is None:
                        assert g is None and g0 is None, where
                        continue
                    diff = (g - g0).abs().max().item()
                    assert torch.equal(g, g0), f"{where}: differs by {diff:.3g}"
    for run, per_rank in enumerate(runs):
        for rank, per_step in enumerate(per_rank):
            for s, ((losses, grads), (ref_losses, ref_grads)) in enumerate(zip(per_step, expected)):
                assert torch.equal(losses, ref_losses), f"run {run} rank {rank} step {s}: losses"
                for n, g in grads.items():
                    ref = ref_grads[n]
                    where = f"run {run}, rank {rank}, step {s}: gradient of {n}"
                    if ref is None:
                        assert g is None, f"{where}: unexpected"
                        continue
                    assert g is not None, f"{where}: missing"
                    if not det.exact:
                        assert_close(g, ref, where)
                        continue
                    diff = (g - ref).abs().max().item()
                    assert torch.equal(g, ref), f"{where}: differs from the reference by {diff:.3g}"


@pytest.mark.parametrize(
    "assignment, where",
    [
        # Rank 1 serves one call per microbatch (children 2-4 as one span): its backward is
        # one engine run, so its contributions go to .grad as they arrive, in the segment.
        ({"2": 1, "3": 1, "4": 1}, "segment"),
        # Two calls per microbatch (the span, then child 6), each with its own parameters:
        # each parameter's one contribution streams too (per-parameter streaming).
        ({"2": 1, "3": 1, "4": 1, "6": 1}, "segment"),
        # The same with streaming off (as for parameters two calls share): buffered, and
        # folded by the task of the second call once it has answered.
        ({"2": 1, "3": 1, "4": 1, "6": 1}, "task"),
    ],
    ids=["one-call", "two-calls", "two-calls-buffered"],
)
def test_fold_happens_before_the_driver_ends_the_microbatch(
    assignment: dict[str, int], where: str, request: pytest.FixtureRequest
) -> None:
    """A rank folds a microbatch's gradients as soon as its own records show that its
    backward of the microbatch is done, not when the driver's ``MbDone`` arrives: the
    driver's step function, after ``backward``, waits until rank 1 folded that microbatch
    (``MbDone`` is sent only after the step function returns: waiting for it times out).
    Where a rank's backward of a microbatch is one engine run, the fold happens inside it,
    as the engine reaches the parameter (one microbatch in flight at a time: the earlier
    ones are folded by then). Gradients stay bitwise equal to one thread accumulating the
    microbatches in order."""
    torch.manual_seed(11)
    base = relu_mlp()
    m, steps = 4, 2
    case = Case(relu_mlp, regression, assignment, m=m)
    expected = accumulating_reference(copy.deepcopy(base), case, steps)
    copies = [copy.deepcopy(base) for _ in range(2)]
    split = split_microbatches(None, case.batch(), None, m)
    mbs = [((args[0], i), {}) for i, (args, _) in enumerate(split)]
    ys = [args[1] for args, _ in split]
    folded = {(s, k): threading.Event() for s in range(steps) for k in range(m)}
    waits: list[tuple[int, int, bool]] = []  # driver: (step, mb, rank 1 folded it in time)
    seen: list[list[tuple[int, int, str]]] = [[], []]  # per rank: (step, mb, where)

    def rank_main(comm: LoopbackCommunicator) -> list[dict[str, torch.Tensor]]:
        model = copies[comm.rank]
        rt = PipelineRuntime(
            model, comm, comm.rank, 2, assignment=assignment, timeout_s=10, active_microbatches=1
        )
        if request.node.callspec.id == "two-calls-buffered" and comm.rank == 1:
            rt.server.records.streamable = lambda ctx: frozenset()  # type: ignore[method-assign]
        now = {"step": 0, "folds": 0}

        def step(x: torch.Tensor, i: int) -> torch.Tensor:
            loss = F.mse_loss(model(x), ys[i])
            rt.backward(loss)
            # Waits holding the token: nothing more comes from this rank until it returns.
            waits.append((now["step"], i, folded[(now["step"], i)].wait(timeout=3.0)))
            return loss

        def on_fold(_p: torch.Tensor) -> None:
            k = now["folds"]  # every microbatch reaches the parameter: the k-th fold is mb k
            now["folds"] += 1
            task = rt.server.executor.current
            at = "loop" if task is None else "segment" if task.in_segment else "task"
            seen[comm.rank].append((now["step"], k, at))
            if comm.rank == 1:
                folded[(now["step"], k)].set()

        name = "0.weight" if comm.rank == 0 else "2.weight"
        rt.register_grad_hook(dict(model.named_parameters())[name], on_fold)
        try:
            out = []
            for s in range(steps):
                now["step"], now["folds"] = s, 0
                rt.run_microbatches(step, mbs if comm.rank == 0 else [])
                out.append({n: p.grad.clone() for n, p in rt.named_local_parameters()})
            return out
        finally:
            rt.close()

    results = values(run_ranks(2, rank_main, deadline_s=40.0))
    late = [(s, k) for s, k, in_time in waits if not in_time]
    assert not late, f"rank 1 folded (step, microbatch) {late} only after MbDone: {seen[1]}"
    want = [(s, k) for s in range(steps) for k in range(m)]
    assert seen[1] == [(s, k, where) for s, k in want], seen[1]
    assert seen[0] == [(s, k, "segment") for s, k in want], seen[0]
    for rank, per_step in enumerate(results):
        for s, grads in enumerate(per_step):
            for n, g in grads.items():
                assert torch.equal(g, expected[s][1][n]), f"rank {rank} step {s}: {n}"
