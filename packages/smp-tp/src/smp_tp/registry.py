"""Marking modules for tensor parallelism and registering distributed implementations."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from smp_tp.init_hooks import module_init_hook
from smp_tp.module import DistributedModule

TP_FLAG = "_smp_tp_enabled"
INIT_ARGS = "_smp_tp_init_args"

# --------------------------------------------------------------------------- marking

_local = threading.local()


def _mark_tp(module: nn.Module) -> None:
    # Thread-local: the patch point is process-wide, a block marks its own thread's modules.
    stack = getattr(_local, "stack", None)
    if stack:
        object.__setattr__(module, TP_FLAG, stack[-1])


@contextmanager
def tensor_parallelism(enabled: bool = True) -> Iterator[None]:
    """Mark every module created inside (in this thread) for tensor parallelism or not.

    Works through :func:`smp_tp.init_hooks.module_init_hook`, the one wrapper of
    ``nn.Module.__init__``, so it nests and interleaves with other marking blocks
    (``smp.partition``); among nested ``tensor_parallelism`` blocks the innermost decides.
    """
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(bool(enabled))
    try:
        with module_init_hook(_mark_tp):
            yield
    finally:
        stack.pop()


def set_tensor_parallelism(module: nn.Module, enabled: bool = True) -> nn.Module:
    """Mark ``module`` and all its submodules for tensor parallelism (or unmark them)."""
    for m in module.modules():
        object.__setattr__(m, TP_FLAG, bool(enabled))
    return module


def is_tensor_parallel_enabled(module: nn.Module) -> bool:
    """Whether ``module`` is marked for tensor parallelism."""
    return bool(getattr(module, TP_FLAG, False))


# --------------------------------------------------------------------------- registry


@dataclass
class Registration:
    """How to replace instances of one module class."""

    dist_cls: type
    init_hook: Callable[..., tuple[Any, dict[str, Any]]] | None = None
    forward_hook: Callable[..., tuple[Any, dict[str, Any]]] | None = None
    return_hook: Callable[[Any], Any] | None = None
    # (to_full, from_full): translate the original module's state dict to the distributed
    # module's full keys and back; identity when None.
    weight_hooks: tuple[Callable[[dict], dict], Callable[[dict], dict]] | None = None
    # Built-in converters build the distributed module straight from the live module.
    # Returning None leaves the module unreplaced.
    converter: Callable[[nn.Module], DistributedModule | None] | None = None


_registry: dict[type, Registration] = {}


def _record_init_args(cls: type) -> None:
    if getattr(cls.__init__, "_smp_tp_records", False):  # type: ignore[misc]
        return
    original = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is cls:
            object.__setattr__(self, INIT_ARGS, (args, kwargs))

    __init__._smp_tp_records = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign,misc]


def _check_dist_cls(dist_cls: type) -> None:
    if not (isinstance(dist_cls, type) and issubclass(dist_cls, DistributedModule)):
        raise TypeError(f"tp_register: {dist_cls!r} is not a subclass of smp_tp.DistributedModule")


def tp_register_with_module(
    module_cls: type,
    dist_cls: type,
    init_hook: Callable[..., tuple[Any, dict[str, Any]]] | None = None,
    forward_hook: Callable[..., tuple[Any, dict[str, Any]]] | None = None,
    return_hook: Callable[[Any], Any] | None = None,
    *,
    weight_hooks: tuple[Callable[[dict], dict], Callable[[dict], dict]] | None = None,
) -> None:
    """Register ``dist_cls`` as the distributed implementation of ``module_cls`` (App. I.4).

    ``init_hook(*init_args) -> (args, kwargs)`` translates the original constructor
    arguments, ``forward_hook(*fwd_args) -> (args, kwargs)`` the forward arguments,
    ``return_hook(out)`` the result. Constructor arguments are recorded from the moment of
    registration, so instances must be created after registering. The original weights are
    copied in when the original state-dict keys equal the distributed module's full keys,
    or through ``weight_hooks=(to_full, from_full)``.
    """
    _check_dist_cls(dist_cls)
    _record_init_args(module_cls)
    _registry[module_cls] = Registration(dist_cls, init_hook, forward_hook, return_hook, weight_hooks)


def tp_register(
    dist_cls: type,
    init_hook: Callable[..., tuple[Any, dict[str, Any]]] | None = None,
    forward_hook: Callable[..., tuple[Any, dict[str, Any]]] | None = None,
    return_hook: Callable[[Any], Any] | None = None,
    *,
    weight_hooks: tuple[Callable[[dict], dict], Callable[[dict], dict]] | None = None,
) -> Callable[[type], type]:
    """Class decorator form of :func:`tp_register_with_module`."""

    def deco(module_cls: type) -> type:
        tp_register_with_module(
            module_cls, dist_cls, init_hook, forward_hook, return_hook, weight_hooks=weight_hooks
        )
        return module_cls

    return deco


def register_builtin(module_cls: type, dist_cls: type, converter: Callable[[nn.Module], Any]) -> None:
    """Register a converter that builds the distributed module from a live instance."""
    if module_cls not in _registry:
        _registry[module_cls] = Registration(dist_cls, converter=converter)


def lookup(module: nn.Module) -> Registration | None:
    """The registration for ``type(module)`` exactly (subclasses may change the maths)."""
    return _registry.get(type(module))


def registered_base(module: nn.Module) -> type | None:
    """A registered class that ``type(module)`` strictly subclasses (nearest in the MRO), or
    None: such an instance is not replaced (:func:`lookup` takes exact types only)."""
    for base in type(module).__mro__[1:]:
        if base in _registry:
            return base
    return None
