"""The log of a delayed construction and its replay (see :mod:`smp_torch.deferred`).

A log is a list of :class:`Entry`: one aten op that wrote or created a recorded storage, or
consumed the CPU default generator, or a point where the generator's state was set. Tensors in
an entry's arguments are :class:`Ref` (a view of a recorded storage), :class:`Const` (the value
of a real tensor, captured when the op ran) or :class:`Scratch` (a real tensor a random op
wrote: only its layout matters, to consume the generator as the op did).

:func:`plan` walks the log backwards from the storages a caller wants and decides, for every
entry, whether to run it for real (RUN), only for its random numbers on scratch memory
(SCRATCH), or not at all; :class:`Replayer` then walks forwards, allocating each storage at
its first RUN entry and freeing it after its last, handing targets to the sink there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import TreeSpec, tree_leaves, tree_unflatten

from smp_torch.errors import SMPError

__all__ = ["Ref", "Const", "Scratch", "DEVICE", "Entry", "StorageInfo", "plan", "Replayer", "where"]

SKIP, RUN, SCRATCH = 0, 1, 2
CPU = torch.device("cpu")


class Ref(NamedTuple):
    """A view of recorded storage ``sid``."""

    sid: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class Const(NamedTuple):
    """A real tensor an op read, captured (cloned) when the op was recorded."""

    value: torch.Tensor


class Scratch(NamedTuple):
    """A real tensor a recorded random op wrote: replayed on fresh memory of the same layout."""

    nbytes: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _Device:
    def __repr__(self) -> str:
        return "<replay device>"


DEVICE = _Device()  # stands for the meta device in recorded arguments


@dataclass(eq=False)
class Entry:
    """One recorded op, or (``func`` None) the generator's state being set to ``state``."""

    func: Any
    leaves: list[Any]
    spec: TreeSpec | None
    written: frozenset[int]  # indices in ``leaves`` of the tensors the op writes
    reads: frozenset[int]  # storages whose earlier content the op needs when run for real
    rng_reads: frozenset[int]  # storages it needs when run only for its random numbers
    writes: frozenset[int]  # storages it writes in place
    creates: tuple[tuple[int, int], ...]  # (storage, index in its flattened outputs)
    outs: tuple[Ref | None, ...]  # the recorded layout of each flattened output
    full: frozenset[int]  # storages it overwrites entirely without reading them
    rng: bool  # consumes the CPU default generator
    generator: str  # how to hand the replay's generator to it: "kw", "overload:<name>", "swap"
    bad: str | None = None  # why it cannot be replayed
    state: torch.Tensor | None = None
    # factory ops given no dtype use the default dtype of the time they ran
    default_dtype: torch.dtype = torch.float32
    blind: frozenset[int] = frozenset()  # leaves it writes without reading (all or part)
    uninitialised: bool = False  # creates storage without writing it (torch.empty)

    @property
    def name(self) -> str:
        f = self.func
        if isinstance(f, torch._ops.OpOverload) or f is None:
            return str(f)
        return f"{f.__module__}.{f.__name__}"

    @classmethod
    def generator_set(cls, state: torch.Tensor) -> Entry:
        """The global generator was set to ``state`` here (``torch.manual_seed``...)."""
        empty: frozenset[int] = frozenset()
        return cls(
            None, [], None, empty, empty, empty, empty, (), (), empty, False, "", state=state
        )


@dataclass(eq=False)
class StorageInfo:
    nbytes: int
    creator: int | None  # index of the entry that created it; None: made outside the block


def where(name: str) -> str:
    """``name`` (a target's qualified name) as errors show it."""
    if name.startswith("<"):
        return name  # not a target: what needed it
    module, _, tensor = name.rpartition(".")
    return f"{name!r} (module {module or '<root>'!r}, tensor {tensor!r})"


