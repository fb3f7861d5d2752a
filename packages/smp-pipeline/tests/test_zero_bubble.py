"""``schedule="zero_bubble"`` (smp_pipeline.zerobubble): backwards split into input-grad now and
weight-grad tasks in idle time, gradients bitwise those of ``"interleaved"``.

Single-process checks of the pieces (which layers are split, the fold waiting for W tasks,
a backward paused inside the engine, a pp=1 runtime), then one ``mpiexec`` job per pipeline
degree running every case of ``zb_cases.py`` against dynamic mode, bitwise.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from no_peers import NoPeers
from smp_pipeline import PipelineConfigError, PipelineRuntime, Scheduler, zerobubble
from smp_pipeline.accumulation import GradAccumulator
from smp_pipeline.wsplit import WeightGradQueue, split_modules
from smp_pipeline.zerobubble import WeightGradWork, modules_to_split
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


class _Tied(nn.Module):
    """An embedding tied to an output head (both splittable) and a Linear whose weight a
    parameter-holding module uses functionally (not splittable)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight
        self.lin = nn.Linear(4, 4)
        self.user = nn.Module()
        self.user.w = self.lin.weight
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.other = nn.Linear(4, 4)


def test_tied_pairs_of_split_layers_stay_split_a_weight_shared_with_other_ops_does_not() -> None:
    model = _Tied()
    chosen = [path for path, _ in modules_to_split(model, model.named_modules())]
    assert chosen == ["embed", "head", "other"]


