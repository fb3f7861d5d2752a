"""Train a small character-level GPT on the bundled public-domain text with smp.

    mpiexec -n 4 python examples/gpt/train.py --pp 2 --tp 2 --microbatches 4 --steps 60

Any layout works (``--pp``, ``--tp``; the rest of the ranks are data parallel). Rank 0 prints
the partition table, a progress bar with the loss and tokens/s, a short greedy sample at the
end, and writes to ``--out``: ``partition.txt``/``partition.svg`` (automatic partition),
``timeline.json`` (Chrome trace, open in chrome://tracing or Perfetto) and ``timeline.png``
(with ``--timeline``), ``metrics.json`` (per-step losses and the throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import smp_torch as smp  # noqa: E402
from model import build_gpt, lm_loss  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_degree")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--pipeline", default="interleaved", choices=["interleaved", "simple"])
    p.add_argument("--placement", default="cluster")
    p.add_argument("--prescaled", action="store_true", help="prescaled_batch (Megatron mode)")
    p.add_argument("--shard-optimizer", action="store_true", help="shard_optimizer_state")
    p.add_argument("--memory-weight", type=float, default=0.8, help="partitioner alpha")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/gpt", help="directory for the artefacts")
    p.add_argument("--timeline", action="store_true", help="record the pipeline timeline")
    p.add_argument("--progress", action="store_true", help="tqdm progress bar on rank 0")
    p.add_argument("--sample", type=int, default=0, help="greedy-sample this many characters")
    p.add_argument("--save", default=None, help="checkpoint directory (saved at the end)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    config = {
        "pipeline_parallel_degree": args.pp,
        "tensor_parallel_degree": args.tp,
        "microbatches": args.microbatches,
        "pipeline": args.pipeline,
        "placement_strategy": args.placement,
        "prescaled_batch": args.prescaled,
        "shard_optimizer_state": args.shard_optimizer,
        "memory_weight": args.memory_weight,
        "timeline": os.path.join(args.out, "timeline") if args.timeline and args.pp > 1 else None,
    }
    smp.init(config)
    corpus = common.CharCorpus()
    torch.manual_seed(args.seed)
    net = build_gpt(corpus.vocab_size, args.seq, args.dim, args.heads, args.layers, args.tp > 1)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def predict(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    bar = common.progress(args.steps, args.progress)
    meter = common.Throughput()
    losses: list[float] = []
    tokens_per_step = args.batch * args.seq
    tok_s = 0.0
    t0 = time.perf_counter()
    for step in range(args.steps):
        if args.timeline and args.pp > 1 and step == max(0, args.steps - 3):
            model.reset_timeline()  # draw only the last steps: readable, like Figure 5
        x, y = corpus.batch(step, args.batch, args.seq)
        optimizer.zero_grad()
        out = train_step(common.local_part(x), common.local_part(y))
        optimizer.step()
        loss = common.global_mean(float(out.reduce_mean()))
        losses.append(loss)
        tok_s = meter.tick(tokens_per_step)
        if step == 0 and smp.rank() == 0:
            table = model.partition_table()
            if table is not None:
                print(table, flush=True)
                with open(os.path.join(args.out, "partition.txt"), "w", encoding="utf-8") as f:
                    f.write(table + "\n")
                model.write_partition_svg(os.path.join(args.out, "partition.svg"))
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - t0

    if args.timeline and args.pp > 1:
        model.write_timeline()
    sample = ""
    if args.sample:
        # Greedy decoding through the same (pipelined, tensor-parallel) model: every rank feeds
        # the same prompt, so tensor-parallel peers see identical inputs.
        model.eval()
        ids = corpus.encode("It is a truth ")
        with torch.no_grad():
            for _ in range(args.sample):
                window = ids[-args.seq :].unsqueeze(0).repeat(args.microbatches, 1)
                logits = predict(window).concat()
                ids = torch.cat([ids, logits[0, -1].argmax().view(1)])
        sample = corpus.decode(ids)
        model.train()
    if args.save:
        smp.save_checkpoint(args.save, f"step{args.steps}", partial=True, user_content={"step": args.steps})
    metrics = {
        "config": config,
        "losses": losses,
        "tokens_per_s": tok_s,
        "seconds": elapsed,
        "world_size": smp.size(),
        "sample": sample,
    }
    if smp.rank() == 0:
        with open(os.path.join(args.out, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=1)
        print(
            f"trained {args.steps} steps on {smp.size()} processes "
            f"(pp={args.pp} tp={args.tp} dp={smp.rdp_size()}): loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f}, {tok_s:,.0f} tokens/s",
            flush=True,
        )
        if sample:
            print(f"sample: {sample!r}", flush=True)
    return metrics


if __name__ == "__main__":
    main()
