"""Expert parallelism (ep=2) vs data parallelism with replicated experts, and grouped vs looped
expert compute, on a Mixtral-shaped stack.

Run: python benchmarks/bench_moe.py   (spawns `mpiexec -n 2` of itself three times; ~2 minutes)

The model: transformers' ``MixtralForCausalLM`` built from a config (``LAYERS`` layers,
hidden ``HIDDEN``, expert intermediate ``INTER``, ``EXPERTS`` experts, top-2, vocabulary 256),
Adam, fp32, ``BATCH`` sequences of ``SEQ`` tokens per rank, so the global batch is the same
for every contender. Five contenders on 2 processes:

- ``dp loop`` / ``dp grouped``: ``expert_parallel_degree`` 1 — every rank holds every expert
  and runs transformers' own experts (``experts_implementation`` "eager": a loop over the
  experts; "grouped_mm": one grouped matmul);
- ``ep2 loop`` / ``ep2 grouped``: ``expert_parallel_degree`` 2 — each rank holds half of the
  experts, tokens travel by all-to-all, the local experts run as a loop or as one grouped
  matmul (smp follows the model's ``experts_implementation``);
- ``ep2 grouped-cap1``: the same with ``expert_capacity_factor`` 1.0 (slots over an expert's
  capacity dropped: faster, not the same results).

Timing job: the five alternate round by round in one job (same machine load); the median
step time of each, tokens/s over both ranks, and the ratios ep2/dp (same compute) and
grouped/loop (same degree). The same job prints the bytes a rank holds in parameters +
gradients + Adam state and in expert parameters (from the tensors). Memory jobs: one per
degree, rank 0's peak RSS and its growth over the RSS before the model was built.
"""

from __future__ import annotations

import functools
import os
import resource
import statistics
import sys

import workers  # (this folder)

HIDDEN = int(os.environ.get("BENCH_MOE_HIDDEN", "256"))
INTER = int(os.environ.get("BENCH_MOE_INTER", "512"))
EXPERTS = int(os.environ.get("BENCH_MOE_EXPERTS", "8"))
LAYERS = int(os.environ.get("BENCH_MOE_LAYERS", "4"))
BATCH, SEQ, VOCAB = 4, 64, 256
WARMUP, STEPS, ROUNDS = 2, 4, 3
CONTENDERS = ("dp loop", "dp grouped", "ep2 loop", "ep2 grouped", "ep2 grouped-cap1")


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _worker(names: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import smp_torch as smp
    import torch
    import torch.nn.functional as F  # noqa: N812
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.set_num_threads(1)

    def build(name: str):  # type: ignore[no-untyped-def]
        degree, compute = name.split()
        ep = 2 if degree == "ep2" else 1
        capacity = {"expert_capacity_factor": 1.0} if compute.endswith("-cap1") else {}
        smp.init({"expert_parallel_degree": ep, "ddp": True, **capacity})
        torch.manual_seed(0)
        net = MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
            num_attention_heads=8, num_key_value_heads=2, num_local_experts=EXPERTS,
            num_experts_per_tok=2, max_position_embeddings=SEQ, use_cache=False,
            experts_implementation="grouped_mm" if compute.startswith("grouped") else "eager",
            pad_token_id=0, bos_token_id=0, eos_token_id=0,
        ))  # fmt: skip
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            model.backward(loss)
            return loss

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            train_step(x, y)
            opt.step()

        return step, model, opt.optimizer

    def held_bytes(model, opt) -> tuple[int, int]:  # type: ignore[no-untyped-def]
        total = experts = 0
        for key, p in model.named_parameters():
            size = sum(
                t.numel() * t.element_size()
                for t in [p, p.grad, *opt.state.get(p, {}).values()]
                if torch.is_tensor(t) and t.dim() > 0
            )
            total += size
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts += p.numel() * p.element_size()
        return total, experts

    base = _rss_kib()
    times: dict[str, list[float]] = {n: [] for n in names}
    held: dict[str, tuple[int, int]] = {}
    from mpi4py import MPI

    g = torch.Generator().manual_seed(1 + MPI.COMM_WORLD.Get_rank())  # each rank its own samples
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for _ in range(ROUNDS if len(names) > 1 else 1):
        for name in names:
            step, model, opt = build(name)
            times[name] += workers.timed_steps(functools.partial(step, x, y), WARMUP, STEPS, smp.barrier).times
            held[name] = held_bytes(model, opt)
            del step, model, opt
    if smp.rank() != 0:
        return
    if len(names) == 1:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"MEM {names[0].split()[0]} {peak} {peak - base}", flush=True)
        return
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    med = {n: statistics.median(times[n]) for n in names}
    tokens = 2 * BATCH * SEQ
    print(
        f"moe (Mixtral {LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts x {INTER}, top-2, "
        f"{BATCH}x{SEQ} tokens per rank, Adam, 2 ranks, load {load}):",
        flush=True,
    )
    for n in names:
        print(f"  {n:<17} step {med[n] * 1e3:7.1f} ms  {tokens / med[n]:8.0f} tokens/s", flush=True)
    for compute in ("loop", "grouped"):
        r = med[f"dp {compute}"] / med[f"ep2 {compute}"]
        print(f"  tokens/s ratio ep2/dp ({compute}): {r:.3f}", flush=True)
    for degree in ("dp", "ep2"):
        r = med[f"{degree} loop"] / med[f"{degree} grouped"]
        print(f"  tokens/s ratio grouped/loop ({degree}): {r:.3f}", flush=True)
    r = med["ep2 grouped"] / med["ep2 grouped-cap1"]
    print(f"  tokens/s ratio capacity factor 1.0 / no drops (ep2 grouped; changes results): {r:.3f}", flush=True)
    (dp_all, dp_exp), (ep_all, ep_exp) = held["dp loop"], held["ep2 loop"]
    print(
        f"  bytes per rank (parameters + gradients + Adam state): dp {dp_all / 2**20:.1f} MiB, "
        f"ep2 {ep_all / 2**20:.1f} MiB (ratio {ep_all / dp_all:.3f}); expert parameters held: "
        f"{ep_exp / dp_exp:.3f} of all at ep2",
        flush=True,
    )


def main() -> None:
    print(workers.run_self(__file__, 2, list(CONTENDERS)), end="", flush=True)
    mem = workers.peak_rss(__file__, 2, [["dp loop"], ["ep2 loop"]])
    ratio = mem["ep2"][1] / mem["dp"][1]
    print(workers.rss_summary(mem, ("dp", "ep2")) + f"; growth ratio ep2/dp {ratio:.3f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        main()
