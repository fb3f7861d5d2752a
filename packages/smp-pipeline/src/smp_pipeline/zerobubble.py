"""Zero-bubble placement: each rank's weight-gradient (W) tasks run in its idle time.

Under ``schedule="zero_bubble"`` every pipeline rank splits the backward of the modules it
owns with :mod:`smp_pipeline.wsplit`: the input-gradient part (I) runs as the backward task
it is, since the previous stage waits for it, and each split layer application queues a W
task that holds only what its weight gradient needs. :class:`WeightGradWork` is one rank's
queue and its placement rules:

- **Where W tasks go**: when the rank's main loop finds nothing to do (no worker to resume,
  no schedulable task, no arrived message) it runs *one* W task and looks again, instead of
  waiting for a message. A W task is one layer application's weight GEMM (a fraction of a
  stage's backward), so an arrival waits at most that long. The measured mean times of F,
  I (backward tasks) and W tasks are kept (:attr:`WeightGradWork.stats`) for the picture and
  the benchmark; the rule itself needs none of them: the idle loop *is* the measurement of
  where the bubbles are.
- **Memory**: W tasks of more than ``max_microbatches`` microbatches queued (1F1B holds that
  many microbatches' activations, the queued W inputs come on top) run eagerly, oldest
  first, before new work starts. At the step's end the rest is drained before the step's
  gradients are final.
- **Order** (bitwise): each group of W tasks (one autograd engine run) is tagged with the
  microbatch of the task that queued it; its summed gradient per parameter goes into that
  microbatch's buffer of the :class:`~smp_pipeline.accumulation.GradAccumulator`, as an
  ``AccumulateGrad`` contribution would, and a microbatch is folded into ``.grad`` only once
  its W tasks ran (:attr:`GradAccumulator.hold`): every parameter's gradient is still summed
  in microbatch order, and each microbatch's contributions in autograd's order.
- **Where deferral does not pay**: a rank that ran fewer than half of a step's W tasks in
  idle time (a bottleneck stage: the rest ran at the memory bound or the step's end, on its
  critical path) splits nothing for the next ``REST_STEPS`` steps, then tries again
  (:data:`REST_BELOW_IDLE_SHARE`, counted in :attr:`WeightGradStats.rested_steps`).
- **Page faults**: a W task computes a linear layer's weight gradient into one of the
  parameter's gradients already folded, when the queue holds one
  (:meth:`~smp_pipeline.wqueue.WeightGradQueue.recycle`, within a step). A fresh output a
  task was faulted in anew every time on a rank's main thread (glibc gave the freed top of
  its heap back after each fold); measured on bench_zero_bubble's model below.
- **What is split**: the owned ``nn.Linear``/``LayerNorm``/``RMSNorm``/``Embedding`` modules
  (:func:`~smp_pipeline.wsplit.splittable`) except those holding a parameter that another,
  unsplit, module also holds: such a parameter would get an I-pass gradient and W tasks in
  one microbatch, which cannot be summed in autograd's order. A parameter shared only by
  split modules (a tied embedding and output head) stays split. A parameter found mixed at
  run time anyway (used functionally elsewhere) is warned about once and its modules are left
  unsplit from the next step on. A layer whose parameter has a tensor hook of its own
  (``p.register_hook``, checked each step) stays unsplit too: the hook would not see the W
  gradient.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from torch import nn

from smp_pipeline.accumulation import GradAccumulator
from smp_pipeline.actions import ActionKind
from smp_pipeline.wsplit import WeightGradQueue, split_modules, splittable

__all__ = ["WeightGradStats", "WeightGradWork", "modules_to_split"]

WEIGHT_GRAD = ActionKind.WEIGHT_GRAD
#: A rank that found little idle time for its W tasks in a step (fewer than this share ran in
#: idle time; the rest ran eagerly at the memory bound or at the step's end, both on its own
#: critical path: a bottleneck stage) gains nothing from deferring them and pays the split:
#: it splits nothing for the next ``REST_STEPS`` steps, then tries again. Split or not, the
#: gradients are the same bits.
REST_BELOW_IDLE_SHARE = 0.5
REST_STEPS = 4
# (pp rank, microbatch, module, phase, start, end), as the executor's timeline events
Span = tuple[int, int, str, ActionKind, float, float]


@dataclass
class WeightGradStats:
    """Counts of one rank's W tasks over its steps (see :class:`WeightGradWork`)."""

    #: W tasks run: in idle time, eagerly (the memory bound), at a step's end (drained)
    idle: int = 0
    eager: int = 0
    drained: int = 0
    #: seconds spent in W tasks, the most W tasks queued at once, and the most bytes their
    #: held tensors took at once (storages counted once: ``WeightGradQueue.queued_bytes``)
    seconds: float = 0.0
    peak_queued: int = 0
    peak_queued_bytes: int = 0
    #: layer applications split, by operator (``linear``, ``embedding``, ...)
    deferred_ops: dict[str, int] = field(default_factory=dict)
    #: steps this rank split nothing, having found too little idle time before
    #: (``REST_BELOW_IDLE_SHARE``)
    rested_steps: int = 0

    @property
    def total(self) -> int:
        """Every W task run."""
        return self.idle + self.eager + self.drained

    @property
    def mean_s(self) -> float:
        """Mean duration of a W task (0 before any ran)."""
        return self.seconds / self.total if self.total else 0.0


