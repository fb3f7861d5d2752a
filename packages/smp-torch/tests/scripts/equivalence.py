"""Train several smp configurations in one MPI job and compare each with one process.

Usage: ``mpiexec -n N python equivalence.py CASES_JSON`` where CASES_JSON is a JSON list of
``{"name": ..., "config": {...}, "steps": 3, "batch": 8, "optimizer": "adam", ...}``.
Every rank computes the single-process reference itself (the models are tiny) and checks the
distributed run against it after every step: loss, and the gathered full state dict.
A case with ``"bitwise_vs": {config overrides}`` is then trained again with those overrides
(e.g. ``{"pipeline": "interleaved", "static_mode": False}``: dynamic mode), and every step's
loss and each rank's local gradients (before the optimizer step) and gathered state dict
must equal the first run's bit for bit.
Prints ``CASE-OK <name>`` per case from rank 0; raises on the first mismatch.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def make_opt(kind: str, params: object) -> torch.optim.Optimizer:
    """The test's optimizer. AdamW's eps is 1e-4, not 1e-8: its first update,
    lr * g / (|g| + eps), magnifies a gradient's rounding by up to lr / eps. At 1e-8 (10^6)
    an element with |g| = 7e-8 turned a reordered sum's 1e-10 into a 1.4e-6 parameter
    difference (sdp2-pp2-llama-tied-stage0 on an AVX-512 machine); at 1e-4 (100) rounding
    stays 30x under ATOL, and a wrongly scaled gradient still moves the update."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-4)  # type: ignore[arg-type]


def local_slice(x: torch.Tensor, cfg: smp.SMPConfig) -> torch.Tensor:
    if cfg.prescaled_batch:
        n, i = smp.rdp_size(), smp.rdp_rank()
    else:
        n, i = smp.dp_size(), smp.dp_rank()
    return x.chunk(n)[i]


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    if got.shape != want.shape or not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(
            f"[{name}] rank {smp.rank()}: {what} differs from one process (max diff {diff})"
        )


def check_offloading(dmodel: smp.DistributedModel, cfg: smp.SMPConfig, case: dict) -> None:
    """The checkpointed blocks' inputs really went to the host pool and came back, never
    more than ``activation_loading_horizon`` microbatches ahead of their backward."""
    name = case["name"]
    stats = smp.allgather(dmodel.offload_stats(), smp.WORLD)
    assert all(s is not None for s in stats), f"[{name}] a rank has no offloader: {stats}"
    assert sum(s["tensors_offloaded"] for s in stats) > 0, f"[{name}] nothing offloaded: {stats}"
    for r, s in enumerate(stats):
        assert s["max_ahead"] <= cfg.activation_loading_horizon, f"[{name}] rank {r}: {s}"
        assert s["bytes_reloaded"] >= s["bytes_offloaded"], f"[{name}] rank {r}: {s}"
    if smp.rank() == 0:
        print(f"STATS {name} {stats}", flush=True)


def check_initial_weights(dmodel: smp.DistributedModel, ref: torch.nn.Module, name: str) -> None:
    """Every tensor this rank materialised equals the normal construction's bitwise, before
    any step (the local state dict: this stage's entries, a sharded tensor's local shard
    compared with the same slice of the whole)."""
    from smp_torch import sharded, tp_glue

    want = {**dict(ref.named_parameters(remove_duplicate=False)), **dict(ref.named_buffers(remove_duplicate=False))}
    local = {**dict(dmodel.module.named_parameters(remove_duplicate=False)), **dict(dmodel.module.named_buffers(remove_duplicate=False))}
    checked = 0
    for k, t in local.items():
        if k not in want or t.numel() == 0 or t.is_meta:
            continue  # (another stage's empty stand-in)
        full = want[k].detach()
        mine = sharded.local_tensor(t).detach()
        if sharded.is_sharded(t):
            full = sharded.shard_like(full, t).to_local()  # type: ignore[arg-type]
        if tp_glue.is_shard(t):
            continue  # (a tensor-parallel slice: compared through the gathered state dict)
        if mine.shape != full.shape or not torch.equal(mine, full):
            raise AssertionError(f"[{name}] rank {smp.rank()}: {k} differs from a normal construction")
        checked += 1
    assert checked, f"[{name}] rank {smp.rank()} materialised nothing"


