"""Built-in replacements for Hugging Face GPT-2, BERT, RoBERTa and Llama-family models.

GPT-2/BERT/RoBERTa layers become :class:`DistributedTransformerLayer`; Llama, Mistral and
Qwen2 attention and MLP blocks become Megatron column → row
:class:`~smp_tp.layers.block.DistributedBlock` (RMSNorm and rotary embeddings untouched);
GPT-2's and the Llama family's token embedding and output head become vocabulary-parallel
(tied when the model ties them).

Imported only when ``transformers`` is already imported by the user (see
:func:`register_hf_if_loaded`), so smp-tp never requires it. The layer signatures followed
are those of transformers 5 (a layer returns a tensor); layers whose configuration the
generic transformer cannot express (cross-attention, per-layer attention scaling, ...) are
left unreplaced with a warning.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch

from smp_tp.architectures import register_builtin_block, register_builtin_vocab
from smp_tp.builtin import finish
from smp_tp.layers.transformer import DistributedTransformerLayer
from smp_tp.module import DistributedModule
from smp_tp.registry import register_builtin

_ACT_NAMES = {"gelu", "gelu_new", "gelu_pytorch_tanh", "relu"}


def _sub(sd: dict, mapping: list[tuple[str, str]], transpose: Any = frozenset()) -> dict:
    out = {}
    for src, dst in mapping:
        for leaf in ("weight", "bias"):
            key = f"{src}.{leaf}"
            if key in sd:
                t = sd[key]
                out[f"{dst}.{leaf}"] = t.t() if (leaf == "weight" and src in transpose) else t
    return out


def _check_cache(past: Any) -> None:
    if past is not None and hasattr(past, "get_seq_length") and past.get_seq_length() > 0:
        raise NotImplementedError(
            "smp_tp: distributed transformer layers do not use a key/value cache; "
            "call the model with use_cache=False for incremental decoding"
        )


def _install_forward(dist: DistributedModule, original_cls: type, names: dict[str, str]) -> None:
    """Accept the original layer's call signature (HF passes positional arguments too)."""
    sig = inspect.signature(original_cls.forward)  # type: ignore[attr-defined]
    run = dist.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = sig.bind(None, *args, **kwargs).arguments
        extra = bound.get("kwargs", {})
        _check_cache(bound.get("past_key_values", extra.get("past_key_values")))
        if bound.get(names.get("encoder", "encoder_hidden_states")) is not None:
            raise NotImplementedError("smp_tp: cross-attention is not supported for this layer")
        return run(bound["hidden_states"], bound.get("attention_mask"))

    object.__setattr__(dist, "forward", forward)


# ----------------------------------------------------------------------------- GPT-2

_GPT2_MAP = [("ln_1", "attention.pre_layernorm"), ("attn.c_proj", "attention.dense"),
             ("ln_2", "output.pre_layernorm"), ("mlp.c_fc", "output.dense_h_to_4h"),
             ("mlp.c_proj", "output.dense_4h_to_h")]
_GPT2_T = {"attn.c_proj", "mlp.c_fc", "mlp.c_proj"}  # Conv1D stores (in, out)


def _gpt2_to_full(sd: dict) -> dict:
    out = _sub(sd, _GPT2_MAP, _GPT2_T)
    w, b = sd["attn.c_attn.weight"], sd["attn.c_attn.bias"]
    for name, wi, bi in zip(("query", "key", "value"), w.chunk(3, 1), b.chunk(3, 0)):
        out[f"attention.{name}.weight"], out[f"attention.{name}.bias"] = wi.t(), bi
    return out


def _gpt2_from_full(sd: dict) -> dict:
    inverse = [(dst, src) for src, dst in _GPT2_MAP]
    out = _sub(sd, inverse, {dst for src, dst in _GPT2_MAP if src in _GPT2_T})
    names = ("query", "key", "value")
    out["attn.c_attn.weight"] = torch.cat([sd[f"attention.{n}.weight"].t() for n in names], 1)
    out["attn.c_attn.bias"] = torch.cat([sd[f"attention.{n}.bias"] for n in names])
    return out


def _gpt2_block(m: Any) -> DistributedModule | None:
    attn = m.attn
    cfg = attn.config
    reason = None
    if hasattr(m, "crossattention"):
        reason = "cross-attention"
    elif getattr(attn, "scale_attn_by_inverse_layer_idx", False) or getattr(attn, "reorder_and_upcast_attn", False):
        reason = "scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn"
    elif not getattr(attn, "scale_attn_weights", True):
        reason = "scale_attn_weights=False"
    elif cfg.activation_function not in _ACT_NAMES:
        reason = f"activation {cfg.activation_function!r}"
    if reason:
        warnings.warn(f"smp_tp: GPT2Block with {reason} is left unreplaced", stacklevel=3)
        return None
    w = attn.c_attn.weight
    dist = DistributedTransformerLayer(
        num_attention_heads=attn.num_heads, attention_head_size=attn.head_dim,
        hidden_size=attn.embed_dim, intermediate_size=m.mlp.c_fc.weight.shape[1],
        attention_dropout_prob=cfg.attn_pdrop, hidden_dropout_prob=cfg.resid_pdrop,
        activation=cfg.activation_function, layernorm_epsilon=m.ln_1.eps,
        causal_mask_size=cfg.n_positions, pre_layernorm=True, post_layernorm=False,
        dtype=w.dtype, device=w.device,
    )
    finish(dist, m, _gpt2_to_full, _gpt2_from_full)
    _install_forward(dist, type(m), {})
    return dist


# ------------------------------------------------------------------- BERT / RoBERTa

