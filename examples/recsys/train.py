"""A recommendation model whose embedding tables are split by tensor parallelism across
data-parallel ranks.

    mpiexec -n 2 python examples/recsys/train.py --tp 2 --steps 60

Two large tables (users and items) dominate the parameters, the rest is a small MLP. Created
under ``smp.tensor_parallelism()``, each table becomes an ``smp.nn.DistributedEmbedding``: every
rank stores a slice of the embedding dimension, keeps feeding its *own* samples (TP across DP,
paper §5), and the layer exchanges indices and looked-up slices with its peers. Clicks are
synthetic: a hidden user-item affinity decides them, so the model has something to learn.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import smp_torch as smp  # noqa: E402


class Recommender(nn.Module):
    def __init__(self, users: int, items: int, dim: int, tensor_parallel: bool) -> None:
        super().__init__()
        with smp.tensor_parallelism(enabled=tensor_parallel):
            self.user_emb = nn.Embedding(users, dim)
            self.item_emb = nn.Embedding(items, dim)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        u, i = self.user_emb(user), self.item_emb(item)
        return self.mlp(torch.cat([u, i, u * i], dim=-1)).squeeze(-1)


def synthetic_batch(step: int, batch: int, users: int, items: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(70_000 + step)
    user = torch.randint(0, users, (batch,), generator=g)
    item = torch.randint(0, items, (batch,), generator=g)
    # The hidden affinity: users and items each belong to one of 8 tastes.
    click = ((user % 8) == (item % 8)).float()
    return user, item, click


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description="recommendation model with TP embeddings")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--users", type=int, default=20_000)
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": args.tp, "pipeline_parallel_degree": args.pp})
    torch.manual_seed(0)
    model = smp.DistributedModel(Recommender(args.users, args.items, args.dim, args.tp > 1))
    # Sparse tables with few touched rows per step: Adagrad-like adaptivity helps; Adam is fine.
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    local = sum(p.numel() for p in model.parameters())

    @smp.step
    def train_step(user: torch.Tensor, item: torch.Tensor, click: torch.Tensor) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(model(user, item), click)
        model.backward(loss)
        return loss

    bar = common.progress(args.steps, args.progress)
    loss = first = 0.0
    for step in range(args.steps):
        batch = synthetic_batch(step, args.batch, args.users, args.items)
        opt.zero_grad()
        loss = common.global_mean(float(train_step(*[common.local_part(t) for t in batch]).reduce_mean()))
        opt.step()
        first = first or loss
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)
    bar.close()
    if smp.rank() == 0:
        print(
            f"recsys: {args.steps} steps on {smp.size()} processes (tp={args.tp}); "
            f"{local:,} parameters on this rank; loss {first:.3f} -> {loss:.3f}"
        )
    return loss


if __name__ == "__main__":
    main()