class _Functional(nn.Module):
    """A layer the split does not know: F.linear on its own parameter (as smp-tp's
    DistributedTransformerLayer, GPT-2's tensor-parallel mapping, does)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


def test_a_stage_with_nothing_to_split_is_warned_about() -> None:
    grads = GradAccumulator(lambda: 0)
    fn, frozen = _Functional(), nn.Linear(3, 3).requires_grad_(False)
    model = nn.Sequential(fn, frozen)
    work = WeightGradWork(3, grads, lambda: 0, max_microbatches=4)
    with pytest.warns(RuntimeWarning, match=r"splits nothing on pp rank 3: .* held by _Functional;"):
        work.set_modules(model, [("0", fn), ("1", frozen)])
    assert work.modules == []
    # a stage owning only frozen parameters, or one splittable layer, is not warned about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WeightGradWork(0, grads, lambda: 0, 4).set_modules(model, [("1", frozen)])
        lin = nn.Linear(3, 3)
        WeightGradWork(0, grads, lambda: 0, 4).set_modules(nn.Sequential(fn, lin), [("0", fn), ("1", lin)])


def test_a_layer_with_a_tensor_hook_on_its_weight_stays_unsplit() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    grads = GradAccumulator(lambda: 0)
    grads.track([*a.parameters(), *b.parameters()])  # (the accumulator's own hooks)
    work = WeightGradWork(0, grads, lambda: 0, max_microbatches=4)
    work.set_modules(nn.Sequential(a, b), [("0", a), ("1", b)])
    assert [path for path, _ in work.modules] == ["0", "1"]
    handle = b.weight.register_hook(lambda g: g * 2)
    assert [path for path, _ in work.modules] == ["0"]
    handle.remove()
    assert [path for path, _ in work.modules] == ["0", "1"]


def test_schedule_and_runtime_arguments() -> None:
    s = Scheduler("zero_bubble", 4, 2)
    assert s.kind == "interleaved"  # tasks start as interleaved's do
    with pytest.raises(PipelineConfigError, match="zero_bubble"):
        Scheduler("zero-bubble", 4, 2)
    with pytest.raises(PipelineConfigError, match="deterministic_accumulation"):
        PipelineRuntime(nn.Linear(2, 2), NoPeers(), 0, 1, schedule="zero_bubble",
                        deterministic_accumulation=False)  # fmt: skip
    model = nn.Linear(2, 1)
    rt = PipelineRuntime(model, NoPeers(), 0, 1, assignment={})

    def step(x):
        rt.backward(model(x).sum())

    with pytest.raises(PipelineConfigError, match="when the runtime is built"):
        rt.run_step(step, (torch.ones(2, 2),), num_microbatches=2, schedule="zero_bubble")
    rt.close()


def test_a_fold_waits_for_its_microbatchs_weight_grads() -> None:
    """Microbatch 0 complete while its W task is queued: nothing reaches ``.grad`` until it
    runs; then the buffer (W's contribution) is folded."""
    lin = nn.Linear(3, 2)
    mb = [0]
    grads = GradAccumulator(lambda: mb[0])
    grads.track(lin.parameters())
    work = WeightGradWork(0, grads, lambda: mb[0], max_microbatches=4)
    work.set_modules(lin, [("", lin)])
    grads.begin(1)
    with work.step():
        lin(torch.ones(4, 3)).sum().backward()
    assert len(work.queue) == 1 and lin.weight.grad is None
    grads.complete(1, 0)
    assert lin.weight.grad is None  # held: its W task has not run
    work.run_one("idle")
    assert torch.equal(lin.weight.grad, torch.full((2, 3), 4.0))
    assert work.stats.idle == 1 and not work.pending()
    grads.end()


def test_a_linear_w_task_computes_into_a_folded_gradient_never_into_grad() -> None:
    """W outputs reuse gradients already folded (``WeightGradQueue.recycle``: a fresh output
    was page-faulted anew by every task). Microbatch 0's W gradient becomes ``.grad`` and is
    never reused; microbatch 1's, added into ``.grad``, is microbatch 2's output; the result
    is bitwise a plain backward's, and no spare outlives the step."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 6)
    plain = copy.deepcopy(lin)
    xs = [torch.randn(5, 8) for _ in range(3)]
    for x in xs:
        plain(x).pow(2).sum().backward()
    mb = [0]
    grads = GradAccumulator(lambda: mb[0])
    grads.track(lin.parameters())
    work = WeightGradWork(0, grads, lambda: mb[0], max_microbatches=4)
    work.set_modules(lin, [("", lin)])
    spares = work.queue._spares
    grads.begin(1)
    with work.step():
        storages = []
        for k, x in enumerate(xs):
            mb[0] = k
            lin(x).pow(2).sum().backward()
            grads.complete(1, k)
            work.run_one("idle")
            kept = spares.get(id(lin.weight))
            storages.append([] if kept is None else [kept.data_ptr()])
            assert lin.weight.grad is not None
            assert lin.weight.grad.data_ptr() not in storages[-1]  # .grad is never a spare
        grad_storage = lin.weight.grad.data_ptr()
    assert storages[0] == []  # microbatch 0's output became .grad
    assert len(storages[1]) == 1 and storages[2] == storages[1]  # 1's output was 2's
    assert spares == {}
    grads.end()
    assert lin.weight.grad.data_ptr() == grad_storage
    assert torch.equal(lin.weight.grad, plain.weight.grad)
    assert torch.equal(lin.bias.grad, plain.bias.grad)


def test_only_whole_cpu_gradients_of_the_parameters_shape_are_kept_for_reuse() -> None:
    q = WeightGradQueue()
    p = nn.Parameter(torch.zeros(2, 3))
    q.recycle(p, torch.zeros(2, 3, device="meta"))  # not the CPU: another stream may read it
    q.recycle(p, torch.zeros(3, 2).t())  # not contiguous
    q.recycle(p, torch.zeros(3, 3))  # another shape
    assert q.spare(p, torch.zeros(1, device="meta")) is None
    assert q.spare(p, torch.zeros(1)) is None
    kept = torch.zeros(2, 3)
    q.recycle(p, kept)
    q.recycle(p, torch.zeros(2, 3))  # one per parameter: the first stays
    assert q.spare(p, torch.zeros(1, dtype=torch.float64)) is None  # (dtype differs: dropped)
    q.recycle(p, kept)
    assert q.spare(p, torch.zeros(1)) is kept
    q.recycle(p, kept)
    q.drop_spares()
    assert q.spare(p, torch.zeros(1)) is None


def test_a_contribution_outside_a_step_is_stored_as_accumulate_grad_would() -> None:
    """A W task's gradient that goes straight into an empty ``.grad`` (no step open, or a
    late microbatch) is laid out like the parameter, not kept as a view of another tensor."""
    lin = nn.Linear(3, 2)
    grads = GradAccumulator(lambda: 0)
    grads.track(lin.parameters())
    g = torch.arange(6.0).reshape(3, 2).t()  # a transposed view: other strides, a _base
    grads.add_contribution(lin.weight, g, 0)
    stored = lin.weight.grad
    assert stored is not None and torch.equal(stored, g)
    assert stored._base is None and stored.stride() == lin.weight.stride()
    grads.add_contribution(lin.weight, g, 0)  # into the existing .grad: summed
    assert torch.equal(lin.weight.grad, 2 * g)


@pytest.mark.parametrize(("idle", "rests"), [(False, True), (True, True), (False, False)])
def test_a_rank_that_finds_no_idle_time_rests_from_splitting(idle: bool, rests: bool) -> None:
    """A step whose W tasks all ran at its end (none in idle time: a bottleneck stage) makes
    the rank split nothing for ``REST_STEPS`` steps, then try again; W tasks run in idle time
    keep it splitting. The gradients are the same bits either way. ``rests=False`` (a
    tensor-parallel peer, which must split what its peers split) keeps splitting."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    plain = copy.deepcopy(lin)
    grads = GradAccumulator(lambda: 0)
    grads.track(lin.parameters())
    work = WeightGradWork(0, grads, lambda: 0, max_microbatches=4, rests=rests)
    work.set_modules(lin, [("", lin)])
    queued = []
    steps = zerobubble.REST_STEPS + 2
    for step in range(1, steps + 1):
        x = torch.randn(4, 3)
        grads.begin(step)
        with work.step():
            lin(x).pow(2).sum().backward()
            queued.append(len(work.queue))
            grads.complete(step, 0)
            if idle and work.pending():
                work.run_one("idle")
            work.drain()
        grads.end()
        plain(x).pow(2).sum().backward()
    rested = 0 if idle or not rests else zerobubble.REST_STEPS
    assert queued == [1] + [0] * rested + [1] * (steps - 1 - rested), queued
    assert work.stats.rested_steps == rested
    assert torch.equal(lin.weight.grad, plain.weight.grad)
    assert torch.equal(lin.bias.grad, plain.bias.grad)


