"""Exact delayed initialisation (smp_torch.deferred): a model built under
``smp.delay_param_initialization()`` and materialised is bitwise the model a normal CPU
construction with the same seed makes — every parameter and buffer, the model's own init
scheme, computed buffers, tied weights — wholly or in parts, with little memory, or an
SMPError naming the tensor. Single process."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import smp_torch as smp
import torch
from smp_torch.deferred import DeferredInit, materialize
from smp_torch.errors import SMPError
from torch import nn
from torch.nn.init import trunc_normal_  # captured before any block: must still be seen

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _llama(tied: bool = True, layers: int = 2) -> nn.Module:
    cfg = transformers.LlamaConfig(
        **{**SMALL, "num_hidden_layers": layers}, tie_word_embeddings=tied
    )
    return transformers.LlamaForCausalLM(cfg)


HF_MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama-tied": _llama,
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**SMALL, head_dim=8)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=96,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
    ),
}


class Computed(nn.Module):
    """No reset_parameters; buffers computed in __init__; in-place ops on views."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))
        self.emb = nn.Embedding(10, 4, padding_idx=3)  # row 3 zeroed through a view
        pos = torch.arange(0, 8, 2, dtype=torch.int64).float()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (pos / 8)), persistent=False)
        self.register_buffer("table", torch.outer(torch.arange(4.0), self.inv_freq))
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))  # from Python data: real CPU
        with torch.no_grad():
            self.w[1:3].mul_(2.0)  # a slice of rows
            self.w[:, 0].zero_()  # a strided column
            self.w.t()[4].uniform_(-1, 1)  # a view of a transpose
            self.emb.weight[5:7] = self.w[:2, 1:5]  # copy between two recorded storages
        self.proj = nn.Linear(5, 3)
        self.proj.weight = self.w_t = nn.Parameter(self.w.detach()[:3, :].clone())  # reassigned


