"""Dropout random streams for tensor-parallel regions.

Two streams per device, both derived from ``tensor_parallel_seed``:

* ``"tp_rank"`` — seeded with ``seed + 2718 + tp_rank``: different on every TP rank, used
  for dropout on activations that are *sharded* across the group (attention probabilities
  of local heads, everything in ``optimize="memory"``), and to initialise parameter shards.
* ``"tp_shared"`` — seeded with ``seed`` alone: identical on every TP rank, used for dropout
  on activations that are *replicated* inside a TP region (``optimize="speed"`` hidden
  dropout) and to initialise replicated parameters, so replicas never diverge.

Everything outside TP regions uses torch's default generator (the data-parallel stream,
which the user or the umbrella seeds). Dropout here draws its mask from a
``torch.Generator`` passed explicitly, so no global RNG state is swapped and worker threads
do not race on it.

Activation checkpointing restores only torch's default generators before recomputing, so
pass :func:`checkpoint_context` as ``context_fn`` to
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the recomputation then
replays these streams too (same dropout masks as the forward).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

try:  # packs dropout masks in one pass; torch runs without numpy, so it stays optional
    import numpy as _np
except ImportError:  # pragma: no cover - the torch passes below do the same, slower
    _np = None  # type: ignore[assignment]

import torch

from smp_tp.group import ProcessGroup, tp_rank

_seed = 0
_generators: dict[tuple[str, str, int, int], torch.Generator] = {}
_lock = threading.Lock()


def set_tensor_parallel_seed(seed: int) -> None:
    """Set ``tensor_parallel_seed`` and restart both streams from it."""
    global _seed
    with _lock:
        _seed = int(seed)
        _generators.clear()


_Key = tuple[str, str, int, int]


def _fresh(key: _Key) -> torch.Generator:
    device, kind, rank, seed = key
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + (2718 + rank if kind == "tp_rank" else 0))
    return gen


def get_generator(device: torch.device | str, kind: str, tp_group: ProcessGroup = None) -> torch.Generator:
    """The ``"tp_rank"`` or ``"tp_shared"`` generator for ``device``."""
    if kind not in ("tp_rank", "tp_shared"):
        raise ValueError(f"unknown random stream {kind!r}; use 'tp_rank' or 'tp_shared'")
    device = torch.device(device)
    rank = tp_rank(tp_group) if kind == "tp_rank" else -1
    key = (str(device), kind, rank, _seed)
    with _lock:
        gen = _generators.get(key)
        if gen is None:
            gen = _generators[key] = _fresh(key)
        return gen


def get_rng_state() -> dict[_Key, torch.Tensor]:
    """The state of every tensor-parallel stream created so far."""
    with _lock:
        return {k: g.get_state() for k, g in _generators.items()}


def set_rng_state(states: dict[_Key, torch.Tensor]) -> None:
    """Put the streams back to ``states``; streams created since restart from their seed."""
    with _lock:
        for key in list(_generators):
            if key not in states:
                _generators[key] = _fresh(key)
        for key, state in states.items():
            gen = _generators.get(key)
            if gen is None:
                gen = _generators[key] = _fresh(key)
            gen.set_state(state)


def checkpoint_context() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

    The first context records the streams' state when the checkpointed forward starts; the
    second replays the recomputation from that state, then puts the streams back where
    they were, so recomputing draws the forward's dropout masks and moves nothing on.
    """
    saved: dict[_Key, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved.update(get_rng_state())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        now = get_rng_state()
        set_rng_state(saved)
        try:
            yield
        finally:
            set_rng_state(now)

    return forward(), recompute()


def dropout_mask(x: torch.Tensor, p: float, gen: torch.Generator | None) -> torch.Tensor:
    """The keep mask (bool) of inverted dropout with drop probability ``p``, drawn from ``gen``."""
    return torch.rand(x.shape, generator=gen, device=x.device) >= p


def _numpy_ok(t: torch.Tensor) -> bool:
    return _np is not None and t.device.type == "cpu"


def pack_mask(keep: torch.Tensor) -> torch.Tensor:
    """A bool mask as bits: a flat uint8 tensor of ``ceil(numel / 8)`` bytes (bit ``i`` of
    byte ``j`` is element ``8 j + i``; padding bits are 0).

    On CPU with numpy present this is one ``numpy.packbits`` pass (about 20x faster than the
    torch passes, which serve other devices and numpy-less installs); both give the same bytes.
    """
    flat = keep.reshape(-1)
    if _numpy_ok(flat):
        return torch.from_numpy(_np.packbits(flat.numpy(), bitorder="little"))
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    rows = flat.view(torch.uint8).view(-1, 8)
    bits = rows[:, 0].clone()
    for i in range(1, 8):  # eight strided passes over numel/8 bytes: cheaper than one sum
        bits |= rows[:, i] << i
    return bits


def unpack_mask(bits: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The bool mask of ``shape`` that :func:`pack_mask` turned into ``bits``."""
    count = math.prod(shape)
    if _numpy_ok(bits):
        ones = _np.unpackbits(bits.numpy(), count=count, bitorder="little")
        return torch.from_numpy(ones.view(_np.bool_)).view(tuple(shape))
    rows = torch.empty(bits.numel(), 8, dtype=torch.uint8, device=bits.device)
    for i in range(8):
        torch.bitwise_and(bits >> i, 1, out=rows[:, i])
    return rows.view(-1)[:count].view(torch.bool).view(tuple(shape))


class MaskTape:
    """The dropout keep-masks one recomputed function draws, in order.

    On the first run (``bits=None``) each mask is drawn from ``generator`` and kept packed
    (:attr:`bits`, one bit per element: 1/32 of a float mask); a tape made from those bits
    hands the same masks back, in the same order, without drawing. Recomputing the
    attention core this way costs one unpacking pass per mask instead of redrawing it (on CPU
    drawing the numbers is the dearest step of that core: about 1.7 ms of its ~4 ms for
    8 samples x 4 heads x 128^2) and needs no generator state.
    """

    def __init__(self, generator: torch.Generator | None, bits: Sequence[torch.Tensor] | None = None) -> None:
        self.generator = generator
        self.bits: list[torch.Tensor] = list(bits) if bits is not None else []
        self._replaying = bits is not None
        self._next = 0

    def keep(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """The keep mask for ``x`` (drop probability ``p``): drawn and recorded, or replayed."""
        if self._replaying:
            bits = self.bits[self._next]
            self._next += 1
            return unpack_mask(bits, x.shape)
        keep = dropout_mask(x, p, self.generator)
        self.bits.append(pack_mask(keep))
        return keep


def tp_dropout(
    x: torch.Tensor,
    p: float,
    training: bool,
    kind: str,
    tp_group: ProcessGroup = None,
    generator: torch.Generator | MaskTape | None = None,
) -> torch.Tensor:
    """Inverted dropout whose mask comes from the given tensor-parallel stream.

    ``generator``, when given, is used instead of the stream's generator: a copy of the
    stream in the state it had during forward, or a :class:`MaskTape` that records the masks
    (or replays them, when recomputing).
    """
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    if isinstance(generator, MaskTape):
        keep = generator.keep(x, p)
    else:
        gen = generator if generator is not None else get_generator(x.device, kind, tp_group)
        keep = dropout_mask(x, p, gen)
    return x * keep * (1.0 / (1.0 - p))
