"""Sharded data parallelism: a GPT whose training state does not fit one rank's budget.

    mpiexec -n 4 python examples/sharded/train.py --sdp 4 --budget-mib 24

The character-level GPT of ``examples/gpt`` trained with ``sharded_data_parallel_degree``:
each rank keeps 1/sdp of every parameter, of its gradient and of its AdamW state (FSDP2 under
smp), gathering a block's parameters only while the block runs. The script states a
per-rank memory budget for the training state (parameters + gradients + optimizer state,
fp32: 16 bytes per parameter with AdamW), shows that plain data parallelism (every rank
holding everything) would exceed it, and after the first step measures what this rank holds
from the tensors themselves and checks it is within the budget. Gradients are clipped to
norm 1.0 over the shards (``sdp_gradient_clipping``). ``--bf16`` runs the step under bf16
autocast.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import smp_torch as smp  # noqa: E402
from gpt.model import build_gpt, lm_loss  # noqa: E402
from smp_torch import sharded  # noqa: E402


def held_mib(model: smp.DistributedModel, opt: smp.DistributedOptimizer) -> float:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards)."""
    total = 0
    for p in model.parameters():
        for t in [p, p.grad, *opt.optimizer.state.get(p, {}).values()]:
            if torch.is_tensor(t) and t.dim() > 0:
                local = sharded.local_tensor(t)
                total += local.numel() * local.element_size()
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdp", type=int, default=4, help="sharded data-parallel degree")
    ap.add_argument("--budget-mib", type=float, default=24.0, help="per-rank training-state budget")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    smp.init({
        "sharded_data_parallel_degree": args.sdp,
        # Each transformer block (about 12 * dim**2 elements) becomes its own shard unit.
        "sdp_param_persistence_threshold": 4 * args.dim * args.dim,
        "sdp_gradient_clipping": 1.0,
        "bf16": args.bf16,
    })  # fmt: skip
    corpus = common.CharCorpus()
    torch.manual_seed(0)
    net = build_gpt(corpus.vocab_size, args.seq, args.dim, 4, args.layers, tensor_parallel=False)
    n_params = sum(p.numel() for p in net.parameters())
    replicated_mib = 16 * n_params / 2**20  # fp32 parameter + gradient + AdamW's two moments
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(args.steps):
        x, y = corpus.batch(step, args.batch, args.seq)
        opt.zero_grad()
        loss = train_step(common.local_part(x), common.local_part(y)).reduce_mean()
        opt.step()
        losses.append(common.global_mean(float(loss)))
        if step == 0:
            mine = max(smp.allgather(held_mib(model, opt)))
            if smp.rank() == 0:
                units = model.engine.shard_plan.units
                print(
                    f"sharded: {n_params / 1e6:.2f} M parameters, {len(units)} shard units; "
                    f"training state per rank: plain data parallelism {replicated_mib:.1f} MiB, "
                    f"sdp={args.sdp} {mine:.1f} MiB (measured), budget {args.budget_mib:.1f} MiB",
                    flush=True,
                )
            if mine > args.budget_mib:
                raise SystemExit(f"over budget: {mine:.1f} MiB > {args.budget_mib} MiB per rank")
    if smp.rank() == 0:
        fits = "fits" if replicated_mib <= args.budget_mib else "would not fit"
        print(
            f"sharded: {args.steps} steps on {smp.size()} processes (sdp={args.sdp}), loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f}; within the budget (plain data parallelism {fits})",
            flush=True,
        )


if __name__ == "__main__":
    main()
