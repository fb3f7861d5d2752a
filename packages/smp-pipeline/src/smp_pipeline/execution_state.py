"""Capturing and restoring the grad-mode and autocast state a request carries (Appendix B).

Both are thread-local in PyTorch, so a worker thread must re-enter the requester's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return bool(torch.is_autocast_enabled())


def _autocast_dtype(device_type: str) -> torch.dtype:
    try:
        return torch.get_autocast_dtype(device_type)
    except (AttributeError, TypeError):  # torch < 2.4
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype()
        return torch.get_autocast_gpu_dtype()


def autocast_state() -> list[tuple[str, str]]:
    """The autocast contexts active on this thread, as ``(device_type, dtype name)`` pairs."""
    state = []
    for dev in _DEVICE_TYPES:
        if _autocast_enabled(dev):
            state.append((dev, str(_autocast_dtype(dev)).replace("torch.", "")))
    return state


def execution_state(grad_enabled: bool, autocast: list[tuple[str, str]]) -> contextlib.AbstractContextManager[Any]:
    """Enter the requester's grad mode and autocast contexts (a context manager).

    Without autocast (the common case) just the grad mode: one object instead of a
    generator and an exit stack, on a path every request takes."""
    if not autocast:
        return torch.set_grad_enabled(grad_enabled)
    return _full_state(grad_enabled, autocast)


@contextlib.contextmanager
def _full_state(grad_enabled: bool, autocast: list[tuple[str, str]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad_enabled))
        for dev, dtype in autocast:
            stack.enter_context(torch.autocast(dev, dtype=getattr(torch, dtype)))
        yield


def capture() -> dict[str, Any]:
    """Grad mode and autocast state of the calling thread."""
    return {"grad": torch.is_grad_enabled(), "autocast": autocast_state()}
