"""The models ``bench_plan`` measures and plans: each ``build(name)`` gives (model_fn,
global batch, step_fn), ``blocks(name, net)`` the layers its grid checkpoints.

The two GPTs are examples/gpt's model; the others are Hugging Face models built from a
config (``packages/smp-torch/tests/scripts/hf_models.py``, the builders the multi-process
tests use too: no download, no weights, seeded), each a different shape.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
# hf_models.py (no smp or MPI import): the Hugging Face builders the tests use
sys.path.insert(0, os.path.join(ROOT, "packages", "smp-torch", "tests", "scripts"))

# name: (vocab, seq, dim, heads, layers, global batch). gpt2-small: GPT-2's shape, scaled to
# fit 4 processes on 2 cores; wide-vocab: an embedding (tied head) that dominates the model.
GPT_MODELS: dict[str, tuple[int, ...]] = {
    "gpt2-small": (65, 32, 128, 4, 6, 32),
    "wide-vocab": (8192, 16, 64, 4, 2, 32),
}
# Hugging Face models built from a config (tests/scripts/hf_models.py, the builders the
# multi-process tests use), each a different shape, sized so a grid point (4 processes on 2
# cores, start-up included) takes 17-60 s of wall time at load 3-19 and a rank peaks under
# 560 MiB (the 23 GiB machine holds a job 10 times over): "kind" names the builder, "args" its arguments, "seq" the tokens
# (or, for vit, the image side) of a sample, "batch" the global batch, "classes" the labels
# a sample's target ranges over (one per token for the LMs, one per image for vit).
HF_SHAPES: dict[str, dict[str, Any]] = {
    # Llama: grouped-query attention (4 heads, 2 kv heads), SwiGLU, head tied to the embedding
    "llama-tied": {"kind": "llama", "args": [512, 128, 344, 4, 2, 4, 32], "seq": 32, "batch": 32, "classes": 512},
    # T5: 3 encoder + 3 decoder blocks with cross-attention, one embedding for both and the head
    "t5": {"kind": "t5", "args": [256, 128, 32, 512, 4, 3], "seq": 32, "batch": 32, "classes": 256},
    # Mixtral: 3 sparse MoE layers of 4 experts, each token routed to 2 (transformers' loop)
    "mixtral": {"kind": "mixtral", "args": [256, 96, 192, 4, 2, 3, 32, 4, 2], "seq": 32, "batch": 32, "classes": 256},
    # ViT: 32x32 images in 4x4 patches (64 + [CLS] tokens), 4 encoder layers, 10 classes
    "vit": {"kind": "vit", "args": [32, 4, 96, 4, 4, 10], "seq": 32, "batch": 32, "classes": 10},
}
# name: (vocab, tokens per sample, dim, blocks, classes, global batch). A classifier over a
# huge vocabulary (a recommender's or a hashed-features model's shape): its embedding's
# parameters, gradient and Adam state (256 MiB for one replica) dominate a rank's memory,
# which the runtime's own ~340 MiB does for every other model here, so where the layout puts
# the table (one pipeline stage; replicated, sharded or split by tensor parallelism) moves a
# rank's peak by hundreds of MiB, as in the large models the planner is for. Compute stays
# small (a lookup, MLP blocks of width 64, the optimizer's pass over the table).
EMBEDDING_MODELS: dict[str, tuple[int, ...]] = {
    "huge-embedding": (1 << 18, 16, 64, 3, 16, 32),
}
MODELS: dict[str, Any] = {**GPT_MODELS, **HF_SHAPES, **EMBEDDING_MODELS}


def _embedding_classifier(vocab: int, dim: int, n_blocks: int, classes: int) -> Any:
    """Embedding(vocab, dim), pre-norm residual MLP blocks, mean over tokens, a linear head."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, h: Any) -> Any:
            return h + self.mlp(self.norm(h))

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
            self.head = nn.Linear(dim, classes)

        def forward(self, tokens: Any) -> Any:
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(h.mean(dim=1))

    return Classifier()

def build(name: str) -> tuple[Any, Any, Any]:
    """(model_fn, global batch (x, y), step_fn) of a model of :data:`MODELS`. Every model is
    built marked for tensor parallelism (inert where tp = 1), so the profile sees what smp-tp
    would split."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if name not in MODELS:
        raise KeyError(f"bench_plan: no model {name!r} (models: {', '.join(MODELS)})")
    g = torch.Generator().manual_seed(0)
    if name in GPT_MODELS:
        from model import build_gpt, lm_loss

        vocab, seq, dim, heads, layers, batch = GPT_MODELS[name]

        def model_fn() -> Any:
            torch.manual_seed(0)
            return build_gpt(vocab, seq, dim, heads, layers, True)

        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        return model_fn, (x, y), lambda m, b: lm_loss(m(b[0]), b[1])

    import smp_torch as smp

    if name in EMBEDDING_MODELS:
        vocab, seq, dim, n_blocks, classes, batch = EMBEDDING_MODELS[name]

        def emb_fn() -> Any:
            torch.manual_seed(0)
            return smp.set_tensor_parallelism(_embedding_classifier(vocab, dim, n_blocks, classes))

        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return emb_fn, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1])

    import hf_models

    shape = HF_SHAPES[name]
    kind, batch, seq, classes = shape["kind"], shape["batch"], shape["seq"], shape["classes"]

    def hf_fn() -> Any:
        torch.manual_seed(0)
        return smp.set_tensor_parallelism(getattr(hf_models, kind)(*shape["args"]))

    if kind == "vit":  # images in, one label per image
        x = torch.randn(batch, 3, seq, seq, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
    else:  # tokens in, one label per token
        x = torch.randint(0, classes, (batch, seq), generator=g)
        y = torch.randint(0, classes, (batch, seq), generator=g)

    def step_fn(m: Any, b: Any) -> Any:
        logits = hf_models.logits(m, kind, b[0])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))

    return hf_fn, (x, y), step_fn


def blocks(name: str, net: Any) -> list[Any]:
    """The model's layers: what the grid checkpoints (each on its own) with ``ckpt``."""
    if name in GPT_MODELS or name in EMBEDDING_MODELS:
        return list(net.blocks)
    kind = HF_SHAPES[name]["kind"]
    if kind == "t5":  # both stacks
        return [*net.encoder.block, *net.decoder.block]
    if kind == "vit":
        return list(net.vit.layers)
    return list(net.model.layers)  # the Llama family, Mixtral
