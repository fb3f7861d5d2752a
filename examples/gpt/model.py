"""A small GPT (decoder-only transformer) in plain PyTorch.

Written for smp: tensor parallelism replaces the attention and MLP ``nn.Linear`` layers created
under ``smp.tensor_parallelism()``, and the pipeline partitioner places the embeddings, the
blocks and the (tied) output head wherever they balance best — no ``nn.Sequential`` needed.
"""

from __future__ import annotations

import contextlib

import smp_torch as smp
import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        with smp.tensor_parallelism() if TP_ENABLED[0] else contextlib.nullcontext():
            self.attn = CausalSelfAttention(dim, heads)
            self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# Set by build_gpt: whether the blocks' linear layers are marked for tensor parallelism.
TP_ENABLED = [False]


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        # An nn.Sequential rather than a ModuleList looped over in forward: when the pipeline
        # splits it, each stage's run of blocks is one request (smp-pipeline serves spans of
        # a Sequential), not one request per block.
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied input and output embeddings
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = self.blocks(x)
        return self.head(self.ln_f(x))


def _init_weights(m: nn.Module) -> None:
    # GPT-2's initialisation: small normal weights keep the first logits near uniform.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def build_gpt(vocab: int, seq: int, dim: int, heads: int, layers: int, tensor_parallel: bool) -> GPT:
    TP_ENABLED[0] = tensor_parallel
    try:
        return GPT(vocab, seq, dim, heads, layers)
    finally:
        TP_ENABLED[0] = False


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
