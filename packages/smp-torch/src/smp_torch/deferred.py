"""Exact delayed parameter initialisation: record a construction on ``meta``, replay parts of it.

Inside :func:`recording` (what ``smp.delay_param_initialization()`` enters) a model is built
on the ``meta`` device, so it takes no memory, while a ``TorchDispatchMode`` writes down every
aten op that creates or writes a meta tensor (``empty``, ``normal_``, ``copy_``, ``arange``,
in-place ops on views...) and every random op on a real CPU tensor. Later,
:meth:`DeferredInit.replay` runs the part of that log a rank needs, on CPU, and yields values
bitwise equal to what a normal CPU construction with the same generator state makes: the
model's own init scheme (Hugging Face's ``post_init``), computed buffers (rotary
``inv_freq``), tied weights and in-place edits of slices included, since they are the same ops
on the same layouts with the same random numbers.

How the log is kept:

- Tensors are known by their *storage* (views share it), numbered in the order first seen
  (``sid``); an op's tensor arguments are kept as (sid, offset, size, stride, dtype), real
  tensors it reads as cloned constants, ``device=meta`` as "the replay's device". A parameter
  (``nn.Parameter`` keeps its data's storage) maps back to the storage that was recorded.
- A registry maps each live recorded storage to its recording, so :meth:`DeferredInit.of`
  finds it from a module; entries go when the storage dies (a weak reference on it), so the
  recording lives exactly as long as some of its tensors do and a reused address is never
  mistaken for an old storage.
- Tensors made from Python data (``torch.tensor``, ``as_tensor``, ``asarray``) stay real CPU
  tensors inside the block, as in a normal construction: they are small, and code probes
  ``torch.tensor([]).device`` to tell a meta construction — Hugging Face's ``init_weights``
  skips the model's whole initialisation when it sees ``meta`` there.

Random numbers: the recording does not draw the numbers of random ops on meta tensors, so the
global CPU generator is *not* advanced for them (a normal construction advances it); after a
replay, :attr:`DeferredInit.rng_state_after` is the state a normal construction leaves at the
end of the block. Wherever code inside the block can observe the generator, the recording
brings it up to date first (by drawing the pending numbers on scratch memory), so what it
sees is exact: before a random op on a real CPU tensor, and in ``torch.get_rng_state()``
(hence ``torch.random.fork_rng``). ``torch.manual_seed``, ``torch.seed`` and
``torch.set_rng_state`` inside the block are logged and honoured by the replay. Not seen:
methods called directly on ``torch.default_generator`` (a change of its state is still
noticed at the next random op and honoured as a reseed) and random numbers drawn outside torch
ops. A random op given an explicit ``generator=`` cannot be replayed: a target that needs it
raises :class:`SMPError`.

Replay (:mod:`smp_torch.deferred_replay`) runs only the ops the wanted storages depend on,
every other random op only for its random numbers (on scratch memory, freed at once), and
skips the rest; it allocates a storage at its last full overwrite (``normal_``, ``fill_``,
``copy_`` into the whole storage...) and frees it as soon as its targets are handed to the
caller's ``sink``, so peak memory is about one tensor, not the model. It uses a private
``torch.Generator``; ops without a generator argument (``rand_like``, dropout) borrow the
global one for the call and put its state back.

A meta tensor with no recorded producer (made outside the block, or changed in place on meta
after it ended), an op that cannot be replayed, or an explicit generator raises
:class:`SMPError` naming the module and tensor; nothing falls back to ``reset_parameters``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
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
    _where,
    plan,
)
from smp_torch.errors import SMPError

__all__ = ["DeferredInit", "materialize", "recording"]

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

_registry_lock = threading.RLock()
_LIVE: dict[int, tuple[DeferredInit, int]] = {}  # storage address -> (recording, sid)
_local = threading.local()


def _active() -> DeferredInit | None:
    return getattr(_local, "active", None)


def _lookup(t: torch.Tensor) -> tuple[DeferredInit, int] | None:
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
    for n, st in sorted(((n, st) for n, st in zip(ref.size, ref.stride) if n != 1), key=lambda p: p[1]):
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


def _write_flags(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[bool]:
    """For each leaf of ``(args, kwargs)``: whether the op writes it (from its schema)."""
    schema = func._schema.arguments
    by_name = {a.name: bool(a.alias_info is not None and a.alias_info.is_write) for a in schema}
    shadow_args = tuple(
        tree_map(lambda _, w=by_name[schema[i].name]: w, a) for i, a in enumerate(args)
    )
    shadow_kwargs = {k: tree_map(lambda _, w=by_name.get(k, False): w, v) for k, v in kwargs.items()}
    return tree_leaves((shadow_args, shadow_kwargs))


def _layout(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


class DeferredInit:
    """The recording of one delayed construction, and its replay.

    Made by :func:`recording` (``smp.delay_param_initialization()``); find it with
    :meth:`of`. ``rng_state`` is the CPU generator state at the block's entry: a caller may
    replace it (e.g. with rank 0's, so that ranks agree). After :meth:`replay`,
    ``rng_state_after`` is the state a normal construction would leave the generator in, and
    ``peak_bytes`` the most memory the replay held at once.
    """

    def __init__(self) -> None:
        self.rng_state: torch.Tensor = torch.default_generator.get_state()
        self.rng_state_after: torch.Tensor | None = None
        self.peak_bytes = 0
        self.entries: list[Entry] = []
        self.storages: list[StorageInfo] = []
        self._sids: dict[int, int] = {}  # live storage address -> sid
        self._storage_refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}
        self._versions: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._expected = self.rng_state  # the generator state the log accounts for
        self._pending = False  # random ops on meta since the generator was last brought up to date

    # -- public API ----------------------------------------------------------------------------
    @classmethod
    def of(cls, module: nn.Module) -> DeferredInit:
        """The recording that built ``module``'s meta tensors."""
        found: dict[int, DeferredInit] = {}
        outside: list[str] = []
        for name, t in _named_tensors(module):
            if not t.is_meta:
                continue
            hit = _lookup(t)
            if hit is None:
                outside.append(name)
            else:
                found[id(hit[0])] = hit[0]
        what = f"module {type(module).__name__}"
        if len(found) > 1:
            raise SMPError(
                f"{what} has meta tensors from {len(found)} different "
                "smp.delay_param_initialization() blocks; build it in one"
            )
        if not found:
            if outside:
                raise SMPError(
                    f"{what} has meta tensors ({', '.join(outside[:3])}"
                    f"{', ...' if len(outside) > 3 else ''}) that were not created under "
                    "smp.delay_param_initialization(), so there is no record of how to "
                    "initialise them (plain torch.device('meta') records nothing)"
                )
            raise SMPError(f"{what} has no meta parameters or buffers: nothing to materialise")
        return next(iter(found.values()))

    def targets(
        self, module: nn.Module, names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """``module``'s meta parameters and buffers by qualified name (tied names all present),
        restricted to ``names``. Call it before the module's tensors are swapped."""
        index = dict(_named_tensors(module))
        wanted = list(index) if names is None else list(names)
        unknown = [n for n in wanted if n not in index]
        if unknown:
            raise SMPError(
                f"module {type(module).__name__} has no parameter or buffer {unknown[0]!r}"
            )
        out: dict[str, torch.Tensor] = {}
        for name in wanted:
            t = index[name]
            if not t.is_meta:
                continue
            self._check_target(name, t)
            seen = self._versions.get(id(t))
            if seen is not None and seen[0]() is t and t._version != seen[1]:
                raise SMPError(
                    f"smp.delay_param_initialization: {_where(name)} was changed in place "
                    "after the block ended, where nothing records it; do it inside the block"
                )
            out[name] = t
        return out

    def replay(
        self,
        targets: dict[str, torch.Tensor],
        device: torch.device,
        sink: Callable[[str, torch.Tensor], None],
        rng_state: torch.Tensor | None = None,
    ) -> None:
        """Call ``sink(name, value)`` once per target, ``value`` a real tensor on ``device``
        bitwise equal to the tensor a normal CPU construction makes (tied names: the same
        value), as soon as the last op writing it has run: the replay keeps no reference
        after, so a sink that keeps a slice lets the rest be freed."""
        refs: dict[str, Ref] = {}
        wanted: dict[int, str] = {}
        for name, t in targets.items():
            sid = self._check_target(name, t)
            refs[name] = Ref(sid, *_layout(t))
            wanted.setdefault(sid, name)
        actions = plan(self.entries, self.storages, wanted)
        gen = torch.Generator()
        gen.set_state(self.rng_state if rng_state is None else rng_state)
        replayer = Replayer(self.entries, self.storages, gen)
        with _disable_current_modes():
            replayer.run(actions, refs, torch.device(device), sink)
        self.rng_state_after = gen.get_state()
        self.peak_bytes = replayer.peak

    def _check_target(self, name: str, t: torch.Tensor) -> int:
        hit = _lookup(t) if t.is_meta else None
        if hit is None or hit[0] is not self:
            raise SMPError(
                f"smp.delay_param_initialization: {_where(name)} is "
                + ("not a meta tensor" if not t.is_meta else "a meta tensor made outside this block")
                + ", so this recording cannot materialise it"
            )
        return hit[1]

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
        self._storage_refs[sid] = weakref.ref(st, lambda _, k=key, s=sid: self._died(k, s))
        with _registry_lock:
            _LIVE[key] = (self, sid)
        return sid, True

    def _died(self, key: int, sid: int) -> None:
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

    def _log_state(self) -> None:
        """The generator was set: the replay sets its own to the same state here."""
        state = torch.default_generator.get_state()
        self.entries.append(Entry(None, [], None, frozenset(), frozenset(), frozenset(),
                                  frozenset(), (), (), None, False, "", state=state))
        self._expected = state
        self._pending = False

    def _check_generator(self) -> None:
        if not torch.equal(torch.default_generator.get_state(), self._expected):
            self._log_state()  # changed behind our back (e.g. default_generator.manual_seed)

    def _catch_up(self) -> None:
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

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], real: bool) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        flags = _write_flags(func, args, kwargs)
        generator = _generator_arg(func, args, kwargs)
        rng = _SEEDED in func.tags
        bad: str | None = None
        if rng and generator is not None and generator is not torch.default_generator:
            rng, bad = False, "it draws from an explicit generator= the replay cannot reproduce"
        if rng:
            if real:
                self._catch_up()
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
                x = Ref(sid, *_layout(x))
                if flags[j]:
                    written.add(j)
                    writes.add(sid)
                else:
                    read_sids.add(sid)
            elif isinstance(x, torch.Tensor):
                if flags[j] and real:
                    x = Scratch(x.untyped_storage().nbytes(), *_layout(x))
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
                outs.append(Ref(sid, *_layout(o)))
            else:
                outs.append(None)
        if any(self.storages[s].nbytes != self._current_nbytes(s, before[s]) for s in writes):
            bad = "it resizes a storage in place"
        if not (writes or creates or rng):
            return out  # a view or a query: later ops name the storage themselves
        full = None
        first = leaves[0] if leaves else None
        if (
            func in _OVERWRITE
            and 0 in written
            and isinstance(first, Ref)
            and first.sid not in read_sids
            and _covers(first, self.storages[first.sid].nbytes)
        ):
            full = first.sid
        # a partial write keeps the rest of the storage: its earlier content is needed too
        reads = (read_sids | writes) - ({full} if full is not None else set())
        self.entries.append(Entry(
            func, leaves, spec, frozenset(written), frozenset(reads), frozenset(read_sids),
            frozenset(writes), tuple(creates), tuple(outs), full, rng,
            _generator_mode(func) if rng else "", bad,
        ))
        if rng and real:
            self._expected = torch.default_generator.get_state()
        elif rng:
            self._pending = True
        return out

    def _current_nbytes(self, sid: int, default: int) -> int:
        ref = self._storage_refs.get(sid)
        st = ref() if ref is not None else None
        return st.nbytes() if st is not None else default

    def _finish(self) -> None:
        for key, w in self._seen.items():
            t = w()
            if t is not None:
                self._versions[key] = (w, t._version)
        self._seen.clear()


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