# What a run produced, per step: the mean loss, this rank's local gradients before the
# optimizer step, the gathered state dict after it (compared bitwise by ``bitwise_vs``).
Trace = list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def local_grads(dmodel: smp.DistributedModel) -> dict[str, torch.Tensor]:
    """This rank's gradients (a sharded parameter's local shard), by parameter name."""
    from smp_torch import sharded

    return {
        n: sharded.local_tensor(p.grad).detach().clone()
        for n, p in dmodel.named_parameters()
        if p.grad is not None
    }


def check_bitwise(name: str, vs: dict, got: Trace, want: Trace) -> None:
    """``got`` (the case) equals ``want`` (the case under the ``vs`` overrides) bit for bit."""
    where = f"[{name}] rank {smp.rank()} vs {vs}"
    assert len(got) == len(want), f"{where}: {len(got)} steps vs {len(want)}"
    for step, ((loss, grads, state), (loss2, grads2, state2)) in enumerate(zip(got, want)):
        assert torch.equal(loss, loss2), f"{where}: loss at step {step}: {loss} vs {loss2}"
        for what, a, b in (("gradient", grads, grads2), ("state", state, state2)):
            assert set(a) == set(b), f"{where}: {what} names differ at step {step}: {sorted(set(a) ^ set(b))}"
            for k, t in a.items():
                if not torch.equal(t, b[k]):
                    diff = (t - b[k]).abs().max().item() if t.shape == b[k].shape else "shape"
                    raise AssertionError(f"{where}: {what} {k} at step {step} differs (max diff {diff})")


def graph_tensors_alive() -> int:
    """Tensors alive in this process that carry an autograd graph (not leaves), less the
    result an ``smp`` group's express-path handle keeps until that group's next collective.

    (That handle is reused from call to call, and holds its last result, at most
    ``inline_bytes``: one small tensor per group, whether it is a graph's depends on which
    collective came last on the express path, which depends on timing. Counted, it made
    the census 1, 2 or 3 from step to step on a tensor-parallel rank: [1, 1, 2] failed a CI
    run, 2 Dec.)"""
    from smp_comm.torch_calls import CallOrder

    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on torch's deprecated module objects)
        objects = gc.get_objects()
        spare = {
            id(t)
            for o in objects
            if isinstance(o, CallOrder) and o._spare is not None
            for t in o._spare.result()
        }
        return sum(
            1 for o in objects
            if isinstance(o, torch.Tensor) and o.grad_fn is not None and id(o) not in spare
        )


