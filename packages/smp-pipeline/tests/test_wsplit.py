"""Single-process tests of the input-grad / weight-grad split (``smp_pipeline.wsplit``).

Every comparison is bitwise: parameter ``.grad`` and input gradients after several
microbatches' backwards, split (W tasks run afterwards, in microbatch order) against plain.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from smp_pipeline.wsplit import WeightGradQueue, deferred_weight_grads
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

D = 32


class Block(nn.Module):
    """Pre-norm transformer block: SDPA attention and a GELU MLP."""

    def __init__(self, norm: type[nn.Module] = nn.LayerNorm, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = norm(D), norm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.n2(x))))


class TiedLM(nn.Module):
    """Embedding and head share one weight (two W tasks for one parameter per microbatch)."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.block = Block()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.emb(ids))))


class Checkpointed(nn.Module):
    """Two blocks, each recomputed in the backward (non-reentrant checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = checkpoint(self._run, blk, x, use_reentrant=False)
        return x

    def _run(self, blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return blk(x)  # type: ignore[no-any-return]


class Scaled(nn.Module):
    """A Linear plus parameters the split leaves to torch's backward (computed now): a
    multiply, a convolution, and a Linear on a non-contiguous input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.randn(D))
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.tail = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        return self.tail(self.conv(h.transpose(1, 2)).transpose(1, 2))


def _inputs(kind: str, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if kind == "ids":
        return [torch.randint(0, 50, (2, 12), generator=g) for _ in range(n)]
    if kind == "2d":
        return [torch.randn(24, D, generator=g) for _ in range(n)]
    return [torch.randn(2, 12, D, generator=g) for _ in range(n)]


def _grads(
    make: Callable[[], nn.Module],
    inputs: list[torch.Tensor],
    split: bool,
    runner: Callable[[WeightGradQueue], object] = lambda q: q.run(),
    defer_norms: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], WeightGradQueue | None]:
    """Accumulate every microbatch's ``loss / m`` backward; split: run W tasks afterwards."""
    torch.manual_seed(0)
    model = make()
    xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    q = None

    def backwards() -> None:
        for x in xs:
            (model(x).square().mean() / len(xs)).backward()

    if split:
        with deferred_weight_grads(model, defer_norms=defer_norms) as q:
            backwards()
        runner(q)
        assert len(q) == 0
    else:
        backwards()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]
    return grads, [x.grad for x in xs], q


def _assert_bitwise(a: tuple, b: tuple) -> None:
    for ga, gb in zip(a[0], b[0], strict=True):
        assert torch.equal(ga, gb), (ga - gb).abs().max()
    for ia, ib in zip(a[1], b[1], strict=True):
        assert (ia is None and ib is None) or torch.equal(ia, ib)


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(D, 64), nn.GELU(), nn.Linear(64, D, bias=False)), "2d"),
    "mlp3d": (lambda: nn.Sequential(nn.Linear(D, 64), nn.GELU(), nn.Linear(64, D)), "3d"),
    "block_layernorm": (Block, "3d"),
    "block_rmsnorm": (lambda: Block(norm=nn.RMSNorm), "3d"),
    "tied_embedding_head": (TiedLM, "ids"),
    "checkpointed": (Checkpointed, "3d"),
}


@pytest.mark.parametrize("defer_norms", [False, True], ids=["norms_in_i", "norms_deferred"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_backward_is_bitwise_plain(case: str, defer_norms: bool) -> None:
    make, kind = CASES[case]
    plain = _grads(make, _inputs(kind), split=False)
    split = _grads(make, _inputs(kind), split=True, defer_norms=defer_norms)
    _assert_bitwise(plain, split)
    q = split[2]
    assert q is not None and not q.not_deferred_ops and not q.immediate_params
    assert q.deferred_ops


def test_w_tasks_one_at_a_time_and_by_group_match_plain() -> None:
    plain = _grads(TiedLM, _inputs("ids"), split=False)

    def one_by_one(q: WeightGradQueue) -> None:
        while q.run_next():
            pass

    def by_group(q: WeightGradQueue) -> None:
        assert q.tasks[0].group == 0 and q.tasks[-1].group == 2  # one group per backward
        while q.run_group():
            pass

    _assert_bitwise(plain, _grads(TiedLM, _inputs("ids"), split=True, runner=one_by_one))
    _assert_bitwise(plain, _grads(TiedLM, _inputs("ids"), split=True, runner=by_group))


def test_wrong_w_order_is_caught() -> None:
    """The bitwise check can fail: W tasks run newest microbatch first give other bits."""

    def reversed_groups(q: WeightGradQueue) -> None:
        q.tasks.sort(key=lambda t: -t.group)
        q.run()

    plain = _grads(Block, _inputs("3d", 4), split=False)
    wrong = _grads(Block, _inputs("3d", 4), split=True, runner=reversed_groups)
    assert any(not torch.equal(a, b) for a, b in zip(plain[0], wrong[0], strict=True))


def test_checkpoint_recompute_goes_through_the_split() -> None:
    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(2, 12, D, requires_grad=True)
    with deferred_weight_grads(model) as q:
        model(x).sum().backward()
    assert model.forwards == 4  # two forwards, two recomputations
    assert q.deferred_ops == {"linear": 8, "layer_norm": 4}
    assert all(p.grad is None for p in model.parameters())
    q.run()
    assert all(p.grad is not None for p in model.parameters())


def test_unsplit_parameters_get_their_gradient_now_and_are_counted() -> None:
    plain = _grads(Scaled, _inputs("3d"), split=False)
    split = _grads(Scaled, _inputs("3d"), split=True)
    _assert_bitwise(plain, split)
    q = split[2]
    assert q is not None
    assert q.deferred_ops == {"linear": 3}
    assert q.immediate_params == {"scale", "conv.weight", "conv.bias", "tail.weight", "tail.bias"}
    assert q.not_deferred_ops == {"linear": 3}


class HalfTied(nn.Module):
    """The head reuses the embedding's weight through ``F.linear`` (not a split layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.emb(ids)), self.emb.weight)


def test_a_parameter_both_split_and_not_is_reported() -> None:
    plain = _grads(HalfTied, _inputs("ids"), split=False)
    split = _grads(HalfTied, _inputs("ids"), split=True)
    q = split[2]
    assert q is not None and q.mixed_params == {"emb.weight"}
    torch.testing.assert_close(plain[0][0], split[0][0])  # equal values, not promised bits


def test_graph_is_freed_after_the_i_pass_only_w_inputs_remain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                          nn.Linear(128, D))  # fmt: skip
    x = torch.randn(64, D)
    saved: dict[int, StorageWeakRef] = {}  # storage address -> weak reference to the storage

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = StorageWeakRef(t.untyped_storage())
        return t

    def alive() -> set[int]:
        keep = {p.untyped_storage().data_ptr() for p in model.parameters()}
        keep.add(x.untyped_storage().data_ptr())
        return {ptr for ptr, ref in saved.items() if not ref.expired()} - keep

    with deferred_weight_grads(model) as q:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).square().sum()
        forward = alive()
        loss.backward()
    held = {t.untyped_storage().data_ptr() for task in q.tasks for t in task.held}
    # the GELU's and Tanh's inputs are saved by the forward; after I only W inputs remain
    assert len(forward) >= 4 and alive() <= held, "a saved tensor outlived the I pass"
    assert len(alive()) == 2 and len(q) == 3 and q.pending_bytes() > 0
    q.run()
    assert q.pending_bytes() == 0
    assert not alive()
