"""The one place that wraps ``nn.Module.__init__``: hooks that see every module built.

smp-tp marks modules created inside ``tensor_parallelism()``; smp-torch marks those created
inside ``smp.partition(i)``. Both need a call after each ``nn.Module.__init__``, and two
independent patches of the same method undo each other: the one that exits last restores
whatever it captured, dropping the other's wrapper while its block is still open. So both go
through :func:`module_init_hook`, which owns the only patch:

- hooks are counted per callable; entering adds one use of its hook, leaving removes that
  one use only, so contexts may nest or interleave in any order;
- the wrapper is installed when the first hook arrives, wrapping the constructor *in force
  at that moment* (never one captured at import, so another library's patch made since is
  kept), and removed when the last hook leaves — unless something has wrapped
  ``nn.Module.__init__`` over it meanwhile, in which case it stays (with no hooks it only
  forwards) rather than cut that wrapper out of the chain.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["ModuleInitHook", "module_init_hook", "active_hooks"]

ModuleInitHook = Callable[[nn.Module], None]
"""Called with each module right after ``nn.Module.__init__`` has set it up."""

_lock = threading.Lock()
# (hook, uses) pairs; replaced, never mutated, so the wrapper can read it without the lock
# while another thread enters or leaves a block.
_hooks: tuple[tuple[ModuleInitHook, int], ...] = ()
_inner_init: Any = None
# Whether _hooked_init is in nn.Module.__init__'s chain, at the top or under another
# library's wrapper: installing it again would then make it call itself.
_installed = False


def _hooked_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _inner_init(self, *args, **kwargs)
    for hook, _ in _hooks:
        hook(self)


def _add(hook: ModuleInitHook) -> None:
    global _hooks, _inner_init, _installed
    with _lock:
        if not _installed:
            _installed = True
            _inner_init = nn.Module.__init__
            nn.Module.__init__ = _hooked_init  # type: ignore[method-assign]
        for i, (known, uses) in enumerate(_hooks):
            if known is hook:
                _hooks = (*_hooks[:i], (known, uses + 1), *_hooks[i + 1:])
                return
        _hooks = (*_hooks, (hook, 1))


def _remove(hook: ModuleInitHook) -> None:
    global _hooks, _installed
    with _lock:
        kept: list[tuple[ModuleInitHook, int]] = []
        for known, uses in _hooks:
            if known is hook:
                uses -= 1
            if uses > 0:
                kept.append((known, uses))
        _hooks = tuple(kept)
        if not _hooks and nn.Module.__init__ is _hooked_init:
            nn.Module.__init__ = _inner_init  # type: ignore[method-assign]
            _installed = False


@contextmanager
def module_init_hook(hook: ModuleInitHook) -> Iterator[None]:
    """Call ``hook(module)`` after ``nn.Module.__init__`` of every module built inside.

    The hook is process-wide (a module built by another thread meanwhile reaches it too), so
    a hook that should act for one thread only keeps its state thread-local. Blocks nest and
    interleave freely: leaving one removes only the use it added.
    """
    _add(hook)
    try:
        yield
    finally:
        _remove(hook)


def active_hooks() -> tuple[ModuleInitHook, ...]:
    """The hooks now in force, oldest first (for tests and diagnostics)."""
    return tuple(hook for hook, _ in _hooks)