class _Recorder(TorchDispatchMode):
    def __init__(self, rec: DeferredInit) -> None:
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
            return self.rec._record(func, args, kwargs, real=False)
        if _SEEDED in func.tags and _on_cpu(flat):
            gen = _generator_arg(func, args, kwargs)
            if gen is None or gen is torch.default_generator:
                return self.rec._record(func, args, kwargs, real=True)
        return func(*args, **kwargs)


def _on_cpu(flat: list[Any]) -> bool:
    for x in flat:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return False
        if isinstance(x, torch.device) and x.type != "cpu":
            return False
    return True


class _DelayedDevice(DeviceContext):
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


# -- the generator's Python entry points, watched while a block records ------------------------
_patch_lock = threading.Lock()
_patch_depth = 0
_originals: dict[str, Any] = {}
_RNG_FUNCS = ("manual_seed", "seed", "set_rng_state", "get_rng_state")


def _watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _active()
        if rec is None:
            return original(*args, **kwargs)
        if name == "get_rng_state":
            rec._catch_up()
            return original(*args, **kwargs)
        result = original(*args, **kwargs)
        rec._log_state()
        return result

    wrapper.__name__ = name
    wrapper.__doc__ = original.__doc__
    return wrapper


def _patch(on: bool) -> None:
    global _patch_depth
    with _patch_lock:
        if on:
            _patch_depth += 1
            if _patch_depth == 1:
                for name in _RNG_FUNCS:
                    original = getattr(torch.random, name)
                    _originals[name] = original
                    wrapped = _watched(name, original)
                    setattr(torch.random, name, wrapped)
                    setattr(torch, name, wrapped)
        else:
            _patch_depth -= 1
            if _patch_depth == 0:
                for name, original in _originals.items():
                    setattr(torch.random, name, original)
                    setattr(torch, name, original)
                _originals.clear()


