"""VocabParallelEmbedding, VocabParallelLMHead and vocab_parallel_cross_entropy vs plain torch.

Run under torch.distributed.run with 2 or 4 ranks. A small language model (embedding →
replicated linear → head, tied or not) is built once as plain torch (the reference, run on
the concatenated batch in this process) and once vocabulary-parallel with the reference's
weights; every rank feeds its own samples (scaled batch) or the same ones (prescaled).
Vocabularies 97 and 5 do not divide by 2 or 4, so the last ranks hold padding rows (at
4 ranks and V=5 one rank holds padding only). Checks: loss and per-token losses, logits
(gathered), gradients after sync_gradients, full state dict (original shapes), padding rows
never touched, ignore_index, the three reductions, non-uniform upstream gradients, the
collectives per step, and the errors.
"""

from __future__ import annotations

import copy
import os

import smp_tp
import torch
import torch.nn.functional as F
from common import (
    FAILURES,
    check,
    close,
    close_dicts,
    close_norm_dicts,
    finish,
    gather_batch,
    log,
    setup,
)
from torch import nn

rank, T, single = setup()
failures = FAILURES
B, S, H = 3, 4, 12
IGNORE = -100


class TinyLM(nn.Module):
    def __init__(self, V: int, tied: bool, bias: bool, parallel: bool, gather: bool = False) -> None:
        super().__init__()
        if parallel:
            self.emb = smp_tp.VocabParallelEmbedding(V, H, padding_idx=1)
            self.head = smp_tp.VocabParallelLMHead(
                H, V, bias, tie_to=self.emb if tied else None, gather_output=gather)
        else:
            self.emb = nn.Embedding(V, H, padding_idx=1)
            self.head = nn.Linear(H, V, bias=bias)
            if tied:
                self.head.weight = self.emb.weight
        self.mix = nn.Linear(H, H)  # an ordinary (data-parallel) parameter in between

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def data(seed: int, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    ids[0, 0] = 1  # the padding index appears
    target = torch.randint(0, V, (B, S), generator=gen)
    flat = target.view(-1)
    flat[torch.randperm(B * S, generator=gen)[:2]] = IGNORE  # 2 ignored per rank
    weight = torch.rand(B, S, generator=gen) + 0.5
    return ids, target, weight


def reference(V: int, tied: bool, bias: bool) -> TinyLM:
    torch.manual_seed(5)
    ref = TinyLM(V, tied, bias, parallel=False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return ref


def run(V: int, tied: bool, bias: bool, prescaled: bool, reduction: str, gather: bool) -> None:
    label = f"V={V} tied={tied} bias={bias} prescaled={prescaled} {reduction} gather={gather}"
    ref = reference(V, tied, bias)
    with smp_tp.tp_config(prescaled_batch=prescaled):
        par = TinyLM(V, tied, bias, parallel=True, gather=gather)
    smp_tp.load_full_state_dict(par, ref.state_dict())
    ids, target, weight = data(11 if prescaled else 11 + rank, V)
    every = [(t if prescaled else gather_batch(t)) for t in (ids, target, weight)]
    # parallel
    out = par(ids)
    if gather:
        losses = F.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="none").view(B, S)
        logits = out
    else:
        losses = smp_tp.vocab_parallel_cross_entropy(out, target, ignore_index=IGNORE, reduction="none", vocab_size=V,
                                                     prescaled_batch=prescaled)
        logits = smp_tp.gather_vocab_parallel_logits(out.detach(), par.head)
        if reduction != "none":
            red = smp_tp.vocab_parallel_cross_entropy(out, target, ignore_index=IGNORE, reduction=reduction,
                                                      vocab_size=V, prescaled_batch=prescaled)
            want_red = losses.sum() / ((target != IGNORE).sum() if reduction == "mean" else 1)
            close(f"{label} {reduction} vs none", red, want_red)
    n_all = int((every[1] != IGNORE).sum())
    if reduction == "none":  # non-uniform upstream gradient
        loss = (losses * weight).sum()
    elif reduction == "sum":  # Hugging Face's num_items_in_batch convention (counts differ per rank)
        loss = losses.sum() / (n_all / (1 if prescaled else T))
    else:  # every rank has the same number of non-ignored targets: plain means
        loss = losses.sum() / (target != IGNORE).sum()
    loss.backward()
    smp_tp.sync_gradients(par)
    got_grads, state = smp_tp.full_grad_dict(par), smp_tp.full_state_dict(par)
    mean_loss = loss.detach() if prescaled else smp_tp.allreduce_for_tp(loss.detach()) / T
    # reference on the whole batch
    ref_logits = ref(every[0])
    ref_losses = F.cross_entropy(ref_logits.flatten(0, 1), every[1].flatten(), ignore_index=IGNORE,
                                 reduction="none").view(every[1].shape)
    if reduction == "none":
        ref_loss = (ref_losses * every[2]).sum() / (1 if prescaled else T)
    else:
        ref_loss = ref_losses.sum() / n_all
    ref_loss.backward()
    want_grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)}
    own = (lambda t: t) if prescaled else (lambda t: t.chunk(T, 0)[rank])
    close(f"{label} loss", mean_loss, ref_loss)
    close(f"{label} per-token losses", losses, own(ref_losses))
    close(f"{label} logits", logits, own(ref_logits))
    close_norm_dicts(f"{label} grads", got_grads, want_grads)
    close_dicts(f"{label} state", state, ref.state_dict(), 0, 0)
    # padding rows: zero, with zero gradient
    w = par.emb.weight
    pad = max(0, min(w.shape[0], V - par.emb.vocab_start))
    if w[pad:].abs().sum() != 0 or (w.grad is not None and w.grad[pad:].abs().sum() != 0):
        raise AssertionError(f"{label}: padding rows changed")
    if tied and par.head.weight is not par.emb.weight:
        raise AssertionError(f"{label}: tie lost")
    if rank == 0 and os.environ.get("SMP_TP_VERBOSE"):
        log(f"{label}: OK")


