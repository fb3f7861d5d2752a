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


def main() -> None:
    torch.set_num_threads(1)
    fp16_loss_scaling()
    bf16_close_to_fp32()
    delayed_init(1)
    delayed_init(2)
    clipping_and_eval()
    for strategy in ("each", "contiguous", "group_3"):
        sequential_checkpointing(strategy)


if __name__ == "__main__":
    main()
