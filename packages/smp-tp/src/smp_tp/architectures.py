"""Registering a model architecture: Megatron blocks and vocabulary-parallel embeddings.

Two registrations describe most of today's decoder models (see the README's recipe):

* :func:`tp_register_block` — a block class (attention, MLP) whose ``column`` linears are
  split over output channels and ``row`` linears over input channels, with the original
  forward in between (:class:`~smp_tp.layers.block.DistributedBlock`): one collective pair
  per block.
* :func:`tp_register_vocab_parallel` — a model class whose input embedding (and output head,
  tied or not) become :class:`~smp_tp.VocabParallelEmbedding` /
  :class:`~smp_tp.VocabParallelLMHead`, keeping a tie as one shared shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from smp_tp.layers.block import DistributedBlock
from smp_tp.registry import Registration, _registry


@dataclass(frozen=True)
class VocabPlan:
    """Where a model keeps its vocabulary modules (paths relative to the model)."""

    embedding: str | None  # None: ``model.get_input_embeddings()`` (Hugging Face)
    head: str | None  # None: ``model.get_output_embeddings()`` if any; "": no head
    hf_causal_lm: bool  # take over the model's ``loss_function`` (ForCausalLMLoss semantics)
    hf_seq2seq_lm: bool = False  # compute the loss from ``labels`` around the forward (T5)


_vocab_plans: dict[type, VocabPlan] = {}


def _block_converter(
    column: Sequence[str], row: Sequence[str], sizes: Callable[[nn.Module], dict[str, int]] | None,
    divide: Sequence[str], input_name: str, shard: dict[str, int] | None = None,
    local: Sequence[str] = (), inputs: Sequence[str] = (),
) -> Callable[[nn.Module], DistributedBlock]:
    column, row, divide = tuple(column), tuple(row), tuple(divide)
    shard, local, inputs = dict(shard or {}), tuple(local), tuple(inputs)

    def convert(module: nn.Module) -> DistributedBlock:
        return DistributedBlock(module, column, row, sizes=sizes, divide=divide, input_name=input_name,
                                shard=shard, local=local, inputs=inputs)

    return convert


def tp_register_block(
    module_cls: type,
    column: Sequence[str],
    row: Sequence[str],
    *,
    sizes: Callable[[nn.Module], dict[str, int]] | None = None,
    divide: Sequence[str] = (),
    input_name: str = "hidden_states",
    shard: dict[str, int] | None = None,
    local: Sequence[str] = (),
    inputs: Sequence[str] = (),
) -> None:
    """Replace marked instances of ``module_cls`` by a :class:`DistributedBlock`.

    ``column``/``row``: names of ``nn.Linear`` children split over outputs / inputs;
    ``sizes(module)``: sizes that must divide by the degree (e.g. head counts);
    ``divide``: integer attributes the forward reads that become per-rank values (e.g.
    ``["num_heads"]``); the block's output must be the row linear's output.
    ``shard``: further per-head parameters split along a dimension
    (``{"relative_attention_bias.weight": 1}``); ``local``: arguments holding per-rank
    values, never gathered (a position bias derived from ``shard`` parameters);
    ``inputs``: further arguments feeding column linears (cross-attention's encoder states).
    Example (Llama attention and MLP)::

        smp_tp.tp_register_block(LlamaAttention, ["q_proj", "k_proj", "v_proj"], ["o_proj"],
            sizes=lambda m: {"num_attention_heads": m.config.num_attention_heads,
                             "num_key_value_heads": m.config.num_key_value_heads})
        smp_tp.tp_register_block(LlamaMLP, ["gate_proj", "up_proj"], ["down_proj"])
    """
    _registry[module_cls] = Registration(
        DistributedBlock,
        converter=_block_converter(column, row, sizes, divide, input_name, shard, local, inputs))


def register_builtin_block(
    module_cls: type, column: Sequence[str], row: Sequence[str],
    sizes: Callable[[nn.Module], dict[str, int]] | None = None, **options: Any,
) -> None:
    """Like :func:`tp_register_block` (same keyword options), but a user registration of
    the class wins."""
    if module_cls not in _registry:
        tp_register_block(module_cls, column, row, sizes=sizes, **options)


def tp_register_vocab_parallel(
    model_cls: type,
    embedding: str | None = None,
    head: str | None = None,
    *,
    hf_causal_lm: bool = False,
    hf_seq2seq_lm: bool = False,
) -> None:
    """Make the vocabulary modules of marked ``model_cls`` instances vocabulary-parallel.

    ``embedding``/``head``: paths of the ``nn.Embedding`` and output ``nn.Linear`` inside
    the model (``None``: Hugging Face's ``get_input_embeddings()`` /
    ``get_output_embeddings()``; ``head=""``: no head). A head whose weight *is* the
    embedding's weight stays tied (one shard). ``hf_causal_lm=True``: the model is a Hugging
    Face causal LM; its ``loss_function`` becomes vocabulary-parallel and its head returns
    logits shards while a forward call computes the loss from ``labels`` (full logits
    otherwise). ``hf_seq2seq_lm=True``: a Hugging Face encoder-decoder LM computing its
    cross entropy inline (T5): a forward call with ``labels`` runs without them (decoder
    inputs from ``prepare_decoder_input_ids_from_labels``) and the loss is computed from the
    logits shards. Otherwise the head always returns shards, for
    :func:`smp_tp.vocab_parallel_cross_entropy`. Further ``nn.Embedding`` modules of the
    model holding the embedding's very parameter (T5's ``encoder.embed_tokens`` and
    ``decoder.embed_tokens``) become vocabulary-parallel embeddings sharing its shard.
    """
    if hf_causal_lm and hf_seq2seq_lm:
        raise ValueError("tp_register_vocab_parallel: hf_causal_lm and hf_seq2seq_lm exclude each other")
    _vocab_plans[model_cls] = VocabPlan(embedding, head, hf_causal_lm, hf_seq2seq_lm)


def register_builtin_vocab(model_cls: type, hf_causal_lm: bool, hf_seq2seq_lm: bool = False,
                           head: str | None = None) -> None:
    """Built-in Hugging Face registration; a user registration of the class wins."""
    _vocab_plans.setdefault(model_cls, VocabPlan(None, head, hf_causal_lm, hf_seq2seq_lm))


def vocab_plan(model: nn.Module) -> VocabPlan | None:
    """The vocabulary plan for ``type(model)`` exactly."""
    return _vocab_plans.get(type(model))
