"""Marks a user puts on modules before wrapping them: partition, checkpointing, delayed init.

- ``with smp.partition(i):`` — modules *created* inside go to pipeline stage ``i`` (when
  ``auto_partition`` is False; with auto partitioning the marks are ignored). An unmarked module
  follows its parent; the root follows ``default_partition``.
- ``smp.set_partition(module, i)`` — the same for an existing module.
- ``smp.set_activation_checkpointing(module, preserve_rng_state=True, pack_args_as_tuple=False,
  strategy="each")`` — recompute the module's activations in backward.
- ``with smp.delay_param_initialization():`` — parameters and buffers are created on the
  ``meta`` device (no memory) while the construction is recorded, so that only what a rank
  owns is later materialised, bitwise as a normal construction makes it
  (:mod:`smp_torch.deferred`).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

from smp_pipeline.checkpointing import CheckpointOptions
from smp_tp.init_hooks import module_init_hook
from torch import nn

from smp_torch.deferred import recording

__all__ = [
    "partition",
    "set_partition",
    "get_partition_mark",
    "set_activation_checkpointing",
    "get_checkpoint_mark",
    "checkpoint_options",
    "delay_param_initialization",
]

_PARTITION_ATTR = "_smp_partition"
_CHECKPOINT_ATTR = "_smp_checkpoint"
_local = threading.local()


def _current_partition() -> int | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def _mark_partition(module: nn.Module) -> None:
    mark = _current_partition()
    if mark is not None and _PARTITION_ATTR not in module.__dict__:
        object.__setattr__(module, _PARTITION_ATTR, mark)


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Assign every module created inside the block (in this thread) to pipeline stage
    ``index``; nested blocks: the innermost decides. Goes through smp-tp's one wrapper of
    ``nn.Module.__init__``, so it nests and interleaves with ``smp.tensor_parallelism()``."""
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"smp.partition index must be a non-negative int, got {index!r}")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(index)
    try:
        with module_init_hook(_mark_partition):
            yield
    finally:
        stack.pop()


def set_partition(module: nn.Module, index: int) -> None:
    """Assign ``module`` (and its unmarked descendants) to pipeline stage ``index``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_partition expects an nn.Module, got {type(module).__name__}")
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"partition index must be a non-negative int, got {index!r}")
    object.__setattr__(module, _PARTITION_ATTR, index)


def get_partition_mark(module: nn.Module) -> int | None:
    """The stage a module was marked with, or ``None``."""
    return module.__dict__.get(_PARTITION_ATTR)


_STRATEGY = re.compile(r"^(each|contiguous|group_([1-9][0-9]*))$")


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
) -> None:
    """Checkpoint ``module``: keep only its inputs in forward, recompute it in backward.

    ``strategy`` (``"each"``, ``"contiguous"``, ``"group_N"``) and ``pack_args_as_tuple``
    apply to ``nn.Sequential`` modules only, as in the paper's Appendix I.2.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    if not _STRATEGY.match(strategy):
        raise ValueError(f"strategy must be 'each', 'contiguous' or 'group_N', got {strategy!r}")
    is_seq = isinstance(module, nn.Sequential)
    if not is_seq and (strategy != "each" or pack_args_as_tuple):
        raise ValueError("strategy and pack_args_as_tuple apply only to nn.Sequential modules")
    object.__setattr__(
        module,
        _CHECKPOINT_ATTR,
        {
            "preserve_rng_state": preserve_rng_state,
            "pack_args_as_tuple": pack_args_as_tuple,
            "strategy": strategy,
        },
    )


def carry_marks(old: nn.Module, new: nn.Module) -> None:
    """Copy the smp marks (stage, activation checkpointing) of ``old`` onto ``new``, which
    replaces it (e.g. a tensor-parallel layer); ``new``'s own marks win."""
    for attr in (_PARTITION_ATTR, _CHECKPOINT_ATTR):
        if attr in old.__dict__ and attr not in new.__dict__:
            object.__setattr__(new, attr, old.__dict__[attr])


def get_checkpoint_mark(module: nn.Module) -> dict[str, Any] | None:
    """The checkpointing options set on a module, or ``None``."""
    return module.__dict__.get(_CHECKPOINT_ATTR)


def checkpoint_options(
    root: nn.Module,
) -> tuple[dict[str, str | None], dict[str, CheckpointOptions]]:
    """The checkpointing marks under ``root`` in smp-pipeline's terms: ``{path: strategy}``
    (None: the module itself; a strategy for ``nn.Sequential`` containers) and the
    per-path options. One translation for every pipeline degree."""
    config: dict[str, str | None] = {}
    options: dict[str, CheckpointOptions] = {}
    for name, m in root.named_modules():
        opts = get_checkpoint_mark(m)
        if opts is None:
            continue
        config[name] = opts["strategy"] if isinstance(m, nn.Sequential) else None
        options[name] = CheckpointOptions(
            preserve_rng_state=bool(opts["preserve_rng_state"]),
            pack_args_as_tuple=bool(opts["pack_args_as_tuple"]),
        )
    return config, options


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Create parameters and buffers on the ``meta`` device inside the block (no memory),
    recording how they are built; :func:`smp_torch.deferred.materialize` (or
    :class:`smp_torch.deferred.DeferredInit`) later makes any of them real, bitwise equal to
    a normal CPU construction with the same seed. See :mod:`smp_torch.deferred`."""
    if not enabled:
        yield
        return
    with recording():
        yield
