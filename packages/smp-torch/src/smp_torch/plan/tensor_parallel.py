"""What tensor parallelism does to a model, as the planner's profile needs it: which modules
smp-tp splits (and the number the degree must divide), and which of them all-gather their
input from the tensor-parallel group (kept for backward at tp times the samples)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from smp_tp.architectures import vocab_plan
from smp_tp.hf import register_hf_if_loaded
from smp_tp.layers.block import DistributedBlock
from smp_tp.registry import is_tensor_parallel_enabled, lookup
from torch import nn
from torch.utils._pytree import tree_leaves

_HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def tensor_parallel_divisors(model: nn.Module) -> dict[str, int]:
    """The modules smp-tp would split (marked, with a distributed implementation, not
    inside another such module), each with the number tp must divide: its head count when
    it names one, else the greatest common divisor of its parameters' first dimensions; an
    attention module (smp-tp's Megatron block over its projections) and a module inside one
    (a projection smp-tp splits one by one) divide its query and key/value head counts too,
    as smp-tp requires of the attention.

    smp-tp registers its Hugging Face blocks (Llama's attention and MLP, T5's) only when
    ``parallelize`` runs; they are registered here first, so the planner sees the modules
    smp-tp will replace: one Llama attention block with one collective pair, not its four
    projections with a pair each (measured: tp = 2 predicted 2-3x too slow on bench_plan's
    llama-tied grid, 30 split modules where smp-tp runs 10)."""
    register_hf_if_loaded()
    out: dict[str, int] = {}
    modules = dict(model.named_modules())
    for name, m in modules.items():
        if any(name.startswith(p + ".") or p == "" for p in out) and name:
            continue
        if not is_tensor_parallel_enabled(m) or lookup(m) is None:
            continue
        heads = next((getattr(m, a) for a in _HEAD_ATTRS if isinstance(getattr(m, a, None), int)), None)
        if heads is None:
            dims = [p.shape[0] for p in m.parameters() if p.dim()]
            heads = math.gcd(*dims) if dims else 1
        parent = modules.get(name.rpartition(".")[0]) if "." in name else None
        heads = math.gcd(heads, *_head_counts(m))
        if parent is not None:
            heads = math.gcd(heads, *_head_counts(parent))
        out[name] = int(heads)
    return out


def gathers_its_input(model: nn.Module, name: str) -> bool:
    """Whether smp-tp's replacement of module ``name`` all-gathers its input from the tp
    group (scaled batch, smp's default): a Megatron block (``tp_register_block``, the
    Hugging Face attention and MLP blocks) and the output head of a model registered for
    vocabulary parallelism; a per-linear split or a distributed layer exchanges channel
    slices instead (all-to-all), holding no more than its own samples' bytes."""
    register_hf_if_loaded()
    m = model.get_submodule(name)
    reg = lookup(m)
    if reg is not None and reg.dist_cls is DistributedBlock:
        return True
    for owner in model.modules():
        if vocab_plan(owner) is None:
            continue
        head = getattr(owner, "get_output_embeddings", None)
        try:
            if callable(head) and head() is m:
                return True
        except (AttributeError, NotImplementedError):  # (a model without a head)
            continue
    return False


def gathered_input_bytes(model: nn.Module, run: Callable[[], Any], names: Iterable[str]) -> dict[str, int]:
    """Bytes of the input each module of ``names`` that gathers it (:func:`gathers_its_input`)
    receives during ``run()``, summed over its calls: what it keeps for backward at tp
    times the samples once split."""
    out: dict[str, int] = {}
    handles = []
    for name in names:
        if not gathers_its_input(model, name):
            continue
        out[name] = 0

        def pre(_mod: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            # the block input and every further tensor argument with its batch dimension
            # (masks, rotary cos/sin, cross-attention's encoder states): smp-tp gathers them all
            tensors = _tensors((args, kwargs))
            first = next((t for t in tensors if t.is_floating_point() and t.dim()), None)
            if first is not None:
                same = {t.untyped_storage().data_ptr(): t for t in tensors if t.dim() and t.shape[0] == first.shape[0]}
                out[name] += sum(t.numel() * t.element_size() for t in same.values())

        handles.append(model.get_submodule(name).register_forward_pre_hook(pre, with_kwargs=True))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return out


def _head_counts(m: nn.Module) -> list[int]:
    """The head counts an attention module names (one with a ``head_dim``): query heads and
    key/value heads (grouped-query attention), on the module or its ``config`` (Hugging Face
    keeps them there); [] for any other module."""
    if not hasattr(m, "head_dim"):
        return []
    counts = []
    for owner in (m, getattr(m, "config", None)):
        for a in (*_HEAD_ATTRS, *_KV_HEAD_ATTRS):
            v = getattr(owner, a, None) if owner is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                counts.append(v)
    return counts
