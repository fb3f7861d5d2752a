"""Sharded data parallelism: several configurations in one MPI job, each against one process.

Usage: ``mpiexec -n N python sharded.py CASES_JSON``; a case is ``{"name", "config", "steps",
"optimizer", "layers", "static_loss_scale", ...}``; ``"model"``: ``"llama"`` (a tiny Hugging Face
Llama with tied embeddings), ``"moe"`` (:class:`models.MoELM`: each rank's data picks its expert)
or TinyLM (default); ``"pin"``: ``{module path: pipeline stage}`` (manual partition, with
``auto_partition`` False); ``"error"``: substrings every rank's error of the first step must
contain (the case passes when every rank raised it; such a case ends the job). With ``tensor_parallel_degree`` > 1 the
model's blocks and norm are marked for tensor parallelism (smp-tp's layers, sharded by FSDP2). Every rank trains the single-process reference on the
global batch itself (same seed, same initial weights, the same autocast and clipping as the
configuration) and checks after every step the mean loss and every parameter of the gathered
model. Besides, each case checks that the model really is sharded: every parameter,
gradient and optimizer-state tensor this rank holds is a shard of about 1/sdp of the whole.

``bound: "fp32"`` (default): SPEC §8, ``rtol=1e-5, atol=1e-6`` elementwise. ``bound: "bf16"``:
under bf16 autocast every matmul rounds its output to bf16 (unit roundoff 2**-8), and a CPU
GEMM blocks its reduction differently for the per-rank batch than for the global batch, so
single outputs may differ by one bf16 ulp between the runs; these differences enter the
gradients, which are then summed in a different order (reduce-scatter over ranks). The loss
is compared relative to its size within ``8 * 2**-8``, and each parameter tensor by the
norm of its difference relative to the norm of its *change* from the initial weights (the
part the bf16 arithmetic produced), within ``8 * 2**-8`` (a few ulps of bf16 accumulated
over the steps). A wrong sharding, scaling or missing reduction moves these by O(1).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402
from equivalence import check_close, local_slice, make_opt  # noqa: E402
from smp_torch import sharded  # noqa: E402

BF16_REL = 8 * 2.0**-8


def check_sharded(name: str, dmodel: smp.DistributedModel, opt: smp.DistributedOptimizer, sdp: int) -> None:
    """Every parameter, gradient and state tensor here is a shard: about 1/sdp of the whole."""
    total = mine = 0
    for n, p in dmodel.named_parameters():
        assert sharded.is_sharded(p), f"[{name}] {n} is not sharded"
        local = sharded.local_tensor(p)
        assert local.numel() <= -(-p.shape[0] // sdp) * (p.numel() // max(p.shape[0], 1)), (name, n)
        total += p.numel()
        mine += local.numel()
        if p.grad is not None:
            assert sharded.local_tensor(p.grad).numel() == local.numel(), (name, n)
        for k, v in opt.optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                assert sharded.local_tensor(v).numel() == local.numel(), (name, n, k)
    # Uneven dim-0 splits (chunk semantics) leave at most one row per parameter over 1/sdp.
    assert mine <= total / sdp + sum(p.numel() // max(p.shape[0], 1) for p in dmodel.parameters()), (
        name,
        mine,
        total,
    )


def close_bf16(what: str, got: torch.Tensor, want: torch.Tensor, start: torch.Tensor, name: str) -> None:
    scale = float((want.double() - start.double()).norm()) + 1e-12
    err = float((got.double() - want.double()).norm())
    if got.shape != want.shape or err > BF16_REL * scale:
        raise AssertionError(
            f"[{name}] rank {smp.rank()}: {what} differs from one process: |diff| {err:.3g} > "
            f"{BF16_REL:.3g} * |change| {scale:.3g}"
        )


def build_model(case: dict, tp: bool) -> torch.nn.Module:
    """The case's model (see the module docstring), its ``pin`` marks set."""
    kind = case.get("model")
    if kind == "llama":
        model: torch.nn.Module = models.hf_llama()
        if tp:
            smp.set_tensor_parallelism(model)
    elif kind == "moe":
        model = models.MoELM(tp=tp)
    else:
        model = models.TinyLM(tp=tp, tied=case.get("tied", True), layers=case.get("layers", 2))
    for path, stage in case.get("pin", {}).items():
        smp.set_partition(model.get_submodule(path), stage)
    return model


