"""Train a small Llama on long sequences with context parallelism: each rank keeps 1/cp of every sequence.

    mpiexec -n 2 python examples/long_context/train.py --cp 2 --seq 256 --steps 30

The model is transformers' ``LlamaForCausalLM`` built from a config (no download), reading
the bundled public-domain text character by character. Every rank of a context-parallel
group receives the same full sequences and calls ``model(input_ids=x, labels=x).loss`` as one
process would; with ``context_parallel_degree`` = ``--cp`` smp keeps 1/cp of each sequence
per rank (activations split through the whole model), lets attention see the other ranks'
tokens (``--attention``: ring attention, k/v blocks passed round the group; or one
all-to-all over heads; "auto" takes the all-to-all where cp divides the heads) and returns
the full-sequence loss on every rank. The
ranks beyond ``--cp`` are data parallel (``--batch`` sequences in the global batch).

Rank 0 prints the loss of every step, then ``loss fell from X to Y``; with ``--memory``
(the default) each rank's bytes saved for backward in one forward (activations: parameters
excluded) against one process on the same sequences.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import common  # noqa: E402
import smp_torch as smp  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context_parallel_degree")
    p.add_argument("--attention", default="auto", choices=["auto", "ring", "all_to_all"],
                   help="context_parallel_attention: ring attention, one all-to-all over heads "
                        "(cp must divide the heads), or auto (all-to-all where the heads divide)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (a multiple of 2 * cp)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=1, help="global batch (sequences), split over dp")
    p.add_argument("--dim", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the saved-activation comparison at the end")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    smp.init({"context_parallel_degree": args.cp,
              **({"context_parallel_attention": args.attention} if args.cp > 1 else {})})
    corpus = common.CharCorpus()
    if args.seq >= len(corpus.data):
        raise SystemExit(f"--seq {args.seq}: the bundled text has {len(corpus.data)} characters")
    torch.manual_seed(args.seed)
    net = LlamaForCausalLM(LlamaConfig(
        vocab_size=corpus.vocab_size, hidden_size=args.dim, intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    ))  # fmt: skip
    one_process = copy.deepcopy(net) if args.memory else None  # (for the comparison at the end)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @smp.step
    def train_step(x: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=x, labels=x)  # the full sequences, as with one process
        model.backward(out.loss)
        return out.loss

    losses: list[float] = []
    meter = common.Throughput()
    tok_s = 0.0
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, _ = corpus.batch(step, args.batch, args.seq)  # (labels=x: the model shifts them)
        optimizer.zero_grad()
        out = train_step(common.local_part(x))
        optimizer.step()
        loss = common.global_mean(float(out.reduce_mean()))  # every cp rank: the full-sequence loss
        losses.append(loss)
        tok_s = meter.tick(args.batch * args.seq)
        if smp.rank() == 0:
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    elapsed = time.perf_counter() - t0

    memory: list[tuple[int, int]] = []
    if one_process is not None:
        # One forward on this rank's sequences: the bytes autograd keeps for backward here
        # (1/cp of each sequence) and in one process holding the whole sequences.
        x = common.local_part(corpus.batch(0, args.batch, args.seq)[0])
        mine = smp.saved_activation_bytes(lambda: model(input_ids=x, labels=x).loss, model.parameters())
        one = smp.saved_activation_bytes(lambda: one_process(input_ids=x, labels=x).loss, one_process.parameters())
        memory = smp.allgather((mine, one), smp.WORLD)
    if smp.rank() == 0:
        fell = "fell" if losses[-1] < losses[0] else "did not fall"
        print(
            f"long_context: {args.steps} steps on {smp.size()} processes (cp={smp.cp_size()} "
            f"dp={smp.dp_size()}, attention {args.attention}), {args.seq} tokens per sequence, {args.seq // args.cp} per rank; "
            f"{tok_s:,.0f} tokens/s; loss {fell} from {losses[0]:.4f} to {losses[-1]:.4f}",
            flush=True,
        )
        for r, (mine, one) in enumerate(memory):
            print(f"  rank {r}: saved for backward {mine / 2**20:.2f} MiB, one process on the same "
                  f"sequences {one / 2**20:.2f} MiB ({mine / one:.3f}x)", flush=True)
    return {"losses": losses, "tokens_per_s": tok_s, "seconds": elapsed, "saved": memory}


if __name__ == "__main__":
    main()
