"""Deterministic gradient accumulation: each parameter's gradient is summed in microbatch order.

Under pipelining, the backward work of several microbatches is in flight on a rank at once,
and autograd's ``AccumulateGrad`` would add each contribution to ``.grad`` when the backward
reaching the parameter happens to run. Floating-point addition is not associative, so the
result would depend on timing. :class:`GradAccumulator` makes it depend on the configuration
only:

- While a step runs, every contribution autograd makes to a local parameter is caught (a
  tensor hook before ``AccumulateGrad`` moves ``.grad`` aside, so autograd stores the
  contribution alone; a post-accumulate hook takes it and puts ``.grad`` back) and added to a
  buffer of the microbatch whose task produced it. ``.grad`` itself never changes then.
- A microbatch's buffer is *folded* into ``.grad`` (``grad += buffer``, or ``grad = buffer``
  if there was none) once that microbatch's backward is complete on this rank and every
  earlier microbatch is folded; what is left is folded in order at the end of the step.
  Complete means: the driver's step function returned (:meth:`complete`, and its ``MbDone``
  note elsewhere), or, sooner, this rank saw that every call of the microbatch it served has
  run its only backward (:meth:`complete_locally`; see
  :meth:`smp_pipeline.autograd.CallRecords.finish`). A stage's last fold, and so a
  data-parallel reduction hooked on folds, thus starts as soon as its own backward is done,
  while earlier stages still run theirs.
- *Streaming*: where a parameter gets exactly one contribution of a microbatch on this rank,
  final when it arrives (see :meth:`smp_pipeline.autograd.CallRecords.streamable`): every
  parameter if the microbatch's backward here is one engine run (the driver's step, or the
  only call it served, joined, asked once), and otherwise, where the rank served several
  calls of the microbatch (one request per block of an ``nn.ModuleList`` loop, say), each
  one engine run, the parameters of exactly one of those calls' modules. If the
  parameter's gradient of every earlier microbatch is
  in ``.grad`` already (folded, or streamed itself), the contribution is added to ``.grad``
  right away instead of buffered: the tensor hook decides before ``AccumulateGrad`` runs and
  leaves ``.grad`` in place, so autograd adds the contribution itself (the same sum, with no
  Python in between). The same sums in the same order per parameter, but fold
  hooks run as the backward reaches each parameter (on the first stage, its backward of
  the last microbatch, typically), not after the microbatch. A module that uses a
  parameter it does not hold (neither as its own nor under a child) can break the
  "exactly one": its second contribution is then added in arrival order, and if a later
  microbatch got in between, the late-contribution warning below says so.
- Parameters of a microbatch are folded in reverse registration order, roughly the order
  backward produces them and the order a data-parallel reducer launches its buckets in.

This is what one process computes accumulating the microbatches in order (each
``(loss_i / m).backward()``): autograd's per-run sum of a parameter's uses, then
``grad += that``. Where a parameter gets contributions from several engine runs within one
microbatch (a module called twice through remote calls, tied weights used by two calls) they
are summed in the order those runs happen, which is fixed by the microbatch's own data flow
in joined mode (one chain of backward per microbatch); two contributions sum exactly as in one
process in any order (addition is commutative).

Memory: one gradient-sized buffer per parameter and per microbatch whose backward reached the
parameter here but is not folded yet (bounded by the microbatches in flight).

A contribution arriving for a microbatch already folded (only if a step function runs
forward and backward again after a backward in one microbatch: the rank's records said that
microbatch was done) is added to ``.grad`` directly; the sum is right but its order may
differ, so it warns and from then on folds wait for the driver's word (no local completion,
no streaming).

Hooks run wherever autograd runs, always while the execution token is held, so the task
holding it (``current_mb``) names the microbatch; no lock is needed. Users who need to know
when gradients land use :meth:`GradAccumulator.register_fold_hook` instead of
``register_post_accumulate_grad_hook`` (which sees ``.grad`` unchanged during a step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Container, Iterable
from typing import Any, cast

import torch

FoldHook = Callable[[torch.Tensor], None]


def storable_grad(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g`` as ``AccumulateGrad`` would store it as ``p``'s gradient: itself, or a copy laid
    out like ``p`` if it is a view (it would alias the tensor it views) or strided otherwise."""
    if g._base is None and g.stride() == p.stride():
        return g
    return torch.empty_like(p).copy_(g)