def batch_of(case: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (MoE: routed by ``case["routes"]``, models.moe_batch)."""
    if case.get("model") == "moe":
        return models.moe_batch(step, case.get("batch", 8), case.get("routes"))
    return models.global_batch(step, case.get("batch", 8))


def expect_error(case: dict, step: Any) -> bool:
    """Run ``step()`` expecting an error that contains every substring of ``case["error"]``;
    print it as ``RANK <r> RAISED <name>: <message>`` (the test checks every rank)."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - checked below, on every rank
        text = " ".join(str(exc).split())
        missing = [w for w in case["error"] if w not in text]
        assert not missing, f"[{case['name']}] rank {smp.rank()}: {missing} not in {type(exc).__name__}: {text}"
        os.write(1, f"RANK {smp.rank()} RAISED {case['name']}: {type(exc).__name__}: {text}\n".encode())
        return True
    raise AssertionError(f"[{case['name']}] rank {smp.rank()}: the step did not raise")


def run_case(case: dict) -> None:
    name = case["name"]
    config = case["config"]
    if "nodes" in case:
        # Pretend the ranks sit on ``nodes`` machines (smp-comm's node-identity override).
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        os.environ["SMP_COMM_NODE_ID"] = f"node{world.Get_rank() * case['nodes'] // world.Get_size()}"
    else:
        os.environ.pop("SMP_COMM_NODE_ID", None)
    cfg = smp.init(config)
    torch.manual_seed(case.get("seed", 0))
    # With tensor parallelism the blocks and the norm are smp-tp's (FSDP2 shards their slices).
    model = build_model(case, cfg.tp > 1)
    hf = case.get("model") == "llama"
    ref = copy.deepcopy(model)
    start = copy.deepcopy(ref.state_dict())
    ref_opt = make_opt(case.get("optimizer", "adam"), ref.parameters())
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(
        make_opt(case.get("optimizer", "adam"), dmodel.parameters()),
        static_loss_scale=case.get("static_loss_scale"),
    )
    def check_plan() -> Any:
        # With a pipeline the units are the stage's top modules, known after the first step's
        # partition; without one the root's unit comes last.
        plan = dmodel.engine.shard_plan
        assert plan is not None and (cfg.pp > 1 or plan.units[-1] == ""), plan
        if "units" in case:
            want = case["units"][str(smp.pp_rank())] if cfg.pp > 1 else case["units"]
            assert plan.units == want, (name, plan.units)
        return plan

    plan = check_plan() if cfg.pp == 1 else None
    if cfg.tp > 1:
        from smp_torch import tp_glue

        shards = [n for n, p in dmodel.named_parameters() if tp_glue.is_shard(p)]
        assert shards, f"[{name}] tensor parallelism replaced no module (or lost its specs)"
    if "forward_prefetch" in case:
        assert plan is not None and plan.forward_prefetch == case["forward_prefetch"], (name, plan.forward_prefetch)
    if "reshard_after_forward" in case:
        assert plan is not None and plan.reshard_after_forward == case["reshard_after_forward"], (name, plan)
    # fp16 is checked with the same bound (its unit roundoff, 2**-11, is smaller); the
    # reference skips loss scaling: multiplying by a power of two is exact without overflow.
    bf16 = bool(config.get("bf16")) or bool(config.get("fp16"))
    half = torch.float16 if config.get("fp16") else torch.bfloat16
    clip = float(config.get("sdp_gradient_clipping", 0.0))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(dmodel(input_ids=x).logits if hf else dmodel(x), y)
        dmodel.backward(loss)
        return loss

    if "error" in case:
        x, y = batch_of(case, 0)
        expect_error(case, lambda: train_step(local_slice(x, cfg), local_slice(y, cfg)))
        return

    clipped = 0
    t0 = time.perf_counter()
    for step in range(case.get("steps", 3)):
        x, y = batch_of(case, step)
        ref_opt.zero_grad()
        ctx = torch.autocast("cpu", dtype=half) if bf16 else contextlib.nullcontext()
        with ctx:
            ref_loss = models.lm_loss(ref(input_ids=x).logits if hf else ref(x), y)
        ref_loss.backward()
        if clip > 0:
            clipped += float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)) > clip
        ref_opt.step()

        opt.zero_grad()
        loss = train_step(local_slice(x, cfg), local_slice(y, cfg)).reduce_mean()
        losses = smp.allgather(float(loss), smp.DP_GROUP)
        mean_loss = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
        want_loss = ref_loss.detach().double()
        if bf16:
            err = abs(float(mean_loss - want_loss))
            assert err <= BF16_REL * abs(float(want_loss)), (name, step, err, float(want_loss))
        else:
            check_close(f"loss at step {step}", mean_loss, want_loss, name)
        opt.step()
        if plan is None:
            plan = check_plan()
        check_sharded(name, dmodel, opt, cfg.sdp)
        full = dmodel.state_dict()
        want = ref.state_dict()
        assert set(full) == set(want), (name, sorted(full), sorted(want))
        for k, v in want.items():
            if bf16:
                close_bf16(f"{k} after step {step}", full[k], v, start[k], name)
            else:
                check_close(f"{k} after step {step}", full[k], v, name)
    elapsed = time.perf_counter() - t0
    assert clip == 0 or clipped, f"[{name}] the clipping bound never applied: choose a smaller one"
    fresh = build_model({k: v for k, v in case.items() if k != "pin"}, False)
    fresh.load_state_dict(dmodel.state_dict(), strict=True)
    # The gathered optimizer state loads back exactly (state_dict -> load_state_dict round trip).
    osd = opt.state_dict()
    opt.load_state_dict(osd)
    again = opt.state_dict()
    for pname, st in osd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(v, again["state"][pname][k]), (name, pname, k)
    # A full state dict loads back, every rank slicing its shards: a shifted copy comes back.
    shifted = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
    dmodel.load_state_dict(shifted)
    again = dmodel.state_dict()
    for k, v in shifted.items():
        assert torch.equal(again[k], v), (name, k)
    # The sharding groups run on collective_backend like smp's others ("auto": smp on CPU).
    from smp_torch import group_cache

    want = config.get("collective_backend", "auto")
    want = ("nccl" if torch.cuda.is_available() else "smp") if want == "auto" else want
    on = {torch.distributed.get_backend(g) for g in group_cache._GROUPS.values()
          if g is not torch.distributed.GroupMember.NON_GROUP_MEMBER}
    assert on == {want}, f"[{name}] groups on {on}, want {want}"
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-OK {name} ({elapsed:.1f}s; units {plan.units})", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(sys.argv[1])
    for case in cases:
        run_case(case)
        if "error" in case:
            return  # (the failed step's groups are not reused: nothing follows it)


if __name__ == "__main__":
    main()