for V in (97, 5):
    for prescaled in (False, True):
        for tied, bias in ((True, False), (False, True)):
            for reduction in ("mean", "sum", "none"):
                check(f"V={V} {prescaled} {tied} {reduction}", run, V, tied, bias, prescaled, reduction, False)
        check(f"V={V} {prescaled} gather", run, V, True, False, prescaled, "mean", True)


def counts() -> None:
    """Collectives of one step: embedding, head, cross entropy."""
    got = {}
    for prescaled in (False, True):
        with smp_tp.tp_config(prescaled_batch=prescaled):
            par = TinyLM(97, True, False, parallel=True)
        ids, target, _ = data(3 if prescaled else 3 + rank, 97)
        with smp_tp.collective_counts() as c:
            smp_tp.vocab_parallel_cross_entropy(par(ids), target, vocab_size=97, prescaled_batch=prescaled).backward()
        got[prescaled] = c.total()
    want = {
        False: {"forward": {"all_gather": 3, "reduce_scatter": 1, "all_reduce": 2},
                "backward": {"all_gather": 2, "reduce_scatter": 1}},
        True: {"forward": {"all_reduce": 3}, "backward": {"all_reduce": 1}},
    }
    if got != want:
        raise AssertionError(f"collectives {got} != {want}")
    if rank == 0:
        log(f"vocab collectives per step: scaled {got[False]}, prescaled {got[True]}")


check("counts", counts)


# ---- a new architecture registered in three lines (the recipe in docs/packages/smp-tp.md), plain torch
class Attention(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # the forward reads self.heads: registered with divide=["heads"]
        q, k, v = (lin(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(ctx.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(h, heads), MLP(h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(torch.tanh(x), mask)
        return x + self.mlp(torch.tanh(x))


class NewLM(nn.Module):
    def __init__(self, V: int, h: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(2))
        self.head = nn.Linear(h, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        mask = pad.bool()[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril()
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


smp_tp.tp_register_block(Attention, ["q", "k", "v"], ["o"], divide=["heads"], input_name="x")
smp_tp.tp_register_block(MLP, ["up"], ["down"], input_name="x")
smp_tp.tp_register_vocab_parallel(NewLM, embedding="emb", head="head")


def recipe(prescaled: bool) -> None:
    V = 97
    torch.manual_seed(2)
    ref = NewLM(V)
    model = smp_tp.parallelize(smp_tp.set_tensor_parallelism(copy.deepcopy(ref)), prescaled_batch=prescaled)
    ids, target, _ = data(21 if prescaled else 21 + rank, V)
    pad = torch.ones(B, S, dtype=torch.long)
    pad[-1, S - 1 - (0 if prescaled else rank % 2):] = 0  # differs between ranks
    every = [(t if prescaled else gather_batch(t)) for t in (ids, target, pad)]
    loss = model.head.cross_entropy(model(ids, pad), target, ignore_index=IGNORE)
    loss.backward()
    smp_tp.sync_gradients(model)
    got_grads, state = smp_tp.full_grad_dict(model), smp_tp.full_state_dict(model)
    mean_loss = loss.detach() if prescaled else smp_tp.allreduce_for_tp(loss.detach()) / T
    ref_loss = F.cross_entropy(ref(every[0], every[2]).flatten(0, 1), every[1].flatten(), ignore_index=IGNORE)
    ref_loss.backward()
    kinds = [type(m).__name__ for m in model.modules()]
    if kinds.count("DistributedBlock") != 4 or "Linear" in kinds or model.head.weight is not model.emb.weight:
        raise AssertionError(f"recipe: {kinds}")
    close("recipe loss", mean_loss, ref_loss)
    close_norm_dicts("recipe grads", got_grads, {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)})
    close_dicts("recipe state", state, ref.state_dict(), 0, 0)
    if rank == 0:
        log(f"new architecture via tp_register_block/tp_register_vocab_parallel, prescaled={prescaled}: OK")


check("recipe scaled", recipe, False)
check("recipe prescaled", recipe, True)


def errors() -> None:
    with smp_tp.tp_config(prescaled_batch=False):
        par = TinyLM(97, True, False, parallel=True)
    ids, target, _ = data(3 + rank, 97)
    shard = par(ids)
    cases = [
        (lambda: smp_tp.vocab_parallel_cross_entropy(shard[:B], target), ValueError, "TP group's batch"),
        (lambda: smp_tp.vocab_parallel_cross_entropy(shard, target, vocab_size=200), ValueError, "cannot hold"),
        (lambda: smp_tp.vocab_parallel_cross_entropy(shard, torch.full_like(target, 97), vocab_size=97),
         IndexError, "out of range"),
        (lambda: par(torch.full_like(ids, 97)), IndexError, "out of range"),
        (lambda: smp_tp.VocabParallelEmbedding(10, 4, max_norm=1.0), ValueError, "max_norm"),
        (lambda: smp_tp.VocabParallelLMHead(4, 11, tie_to=par.emb), ValueError, "cannot tie"),
    ]
    for fn, exc, text in cases:
        try:
            fn()
        except exc as e:
            if text not in str(e):
                raise AssertionError(f"message {e!r} lacks {text!r}") from e
        else:
            raise AssertionError(f"no {exc.__name__} ({text})")


check("errors", errors)
finish(failures)
