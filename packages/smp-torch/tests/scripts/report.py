"""``model.report()`` on Hugging Face Gemma2, Phi-3 and Llama (tiny configs, no weights) at
tp = 2 and at pp = 2, on 2 ranks: the report's content and the fallback warnings (once, rank
0 only, naming the remedy). Prints ``CASE-OK <name>`` per case. Argument: a scratch folder.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import smp_torch as smp
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

VOCAB, SEQ = 64, 8
PARAMS: dict[str, dict[int, int]] = {}  # the last wrapped model's, before wrapping


def gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="eager", pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Gemma2ForCausalLM(cfg)


def phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
        use_cache=False, attn_implementation="sdpa", pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Phi3ForCausalLM(cfg)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


MODELS: dict[str, Callable[[], nn.Module]] = {"gemma2": gemma2, "phi3": phi3, "llama": llama}


def full_bytes(model: nn.Module) -> dict[str, dict[int, int]]:
    """Each module's parameters in the unwrapped model: {id: bytes} (its subtree, tied once)."""
    return {path: {id(p): p.numel() * p.element_size() for p in m.parameters()}
            for path, m in model.named_modules()}


@smp.step
def train(model: smp.DistributedModel, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


def wrap(name: str) -> tuple[smp.DistributedModel, dict[str, int], list[warnings.WarningMessage]]:
    """The wrapped model, the unwrapped bytes of each module, the warnings of wrapping."""
    global PARAMS
    torch.manual_seed(0)
    model = MODELS[name]()
    smp.set_tensor_parallelism(model)
    PARAMS = full_bytes(model)
    expected = {path: sum(ps.values()) for path, ps in PARAMS.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = smp.DistributedModel(model)
    return wrapped, expected, list(caught)


def fallback_kinds(caught: list[warnings.WarningMessage]) -> list[str]:
    """The remedy each TPFallbackWarning names, in order."""
    names = ("tp_register_block", "tp_register_vocab_parallel", "tp_register_with_module")
    out = []
    for w in caught:
        if issubclass(w.category, smp.TPFallbackWarning):
            named = [n for n in names if f"smp.{n}(" in str(w.message)]
            assert len(named) == 1, str(w.message)
            out.append(named[0])
    return out


def ok(name: str) -> None:
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-OK {name}", flush=True)


def check_tp(name: str) -> None:
    smp.init({"tensor_parallel_degree": 2, "print_report": name == "llama"})
    model, full, caught = wrap(name)
    report = model.report()  # pp = 1: there at wrap time
    rows = {r.path: r for r in report.modules}
    half = {path: full[path] // 2 for path in full}
    # smp-tp's own per-rank warning (no remedy, smp's source line) is gone.
    assert not any("shares parameters or is reused" in str(w.message) for w in caught), caught
    kinds = fallback_kinds(caught)
    if smp.rank() != 0:
        assert kinds == [], kinds
    for i in range(2):
        layer = f"model.layers.{i}"
        assert rows[f"{layer}.input_layernorm"].tp == "replicated", rows[f"{layer}.input_layernorm"]
        assert rows[f"{layer}.input_layernorm"].bytes_per_rank == full[f"{layer}.input_layernorm"]
        assert all(r.stage is None and r.shard_unit is None for r in report.modules)
        if name == "llama":
            for block in ("self_attn", "mlp"):
                r = rows[f"{layer}.{block}"]
                assert (r.tp, r.remedy) == ("block", None), r
                assert r.bytes_per_rank == half[f"{layer}.{block}"], (r, full[f"{layer}.{block}"])
        else:
            linears = ["qkv_proj", "o_proj"] if name == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
            for lin in linears:
                r = rows[f"{layer}.self_attn.{lin}"]
                assert (r.tp, r.remedy) == ("per-linear", "tp_register_block"), r
                assert r.bytes_per_rank == half[f"{layer}.self_attn.{lin}"], r
            attention = rows[f"{layer}.self_attn"]
            assert attention.tp == "" and attention.bytes_per_rank == half[f"{layer}.self_attn"], attention
    emb, head = rows["model.embed_tokens"], rows["lm_head"]
    if name == "llama":
        assert (emb.tp, head.tp) == ("vocab-parallel", "vocab-parallel"), (emb, head)
        assert emb.bytes_per_rank == half["model.embed_tokens"], emb
        assert "tied to model.embed_tokens" in head.tp_reason, head
        assert kinds == [], kinds
    elif name == "phi3":
        assert (emb.tp, emb.remedy) == ("layer", "tp_register_vocab_parallel"), emb
        assert (head.tp, head.remedy) == ("per-linear", "tp_register_vocab_parallel"), head
        assert rows["model.norm"].tp == "replicated"
        if smp.rank() == 0:
            assert sorted(kinds) == ["tp_register_block", "tp_register_vocab_parallel"], kinds
    else:  # Gemma2: a scaled embedding (a subclass of nn.Embedding) tied to the head
        assert emb.tp == "replicated" and emb.remedy == "tp_register_with_module", emb
        assert emb.module_type.endswith("ScaledWordEmbedding") and "subclass of Embedding" in emb.tp_reason, emb
        assert emb.bytes_per_rank == full["model.embed_tokens"], emb
        assert (head.tp, head.remedy) == ("replicated", "tp_register_vocab_parallel"), head
        assert "model.embed_tokens" in head.tp_reason, head
        if smp.rank() == 0:
            assert sorted(kinds) == ["tp_register_block", "tp_register_vocab_parallel",
                                     "tp_register_with_module"], kinds
            assert all("Gemma2ForCausalLM" in str(w.message) for w in caught
                       if issubclass(w.category, smp.TPFallbackWarning)), caught
    # The whole model: what is replicated in full, every split parameter halved.
    whole = {pid: b for path, r in rows.items() if r.tp == "replicated" for pid, b in PARAMS[path].items()}
    assert rows[""].bytes_per_rank == (full[""] - sum(whole.values())) // 2 + sum(whole.values()), rows[""]
    # The warning points at this script's line, not at smp's source.
    for w in caught:
        if issubclass(w.category, smp.TPFallbackWarning):
            assert w.filename == __file__, w.filename
    if name != "llama":  # (the Llama, printing its table, has no fallback)
        # Wrapping the same model class again warns no more.
        _, _, again = wrap(name)
        assert fallback_kinds(again) == [], again
    ok(f"tp2_{name}")


def check_pp(name: str, folder: str) -> None:
    timeline = os.path.join(folder, f"run_{name}", "timeline")
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeline": timeline})
    model, full, caught = wrap(name)
    assert fallback_kinds(caught) == [], caught
    try:
        model.report()
    except smp.SMPError as exc:
        assert "first step" in str(exc), exc
    else:
        raise AssertionError("report() before the first step")
    torch.manual_seed(1)
    train(model, torch.randint(1, VOCAB, (4, SEQ)))
    report = model.report()
    rows = {r.path: r for r in report.modules}
    stages = [rows[f"model.layers.{i}"].stage for i in range(2)]
    assert stages == sorted(stages) and set(stages) <= {0, 1}, stages  # blocks in stage order
    # Leaves (modules with parameters and no rows under them) are whole on their stage; the
    # partitioner may still move a block's child to the other stage, so sum by leaf.
    leaves = [r for path, r in rows.items()
              if path and PARAMS[path] and not any(p.startswith(path + ".") for p in rows)]
    totals: dict[int, dict[int, int]] = {0: {}, 1: {}}
    for r in leaves:
        assert r.stage in (0, 1) and r.bytes_per_rank == full[r.path], (r, full[r.path])
        # The stage column is where the parameters really are (other stages: empty stand-ins).
        here = sum(p.numel() for p in model.module.get_submodule(r.path).parameters()) > 0
        assert here == (r.stage == smp.pp_rank()), (r, smp.pp_rank())
        totals[r.stage].update(PARAMS[r.path])
    assert all(totals.values()), totals  # both stages hold parameters
    # The model's row: the rank holding the most (a weight tied across stages on both).
    assert rows[""].bytes_per_rank == max(sum(t.values()) for t in totals.values()), rows[""]
    assert rows[""].bytes_per_rank < full[""], (rows[""], full[""])
    assert all(r.tp == "" for r in report.modules), report
    assert report.pipeline_parallel_degree == 2 and report.tensor_parallel_degree == 1
    written = timeline + ".report.txt"
    if smp.rank() == 0:
        with open(written, encoding="utf-8") as f:
            assert f.read().strip() == str(report), written
    ok(f"pp2_{name}")


def check_sdp() -> None:
    """Sharded data parallelism (FSDP2): each module's unit, and half of every even tensor."""
    # (A low threshold: the tiny model gets units below its root.)
    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 500})
    model, full, _ = wrap("llama")
    rows = {r.path: r for r in model.report().modules}
    units = {r.shard_unit for r in rows.values()}
    assert None not in units and len(units) > 1, units
    for r in rows.values():
        # The unit named is one FSDP2 really made, and encloses the module.
        assert r.shard_unit is not None
        members = r.shard_unit.split("+")
        assert all(isinstance(model.module.get_submodule(m), FSDPModule) for m in members), r
        assert any(m == "" or r.path == m or r.path.startswith(m + ".") for m in members), r
    for i in range(2):
        mlp = f"model.layers.{i}.mlp"
        assert rows[mlp].bytes_per_rank == full[mlp] // 2, (rows[mlp], full[mlp])
    ok("sdp2_llama")


if __name__ == "__main__":
    scratch = sys.argv[1]
    for model_name in MODELS:
        check_tp(model_name)
    for model_name in MODELS:
        check_pp(model_name, scratch)
    check_sdp()
