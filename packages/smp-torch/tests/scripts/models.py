"""Small models used by the multi-process tests (built identically on every rank)."""

from __future__ import annotations

from collections.abc import Callable

import hf_models  # (this folder)
import smp_torch as smp
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

VOCAB, HIDDEN, SEQ = 16, 8, 4


class MLPBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(h)))


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, layer norm, head tied to the embedding."""

    def __init__(
        self, tp: bool = False, tied: bool = True, layers: int = 2, manual: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        with smp.tensor_parallelism(enabled=tp) if tp else _null():
            blocks = [MLPBlock(HIDDEN) for _ in range(layers - 1)]
            # Manual partitioning: the last block and the norm go to stage 1, the (tied) head
            # stays with the embedding on stage 0, so the forward visits stage 0 twice.
            with smp.partition(1) if manual else _null():
                blocks.append(MLPBlock(HIDDEN))
                self.ln = nn.LayerNorm(HIDDEN)
            self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


class Experts(nn.Module):
    """Two residual MLP experts; each sample goes to the expert its ``route`` entry names, and
    an expert no sample chose is not called at all (the data-dependent branch)."""

    def __init__(self, hidden: int, n: int = 2) -> None:
        super().__init__()
        self.experts = nn.ModuleList(MLPBlock(hidden) for _ in range(n))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = h
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().flatten()
            if idx.numel() == 0:
                continue
            out = out.index_copy(0, idx, expert(h.index_select(0, idx)))
        return out


class MoELM(nn.Module):
    """Embedding, an MLP block, a two-expert layer, layer norm, untied head. A sample's expert
    is chosen by its first token (below ``VOCAB // 2``: expert 0), so which expert runs is
    decided by each rank's data (see :func:`moe_batch`)."""

    def __init__(self, tp: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        with smp.tensor_parallelism(enabled=tp) if tp else _null():
            self.block = MLPBlock(HIDDEN)
        self.moe = Experts(HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = (x[:, 0] >= VOCAB // 2).long()
        return self.head(self.ln(self.moe(self.block(self.emb(x)), route)))


# The expert of each equal part of the batch (a data-parallel rank's share), per step.
MOE_ROUTES = [[0, 1], [1, 0], [0, 0]]


def moe_batch(
    step: int, batch: int, routes: list[list[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`global_batch` with each sample's first token set so that part ``i`` of the
    batch goes to expert ``routes[step][i]``. By default (two parts: two data-parallel
    ranks) step 0 sends the first half to expert 0 and the second to expert 1, step 1 the
    other way round, and step 2 every sample to expert 0 (expert 1 gets a gradient on no
    rank: it must keep none)."""
    x, y = global_batch(step, batch)
    route = (routes or MOE_ROUTES)[step]
    part = batch // len(route)
    x = x.clone()
    for i, expert in enumerate(route):
        rows = slice(i * part, (i + 1) * part)
        x[rows, 0] = x[rows, 0] % (VOCAB // 2) + expert * (VOCAB // 2)
    return x, y


def seq_lm(tp: bool = False, layers: int = 3, manual: bool = False) -> nn.Sequential:
    """A plain ``nn.Sequential`` LM (embedding, residual MLP blocks, norm, untied head): the
    ``fast_mode`` path, where a run of children on one stage is one request. ``manual``: the
    last block, the norm and the head go to stage 1 (one run of three children)."""
    mods: list[nn.Module] = [nn.Embedding(VOCAB, HIDDEN)]
    with smp.tensor_parallelism(enabled=tp) if tp else _null():
        for i in range(layers):
            with smp.partition(1) if manual and i == layers - 1 else _null():
                mods.append(MLPBlock(HIDDEN))
    with smp.partition(1) if manual else _null():
        mods += [nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)]
    return nn.Sequential(*mods)


def build(case: dict, tp: bool) -> nn.Module:
    """The case's model: ``"seq"`` (:func:`seq_lm`) or :class:`TinyLM` (the default; its
    blocks an ``nn.ModuleList`` its forward loops over, ``layers`` of them)."""
    if case.get("model") == "seq":
        return seq_lm(tp=tp, manual=case.get("manual", False))
    return TinyLM(
        tp=tp, tied=case.get("tied", True), layers=case.get("layers", 2), manual=case.get("manual", False)
    )


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def global_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return x, y


def hf_gpt2() -> nn.Module:
    """A tiny Hugging Face GPT-2 built from a config (no download), dropout off."""
    return hf_models.gpt2(VOCAB, 16, 2, 2, SEQ)


def hf_llama() -> nn.Module:
    """A tiny Hugging Face Llama (grouped-query attention, tied head) built from a config."""
    return hf_models.llama(VOCAB, 16, 32, 4, 2, 2, SEQ, tied=True)


def hf_t5() -> nn.Module:
    """A tiny Hugging Face T5 (encoder-decoder, relative position biases, tied head) built
    from a config, dropout off."""
    return hf_models.t5(VOCAB, 16, 8, 32, 2, 2)


HF_MODELS = {"gpt2": hf_gpt2, "llama": hf_llama, "t5": hf_t5}


def hf_logits(model: Callable[..., object], kind: str, x: torch.Tensor) -> torch.Tensor:
    """``model``'s logits for the token batch ``x`` (:func:`hf_models.logits`)."""
    return hf_models.logits(model, kind, x)


def expect_config_error(name: str, key: str, config: dict, build_model: Callable[[], nn.Module]) -> None:
    """``smp.init(config)`` then ``smp.DistributedModel(build_model())`` must raise
    ``ConfigError`` naming ``key`` on every rank; rank 0 prints ``CASE-OK <name> ...``."""
    caught: BaseException | None = None
    try:
        smp.init(config)
        smp.DistributedModel(build_model())
    except smp.ConfigError as exc:
        caught = exc
    got = MPI.COMM_WORLD.allgather(None if caught is None else (caught.key, str(caught)))
    bad = [r for r, g in enumerate(got) if g is None or g[0] != key]
    if bad:
        raise AssertionError(f"[{name}] no ConfigError naming {key!r} on ranks {bad}: {got}")
    if MPI.COMM_WORLD.Get_rank() == 0:  # (smp may not be initialised: init itself may be what failed)
        print(f"CASE-OK {name} ConfigError on every rank: {got[0][1]}", flush=True)


def assert_resumed(name: str, saved: dict, saved_opt: dict, model: smp.DistributedModel,
                   opt: smp.DistributedOptimizer) -> None:
    """The gathered model and optimizer state of ``model``/``opt`` equal what was saved, bitwise."""
    back, back_opt = model.state_dict(), opt.state_dict()
    for k, v in saved.items():
        assert torch.equal(back[k], v), f"[{name}] rank {smp.rank()}: {k} differs after resuming"
    for k, st in saved_opt["state"].items():
        for key, v in st.items():
            got = back_opt["state"][k][key]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), f"[{name}] optimizer {key} of {k} after resuming"
