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
"""

from __future__ import annotations

import threading

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
            gen = torch.Generator(device=device)
            gen.manual_seed(_seed + (2718 + rank if kind == "tp_rank" else 0))
            _generators[key] = gen
        return gen


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
