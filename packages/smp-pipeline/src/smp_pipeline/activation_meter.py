"""Live and peak bytes of activation memory: the tensors a forward saves for backward.

:class:`ActivationMeter` counts what chosen modules' forwards save for backward, as it lives:
a tensor's bytes are added when autograd packs it (``saved_tensors_hooks``) and taken off
when the packed object dies, i.e. when the autograd node holding it is freed (after its
backward, or when the graph is dropped). It is meant for comparing pipeline schedules on one
rank — torch's ``Schedule1F1B`` against zero-bubble schedules, smp's modes — with one rule:

- **Storages, once.** A tensor is counted by its storage (the whole of it: a view keeps its
  base alive), and a storage saved several times (a layer's output saved by the next layer as
  its input, a ReLU's result saved by itself and the next Linear) counts once while any of
  them lives.
- **Not activations.** Storages of ``exclude`` (the parameters; the input batch, which the
  caller holds anyway) are not counted, even when a layer saves them (a Linear saves its
  weight for the input gradient).
- **Where.** Saved-tensor hooks are per thread, and a pipeline runtime may run a stage's
  forward on a thread of its own; the meter enters its hooks in a forward pre-hook and leaves
  them in the forward hook of each module given, on whichever thread runs it. Give the
  leaves of a stage (what they save is the stage's activations); a loss computed outside
  them is not counted.
- **What else is held.** ``extra`` (storage address -> bytes, e.g.
  :meth:`~smp_pipeline.wqueue.WeightGradQueue.held_storages`: zero-bubble's queued W tasks
  hold a layer's input and grad_output after its saved tensors were freed) is added at each
  count, its storages counted once with the saved ones (and not at all if excluded).

The peak is taken at each pack and each release of a saved tensor, excluded ones included:
the count only grows at a pack, or as W tasks are queued inside a backward node, whose saved
tensors (a split layer's input and weight) are released right after; :meth:`sample` counts
at other moments.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from smp_pipeline.storages import LiveStorages

__all__ = ["ActivationMeter"]


class _Packed:
    """What autograd holds instead of a counted saved tensor: its death is the release."""

    __slots__ = ("__weakref__", "key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int | None, meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Counts the bytes saved for backward by ``modules``' forwards while :meth:`measure` is
    open (module doc).

    Args:
        modules: where saved tensors are counted (a stage's leaf modules).
        exclude: tensors whose storages are not activations (parameters, the input batch).
        extra: called at each count: further live storages (address -> bytes) to add, each
            storage counted once with the saved ones.
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        exclude: Iterable[torch.Tensor] = (),
        extra: Callable[[], Mapping[int, int]] | None = None,
    ) -> None:
        self.modules = list(modules)
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.extra = extra
        #: the most bytes alive at once, ``extra`` included, since the last :meth:`reset_peak`
        self.peak_bytes = 0
        #: tensors packed (counted or not) since the meter was made
        self.packed = 0
        self._live = LiveStorages()  # the saved storages alive now (copies counted once)
        # (a node may be freed on another thread than its pack, or by the collector inside a pack)
        self._lock = threading.RLock()
        self._local = threading.local()

    @property
    def live_bytes(self) -> int:
        """Bytes of the saved storages alive now (without ``extra``)."""
        return self._live.bytes

    def sample(self) -> int:
        """Count now (the peak too); the total (:meth:`total_bytes`)."""
        with self._lock:
            self._sample()
            return self._total()

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        with self._lock:
            self.peak_bytes = 0
            self._sample()

    def total_bytes(self) -> int:
        """Saved storages alive now plus ``extra``'s others."""
        with self._lock:
            return self._total()

    @contextlib.contextmanager
    def measure(self) -> Iterator[ActivationMeter]:
        """Count what the modules' forwards save while the context is open (a packed tensor
        that outlives it is still released when it dies)."""
        handles = []
        try:
            for m in self.modules:
                handles.append(m.register_forward_pre_hook(self._enter))
                handles.append(m.register_forward_hook(self._leave, always_call=True))
            yield self
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------------------------ hooks
    def _enter(self, module: nn.Module, args: Any) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._stack().append(hooks)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:  # (a module entered before measure() opened has no hooks to leave)
            stack.pop().__exit__(None, None, None)

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            self.packed += 1
            if key in self.excluded:
                # not counted, but its release is a moment to count at (a layer's weight
                # is released with its input, just after its I pass queued a W task)
                return _Packed(t, None, self)
            self._live.hold(key, storage.nbytes())
            self._sample()
        # Detached: a saved output's grad_fn is the node holding it, a cycle of references
        # the collector cannot see (the node is C++), so the node would never be freed.
        return _Packed(t.detach(), key, self)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _release(self, key: int | None) -> None:
        with self._lock:
            if key is not None:
                self._live.release(key)
            self._sample()

    def _total(self) -> int:
        if self.extra is None:
            return self._live.bytes
        others = dict(self.extra())  # (a copy: the queue may change on another thread)
        skip = self._live.keys() | self.excluded
        return self._live.bytes + sum(n for ptr, n in others.items() if ptr not in skip)

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._total())
