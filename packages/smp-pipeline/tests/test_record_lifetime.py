"""A finished microbatch leaves nothing alive: the cross-rank records a rank drops at
``MbDone`` and at the step's end must take their graphs with them.

The records hold tensors whose graphs hold a remote call's boundary node, the node holds the
call and the call its context (``parent``): a cycle through autograd's C++ graph, which
Python's collector does not see. Two such cycles leaked every step until 2 Dec (a Hugging
Face ViT's driver +10 MiB a step at pp = 2, tp = 2; T5's decoder stage +7 MiB): fast_mode's
last chained call on the context, and a served call's outputs computed through a call it
made in turn. Each test fails with its half of ``autograd._release`` removed.
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from test_chains import ON_RANK_1, LoopNet, run_pipeline
from test_loopback import (  # noqa: F401 - one_torch_thread: the autouse fixture, here too
    Case,
    one_torch_thread,
    pipeline_steps,
    regression,
    run_ranks,
    values,
)
from torch import nn

pytestmark = pytest.mark.timeout(60)


def graph_tensors_alive() -> int:
    """Tensors alive anywhere in the process that carry a graph (not leaves)."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on torch's deprecated module objects)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_chained_microbatches_leave_no_graph_alive() -> None:
    """The driver's loop chains blocks 1-3 (pp rank 1): its context's last chained call
    holds outputs of its own remote call."""
    before = graph_tensors_alive()
    case = Case(LoopNet, regression, ON_RANK_1, m=4)
    runtimes, _, _ = run_pipeline(case, 3, lambda model, s: None)
    chains = runtimes[0]._dispatch.chains
    assert chains is not None and chains.hits > 0  # the chains ran
    assert graph_tensors_alive() == before


class Outer(nn.Module):
    """Served on pp rank 1; its ``inner`` lives on pp rank 0, so its forward makes a call of
    its own and its output's graph runs through that call's boundary."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.inner(x)))


class NestedNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.outer = Outer(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.outer(self.pre(x)))


def test_a_served_call_that_calls_back_leaves_no_graph_alive() -> None:
    """Pp rank 1 serves ``outer``, which calls ``inner`` on pp rank 0: the served call's
    outputs hold the graph of the call it made."""
    case = Case(NestedNet, regression, {"outer": 1, "outer.lin": 1, "outer.inner": 0})
    before = graph_tensors_alive()
    torch.manual_seed(0)
    base = case.build()
    copies = [copy.deepcopy(base) for _ in range(case.pp)]

    def rank_main(comm: object) -> int:
        _, rt = pipeline_steps(comm, copies[comm.rank], case, 3)  # type: ignore[attr-defined]
        return rt.requests_served

    served = values(run_ranks(case.pp, rank_main))
    assert served[1] > 0 and served[0] > 0  # both ways: outer on 1, inner back on 0
    assert graph_tensors_alive() == before