class Zoo(nn.Module):
    """torch's own modules and initialisers, including those that skip meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4)
        self.lstm = nn.LSTM(8, 8, num_layers=2)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm1d(5)
        self.orth = nn.Parameter(torch.empty(6, 6))
        nn.init.orthogonal_(self.orth)
        self.trunc = nn.Parameter(torch.empty(50))
        trunc_normal_(self.trunc, std=0.02)  # rejection sampling: data-dependent draws
        self.sparse = nn.Parameter(torch.empty(5, 5))
        nn.init.sparse_(self.sparse, 0.5)  # its randperm draws from the global generator
        self.dirac = nn.Parameter(torch.empty(4, 2, 3))
        nn.init.dirac_(self.dirac, groups=2)
        self.fused = nn.Parameter(torch.empty(6, 4))  # initialised slice by slice
        nn.init.normal_(self.fused[:3])
        nn.init.zeros_(self.fused[3:])
        self.register_buffer("perm", torch.randperm(10))
        self.register_buffer("mask", torch.rand(8) > 0.5)
        self.drop = nn.Parameter(nn.functional.dropout(torch.ones(20), 0.5))


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(m.named_parameters(remove_duplicate=False)),
        **dict(m.named_buffers(remove_duplicate=False)),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _differ(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    assert ref.keys() == got.keys()
    return [
        k
        for k, a in ref.items()
        if got[k].is_meta
        or a.dtype != got[k].dtype
        or a.shape != got[k].shape
        or a.stride() != got[k].stride()
        or not torch.equal(_bits(a), _bits(got[k]))
    ]


def _build(build: Callable[[], nn.Module], seed: int, delayed: bool) -> nn.Module:
    torch.manual_seed(seed)
    if not delayed:
        return build()
    with smp.delay_param_initialization():
        return build()


@pytest.mark.parametrize("name", [*HF_MODELS, "computed", "zoo"])
def test_materialised_model_is_bitwise_the_normal_one(name: str) -> None:
    build = HF_MODELS.get(name, Computed if name == "computed" else Zoo)
    ref = _build(build, 0, delayed=False)
    model = _build(build, 0, delayed=True)
    metas = [k for k, t in _tensors(model).items() if t.is_meta]
    assert len(metas) >= len(_tensors(model)) - 1  # all but tensors made from Python data
    materialize(model, torch.device("cpu"))
    assert _differ(_tensors(ref), _tensors(model)) == []
    assert model.state_dict().keys() == ref.state_dict().keys()  # persistence kept
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert type(q) is nn.Parameter and q.requires_grad == p.requires_grad, n
    if name == "llama-tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert (
            ref.model.layers[0].mlp.up_proj.weight.std() < 0.03
        )  # HF's std 0.02 init, not Linear's
    if name == "computed":
        assert model.proj.weight is model.w_t and "inv_freq" not in model.state_dict()


def test_seed_and_generator_calls_inside_the_block_are_honoured() -> None:
    class Seeded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.register_buffer(
                "noise", torch.randn(5, device="cpu").to(torch.get_default_device())
            )
            self.b = nn.Linear(8, 8)
            torch.manual_seed(0)  # the entry state again: only the patched call tells
            self.c = nn.Linear(8, 8)
            with torch.random.fork_rng():
                torch.manual_seed(5)
                self.d = nn.Linear(8, 8)
            self.e = nn.Linear(8, 8)
            self.real = torch.rand(3, device="cpu")  # a real tensor: exact only if caught up
            self.f = nn.Parameter(torch.empty(6).bernoulli_(0.3))

    for seed in (0, 1):
        ref = _build(Seeded, seed, delayed=False)
        normal_after = torch.get_rng_state()
        model = _build(Seeded, seed, delayed=True)
        assert torch.equal(model.real, ref.real)
        deferred = DeferredInit.of(model)
        before = torch.get_rng_state()
        materialize(model, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), before)  # the replay's generator is private
        assert _differ(_tensors(ref), _tensors(model)) == []
        assert deferred.rng_state_after is not None
        assert torch.equal(deferred.rng_state_after, normal_after)


def test_partial_replay_then_the_rest() -> None:
    ref = _build(_llama, 0, delayed=False)
    model = _build(_llama, 0, delayed=True)
    layer = [n for n in _tensors(model) if n.startswith("model.layers.1.")]
    materialize(model, torch.device("cpu"), names=layer)
    got = _tensors(model)
    assert all(not got[n].is_meta for n in layer)
    assert all(t.is_meta for n, t in got.items() if n not in layer)
    assert _differ({n: _tensors(ref)[n] for n in layer}, {n: got[n] for n in layer}) == []
    materialize(model, torch.device("cpu"))  # the same recording serves the rest later
    assert _differ(_tensors(ref), _tensors(model)) == []


def test_rng_state_override_replays_another_seed() -> None:
    other = _build(_llama, 7, delayed=False)
    model = _build(_llama, 0, delayed=True)
    torch.manual_seed(7)
    materialize(model, torch.device("cpu"), rng_state=torch.get_rng_state())
    assert _differ(_tensors(other), _tensors(model)) == []


def test_sink_gets_each_name_once_and_the_replay_holds_about_one_tensor() -> None:
    model = _build(lambda: _llama(tied=True, layers=6), 0, delayed=True)
    deferred = DeferredInit.of(model)
    targets = deferred.targets(model)
    total = sum(t.numel() * t.element_size() for n, t in targets.items() if n != "lm_head.weight")
    largest = max(t.numel() * t.element_size() for t in targets.values())
    delivered: list[str] = []
    values: dict[str, torch.Tensor] = {}
    alive: list[weakref.ref[torch.Tensor]] = []
    most_alive = 0

    def sink(name: str, value: torch.Tensor) -> None:
        nonlocal most_alive
        # what earlier calls were given and dropped is gone (freed by reference counting, no
        # cycles): the replay kept no reference
        live = sum(r().numel() * r().element_size() for r in alive if r() is not None)  # type: ignore[union-attr]
        most_alive = max(most_alive, live)
        assert not value.is_meta and value.shape == targets[name].shape
        delivered.append(name)
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            values[name] = value
        else:
            alive.append(weakref.ref(value))

    deferred.replay(targets, torch.device("cpu"), sink)
    assert sorted(delivered) == sorted(targets) and len(delivered) == len(set(delivered))
    assert values["lm_head.weight"] is values["model.embed_tokens.weight"]  # tied: one value
    assert most_alive == 0
    assert deferred.peak_bytes <= 2 * largest < total / 4, (deferred.peak_bytes, largest, total)
    ref = _build(lambda: _llama(tied=True, layers=6), 0, delayed=False)
    assert torch.equal(values["lm_head.weight"], ref.lm_head.weight)


def test_plain_meta_module_is_refused_naming_it() -> None:
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(SMPError, match=r"Sequential.*0\.weight.*not created under smp\.delay"):
        materialize(plain, torch.device("cpu"))
    with pytest.raises(SMPError, match="no meta parameters"):
        DeferredInit.of(nn.Linear(2, 2))


def test_ops_that_cannot_be_replayed_name_the_tensor() -> None:
    gen = torch.Generator().manual_seed(3)

    class Block(nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.ok = nn.Parameter(torch.zeros(3))
            self.w = nn.Parameter(torch.empty(4, 4))
            with torch.no_grad():
                if how == "generator":
                    nn.init.normal_(self.w, generator=gen)
                elif how == "resize":
                    self.w.data.resize_(20)
                elif how == "outside":
                    self.w.copy_(outside)

    outside = torch.empty(4, 4, device="meta")
    for how, why in (
        ("generator", "explicit generator"),
        ("resize", "resizes a storage"),
        ("outside", "made outside"),
    ):
        with smp.delay_param_initialization():
            net = nn.Sequential(nn.Linear(2, 2), Block(how))
        with pytest.raises(SMPError, match=rf"'1\.w' \(module '1', tensor 'w'\).*{why}"):
            materialize(net, torch.device("cpu"))
        materialize(net, torch.device("cpu"), names=["0.weight", "1.ok"])  # the rest is fine
        assert not net[1].ok.is_meta and net[1].w.is_meta


def test_in_place_change_after_the_block_is_refused() -> None:
    with smp.delay_param_initialization():
        net = nn.Linear(3, 3)
    with torch.no_grad():
        net.weight.fill_(1.0)  # on meta, outside the recording: a replay would miss it
    with pytest.raises(SMPError, match="'weight'.*changed in place after the block"):
        materialize(net, torch.device("cpu"))


def test_training_step_is_bitwise_the_normal_one() -> None:
    results = []
    for delayed in (False, True):
        model = _build(lambda: _llama(tied=True), 0, delayed=delayed)
        if delayed:
            materialize(model, torch.device("cpu"))
        ids = torch.arange(24).reshape(2, 12) % 96
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    assert torch.equal(_bits(loss), _bits(ref_loss))
    assert ref_grads.keys() == grads.keys()
    assert all(torch.equal(_bits(ref_grads[n]), _bits(grads[n])) for n in grads)


def test_disabled_and_nested_blocks() -> None:
    with smp.delay_param_initialization(enabled=False):
        real = nn.Linear(2, 2)
    assert not real.weight.is_meta
    with smp.delay_param_initialization():
        outer = nn.Linear(2, 2)
        with smp.delay_param_initialization():
            inner = nn.Linear(2, 2)
    assert DeferredInit.of(outer) is DeferredInit.of(inner)


def test_default_dtype_of_the_construction_is_replayed() -> None:
    def build() -> nn.Module:
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return Computed()
        finally:
            torch.set_default_dtype(old)

    ref = _build(build, 0, delayed=False)
    model = _build(build, 0, delayed=True)
    materialize(model, torch.device("cpu"))
    assert model.w.dtype == torch.float64
    assert _differ(_tensors(ref), _tensors(model)) == []


def test_conversion_after_the_block_is_refused() -> None:
    with smp.delay_param_initialization():
        net = nn.Linear(3, 3)
    net.half()  # new meta tensors, made where nothing records
    with pytest.raises(SMPError, match="not created under smp.delay_param_initialization"):
        materialize(net, torch.device("cpu"))


def test_recording_lives_as_long_as_its_tensors() -> None:
    from smp_torch import deferred_record

    gc.collect()
    entries = len(deferred_record._LIVE)
    model = _build(_llama, 0, delayed=True)
    rec = weakref.ref(DeferredInit.of(model))
    gc.collect()
    assert rec() is not None  # kept by the model's meta tensors alone
    del model
    gc.collect()
    assert rec() is None and len(deferred_record._LIVE) == entries


def test_parameters_nothing_wrote_are_refused_buffers_are_not() -> None:
    def skips_meta(t: torch.Tensor) -> None:  # an initialiser that tests is_meta itself
        if not t.is_meta:
            with torch.no_grad():
                t.normal_()

    class Half(nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.register_buffer("cache", torch.empty(3), persistent=False)  # garbage, as normal
            self.w = nn.Parameter(torch.empty(4, 4))
            if how == "skipped":
                skips_meta(self.w)
            elif how == "half":
                nn.init.normal_(self.w[:2])

    for how, seen in (("skipped", "its value is"), ("half", "its value is")):
        with smp.delay_param_initialization():
            net = Half(how)
        with pytest.raises(SMPError, match=rf"'w' .*{seen} memory that nothing wrote after"):
            materialize(net, torch.device("cpu"))
        materialize(net, torch.device("cpu"), names=["cache"])
        assert not net.cache.is_meta


def test_patches_are_undone_after_the_block() -> None:
    seed, trunc = torch.manual_seed, nn.init.trunc_normal_.__code__
    with pytest.raises(RuntimeError, match="boom"):
        with smp.delay_param_initialization():
            assert torch.manual_seed is not seed and nn.init.trunc_normal_.__code__ is not trunc
            raise RuntimeError("boom")
    assert torch.manual_seed is seed and torch.random.get_rng_state.__module__ == "torch.random"
    assert nn.init.trunc_normal_.__code__ is trunc and not torch.empty(1).is_meta
