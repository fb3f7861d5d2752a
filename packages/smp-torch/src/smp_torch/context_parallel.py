"""Context parallelism (``context_parallel_degree``): every sequence split across the cp group.

The ranks of one cp group receive the same full batch from the user. At the model's call
(:meth:`SequenceSplit.split`, from ``DistributedModel.forward``) each keeps its share of
every sequence input, in smp-tp's load-balanced layout: the sequence is cut into ``2 * cp``
chunks and cp rank ``i`` keeps chunks ``i`` and ``2 * cp - 1 - i`` (one early, one late: the
same causal work everywhere). Activations stay split through the whole model; only
attention needs the other shares, and gets them from :func:`smp_tp.context_parallel_attention`
(ring attention: k/v blocks travel round the group, nothing else does).

What is split, and how:

- ``input_ids`` / ``inputs_embeds`` / ``token_type_ids`` and the keys the user names
  (``DistributedModel(sequence_inputs={"name": axis})``) along their sequence axis;
- ``labels``: shifted by one first (token ``t`` predicts ``t + 1``, the last predicts
  nothing), then split, so no rank loses the target that sits across a chunk boundary;
- ``position_ids``: the global positions (``0..S-1`` when not given), then split, so rotary
  embeddings see where each chunk really is;
- ``attention_mask``: only an all-ones mask (no padding) is accepted, and dropped.

Applied to Hugging Face models that call attention through transformers' attention
interface (``_supports_attention_backend``: Llama, Mistral, Qwen2/3, Phi-3, ...): smp registers
one attention function there and selects it on the model. The model's causal-LM loss is
replaced by one that sums the cross entropy of this rank's tokens, all-reduces the sum and
the token count over the cp group, and divides: every cp rank gets the full-sequence loss.
Its backward passes the gradient straight to this rank's tokens, so each rank's parameter
gradients hold its tokens' share and their sum over the cp group is the full gradient: the
data-parallel reducer sums over cp (and averages over dp), see ``DistributedModel``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from smp_tp import (
    DistributedAttentionLayer,
    VocabParallelCausalLMLoss,
    context_parallel_attention,
    split_sequence,
    ulysses_attention,
)
from torch import nn

from smp_torch.errors import ConfigError
from smp_torch.state import state

__all__ = [
    "ATTENTION_NAME", "SEQUENCE_INPUTS", "SequenceSplit", "full_sequence_loss", "install",
    "route_layers", "saved_activation_bytes", "sequence_mean", "sequence_share", "splitter",
]

#: The name smp's attention function is registered under in transformers.
ATTENTION_NAME = "smp_context_parallel"
#: Inputs split along the sequence by default (name: axis); labels and positions are
#: handled on their own (see the module docstring).
SEQUENCE_INPUTS: Mapping[str, int] = {"input_ids": 1, "inputs_embeds": 1, "token_type_ids": 1,
                                      "shift_labels": -1}
_IGNORE = -100  # transformers' ignore_index: a target that counts for nothing


@dataclass(frozen=True)
class SequenceSplit:
    """Cuts a model call's sequence inputs to this cp rank's share (see the module docstring)."""

    signature: inspect.Signature
    cp_rank: int
    cp: int
    inputs: Mapping[str, int]
    #: Whether the model's loss is the full-sequence causal-LM loss (:func:`install`).
    causal_lm: bool

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with every sequence input replaced by this rank's share."""
        bound = self.signature.bind_partial(*args, **kwargs)
        named = dict(bound.arguments)
        var_keyword = _var_keyword(self.signature)
        extra = (named.pop(var_keyword, None) if var_keyword else None) or {}
        named.update(extra)
        length = self._length(named)
        mask = named.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all()):
                raise ConfigError(
                    "context_parallel_degree",
                    "splits sequences without padding only: attention_mask must be None or all ones "
                    "(pack sequences to a common length instead)",
                )
            named["attention_mask"] = None
        labels = named.get("labels")
        if isinstance(labels, torch.Tensor):
            if not self.causal_lm:
                raise ConfigError(
                    "context_parallel_degree",
                    "splits the loss of causal language models (transformers' ForCausalLM loss) "
                    "only; this model's loss is another",
                )
            if named.get("shift_labels") is None:
                named["labels"] = F.pad(labels[..., 1:], (0, 1), value=_IGNORE)
        positions = named.get("position_ids")
        if positions is None and "position_ids" in self.signature.parameters:
            tokens = [named.get(k) for k in ("input_ids", "inputs_embeds")]
            device = next((t.device for t in tokens if isinstance(t, torch.Tensor)), None)
            positions = torch.arange(length, device=device).unsqueeze(0)
        if positions is not None:
            named["position_ids"] = positions
        axes = {**self.inputs, "labels": -1, "position_ids": -1}
        for name, axis in axes.items():
            value = named.get(name)
            if isinstance(value, torch.Tensor):
                named[name] = self._share(name, value, axis, length)
        return (), named

    def _length(self, named: Mapping[str, Any]) -> int:
        for name in ("input_ids", "inputs_embeds", *self.inputs):
            value = named.get(name)
            if isinstance(value, torch.Tensor):
                axis = self.inputs.get(name, 1)
                return int(value.shape[axis])
        raise ConfigError(
            "context_parallel_degree",
            f"found no sequence input in the model's call (looked for {sorted(self.inputs)}); "
            "name yours with DistributedModel(sequence_inputs={name: axis})",
        )

    def _share(self, name: str, value: torch.Tensor, axis: int, length: int) -> torch.Tensor:
        axis %= value.dim()
        if value.shape[axis] != length:
            raise ConfigError(
                "context_parallel_degree",
                f"input {name!r} has {value.shape[axis]} positions along axis {axis}, the sequence has {length}",
            )
        return _balanced_share(value, axis, self.cp_rank, self.cp, f" (input {name!r})")