def run_case(case: dict) -> Trace:
    """Train ``case`` checking it against one process; what it produced per step."""
    name = case["name"]
    delayed = {"delayed_parameter_initialization": True} if case.get("delayed") else {}
    cfg = smp.init({**case["config"], **delayed})
    # the groups really run on the chosen backend ("auto": smp on CPU, NCCL on CUDA)
    want = cfg.collective_backend
    if want == "auto":
        want = "nccl" if torch.cuda.is_available() else "smp"
    groups = [smp.get_dp_process_group(), smp.get_tp_process_group(), smp.get_pp_process_group()]
    backends = {torch.distributed.get_backend(g) for g in groups}
    assert backends == {want}, f"[{name}] groups on {backends}, want {want}"
    tp_marks = cfg.tp > 1 or case.get("tp_marks", False)

    def construct() -> torch.nn.Module:
        torch.manual_seed(case.get("seed", 0))
        if case.get("model") in models.HF_MODELS:
            built = models.HF_MODELS[case["model"]]()
            if tp_marks:
                smp.set_tensor_parallelism(built)
            return built
        return models.build(case, tp_marks)

    model = construct()
    if case.get("checkpoint_blocks"):
        blocks = getattr(model, "blocks", None) or [m for m in model.children() if isinstance(m, models.MLPBlock)]
        for block in blocks:
            smp.set_activation_checkpointing(block)
    ref = copy.deepcopy(model)
    ref_opt = make_opt(case.get("optimizer", "adam"), ref.parameters())
    if case.get("delayed"):
        # The same construction, recorded on the meta device: every rank materialises what
        # it owns, and must get the normal construction's values (the reference) bitwise.
        with smp.delay_param_initialization():
            model = construct()
        assert all(t.is_meta for t in model.parameters()), f"[{name}] not built on meta"
        if case.get("checkpoint_blocks"):
            blocks = getattr(model, "blocks", None) or [m for m in model.children() if isinstance(m, models.MLPBlock)]
            for block in blocks:
                smp.set_activation_checkpointing(block)
    dmodel = smp.DistributedModel(model, **case.get("wrap", {}))
    if case.get("partitioned_at_wrap") is not None:
        assert dmodel.partitioned == case["partitioned_at_wrap"], f"[{name}] partitioned: {dmodel.partitioned}"
    if case.get("delayed"):
        check_initial_weights(dmodel, ref, name)
    if cfg.tp > 1:
        from smp_torch import tp_glue

        shards = [n for n, p in dmodel.named_parameters() if tp_glue.is_shard(p)]
        assert shards, f"[{name}] tensor parallelism replaced no module"
        if case.get("model") == "llama":  # the Llama mapping, not per-linear fallbacks
            kinds = {type(m).__name__ for m in dmodel.modules()}
            assert {"DistributedBlock", "ColumnParallelLinear"} <= kinds, f"[{name}] {sorted(kinds)}"
            assert "DistributedLinear" not in kinds, f"[{name}] {sorted(kinds)}"
    opt = smp.DistributedOptimizer(make_opt(case.get("optimizer", "adam"), dmodel.parameters()))

    hf = case.get("model") in models.HF_MODELS

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = models.hf_logits(dmodel, case["model"], x) if hf else dmodel(x)
        loss = models.lm_loss(logits, y)
        dmodel.backward(loss)
        return loss

    executor = dmodel.engine.runtime.server.executor if cfg.pp > 1 else None
    if cfg.static_mode and executor is not None and executor.inline_max_s:
        # The 2 ms gate of static mode is a speed heuristic: lifted here, what is served
        # inline does not depend on the machine's load. (Not on a tensor-parallel follower,
        # which has none: it runs inline what its leader announces.)
        executor.inline_max_s = 60.0
    batch = case.get("batch", 8)
    trace: Trace = []
    alive: list[int] = []  # graph tensors alive after each step (a pipeline's)
    t0 = time.perf_counter()
    for step in range(case.get("steps", 3)):
        x, y = models.global_batch(step, batch)
        ref_opt.zero_grad()
        ref_loss = models.lm_loss(models.hf_logits(ref, case["model"], x) if hf else ref(x), y)
        ref_loss.backward()
        ref_opt.step()

        opt.zero_grad()
        out = train_step(local_slice(x, cfg), local_slice(y, cfg))
        loss = out.reduce_mean()
        losses = smp.allgather(float(loss), smp.DP_GROUP)
        mean_loss = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
        check_close(f"loss at step {step}", mean_loss, ref_loss.detach().double(), name)
        grads = local_grads(dmodel) if case.get("bitwise_vs") else {}
        opt.step()
        full = dmodel.state_dict()
        want = ref.state_dict()
        if set(full) != set(want):
            raise AssertionError(f"[{name}] state_dict keys {sorted(full)} != {sorted(want)}")
        for k, v in want.items():
            check_close(f"{k} after step {step}", full[k], v, name)
        if case.get("bitwise_vs"):
            trace.append((mean_loss, grads, {k: v.detach().clone() for k, v in full.items()}))
        if cfg.pp > 1:
            alive.append(graph_tensors_alive())
    if len(alive) > 1 and alive[-1] > alive[0]:
        # A finished microbatch's cross-rank records must take their graphs with them (until
        # 2 Dec two reference cycles through autograd's C++ graph kept every chained or
        # calling-back microbatch's graph: Llama's driver +2.6 MiB a step, T5's decoder +7).
        raise AssertionError(f"[{name}] rank {smp.rank()}: graph tensors alive after each step {alive}")
    if cfg.pp > 1 and cfg.tp > 1:
        # smp-pipeline always has the OrderChannel now (the "serial" fallback is gone).
        want = "leader"
        assert dmodel.engine.ordering == want, (dmodel.engine.ordering, want)
    if case.get("served_per_mb") is not None and smp.pp_rank() == 1:
        # fast_mode: the requests stage 1 served (forward + backward), per microbatch.
        served = dmodel.engine.runtime.requests_served
        want = case["served_per_mb"] * cfg.microbatches * case.get("steps", 3)
        assert served == want, f"[{name}] stage 1 served {served} requests, expected {want}"
    if case.get("chained") and smp.pp_rank() == 0:
        # fast_mode chained the loop's blocks on stage 1 (ModuleList chains), with no miss.
        chains = dmodel.engine.runtime._dispatch.chains
        assert chains is not None and chains.hits > 0 and chains.misses == 0, (
            f"[{name}] chains: {None if chains is None else (chains.hits, chains.misses)}"
        )
    if case.get("relayed") is not None:
        # fast_mode relays: requests a stage passed on to the next (forward and backward).
        relayed = sum(smp.allgather(dmodel.engine.runtime.server.remote.relayed, smp.PP_GROUP))
        assert (relayed > 0) == case["relayed"], f"[{name}] requests relayed: {relayed}"
    if cfg.static_mode and cfg.pp > 1 and smp.pp_rank() == 1:
        # (Under tp a follower runs inline what its leader announces it ran inline.)
        inlined = dmodel.engine.runtime.server.executor.inlined
        if case.get("calls_back"):
            # Every request stage 1 serves calls back into stage 0 (T5's decoder, whole on
            # stage 1, looks up the shared embedding there): none runs straight through, so
            # nothing runs inline and the steps are not replayable (said, and run dynamic).
            st = dmodel.engine.runtime.replay_stats
            assert inlined == 0 and st is not None and st.not_replayable, (
                f"[{name}] stage 1 inlined {inlined}, replay stats {st}"
            )
        else:
            assert inlined > 0, f"[{name}] static mode served nothing on stage 1's main loop"
    if cfg.static_mode and cfg.pp > 1:
        # What static mode did per serving stage (for the mode table, docs/how-to/pipeline.md):
        # steps replayed, fallbacks, and why a stage's steps cannot be replayed (under tp only
        # the leaders replay; a follower runs inline what its leader ran inline).
        st = dmodel.engine.runtime.replay_stats
        got = smp.allgather(None if st is None else (st.replayed, st.fallbacks, st.not_replayable), smp.WORLD)
        if smp.rank() == 0:
            print(f"REPLAY {name} {got}", flush=True)
    if cfg.static_mode and cfg.pp > 1 and smp.pp_rank() > 0 and smp.tp_rank() == 0:
        # The same model and shapes every step: no fallback; each step after the first is
        # replayed ("replayed": every module a stage's requests run lives there), or the
        # stage says why it cannot be (a request whose module has a child on another stage).
        stats = dmodel.engine.runtime.replay_stats
        steps = case.get("steps", 3)
        assert stats is not None, f"[{name}] no replay stats"
        if case.get("chained"):
            # Except where fast_mode chains a ModuleList's loop: chains start on the second
            # step (the first shows the loop follows the chaining rule), so that step's
            # requests differ from the first's recording: one fallback, exact, naming the
            # chain; the third step replays the second.
            assert stats.fallbacks == 1 and "chain" in stats.reasons[0], f"[{name}] {stats}"
            assert stats.replayed == steps - 2, f"[{name}] stage {smp.pp_rank()}: {stats}"
        elif case.get("replayed"):
            assert stats.fallbacks == 0, f"[{name}] {stats}"
            assert stats.replayed == steps - 1, f"[{name}] stage {smp.pp_rank()}: {stats}"
        else:
            assert stats.fallbacks == 0, f"[{name}] {stats}"
            assert stats.replayed == steps - 1 or stats.not_replayable, f"[{name}] {stats}"
    if cfg.pipeline == "zero_bubble":
        # The split really ran on every stage that has a layer it knows: W tasks queued and
        # run, some in idle time. A stage with none (GPT-2's tensor-parallel blocks call
        # F.linear on their parameters) runs its backwards whole, warned about, and the
        # case says so (ZB-NOTHING-SPLIT): still bitwise equal to "interleaved".
        work = dmodel.engine.runtime.weight_grads
        assert work is not None, f"[{name}] zero_bubble without a weight-gradient queue"
        st, splits = work.stats, len(work.modules)
        assert st.total > 0 or not splits, f"[{name}] stage {smp.pp_rank()}: {splits} split layers, {st}"
        assert st.total == sum(st.deferred_ops.values()), f"[{name}] {st}"
        # (Under tensor parallelism a stage's followers start tasks in their leader's order
        # and hold their W tasks to the step's end or the memory bound: only the leaders'
        # pipeline has idle time to place them in.)
        split = smp.allgather((st.total, st.idle, st.eager, st.drained, splits), smp.WORLD)
        if smp.rank() == 0:  # (per rank: W tasks total, idle, eager, drained; split layers)
            print(f"WSPLIT {name} {split}", flush=True)
            if not any(w[0] for w in split):
                print(f"ZB-NOTHING-SPLIT {name}", flush=True)
        if any(w[0] for w in split):
            idle = sum(w[1] for w in split)
            assert idle > 0, f"[{name}] no W task ran in idle time: {split}"
        if case.get("w_eager") and smp.tp_rank() > 0:
            # A follower (its W tasks wait for the step's end) kept the memory bound
            # (active_microbatches): some ran eagerly, before a task started.
            assert st.eager > 0, f"[{name}] rank {smp.rank()}: no W task ran eagerly: {st}"
    if cfg.offload_activations:
        check_offloading(dmodel, cfg, case)
    if cfg.pp > 1:
        counts = smp.allgather(len(list(dmodel.parameters())), smp.PP_GROUP)
        assert all(counts), f"[{name}] a pipeline stage owns no parameter: {counts}"
    elapsed = time.perf_counter() - t0
    # The gathered state dict loads into the unwrapped module, strict.
    fresh = models.HF_MODELS[case["model"]]() if hf else models.build(case, False)
    fresh.load_state_dict(dmodel.state_dict(), strict=True)
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-RAN {name} ({elapsed:.1f}s)", flush=True)
    return trace


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(sys.argv[1])
    for case in cases:
        t0 = time.perf_counter()
        trace = run_case(case)
        vs = case.get("bitwise_vs")
        if vs:
            # The same configuration under the overrides (dynamic mode), in this job.
            other = {**case, "name": f"{case['name']}~vs", "config": {**case["config"], **vs}}
            check_bitwise(case["name"], vs, trace, run_case(other))
            smp.barrier()
        if smp.rank() == 0:
            bits = f", bitwise equal to {vs}" if vs else ""
            print(f"CASE-OK {case['name']} ({time.perf_counter() - t0:.1f}s{bits})", flush=True)


if __name__ == "__main__":
    main()
