"""Data-parallel gradient reduction: an explicit phase of every step, overlapped with backward.

Each parameter is averaged over its own group: tensor-parallel shards over the reduced
data-parallel group (the ranks holding the same shard), everything else over the whole
data-parallel group. Each parameter also has its own divisor, chosen by the model so that
the reduced gradient equals the single-process gradient of the mean loss over the global
batch.

The phase, at every pipeline degree:

- :meth:`GradReducer.begin` (step start) arms the reducer. A hook counts every
  accumulation into each parameter's ``.grad``: autograd's post-accumulate-grad hook, or
  under pipelining the runtime's (``register_grad_hook``: it sums each parameter's gradient
  per microbatch and adds the sums to ``.grad`` in microbatch order, once per microbatch).
- The first step that runs a backward teaches the reducer how many accumulations each
  parameter receives per step (one per microbatch that uses it); that step is reduced at the
  end. From then on a bucket is all-reduced asynchronously as soon as all of its parameters
  reached the count of the previous step, i.e. right after this rank's last backward
  touching them: with
  pipelining each stage starts reducing when its own last backward is done, overlapping
  the other stages' remaining backward.
- Buckets launch strictly in a fixed order (the reverse of registration order, roughly the
  order backward produces gradients), so every rank issues the same sequence of collectives
  on every group even though gradients become ready at different times.
- :meth:`GradReducer.finish` (after the ranks agreed that the step succeeded) launches the
  rest in order and waits. A parameter accumulated again after its bucket was launched
  (data-dependent control flow) makes that rank's reduction stale; one tiny agreement
  collective decides, and then every rank of the group re-reduces every bucket together.

A small flag per parameter travels with each bucket so that a gradient that is ``None`` on
every rank stays ``None`` (the optimizer then skips it exactly as it would in one process).

Every tensor handed to a collective lives on the reducer's ``device`` (``ctx.device``: on CUDA
the groups are NCCL groups, which take device tensors only), and the flags are built there
without copies from the host. One device-to-host read per step remains, in
:meth:`GradReducer.finish`: the flags (and the late agreement) decide on the host which
gradients stay ``None`` and whether to reduce again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from smp_comm.shutdown import abandon_collective

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
    members: set[int] = field(default_factory=set)


class GradReducer:
    """Averages gradients over data-parallel groups; see the module docstring.

    Args:
        specs: one :class:`GradSpec` per trainable parameter, in registration order.
        stale_group: a ``torch.distributed`` group containing every rank that shares a bucket
            with this rank (the data-parallel group): the late-accumulation agreement runs
            over it.
        bucket_bytes: the size of a bucket.
        overlap: launch buckets during backward (True) or only at the end of the step.
        register_hook: ``register_hook(param, fn)`` makes ``fn(param)`` run after each
            accumulation into ``param.grad`` and returns a handle with ``remove()``; default
            autograd's ``register_post_accumulate_grad_hook``.
        wait: waits for one launched collective (default ``work.wait()``); smp's raises if
            another rank failed meanwhile (see :mod:`smp_torch.watch`), and the reducer is
            then disarmed by its owner.
        device: the device the groups serve, where the late-accumulation flag is made
            (``ctx.device``); default the first parameter's device.
    """

    def __init__(
        self,
        specs: Sequence[GradSpec],
        stale_group: Any,
        bucket_bytes: int = 4 << 20,
        overlap: bool = True,
        register_hook: Callable[[torch.Tensor, Callable[[torch.Tensor], None]], Any] | None = None,
        wait: Callable[[Any], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._lock = threading.Lock()
        if device is None:
            device = specs[0].param.device if specs else torch.device("cpu")
        self._device = device
        self._wait_work: Callable[[Any], None] = wait or (lambda work: work.wait())
        self._armed = False
        self._overlap = overlap
        self._stale_group = stale_group
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next = 0
        self._hooks: list[Any] = []
        self._counts: dict[int, int] = {}
        # Accumulations per parameter and step, learned on the first step with a backward.
        self._expected: dict[int, int] | None = None
        self._late = False
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
            if register_hook is None:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
            else:
                self._hooks.append(register_hook(p, self._on_grad))

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def overlap(self) -> bool:
        """Whether buckets are launched during backward (after the first step)."""
        return self._overlap

    def begin(self) -> None:
        """Start counting accumulations (the start of a step)."""
        with self._lock:
            self._reset()
            self._armed = True
            if self._overlap and self._expected is not None:
                # Parameters that receive no gradient in a step are ready from the start.
                for b in self._buckets:
                    b.ready = sum(1 for s in b.specs if self._expected[id(s.param)] == 0)
                self._launch_ready()

    def disarm(self) -> None:
        """Stop reacting to gradients and forget launched buckets (a step that ran no
        backward, or failed)."""
        with self._lock:
            self._armed = False
            for b in self._buckets:
                if b.handle is not None:
                    # A peer may never join it: smp_comm's exit protocol keeps and awaits it.
                    abandon_collective(b.handle)
            self._reset()

    def _reset(self) -> None:
        self._next = 0
        self._late = False
        self._counts = {}
        for b in self._buckets:
            b.ready = 0
            b.members.clear()
            b.flat, b.handle = None, None

    def _on_grad(self, param: torch.Tensor) -> None:
        with self._lock:
            if not self._armed:
                return
            key = id(param)
            count = self._counts.get(key, 0) + 1
            self._counts[key] = count
            if not self._overlap or self._expected is None:
                return
            index = self._bucket_of[key]
            want = self._expected[key]
            if count == want:
                b = self._buckets[index]
                b.members.add(key)
                b.ready += 1
                self._launch_ready()
            elif count > want and index < self._next:
                self._late = True  # its bucket already left with a partial gradient

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if b.ready < len(b.specs):
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        parts: list[torch.Tensor] = []
        missing: list[int] = []
        ref = b.specs[0].param
        for i, spec in enumerate(b.specs):
            g = spec.param.grad
            if g is None:
                parts.append(torch.zeros(spec.param.numel(), dtype=ref.dtype, device=ref.device))
                missing.append(i)
            else:
                parts.append(g.detach().reshape(-1).to(ref.dtype))
        # Made on the device (torch.tensor(list) would copy from the host, a stream sync on
        # CUDA, during backward): ones, zeroed where this rank has no gradient.
        flags = torch.ones(len(b.specs), dtype=ref.dtype, device=ref.device)
        for i in missing:
            flags[i] = 0.0
        parts.append(flags)
        flat = torch.cat(parts)
        spec0 = b.specs[0]
        n = flat.numel() - len(b.specs)
        if spec0.divisor != 1:
            flat[:n].div_(spec0.divisor)
        b.flat = flat
        b.handle = None
        if spec0.group_size > 1:
            b.handle = dist.all_reduce(flat, group=spec0.group, async_op=True)

    def _launch_rest(self) -> None:
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1

    def _wait(self) -> None:
        for b in self._buckets:
            if b.handle is not None:
                self._wait_work(b.handle)
                b.handle = None

    def finish(self) -> None:
        """Collective over the data-parallel groups: launch every remaining bucket in order,
        wait, and write the averages back (see the module docstring)."""
        with self._lock:
            self._armed = False
            self._launch_rest()
            late = self._late
        self._wait()
        if self._overlap and self._expected is not None:
            # On the groups' device (an NCCL group takes no host tensor); torch.full fills on
            # the device, no copy from the host.
            flag = torch.full((1,), 1.0 if late else 0.0, device=self._device)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stale_group, async_op=True)
            self._wait_work(work)
            # Read with the buckets' flags: one device-to-host read per step.
            stale, *flags = self._read_flags(flag)
            if stale > 0:
                # Every rank re-reduces everything from its local gradients (still in .grad).
                self._next = 0
                self._launch_rest()
                self._wait()
                flags = self._read_flags()
        else:
            flags = self._read_flags()
        # Next step expects what this one did (per rank: only the launch order is shared).
        self._expected = {
            id(s.param): self._counts.get(id(s.param), 0) for b in self._buckets for s in b.specs
        }
        at = 0
        for b in self._buckets:
            assert b.flat is not None
            flat = b.flat
            offset = 0
            for spec in b.specs:
                p = spec.param
                k = p.numel()
                has = flags[at] > 0
                at += 1
                if has:
                    value = flat[offset : offset + k].view_as(p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
                offset += k
        with self._lock:
            self._reset()

    def _read_flags(self, first: torch.Tensor | None = None) -> list[float]:
        """``first`` (if given) and every bucket's per-parameter flags, in bucket order, read
        to the host in one transfer (the host decides which gradients stay ``None``)."""
        tails = [b.flat[b.flat.numel() - len(b.specs) :] for b in self._buckets if b.flat is not None]
        if first is not None:
            tails.insert(0, first.to(tails[0].dtype) if tails else first)
        if not tails:
            return []
        return [float(v) for v in torch.cat(tails).tolist()]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _bucket_key(b: _Bucket) -> tuple[Any, ...]:
    s = b.specs[0]
    return (id(s.group), s.divisor, s.param.dtype, s.param.device)