def _balanced_share(value: torch.Tensor, axis: int, cp_rank: int, cp: int, what: str = "") -> torch.Tensor:
    """``cp_rank``'s balanced share of ``value`` along ``axis``; a length that 2 * cp does not
    divide is a :class:`ConfigError` (``what`` names the input in the message)."""
    length = value.shape[axis]
    if length % (2 * cp):
        raise ConfigError(
            "context_parallel_degree",
            f"the sequence length {length}{what} is not divisible by 2 * "
            f"context_parallel_degree = {2 * cp} (each rank keeps two equal chunks)",
        )
    return split_sequence(value, cp_rank, cp, axis, "balanced")


def _var_keyword(sig: inspect.Signature) -> str | None:
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return p.name
    return None


class _SequenceMean(torch.autograd.Function):
    """``(sum over the group of local sums) / denominator``; the gradient goes straight to
    this rank's sum (each rank's share of the full-sequence gradient, summed over cp later)."""

    @staticmethod
    def forward(ctx: Any, local_sum: torch.Tensor, count: torch.Tensor, fixed: float | None,
                group: Any) -> torch.Tensor:
        both = torch.stack([local_sum.detach().float(), count.float()])
        if not both.is_meta:
            dist.all_reduce(both, group=group)
        denominator = both[1] if fixed is None else torch.tensor(fixed, dtype=both.dtype)
        ctx.save_for_backward(denominator)
        return (both[0] / denominator).to(local_sum.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (denominator,) = ctx.saved_tensors
        return grad / denominator, None, None, None


class _SequenceLoss:
    """A causal-LM loss over the whole sequence from each rank's share (labels arrive shifted)."""

    def __init__(self, original: Any, group: Any) -> None:
        self.original, self.group = original, group

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                 num_items_in_batch: Any = None, ignore_index: int = _IGNORE,
                 shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        targets = labels if shift_labels is None else shift_labels
        assert targets is not None
        # num_items_in_batch=1: transformers' loss then returns the plain sum.
        local = self.original(logits, None, vocab_size, num_items_in_batch=1, ignore_index=ignore_index,
                              shift_labels=targets, **kwargs)
        count = (targets != ignore_index).sum()
        fixed = None if num_items_in_batch is None else float(num_items_in_batch)
        out: torch.Tensor = _SequenceMean.apply(local, count, fixed, self.group)
        return out


def _attention_function(group: Any, cp: int, choice: str) -> Any:
    """transformers' attention-interface signature over smp-tp's ring attention or
    all-to-all over heads (``choice``: ``context_parallel_attention``)."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: int | None = None, softcap: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        where = f"context_parallel_degree={cp}, in {type(module).__name__}"
        if dropout:
            raise ValueError(f"{where}: attention dropout ({dropout}) is not supported; set it to 0")
        full = query.shape[2] * cp
        if sliding_window is not None and sliding_window < full:
            raise ValueError(f"{where}: a sliding window of {sliding_window} tokens over sequences "
                             f"of {full} is not supported by context parallelism yet")
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        if softcap is not None:
            raise ValueError(f"{where}: attention soft-capping is not supported by context parallelism yet")
        heads_divide = query.shape[1] % cp == 0 and key.shape[1] % cp == 0
        if choice == "all_to_all" and not heads_divide:
            raise ValueError(f"{where}: context_parallel_attention='all_to_all' needs cp to divide the "
                             f"{query.shape[1]} query and {key.shape[1]} key/value heads this rank "
                             "holds; use 'ring' or 'auto'")
        if query.is_meta:  # (a shape-only trace: nothing to exchange)
            out = query.new_empty(*query.shape[:3], value.shape[-1])
        elif choice != "ring" and heads_divide:
            out = ulysses_attention(query, key, value, group, causal=causal, scale=scaling)
        else:
            out = context_parallel_attention(query, key, value, group, causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def install(module: nn.Module, group: Any, cp: int, choice: str = "auto", tp: int = 1) -> int:
    """Route the attention of a Hugging Face ``module`` that calls it through transformers'
    attention interface to ring attention or the all-to-all over heads, over ``group``.
    Returns the number of attention modules routed (0 for another model). Before the engine
    wraps the model (its trace runs it).

    Raises :class:`ConfigError` (the same on every rank: same model) when the model's
    configuration is one the exchange does not support."""
    from transformers import (  # (optional: the user's model may be one)
        AttentionInterface,
        PreTrainedModel,
    )

    if not isinstance(module, PreTrainedModel) or not getattr(module, "_supports_attention_backend", False):
        return 0
    name, config = type(module).__name__, module.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ConfigError(
            "context_parallel_degree",
            f"{name} soft-caps its attention scores (attn_logit_softcapping="
            f"{config.attn_logit_softcapping}); ring attention does not support soft-capping yet",
        )
    attention = [m for m in module.modules() if getattr(m, "is_causal", None) is not None
                 and type(m).__name__.endswith("Attention")]
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if choice == "all_to_all" and isinstance(heads, int) and isinstance(kv_heads, int) \
            and (heads // tp % cp or kv_heads // tp % cp):
        raise ConfigError(
            "context_parallel_attention",
            f"'all_to_all' needs context_parallel_degree={cp} to divide each rank's heads: {name} has "
            f"{heads} query and {kv_heads} key/value heads over tensor_parallel_degree={tp}; use 'ring' or 'auto'",
        )
    AttentionInterface.register(ATTENTION_NAME, _attention_function(group, cp, choice))
    module.set_attn_implementation(ATTENTION_NAME)
    return len(attention)


def route_layers(module: nn.Module, group: Any, cp: int, routed: int) -> None:
    """After the engine: give every smp-tp ``DistributedAttentionLayer`` of ``module`` (built
    by the user or by tensor parallelism's replacements) the cp group, so its attention core
    runs as ring attention. ``routed``: what :func:`install` routed; with nothing routed at
    all, :class:`ConfigError` (no attention would see the other ranks' tokens)."""
    layers = [m for m in module.modules() if isinstance(m, DistributedAttentionLayer)]
    for layer in layers:
        layer.context_group = group
    if not routed and not layers:
        raise ConfigError(
            "context_parallel_degree",
            f"is {cp} but {type(module).__name__} has no attention smp can split: neither a Hugging "
            "Face model calling attention through transformers' attention interface (Llama, "
            "Mistral, Qwen2/3, Phi-3, ...) nor smp-tp's DistributedAttentionLayer",
        )


def full_sequence_loss(module: nn.Module, group: Any) -> bool:
    """Make ``module``'s causal-LM loss the full sequence's (:class:`_SequenceLoss`). After
    the engine wrapped the model: tensor parallelism may have replaced the loss with its
    vocabulary-parallel one, which this wraps the same way. Returns whether the model has a
    causal-LM loss (transformers' own or smp-tp's)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    original = getattr(module, "loss_function", None)
    if isinstance(original, _SequenceLoss):
        return True
    if original is LOSS_MAPPING.get("ForCausalLM") or isinstance(original, VocabParallelCausalLMLoss):
        setattr(module, "loss_function", _SequenceLoss(original, group))  # noqa: B010 - (a property)
        return True
    return False


def splitter(module: nn.Module, cp_rank: int, cp: int, causal_lm: bool,
             inputs: Mapping[str, int] | None = None) -> SequenceSplit:
    """The :class:`SequenceSplit` of ``module``'s calls (``inputs`` add to :data:`SEQUENCE_INPUTS`)."""
    return SequenceSplit(inspect.signature(module.forward), cp_rank, cp,
                         {**SEQUENCE_INPUTS, **(inputs or {})}, causal_lm)


def saved_activation_bytes(run: Callable[[], Any], parameters: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``run()`` executes,
    the storages of ``parameters`` left out: the activation memory a forward keeps until its
    backward (what context parallelism divides), counted from the tensors themselves."""
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def sequence_share(t: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """This rank's share of a full-sequence tensor, as the model's inputs are split (load-
    balanced chunks ``cp_rank`` and ``2 cp - 1 - cp_rank``): for a model of your own, the
    targets that match its outputs. ``t`` itself with ``context_parallel_degree`` 1."""
    ctx = state()
    cp = ctx.config.cp
    return t if cp == 1 else _balanced_share(t, axis, ctx.index("cp"), cp)


def sequence_mean(total: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """The mean over the whole sequences from this rank's share: ``total`` (e.g. the summed
    token losses of :func:`sequence_share`'s targets) and ``count`` (the tokens counted) summed
    over the cp group, divided. Every cp rank gets the same value; the gradient reaches this
    rank's ``total`` only (its share: smp sums gradients over cp). What a model of your own
    returns as its loss under ``context_parallel_degree``; ``total / count`` without it."""
    ctx = state()
    count_t = torch.as_tensor(count, device=total.device)
    if ctx.config.cp == 1:
        return total / count_t
    out: torch.Tensor = _SequenceMean.apply(total, count_t, None, ctx.process_groups["cp"])
    return out