def plan(
    entries: list[Entry],
    storages: list[StorageInfo],
    wanted: dict[int, str],
    strict: dict[int, list[tuple[str, Ref]]] | None = None,
) -> bytearray:
    """What to do with each entry so that storages ``wanted`` (sid -> the target name that
    needs it, for errors) end up as a normal construction leaves them, and the generator
    advances as it does there. Raises :class:`SMPError` naming the target that cannot be, and
    for the targets in ``strict`` (parameters, by storage) whose value would be memory that
    nothing wrote after ``torch.empty``."""
    actions = bytearray(len(entries))
    live = dict(wanted)  # storage -> name of a target whose value needs its current content
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        if e.func is None:
            actions[i] = RUN
            continue
        hit = next((s for s in e.writes if s in live), None)
        if hit is None:
            hit = next((s for s, _ in e.creates if s in live), None)
        if hit is not None:
            why = live[hit]
            if e.bad is not None:
                raise SMPError(
                    f"smp.delay_param_initialization: cannot materialise {where(why)}: it is "
                    f"computed by {e.name}, which cannot be replayed ({e.bad})"
                )
            actions[i] = RUN
            for s, _ in e.creates:
                live.pop(s, None)
            for s in e.full:
                live.pop(s, None)  # what was written there before is never seen
            for s in e.reads:
                live.setdefault(s, why)
        elif e.rng:
            if e.bad is not None:
                raise SMPError(
                    f"smp.delay_param_initialization: random op {e.name} cannot be replayed "
                    f"({e.bad}), so no random value drawn after it can be reproduced"
                )
            actions[i] = SCRATCH
            for s in e.rng_reads:
                live.setdefault(s, f"<input of random op {e.name}>")
    for sid, named in (strict or {}).items():
        creator = storages[sid].creator
        if creator is not None and actions[creator] == RUN and entries[creator].uninitialised:
            seen = _unwritten_read(entries, actions, sid, creator, storages[sid].nbytes, named)
            if seen is not None:
                raise SMPError(
                    f"smp.delay_param_initialization: cannot materialise {where(named[0][0])}: "
                    f"{seen} memory that nothing wrote after {entries[creator].name}, so a normal "
                    "construction leaves whatever the memory held there. Usually an initialiser "
                    "skipped it because it was on the meta device: smp records torch's own "
                    "(torch.nn.init) but not code that tests tensor.is_meta itself"
                )
    for why in live.values():  # only storages no entry created are still wanted here
        raise SMPError(
            f"smp.delay_param_initialization: cannot materialise {where(why)}: it is (or is "
            "computed from) a meta tensor made outside the delay_param_initialization() block, "
            "so there is no record of how a normal construction would fill it"
        )
    return actions


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _unwritten_read(
    entries: list[Entry],
    actions: bytearray,
    sid: int,
    creator: int,
    nbytes: int,
    named: list[tuple[str, Ref]],
) -> str | None:
    """Follow which bytes of storage ``sid`` are written after its uninitialised creation:
    how the first byte nothing wrote is observed (read by an op, or part of a target), or
    None. One byte of mask per byte of storage, for as long as the check runs."""
    mask = torch.zeros(nbytes, dtype=torch.uint8)

    def view(ref: Ref) -> torch.Tensor | None:
        kind = _INT_OF_SIZE.get(ref.dtype.itemsize)
        if kind is None or nbytes % ref.dtype.itemsize:
            return None
        return mask.view(kind).as_strided(ref.size, ref.stride, ref.offset)

    def ones(v: torch.Tensor) -> int:  # every bit set
        return 255 if v.dtype == torch.uint8 else -1

    def written(v: torch.Tensor) -> bool:
        return bool((v == ones(v)).all())

    for i in range(creator + 1, len(entries)):
        e = entries[i]
        if actions[i] != RUN or e.func is None:
            continue
        for j, x in enumerate(e.leaves):
            if not (isinstance(x, Ref) and x.sid == sid):
                continue
            v = view(x)
            if v is None:
                return None  # a layout the mask cannot follow: do not refuse
            if j not in e.blind and not written(v):
                return f"{e.name} reads"
            if j in e.written:
                v.fill_(ones(v))
        if bool(mask.all()):
            return None
    for _, ref in named:
        v = view(ref)
        if v is not None and not written(v):
            return "its value is"
    return None


@contextlib.contextmanager
def _on_default_generator(gen: torch.Generator) -> Iterator[None]:
    """Run an op that has no generator argument on ``gen``'s state, then put the global
    generator back (a short window in which the global generator holds ``gen``'s state)."""
    saved = torch.default_generator.get_state()
    torch.default_generator.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(torch.default_generator.get_state())
        torch.default_generator.set_state(saved)


