"""One configuration object for the transformer family of smp-tp layers.

:class:`DistributedAttentionLayer`, :class:`DistributedTransformerOutputLayer`,
:class:`DistributedTransformerLayer`, :class:`DistributedTransformer` and
:class:`DistributedTransformerLMHead` share one set of options (sizes, dropout, layer-norm
placement, layout and recomputation). As in Megatron-LM's ``TransformerConfig``, they take
it as one frozen :class:`TransformerConfig`; a class reads the fields it needs and passes the
same object down to its children, so the options are spelled once.

The older call forms (positional and keyword arguments, each class with its own order) stay
public API. :func:`build_config` is the one place that turns them into a config, so the
classes themselves only ever see a :class:`TransformerConfig`.

Where the module lives (``tp_group``, ``prescaled_batch``, ``dtype``, ``device``) is not part
of the config: those stay constructor keywords, as for every other
:class:`~smp_tp.DistributedModule`, so one config can describe layers on several groups.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TransformerConfig:
    """What a transformer layer (or a stack, or a whole LM) of smp-tp computes.

    A class ignores the fields that do not concern it (``vocab_size`` for a layer,
    ``intermediate_size`` for an attention layer), as Megatron's layers do.

    Sizes: ``num_layers`` (stacks), ``num_attention_heads`` × ``attention_head_size`` (the
    attention width), ``hidden_size``, ``intermediate_size`` (MLP), ``vocab_size``,
    ``num_positions`` and ``num_token_types`` (LM embeddings; 0: no token-type embedding).

    Maths: ``attention_dropout_prob``, ``hidden_dropout_prob``, ``activation`` (a name of
    :data:`smp_tp.layers.region.ACTIVATIONS`), ``layernorm_epsilon``; ``causal_mask_size`` not
    None makes self-attention causal; ``cross_attention`` (an attention layer takes keys and
    values from ``cross_states``; the layer classes set it on their ``crossattention`` child
    themselves); ``add_cross_attention`` (a layer gets a ``crossattention`` child);
    ``add_lm_head`` (the LM returns logits, not hidden states); ``pre_layernorm`` (GPT-2) /
    ``post_layernorm`` (BERT).

    Initialisation: ``initializer_range`` and ``use_normal_initialization`` (see
    :func:`smp_tp.parameter_creation_scope`).

    Layout and memory: ``optimize`` (``"speed"`` or ``"memory"``; None: the
    :func:`smp_tp.tp_config` default), ``recompute_activations`` (memory layout),
    ``recompute_attention`` and ``recompute_mlp_activation`` (speed layout),
    ``sequence_parallel`` (speed layout, scaled batch): see
    :class:`~smp_tp.DistributedAttentionLayer`, :class:`~smp_tp.DistributedTransformerOutputLayer`.
    """

    num_layers: int = 12
    num_attention_heads: int = 32
    attention_head_size: int = 32
    hidden_size: int = 1024
    intermediate_size: int = 4096
    vocab_size: int = 30522
    num_positions: int = 1024
    num_token_types: int = 0
    attention_dropout_prob: float = 0.1
    hidden_dropout_prob: float = 0.1
    activation: str = "gelu"
    layernorm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    use_normal_initialization: bool = False
    cross_attention: bool = False
    causal_mask_size: int | None = None
    add_cross_attention: bool = False
    add_lm_head: bool = True
    pre_layernorm: bool = False
    post_layernorm: bool = True
    optimize: str | None = None
    recompute_activations: bool = True
    recompute_attention: bool = False
    recompute_mlp_activation: bool = False
    sequence_parallel: bool = False


_FIELDS = frozenset(f.name for f in fields(TransformerConfig))


def build_config(
    owner: str,
    positional: tuple[str, ...],
    keywords: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: TransformerConfig | None,
) -> TransformerConfig:
    """The config a layer class was called with, in either form.

    ``owner`` names the class in errors; ``positional`` is the order of its older positional
    parameters and ``keywords`` its older keyword-only ones (each class accepted a different
    subset, and a name outside it is still a ``TypeError``, as a typo was before). A config
    may come as the first positional argument or as ``config=``; it excludes the older
    arguments, so no option is given twice with two meanings.
    """
    if args and isinstance(args[0], TransformerConfig):
        if config is not None:
            raise TypeError(f"{owner}: got the config both positionally and as config=")
        config, args = args[0], args[1:]
    if config is not None:
        if args or kwargs:
            given = [*(positional[: len(args)]), *kwargs]
            raise TypeError(f"{owner}: pass a TransformerConfig or the separate arguments, not both "
                            f"(also got {given}); use dataclasses.replace(config, ...) to change fields")
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"{owner}: config must be a TransformerConfig, got {type(config).__name__}")
        return config
    if len(args) > len(positional):
        raise TypeError(f"{owner}: takes at most {len(positional)} positional arguments "
                        f"({len(args)} given)")
    values = dict(zip(positional, args))
    accepted = set(positional) | set(keywords)
    for name, value in kwargs.items():
        if name not in accepted:
            raise TypeError(f"{owner}: unexpected keyword argument {name!r}")
        if name in values:
            raise TypeError(f"{owner}: got multiple values for argument {name!r}")
        values[name] = value
    assert accepted <= _FIELDS, f"{owner}: arguments outside TransformerConfig: {accepted - _FIELDS}"
    return TransformerConfig(**values)
