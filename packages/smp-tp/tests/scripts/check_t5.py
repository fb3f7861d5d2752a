"""Hugging Face T5 (self-attention, cross-attention, relative position bias, dense and gated
feed-forward, the shared embedding tied to three modules) through parallelize(), against
the unwrapped model; and the collectives per encoder and decoder block.

Every rank feeds different samples (scaled batch) or the same ones (prescaled), with right
padding of the encoder input that differs between ranks (the padding mask travels with the
samples) and one ignored label (-100) per rank at a rank-dependent position, so every rank
has the same number of targets and the mean of the per-rank losses is the unwrapped
model's loss on the concatenated batch. Checked: that loss (T5 computes it inline; with a
vocabulary-parallel head it is computed from the logits shards), the logits (gathered from
the shards, and without labels where the head returns full logits), every gradient after
sync_gradients, the full state dict (keys, shapes and values of the unwrapped model; loads
strictly into a fresh one), no nn.Linear and no vocabulary nn.Embedding left, the tie of
``shared``/``encoder.embed_tokens``/``decoder.embed_tokens`` (and ``lm_head``) kept as one
parameter, and the parameter bytes per rank.
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
from torch import nn

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration  # noqa: E402

rank, T, single = setup()
failures = FAILURES
B, S_ENC, S_DEC, V, D = 2, 7, 5, 97, 32
SIZES = dict(vocab_size=V, d_model=D, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
             use_cache=False, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1)


def _untied(model: T5ForConditionalGeneration) -> T5ForConditionalGeneration:
    # transformers 5 always ties T5's head; untie it to test a separate head shard too
    model.lm_head.weight = nn.Parameter(model.shared.weight.detach().clone())
    return model


MODELS = {
    "t5-relu-tied": lambda: T5ForConditionalGeneration(
        T5Config(**SIZES, feed_forward_proj="relu", attn_implementation="eager")),
    "t5-gated-untied": lambda: _untied(T5ForConditionalGeneration(
        T5Config(**SIZES, feed_forward_proj="gated-gelu", tie_word_embeddings=False, attn_implementation="sdpa"))),
    "t5-encoder": lambda: T5EncoderModel(T5Config(**SIZES, feed_forward_proj="gated-gelu", attn_implementation="sdpa")),
}
BLOCKS = {"t5-relu-tied": 10, "t5-gated-untied": 10, "t5-encoder": 4}  # attention + FF modules


def inputs(seed: int, b: int = B) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (b, S_ENC), generator=gen)
    mask = torch.ones(b, S_ENC, dtype=torch.long)
    mask[b - 1, S_ENC - 1 - seed % 3:] = 0  # right padding, different on every rank
    labels = torch.randint(2, V, (b, S_DEC), generator=gen)
    labels[b - 1, seed % S_DEC] = -100  # one ignored target per rank, at another place
    return ids, mask, labels


def build_pair(name: str, prescaled: bool):
    torch.manual_seed(0)
    ref = MODELS[name]()
    randomize(ref)
    with torch.no_grad():  # T5 does not scale q·k: keep the scores moderate, as its init does
        for n, p in ref.named_parameters():
            if n.endswith((".q.weight", "relative_attention_bias.weight")):
                p.mul_(0.25)
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
    seq2seq = hasattr(ref, "lm_head")
    ids, mask, labels = inputs(7 if prescaled else 7 + rank, b)
    every = [t if prescaled else gather_batch(t) for t in (ids, mask, labels)]
    own = (lambda t: t) if prescaled else (lambda t: t.chunk(T, 0)[rank])
    if seq2seq:
        dec = model.prepare_decoder_input_ids_from_labels(labels=labels)
        with torch.no_grad():  # no labels: the head returns full logits
            full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        logits = smp_tp.gather_vocab_parallel_logits(out.logits.detach(), model.lm_head)
        loss = out.loss
    else:
        y = model(input_ids=ids, attention_mask=mask).last_hidden_state
        loss = (y ** 2).mean()
    loss.backward()
    smp_tp.sync_gradients(model)
    got_grads, state = smp_tp.full_grad_dict(model), smp_tp.full_state_dict(model)
    mean_loss = loss.detach() if prescaled else smp_tp.allreduce_for_tp(loss.detach()) / T
    # all collectives done: assertions below cannot desynchronise the ranks
    if seq2seq:
        ref_out = ref(input_ids=every[0], attention_mask=every[1], labels=every[2])
        ref_loss, ref_y = ref_out.loss, ref_out.logits
    else:
        ref_y = ref(input_ids=every[0], attention_mask=every[1]).last_hidden_state
        ref_loss = sum((c ** 2).mean() for c in ref_y.chunk(1 if prescaled else T, 0)) / (1 if prescaled else T)
    ref_loss.backward()
    want_grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    close(f"{name} loss", mean_loss, ref_loss)
    if seq2seq:
        close_norm(f"{name} logits", logits, own(ref_y))
        close_norm(f"{name} logits without labels", full, own(ref_y))
    else:
        close_norm(f"{name} hidden", y, own(ref_y))
    close_norm_dicts(f"{name} grads", got_grads, want_grads)
    close_dicts(f"{name} state", state, ref.state_dict(), 0, 0)
    fresh = MODELS[name]()
    fresh.load_state_dict(state, strict=True)
    left = [n for n, m in model.named_modules() if type(m) is nn.Linear
            or (type(m) is nn.Embedding and not n.endswith("relative_attention_bias"))]
    kinds = [type(m).__name__ for m in model.modules()]
    if left or kinds.count("DistributedBlock") != BLOCKS[name]:
        raise AssertionError(f"{name}: left {left}; {kinds}")
    shared = model.get_input_embeddings()
    if not isinstance(shared, smp_tp.VocabParallelEmbedding):
        raise AssertionError(f"{name}: {type(shared).__name__}")
    stacks = [model.encoder] + ([model.decoder] if seq2seq else [])
    if any(s.embed_tokens.weight is not shared.weight for s in stacks):
        raise AssertionError(f"{name}: embed_tokens no longer share the embedding's shard")
    if seq2seq and (ref.lm_head.weight is ref.shared.weight) != (model.lm_head.weight is shared.weight):
        raise AssertionError(f"{name}: the head's tie changed")
    ratio = param_bytes(model) / param_bytes(ref)
    if T == 2 and ratio > 0.55:
        raise AssertionError(f"{name}: parameter bytes per rank {ratio:.3f} of the unwrapped model")
    if rank == 0:
        log(f"{name} prescaled={prescaled}{'' if b == B else f' batch={b}'}: OK (parameter bytes per rank {ratio:.3f} x unwrapped)")


for name in MODELS:
    for prescaled in (False, True):
        check(f"{name}/{prescaled}", run, name, prescaled)
# one sample per rank: the (1, heads/T, q, k) position bias must not be taken for a sample
check("t5 batch 1", run, "t5-relu-tied", False, 1)


# Collectives per block: one pair per attention module and per feed-forward module, and
# cross-attention's encoder states get the input's collective once more (they feed k, v).
# A mapping that fell back to per-linear DistributedLinear (6 or 10 linears per block)
# would show all-to-alls here.
PER_BLOCK = {
    ("encoder", False): {"forward": {"all_gather": 2, "reduce_scatter": 2},
                         "backward": {"all_gather": 2, "reduce_scatter": 2}},
    ("encoder", True): {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
    ("decoder", False): {"forward": {"all_gather": 4, "reduce_scatter": 3},
                         "backward": {"all_gather": 3, "reduce_scatter": 4}},
    ("decoder", True): {"forward": {"all_reduce": 3}, "backward": {"all_reduce": 4}},
}


def counts(prescaled: bool) -> None:
    ref, model = build_pair("t5-relu-tied", prescaled)
    torch.manual_seed(3 + (0 if prescaled else rank))
    h = torch.randn(B, S_DEC, D, requires_grad=True)
    enc = torch.randn(B, S_ENC, D, requires_grad=True)
    got = {}
    for stack in ("encoder", "decoder"):
        block = getattr(model, stack).block[1]  # a later block: the position bias comes in
        bias = getattr(model, stack).block[0].layer[0].SelfAttention.compute_bias(S_DEC, S_DEC)
        with smp_tp.collective_counts() as c:
            if stack == "encoder":
                out = block(h, None, bias)[0]
            else:
                out = block(h, None, bias, enc, None, None)[0]
            out.sum().backward()
        got[stack] = c.total()
        if got[stack] != PER_BLOCK[stack, prescaled]:
            raise AssertionError(f"prescaled={prescaled}: {stack} block collectives {got[stack]} != "
                                 f"{PER_BLOCK[stack, prescaled]}")
    ids, mask, labels = inputs(5 if prescaled else 5 + rank)
    with smp_tp.collective_counts() as whole:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    if rank == 0:
        for stack in ("encoder", "decoder"):
            log(f"t5 collectives per {stack} block (prescaled={prescaled}): {got[stack]}")
        log(f"t5 whole 2+2-layer model with loss (prescaled={prescaled}): {whole.total()}")


check("counts scaled", counts, False)
check("counts prescaled", counts, True)


def heads_error() -> None:
    model = T5EncoderModel(T5Config(**{**SIZES, "num_heads": 3}))
    smp_tp.set_tensor_parallelism(model)
    try:
        smp_tp.parallelize(model)
    except ValueError as e:
        for text in ("encoder.block.0.layer.0.SelfAttention", "n_heads=3", f"degree {T}"):
            if text not in str(e):
                raise AssertionError(f"{e!r} lacks {text!r}") from e
    else:
        raise AssertionError("no error for num_heads=3")


check("heads error", heads_error)
finish(failures)
