"""Recording a delayed construction (see :mod:`smp_torch.deferred`, which documents the design).

:class:`Recording` keeps the log; :class:`Recorder` (a ``TorchDispatchMode``) feeds it every
aten op that touches a meta tensor and every random op on a real CPU tensor;
:class:`DelayedDevice` is ``torch.device("meta")`` except for tensors made from Python data;
:mod:`smp_torch.deferred_hooks` feeds it what no mode sees (seeds, ``torch.nn.init``).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from smp_torch.deferred_replay import (
    CPU,
    DEVICE,
    Const,
    Entry,
    Ref,
    Replayer,
    Scratch,
    StorageInfo,
    plan,
)

__all__ = [
    "Recording",
    "Recorder",
    "DelayedDevice",
    "active",
    "set_active",
    "lookup",
    "layout",
]

_SEEDED = torch.Tag.nondeterministic_seeded
_aten = torch.ops.aten
# In-place ops that write every element of ``self`` without reading it: when ``self`` covers
# its whole storage, whatever was written there before is dead.
_OVERWRITE = {
    _aten.normal_.default,
    _aten.uniform_.default,
    _aten.fill_.Scalar,
    _aten.fill_.Tensor,
    _aten.zero_.default,
    _aten.copy_.default,
    _aten.random_.default,
    getattr(_aten.random_, "from"),
    _aten.random_.to,
    _aten.exponential_.default,
    _aten.cauchy_.default,
    _aten.log_normal_.default,
    _aten.geometric_.default,
    _aten.bernoulli_.float,
    _aten.bernoulli_.Tensor,
}
_DATA_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
# Ops that allocate without writing: what a normal construction has there is whatever the
# memory held.
_UNINITIALISED = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.empty_permuted.default,
}

_registry_lock = threading.RLock()
_LIVE: dict[int, tuple[Recording, int]] = {}  # storage address -> (recording, sid)
_local = threading.local()


def active() -> Recording | None:
    """The recording this thread is in, if any."""
    return getattr(_local, "active", None)


def set_active(rec: Recording | None) -> None:
    _local.active = rec


def lookup(t: torch.Tensor) -> tuple[Recording, int] | None:
    with _registry_lock:
        return _LIVE.get(t.untyped_storage()._cdata)


def _covers(ref: Ref, nbytes: int) -> bool:
    """Whether the view writes every byte of its storage (dense, no overlap, no offset)."""
    numel = 1
    for n in ref.size:
        numel *= n
    if ref.offset != 0 or numel * ref.dtype.itemsize != nbytes:
        return False
    expected = 1
    for n, st in sorted(
        ((n, st) for n, st in zip(ref.size, ref.stride) if n != 1), key=lambda p: p[1]
    ):
        if st != expected:
            return False
        expected *= n
    return True


def _generator_mode(func: Any) -> str:
    """How the replay hands its generator to ``func`` (see ``Entry.generator``)."""
    args = func._schema.arguments
    names = [a.name for a in args]
    if "generator" in names:
        return "kw" if args[names.index("generator")].kwarg_only else "swap"
    packet = func._overloadpacket
    for overload in packet.overloads():
        other = getattr(packet, overload)._schema.arguments
        gen = [a for a in other if a.name == "generator"]
        if gen and gen[0].kwarg_only and [a.name for a in other if a.name != "generator"] == names:
            return f"overload:{overload}"
    return "swap"


def _generator_arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            return kwargs.get("generator", args[i] if i < len(args) else None)
    return None


def _arg_flags(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], test: Callable[[Any], bool]
) -> list[bool]:
    """For each leaf of ``(args, kwargs)``: ``test`` of its schema argument (e.g. written)."""
    schema = func._schema.arguments
    by_name = {a.name: bool(test(a)) for a in schema}
    shadow_args = tuple(_filled(a, by_name[schema[i].name]) for i, a in enumerate(args))
    shadow_kwargs = {k: _filled(v, by_name.get(k, False)) for k, v in kwargs.items()}
    return tree_leaves((shadow_args, shadow_kwargs))


def _filled(tree: Any, value: bool) -> Any:
    """``tree`` with every leaf replaced by ``value`` (same structure, so same leaf order)."""
    return tree_map(lambda _: value, tree)


def layout(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    return int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype


class Recording:
    """The log of one delayed construction, while it is made and after."""

    def __init__(self) -> None:
        self.rng_state: torch.Tensor = torch.default_generator.get_state()
        self.entries: list[Entry] = []
        self.storages: list[StorageInfo] = []
        self._sids: dict[int, int] = {}  # live storage address -> sid
        self._storage_refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}
        self._versions: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._expected = self.rng_state  # the generator state the log accounts for
        self._pending = False  # random ops on meta since the generator was last brought up to date

    # -- recording -----------------------------------------------------------------------------
    def _sid(self, t: torch.Tensor, creator: int | None) -> tuple[int, bool]:
        """The storage number of meta tensor ``t``; whether it is new."""
        st = t.untyped_storage()
        key = st._cdata
        sid = self._sids.get(key)
        if sid is not None:
            return sid, False
        sid = len(self.storages)
        self.storages.append(StorageInfo(st.nbytes(), creator))
        self._sids[key] = sid
        self._storage_refs[sid] = weakref.ref(st, functools.partial(self._died, key, sid))
        with _registry_lock:
            _LIVE[key] = (self, sid)
        return sid, True

    def _died(self, key: int, sid: int, _: object) -> None:
        """Storage ``sid`` is gone: its address may be reused by a storage we never saw."""
        if self._sids.get(key) == sid:
            del self._sids[key]
        self._storage_refs.pop(sid, None)
        with _registry_lock:
            if _LIVE.get(key, (None, -1))[1] == sid and _LIVE[key][0] is self:
                del _LIVE[key]

    def _see(self, t: torch.Tensor) -> None:
        w = self._seen.get(id(t))
        if w is None or w() is not t:
            self._seen[id(t)] = weakref.ref(t)

    def log_state(self) -> None:
        """The generator was set: the replay sets its own to the same state here."""
        state = torch.default_generator.get_state()
        self.entries.append(Entry.generator_set(state))
        self._expected = state
        self._pending = False

    def _check_generator(self) -> None:
        if not torch.equal(torch.default_generator.get_state(), self._expected):
            self.log_state()  # changed behind our back (e.g. default_generator.manual_seed)

    def catch_up(self) -> None:
        """Bring the global generator to where a normal construction would have it now."""
        self._check_generator()
        if not self._pending:
            return
        gen = torch.Generator()
        gen.set_state(self.rng_state)
        with _disable_current_modes():
            Replayer(self.entries, self.storages, gen).run(
                plan(self.entries, self.storages, {}), {}, CPU, lambda n, v: None
            )
        torch.default_generator.set_state(gen.get_state())
        self._expected = gen.get_state()
        self._pending = False

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], real: bool) -> Any:
        """Run ``func`` and log it if it creates or writes a recorded storage or draws random
        numbers (``real``: an op on real CPU tensors, logged only for its random numbers)."""
        flat, spec = tree_flatten((args, kwargs))
        flags = _arg_flags(
            func, args, kwargs, lambda a: a.alias_info is not None and a.alias_info.is_write
        )
        out_flags = _arg_flags(func, args, kwargs, lambda a: bool(a.is_out))
        generator = _generator_arg(func, args, kwargs)
        rng = _SEEDED in func.tags
        bad: str | None = None
        if rng and generator is not None and generator is not torch.default_generator:
            rng, bad = False, "it draws from an explicit generator= the replay cannot reproduce"
        if rng:
            if real:
                self.catch_up()
            else:
                self._check_generator()
        index = len(self.entries)
        leaves: list[Any] = []
        written: set[int] = set()
        writes: set[int] = set()
        read_sids: set[int] = set()
        for j, x in enumerate(flat):
            if isinstance(x, torch.Tensor) and x.is_meta:
                sid, _ = self._sid(x, None)
                self._see(x)
                x = Ref(sid, *layout(x))
                if flags[j]:
                    written.add(j)
                    writes.add(sid)
                else:
                    read_sids.add(sid)
            elif isinstance(x, torch.Tensor):
                if flags[j] and real:
                    x = Scratch(x.untyped_storage().nbytes(), *layout(x))
                    written.add(j)
                else:
                    if flags[j]:
                        bad = "it writes a real tensor"
                    elif x.device.type != "cpu":
                        bad = f"it reads a tensor on {x.device}"
                    x = Const(x.detach().clone())
            elif isinstance(x, torch.device) and x.type == "meta":
                x = DEVICE
            elif isinstance(x, torch.Generator):
                x = None  # the replay passes its own
            elif isinstance(x, (torch.UntypedStorage, torch.TypedStorage)):
                bad = "it takes a storage argument"
            leaves.append(x)
        before = {s: self.storages[s].nbytes for s in writes}
        out = func(*args, **kwargs)
        creates: list[tuple[int, int]] = []
        outs: list[Ref | None] = []
        for j, o in enumerate(tree_leaves(out)):
            if isinstance(o, torch.Tensor) and o.is_meta:
                sid, new = self._sid(o, index)
                self._see(o)
                if new:
                    creates.append((sid, j))
                outs.append(Ref(sid, *layout(o)))
            else:
                outs.append(None)
        if any(self.storages[s].nbytes != self._current_nbytes(s, before[s]) for s in writes):
            bad = "it resizes a storage in place"
        if not (writes or creates or rng):
            return out  # a view or a query: later ops name the storage themselves
        # Written without being read: ``self`` of an overwriting op, and ``out=`` arguments,
        # unless the op also reads their storage through another argument.
        blind = {
            j
            for j in written
            if (out_flags[j] or (j == 0 and func in _OVERWRITE)) and leaves[j].sid not in read_sids
        }
        partly = {leaves[j].sid for j in written - blind}
        full = {
            leaves[j].sid
            for j in blind
            if leaves[j].sid not in partly
            and _covers(leaves[j], self.storages[leaves[j].sid].nbytes)
        }
        # a partial write keeps the rest of the storage: its earlier content is needed too
        reads = (read_sids | writes) - full
        self.entries.append(
            Entry(
                func=func,
                leaves=leaves,
                spec=spec,
                written=frozenset(written),
                reads=frozenset(reads),
                rng_reads=frozenset(read_sids),
                writes=frozenset(writes),
                creates=tuple(creates),
                outs=tuple(outs),
                full=frozenset(full),
                rng=rng,
                generator=_generator_mode(func) if rng else "",
                bad=bad,
                default_dtype=torch.get_default_dtype(),
                blind=frozenset(blind),
                uninitialised=func in _UNINITIALISED,
            )
        )
        if rng and real:
            self._expected = torch.default_generator.get_state()
        elif rng:
            self._pending = True
        return out

    def record_call(self, func: Callable[..., Any], args: Any, kwargs: Any, rng: bool) -> None:
        """Log a call of initialiser ``func`` (one of :data:`_SKIPPING_INITS`) on a meta
        tensor, which it would skip: the replay calls it on the real tensor."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        rest = dict(bound.arguments)
        tensor = rest.pop("tensor")
        generator = rest.pop("generator", None)
        bad = None
        if generator is not None and generator is not torch.default_generator:
            rng, bad = False, "it draws from an explicit generator= the replay cannot reproduce"
        if rng:
            self._check_generator()
        self._see(tensor)
        sid, _ = self._sid(tensor, None)
        ref = Ref(sid, *layout(tensor))
        full = frozenset({sid}) if _covers(ref, self.storages[sid].nbytes) else frozenset()
        leaves, spec = tree_flatten(((tensor,), rest))
        leaves[0] = ref
        self.entries.append(
            Entry(
                func=func,
                leaves=leaves,
                spec=spec,
                written=frozenset({0}),
                reads=frozenset() if full else frozenset({sid}),
                rng_reads=frozenset(),
                writes=frozenset({sid}),
                creates=(),
                outs=(),
                full=full,
                rng=rng,
                # on the global generator, as it ran: sparse_'s randperm takes no generator=
                generator="swap" if rng else "",
                bad=bad,
                default_dtype=torch.get_default_dtype(),
                blind=frozenset({0}),
            )
        )
        if rng:
            self._pending = True

    def _current_nbytes(self, sid: int, default: int) -> int:
        ref = self._storage_refs.get(sid)
        st = ref() if ref is not None else None
        return st.nbytes() if st is not None else default

    def finish(self) -> None:
        """The block ended: note each recorded tensor's version, to tell later in-place
        changes (which nothing records)."""
        for key, w in self._seen.items():
            t = w()
            if t is not None:
                self._versions[key] = (w, t._version)
        self._seen.clear()


class Recorder(TorchDispatchMode):
    """Hands :meth:`Recording.record` every aten op that involves the meta device, and every
    random op on real CPU tensors that draws from the global generator; runs the rest."""

    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat = tree_leaves((args, kwargs))
        meta = any(
            (isinstance(x, torch.Tensor) and x.is_meta)
            or (isinstance(x, torch.device) and x.type == "meta")
            for x in flat
        )
        if meta:
            return self.rec.record(func, args, kwargs, real=False)
        if _SEEDED in func.tags and _on_cpu(flat):
            gen = _generator_arg(func, args, kwargs)
            if gen is None or gen is torch.default_generator:
                return self.rec.record(func, args, kwargs, real=True)
        return func(*args, **kwargs)


def _on_cpu(flat: list[Any]) -> bool:
    for x in flat:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return False
        if isinstance(x, torch.device) and x.type != "cpu":
            return False
    return True


class DelayedDevice(DeviceContext):
    """``torch.device("meta")``, except that tensors made from Python data stay on CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if (
            func in _DATA_CONSTRUCTORS
            and kwargs.get("device") is None
            and not (args and isinstance(args[0], torch.Tensor))
        ):
            kwargs["device"] = CPU
        return super().__torch_function__(func, types, args, kwargs)
