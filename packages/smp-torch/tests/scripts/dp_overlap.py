"""Usage: dp_overlap.py PP. The overlapped data-parallel reduction under data-dependent control
flow: a module is used a different number of times per microbatch, step and rank, so some
steps accumulate more gradients than the step before (its bucket left early and must be
reduced again), fewer, or none at all. After every step each gradient must equal one process
accumulating the same microbatches. Prints ``CASE-OK dp-overlap-pp<PP>`` on rank 0."""

from __future__ import annotations

import copy
import sys

import smp_torch as smp
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

M = 2  # microbatches
# uses[step][k]: how often microbatch k of the global batch (dp rank k // M) runs ``extra``.
USES = [[0, 0, 1, 0], [1, 1, 1, 2], [2, 0, 0, 1], [0, 0, 0, 0], [1, 2, 2, 1]]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, uses: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        for _ in range(int(uses.reshape(-1)[0])):
            h = torch.tanh(self.extra(h))
        return self.out(h)


def main() -> None:
    torch.set_num_threads(1)
    pp = int(sys.argv[1])
    config = {"pipeline_parallel_degree": pp, "microbatches": M, "timeout_s": 60}
    if pp > 1:
        config["auto_partition"] = False
    smp.init(config)
    torch.manual_seed(0)
    net = Branchy()
    ref = copy.deepcopy(net)
    if pp > 1:
        smp.set_partition(net.extra, 1)
        smp.set_partition(net.out, 1)
    model = smp.DistributedModel(net)
    dp, r = smp.dp_size(), smp.dp_rank()
    assert dp * M == len(USES[0]), (dp, M)

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor, uses: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x, uses), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    for step, uses in enumerate(USES):
        x, y = torch.randn(dp * M * 2, 8, generator=g), torch.randn(dp * M * 2, 1, generator=g)
        u = torch.tensor(uses)
        for p in model.parameters():
            p.grad = None
        train_step(x.chunk(dp)[r], y.chunk(dp)[r], u.chunk(dp)[r])
        ref.zero_grad(set_to_none=True)
        for k in range(dp * M):
            xs, ys = x.chunk(dp * M)[k], y.chunk(dp * M)[k]
            (F.mse_loss(ref(xs, u[k : k + 1]), ys) / (dp * M)).backward()
        want = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            q = want[name]
            if q.grad is None or p.grad is None:
                assert q.grad is None and p.grad is None, (step, name, smp.rank())
                continue
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {step} {name} rank {smp.rank()}"
            )
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-OK dp-overlap-pp{pp}", flush=True)


if __name__ == "__main__":
    main()
