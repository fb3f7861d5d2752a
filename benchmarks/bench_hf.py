"""A Hugging Face model as users write it, pipelined over 2 CPU processes: smp with
``fast_mode``'s ModuleList chains (the default) and without them, vs one process.

Run: python benchmarks/bench_hf.py      (spawns the workers itself; ~1-2 minutes)

The model is ``transformers``' ``GPT2LMHeadModel`` (``BENCH_HF_MODEL=llama``:
``LlamaForCausalLM``) built from a config (no download): its
blocks sit in an ``nn.ModuleList`` that the model's own ``forward`` loops over, so smp
cannot plan them like an ``nn.Sequential``; ``fast_mode`` chains them instead (one request
per stage and microbatch once the first step saw the loop, smp-pipeline's ``chains.py``).
Every process uses one thread, so two processes have twice the compute of one. Runs of
these kinds alternate (best of ``BENCH_HF_ROUNDS`` runs, each the median of its steps):

- one process on the whole batch (the baseline of every ratio);
- one process accumulating the same 8 microbatches, and from it the *ceiling* of a balanced
  two-stage pipeline with no overhead (2 x 8/9 of that rate);
- smp, ``pipeline_parallel_degree=2``, automatic partition, 8 microbatches: chains on (the
  default ``fast_mode``) and off (``fast_mode=False``: one request per block, per
  microbatch, forward and backward).

Not run here: ``torch.distributed.pipelining`` (it needs the model rewritten or traced into
stages, which is what this benchmark's users do not do; ``bench_sequential.py`` and
``bench_gpt.py`` compare with it on models it can split). Multi-process runs use
``mpiexec -bind-to core`` (``BENCH_HF_BIND=""`` turns it off).
"""

from __future__ import annotations

import os
import statistics

import workers  # (this folder)

# layers, width, heads, tokens per sample, samples per step, microbatches
SHAPE = os.environ.get("BENCH_HF_SHAPE", "8,128,4,64,32,8")
LAYERS, WIDTH, HEADS, SEQ, BATCH, MB = (int(v) for v in SHAPE.split(","))
VOCAB = 512
MODEL = os.environ.get("BENCH_HF_MODEL", "gpt2")  # or "llama" (LlamaForCausalLM)
BLOCKS = "model.layers" if MODEL == "llama" else "transformer.h"
WARMUP, STEPS = 2, 6
ROUNDS = int(os.environ.get("BENCH_HF_ROUNDS", "3"))
BIND = os.environ.get("BENCH_HF_BIND", "core")


def _setup():  # type: ignore[no-untyped-def]
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if MODEL == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS,
            num_key_value_heads=HEADS, intermediate_size=4 * WIDTH, vocab_size=VOCAB,
            max_position_embeddings=SEQ, use_cache=False,
        ))  # fmt: skip
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(
            n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=SEQ, vocab_size=VOCAB,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        ))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return torch, model, ids


def _tokens_per_s(times: list[float]) -> float:
    return BATCH * SEQ / statistics.median(times)


def single(microbatches: int = 1) -> dict:
    torch, model, ids = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def run() -> None:
        opt.zero_grad()
        for chunk in ids.chunk(microbatches):
            (model(chunk, labels=chunk).loss / microbatches).backward()
        opt.step()

    return {"rate": _tokens_per_s(workers.timed_steps(run, WARMUP, STEPS).times)}


def smp_pp2(fast: bool) -> dict:
    torch, model, ids = _setup()
    import smp_torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MB, "fast_mode": fast})
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(dmodel.parameters(), lr=1e-3))

    @smp.step
    def train_step(x):  # type: ignore[no-untyped-def]
        loss = dmodel(x, labels=x).loss
        dmodel.backward(loss)
        return loss

    def run() -> None:
        opt.zero_grad()
        train_step(ids)
        opt.step()

    times = workers.timed_steps(run, WARMUP, STEPS, smp.barrier).times
    rt = dmodel.engine.runtime
    served = smp.allgather(rt.requests_served, smp.PP_GROUP)[1]
    on_1 = sum(1 for i in range(LAYERS) if rt.assignment[f"{BLOCKS}.{i}"] == 1)
    chains = rt._dispatch.chains
    return {
        "rate": _tokens_per_s(times), "rank": smp.rank(), "blocks_on_1": on_1,
        "requests_per_mb": served / ((WARMUP + STEPS) * MB),
        "hits": 0 if chains is None else chains.hits,
        "misses": 0 if chains is None else chains.misses,
    }  # fmt: skip


def _launch(kind: str, nprocs: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("SMP_CONFIG", None)
    return workers.launch(__file__, kind, nprocs, env, BIND, timeout=900)


def main() -> None:
    if workers.serve_worker({
        "single": single,
        "accum": lambda: single(MB),
        "chained": lambda: smp_pp2(True),
        "unchained": lambda: smp_pp2(False),
    }):  # fmt: skip
        return
    best: dict[str, float] = {}
    info: dict[str, dict] = {}
    for _ in range(ROUNDS):
        for kind, n in (("single", 1), ("accum", 1), ("chained", 2), ("unchained", 2)):
            r = _launch(kind, n)
            if r["rate"] > best.get(kind, 0.0):
                best[kind], info[kind] = r["rate"], r
    one = best["single"]
    ceiling = 2 * MB / (MB + 1) * best["accum"] / one
    on, off = best["chained"], best["unchained"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"bench_hf (load avg {load:.1f} on {os.cpu_count()} cores, bind {BIND or 'none'}): "
        f"HF {'LlamaForCausalLM' if MODEL == 'llama' else 'GPT2LMHeadModel'}, {LAYERS} blocks of width {WIDTH}, {BATCH} x {SEQ} tokens, {MB} "
        f"microbatches, 1 thread/process: one process {one:,.0f} tokens/s; ceiling "
        f"{ceiling:.2f}x; smp pp=2 chained (default) {on / one:.2f}x one process "
        f"({on / (ceiling * one):.0%} of the ceiling; {info['chained']['requests_per_mb']:.1f} "
        f"requests/microbatch on stage 1 over all steps, "
        f"{info['chained']['blocks_on_1']} blocks there; {info['chained']['hits']} chain hits, "
        f"{info['chained']['misses']} misses), unchained (fast_mode=False) {off / one:.2f}x "
        f"({info['unchained']['requests_per_mb']:.1f} requests/microbatch); chained/unchained "
        f"{on / off:.2f}x",
        flush=True,
    )


if __name__ == "__main__":
    main()
