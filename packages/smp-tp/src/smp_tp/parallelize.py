"""``parallelize``: replace marked modules with their distributed implementations (§5.2)."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from smp_tp import builtin as _builtin  # noqa: F401  (registers nn.Linear/Embedding/LayerNorm)
from smp_tp.checkpoint import load_full_into
from smp_tp.group import ProcessGroup
from smp_tp.hf import register_hf_if_loaded
from smp_tp.module import DistributedModule
from smp_tp.random import set_tensor_parallel_seed
from smp_tp.registry import INIT_ARGS, Registration, is_tensor_parallel_enabled, lookup
from smp_tp.state import check_optimize, tp_config


def _ownership(model: nn.Module) -> tuple[dict[int, set[str]], dict[int, int]]:
    """Parameter id → paths of the modules that hold it directly; module id → #paths."""
    owners: dict[int, set[str]] = {}
    uses: dict[int, int] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        uses[id(m)] = uses.get(id(m), 0) + 1
        for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), set()).add(path)
    return owners, uses


def _within(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def _shares_parameters(m: nn.Module, path: str, owners: dict[int, set[str]]) -> bool:
    return any(
        not _within(o, path)
        for _, p in m.named_parameters(remove_duplicate=False)
        for o in owners.get(id(p), ())
    )


def _generic(module: nn.Module, reg: Registration) -> DistributedModule:
    """Build a user-registered replacement from the recorded constructor arguments."""
    recorded = getattr(module, INIT_ARGS, None)
    if recorded is None:
        raise ValueError(
            f"smp_tp: {type(module).__name__} was created before it was registered with "
            f"tp_register; register the class first so its constructor arguments are recorded"
        )
    args, kwargs = recorded
    if reg.init_hook is not None:
        args, kwargs = reg.init_hook(*args, **kwargs)
    dist = reg.dist_cls(*args, **kwargs)
    to_full, from_full = reg.weight_hooks or (dict, dict)
    try:
        load_full_into(dist, to_full(module.state_dict()))
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"smp_tp: cannot copy the weights of {type(module).__name__} into "
            f"{reg.dist_cls.__name__} ({e}); pass weight_hooks=(to_full, from_full) to tp_register"
        ) from e
    dist.train(module.training)
    object.__setattr__(dist, "_smp_tp_to_full", to_full)
    object.__setattr__(dist, "_smp_tp_from_full", from_full)
    if reg.forward_hook is not None or reg.return_hook is not None:
        run, fh, rh = dist.forward, reg.forward_hook, reg.return_hook

        def forward(*a: Any, **k: Any) -> Any:
            if fh is not None:
                a, k = fh(*a, **k)
            out = run(*a, **k)
            return rh(out) if rh is not None else out

        object.__setattr__(dist, "forward", forward)
    return dist


def _convert(module: nn.Module, path: str) -> DistributedModule | None:
    reg = lookup(module)
    assert reg is not None
    try:
        return reg.converter(module) if reg.converter is not None else _generic(module, reg)
    except ValueError as e:
        raise ValueError(f"smp_tp.parallelize: module {path or '<root>'!r}: {e}") from e


def parallelize(
    model: nn.Module,
    tp_group: ProcessGroup = None,
    prescaled_batch: bool = False,
    optimize: str = "speed",
    tensor_parallel_seed: int | None = None,
) -> nn.Module:
    """Replace, in place, every module that

    1. has a distributed implementation (built-in or registered),
    2. is marked (``tensor_parallelism()`` / ``set_tensor_parallelism()``),
    3. has no ancestor already replaced, and
    4. shares no parameter with a module outside it (and is not reused at several places),

    by its distributed version holding this rank's slices of the *original* weights, and
    return the model (the replacement itself when the root module is replaced).
    """
    check_optimize(optimize)
    if tensor_parallel_seed is not None:
        set_tensor_parallel_seed(tensor_parallel_seed)
    register_hf_if_loaded()
    owners, uses = _ownership(model)

    def eligible(m: nn.Module, path: str) -> bool:
        if isinstance(m, DistributedModule) or lookup(m) is None:
            return False
        if not is_tensor_parallel_enabled(m):
            return False
        if uses.get(id(m), 1) > 1 or _shares_parameters(m, path, owners):
            warnings.warn(
                f"smp_tp: {path or '<root>'} ({type(m).__name__}) shares parameters or is "
                f"reused; left unreplaced", stacklevel=3,
            )
            return False
        return True

    def visit(parent: nn.Module, path: str) -> None:
        for name, child in list(parent.named_children()):
            cpath = f"{path}.{name}" if path else name
            if isinstance(child, DistributedModule):
                continue
            if eligible(child, cpath):
                replacement = _convert(child, cpath)
                if replacement is not None:
                    setattr(parent, name, replacement)
                    continue
            visit(child, cpath)

    with tp_config(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=optimize):
        if eligible(model, ""):
            replacement = _convert(model, "")
            if replacement is not None:
                return replacement
        visit(model, "")
    return model
