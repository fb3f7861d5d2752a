"""The queue of deferred weight-gradient (W) tasks, and how they fold into ``.grad``.

The split operators of :mod:`smp_pipeline.wsplit` queue, per layer application, a
:class:`WTask` holding only what its weight gradient needs; :class:`WeightGradQueue` keeps
them in queue order, groups them by the backward that queued them, and runs them from the
front (a scheduler places them one by one: :mod:`smp_pipeline.zerobubble`).

Bitwise accumulation. A plain backward sums the contributions of one microbatch to one
parameter (a tied weight has several) in the order they arrive, then adds that sum into
``.grad``; microbatches accumulate in the order of their backwards. The W tasks reproduce both
steps: they are grouped by the backward (autograd graph task) that queued them, a group's
contributions to a parameter are summed in queue order, and the sum is folded into ``.grad``
when the group's last contribution to it has run. The formulas are the ones autograd uses for
these operators, on the same kernels, so running the W tasks in microbatch order gives
parameter gradients bitwise equal to plain backwards (``tests/test_wsplit.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from smp_pipeline.accumulation import storable_grad
from smp_pipeline.storages import LiveStorages, storage_sizes

__all__ = ["GradPairs", "WTask", "WeightGradQueue"]

GradPairs = list[tuple[nn.Parameter, torch.Tensor]]


@dataclass
class WTask:
    """One deferred weight gradient: an operator application's held tensors and formula."""

    op: str
    group: int
    params: tuple[nn.Parameter, ...]
    held: tuple[torch.Tensor, ...]
    compute: Callable[[], GradPairs]

    def nbytes(self) -> int:
        """Bytes of the tensors this task holds (shared storages counted once)."""
        return _storage_bytes(self.held)


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(storage_sizes(tensors).values())


