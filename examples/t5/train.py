"""A T5-style encoder-decoder with tied embeddings, trained to undo character corruption.

    mpiexec -n 2 python examples/t5/train.py --pp 2 --microbatches 2 --steps 40

The encoder reads a window of the bundled text in which 15% of the characters were replaced
by a mask symbol; the decoder (teacher-forced) writes the original window. One embedding
table is shared by the encoder input, the decoder input and the output head, so the pipeline
partitioner must keep those three modules on one stage — which it does on its own.
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


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        src = x if memory is None else memory
        k, v = self.kv(src).split(c, dim=2)
        q = self.q(x)
        q, k, v = (z.reshape(b, -1, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and memory is None)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wi = nn.Linear(dim, 4 * dim, bias=False)
        self.wo = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.relu(self.wi(x)))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal=False)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = Attention(dim, heads, causal=True)
        self.cross_attn = Attention(dim, heads, causal=False)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.ln1(x))
        x = x + self.cross_attn(self.ln2(x), memory)
        return x + self.ff(self.ln3(x))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if memory is None else block(x, memory)
        return self.final_norm(x)


class TinyT5(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.encoder = Stack([EncoderBlock(dim, heads) for _ in range(layers)], dim)
        self.decoder = Stack([DecoderBlock(dim, heads) for _ in range(layers)], dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.shared.weight  # tied, as in T5
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shared(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.embed(src))
        return self.lm_head(self.decoder(self.embed(tgt_in), memory))


def corrupt(x: torch.Tensor, step: int, mask_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50_000 + step)
    noise = torch.rand(x.shape, generator=g) < 0.15
    return torch.where(noise, torch.full_like(x, mask_id), x)


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description="T5-style encoder-decoder with smp")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dim", type=int, default=48)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    smp.init(
        {
            "pipeline_parallel_degree": args.pp,
            "tensor_parallel_degree": args.tp,
            "microbatches": args.microbatches,
        }
    )
    corpus = common.CharCorpus()
    mask_id, bos_id = corpus.vocab_size, corpus.vocab_size + 1
    torch.manual_seed(0)
    with smp.tensor_parallelism(enabled=args.tp > 1):
        net = TinyT5(corpus.vocab_size + 2, args.dim, 4, args.layers, args.seq)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=2e-3))

    @smp.step
    def train_step(src: torch.Tensor, tgt_in: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        model.backward(loss)
        return loss

    bar = common.progress(args.steps, args.progress)
    loss = first = 0.0
    for step in range(args.steps):
        tgt, _ = corpus.batch(step, args.batch, args.seq)
        src = corrupt(tgt, step, mask_id)
        tgt_in = torch.cat([torch.full((tgt.shape[0], 1), bos_id), tgt[:, :-1]], dim=1)
        opt.zero_grad()
        parts = [common.local_part(t) for t in (src, tgt_in, tgt)]
        loss = common.global_mean(float(train_step(*parts).reduce_mean()))
        opt.step()
        first = first or loss
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)
    bar.close()
    if smp.rank() == 0:
        print(f"t5: {args.steps} steps on {smp.size()} processes, loss {first:.3f} -> {loss:.3f}")
    return loss


if __name__ == "__main__":
    main()
