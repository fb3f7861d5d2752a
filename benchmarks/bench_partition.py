"""Partitioner benchmark: balance on T5-11B against the lower bound and the paper method,
and scaling from 120k to 1.2M modules on 1024 devices.

Run in a venv with torch + transformers (the T5-11B graph is built on the meta device from
its public config, no weights): ``python benchmarks/bench_partition.py [--svg]``.
``--svg`` also (re)writes ``docs/images/t5-11b.svg``.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "graphs"))

from smp_partition import Module, ModuleGraph, partition  # noqa: E402
from smp_partition.render import svg  # noqa: E402

T5_11B = dict(
    d_model=1024, d_ff=65536, d_kv=128, num_heads=128, num_layers=24, num_decoder_layers=24,
    vocab_size=32128, tie_word_embeddings=True,
)  # fmt: skip


def synthetic(blocks: int) -> ModuleGraph:
    """A GPT-like graph: embedding tied to the head, ``blocks`` blocks of 12 modules each."""
    h = 1024
    mods = [
        Module("", "Model", ("embed", "blocks", "norm", "head")),
        Module("embed", "Embedding", (), {"embed.weight": 50000 * h}),
        Module("norm", "LayerNorm", (), {"norm.weight": h}),
        Module("head", "Linear", (), {"embed.weight": 50000 * h}),
    ]
    names = tuple(f"blocks.{i}" for i in range(blocks))
    mods.append(Module("blocks", "ModuleList", names))
    for b in names:
        sub = ("ln1", "attn", "ln2", "mlp", "drop")
        mods.append(Module(b, "Block", tuple(f"{b}.{s}" for s in sub)))
        for s, n in (("ln1", h), ("ln2", h)):
            mods.append(Module(f"{b}.{s}", "LayerNorm", (), {f"{b}.{s}.w": n}))
        mods.append(Module(f"{b}.drop", "Dropout"))
        att = ("q", "k", "v", "o")
        mods.append(Module(f"{b}.attn", "Attention", tuple(f"{b}.attn.{s}" for s in att)))
        for s in att:
            mods.append(Module(f"{b}.attn.{s}", "Linear", (), {f"{b}.attn.{s}.w": h * h}))
        mods.append(Module(f"{b}.mlp", "MLP", (f"{b}.mlp.fc1", f"{b}.mlp.fc2")))
        for s in ("fc1", "fc2"):
            mods.append(Module(f"{b}.mlp.{s}", "Linear", (), {f"{b}.mlp.{s}.w": 4 * h * h}))
    return ModuleGraph(mods)


def timed(blocks: int, devices: int) -> tuple[int, float, float]:
    """(modules, CPU s to validate and partition, CPU s to partition a validated graph)."""
    mods = list(synthetic(blocks).modules)  # build outside the clock
    gc.collect()
    # CPU time of this process: the benchmark machines are shared, and wall time would
    # measure the neighbours.
    start = time.process_time()
    graph = ModuleGraph(mods)
    validated = time.process_time()
    result = partition(graph, num_devices=devices, alpha=0.5, method="default")
    end = time.process_time()
    assert len(result.assignment) == len(mods)
    return len(mods), end - start, end - validated


def main() -> None:
    from module_graph_from_torch import t5_graph

    graph = ModuleGraph.from_dict(t5_graph(**T5_11B))
    for alpha in (1.0, 0.2):
        d = partition(graph, num_devices=8, alpha=alpha, method="default")
        p = partition(graph, num_devices=8, alpha=alpha, method="paper")
        print(
            f"T5-11B, 8 devices, alpha {alpha}: default max load {d.max_load:.4f} "
            f"({len(d.cut_edges)} cut edges), paper {p.max_load:.4f} "
            f"({len(p.cut_edges)} cut edges), lower bound {d.lower_bound:.4f}; "
            f"default/bound {d.max_load / d.lower_bound:.3f}, "
            f"paper/bound {p.max_load / p.lower_bound:.3f}",
            flush=True,
        )
        if alpha == 1.0 and "--svg" in sys.argv:
            out = ROOT / "docs" / "images" / "t5-11b.svg"
            out.parent.mkdir(exist_ok=True)
            out.write_text(svg(graph, d, title="T5-11B (tied embeddings), 8 devices, alpha 1.0"))
    n_small, t_small, p_small = timed(10_000, 1024)
    n_big, t_big, p_big = timed(100_000, 1024)
    print(
        f"scaling, 1024 devices, CPU s: {n_small} modules {t_small:.2f} s "
        f"(partition alone {p_small:.2f} s), {n_big} modules {t_big:.2f} s ({p_big:.2f} s); "
        f"modules x{n_big / n_small:.1f}, time x{t_big / t_small:.1f} "
        f"(partition alone x{p_big / p_small:.1f})",
        flush=True,
    )


if __name__ == "__main__":
    main()
