"""Data-parallel gradient reduction, bucketed and overlapped with backward.

Each parameter is averaged over its own group: tensor-parallel shards over the reduced
data-parallel group (the ranks holding the same shard), everything else over the whole
data-parallel group. Each parameter also has its own divisor, chosen by the model so that
the reduced gradient equals the single-process gradient of the mean loss over the global
batch.

Buckets are launched strictly in a fixed order (the reverse of registration order, which is
roughly the order backward produces gradients), so every rank issues the same sequence of
collectives on every group even though gradients become ready at slightly different times.
While *armed* (during the last backward of a step) a bucket is all-reduced asynchronously as
soon as all of its gradients have been accumulated; :meth:`GradReducer.finish` launches the
rest and waits. A small flag per parameter travels with each bucket so that a gradient that is
``None`` on every rank stays ``None`` (the optimizer then skips it exactly as it would
in one process).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradSpec", "GradReducer"]


@dataclass
class GradSpec:
    """How one parameter's gradient is reduced."""

    param: torch.nn.Parameter
    group: Any  # a torch.distributed group
    group_size: int
    divisor: float


@dataclass
class _Bucket:
    specs: list[GradSpec]
    ready: int = 0
    flat: torch.Tensor | None = None
    handle: Any = None
    launched: bool = False
    members: set[int] = field(default_factory=set)


class GradReducer:
    """Averages gradients over data-parallel groups; see the module docstring."""

    def __init__(self, specs: Sequence[GradSpec], bucket_bytes: int = 4 << 20) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next = 0
        self._hooks: list[Any] = []
        current: _Bucket | None = None
        size = 0
        for spec in reversed(list(specs)):
            p = spec.param
            key = (id(spec.group), spec.divisor, p.dtype, p.device)
            if (
                current is None
                or size + p.numel() * p.element_size() > bucket_bytes
                or _bucket_key(current) != key
            ):
                current = _Bucket(specs=[])
                self._buckets.append(current)
                size = 0
            current.specs.append(spec)
            size += p.numel() * p.element_size()
            self._bucket_of[id(p)] = len(self._buckets) - 1
            if hasattr(p, "register_post_accumulate_grad_hook"):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def arm(self) -> None:
        """Start reducing buckets as their gradients become final (the step's last backward)."""
        with self._lock:
            self._armed = True

    def disarm(self) -> None:
        """Stop reacting to gradients and forget launched buckets (a step that ran no
        backward, or failed)."""
        with self._lock:
            self._armed = False
            self._next = 0
            for b in self._buckets:
                b.ready = 0
                b.members.clear()
                b.flat, b.handle, b.launched = None, None, False

    def _on_grad(self, param: torch.Tensor) -> None:
        with self._lock:
            if not self._armed:
                return
            b = self._buckets[self._bucket_of[id(param)]]
            if id(param) in b.members:
                return
            b.members.add(id(param))
            b.ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if b.ready < len(b.specs):
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        parts: list[torch.Tensor] = []
        flags: list[float] = []
        ref = b.specs[0].param
        for spec in b.specs:
            g = spec.param.grad
            if g is None:
                parts.append(torch.zeros(spec.param.numel(), dtype=ref.dtype, device=ref.device))
                flags.append(0.0)
            else:
                parts.append(g.detach().reshape(-1).to(ref.dtype))
                flags.append(1.0)
        parts.append(torch.tensor(flags, dtype=ref.dtype, device=ref.device))
        flat = torch.cat(parts)
        spec0 = b.specs[0]
        n = flat.numel() - len(flags)
        if spec0.divisor != 1:
            flat[:n].div_(spec0.divisor)
        b.flat = flat
        if spec0.group_size > 1:
            b.handle = dist.all_reduce(flat, group=spec0.group, async_op=True)
        b.launched = True

    def finish(self) -> None:
        """Launch every remaining bucket in order, wait, and write the averages back."""
        with self._lock:
            self._armed = False
            while self._next < len(self._buckets):
                self._launch(self._buckets[self._next])
                self._next += 1
        for b in self._buckets:
            if b.handle is not None:
                b.handle.wait()
            assert b.flat is not None
            flat = b.flat
            n_params = len(b.specs)
            flags = flat[flat.numel() - n_params :]
            offset = 0
            for i, spec in enumerate(b.specs):
                p = spec.param
                k = p.numel()
                if flags[i].item() > 0:
                    value = flat[offset : offset + k].view_as(p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
                offset += k
            b.flat, b.handle, b.launched, b.ready = None, None, False, 0
            b.members.clear()
        self._next = 0

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _bucket_key(b: _Bucket) -> tuple[Any, ...]:
    s = b.specs[0]
    return (id(s.group), s.divisor, s.param.dtype, s.param.device)
