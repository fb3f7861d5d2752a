"""Hugging Face Llama (tied and untied head, grouped-query attention), Mistral and Qwen2
through parallelize(), against the unwrapped model; and the collectives per decoder layer.

Every rank feeds different samples (scaled batch) or the same ones (prescaled), with
right padding that differs between ranks (the causal mask is per sample and must travel
with the samples) and labels ignored (-100) on padding, so ranks have different numbers of
tokens in the loss: the loss is Hugging Face's sum / ``num_items_in_batch`` with the TP
group's count over T, which makes the mean of the per-rank losses the unwrapped model's
loss on the concatenated batch. Checked: that loss, the logits (gathered from the
vocabulary shards, and without labels where the head returns full logits), every gradient
after sync_gradients, the full state dict (keys, shapes and values of the unwrapped model;
loads strictly into a fresh one), no nn.Linear/nn.Embedding left, the tie kept, and the
parameter bytes per rank.
"""

from __future__ import annotations

import copy
import os
import warnings

import smp_tp
import torch
from common import (
    FAILURES,
    check,
    close,
    close_dicts,
    close_norm,
    close_norm_dicts,
    finish,
    gather_batch,
    log,
    param_bytes,
    randomize,
    setup,
)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

rank, T, single = setup()
failures = FAILURES
B, S, V, H = 2, 6, 97, 64
SIZES = dict(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)


MODELS = {
    "llama-tied-gqa": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=4, tie_word_embeddings=True,
                                                           attn_implementation="sdpa")),
    "llama-untied": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=8, tie_word_embeddings=False,
                                                         attn_implementation="sdpa")),
    "mistral-eager": lambda: MistralForCausalLM(MistralConfig(**SIZES, num_key_value_heads=4, tie_word_embeddings=False,
                                                              attn_implementation="eager")),
    "qwen2-bias-tied": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES, num_key_value_heads=4, tie_word_embeddings=True,
                                                            attn_implementation="sdpa")),
    "llama-base": lambda: LlamaModel(LlamaConfig(**SIZES, num_key_value_heads=4, attn_implementation="sdpa")),
}


def inputs(seed: int, b: int = B) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (b, S), generator=gen)
    mask = torch.ones(b, S, dtype=torch.long)
    mask[b - 1, S - 1 - seed % 3:] = 0  # right padding, different on every rank
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def tokens_in_loss(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())  # Hugging Face shifts the labels by one


