"""TransformerConfig and the older argument form build the same modules (one process, tp=1)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import smp_tp
import torch
from smp_tp import TransformerConfig
from smp_tp import random as smp_tp_random

CFG = TransformerConfig(num_layers=2, num_attention_heads=4, attention_head_size=4, hidden_size=16,
                        intermediate_size=32, vocab_size=97, num_positions=8, num_token_types=2,
                        attention_dropout_prob=0.0, hidden_dropout_prob=0.0, activation="gelu_new",
                        causal_mask_size=8, pre_layernorm=True, post_layernorm=False,
                        initializer_range=0.05, use_normal_initialization=True)

# (class, the same module in the older form); both read CFG's fields, the older form through
# each class's own positional order, so a field landing in the wrong slot shows up here
OLD: dict[str, tuple[type, Callable[..., Any]]] = {
    "attention": (smp_tp.DistributedAttentionLayer, lambda **k: smp_tp.DistributedAttentionLayer(
        4, 4, 16, 0.0, 0.0, 1e-5, 0.05, True, False, 8, True, False, **k)),
    "output": (smp_tp.DistributedTransformerOutputLayer, lambda **k: smp_tp.DistributedTransformerOutputLayer(
        16, 32, 0.0, "gelu_new", 1e-5, 0.05, True, True, False, **k)),
    "layer": (smp_tp.DistributedTransformerLayer, lambda **k: smp_tp.DistributedTransformerLayer(
        4, 4, 16, 32, 0.0, 0.0, "gelu_new", 1e-5, 0.05, True, 8, False, True, False, **k)),
    "stack": (smp_tp.DistributedTransformer, lambda **k: smp_tp.DistributedTransformer(
        2, 4, 4, 16, 32, 0.0, 0.0, "gelu_new", 1e-5, 0.05, True, 8, False, True, False, **k)),
    "lm": (smp_tp.DistributedTransformerLMHead, lambda **k: smp_tp.DistributedTransformerLMHead(
        2, 4, 4, 16, 32, 97, 8, 0.0, 0.0, "gelu_new", 1e-5, 2, 8, False, True, 0.05, True, True, False, **k)),
}


@pytest.fixture(autouse=True)
def _restore_tp_streams() -> Iterator[None]:
    """Later tests in this process find smp_tp's seed and streams as they were."""
    seed, states = smp_tp_random._seed, smp_tp.get_rng_state()  # no public getter of the seed
    yield
    smp_tp.set_tensor_parallel_seed(seed)
    smp_tp.set_rng_state(states)


def _built(make: Callable[[], torch.nn.Module]) -> dict[str, torch.Tensor]:
    # parameter initialisation draws from smp_tp's streams; this restarts them
    smp_tp.set_tensor_parallel_seed(1234)
    return {k: v.detach().clone() for k, v in make().state_dict().items()}


@pytest.mark.parametrize("optimize", ["speed", "memory"])
@pytest.mark.parametrize("kind", sorted(OLD))
def test_config_and_arguments_build_identical_modules(kind: str, optimize: str) -> None:
    cls, old = OLD[kind]
    cfg = replace(CFG, optimize=optimize)
    by_args = _built(lambda: old(optimize=optimize))
    by_config = _built(lambda: cls(cfg))
    by_keyword = _built(lambda: cls(config=cfg))
    assert list(by_args) == list(by_config) == list(by_keyword)  # names, in order
    for name, value in by_args.items():
        assert value.shape == by_config[name].shape, name
        assert torch.equal(value, by_config[name]), name
        assert torch.equal(value, by_keyword[name]), name


def test_keyword_form_by_name_equals_config() -> None:
    """The keyword call of hf.py and the benchmarks builds the config it names."""
    layer = smp_tp.DistributedTransformerLayer(num_attention_heads=4, attention_head_size=4, hidden_size=16,
                                               intermediate_size=32, recompute_mlp_activation=True)
    assert layer.config == TransformerConfig(num_attention_heads=4, attention_head_size=4, hidden_size=16,
                                             intermediate_size=32, recompute_mlp_activation=True)
    assert layer.recompute_mlp_activation and layer.output.recompute_mlp_activation


def test_children_share_the_resolved_config() -> None:
    with smp_tp.tp_config(optimize="memory"):
        layer = smp_tp.DistributedTransformerLayer(replace(CFG, add_cross_attention=True))
    assert layer.optimize == layer.attention.optimize == layer.output.optimize == "memory"
    assert layer.attention.config.optimize == "memory"  # resolved once, by the owner
    assert layer.attention.causal and not layer.attention.cross_attention
    assert layer.crossattention.cross_attention and not layer.crossattention.causal


@pytest.mark.parametrize(("call", "message"), [
    (lambda: smp_tp.DistributedTransformerLayer(CFG, hidden_size=8), "not both"),
    (lambda: smp_tp.DistributedTransformerLayer(CFG, config=CFG), "both positionally"),
    (lambda: smp_tp.DistributedTransformerLayer(4, num_attention_heads=4), "multiple values"),
    (lambda: smp_tp.DistributedTransformerLayer(hidden_sise=8), "unexpected keyword argument 'hidden_sise'"),
    # each class still takes only the options it took before
    (lambda: smp_tp.DistributedAttentionLayer(recompute_mlp_activation=True), "unexpected keyword"),
    (lambda: smp_tp.DistributedTransformerOutputLayer(*range(10)), "at most 9 positional"),
    (lambda: smp_tp.DistributedTransformer(config={"num_layers": 2}), "must be a TransformerConfig"),
])
def test_mixed_or_unknown_arguments_raise(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        call()
