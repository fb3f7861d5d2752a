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
import threading
from collections.abc import Iterator
from typing import Any

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


def tp_dropout(
    x: torch.Tensor,
    p: float,
    training: bool,
    kind: str,
    tp_group: ProcessGroup = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Inverted dropout whose mask comes from the given tensor-parallel stream.

    ``generator``, when given, is used instead of the stream's generator (recomputation
    replays a copy of the stream in the state it had during forward).
    """
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    gen = generator if generator is not None else get_generator(x.device, kind, tp_group)
    keep = dropout_mask(x, p, gen)
    return x * keep * (1.0 / (1.0 - p))
