"""Selective recomputation in one process (degree 1) — optimize="memory" with
recompute_activations, optimize="speed" with recompute_attention (attention core only) and
recompute_mlp_activation (the MLP's activation function only), each alone and together:
recomputing gives bit-for-bit the forward and gradients of the plain computation, dropout
included.
(The multi-rank versions, and the saved-byte counts, are in scripts/check_modules.py.)"""

from __future__ import annotations

import pytest
import smp_tp
import torch
from smp_tp.random import pack_mask, unpack_mask
from smp_tp.recompute import activation_linear, regenerated_dropout

CASES = {
    "bert": dict(activation="gelu"),
    "gpt": dict(activation="gelu_new", causal_mask_size=6, pre_layernorm=True, post_layernorm=False),
    "cross": dict(activation="relu", add_cross_attention=True),
}


# option: (optimize, the recompute keywords it switches on)
OPTIONS = {
    "memory": ("memory", ("recompute_activations",)),
    "speed": ("speed", ("recompute_attention",)),
    "speed_mlp": ("speed", ("recompute_mlp_activation",)),
    "speed_both": ("speed", ("recompute_attention", "recompute_mlp_activation")),
}


def run(recompute: bool, case: str, autocast: bool, option: str = "memory") -> list[torch.Tensor]:
    smp_tp.set_tensor_parallel_seed(7)
    torch.manual_seed(0)
    optimize, keys = OPTIONS[option]
    switch = dict.fromkeys(keys, recompute)
    layer = smp_tp.DistributedTransformerLayer(
        4, 8, 32, 64, 0.25, 0.25, optimize=optimize, **switch, **CASES[case])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 32, generator=gen).requires_grad_(True)
    cross = torch.randn(3, 4, 32, generator=gen).requires_grad_(True)
    mask = torch.ones(3, 6)
    mask[0, -2:] = 0
    outs = []
    for _ in range(2):  # the second call draws different masks: the stream has moved on
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs.append(layer(x, mask, cross_states=cross))
    (outs[0].float().pow(2).sum() + outs[1].float().pow(3).sum()).backward()
    grads = [x.grad, cross.grad if case == "cross" else torch.zeros(1)]
    return outs + grads + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("autocast", [False, True])
def test_recompute_is_bitwise_identical(case: str, autocast: bool, option: str) -> None:
    got, want = run(True, case, autocast, option), run(False, case, autocast, option)
    assert not torch.equal(got[0], got[1])  # dropout on: the two calls differ
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and w is not None, i
        assert torch.equal(g, w), f"tensor {i} differs by {(g.float() - w.float()).abs().max()}"


def test_recompute_is_off_without_grad_and_in_eval() -> None:
    layer = smp_tp.DistributedTransformerLayer(4, 8, 32, 64, 0.25, 0.25, optimize="memory")
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        a = layer.eval()(x)
    b = layer(x.requires_grad_(True))
    assert torch.equal(a, b.detach())
    assert "Recomputed" not in type(b.grad_fn).__name__


def test_speed_recompute_attention_saves_no_scores() -> None:
    """The speed layout with recompute_attention stores no (batch, heads, seq, seq) tensor."""
    shapes: dict[bool, list[tuple[int, ...]]] = {}
    for recompute in (False, True):
        layer = smp_tp.DistributedTransformerLayer(4, 8, 32, 64, 0.25, 0.25, optimize="speed",
                                                   recompute_attention=recompute)
        saved: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor, saved: list = saved) -> torch.Tensor:
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(torch.randn(2, 5, 32, requires_grad=True))
        y.sum().backward()
        shapes[recompute] = saved
    assert (2, 4, 5, 5) in shapes[False]
    assert (2, 4, 5, 5) not in shapes[True]


def test_speed_recompute_mlp_activation_saves_the_pre_activation_only() -> None:
    """recompute_mlp_activation: the MLP stores its (tokens, intermediate) pre-activation once
    (not also the activation's output); without the option it stores both."""
    counts: dict[bool, int] = {}
    for recompute in (False, True):
        layer = smp_tp.DistributedTransformerOutputLayer(32, 64, 0.0, "gelu", optimize="speed",
                                                         recompute_mlp_activation=recompute)
        saved: list[torch.Tensor] = []
        def pack(t: torch.Tensor, saved: list = saved) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(torch.randn(2, 5, 32, requires_grad=True))
        y.sum().backward()
        # distinct storages holding 2 x 5 x 64 elements (3-D or flattened views)
        counts[recompute] = len({t.untyped_storage().data_ptr() for t in saved if t.numel() == 2 * 5 * 64})
    assert counts == {False: 2, True: 1}, counts


def test_recompute_helpers_save_less() -> None:
    pre = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = activation_linear(pre, w, torch.nn.functional.gelu)
        z = regenerated_dropout(pre, 0.5, torch.Generator().manual_seed(3))
    # the pre-activation and the weight, a generator state; no activation output, no mask
    assert sorted(tuple(t.shape) for t in saved if t.dtype != torch.uint8) == [(4, 16), (8, 16)]
    assert not any(t.dtype == torch.bool for t in saved)
    (y.sum() + z.sum()).backward()
    gen = torch.Generator().manual_seed(3)
    keep = torch.rand(8, 16, generator=gen) >= 0.5
    p2, w2 = pre.detach().requires_grad_(True), w.detach().requires_grad_(True)
    (torch.nn.functional.linear(torch.nn.functional.gelu(p2), w2).sum() + (p2 * keep * 2.0).sum()).backward()
    assert torch.equal(pre.grad, p2.grad) and torch.equal(w.grad, w2.grad)


def test_mask_bits_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_mask/unpack_mask give back the mask, for sizes that are and are not whole bytes,
    and the numpy pass (CPU) and the torch passes (other devices, no numpy) make the same
    bytes, so either can unpack what the other packed."""
    import smp_tp.random as rnd

    numpy = rnd._np
    gen = torch.Generator().manual_seed(5)
    for shape in [(3, 5, 7), (2, 4, 8, 8), (1,), (9,), (4, 3, 16, 16)]:
        keep = torch.rand(shape, generator=gen) >= 0.3
        monkeypatch.setattr(rnd, "_np", None)
        bits = pack_mask(keep)
        assert bits.dtype == torch.uint8 and bits.numel() == -(-keep.numel() // 8)
        assert torch.equal(unpack_mask(bits, shape), keep)
        if numpy is not None:
            monkeypatch.setattr(rnd, "_np", numpy)
            fast = pack_mask(keep)
            assert torch.equal(fast, bits)
            assert torch.equal(unpack_mask(bits, shape), keep)


def test_recomputed_attention_core_keeps_mask_bits_not_a_generator_state() -> None:
    """The attention core's recomputation saves its dropout mask as bits (1/8 byte per
    score), no generator state, and replays that very mask."""
    layer = smp_tp.DistributedTransformerLayer(4, 8, 32, 64, 0.25, 0.0, optimize="speed",
                                               recompute_attention=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(torch.randn(2, 6, 32, requires_grad=True)).sum().backward()
    uint8 = [t for t in saved if t.dtype == torch.uint8]
    assert [t.numel() for t in uint8] == [2 * 4 * 6 * 6 // 8], [tuple(t.shape) for t in uint8]