def modules_to_split(
    model: nn.Module, owned: Iterable[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """The :func:`~smp_pipeline.wsplit.splittable` ``(path, module)``s among ``owned`` whose
    parameters are held by no unsplittable module of ``model`` (module doc: a tied pair of
    split modules stays split)."""
    holders: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(m)
    out, seen = [], set()
    for path, m in owned:
        if id(m) in seen or not splittable(m):  # (an alias path: one module)
            continue
        seen.add(id(m))
        params = [p for p in m._parameters.values() if p is not None]
        if not any(p.requires_grad for p in params):  # frozen: nothing to defer
            continue
        if all(splittable(h) for p in params for h in holders.get(id(p), ())):
            out.append((path, m))
    return out


def _foreign_hooks(m: nn.Module, own: set[int]) -> bool:
    """Whether a parameter of ``m`` has a tensor hook other than the accumulator's."""
    return any(set(p._backward_hooks or {}) - own for p in m.parameters(recurse=False))


class WeightGradWork:
    """One rank's deferred weight gradients under zero-bubble (module doc).

    Args:
        pp_rank: this rank (named in timeline spans and warnings).
        grads: the rank's accumulator (deterministic: W gradients go into its buffers).
        current_mb: the microbatch of the task holding the execution token.
        max_microbatches: W tasks of more microbatches than this queued run eagerly.
        record_timeline: keep a span per W task (:attr:`events`).
        note_action: told ``(microbatch, operator)`` as each W task of a microbatch starts
            (the rank's program records it as a ``WEIGHT_GRAD`` action).
        rests: whether the resting rule applies (:data:`REST_BELOW_IDLE_SHARE`). False under
            tensor-parallel ordering: a stage's peers must split the same layers in every
            step, and a follower (its W tasks wait for the step's end, so it finds no idle
            time) would rest while its leader splits; the peers' gradients would then fold
            at different points, and the collectives hooked on folds stop matching.
    """

    def __init__(
        self,
        pp_rank: int,
        grads: GradAccumulator,
        current_mb: Callable[[], int | None],
        max_microbatches: int,
        record_timeline: bool = False,
        note_action: Callable[[int, str], None] | None = None,
        rests: bool = True,
    ) -> None:
        self.pp_rank = pp_rank
        self.rests = rests
        self.note_action = note_action
        self.grads = grads
        self.max_microbatches = max_microbatches
        self.record_timeline = record_timeline
        self.queue = WeightGradQueue(fold=grads.add_contribution, tag=current_mb,
                                     closed=lambda tag: grads.release())  # fmt: skip
        self.stats = WeightGradStats()
        self.events: list[Span] = []
        self._modules: list[tuple[str, nn.Module]] = []
        self._excluded: set[int] = set()  # ids of modules found mixed at run time
        self._resting = 0  # steps left that split nothing (REST_BELOW_IDLE_SHARE)
        self._warned: set[str] = set()
        grads.hold = self.holds

    def set_modules(self, model: nn.Module, owned: Iterable[tuple[str, nn.Module]]) -> None:
        """Choose the modules to split (after partitioning; see :func:`modules_to_split`).
        A rank that owns trainable parameters but no layer the split knows is warned about
        (``RuntimeWarning``, naming the classes holding them): its backwards run whole, as
        under ``"interleaved"``, and nothing else would tell the user."""
        owned = list(owned)
        self._modules = modules_to_split(model, owned)
        if self._modules:
            return
        holders = sorted({
            type(m).__name__ for _, m in owned
            for p in m._parameters.values() if p is not None and p.requires_grad
        })  # fmt: skip
        if holders:
            warnings.warn(
                f"zero_bubble splits nothing on pp rank {self.pp_rank}: no layer of this stage "
                f"is one it knows (its trainable parameters are held by {', '.join(holders[:6])}"
                f"{', ...' if len(holders) > 6 else ''}; the split knows nn.Linear, "
                "LayerNorm, RMSNorm, Embedding and classes given to register_linear): its "
                "backwards run whole, as under 'interleaved'",
                RuntimeWarning,
                stacklevel=2,
            )

    @property
    def modules(self) -> list[tuple[str, nn.Module]]:
        """The ``(path, module)``s split from now on: not those whose parameters carry a
        tensor hook of their own (``p.register_hook``: it would not see W gradients)."""
        own = self.grads.own_hook_ids
        return [(n, m) for n, m in self._modules
                if id(m) not in self._excluded and not _foreign_hooks(m, own)]  # fmt: skip

    # ------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The split for one step's duration (forwards and backwards, so checkpointing's
        recomputation goes through it too); the caller drains (:meth:`drain`) before the
        step's gradients are final."""
        q = self.queue
        q.new_step()
        resting = self._resting > 0
        if resting:
            self._resting -= 1
            self.stats.rested_steps += 1
        idle_before, total_before = self.stats.idle, self.stats.total
        # W outputs into gradients already folded (WeightGradQueue.recycle), within the step
        # only: the step's last folds (after it) free theirs, and no spare outlives it
        self.grads.recycle = q.recycle
        try:
            with split_modules([] if resting else self.modules, q):
                yield
        finally:
            self.grads.recycle = None
            q.drop_spares()
        ran = self.stats.total - total_before
        if self.rests and ran and (self.stats.idle - idle_before) < REST_BELOW_IDLE_SHARE * ran:
            self._resting = REST_STEPS
        for op, n in q.deferred_ops.items():
            self.stats.deferred_ops[op] = self.stats.deferred_ops.get(op, 0) + n
        q.deferred_ops.clear()
        if q.mixed_params:
            self._exclude_mixed()

    def _exclude_mixed(self) -> None:
        q = self.queue
        mixed = q.mixed_param_ids()
        for _, m in self._modules:
            if any(id(p) in mixed for p in m.parameters(recurse=False)):
                self._excluded.add(id(m))
        new = sorted(q.mixed_params - self._warned)
        self._warned |= q.mixed_params
        if new:
            warnings.warn(
                f"zero_bubble, pp rank {self.pp_rank}: parameters {new} got both deferred "
                "weight gradients and gradients of an operator the split does not know in one "
                "microbatch (a weight used functionally elsewhere?); this step's sums may "
                "differ from dynamic mode in the last bits; their layers are not split from "
                "the next step on",
                RuntimeWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ placement
    def pending(self) -> bool:
        """Whether W tasks are queued."""
        return bool(self.queue.tasks)

    def over_limit(self) -> bool:
        """Whether W tasks of more than ``max_microbatches`` microbatches are queued."""
        return len(self.queue.queued_by_tag) > self.max_microbatches

    def keep_bound(self) -> None:
        """Run W tasks eagerly, oldest first, while over the limit (:meth:`over_limit`)."""
        while self.over_limit() and self.queue.tasks:
            self.run_one("eager")

    def holds(self, mb: int) -> bool:
        """Whether microbatch ``mb``'s fold must wait: W tasks of it (or of an earlier one,
        or untagged ones) are still queued."""
        return any(t is None or t <= mb for t in self.queue.queued_by_tag)

    def run_one(self, why: str) -> None:
        """Run the oldest W task (``why``: ``"idle"``, ``"eager"`` or ``"drained"``,
        counted), then fold what it completed."""
        q = self.queue
        # (the queue only shrinks here or in discard(): its peaks are just before a run)
        self.stats.peak_queued = max(self.stats.peak_queued, len(q.tasks))
        self.stats.peak_queued_bytes = max(self.stats.peak_queued_bytes, q.queued_bytes)
        task = q.tasks[0]
        tag = q.group_tags.get(task.group)
        if tag is not None and self.note_action is not None:
            self.note_action(tag, task.op)
        start = time.time()
        q.run_next()
        end = time.time()
        self.stats.seconds += end - start
        setattr(self.stats, why, getattr(self.stats, why) + 1)
        if self.record_timeline:
            self.events.append((self.pp_rank, -1 if tag is None else tag, f"W {task.op}",
                                WEIGHT_GRAD, start, end))  # fmt: skip
        if tag not in q.queued_by_tag:  # that microbatch's last W task: its fold may go
            self.grads.release()

    def discard(self) -> None:
        """Drop every queued W task (a failed step: nothing will fold them)."""
        self.queue.clear()

    def drain(self) -> None:
        """Run every queued W task (a step's end)."""
        while self.queue.tasks:
            self.run_one("drained")
