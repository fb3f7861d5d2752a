"""Activation offloading: what a checkpointed module keeps for its backward waits on the host.

A checkpointed module keeps only its *inputs* for backward (its internals are recomputed).
With offloading (the paper's Appendix H.3), those inputs move to a host pool right after
they are saved, and come back ahead of the backward that needs them:

- **offload**: :meth:`ActivationOffloader.scope` is a ``saved_tensors_hooks`` pair entered
  around every checkpointed call (:mod:`smp_pipeline.checkpointing`); the checkpoint's own
  hook sits above it inside the call, so only what the checkpoint saves itself (its inputs)
  reaches ours. Pack copies each tensor into the pool and keeps no reference to the original,
  whose storage is released once nothing else holds it. On CUDA the copy goes to pinned
  memory on a side stream (the compute stream goes on); on CPU it is a copy into separate
  host tensors, so that the mechanism, its bookkeeping and its schedule are the same code,
  tested without a GPU.
- **prefetch**: the executor tells the offloader when a microbatch's backward first gets the
  execution token on this rank (:meth:`ActivationOffloader.backward_started`), and unpack
  tells it when a microbatch has no tensor left to unpack. At each of these events the load
  window moves: the oldest microbatch whose backward is under way here, and the next
  ``horizon`` microbatches with tensors in the pool (in ``(step, microbatch)`` order, the
  order the built-in schedules run backwards in). So at most ``horizon`` microbatches are
  loaded ahead of the one being consumed. On CUDA the loads run on the side stream, each
  with an event.
- **unpack** takes the loaded copy (waiting for its event on CUDA) or, when the prefetcher
  did not load it (another order than predicted, a graph differentiated twice), loads it
  synchronously: correctness never depends on timing, and the values are bit-identical
  copies, so results equal a run without offloading bit for bit.

A loaded copy is dropped by the pool once unpacked (autograd holds it while it recomputes);
the host copy lives as long as autograd keeps the saved tensor (until that checkpoint's
backward ran, or the graph is freed).

Tensors that are not plain dense tensors (parameters, subclasses such as ``DTensor``, sparse,
meta, empty) are left to autograd untouched. Recomputation and nested checkpoints are never
offloaded: :meth:`ActivationOffloader.scope` applies only outside backward and outside
another offloaded call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from smp_pipeline.errors import PipelineConfigError
from smp_pipeline.worker import current_worker

# (step, microbatch): whose backward a saved tensor belongs to.
Key = tuple[int, int]

_local = threading.local()


@dataclass
class OffloadStats:
    """Counters of one rank's offloader (cumulative since it was built or reset).

    Attributes:
        tensors_offloaded: saved tensors moved to the host pool.
        bytes_offloaded: their bytes.
        bytes_reloaded: bytes copied back to the device (prefetches and synchronous loads).
        prefetch_hits: unpacks that found their tensor already loaded by the prefetcher.
        prefetch_misses: unpacks that had to load synchronously.
        evictions: loaded copies dropped again to keep the window (backwards out of order).
        max_ahead: the most microbatches loaded at once besides the one being consumed
            (at most the horizon).
        peak_device_bytes: the most bytes of saved tensors held on the device by the
            offloader at once (loaded copies not yet unpacked; in counting mode, every saved
            tensor autograd still holds).
        peak_host_bytes: the most bytes in the host pool at once.
    """

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    bytes_reloaded: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    evictions: int = 0
    max_ahead: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Entry:
    """One saved tensor in the pool: its host copy and, while loaded, its device copy."""

    __slots__ = (
        "consumed",
        "device",
        "host",
        "key",
        "load_event",
        "nbytes",
        "offload_event",
        "original",
        "target",
    )

    def __init__(self, key: Key, target: torch.device, nbytes: int) -> None:
        self.key = key
        self.consumed = False  # unpacked once (a graph differentiated again reloads it)
        self.target = target  # where the tensor lives for autograd
        self.nbytes = nbytes
        self.host: torch.Tensor | None = None
        self.device: torch.Tensor | None = None  # the loaded copy, until unpacked
        self.original: torch.Tensor | None = None  # counting mode only: the tensor itself
        self.offload_event: Any = None  # CUDA: the host copy is complete
        self.load_event: Any = None  # CUDA: the device copy is complete


class _Handle:
    """What autograd keeps in place of a saved tensor; dropping it frees the entry."""

    __slots__ = ("entry", "pool")

    def __init__(self, pool: ActivationOffloader, entry: _Entry) -> None:
        self.pool = pool
        self.entry = entry

    def __del__(self) -> None:
        self.pool._forget(self.entry)


def _offloadable(t: torch.Tensor) -> bool:
    # Plain dense tensors only: a parameter stays where it is trained, a subclass (DTensor,
    # ...) has its own storage rules, and an empty tensor is not worth a pool entry.
    return (
        type(t) is torch.Tensor
        and not isinstance(t, nn.Parameter)
        and t.layout == torch.strided
        and t.device.type != "meta"
        and t.numel() > 0
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ActivationOffloader:
    """The host pool and prefetcher of one rank (see the module docstring).

    Args:
        horizon: at most this many microbatches are loaded ahead of their backward (>= 1).
        key: the ``(step, microbatch)`` of the forward running now, or None to leave the
            tensors to autograd (no microbatch known; a backward recomputing).
        move: False counts what would be offloaded without moving anything (the baseline of
            a memory comparison: ``peak_device_bytes`` is then every saved tensor autograd
            holds).
    """

    def __init__(self, horizon: int, key: Callable[[], Key | None], *, move: bool = True) -> None:
        if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 1:
            raise PipelineConfigError(
                f"activation_loading_horizon must be an int >= 1, got {horizon!r}"
            )
        self.horizon = horizon
        self.move = move
        self._key = key
        self._lock = threading.RLock()  # a handle may be dropped on any thread
        self._entries: dict[Key, set[_Entry]] = {}
        self._loaded: dict[Key, int] = {}  # entries with a device copy, per microbatch
        self._started: set[Key] = set()  # microbatches whose backward began here
        self._unconsumed: dict[Key, int] = {}  # entries not unpacked yet, per microbatch
        self._device_bytes = 0
        self._host_bytes = 0
        self._streams: dict[torch.device, Any] = {}
        self.stats = OffloadStats()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ------------------------------------------------------------------ the forward side
    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Offload what the checkpointed call inside the block saves for backward (nothing
        when nested in another offloaded call on this thread, or outside a forward)."""
        # Not nested (the outer checkpoint's hook must see an inner checkpoint's inputs, in
        # the forward as in its recomputation) and only in a forward: a recomputation that
        # pushed hooks would save differently from the forward it replays.
        if getattr(_local, "depth", 0) or self._key() is None:
            yield
            return
        _local.depth = 1
        try:
            with self._hooks:
                yield
        finally:
            _local.depth = 0

    def _pack(self, t: torch.Tensor) -> Any:
        key = self._key()
        if key is None or not _offloadable(t):
            return t
        nbytes = _nbytes(t)
        entry = _Entry(key, t.device, nbytes)
        with self._lock:
            if key in self._started:  # saved after its backward began: nothing to gain
                return t
            if not self.move:
                entry.original = t
                self._add_device(nbytes)
            else:
                entry.host = self._to_host(t, entry)
                self._host_bytes += nbytes
                self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self._host_bytes)
                self.stats.tensors_offloaded += 1
                self.stats.bytes_offloaded += nbytes
                self._unconsumed[key] = self._unconsumed.get(key, 0) + 1
            self._entries.setdefault(key, set()).add(entry)
        return _Handle(self, entry)

    def _to_host(self, t: torch.Tensor, entry: _Entry) -> torch.Tensor:
        if t.device.type != "cuda":
            # A separate host tensor: the original's storage goes once autograd let go of it.
            host = torch.empty_like(t, device="cpu")
            host.copy_(t)
            return host
        side = self._stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t is complete on compute
        with torch.cuda.stream(side):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            entry.offload_event = torch.cuda.Event()
            entry.offload_event.record(side)
        # The allocator keeps t's block until the side stream's copy is done.
        t.record_stream(side)
        return host

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    # ------------------------------------------------------------------ the backward side
    def backward_started(self, step: int, mb: int) -> None:
        """Microbatch ``mb`` of ``step`` began its backward on this rank: move the load
        window (see :meth:`_slide`). Cheap when repeated."""
        key = (step, mb)
        if key in self._started:
            return
        with self._lock:
            self._started.add(key)
            for old in [k for k in self._started if k[0] < step and k not in self._entries]:
                self._started.discard(old)
            if self.move:
                self._slide()

    def _slide(self) -> None:
        """Load the window, drop loaded copies outside it (lock held).

        The window: the oldest microbatch whose backward began here and still has tensors
        to unpack (the one being consumed), then the next ``horizon`` microbatches with
        tensors in the pool; with no backward under way, the next ``horizon`` (prefetched
        for the backward to come). Microbatches outside it wait on the host, a started one
        too (a driver admits several backwards at once; each needs its tensors only when
        the gradient reaches this stage), and a copy loaded for a guess that turned out
        wrong (another backward order) is dropped again."""
        keys = sorted(self._unconsumed)
        current = next((k for k in keys if k in self._started), None)
        if current is None:
            window = keys[: self.horizon]
        else:
            window = [current, *[k for k in keys if k > current][: self.horizon]]
        # (Copies of the sets: a handle dropped meanwhile changes them.)
        for k in window:
            for entry in list(self._entries.get(k, ())):
                if not entry.consumed:
                    self._load(entry)
        for k in [k for k in self._loaded if k not in window]:
            for entry in list(self._entries.get(k, ())):
                self._evict(entry)
        ahead = len(self._loaded) - (current in self._loaded)
        self.stats.max_ahead = max(self.stats.max_ahead, ahead)

    def _load(self, entry: _Entry) -> None:
        """Start copying ``entry`` back to its device (lock held)."""
        if entry.device is not None or entry.host is None:
            return
        host = entry.host
        if entry.target.type != "cuda":
            dev = torch.empty_like(host)
            dev.copy_(host)
        else:
            side = self._stream(entry.target)
            with torch.cuda.stream(side):  # after the offload copy: same stream
                dev = torch.empty_like(host, device=entry.target)
                dev.copy_(host, non_blocking=True)
                entry.load_event = torch.cuda.Event()
                entry.load_event.record(side)
        entry.device = dev
        self._loaded[entry.key] = self._loaded.get(entry.key, 0) + 1
        self._add_device(entry.nbytes)
        self.stats.bytes_reloaded += entry.nbytes

    def _evict(self, entry: _Entry) -> None:
        if entry.device is None:
            return
        entry.device = None
        entry.load_event = None
        self._dec_loaded(entry)
        self.stats.evictions += 1

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        entry: _Entry = packed.entry
        with self._lock:
            if entry.original is not None:  # counting mode
                return entry.original
            if entry.device is not None:
                self.stats.prefetch_hits += 1
            else:
                self.stats.prefetch_misses += 1
                self._load(entry)
            dev, event = entry.device, entry.load_event
            assert dev is not None
            # Autograd holds it while it recomputes; the pool lets go of it now.
            entry.device = None
            entry.load_event = None
            self._dec_loaded(entry)
            if not entry.consumed:
                entry.consumed = True
                if self._consume(entry.key):
                    self._slide()  # this microbatch is done here: the window moves on
        if event is not None:
            stream = torch.cuda.current_stream(dev.device)
            stream.wait_event(event)
            dev.record_stream(stream)  # allocated on the side stream, used on this one
        return dev

    # ------------------------------------------------------------------ bookkeeping
    def _add_device(self, nbytes: int) -> None:
        self._device_bytes += nbytes
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self._device_bytes)

    def _dec_loaded(self, entry: _Entry) -> None:
        self._device_bytes -= entry.nbytes
        n = self._loaded[entry.key] - 1
        if n:
            self._loaded[entry.key] = n
        else:
            del self._loaded[entry.key]

    def _forget(self, entry: _Entry) -> None:
        """Autograd dropped the saved tensor: free its pool entry."""
        with self._lock:
            entries = self._entries.get(entry.key)
            if entries is None or entry not in entries:
                return
            entries.discard(entry)
            if not entries:
                del self._entries[entry.key]
                self._started.discard(entry.key)
            if entry.original is not None:
                entry.original = None
                self._device_bytes -= entry.nbytes
            if entry.device is not None:
                entry.device = None
                self._dec_loaded(entry)
            if entry.host is not None:
                entry.host = None
                self._host_bytes -= entry.nbytes
                if not entry.consumed:  # never unpacked (an output the loss did not use)
                    entry.consumed = True
                    self._consume(entry.key)

    def _consume(self, key: Key) -> bool:
        """One entry of ``key`` will not be unpacked (again); True if it was the last."""
        n = self._unconsumed[key] - 1
        if n:
            self._unconsumed[key] = n
            return False
        del self._unconsumed[key]
        return True

    @property
    def pooled_microbatches(self) -> list[Key]:
        """The microbatches with saved tensors in the pool now, in order."""
        with self._lock:
            return sorted(self._entries)

    @property
    def host_bytes(self) -> int:
        """Bytes in the host pool now."""
        return self._host_bytes

    @property
    def device_bytes(self) -> int:
        """Bytes of saved tensors the offloader holds on the device now."""
        return self._device_bytes

    def reset_stats(self) -> None:
        """Start the counters (and the peaks) again from now."""
        with self._lock:
            self.stats = OffloadStats(
                peak_device_bytes=self._device_bytes, peak_host_bytes=self._host_bytes
            )


def active_offloader() -> ActivationOffloader | None:
    """The offloader of the code running on this thread: the runtime's of a pipeline worker,
    else the one :func:`offloading` set on this thread (a model without a pipeline)."""
    worker = current_worker()
    if worker is not None:
        return getattr(worker.host, "offloader", None)
    return getattr(_local, "offloader", None)


@contextlib.contextmanager
def offloading(offloader: ActivationOffloader | None) -> Iterator[None]:
    """Checkpointed calls on this thread (outside pipeline workers) offload through
    ``offloader`` inside the block (None: not at all)."""
    previous = getattr(_local, "offloader", None)
    _local.offloader = offloader
    try:
        yield
    finally:
        _local.offloader = previous


def offload_scope() -> contextlib.AbstractContextManager[None]:
    """The context every checkpointed call runs in: the active offloader's scope, if any."""
    offloader = active_offloader()
    if offloader is None:
        return contextlib.nullcontext()
    return offloader.scope()
