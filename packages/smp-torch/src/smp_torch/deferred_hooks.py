"""Python entry points watched while a delayed construction records (see
:mod:`smp_torch.deferred`): the generator's (``torch.manual_seed``, ``get_rng_state``...) and
the ``torch.nn.init`` functions that skip meta tensors, neither of which any mode sees."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.init as init_module

from smp_torch.deferred_record import active

__all__ = ["watch_entry_points"]

_patch_lock = threading.Lock()
_patch_depth = 0
_originals: dict[str, Any] = {}
_RNG_FUNCS = ("manual_seed", "seed", "set_rng_state", "get_rng_state")
# torch.nn.init functions that return at once on a meta tensor (torch 2.13: "meta tensors have
# no storage, so sampling is a no-op"), below no mode's sight: nothing would be recorded and
# the replay would lose both their values and their random numbers. While a block records,
# their code is swapped for a trampoline into :func:`_init_hook` (so references captured
# before, such as Hugging Face's TORCH_INIT_FUNCTIONS, go through it too), which logs the
# call; the replay calls the original on the real tensor.
_SKIPPING_INITS = {"trunc_normal_": True, "orthogonal_": True, "sparse_": True, "dirac_": False}
_HOOK = "_smp_deferred_init_hook"
_init_code: dict[str, types.CodeType] = {}
_init_real: dict[str, Callable[..., Any]] = {}


def _init_hook(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    real = _init_real[name]
    rec = active()
    tensor = args[0] if args else kwargs.get("tensor")
    if rec is None or not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
        return real(*args, **kwargs)
    rec.record_call(real, args, kwargs, rng=_SKIPPING_INITS[name])
    return tensor


def _trampoline(*args: Any, **kwargs: Any) -> Any:
    # The template of the swapped code: ``_smp_deferred_init_hook`` is looked up in the
    # globals of the function it runs as (torch.nn.init's, where it is put for the block).
    return _smp_deferred_init_hook("NAME", args, kwargs)


_smp_deferred_init_hook = _init_hook


def _hook_inits(on: bool) -> None:
    if on:
        init_module.__dict__[_HOOK] = _init_hook
        for name in _SKIPPING_INITS:
            fn = getattr(init_module, name, None)
            if not isinstance(fn, types.FunctionType) or fn.__closure__:
                continue  # not the plain function this was written against: leave it
            code = fn.__code__
            real = types.FunctionType(code, fn.__globals__, name, fn.__defaults__)
            real.__kwdefaults__ = fn.__kwdefaults__
            real.__module__ = fn.__module__
            _init_code[name], _init_real[name] = code, real
            consts = tuple(name if c == "NAME" else c for c in _trampoline.__code__.co_consts)
            fn.__code__ = _trampoline.__code__.replace(co_consts=consts, co_name=name)
    else:
        for name, code in _init_code.items():
            getattr(init_module, name).__code__ = code
        _init_code.clear()
        init_module.__dict__.pop(_HOOK, None)


def _watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = active()
        if rec is None:
            return original(*args, **kwargs)
        if name == "get_rng_state":
            rec.catch_up()
            return original(*args, **kwargs)
        result = original(*args, **kwargs)
        rec.log_state()
        return result

    wrapper.__name__ = name
    wrapper.__doc__ = original.__doc__
    return wrapper


def watch_entry_points(on: bool) -> None:
    """Wrap (``on``) or unwrap ``torch.manual_seed``, ``seed``, ``set_rng_state`` and
    ``get_rng_state`` (also under ``torch.random``) — inside a recording, a set is logged
    for the replay, and a get first brings the generator up to date — and the initialisers
    of :data:`_SKIPPING_INITS`. Counted, so nested and concurrent blocks share one wrapping;
    threads that are not recording pass straight through."""
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
                _hook_inits(True)
        else:
            _patch_depth -= 1
            if _patch_depth == 0:
                for name, original in _originals.items():
                    setattr(torch.random, name, original)
                    setattr(torch, name, original)
                _originals.clear()
                _hook_inits(False)