class Replayer:
    """Runs a plan on CPU, handing each target to ``sink`` after the last entry touching it.

    ``peak_bytes`` is the most memory the replayer held at once: live storages plus the
    scratch of the op running.
    """

    def __init__(
        self,
        entries: list[Entry],
        storages: list[StorageInfo],
        gen: torch.Generator,
    ) -> None:
        self.entries = entries
        self.storages = storages
        self.gen = gen
        self.real: dict[int, torch.UntypedStorage] = {}
        self.held = 0
        self.peak = 0

    # -- memory ------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, device=CPU).untyped_storage()

    def _hold(self, sid: int, st: torch.UntypedStorage) -> None:
        self.real[sid] = st
        self.held += st.nbytes()
        self.peak = max(self.peak, self.held)

    def _storage(self, sid: int) -> torch.UntypedStorage:
        st = self.real.get(sid)
        if st is None:  # first use is a full overwrite (or a dead write): no need to fill it
            st = self._alloc(self.storages[sid].nbytes)
            self._hold(sid, st)
        return st

    def _release(self, sid: int) -> None:
        st = self.real.pop(sid, None)
        if st is not None:
            self.held -= st.nbytes()

    @staticmethod
    def view(st: torch.UntypedStorage, layout: Ref | Scratch) -> torch.Tensor:
        t = torch.empty(0, dtype=layout.dtype, device=CPU)
        t.set_(st, layout.offset, layout.size, layout.stride)
        return t

    # -- one entry ---------------------------------------------------------------------------
    def _args(self, e: Entry, scratch_writes: bool) -> tuple[tuple[Any, ...], dict[str, Any], int]:
        leaves: list[Any] = []
        extra = 0
        for j, x in enumerate(e.leaves):
            if isinstance(x, Ref):
                if scratch_writes and j in e.written:
                    nbytes = self.storages[x.sid].nbytes
                    extra += nbytes
                    x = self.view(self._alloc(nbytes), x)
                elif j in e.written:
                    x = self.view(self._storage(x.sid), x)
                else:
                    assert x.sid in self.real, f"{e.name} reads storage {x.sid} before it exists"
                    x = self.view(self.real[x.sid], x)
            elif isinstance(x, Scratch):
                extra += x.nbytes
                x = self.view(self._alloc(x.nbytes), x)
            elif isinstance(x, Const):
                x = x.value
            elif x is DEVICE:
                x = CPU
            leaves.append(x)
        assert e.spec is not None
        args, kwargs = tree_unflatten(leaves, e.spec)
        return tuple(args), dict(kwargs), extra

    def _call(self, e: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not isinstance(e.func, torch._ops.OpOverload):
            # a Python initialiser: tensors it makes without a device go where a normal CPU
            # construction puts them, whatever the default device (a block's meta) is now
            with torch.device(CPU):
                return self._call_op(e, args, kwargs)
        return self._call_op(e, args, kwargs)

    def _call_op(self, e: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not e.rng:
            return e.func(*args, **kwargs)
        how = e.generator
        if how == "kw":
            return e.func(*args, **{**kwargs, "generator": self.gen})
        if how.startswith("overload:"):
            func = getattr(e.func._overloadpacket, how.partition(":")[2])
            return func(*args, **{**kwargs, "generator": self.gen})
        with _on_default_generator(self.gen):
            return e.func(*args, **kwargs)

    def _adopt_outputs(self, e: Entry, out: Any) -> None:
        flat = tree_leaves(out)
        for sid, j in e.creates:
            if sid in self.real:
                continue
            o, ref = flat[j], e.outs[j]
            assert isinstance(o, torch.Tensor) and ref is not None
            nbytes = self.storages[sid].nbytes
            st = o.untyped_storage()
            same = (
                o.dtype == ref.dtype
                and o.storage_offset() == ref.offset
                and tuple(o.shape) == ref.size
                and tuple(o.stride()) == ref.stride
                and st.nbytes() == nbytes
            )
            if not same:  # CPU chose another layout than meta did: keep the recorded one
                st = self._alloc(nbytes)
                self.view(st, ref).copy_(o)
            self._hold(sid, st)

    def run_entry(self, e: Entry, action: int) -> None:
        if e.func is None:
            assert e.state is not None
            self.gen.set_state(e.state)
            return
        args, kwargs, extra = self._args(e, scratch_writes=action == SCRATCH)
        self.peak = max(self.peak, self.held + extra)
        default = torch.get_default_dtype()
        if e.default_dtype != default:
            torch.set_default_dtype(e.default_dtype)
        try:
            out = self._call(e, args, kwargs)
        finally:
            if e.default_dtype != default:
                torch.set_default_dtype(default)
        if action == RUN:
            self._adopt_outputs(e, out)
            self.peak = max(self.peak, self.held + extra)

    # -- the whole log -----------------------------------------------------------------------
    def run(
        self,
        actions: bytearray,
        targets: dict[str, Ref],
        device: torch.device,
        sink: Callable[[str, torch.Tensor], None],
    ) -> None:
        last: dict[int, int] = {}  # storage -> the last entry that uses its memory
        for i, e in enumerate(self.entries):
            if e.func is None or actions[i] == SKIP:
                continue
            for j, x in enumerate(e.leaves):
                if isinstance(x, Ref) and (actions[i] == RUN or j not in e.written):
                    last[x.sid] = i
            if actions[i] == RUN:
                for s, _ in e.creates:
                    last[s] = i
        due: dict[int, list[int]] = {}
        for s, i in last.items():
            due.setdefault(i, []).append(s)
        by_sid: dict[int, list[tuple[str, Ref]]] = {}
        for name, ref in targets.items():
            by_sid.setdefault(ref.sid, []).append((name, ref))
        missing = [n for n, r in targets.items() if r.sid not in last]
        assert not missing, f"planner left targets without a producer: {missing}"
        with torch.no_grad():
            for i, e in enumerate(self.entries):
                if actions[i] == SKIP:
                    continue
                self.run_entry(e, actions[i])
                for s in due.get(i, ()):
                    self._deliver(by_sid.pop(s, []), s, device, sink)
                    self._release(s)

    def _deliver(
        self,
        named: list[tuple[str, Ref]],
        sid: int,
        device: torch.device,
        sink: Callable[[str, torch.Tensor], None],
    ) -> None:
        cache: dict[Ref, torch.Tensor] = {}
        for name, ref in named:
            value = cache.get(ref)
            if value is None:
                value = self.view(self.real[sid], ref)
                if device != CPU:
                    value = value.to(device)
                cache[ref] = value
            sink(name, value)
        cache.clear()