def test_a_paused_backward_keeps_its_group() -> None:
    """A tied weight used twice by backward A, which runs backward B (same weight) in the
    middle, as a joined pipeline backward pauses inside the engine while another
    microbatch's runs: the W tasks interleave (A, B, A), yet each backward's contributions
    are summed apart and the result is bitwise the plain one."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6, bias=False)
    xa, xb = torch.randn(5, 6), torch.randn(3, 6)

    def run(split: bool) -> torch.Tensor:
        lin.weight.grad = None
        q = WeightGradQueue()
        both = _backward_pausing_for_another(lin, xa, xb)  # A's two first uses' W after B's

        if not split:
            both()
            return lin.weight.grad.clone()
        with split_modules([("lin", lin)], q):
            both()
        groups = [t.group for t in q.tasks]
        assert groups[0] != groups[1] and groups[0] == groups[-1], groups  # A, B, A, A
        q.run()
        return lin.weight.grad.clone()

    assert torch.equal(run(True), run(False))


def _backward_pausing_for_another(
    lin: nn.Linear, xa: torch.Tensor, xb: torch.Tensor, in_pause: Callable[[], None] = lambda: None
) -> Callable[[], None]:
    """Backward A of three uses of ``lin`` (on ``xa``) that runs, between its uses, backward B
    of ``lin`` on ``xb`` and then ``in_pause`` (as a joined pipeline backward pauses inside the
    engine while another microbatch's backward and the rank's idle work run)."""

    class RunB(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):  # noqa: ANN001, ANN205
            return h.clone()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            with torch.enable_grad():
                torch.tanh(lin(xb)).pow(2).sum().backward()
            in_pause()
            return g

    def both() -> None:
        h = lin(torch.tanh(lin(xa)))
        torch.tanh(lin(RunB.apply(torch.tanh(h)))).pow(2).sum().backward()

    return both


def test_w_tasks_run_while_their_backward_is_paused_fold_at_its_end() -> None:
    """As above, but the W tasks queued so far run *inside* the pause (a zero-bubble rank's
    idle time while its joined backward waits for another rank): backward A's first
    contribution has run, its later ones are still to be queued, so A's sum must wait for
    A's end (T5's shared embedding at pp=2 differed in the last bit before it did)."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6, bias=False)
    xa, xb = torch.randn(5, 6), torch.randn(3, 6)
    q = WeightGradQueue()
    ran_in_pause: list[int] = []
    # In the pause: A's first W task and all of B's run.
    both = _backward_pausing_for_another(lin, xa, xb, lambda: ran_in_pause.append(q.run()))

    lin.weight.grad = None
    both()
    plain = lin.weight.grad.clone()
    lin.weight.grad, ran_in_pause[:] = None, []
    with split_modules([("lin", lin)], q):
        both()
    assert ran_in_pause == [2] and len(q) == 2, (ran_in_pause, len(q))
    q.run()
    assert torch.equal(lin.weight.grad, plain)
    assert not q.queued_by_tag and not q._pending and not q._remaining


def test_pp1_runtime_matches_interleaved_and_draws_w_tasks(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    base = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    grads = []
    for schedule in ("zero_bubble", "interleaved"):
        model = copy.deepcopy(base)
        rt = PipelineRuntime(model, NoPeers(), 0, 1, assignment={}, schedule=schedule,
                             timeline=True)  # fmt: skip

        def step(x, y, model=model, rt=rt):  # noqa: ANN001, ANN202
            loss = F.mse_loss(model(x), y)
            rt.backward(loss)
            return loss

        rt.run_step(step, (x, y), num_microbatches=4)
        grads.append([p.grad for p in model.parameters()])
        if schedule == "zero_bubble":
            st = rt.weight_grad_stats
            assert st is not None and st.total == 4 * 3 == sum(st.deferred_ops.values())
            events = rt.write_timeline(png_path=str(tmp_path / "zb.png"))
            assert events is not None
            assert sum(e[3] == "weight_grad" for e in events) == st.total
            assert (tmp_path / "zb.png").read_bytes()[:4] == b"\x89PNG"
        rt.close()
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_zero_bubble_is_bitwise_interleaved(pp: int) -> None:
    """Under mpiexec: an MLP (LayerNorm + Linear blocks), with activation checkpointing, a
    tied embedding/head, the Branch model (data-dependent control flow), non-tensor stage
    inputs, a Linear whose weight another module uses (left unsplit): bitwise equal to
    ``"interleaved"``, W tasks run (some in idle time) — see zb_cases.py."""
    pytest.importorskip("mpi4py")
    from smp_comm.testing import run_mpi

    out = run_mpi([os.path.join(HERE, "zb_cases.py")], pp, timeout=240,
                  env={"OMP_NUM_THREADS": "1"}, fast_exit=True)  # fmt: skip
    assert f"SUITE-OK zero_bubble pp{pp}" in out, out
