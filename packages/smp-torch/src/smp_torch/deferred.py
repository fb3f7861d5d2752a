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
- ``torch.nn.init.trunc_normal_``, ``orthogonal_``, ``sparse_`` and ``dirac_`` return at once
  on a meta tensor, where no mode sees them; while a block records, their code is swapped for
  a hook that logs the call itself (references taken earlier, like Hugging Face's, included),
  and the replay calls the function on the real tensor. Other code that tests
  ``tensor.is_meta`` and skips work cannot be seen: when that leaves a *parameter* holding
  bytes nothing wrote after ``torch.empty`` (garbage in a normal construction too), the replay
  refuses it rather than hand out garbage; buffers (caches) are handed out as they are.
- Factory ops given no dtype replay under the default dtype they ran under.

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
caller's ``sink``, so peak memory is about one tensor, not the model (a 95M-parameter Llama:
+55 to +62 MiB peak RSS for 364 MiB of parameters, ``benchmarks/bench_deferred_init.py``). It
uses a private ``torch.Generator``; ops without a generator argument (``rand_like``,
dropout, the logged ``torch.nn.init`` calls) borrow the global one for the call and put its
state back. Every random op of the log runs on every replay, so a replay costs at least the
random-number work of the whole construction, whatever share it materialises.

A meta tensor with no recorded producer (made outside the block, or converted or changed in
place on meta after it ended), an op that cannot be replayed, an explicit generator, or a
parameter nothing initialised raises :class:`SMPError` naming the module and tensor; nothing
falls back to ``reset_parameters``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from smp_torch.deferred_hooks import watch_entry_points
from smp_torch.deferred_record import (
    DelayedDevice,
    Recorder,
    Recording,
    active,
    layout,
    lookup,
    set_active,
)
from smp_torch.deferred_replay import Ref, Replayer, plan, where
from smp_torch.errors import SMPError

__all__ = ["DeferredInit", "materialize", "recording"]


class DeferredInit(Recording):
    """The recording of one delayed construction, and its replay.

    Made by :func:`recording` (``smp.delay_param_initialization()``); find it with
    :meth:`of`. ``rng_state`` is the CPU generator state at the block's entry: a caller may
    replace it (e.g. with rank 0's, so that ranks agree). After :meth:`replay`,
    ``rng_state_after`` is the state a normal construction would leave the generator in, and
    ``peak_bytes`` the most memory the replay held at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rng_state_after: torch.Tensor | None = None
        self.peak_bytes = 0

    # -- public API ----------------------------------------------------------------------------
    @classmethod
    def of(cls, module: nn.Module) -> DeferredInit:
        """The recording that built ``module``'s meta tensors."""
        found: dict[int, DeferredInit] = {}
        outside: list[str] = []
        for name, t in _named_tensors(module):
            if not t.is_meta:
                continue
            hit = lookup(t)
            if hit is None:
                outside.append(name)
            elif isinstance(hit[0], DeferredInit):
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
            version = t._version
            seen = self._versions.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] != version:
                raise SMPError(
                    f"smp.delay_param_initialization: {where(name)} was changed in place "
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
        params: dict[int, list[tuple[str, Ref]]] = {}
        for name, t in targets.items():
            sid = self._check_target(name, t)
            refs[name] = Ref(sid, *layout(t))
            wanted.setdefault(sid, name)
            if isinstance(t, nn.Parameter):
                params.setdefault(sid, []).append((name, refs[name]))
        actions = plan(self.entries, self.storages, wanted, strict=params)
        gen = torch.Generator()
        gen.set_state(self.rng_state if rng_state is None else rng_state)
        replayer = Replayer(self.entries, self.storages, gen)
        with _disable_current_modes():
            replayer.run(actions, refs, torch.device(device), sink)
        self.rng_state_after = gen.get_state()
        self.peak_bytes = replayer.peak

    def _check_target(self, name: str, t: torch.Tensor) -> int:
        hit = lookup(t) if t.is_meta else None
        if hit is None or hit[0] is not self:
            raise SMPError(
                f"smp.delay_param_initialization: {where(name)} is "
                + (
                    "not a meta tensor"
                    if not t.is_meta
                    else "a meta tensor made outside this block (by .to(), .half()... after "
                    "it? convert inside the block)"
                )
                + ", so this recording cannot materialise it"
            )
        return hit[1]


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


@contextlib.contextmanager
def recording() -> Iterator[DeferredInit]:
    """Build on ``meta`` and record how (``smp.delay_param_initialization()``). Nested, the
    inner block is part of the outer recording."""
    outer = active()
    if isinstance(outer, DeferredInit):
        yield outer
        return
    rec = DeferredInit()
    watch_entry_points(True)
    try:
        with DelayedDevice("meta"), Recorder(rec):
            set_active(rec)
            try:
                yield rec
            finally:
                set_active(None)
    finally:
        watch_entry_points(False)
        rec.finish()


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
        new = torch.Tensor._make_subclass(type(old), value, old.requires_grad)  # type: ignore[assignment]
    new.__dict__.update(old.__dict__)  # marks such as smp-tp's _smp_tp_spec, HF's flags
    return new
