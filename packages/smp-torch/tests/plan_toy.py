"""A small model for the planner's tests and CLI: embedding, blocks marked for tensor
parallelism, a head; ``sample_batch`` and ``step_fn`` as the CLI looks them up."""

from __future__ import annotations

import smp_tp
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, LAYERS = 50, 16, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        with smp_tp.tensor_parallelism():
            self.fc = nn.Linear(DIM, 4 * DIM)
            self.proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))


def model_fn() -> nn.Module:
    torch.manual_seed(0)
    return Toy()


def sample_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (8, SEQ), generator=g), torch.randint(0, VOCAB, (8, SEQ), generator=g)


def step_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))