_BERT_MAP = [("attention.self.query", "attention.query"), ("attention.self.key", "attention.key"),
             ("attention.self.value", "attention.value"), ("attention.output.dense", "attention.dense"),
             ("attention.output.LayerNorm", "attention.post_layernorm"),
             ("intermediate.dense", "output.dense_h_to_4h"), ("output.dense", "output.dense_4h_to_h"),
             ("output.LayerNorm", "output.post_layernorm")]


def _bert_to_full(sd: dict) -> dict:
    return _sub(sd, _BERT_MAP)


def _bert_from_full(sd: dict) -> dict:
    return _sub(sd, [(dst, src) for src, dst in _BERT_MAP])


def _bert_layer(m: Any) -> DistributedModule | None:
    selfattn = m.attention.self
    cfg = selfattn.config
    reason = None
    if getattr(m, "add_cross_attention", False):
        reason = "cross-attention"
    elif getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        reason = f"position_embedding_type={cfg.position_embedding_type!r}"
    elif not isinstance(cfg.hidden_act, str) or cfg.hidden_act not in _ACT_NAMES:
        reason = f"activation {cfg.hidden_act!r}"
    elif getattr(m, "chunk_size_feed_forward", 0):
        reason = "chunk_size_feed_forward"
    if reason:
        warnings.warn(f"smp_tp: {type(m).__name__} with {reason} is left unreplaced", stacklevel=3)
        return None
    w = selfattn.query.weight
    dist = DistributedTransformerLayer(
        num_attention_heads=selfattn.num_attention_heads,
        attention_head_size=selfattn.attention_head_size, hidden_size=w.shape[1],
        intermediate_size=m.intermediate.dense.weight.shape[0],
        attention_dropout_prob=cfg.attention_probs_dropout_prob,
        hidden_dropout_prob=cfg.hidden_dropout_prob, activation=cfg.hidden_act,
        layernorm_epsilon=m.output.LayerNorm.eps,
        causal_mask_size=cfg.max_position_embeddings if getattr(selfattn, "is_causal", False) else None,
        pre_layernorm=False, post_layernorm=True, dtype=w.dtype, device=w.device,
    )
    finish(dist, m, _bert_to_full, _bert_from_full)
    _install_forward(dist, type(m), {})
    return dist


# ------------------------------------------------------- Llama family (Mistral, Qwen2)

_ATTN_COLUMN, _ATTN_ROW = ("q_proj", "k_proj", "v_proj"), ("o_proj",)
_MLP_COLUMN, _MLP_ROW = ("gate_proj", "up_proj"), ("down_proj",)


def _attention_heads(m: Any) -> dict[str, int]:
    cfg = m.config
    heads = cfg.num_attention_heads
    return {"num_attention_heads": heads, "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads}


# (module, attention class, MLP class, causal LM class, base model class)
_LLAMA_FAMILY = [
    ("transformers.models.llama.modeling_llama", "Llama"),
    ("transformers.models.mistral.modeling_mistral", "Mistral"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
]


# T5: attention (self and cross) and both feed-forward kinds. The first layer's relative
# position bias table (buckets, heads) is split over heads, so the bias it returns — which
# the later layers reuse — holds this rank's heads (``local``: never gathered);
# cross-attention's encoder states feed k/v (``inputs``).
_T5_ATTENTION: dict[str, Any] = dict(
    divide=("n_heads", "inner_dim"), shard={"relative_attention_bias.weight": 1},
    local=("position_bias",), inputs=("key_value_states",))


def _register_t5(mod: Any) -> None:
    register_builtin_block(mod.T5Attention, ("q", "k", "v"), ("o",), None, **_T5_ATTENTION)
    register_builtin_block(mod.T5DenseActDense, ("wi",), ("wo",))
    register_builtin_block(mod.T5DenseGatedActDense, ("wi_0", "wi_1"), ("wo",))
    register_builtin_vocab(mod.T5ForConditionalGeneration, hf_causal_lm=False, hf_seq2seq_lm=True)
    register_builtin_vocab(mod.T5Model, hf_causal_lm=False, head="")
    register_builtin_vocab(mod.T5EncoderModel, hf_causal_lm=False, head="")


def register_hf_if_loaded() -> None:
    """Register the Hugging Face mappings of the model modules ``transformers`` has loaded.

    Only modules already imported are looked at (a model's class is imported before the
    model exists), so this costs nothing and never imports ``transformers`` itself.
    """
    if "transformers" not in sys.modules:
        return
    targets = [
        ("transformers.models.gpt2.modeling_gpt2", "GPT2Block", _gpt2_block),
        ("transformers.models.bert.modeling_bert", "BertLayer", _bert_layer),
        ("transformers.models.roberta.modeling_roberta", "RobertaLayer", _bert_layer),
    ]
    for modname, clsname, conv in targets:
        cls = getattr(sys.modules.get(modname), clsname, None)
        if cls is not None:
            register_builtin(cls, DistributedTransformerLayer, conv)
    gpt2 = sys.modules.get("transformers.models.gpt2.modeling_gpt2")
    if gpt2 is not None:
        register_builtin_vocab(gpt2.GPT2LMHeadModel, hf_causal_lm=True)
        register_builtin_vocab(gpt2.GPT2Model, hf_causal_lm=False)
    for modname, prefix in _LLAMA_FAMILY:
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        register_builtin_block(getattr(mod, f"{prefix}Attention"), _ATTN_COLUMN, _ATTN_ROW, _attention_heads)
        register_builtin_block(getattr(mod, f"{prefix}MLP"), _MLP_COLUMN, _MLP_ROW)
        register_builtin_vocab(getattr(mod, f"{prefix}ForCausalLM"), hf_causal_lm=True)
        register_builtin_vocab(getattr(mod, f"{prefix}Model"), hf_causal_lm=False)
    t5 = sys.modules.get("transformers.models.t5.modeling_t5")
    if t5 is not None:
        _register_t5(t5)