@contextlib.contextmanager
def recording() -> Iterator[DeferredInit]:
    """Build on ``meta`` and record how (``smp.delay_param_initialization()``). Nested, the
    inner block is part of the outer recording."""
    outer = _active()
    if outer is not None:
        yield outer
        return
    rec = DeferredInit()
    _patch(True)
    try:
        with _DelayedDevice("meta"), _Recorder(rec):
            _local.active = rec
            try:
                yield rec
            finally:
                _local.active = None
    finally:
        _patch(False)
        rec._finish()


def materialize(
    module: nn.Module,
    device: torch.device,
    names: Iterable[str] | None = None,
    rng_state: torch.Tensor | None = None,
) -> None:
    """Replace ``module``'s meta parameters and buffers (all, or those named) by real ones on
    ``device``, in place: parameters stay parameters (same class, ``requires_grad`` and
    attributes), tied parameters stay one object, buffers keep their persistence."""
    deferred = DeferredInit.of(module)
    targets = deferred.targets(module, names)
    slots: dict[str, tuple[nn.Module, str, bool]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, p in m._parameters.items():
            if p is not None and f"{dot}{attr}" in targets:
                slots[f"{dot}{attr}"] = (m, attr, True)
        for attr, b in m._buffers.items():
            if b is not None and f"{dot}{attr}" in targets:
                slots[f"{dot}{attr}"] = (m, attr, False)
    made: dict[tuple[int, bool], torch.Tensor] = {}

    def put(name: str, value: torch.Tensor) -> None:
        owner, attr, is_param = slots[name]
        old = targets[name]
        new = made.get((id(old), is_param))
        if new is None:
            new = _as_parameter(old, value) if is_param else value
            made[(id(old), is_param)] = new
        if is_param:
            owner._parameters[attr] = new  # type: ignore[assignment]
        else:
            owner._buffers[attr] = new

    deferred.replay(targets, device, put, rng_state)


def _as_parameter(old: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    if type(old) is nn.Parameter:
        new = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        new = torch.Tensor._make_subclass(type(old), value, old.requires_grad)
    new.__dict__.update(old.__dict__)  # marks such as smp-tp's _smp_tp_spec, HF's flags
    return new
