"""Hugging Face GPT-2, BERT and RoBERTa through parallelize(), against the originals.

GPT-2's tied wte/lm_head become one vocabulary-parallel shard per rank (vocab 97 does not
divide by 2 or 4: padded), its loss comes from vocab_parallel_cross_entropy.

Every rank feeds different samples (scaled batch) or the same ones (prescaled); outputs,
gradients after sync_gradients and the gathered state dict must match the unwrapped model
on the concatenated batch; the state dict must load into the original class strictly.
"""

from __future__ import annotations

import copy
import os
import traceback
import warnings

import smp_tp
import torch
from common import close, close_dicts, finish, gather_batch, log, param_bytes, setup

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaModel,
)

rank, T, single = setup()
failures: list[str] = []
B, S, V = 2, 6, 97


def gpt2():
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def bert_cfg(cls):
    return cls(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
               vocab_size=V, max_position_embeddings=40, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=1)


MODELS = {
    "gpt2": (gpt2, "GPT2Block"),
    "bert": (lambda: BertModel(bert_cfg(BertConfig)), "BertLayer"),
    "roberta": (lambda: RobertaModel(bert_cfg(RobertaConfig)), "RobertaLayer"),
}


def inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - 1 - seed % 2:] = 0  # padding differs between ranks
    return ids, mask


def loss_of(name, model, ids, mask):
    if name == "gpt2":
        out = model(input_ids=ids, labels=ids)
        logits = out.logits
        if isinstance(model.lm_head, smp_tp.VocabParallelLMHead):  # called with labels: vocab shards
            logits = smp_tp.gather_vocab_parallel_logits(logits.detach(), model.lm_head)
        return logits, out.loss
    out = model(input_ids=ids, attention_mask=mask)
    h = out.last_hidden_state
    return h, (h ** 2).mean() + out.pooler_output.mean()


def run(name: str, prescaled: bool, optimize: str) -> None:
    build, layer_cls = MODELS[name]
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    smp_tp.set_tensor_parallelism(model)
    smp_tp.parallelize(model, prescaled_batch=prescaled, optimize=optimize)
    kinds = [type(m).__name__ for m in model.modules()]
    n_layers = kinds.count("DistributedTransformerLayer")
    ids, mask = inputs(7 if prescaled else 7 + rank)
    all_ids, all_mask = (ids, mask) if prescaled else (gather_batch(ids), gather_batch(mask))
    y, loss = loss_of(name, model, ids, mask)
    y_ref, loss_ref = loss_of(name, ref, all_ids, all_mask)
    loss.backward()
    loss_ref.backward()
    smp_tp.sync_gradients(model)
    got_grads = smp_tp.full_grad_dict(model)
    sd = smp_tp.full_state_dict(model)
    mean_loss = loss.detach() if prescaled else smp_tp.allreduce_for_tp(loss.detach()) / T
    # all collectives done; now assert
    assert n_layers == 2 and layer_cls not in kinds, kinds
    close(f"{name} loss", mean_loss, loss_ref)
    ratio = param_bytes(model) / param_bytes(ref)
    if name == "gpt2":  # the tied wte/lm_head: one vocabulary shard per rank
        assert type(model.transformer.wte).__name__ == "VocabParallelEmbedding", kinds
        assert model.lm_head.weight is model.transformer.wte.weight, "tie lost"
        assert "Embedding" not in kinds and "Linear" not in kinds, kinds
        if T == 2 and ratio > 0.55:
            raise AssertionError(f"gpt2: parameter bytes per rank {ratio:.3f} of the unwrapped model")
    want_grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    close(f"{name} output", y, y_ref if prescaled else y_ref.chunk(T)[rank])
    close_dicts(f"{name} grads", got_grads, want_grads)
    fresh = build()
    fresh.load_state_dict(sd, strict=True)
    close_dicts(f"{name} state", fresh.state_dict(), ref.state_dict(), 0, 0)
    if rank == 0:
        log(f"{name} prescaled={prescaled} optimize={optimize}: OK ({n_layers} layers replaced; "
            f"parameter bytes per rank {ratio:.3f} x unwrapped)")


combos = [(False, "speed"), (False, "memory"), (True, "speed"), (True, "memory")]
for name in MODELS:
    for prescaled, optimize in combos:
        try:
            run(name, prescaled, optimize)
        except Exception:
            failures.append(f"{name}/{prescaled}/{optimize}: {traceback.format_exc()}")

finish(failures)
