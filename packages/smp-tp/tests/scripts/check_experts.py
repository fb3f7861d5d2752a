"""Expert parallelism (ep = every rank) on tiny Mixtral, Qwen3-MoE and DeepSeek-V3.

Every rank builds the same model and feeds its own tokens; a copy has each MoE layer's
experts replaced by ``expert_parallelize``. Against the unmodified model on this rank's
tokens: logits and loss (bitwise where reached, else allclose), non-expert gradients
(local), expert gradients (gathered, against the sum over ranks of the original's), the
share of expert elements held, the collectives run, and the gathered expert state.
Both of transformers' experts implementations ("eager": expert-order index_add_,
"grouped_mm": slot sum) are the reference, with the loop and the grouped-matmul compute,
one GEMM per expert (allclose) or one per expert and sender (``per_sender_gemm``: the
logits and loss must be bitwise the original's).

The optional capacity factor: a capacity nothing exceeds is bitwise no capacity; cf=0.5
(slots dropped) matches the unsplit experts with the dropped slots' weights zeroed; cf=0
is a ValueError.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import smp_tp
import torch
import torch.distributed as dist
from common import FAILURES, check, close, finish, gather_batch, log, randomize, setup

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

rank, T, _ = setup()
B, S, V = 2, 5, 64
# BROKEN=<name> breaks one thing on purpose (to show the checks can fail).
BROKEN = os.environ.get("SMP_TP_EXPERTS_BROKEN", "")


def mixtral(impl: str, experts: int = 8):
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=3, max_position_embeddings=32,
        experts_implementation=impl))


def qwen3(impl: str):
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=32,
        experts_implementation=impl))


def deepseek(impl: str):
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=32, experts_implementation=impl))


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3, "deepseek_v3": deepseek}


def is_expert(key: str) -> bool:
    return key.endswith(("experts.gate_up_proj", "experts.down_proj"))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}


WORST: dict[str, float] = {}  # largest |got - want| / max|want| by kind, reported at the end


def equal_or_close(label: str, got: torch.Tensor, want: torch.Tensor, kind: str) -> bool:
    """True when bitwise equal; else must be allclose (rtol 1e-5, atol 1e-6 x scale)."""
    if torch.equal(got, want):
        return True
    close(label, got, want)
    rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    WORST[kind] = max(WORST.get(kind, 0.0), rel)
    return False


def run(name: str, impl: str, grouped: bool, per_sender: bool) -> None:
    torch.manual_seed(0)
    ref = MODELS[name](impl)
    randomize(ref)
    model = copy.deepcopy(ref)
    replaced = smp_tp.expert_parallelize(model, None, grouped_mm=grouped, per_sender_gemm=per_sender)
    if BROKEN == "combine":  # add the k outputs in the wrong order (eager) / drop the cast
        for m in model.modules():
            if isinstance(m, smp_tp.ExpertParallelExperts):
                m.combine = "slot_sum" if impl == "eager" else "expert_order"
    gen = torch.Generator().manual_seed(100 + rank)  # different tokens on each rank
    ids = torch.randint(0, V, (B, S), generator=gen)
    if BROKEN == "routing":  # send rank r's expert-e tokens to expert (e + 1) % E instead
        for m in model.modules():
            if isinstance(m, smp_tp.ExpertParallelExperts):
                fwd = m.forward
                m.forward = lambda h, i, w, fwd=fwd, m=m: fwd(h, (i + 1) % m.num_experts, w)
    with smp_tp.collective_counts() as counts:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    want = grads(ref)
    for k in sorted(want):
        if is_expert(k):
            dist.all_reduce(want[k])  # the sum over ranks of the original's expert gradient
    got_grads = grads(model)
    got_grads.update(smp_tp.full_expert_grads(model))
    full = smp_tp.full_expert_state(model)
    held = sum(p.numel() for k, p in model.named_parameters() if is_expert(k))
    total = sum(p.numel() for k, p in ref.named_parameters() if is_expert(k))
    sd = dict(model.state_dict())
    sd.update(full)
    fresh = MODELS[name](impl)
    # All collectives done; from here every check runs locally.
    label = f"{name} impl={impl} grouped_mm={grouped} per_sender_gemm={per_sender}"
    exact: dict[str, bool] = {}

    def outputs() -> None:
        exact["logits"] = equal_or_close(f"{label} logits", out.logits, out_ref.logits, "logits")
        exact["loss"] = equal_or_close(f"{label} loss", out.loss, out_ref.loss, "loss")
        if per_sender and not (exact["logits"] and exact["loss"]):
            raise AssertionError(f"per_sender_gemm: not bitwise equal: {exact}")

    def gradients() -> None:
        if set(got_grads) != set(want):
            raise AssertionError(f"keys differ: {sorted(set(got_grads) ^ set(want))}")
        same = {k: equal_or_close(f"{label} grad {k}", got_grads[k], want[k], "grads") for k in sorted(want)}
        exact["grads"] = all(same.values())
        # Not asserted bitwise: the k slot gradients of a token reach d(hidden) through one
        # index backward here, through k index_add_s (eager) or a sort (grouped_mm) there.

    def layout() -> None:
        assert replaced == 2, replaced
        assert held * T == total, (held, total)
        n_ref = {k: v for k, v in ref.state_dict().items() if is_expert(k)}
        assert set(full) == set(n_ref), sorted(set(full) ^ set(n_ref))
        for k, v in n_ref.items():
            assert torch.equal(full[k], v), k
        fresh.load_state_dict(sd, strict=True)
        # per layer: counts + tokens + results forward; results + tokens backward
        assert counts.total() == {"forward": {"all_to_all": 6}, "backward": {"all_to_all": 4}}, counts.total()

    check(f"{label} outputs", outputs)
    check(f"{label} gradients", gradients)
    check(f"{label} layout", layout)
    log(f"{label}: checked (bitwise: {exact})")


def skewed(grouped: bool) -> None:
    """Every rank's tokens choose experts 0..3 only, so rank 1 receives no rows at all (an
    empty expert compute that must still run the return all-to-all in backward)."""
    torch.manual_seed(0)
    ref = mixtral("eager").model.layers[0].mlp.experts
    randomize(ref)
    ep = smp_tp.distribute_experts(ref, None, grouped_mm=grouped)
    gen = torch.Generator().manual_seed(7 + rank)
    n = 6
    x = torch.randn(n, 32, generator=gen)
    idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(n)])
    w = torch.rand(n, 2, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    y = ep(xa, idx, wa)
    y.square().sum().backward()
    y_ref = ref(xb, idx, wb)
    y_ref.square().sum().backward()
    g_ref = {"gate_up_proj": ref.gate_up_proj.grad.clone(), "down_proj": ref.down_proj.grad.clone()}
    for g in g_ref.values():
        dist.all_reduce(g)
    g_got = smp_tp.full_expert_grads(ep)
    label = f"skewed grouped_mm={grouped}"

    def compare() -> None:
        close(f"{label} out", y, y_ref)
        close(f"{label} d input", xa.grad, xb.grad)
        close(f"{label} d weights", wa.grad, wb.grad)
        for k in g_ref:
            close(f"{label} d {k}", g_got[k], g_ref[k])

    check(label, compare)
    log(f"{label}: checked")


def bad_degree() -> None:
    torch.manual_seed(0)
    experts = mixtral("eager", experts=3).model.layers[0].mlp.experts
    try:
        smp_tp.distribute_experts(experts, None)
    except ValueError as e:
        msg = str(e)
        assert f"degree {T}" in msg and "experts 3" in msg, msg
        log(f"ValueError: {msg}")
        return
    raise AssertionError("no ValueError for 3 experts on 2 ranks")


def capacity_mask(idx: torch.Tensor, num_experts: int, cf: float) -> torch.Tensor:
    """1.0 for the slots kept under capacity factor ``cf``, 0.0 for the dropped ones: the rule
    written out slot by slot (the layer's is vectorised), over one rank's tokens."""
    n, k = idx.shape
    cap = math.ceil(cf * n * k / num_experts)
    seen = [0] * num_experts
    mask = torch.ones(n, k)
    for t in range(n):  # token order first, a token's choices in top-k order
        for c in range(k):
            e = int(idx[t, c])
            if seen[e] >= cap:
                mask[t, c] = 0.0
            seen[e] += 1
    return mask


def capacity_nothing_dropped() -> None:
    """A capacity no expert can exceed (cf = E gives cap = n_tok * k): through
    ``expert_parallelize``, logits, loss and every gradient are bitwise cf=None's."""
    torch.manual_seed(0)
    base = mixtral("eager")
    randomize(base)
    models = {cf: copy.deepcopy(base) for cf in (None, 8.0)}
    gen = torch.Generator().manual_seed(300 + rank)
    ids = torch.randint(0, V, (B, S), generator=gen)
    outs = {}
    for cf, m in models.items():
        smp_tp.expert_parallelize(m, None, capacity_factor=cf)
        outs[cf] = m(input_ids=ids, labels=ids)
        outs[cf].loss.backward()
    layers = [m for m in models[8.0].modules() if isinstance(m, smp_tp.ExpertParallelExperts)]
    label = "capacity cf=8 nothing dropped"

    def compare() -> None:
        assert len(layers) == 2 and all(m.capacity_factor == 8.0 for m in layers), layers
        assert [m.dropped_slots for m in layers] == [0, 0], [m.dropped_slots for m in layers]
        assert torch.equal(outs[8.0].logits, outs[None].logits), "logits"
        assert torch.equal(outs[8.0].loss, outs[None].loss), "loss"
        got, want = grads(models[8.0]), grads(models[None])
        for k in want:
            assert torch.equal(got[k], want[k]), f"grad {k}"

    check(label, compare)
    log(f"{label}: checked")


def capacity_drops(impl: str, grouped: bool, per_sender: bool, cf: float = 0.5) -> None:
    """cf=0.5 on Mixtral's experts at ep=2 against the unsplit experts on the concatenated
    batch with the routing weights of exactly the dropped slots zeroed (each rank's drops
    chosen over its own tokens): outputs, input/weight gradients, summed expert gradients."""
    torch.manual_seed(0)
    ref = mixtral(impl).model.layers[0].mlp.experts
    randomize(ref)
    ep = smp_tp.distribute_experts(ref, None, grouped_mm=grouped, per_sender_gemm=per_sender, capacity_factor=cf)
    gen = torch.Generator().manual_seed(400 + rank)
    n, k, E = 10, 3, ref.num_experts
    x = torch.randn(n, 32, generator=gen)
    idx = torch.rand(n, E, generator=gen).topk(k, dim=1).indices
    w = torch.rand(n, k, generator=gen)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = ep(xa, idx, wa)
    y.square().sum().backward()
    dropped = ep.dropped_slots
    total_dropped = torch.tensor([dropped])
    dist.all_reduce(total_dropped)
    g_got = smp_tp.full_expert_grads(ep)
    X, IDX, W = gather_batch(x), gather_batch(idx), gather_batch(w)
    # All collectives done; the reference runs on one rank's view of the whole batch.
    mask = torch.cat([capacity_mask(part, E, cf) for part in IDX.split(n)])
    xb, wb = X.clone().requires_grad_(), W.clone().requires_grad_()
    y_ref = ref(xb, IDX, wb * mask)
    y_ref.square().sum().backward()
    mine = slice(rank * n, (rank + 1) * n)
    label = f"capacity cf={cf} impl={impl} grouped_mm={grouped} per_sender_gemm={per_sender}"

    def compare() -> None:
        assert dropped == int((mask[mine] == 0).sum()), (dropped, mask[mine])
        assert int(total_dropped) == int((mask == 0).sum()) and dropped > 0, (dropped, int(total_dropped))
        close(f"{label} out", y, y_ref[mine])
        close(f"{label} d input", xa.grad, xb.grad[mine])
        close(f"{label} d weights", wa.grad, wb.grad[mine])
        assert torch.all(wa.grad[mask[mine] == 0] == 0), "a dropped slot's weight got a gradient"
        close(f"{label} d gate_up_proj", g_got["gate_up_proj"], ref.gate_up_proj.grad)
        close(f"{label} d down_proj", g_got["down_proj"], ref.down_proj.grad)

    check(label, compare)
    log(f"{label}: checked (dropped {dropped} of {n * k} slots here, {int(total_dropped)} in all)")


def bad_capacity() -> None:
    experts = mixtral("eager").model.layers[0].mlp.experts
    try:
        smp_tp.distribute_experts(experts, None, capacity_factor=0.0)
    except ValueError as e:
        msg = str(e)
        assert "capacity_factor" in msg, msg
        log(f"ValueError: {msg}")
        return
    raise AssertionError("no ValueError for capacity_factor=0")


for name in MODELS:
    for impl in ("eager", "grouped_mm"):
        for grouped in (False, True):
            for per_sender in (False, True):
                run(name, impl, grouped, per_sender)
for grouped in (False, True):
    skewed(grouped)
check("bad degree", bad_degree)
capacity_nothing_dropped()
for impl in ("eager", "grouped_mm"):
    for grouped, per_sender in ((False, False), (True, False), (False, True)):
        capacity_drops(impl, grouped, per_sender)
check("bad capacity", bad_capacity)
log("largest difference / max|value| where not bitwise: " + ", ".join(f"{k} {v:.1e}" for k, v in WORST.items()))
if FAILURES:
    log(f"{len(FAILURES)} checks failed")
finish(FAILURES)
