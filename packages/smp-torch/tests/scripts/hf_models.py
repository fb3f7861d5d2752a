"""Hugging Face models built from a config (no download, no weights), at any size.

One builder per architecture, shared by the multi-process tests (``models.py``: tiny sizes)
and by ``benchmarks/bench_plan.py`` (sizes a CPU grid point runs in seconds), so the two build
the same modules the same way. No smp or MPI import here: the benchmark's planner process
imports this file without starting MPI. Dropout is off everywhere (runs must be repeatable),
and the caller seeds torch before building.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def gpt2(vocab: int, dim: int, heads: int, layers: int, seq: int) -> nn.Module:
    """``GPT2LMHeadModel`` (tied head)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def llama(
    vocab: int, dim: int, inter: int, heads: int, kv_heads: int, layers: int, seq: int, tied: bool = True
) -> nn.Module:
    """``LlamaForCausalLM``: grouped-query attention, rotary embeddings, SwiGLU, the head
    tied to the token embedding unless ``tied`` is false."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
        tie_word_embeddings=tied, use_cache=False, attn_implementation="sdpa",
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def t5(
    vocab: int, dim: int, d_kv: int, d_ff: int, heads: int, layers: int, decoder_layers: int | None = None,
    buckets: int = 8, max_distance: int = 16,
) -> nn.Module:
    """``T5ForConditionalGeneration``: encoder-decoder, relative position biases, the
    embedding shared by encoder, decoder and head."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=vocab, d_model=dim, d_kv=d_kv, d_ff=d_ff, num_layers=layers,
        num_decoder_layers=layers if decoder_layers is None else decoder_layers,
        num_heads=heads, relative_attention_num_buckets=buckets,
        relative_attention_max_distance=max_distance, dropout_rate=0.0, use_cache=False,
        pad_token_id=0, decoder_start_token_id=0, eos_token_id=1, feed_forward_proj="relu",
        attn_implementation="eager",
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def mixtral(
    vocab: int, dim: int, inter: int, heads: int, kv_heads: int, layers: int, seq: int,
    experts: int = 4, top_k: int = 2,
) -> nn.Module:
    """``MixtralForCausalLM``: sparse mixture-of-experts MLPs (``experts`` experts, each token
    routed to ``top_k``), transformers' own expert loop (``experts_implementation`` eager)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=seq, use_cache=False,
        experts_implementation="eager", attn_implementation="sdpa", router_aux_loss_coef=0.0,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return MixtralForCausalLM(cfg)


def vit(image: int, patch: int, dim: int, heads: int, layers: int, classes: int) -> nn.Module:
    """``ViTForImageClassification``: 3-channel ``image`` x ``image`` inputs cut into
    ``patch`` x ``patch`` patches, a [CLS] token, a linear classifier."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=image, patch_size=patch, num_channels=3, hidden_size=dim,
        num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * dim,
        num_labels=classes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return ViTForImageClassification(cfg)


def logits(model: Any, kind: str, x: Any) -> Any:
    """``model``'s logits for the input batch ``x``: an encoder-decoder (``"t5"``) reads
    ``x`` and also gets it as the decoder's input (teacher forcing on the batch itself); a
    vision model (``"vit"``) reads ``x`` as pixel values."""
    if kind == "t5":
        return model(input_ids=x, decoder_input_ids=x).logits
    if kind == "vit":
        return model(pixel_values=x).logits
    return model(input_ids=x).logits
