"""fp16 loss scaling, bf16, delayed parameter initialisation, gradient clipping, evaluation
steps and step-input options, on 2 ranks. Prints ``CASE-OK <name>`` for each."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402
from equivalence import local_slice  # noqa: E402


def ok(name: str) -> None:
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-OK {name}", flush=True)


def trainer(model: smp.DistributedModel):  # type: ignore[no-untyped-def]
    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        model.backward(loss)
        return loss

    return train_step


def fp16_loss_scaling() -> None:
    cfg = smp.init({"fp16": True, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(models.TinyLM())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    step = trainer(model)
    assert opt.scaler is not None and opt.scaler.scale == 2.0**16
    losses = []
    for i in range(4):
        x, y = models.global_batch(i, 8)
        opt.zero_grad()
        losses.append(float(step(local_slice(x, cfg), local_slice(y, cfg)).reduce_mean()))
        opt.step()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # Overflow on ONE rank: every rank skips the update and halves the scale.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    x, y = models.global_batch(9, 8)
    step(local_slice(x, cfg), local_slice(y, cfg))
    if smp.rank() == 1:
        next(iter(model.parameters())).grad.fill_(float("inf"))
    scale = opt.scaler.scale
    opt.step()
    assert opt.scaler.scale == scale / 2, (opt.scaler.scale, scale)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "overflowing step was applied"
    ok("fp16-loss-scaling")


def bf16_close_to_fp32() -> None:
    cfg = smp.init({"bf16": True})
    torch.manual_seed(0)
    net = models.TinyLM()
    ref = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = trainer(model)
    for i in range(3):
        x, y = models.global_batch(i, 8)
        opt.zero_grad()
        loss = float(step(local_slice(x, cfg), local_slice(y, cfg)).reduce_mean())
        opt.step()
        ref_opt.zero_grad()
        ref_loss = models.lm_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        mean = sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size()
        # bf16 has 8 bits of mantissa: the loss agrees to about 1e-2, not 1e-5.
        assert abs(mean - ref_loss.item()) < 5e-2 * abs(ref_loss.item()), (mean, ref_loss.item())
    assert next(iter(model.parameters())).dtype == torch.float32  # fp32 master weights
    ok("bf16-autocast")


def delayed_init(pp: int) -> None:
    smp.init({"delayed_parameter_initialization": True, "pipeline_parallel_degree": pp, "microbatches": 2})
    with smp.delay_param_initialization():
        net = models.TinyLM(tied=False)
    assert all(p.is_meta for p in net.parameters())
    model = smp.DistributedModel(net)
    local = list(model.parameters())
    assert local and not any(p.is_meta for p in local)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    step = trainer(model)
    x, y = models.global_batch(0, 8)
    cfg = smp.state.state().config
    loss = float(step(local_slice(x, cfg), local_slice(y, cfg)).reduce_mean())
    opt.step()
    assert torch.isfinite(torch.tensor(loss))
    if pp > 1:
        counts = smp.allgather(len(local), smp.PP_GROUP)
        assert all(counts), counts
    else:
        # Replicas materialised identically (and stay identical after a step).
        sums = smp.allgather(sum(float(p.detach().double().sum()) for p in local), smp.DP_GROUP)
        assert max(sums) - min(sums) < 1e-9, sums
    ok(f"delayed-init-pp{pp}")


def clipping_and_eval() -> None:
    cfg = smp.init({"microbatches": 2})
    torch.manual_seed(0)
    net = models.TinyLM()
    ref = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    step = trainer(model)
    x, y = models.global_batch(0, 8)
    step(local_slice(x, cfg), local_slice(y, cfg))
    ref_loss = models.lm_loss(ref(x), y)
    ref_loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    got = model.clip_grad_norm_(0.01)
    assert torch.allclose(got.double(), want.double(), rtol=1e-5), (got, want)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), n

    @smp.step(non_split_inputs=["scale"], input_split_axes={"x": 0})
    def evaluate(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(x) * scale
        return logits, logits.mean()

    logits, means = evaluate(local_slice(x, cfg), torch.tensor(2.0))
    assert logits.concat().shape == (4, models.SEQ, models.VOCAB) and len(means.outputs) == 2
    with torch.no_grad():
        want_logits = ref(local_slice(x, cfg)) * 2.0
    torch.testing.assert_close(logits.concat(), want_logits, rtol=1e-5, atol=1e-6)
    ok("clip-and-eval")


class Sequential4(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def sequential_checkpointing(strategy: str) -> None:
    cfg = smp.init({"microbatches": 2})
    torch.manual_seed(0)
    net = Sequential4()
    ref = copy.deepcopy(net)
    smp.set_activation_checkpointing(net.body, strategy=strategy)
    model = smp.DistributedModel(net)

    @smp.step
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
    step(local_slice(x, cfg), local_slice(y, cfg))
    F.mse_loss(ref(x), y).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    ok(f"sequential-checkpointing-{strategy}")


def tp_dropout_checkpointing(config: dict, label: str) -> None:
    """Activation checkpointing with dropout inside tensor-parallel layers: recomputation
    must replay smp-tp's dropout streams, so gradients equal the run without checkpointing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    results = []
    for ckpt in (False, True):
        cfg = smp.init(config)
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=models.VOCAB, n_positions=models.SEQ,
            resid_pdrop=0.3, embd_pdrop=0.0, attn_pdrop=0.3, use_cache=False))
        smp.set_tensor_parallelism(hf)
        if cfg.pp > 1:  # one fixed partition for both runs (masks depend on the executing rank)
            smp.set_partition(hf.transformer.h[1], 1)
            smp.set_partition(hf.transformer.ln_f, 1)
        if ckpt:
            for block in hf.transformer.h:
                smp.set_activation_checkpointing(block)
        model = smp.DistributedModel(hf)
        model.train()

        @smp.step
        def step(x: torch.Tensor, y: torch.Tensor, model=model) -> torch.Tensor:  # type: ignore[no-untyped-def]
            loss = model(input_ids=x, labels=y).loss
            model.backward(loss)
            return loss

        x, y = models.global_batch(0, 4)
        losses = step(local_slice(x, cfg), local_slice(y, cfg))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        # Whole-model view: the two runs may place modules on different stages (a
        # checkpointed block is kept whole), and tensor-parallel shards are per rank.
        merged = {}
        for r, part in enumerate(smp.allgather(grads)):
            merged.update({(n, r if cfg.tp > 1 else 0): g for n, g in part.items()})
        results.append(([float(v) for v in smp.allgather(losses.outputs)[0]], merged))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b, (label, loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a, label
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=1e-6, atol=1e-7,
                                   msg=f"{label}: {n}")
    ok(f"tp-dropout-checkpointing-{label}")


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1:] == ["pp2tp2"]:  # 4 ranks: recomputation inside pipeline stages
        tp_dropout_checkpointing({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                                  "microbatches": 1, "auto_partition": False}, "pp2tp2")
        return
    tp_dropout_checkpointing({"tensor_parallel_degree": 2, "microbatches": 2}, "tp2")
    fp16_loss_scaling()
    bf16_close_to_fp32()
    delayed_init(1)
    delayed_init(2)
    clipping_and_eval()
    for strategy in ("each", "contiguous", "group_3"):
        sequential_checkpointing(strategy)


if __name__ == "__main__":
    main()