class _AllParameters:
    """Contains every parameter id (a microbatch whose backward here is one engine run)."""

    def __contains__(self, key: object) -> bool:
        return True


#: ``streamable``'s answer when every parameter's contribution may stream.
ALL_PARAMETERS: Container[int] = _AllParameters()


class _Handle:
    """Removes one fold hook."""

    def __init__(self, hooks: list[FoldHook], hook: FoldHook) -> None:
        self._hooks = hooks
        self._hook = hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class GradAccumulator:
    """Per-microbatch gradient buffers of one rank's parameters, folded in microbatch order.

    Args:
        current_mb: the microbatch of the task holding the execution token (None outside one).
        enabled: False leaves accumulation to autograd (timing-dependent order, but each
            parameter's gradient is final as soon as its last backward ran here, which lets a
            data-parallel reduction overlap the rest of the pipeline's backward); fold hooks
            are then plain post-accumulate hooks.
        streamable: ``streamable()``: the ``id()`` of the parameters to which the task
            holding the token gives their only contribution of its microbatch here (asked
            once the microbatch's forward is over; :data:`ALL_PARAMETERS` for all): those
            contributions may be streamed (module doc).
    """

    def __init__(
        self,
        current_mb: Callable[[], int | None],
        enabled: bool = True,
        streamable: Callable[[], Container[int]] | None = None,
    ) -> None:
        self._current_mb = current_mb
        self.enabled = enabled
        self._streamable = streamable
        self._streamed: dict[int, set[int]] = {}  # mb -> id(param) streamed into .grad
        # Local completion and streaming: off for good after a late contribution (module doc).
        self.early = True
        self._params: list[torch.Tensor] = []  # tracked, in a fixed order (fold order)
        self._tracked: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self.own_hook_ids: set[int] = set()  # our tensor hooks' handle ids (not a user's)
        self._fold_hooks: dict[int, list[FoldHook]] = {}
        self._step: int | None = None  # the step being accumulated (None: disarmed)
        self._aside: dict[int, torch.Tensor | None] = {}  # .grad moved aside by the pre-hook
        self._inplace: set[int] = set()  # streamed by AccumulateGrad itself (pre-hook's call)
        self._buffers: dict[int, dict[int, torch.Tensor]] = {}  # mb -> id(param) -> sum
        self._complete: set[int] = set()
        self._next = 0  # the next microbatch to fold
        self.peak_buffers = 0  # most microbatch buffers alive at once (for measurements)
        # Zero-bubble: ``hold(mb)`` is True while microbatch ``mb`` still has deferred weight
        # gradients to come (add_contribution); its fold, and every later one, waits (release).
        self.hold: Callable[[int], bool] | None = None
        # Zero-bubble: told ``(param, tensor)`` of a W contribution nothing references any
        # more once added into a buffer or ``.grad`` (its queue reuses it as an output:
        # smp_pipeline.wqueue.WeightGradQueue.recycle); ids of the buffers that are such
        # contributions, until folded
        self.recycle: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._recyclable: set[int] = set()

    # ------------------------------------------------------------------ set-up
    def track(self, params: Iterable[torch.Tensor]) -> None:
        """Accumulate these parameters deterministically (those that require grad; a
        parameter already tracked is skipped)."""
        if not self.enabled:
            return
        for p in params:
            if id(p) in self._tracked or not p.requires_grad:
                continue
            self._tracked[id(p)] = p
            self._params.append(p)
            handle = p.register_hook(self._make_pre_hook(p))
            self.own_hook_ids.add(handle.id)
            self._handles.append(handle)
            self._handles.append(p.register_post_accumulate_grad_hook(self._post_hook))

    def register_fold_hook(self, param: torch.Tensor, hook: FoldHook) -> _Handle:
        """``hook(param)`` runs each time a microbatch's gradient of ``param`` is folded into
        ``param.grad`` (once per microbatch that reached it, in microbatch order)."""
        if not self.enabled:
            return cast(_Handle, param.register_post_accumulate_grad_hook(hook))
        hooks = self._fold_hooks.setdefault(id(param), [])
        hooks.append(hook)
        return _Handle(hooks, hook)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ autograd hooks
    def _make_pre_hook(self, p: torch.Tensor) -> Callable[[torch.Tensor | None], None]:
        key = id(p)
        aside, inplace = self._aside, self._inplace

        def pre_hook(grad: torch.Tensor | None) -> None:
            if self._step is None:
                return
            mb = self._current_mb()
            if grad is not None and mb is not None and mb >= self._next and self._stream(key, mb):
                # Streamed: AccumulateGrad adds the contribution to .grad itself (``grad +=
                # contribution`` in C++, the same sum _add_to_grad would make), and the post
                # hook only runs the fold hooks. (Measured: ~5 us per parameter and
                # microbatch, against ~16 taking it aside; docs/perf-notes.md.)
                inplace.add(key)
                return
            # AccumulateGrad runs next, on this thread: with .grad None it stores the
            # contribution alone (as its own tensor), which the post hook takes.
            aside[key] = p.grad
            p.grad = None

        return pre_hook

    def _post_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._inplace:
            self._inplace.discard(key)
            self._folded(p)
            return
        if self._step is None or key not in self._aside:
            return
        contribution = p.grad
        p.grad = self._aside.pop(key)
        if contribution is None:
            return
        mb = self._current_mb()
        if mb is None or mb < self._next:
            # Outside a microbatch's task, or after its microbatch was folded: no order to
            # keep; accumulate as autograd would.
            if mb is not None:
                self._late(mb)
            self._add_to_grad(p, contribution)
            return
        if self._stream(key, mb):
            self._add_to_grad(p, contribution)
            return
        self._buffer(key, mb, contribution)  # autograd's own tensor: ours to add into

    def _buffer(self, key: int, mb: int, contribution: torch.Tensor) -> None:
        """Add ``contribution`` (a tensor the buffer may own) to microbatch ``mb``'s buffer of
        parameter ``key``."""
        buffers = self._buffers.get(mb)
        if buffers is None:
            buffers = self._buffers[mb] = {}
            self.peak_buffers = max(self.peak_buffers, len(self._buffers))
        buf = buffers.get(key)
        if buf is None:
            buffers[key] = contribution
        else:
            buf += contribution

    def _stream(self, key: int, mb: int) -> bool:
        """Whether this contribution of microbatch ``mb`` to parameter ``key`` goes straight
        to ``.grad`` (module doc): it is the parameter's only one of ``mb`` here, nothing of
        ``mb`` is buffered for it, and every earlier unfolded microbatch streamed it."""
        if not self.early:
            return False
        streamed = self._streamed.setdefault(mb, set())
        if key in streamed:
            # A second contribution where one was expected (a reentrant checkpoint, a second
            # backward in the step function, a module using a parameter it does not hold):
            # in order unless a later microbatch streamed the parameter meanwhile.
            if any(key in s for k, s in self._streamed.items() if k > mb):
                self._late(mb)
            return True
        if key in self._buffers.get(mb, ()):
            return False
        ask = self._streamable
        if ask is None or key not in ask():
            return False
        if all(key in self._streamed.get(k, ()) for k in range(self._next, mb)):
            streamed.add(key)
            return True
        return False

    def _late(self, mb: int) -> None:
        """A gradient of ``mb`` arrived out of order: warn once, fold only on the driver's
        word from now on (module doc)."""
        if not self.early:
            return
        self.early = False
        warnings.warn(
            f"deterministic accumulation: a gradient of microbatch {mb} arrived after a later "
            "microbatch's was added, or after it was folded (a step function that runs "
            "forward and backward again after its backward?); from now on folds wait for the "
            "driver's step function to return",
            RuntimeWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ steps
    def begin(self, step: int) -> None:
        """Start accumulating ``step``'s gradients in microbatch order."""
        self._step = step
        self._aside.clear()
        self._inplace.clear()
        self._buffers.clear()
        self._recyclable.clear()  # (ids of those buffers)
        self._complete.clear()
        self._streamed.clear()
        self._next = 0

    def complete(self, step: int, mb: int) -> None:
        """Microbatch ``mb``'s backward is complete on every rank: fold it, and any later
        complete ones, once every earlier microbatch is folded."""
        if step != self._step or mb < self._next:
            return
        self._complete.add(mb)
        self.release()

    def release(self) -> None:
        """Fold the complete microbatches that may be folded now, in order (after a
        :attr:`hold` ended; :meth:`complete` calls it)."""
        hold = self.hold
        while self._next in self._complete and not (hold is not None and hold(self._next)):
            self._complete.discard(self._next)
            self._fold(self._next)
            self._streamed.pop(self._next, None)
            self._next += 1

    def add_contribution(self, p: torch.Tensor, g: torch.Tensor, mb: int | None) -> None:
        """A gradient of ``p`` computed outside autograd's ``AccumulateGrad`` (a deferred
        weight-gradient task of zero-bubble, :mod:`smp_pipeline.wsplit`), for microbatch
        ``mb``: added to that microbatch's buffer like one autograd gives, so it is folded
        in microbatch order. ``g`` becomes the buffer's own (a copy if it is a view or laid
        out unlike ``p``, as ``AccumulateGrad`` would store it)."""
        recycle = self.recycle
        if not self.enabled or self._step is None or mb is None or mb < self._next:
            if mb is not None and self._step is not None and self.enabled:
                self._late(mb)
            # (As .grad itself, ``g`` must be stored as AccumulateGrad would store it.)
            if p.grad is None:
                self._add_to_grad(p, storable_grad(p, g))
            else:
                self._add_to_grad(p, g)
                if recycle is not None:
                    recycle(p, g)
            return
        # Added into an existing buffer as it is; a new buffer owns it (a copy where needed).
        if id(p) in self._buffers.get(mb, {}):
            self._buffer(id(p), mb, g)
            if recycle is not None:
                recycle(p, g)
            return
        own = storable_grad(p, g)
        self._buffer(id(p), mb, own)
        if recycle is not None:
            self._recyclable.add(id(own))

    def complete_locally(self, step: int, mb: int) -> None:
        """This rank's backward of microbatch ``mb`` is complete by its own records: fold as
        :meth:`complete` does (unless a late contribution turned local completion off)."""
        if self.early:
            self.complete(step, mb)

    def end(self) -> None:
        """The step ended (or failed): fold what is left in microbatch order and stop."""
        if self._step is None:
            return
        for key, grad in self._aside.items():  # only if autograd failed between the hooks
            self._tracked[key].grad = grad
        self._aside.clear()
        self._inplace.clear()
        for mb in sorted(self._buffers):
            self._fold(mb)
        self._recyclable.clear()
        self._step = None
        self._aside.clear()
        self._complete.clear()
        self._streamed.clear()

    def _fold(self, mb: int) -> None:
        buffers = self._buffers.pop(mb, None)
        if not buffers:
            return
        recyclable = self._recyclable
        for p in reversed(self._params):  # backward's order: a reducer's buckets leave sooner
            buf = buffers.get(id(p))
            if buf is not None:
                kept = p.grad is None  # (then the buffer becomes .grad)
                self._add_to_grad(p, buf)
                if recyclable and id(buf) in recyclable:
                    recyclable.discard(id(buf))
                    if not kept and self.recycle is not None:
                        self.recycle(p, buf)

    def _add_to_grad(self, p: torch.Tensor, g: torch.Tensor) -> None:
        if p.grad is None:
            p.grad = g
        else:
            with torch.no_grad():
                p.grad += g
        self._folded(p)

    def _folded(self, p: torch.Tensor) -> None:
        """A microbatch's gradient of ``p`` is in ``p.grad`` now: run its fold hooks."""
        for hook in self._fold_hooks.get(id(p), ()):
            hook(p)
