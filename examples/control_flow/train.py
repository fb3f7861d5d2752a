"""A model with data-dependent ``if/else`` and a module used several times, pipelined.

    mpiexec -n 2 python examples/control_flow/train.py --pp 2 --check

``forward`` picks one of two branches from the batch itself, applies one shared ``refine``
block three times (module reuse: one set of weights, three calls), and sometimes skips the
head's extra layer. None of this is expressible as an ``nn.Sequential``; the module-server
pipeline simply serves whichever module is called. With ``--check`` every rank also trains the
plain model in one process on the global batch and asserts the losses and weights match.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import smp_torch as smp  # noqa: E402


class Branchy(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(16, dim)
        self.wide = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.narrow = nn.Linear(dim, dim)
        self.refine = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh())
        self.extra = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        if h.mean() > 0.25:  # data-dependent branch: differs between steps and ranks
            h = h + self.wide(h)
        else:
            h = h + self.narrow(h)
        for _ in range(3):  # one module, three calls
            h = h + self.refine(h)
        if x[:, 0].sum() > 0:
            h = self.extra(h)
        return self.head(h)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(90_000 + step)
    x = torch.randn(size, 16, generator=g) + (0.5 if step % 3 == 0 else -0.2)
    y = (x[:, :4].argmax(dim=1)).long()
    return x, y


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description="control flow and module reuse with smp")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--check", action="store_true", help="compare with one process")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": args.pp, "microbatches": args.microbatches})
    torch.manual_seed(0)
    net = Branchy()
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.9)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    loss = first = 0.0
    for step in range(args.steps):
        x, y = batch(step, args.batch)
        opt.zero_grad()
        loss = common.global_mean(float(train_step(common.local_part(x), common.local_part(y)).reduce_mean()))
        opt.step()
        first = first or loss
        if args.check:
            # One process on the global batch, split into the same microbatches: control flow
            # depends on the (micro)batch, so the reference sees exactly what the ranks saw.
            ref_opt.zero_grad()
            chunks = args.microbatches * smp.dp_size()
            ref_losses = []
            for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
                ref_loss = F.cross_entropy(reference(xc), yc) / chunks
                ref_loss.backward()
                ref_losses.append(ref_loss.item() * chunks)
            ref_opt.step()
            want = sum(ref_losses) / len(ref_losses)
            assert abs(want - loss) <= 1e-5 * abs(want) + 1e-6, (step, want, loss)
            full = model.state_dict()
            for k, v in reference.state_dict().items():
                torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)
    if smp.rank() == 0:
        checked = " (equal to one process at every step)" if args.check else ""
        print(f"control_flow: {args.steps} steps on {smp.size()} processes, loss {first:.3f} -> {loss:.3f}{checked}")
    return loss


if __name__ == "__main__":
    main()
