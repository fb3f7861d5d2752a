"""Shared by the example scripts: the bundled text, data-parallel batch slicing, logging.

Every rank draws the same *global* batch from a generator seeded by the step number, then keeps
its own slice: the data-parallel rank's share (or, with ``prescaled_batch``, the reduced
data-parallel rank's share, tensor-parallel peers feeding the same samples). Training is
therefore identical to one process on the global batch, whatever the layout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import smp_torch as smp
import torch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "public_domain.txt")


class CharCorpus:
    """The bundled public-domain text as a tensor of character ids."""

    def __init__(self, path: str = DATA) -> None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.index.get(c, 0) for c in s], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: inputs and next-character targets."""
        g = torch.Generator().manual_seed(10_000 + step)
        starts = torch.randint(0, len(self.data) - seq - 1, (batch,), generator=g)
        x = torch.stack([self.data[s : s + seq] for s in starts])
        y = torch.stack([self.data[s + 1 : s + seq + 1] for s in starts])
        return x, y


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a global batch (see the module docstring)."""
    cfg = smp.state.state().config
    if cfg.prescaled_batch:
        return t.chunk(smp.rdp_size())[smp.rdp_rank()]
    return t.chunk(smp.dp_size())[smp.dp_rank()]


def global_mean(value: float) -> float:
    """Mean of a per-rank value over the data-parallel group (the global-batch loss)."""
    values = smp.allgather(float(value), smp.DP_GROUP)
    return sum(values) / len(values)


def progress(total: int, enabled: bool) -> Any:
    """A tqdm bar on rank 0 when asked for (and installed); a silent stand-in otherwise."""
    if enabled and smp.rank() == 0:
        try:
            from tqdm import tqdm

            return tqdm(total=total, unit="step", dynamic_ncols=True)
        except ImportError:
            pass
    return _Quiet()


class _Quiet:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


class Throughput:
    """Tokens (or samples) per second over the steps after the first (warm-up) one."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.count = 0

    def tick(self, n: int) -> float:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
            return 0.0
        self.count += n
        return self.count / max(now - self.start, 1e-9)


def batches(n: int) -> Iterator[int]:
    yield from range(n)
