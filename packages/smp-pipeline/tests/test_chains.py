"""fast_mode's ModuleList chains (``smp_pipeline.chains``): the learning, hit and miss rules
on their own, and pipelines over loopback ranks that equal one thread bit for bit while the
blocks of a loop on another rank cost one request per microbatch instead of one per block."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import models
import pytest
import torch
from smp_pipeline import PipelineRuntime
from smp_pipeline.chains import ModuleListChains, chain_input, chain_links
from test_loopback import (  # noqa: F401 - one_torch_thread: the autouse fixture, here too
    Case,
    assert_workers_end,
    one_torch_thread,
    pipeline_steps,
    reference_steps,
    regression,
    run_ranks,
    values,
)
from torch import nn

pytestmark = pytest.mark.timeout(60)


class LoopNet(nn.Module):
    """A loop over a ModuleList in the model's own forward (the Hugging Face decoder shape:
    ``h = layer(h, mask)``), which can leave the chaining rule on purpose: ``skip`` leaves
    one block out, ``perturb`` gives one block a new tensor (equal values) as its input."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([models.Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)
        self.skip: int | None = None
        self.perturb: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i == self.skip:
                continue
            if i == self.perturb:
                h = h + 0.0
            h = block(h)
        return self.head(h)


class MaskedBlock(nn.Module):
    """A block with a second argument and a tuple output (GPT-2's block returns a tuple)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, ...]:
        out = torch.tanh(self.lin(h)) * mask * scale + h
        return (out, out.detach().sum())


class MaskedLoopNet(nn.Module):
    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([MaskedBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        mask = (x > 0).float()
        for block in self.blocks:
            h = block(h, mask, scale=0.5)[0]
        return self.head(h)


# ---------------------------------------------------------------------- the rules


def test_chain_input_is_the_tensor_or_the_first_item() -> None:
    t = torch.ones(2)
    assert chain_input(t) is t and chain_input((t, 3)) is t and chain_input([t]) is t
    assert chain_input({"h": t}) is None and chain_input(()) is None and chain_input((3, t)) is None


def test_links_join_consecutive_list_blocks_on_one_other_rank() -> None:
    net = LoopNet(n=5)
    assign = {n: 0 for n, _ in net.named_modules()}
    assign.update({"blocks.1": 1, "blocks.2": 1, "blocks.3": 1, "blocks.4": 2})
    local = {1: {"blocks.1", "blocks.2", "blocks.3"}, 2: {"blocks.4"}}
    links = chain_links(net, assign, 0, lambda r: {f"{p}{s}" for p in local[r] for s in ("", ".lin")})
    assert links == {"blocks.1": "blocks.2", "blocks.2": "blocks.3"}
    # On the owner itself there is nothing to chain; a block whose subtree is not all there
    # does not chain either (a chained request must never leave its rank).
    assert chain_links(net, assign, 1, lambda r: local[r]) == {}
    assert chain_links(net, assign, 0, lambda r: {"blocks.1", "blocks.3"}) == {}


def test_a_link_chains_once_seen_hits_by_the_rule_and_a_miss_turns_it_off() -> None:
    chains = ModuleListChains({"l.0": "l.1", "l.1": "l.2"})
    st = (True, [])
    x, mask = torch.ones(2), torch.zeros(2)
    o0, o1, o2 = (torch.full((2,), float(i)) for i in range(3))

    # Unchained: l.1 follows l.0 by the rule, then l.2 follows l.1: both links seen.
    assert chains.chain_after("l.0") == ()
    last = chains.after_request(None, "l.0", [o0], (x, mask), {"k": 1}, st)
    assert chains.take(last, "l.1", (o0, mask), {"k": 1}, st) == (False, None)
    last = chains.after_request(last, "l.1", [(o1, "extra")], (o0, mask), {"k": 1}, st)
    assert chains.take(last, "l.2", (o1, mask), {"k": 1}, st) == (False, None)
    assert chains.chain_after("l.0") == ()  # in force from the next step on
    chains.begin_step()
    assert chains.seen == {"l.0", "l.1"} and chains.chain_after("l.0") == ("l.1", "l.2")

    # Chained: l.1 and l.2 come from the request of l.0; another module between is no miss.
    last = chains.after_request(None, "l.0", [o0, o1, o2], (x, mask), {"k": 1}, st)
    assert chains.after_request(last, "head", [o0], (x,), {}, st) is last
    assert chains.take(last, "head", (x,), {}, st) == (False, None)
    hit, out = chains.take(last, "l.1", (o0, mask), {"k": 1}, st)
    assert hit and out is o1
    hit, out = chains.take(last, "l.2", (o1, mask), {"k": 1}, st)
    assert hit and out is o2 and chains.hits == 2

    # Misses: other arguments (an equal copy of a tensor is another tensor), another grad
    # mode, another block of the list. Each turns its link off for good.
    last = chains.after_request(None, "l.0", [o0, o1, o2], (x, mask), {"k": 1}, st)
    assert chains.take(last, "l.1", (o0, mask.clone()), {"k": 1}, st) == (False, None)
    last = chains.after_request(None, "l.1", [o1, o2], (o0, mask), {"k": 1}, st)
    assert chains.take(last, "l.2", (o1, mask), {"k": 1}, (False, [])) == (False, None)
    assert chains.misses == 2 and chains.chain_after("l.0") == ("l.1", "l.2")
    chains.begin_step()
    assert chains.off == {"l.0", "l.1"} and chains.chain_after("l.0") == ()
    assert chains.chain_after("l.1") == ()


def test_a_tensor_changed_in_place_since_the_chain_ran_is_a_miss() -> None:
    """The chained blocks ran on the tensors as they were: the loop scaling the output in
    place (``h.mul_(2)``), or editing a mask or a tensor nested in an argument, before the
    next call must not get their outputs."""
    st = (True, [])
    for change in ("output", "mask", "nested"):
        chains = ModuleListChains({"l.0": "l.1"})
        chains.seen.add("l.0")
        assert chains.chain_after("l.0") == ("l.1",)
        x, mask, cos = torch.ones(2), torch.zeros(2), torch.ones(3)
        o0, o1 = torch.full((2,), 1.0), torch.full((2,), 2.0)
        last = chains.after_request(None, "l.0", [o0, o1], (x, mask), {"pe": (cos,)}, st)
        {"output": o0, "mask": mask, "nested": cos}[change].mul_(2)
        assert chains.take(last, "l.1", (o0, mask), {"pe": (cos,)}, st) == (False, None), change
        chains.begin_step()
        assert chains.off == {"l.0"} and chains.misses == 1, change


# ---------------------------------------------------------------------- pipelines


def run_pipeline(case: Case, steps: int, configure: Callable[[nn.Module, int], None]) -> Any:
    """The case over loopback ranks; every step checked bitwise against one thread
    (``reference_steps``, configured the same way).
    Returns the runtimes and, per step, the requests pp rank 1 served in it."""
    torch.manual_seed(1234)
    base = case.build()
    copies = [copy.deepcopy(base) for _ in range(case.pp)]
    expected = reference_steps(copy.deepcopy(base), case, steps, configure)
    served: list[int] = []
    misses: list[int] = []  # the driver's misses so far, at each step's start

    def rank_main(comm: Any) -> Any:
        model = copies[comm.rank]

        def before(rt: PipelineRuntime, s: int) -> None:
            configure(model, s)
            if comm.rank == 1:
                served.append(rt.requests_served)
            chains = rt._dispatch.chains
            if comm.rank == 0 and chains is not None:
                misses.append(chains.misses)

        return pipeline_steps(comm, model, case, steps, before_step=before)

    results = values(run_ranks(case.pp, rank_main))
    runtimes = [rt for _, rt in results]
    assert_workers_end(runtimes)
    for rank, (per_step, _) in enumerate(results):
        for s, ((outs, grads), (losses, ref_grads)) in enumerate(zip(per_step, expected)):
            assert torch.equal(torch.stack(outs), losses), f"rank {rank} step {s}: losses"
            for n, g in grads.items():
                ref = ref_grads[n]
                if ref is None:  # a block the loop left out: no gradient (chained or not)
                    assert g is None, f"rank {rank} step {s}: {n} got a gradient"
                    continue
                assert g is not None, f"rank {rank} step {s}: {n} got no gradient"
                diff = (g - ref).abs().max().item()
                assert torch.equal(g, ref), f"rank {rank} step {s}: grad of {n} differs by {diff:.3g}"
    served.append(runtimes[1].requests_served)
    chains = runtimes[0]._dispatch.chains
    if chains is not None:
        misses.append(chains.misses)
    per_step = [[b - a for a, b in zip(v, v[1:])] for v in (served, misses)]
    return runtimes, per_step[0], per_step[1]


ON_RANK_1 = {"blocks.1": 1, "blocks.2": 1, "blocks.3": 1, "head": 1}


@pytest.mark.parametrize("build", [LoopNet, MaskedLoopNet], ids=["tensor-out", "tuple-out-kwargs"])
def test_a_loop_over_blocks_on_another_rank_is_one_request_per_microbatch(
    build: Callable[[], nn.Module],
) -> None:
    """The loop calls blocks 1-3 (pp rank 1) one by one; once the first step saw it follow
    the chaining rule, each microbatch's blocks 1-3 are one forward and one backward request
    (with the head: 4 per microbatch, against 8 unchained in the first step), bitwise equal
    to one thread."""
    case = Case(build, regression, ON_RANK_1, m=4)
    runtimes, served, misses = run_pipeline(case, 3, lambda model, s: None)
    chains = runtimes[0]._dispatch.chains
    assert chains is not None and misses == [0, 0, 0] and chains.hits >= 2 * 2 * case.m
    assert served == [8 * case.m, 4 * case.m, 4 * case.m], served


@pytest.mark.parametrize("leave", ["skip", "perturb"])
def test_a_loop_that_leaves_the_rule_misses_and_stays_exact(leave: str) -> None:
    """From step 2 on, the loop leaves block 2 out (``skip``) or gives it a new tensor
    (``perturb``): the chained outputs are not the ones it needs, so the call goes out as a
    request of its own (a miss), the unused chained work gets no gradient, and every step
    stays bitwise equal to one thread. The link is off from the next step on."""

    def configure(model: nn.Module, s: int) -> None:
        setattr(model, leave, 2 if s >= 2 else None)

    case = Case(LoopNet, regression, ON_RANK_1, m=4)
    runtimes, served, misses = run_pipeline(case, 4, configure)
    chains = runtimes[0]._dispatch.chains
    assert chains is not None and chains.off == {"blocks.1"}, chains.off
    # Step 3: every microbatch chained blocks 1-3 and missed (what a step sees takes effect
    # at the next); step 4: the link from block 1 is off, none misses.
    assert misses == [0, 0, case.m, 0], misses
    # Requests pp rank 1 served per microbatch, forward and backward: unchained (8), then
    # chained with the head (4); step 3 as step 2 plus the one the miss sends; step 4
    # blocks 1 and 3 each a request (skip: 6), or block 1 alone and 2-3 chained (perturb: 6).
    assert served == [8 * case.m, 4 * case.m, 6 * case.m, 6 * case.m], served