@dataclass
class WeightGradQueue:
    """The W tasks queued by backwards under :func:`deferred_weight_grads`, in queue order.

    Run them with :meth:`run` (all), :meth:`run_group` (one backward's, i.e. one
    microbatch's) or :meth:`run_next` (one task: a scheduler can place tasks one by one).
    Groups must be run in the order they were queued for the accumulation to be bitwise that
    of plain backwards; the queue enforces it by running from the front only.
    """

    tasks: list[WTask] = field(default_factory=list)
    #: operator name -> applications split (their weight gradients deferred)
    deferred_ops: dict[str, int] = field(default_factory=dict)
    #: operator name -> applications of a split module that could not be split (a linear
    #: layer on a non-contiguous input, an embedding with ``max_norm``: torch's backward)
    not_deferred_ops: dict[str, int] = field(default_factory=dict)
    #: names of tracked parameters whose gradient was accumulated in the I pass
    immediate_params: set[str] = field(default_factory=set)
    #: names of parameters that received both: a gradient in the I pass (an operator the
    #: split does not know) and W tasks. Their ``.grad`` is right but its rounding is not a
    #: plain backward's (which sums a microbatch's contributions before accumulating them).
    mixed_params: set[str] = field(default_factory=set)
    _immediate_ids: dict[int, str] = field(default_factory=dict)
    _pending: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _remaining: dict[tuple[int, int], int] = field(default_factory=dict)
    #: where a group's summed gradient of a parameter goes: ``fold(param, grad, tag)`` with
    #: the group's tag (None: ``param.grad += grad`` as AccumulateGrad does)
    fold: Callable[[nn.Parameter, torch.Tensor, int | None], None] | None = None
    #: called when a group opens (while its first W task is queued): the group's tag, e.g.
    #: the microbatch whose backward queues it (None: untagged)
    tag: Callable[[], int | None] | None = None
    #: group -> its tag (until :meth:`seal`); tag -> W tasks of its groups still queued
    group_tags: dict[int, int | None] = field(default_factory=dict)
    queued_by_tag: dict[int | None, int] = field(default_factory=dict)
    #: False (default): a norm's weight gradient (a vector, memory-bound to compute) is
    #: computed in the I pass and only folded into ``.grad`` by its W task; True: computed by
    #: the W task from the held input and grad_output (see the module docstring)
    defer_norms: bool = False
    #: an empty tensor requiring grad, passed to every split operator (see ``_detach``)
    anchor: torch.Tensor = field(default_factory=lambda: torch.empty(0, requires_grad=True))
    _group: int = -1
    #: autograd graph task id -> its group (a backward paused inside the engine, as a
    #: pipeline's joined backward is while it waits for another rank, keeps its group)
    _groups: dict[int, int] = field(default_factory=dict)
    #: groups whose backward is still running -> the parameters whose sum waits for its end
    _open: dict[int, dict[int, nn.Parameter]] = field(default_factory=dict)
    #: called with a group's tag when its backward ended and that took the group's last
    #: count off :attr:`queued_by_tag` (a scheduler may fold the microbatch now)
    closed: Callable[[int | None], None] | None = None
    #: the storages the queued W tasks hold, each counted once however many tasks (or
    #: tensors of one task) hold it; kept up to date as tasks are queued and run
    _held: LiveStorages = field(default_factory=LiveStorages)
    #: param id -> a weight-gradient tensor of its shape that nothing references any more
    #: (:meth:`recycle`), until :meth:`drop_spares`
    _spares: dict[int, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tasks)

    def pending_bytes(self) -> int:
        """Bytes held by the queued W tasks (what stays alive between I and W), recounted
        from the tasks (:attr:`queued_bytes` is the same figure, kept as they come and go)."""
        return _storage_bytes([t for task in self.tasks for t in task.held])

    @property
    def queued_bytes(self) -> int:
        """Bytes of the storages the queued W tasks hold, each counted once (kept up to date
        as tasks are queued and run)."""
        return self._held.bytes

    def held_storages(self) -> dict[int, int]:
        """Storage address -> bytes of each storage the queued W tasks hold (to count them
        once with other live tensors, e.g. saved activations sharing an input; a meter may
        ask from another thread while this one queues or runs tasks)."""
        return self._held.sizes()

    def _hold(self, task: WTask) -> None:
        for ptr, nbytes in storage_sizes(task.held).items():
            self._held.hold(ptr, nbytes)

    def _release(self, task: WTask) -> None:
        for ptr in storage_sizes(task.held):
            self._held.release(ptr)

    def new_step(self) -> None:
        """A step starts: :meth:`seal` the groups, and forget which parameters got I-pass or
        mixed gradients (:attr:`immediate_params`, :attr:`mixed_params`)."""
        self.seal()
        self.immediate_params.clear()
        self.mixed_params.clear()
        self._immediate_ids.clear()

    def mixed_param_ids(self) -> set[int]:
        """``id`` of each parameter named in :attr:`mixed_params` this step."""
        return {pid for pid, name in self._immediate_ids.items() if name in self.mixed_params}

    def seal(self) -> None:
        """End the open groups: the next W task queued starts a new group (and the tags of
        groups whose tasks all ran are forgotten)."""
        self._groups.clear()
        live = {t.group for t in self.tasks}
        self.group_tags = {g: t for g, t in self.group_tags.items() if g in live}

    def _group_for_current_backward(self) -> int:
        # One group per autograd graph task: one backward call is one microbatch's I pass.
        task_id = torch._C._current_graph_task_id()
        group = self._groups.get(task_id)
        if group is None:
            self._group += 1
            group = self._groups[task_id] = self._group
            tag = self.group_tags[group] = None if self.tag is None else self.tag()
            # A W task may run while its backward is paused (a pipeline's joined backward
            # waiting for another rank): a parameter's sum must still wait for the backward's
            # end, where autograd's AccumulateGrad would add it, or a later contribution of
            # the same backward would be added to .grad on its own (other rounding). The
            # open backward counts once in queued_by_tag, so its microbatch does not fold.
            self._open[group] = {}
            self.queued_by_tag[tag] = self.queued_by_tag.get(tag, 0) + 1
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._close(group))
        return group

    def _close(self, group: int) -> None:
        """The backward of ``group`` ended: fold the sums that waited for it."""
        waiting = self._open.pop(group, None)
        if waiting is None:  # (cleared: a discarded step)
            return
        tag = self.group_tags.get(group)
        with torch.no_grad():
            for pid, p in waiting.items():
                key = (group, pid)
                if self._remaining.get(key) == 0:
                    del self._remaining[key]
                    self._fold(p, self._pending.pop(key), tag)
        if self._uncount(tag) and self.closed is not None:
            self.closed(tag)

    def _uncount(self, tag: int | None) -> bool:
        """One less queued under ``tag``; whether that was its last."""
        left = self.queued_by_tag[tag] - 1
        if left:
            self.queued_by_tag[tag] = left
            return False
        del self.queued_by_tag[tag]
        return True

    def _fold(self, p: nn.Parameter, total: torch.Tensor, tag: int | None) -> None:
        if id(p) in self._immediate_ids:
            self.mixed_params.add(self._immediate_ids[id(p)])
        if self.fold is None:
            _fold_into_grad(p, total)
        else:
            self.fold(p, total, tag)

    def recycle(self, p: torch.Tensor, t: torch.Tensor) -> None:
        """``t``, a gradient of ``p`` that nothing references any more (its fold is done), is
        kept (one per parameter) to be a later W task's output
        (:meth:`spare`). Why: on a pipeline rank's main thread a fresh weight gradient's pages
        were faulted in anew by every W task (glibc returned the freed top of its heap after
        each fold): 252 faults a task for a 512 x 512 weight, 16,135 a step on bench_zero_bubble's
        last stage, against 0-1,900 a step in dynamic mode."""
        # (CPU only: a GPU's caching allocator has no such cost, and there the fold that
        # read ``t`` may still be queued on another thread's stream when a W task reuses it)
        if t.device.type != "cpu" or t.shape != p.shape or t.requires_grad or not t.is_contiguous():
            return
        self._spares.setdefault(id(p), t)

    def spare(self, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
        """A recycled gradient of ``p`` with ``like``'s dtype and device, or None."""
        t = self._spares.pop(id(p), None)
        return t if t is not None and t.dtype == like.dtype and t.device == like.device else None

    def drop_spares(self) -> None:
        """Forget the recycled gradients (a step's end: between steps they would be memory
        the user's process keeps for nothing)."""
        self._spares.clear()

    def clear(self) -> None:
        """Drop every queued W task and partial sum (a failed step: nothing will fold them)."""
        self.tasks.clear()
        self._held.clear()
        self.queued_by_tag.clear()
        self._pending.clear()
        self._remaining.clear()
        self._open.clear()
        self._spares.clear()

    def oldest_tag(self) -> int | None:
        """The tag of the oldest queued W task's group (None: empty, or untagged)."""
        return self.group_tags.get(self.tasks[0].group) if self.tasks else None

    def _note_immediate(self, p: torch.Tensor, name: str) -> None:
        self.immediate_params.add(name)
        self._immediate_ids[id(p)] = name

    def _count_not_deferred(self, op: str) -> None:
        if torch.is_grad_enabled():
            self.not_deferred_ops[op] = self.not_deferred_ops.get(op, 0) + 1

    def _enqueue(self, task: WTask) -> None:
        self.tasks.append(task)
        self._hold(task)
        tag = self.group_tags.get(task.group)
        self.queued_by_tag[tag] = self.queued_by_tag.get(tag, 0) + 1
        for p in task.params:
            key = (task.group, id(p))
            self._remaining[key] = self._remaining.get(key, 0) + 1
        self.deferred_ops[task.op] = self.deferred_ops.get(task.op, 0) + 1

    def run_next(self) -> bool:
        """Run the oldest W task; False when the queue is empty."""
        if not self.tasks:
            return False
        task = self.tasks.pop(0)
        self._release(task)
        tag = self.group_tags.get(task.group)
        with torch.no_grad():
            for p, g in task.compute():
                # Keyed by group too: a paused backward's group may interleave with others.
                key = (task.group, id(p))
                partial = self._pending.pop(key, None)
                # The sum of one group's contributions, in arrival order (autograd's input
                # buffer), before it meets .grad (autograd's AccumulateGrad).
                total = g if partial is None else partial + g
                self._remaining[key] -= 1
                waiting = self._open.get(task.group)
                if self._remaining[key] or waiting is not None:
                    # more to come, or possibly more: the backward has not ended
                    self._pending[key] = total
                    if waiting is not None and not self._remaining[key]:
                        waiting[id(p)] = p
                    continue
                del self._remaining[key]
                self._fold(p, total, tag)
        self._uncount(tag)
        return True

    def run_group(self) -> int:
        """Run the oldest backward's W tasks; returns how many ran."""
        if not self.tasks:
            return 0
        group, n = self.tasks[0].group, 0
        while self.tasks and self.tasks[0].group == group:
            self.run_next()
            n += 1
        return n

    def run(self) -> int:
        """Run every queued W task in queue order; returns how many ran."""
        n = 0
        while self.run_next():
            n += 1
        return n


def _fold_into_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    """``p.grad += g`` the way AccumulateGrad does it (the first gradient is stored as is)."""
    if p.grad is None:
        p.grad = storable_grad(p, g)  # (a view, a one-row bias sum, would alias a held tensor)
    else:
        p.grad += g
