"""The one wrapper of ``nn.Module.__init__`` (``smp_tp.init_hooks``): nesting, interleaving,
and leaving another library's patch of the constructor in place."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import smp_tp
from smp_tp.init_hooks import active_hooks, module_init_hook
from torch import nn

_PLAIN_INIT = nn.Module.__init__
_local = threading.local()


def _mark_other(module: nn.Module) -> None:
    # A second marker, standing for smp.partition (which lives above smp-tp).
    stack = getattr(_local, "stack", None)
    if stack:
        object.__setattr__(module, "_other_mark", stack[-1])


@contextlib.contextmanager
def other_marks(value: int) -> Iterator[None]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(value)
    try:
        with module_init_hook(_mark_other):
            yield
    finally:
        stack.pop()


def other(module: nn.Module) -> int | None:
    return module.__dict__.get("_other_mark")


def test_tp_ending_inside_another_block_leaves_its_marks_on() -> None:
    with other_marks(1):
        with smp_tp.tensor_parallelism():
            both = nn.Linear(2, 2)
        after = nn.Linear(2, 2)
    assert smp_tp.is_tensor_parallel_enabled(both) and other(both) == 1
    assert not smp_tp.is_tensor_parallel_enabled(after) and other(after) == 1
    assert nn.Module.__init__ is _PLAIN_INIT and active_hooks() == ()


def test_other_block_ending_inside_tp_leaves_tp_on() -> None:
    with smp_tp.tensor_parallelism():
        with other_marks(2):
            both = nn.Linear(2, 2)
        after = nn.Linear(2, 2)
    assert smp_tp.is_tensor_parallel_enabled(both) and other(both) == 2
    assert smp_tp.is_tensor_parallel_enabled(after) and other(after) is None
    assert nn.Module.__init__ is _PLAIN_INIT


def test_interleaved_blocks_each_remove_only_their_own_hook() -> None:
    tp, mark = smp_tp.tensor_parallelism(), other_marks(3)
    tp.__enter__()
    mark.__enter__()
    tp.__exit__(None, None, None)  # leaves first although entered first
    only_mark = nn.Linear(2, 2)
    tp2 = smp_tp.tensor_parallelism()
    tp2.__enter__()
    mark.__exit__(None, None, None)
    only_tp = nn.Linear(2, 2)
    tp2.__exit__(None, None, None)
    none = nn.Linear(2, 2)
    assert other(only_mark) == 3 and not smp_tp.is_tensor_parallel_enabled(only_mark)
    assert other(only_tp) is None and smp_tp.is_tensor_parallel_enabled(only_tp)
    assert other(none) is None and not smp_tp.is_tensor_parallel_enabled(none)
    assert nn.Module.__init__ is _PLAIN_INIT and active_hooks() == ()


def test_nested_same_hook_is_counted() -> None:
    with smp_tp.tensor_parallelism():
        with smp_tp.tensor_parallelism(enabled=False):
            off = nn.Linear(2, 2)
        on = nn.Linear(2, 2)
        assert len(active_hooks()) == 1
    assert not smp_tp.is_tensor_parallel_enabled(off) and smp_tp.is_tensor_parallel_enabled(on)
    assert active_hooks() == ()


def test_a_patch_made_meanwhile_by_someone_else_is_kept() -> None:
    built: list[str] = []

    with smp_tp.tensor_parallelism():
        under = nn.Module.__init__

        def theirs(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            under(self, *args, **kwargs)
            built.append(type(self).__name__)

        nn.Module.__init__ = theirs  # type: ignore[method-assign]
    try:
        # Our wrapper stays under theirs (cutting it out would drop their patch) and a new
        # block must not wrap itself again.
        assert nn.Module.__init__ is theirs
        with smp_tp.tensor_parallelism():
            marked = nn.Linear(2, 2)
        assert smp_tp.is_tensor_parallel_enabled(marked) and built == ["Linear"]
        assert not smp_tp.is_tensor_parallel_enabled(nn.Linear(2, 2))
    finally:
        nn.Module.__init__ = under  # type: ignore[method-assign]
        with smp_tp.tensor_parallelism():
            pass  # our wrapper back on top: leaving now removes it
    assert nn.Module.__init__ is _PLAIN_INIT
