"""Small models exercising what the pipeline must support (shared by the MPI test scripts)."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class Chain(nn.Module):
    """A ModuleList of blocks and a head."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class TiedLM(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab: int = 11, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


class Reuse(nn.Module):
    """A submodule called twice, on another rank than its caller."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = Block(d)
        self.shared = Block(d)
        self.b = Block(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.a(x))
        h = self.shared(self.b(h)) + h
        return self.out(h)


class Branch(nn.Module):
    """Data-dependent control flow: the branch taken differs between microbatches."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pre = Block(d)
        self.left = Block(d)
        self.right = nn.Sequential(Block(d), Block(d))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        if x[0, 0] > 0:  # decided per microbatch by its first sample
            h = self.left(h)
        else:
            h = self.right(h)
        return self.out(h)


@dataclasses.dataclass
class Packet:
    main: torch.Tensor
    extra: dict


class Fancy(nn.Module):
    """kwargs, non-tensor args and outputs, nested dataclass/dict outputs, a tensor that does
    not require grad, an output the loss does not use, frozen parameters."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.enc = Encoder(d)
        self.frozen = nn.Linear(d, d)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.dec = Decoder(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        pkt = self.enc(x, mask=mask, scale=scale, tag="hello")
        h = self.frozen(pkt.main)
        return self.dec(h, extra=pkt.extra)


class Encoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.aux = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float, tag: str) -> Packet:
        assert tag == "hello" and not mask.requires_grad
        h = self.lin(x) * mask * scale
        unused = self.aux(x)  # returned, never used by the loss
        return Packet(main=h, extra={"skip": x * 2.0, "unused": unused, "note": tag, "n": 3})


class Decoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1)

    def forward(self, h: torch.Tensor, extra: dict) -> torch.Tensor:
        assert extra["note"] == "hello" and extra["n"] == 3
        return self.lin(torch.relu(h) + extra["skip"])


class _DeviceSleep(torch.autograd.Function):
    """Identity whose forward and backward 'run on the device' (smp_pipeline.device_work)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        from smp_pipeline import device_work

        with device_work():
            time.sleep(0.002)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        from smp_pipeline import device_work

        with device_work():
            time.sleep(0.004)
        return g


class DeviceBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeviceSleep.apply(super().forward(x))


class DeviceChain(Chain):
    """Chain whose blocks release the execution token during simulated device work."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__(d, n)
        self.blocks = nn.ModuleList([DeviceBlock(d) for _ in range(n)])


class _CountBackward(torch.autograd.Function):
    """Identity that counts how often its backward runs (in ``Diamond.backward_runs``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        Diamond.backward_runs += 1
        return g


class Diamond(nn.Module):
    """A residual path around a remote child: ``h + mid(norm(h))`` with ``mid`` elsewhere.

    Local graph below ``h`` gets gradient both through the residual and through the remote
    call; joined backward must differentiate it once per microbatch, segments twice.
    """

    backward_runs = 0

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mid = Block(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _CountBackward.apply(torch.tanh(self.inp(x)))
        return self.head(h + self.mid(self.norm(h)))


def seq_model(d: int = 8) -> nn.Sequential:
    """A flat Sequential: runs of children on one rank travel as one request."""
    return nn.Sequential(*[Block(d) for _ in range(5)], nn.Linear(d, 1))


def nested_seq_model(d: int = 8, n: int = 4) -> nn.Sequential:
    """A Sequential of Sequential blocks and a head: a placement that cuts inside a block
    gives a run crossing the nested container's boundary (fast_mode flattens it)."""
    blocks = [nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(n)]
    return nn.Sequential(*blocks, nn.Linear(d, 1))


def halve_output(_module: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
    """A forward hook that changes the output (a skipped call of its module would show)."""
    return out * 0.5


def hooked_nested_seq_model(d: int = 8, n: int = 4) -> nn.Sequential:
    """:func:`nested_seq_model` with a forward hook on block 1, so it is not flattened."""
    net = nested_seq_model(d, n)
    net[1].register_forward_hook(halve_output)
    return net


def mse_step(model: nn.Module, backward):
    def step(x, y):
        out = model(x)
        loss = F.mse_loss(out, y)
        backward(loss)
        return loss

    return step
