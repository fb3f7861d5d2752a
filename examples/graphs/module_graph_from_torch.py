"""Build an ``smp-partition/module-graph@1`` dict from a torch ``nn.Module``.

Needs torch (and transformers for the T5 graphs); smp-partition itself does not.
Children are listed in definition order; a module reachable under several names (e.g. T5's
``encoder.embed_tokens``, the same object as ``shared``) appears once, under its first
name, as a child of every parent that holds it; parameters are keyed by identity (their
first name), so a tied weight is one key shared by every module that registers it.

    python examples/graphs/module_graph_from_torch.py   # regenerates t5-small.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SCHEMA = "smp-partition/module-graph@1"


def leaf_activation_bytes(model: Any, **inputs: Any) -> dict[str, int]:
    """Bytes of the outputs of every leaf module during one forward pass with ``inputs``.

    Runs fine on the meta device (only shapes). Containers get nothing: their outputs are
    their last child's, so counting them too would count the same tensor twice.
    """
    import torch

    found: dict[str, int] = {}
    handles = []

    def record(name: str) -> Any:
        def hook(_mod: Any, _inp: Any, out: Any) -> None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            size = sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            found[name] = found.get(name, 0) + size

        return hook

    for name, mod in model.named_modules():
        if next(mod.children(), None) is None:
            handles.append(mod.register_forward_hook(record(name)))
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return found


def graph_dict(model: Any, activations: dict[str, int] | None = None) -> dict[str, Any]:
    """The module graph of ``model`` (works on the meta device: only shapes are read)."""
    activations = activations or {}
    names: dict[int, str] = {}
    for name, mod in model.named_modules():  # deduplicates reused modules: first name wins
        names.setdefault(id(mod), name)
    pkeys: dict[int, str] = {}
    for name, p in model.named_parameters():  # tied parameters: first name wins
        pkeys.setdefault(id(p), name)
    modules = []
    for name, mod in model.named_modules():
        children = []
        for _, child in mod.named_children():
            cname = names[id(child)]
            if cname not in children:
                children.append(cname)
        params = {pkeys[id(p)]: int(p.numel()) for _, p in mod.named_parameters(recurse=False)}
        modules.append(
            {
                "name": name,
                "type": type(mod).__name__,
                "children": children,
                "params": params,
                "activation_bytes": activations.get(name, 0),
                "forward_ms": None,
            }
        )
    return {"schema": SCHEMA, "modules": modules}


def t5_graph(micro_batch: tuple[int, int] | None = None, **config: Any) -> dict[str, Any]:
    """The graph of a ``T5ForConditionalGeneration`` built from ``T5Config(**config)``.

    With ``micro_batch=(batch, tokens)`` the leaf modules' activation bytes for that input
    (encoder and decoder sequences of equal length) are recorded too.
    """
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(**config))
    acts = None
    if micro_batch is not None:
        ids = torch.zeros(micro_batch, dtype=torch.long, device="meta")
        acts = leaf_activation_bytes(model, input_ids=ids, decoder_input_ids=ids)
    return graph_dict(model, acts)


def main() -> None:
    out = Path(__file__).with_name("t5-small.json")
    # The public t5-small configuration (transformers' T5Config defaults), tied embeddings,
    # with activations of a 2 x 128-token micro-batch.
    graph = t5_graph(
        micro_batch=(2, 128),
        d_model=512,
        d_ff=2048,
        d_kv=64,
        num_heads=8,
        num_layers=6,
        num_decoder_layers=6,
        vocab_size=32128,
        tie_word_embeddings=True,
    )
    out.write_text(json.dumps(graph, indent=1) + "\n")
    print(f"wrote {out} ({len(graph['modules'])} modules)", file=sys.stderr)


if __name__ == "__main__":
    main()