def build_pair(name: str, prescaled: bool):
    torch.manual_seed(0)
    ref = MODELS[name]()
    randomize(ref)
    model = copy.deepcopy(ref)
    smp_tp.set_tensor_parallelism(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp_tp.parallelize(model, prescaled_batch=prescaled)
    unreplaced = [str(w.message) for w in caught if "smp_tp" in str(w.message)]
    if unreplaced:
        raise AssertionError(f"{name}: {unreplaced}")
    return ref, model


def run(name: str, prescaled: bool, b: int = B) -> None:
    ref, model = build_pair(name, prescaled)
    causal = hasattr(ref, "lm_head")
    kinds = [type(m).__name__ for m in model.modules()]
    ids, mask, labels = inputs(7 if prescaled else 7 + rank, b)
    every = [t if prescaled else gather_batch(t) for t in (ids, mask, labels)]
    own = (lambda t: t) if prescaled else (lambda t: t.chunk(T, 0)[rank])
    n_all = tokens_in_loss(every[2])
    if causal:
        with torch.no_grad():  # no labels: the head returns full logits
            full = model(input_ids=ids, attention_mask=mask).logits
        items = torch.tensor(float(n_all) / (1 if prescaled else T))
        out = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
        logits = smp_tp.gather_vocab_parallel_logits(out.logits.detach(), model.lm_head)
        loss = out.loss
        shard_shape = tuple(out.logits.shape)
    else:
        y = model(input_ids=ids, attention_mask=mask).last_hidden_state
        loss = (y ** 2).mean()
    loss.backward()
    smp_tp.sync_gradients(model)
    got_grads, state = smp_tp.full_grad_dict(model), smp_tp.full_state_dict(model)
    mean_loss = loss.detach() if prescaled else smp_tp.allreduce_for_tp(loss.detach()) / T
    # all collectives done: assertions below cannot desynchronise the ranks
    if causal:
        ref_out = ref(input_ids=every[0], attention_mask=every[1], labels=every[2])
        ref_loss, ref_y = ref_out.loss, ref_out.logits
    else:
        ref_y = ref(input_ids=every[0], attention_mask=every[1]).last_hidden_state
        ref_loss = sum((c ** 2).mean() for c in ref_y.chunk(1 if prescaled else T, 0)) / (1 if prescaled else T)
    ref_loss.backward()
    want_grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    close(f"{name} loss", mean_loss, ref_loss)
    if causal:
        rows = ceil_div(V, T)
        want_shape = (b if prescaled else T * b, S, rows)
        if shard_shape != want_shape:
            raise AssertionError(f"{name}: logits shard {shard_shape} != {want_shape}")
        # norm-based (see common.close_norm): row-parallel outputs are sums of per-rank
        # partial products, reduced in another order than the unwrapped matmul's
        close_norm(f"{name} logits", logits, own(ref_y))
        close_norm(f"{name} logits without labels", full, own(ref_y))
    else:
        close_norm(f"{name} hidden", y, own(ref_y))
    close_norm_dicts(f"{name} grads", got_grads, want_grads)
    close_dicts(f"{name} state", state, ref.state_dict(), 0, 0)
    fresh = MODELS[name]()
    fresh.load_state_dict(state, strict=True)
    for kind in ("Linear", "Embedding"):
        if kind in kinds:
            raise AssertionError(f"{name}: an nn.{kind} was left: {kinds}")
    if kinds.count("DistributedBlock") != 4 or "VocabParallelEmbedding" not in kinds:
        raise AssertionError(f"{name}: {kinds}")
    if causal and ref.lm_head.weight is ref.get_input_embeddings().weight:
        if model.lm_head.weight is not model.get_input_embeddings().weight:
            raise AssertionError(f"{name}: the tie was lost")
    ratio = param_bytes(model) / param_bytes(ref)
    if T == 2 and ratio > 0.55:
        raise AssertionError(f"{name}: parameter bytes per rank {ratio:.3f} of the unwrapped model")
    if rank == 0:
        log(f"{name} prescaled={prescaled}{'' if b == B else f' batch={b}'}: OK "
            f"(parameter bytes per rank {ratio:.3f} x unwrapped)")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


for name in MODELS:
    for prescaled in (False, True):
        if name == "llama-base" and prescaled:
            continue
        check(f"{name}/{prescaled}", run, name, prescaled)
# one sample per rank: (1, ...) arguments (position ids, cos/sin) are per sample too
check("llama batch 1", run, "llama-tied-gqa", False, 1)


# Collectives per decoder layer: one pair per attention block and one per MLP block.
# A mapping that fell back to per-linear DistributedLinear (7 linears) would show 7
# all-to-all + 7 reduce-scatter forward here instead.
PER_LAYER = {
    False: {"forward": {"all_gather": 2, "reduce_scatter": 2}, "backward": {"all_gather": 2, "reduce_scatter": 2}},
    True: {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
}


def counts(prescaled: bool) -> None:
    ref, model = build_pair("llama-tied-gqa", prescaled)
    layer = model.model.layers[0]
    torch.manual_seed(3 + (0 if prescaled else rank))
    h = torch.randn(B, S, H, requires_grad=True)
    pos = torch.arange(S)[None]
    cos, sin = model.model.rotary_emb(h, pos)
    with smp_tp.collective_counts() as c:
        layer(h, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin)).sum().backward()
    ids, mask, labels = inputs(5 if prescaled else 5 + rank)
    with smp_tp.collective_counts() as whole:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    if c.total() != PER_LAYER[prescaled]:
        raise AssertionError(f"prescaled={prescaled}: per-layer collectives {c.total()} != {PER_LAYER[prescaled]}")
    if rank == 0:
        log(f"llama collectives per decoder layer (prescaled={prescaled}): {c.total()}; "
            f"whole 2-layer model with loss: {whole.total()}")


check("counts scaled", counts, False)
check("counts prescaled", counts, True)


def gqa_error() -> None:
    model = LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=1))
    smp_tp.set_tensor_parallelism(model)
    try:
        smp_tp.parallelize(model)
    except ValueError as e:
        for text in ("model.layers.0.self_attn", "num_key_value_heads=1", f"degree {T}"):
            if text not in str(e):
                raise AssertionError(f"{e!r} lacks {text!r}") from e
    else:
        raise AssertionError("no error for num_key_value_heads=1")


check("gqa error", gqa_error)
finish(failures)
