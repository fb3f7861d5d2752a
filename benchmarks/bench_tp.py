"""smp-tp benchmark: parameter bytes per TP rank of GPT-2 and Llama configurations (vocabulary-
parallel embeddings and heads included), activation memory of optimize="memory" (with and
without its selective recomputation) vs "speed", and throughput of
tensor parallelism across data-parallel ranks (scaled batch) vs Megatron-style (prescaled)
on an embedding-heavy recommendation model; and tokens/s of a Llama-shaped decoder stack at
tp=2 with smp-tp's Llama mapping against PyTorch's own tensor parallelism
(``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` plans) on the same model.

Run as ``python benchmarks/bench_tp.py``: it launches itself under torch.distributed.run
with 2 and then 4 CPU processes (gloo) and prints one line of ratios per measurement.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

WORKER_FLAG = "--worker"


# ----------------------------------------------------------------------------- worker


def saved_activation_bytes(model, x) -> int:
    """Bytes of distinct storages autograd saves for backward during one forward,
    parameters excluded (they are not activations)."""
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return sum(seen.values())


ROUNDS = 41  # interleaved timing rounds of the layer variants


def timed_rounds(layers: dict, x, barrier) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Time one forward + backward of every layer in ``layers`` per round, interleaved over
    :data:`ROUNDS` rounds (the machine is shared): the times per layer, and per layer the
    median over rounds of its time / the ``"speed"`` layer's in the same round (pairs see the
    same load, so the ratio drifts less than either time)."""
    rounds: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(ROUNDS):
        for name, layer in layers.items():
            barrier()
            t0 = time.perf_counter()
            layer(x).sum().backward()
            rounds[name].append(time.perf_counter() - t0)
    paired = {}
    for name, ts in rounds.items():
        ratios = sorted(a / b for a, b in zip(ts, rounds["speed"]))
        paired[name] = ratios[len(ratios) // 2]
    return rounds, paired


def bench_memory(rank: int, tp: int) -> None:
    import smp_tp
    import torch
    import torch.distributed as dist

    cfg = dict(num_attention_heads=8, attention_head_size=32, hidden_size=256, intermediate_size=1024,
               attention_dropout_prob=0.1, hidden_dropout_prob=0.1)
    singles = [dist.new_group([r]) for r in range(tp)]  # every rank creates every group
    try:  # smp-comm's backend: what smp-torch's groups use with collective_backend="smp"
        import smp_comm.torch_backend  # noqa: F401

        smp_group = dist.new_group(backend="smp")
    except ImportError:
        smp_group = None
    variants = {  # name: (optimize, recompute (activations for memory, attention for speed), group, sp,
        #                    recompute_mlp_activation)
        "speed": ("speed", False, None, False, False),
        "speed_recompute": ("speed", True, None, False, False),  # selective: the attention core only
        "speed_sp": ("speed", False, None, True, False),  # sequence parallel
        "speed_sp_recompute": ("speed", True, None, True, False),
        "speed_sp_recompute_mlp": ("speed", True, None, True, True),  # + the MLP activation function
        "memory": ("memory", True, None, False, False),
        "memory_norecompute": ("memory", False, None, False, False),
        "single": ("speed", False, singles[rank], False, False),  # no TP: one device on its own samples
    }

    def build(optimize: str, recompute: bool, group: object, sp: bool,
              mlp: bool) -> smp_tp.DistributedTransformerLayer:
        torch.manual_seed(0)
        switch = ({"recompute_activations": recompute} if optimize == "memory"
                  else {"recompute_attention": recompute, "sequence_parallel": sp, "recompute_mlp_activation": mlp})
        return smp_tp.DistributedTransformerLayer(**cfg, optimize=optimize, tp_group=group, **switch)

    for seq in (128, 32):
        result = {}
        for name, variant in variants.items():
            layer = build(*variant)
            x = torch.randn(4, seq, 256, requires_grad=True)  # this rank's own samples
            result[name] = saved_activation_bytes(layer, x)
        times = {}
        if seq == 128:  # what recomputation costs: one fwd+bwd of the layer, best of ROUNDS
            names = ("memory", "memory_norecompute", "speed", "speed_recompute", "speed_sp", "speed_sp_recompute",
                     "speed_sp_recompute_mlp")
            layers = {name: build(*variants[name]) for name in names}
            x = torch.randn(4, seq, 256, requires_grad=True)
            # best of each, and the median paired ratio to speed (timed_rounds)
            rounds, paired = timed_rounds(layers, x, dist.barrier)
            times = {name: min(ts) for name, ts in rounds.items()}
            times.update({f"{name}_paired": ratio for name, ratio in paired.items()})
        if seq == 128 and smp_group is not None:  # the same timing, tp group on smp-comm
            names = ("speed", "speed_sp", "speed_sp_recompute", "speed_sp_recompute_mlp")
            on_smp = {name: build(variants[name][0], variants[name][1], smp_group, *variants[name][3:])
                      for name in names}
            rounds, paired = timed_rounds(on_smp, x, dist.barrier)
            if rank == 0:
                print(f"RESULT smptime{seq} tp={tp} speed_ms={min(rounds['speed']) * 1e3:.1f} "
                      + " ".join(f"{name}_paired={ratio:.3f}" for name, ratio in paired.items()),
                      flush=True)
        if rank == 0:
            if times:
                print(f"RESULT time{seq} tp={tp} recompute_ms={times['memory'] * 1e3:.1f} "
                      f"stored_ms={times['memory_norecompute'] * 1e3:.1f} "
                      f"speed_ms={times['speed'] * 1e3:.1f} "
                      f"speed_recompute_ms={times['speed_recompute'] * 1e3:.1f} "
                      f"sp_ms={times['speed_sp'] * 1e3:.1f} "
                      f"sp_recompute_ms={times['speed_sp_recompute'] * 1e3:.1f} "
                      f"sp_recompute_mlp_ms={times['speed_sp_recompute_mlp'] * 1e3:.1f} "
                      f"speed_recompute_paired={times['speed_recompute_paired']:.3f} "
                      f"sp_paired={times['speed_sp_paired']:.3f} "
                      f"sp_recompute_paired={times['speed_sp_recompute_paired']:.3f} "
                      f"sp_recompute_mlp_paired={times['speed_sp_recompute_mlp_paired']:.3f}", flush=True)
            print(f"RESULT memory{seq} tp={tp} speed_MiB={result['speed'] / 2**20:.2f} "
                  f"memory_MiB={result['memory'] / 2**20:.2f} "
                  f"ratio={result['memory'] / result['speed']:.3f} "
                  f"norecompute_MiB={result['memory_norecompute'] / 2**20:.2f} "
                  f"norecompute_ratio={result['memory_norecompute'] / result['speed']:.3f} "
                  f"speedrc_MiB={result['speed_recompute'] / 2**20:.2f} "
                  f"speedrc_ratio={result['speed_recompute'] / result['speed']:.3f} "
                  f"sp_MiB={result['speed_sp'] / 2**20:.2f} "
                  f"sp_ratio={result['speed_sp'] / result['speed']:.3f} "
                  f"sprc_MiB={result['speed_sp_recompute'] / 2**20:.2f} "
                  f"sprc_ratio={result['speed_sp_recompute'] / result['speed']:.3f} "
                  f"sprcmlp_MiB={result['speed_sp_recompute_mlp'] / 2**20:.2f} "
                  f"sprcmlp_ratio={result['speed_sp_recompute_mlp'] / result['speed']:.3f} "
                  f"single_MiB={result['single'] / 2**20:.2f}", flush=True)


def bench_throughput(rank: int, tp: int) -> None:
    import smp_tp
    import torch
    import torch.distributed as dist
    from torch import nn

    vocab, dim, ids_per_sample, global_batch = 400_000, 64, 16, 512

    class Recommender(nn.Module):
        """A big sparse-gradient embedding table (tensor parallel) and a small MLP (replicated)."""

        def __init__(self) -> None:
            super().__init__()
            with smp_tp.tensor_parallelism():
                self.table = nn.Embedding(vocab, dim, sparse=True)
            self.mlp = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                     nn.Linear(256, 1))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.table(ids).sum(1)).squeeze(-1)

    steps_for = {}
    for prescaled in (False, True):
        torch.manual_seed(0)
        model = smp_tp.parallelize(Recommender(), prescaled_batch=prescaled)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        local = global_batch if prescaled else global_batch // tp  # equal global batch
        gen = torch.Generator().manual_seed(1 if prescaled else 1 + rank)
        ids = torch.randint(0, vocab, (local, ids_per_sample), generator=gen)
        target = torch.rand(local, generator=gen)

        def step(model=model, opt=opt, ids=ids, target=target) -> None:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(ids), target)
            loss.backward()
            smp_tp.sync_gradients(model)
            opt.step()

        step()
        steps_for[prescaled] = step
    # Interleave the two modes and keep each one's best round: the machine is shared.
    best = {False: float("inf"), True: float("inf")}
    for _ in range(5):
        for prescaled in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(4):
                steps_for[prescaled]()
            dist.barrier()
            best[prescaled] = min(best[prescaled], (time.perf_counter() - t0) / 4)
    rates = {k: global_batch / v for k, v in best.items()}
    if rank == 0:
        print(f"RESULT throughput tp={tp} scaled_samples_per_s={rates[False]:.0f} "
              f"prescaled_samples_per_s={rates[True]:.0f} ratio={rates[False] / rates[True]:.2f}",
              flush=True)


LLAMA_STACK = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4,
                   vocab_size=32, max_position_embeddings=128, attn_implementation="sdpa", use_cache=False)
LLAMA_LAYERS, LLAMA_SEQ, LLAMA_BATCH = 2, 64, 8  # global batch: 8 x 64 tokens per step

# PyTorch's Megatron plan for one decoder layer (what torchtitan and HF's tp_plan use)
TORCH_PLAN = {**{f"self_attn.{n}_proj": "colwise" for n in "qkv"}, "self_attn.o_proj": "rowwise",
              "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def bench_llama(rank: int, tp: int) -> None:
    """Tokens/s of a Llama decoder stack (fwd + bwd + SGD step): smp-tp (both batch modes)
    vs ``torch.distributed.tensor.parallel`` on the same weights, interleaved in one run."""
    import smp_tp
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**LLAMA_STACK)

    class Stack(nn.Module):
        """Decoder layers only (no embedding or head): the part both libraries split."""

        def __init__(self) -> None:
            super().__init__()
            self.rotary = LlamaRotaryEmbedding(cfg)
            self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(LLAMA_LAYERS))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(h.shape[1])[None]
            cos_sin = self.rotary(h, pos)
            for layer in self.layers:  # attention_mask=None: sdpa's causal kernel
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
            return h

    def nbytes(model: nn.Module) -> int:
        local = [getattr(p, "_local_tensor", p) for p in model.parameters()]  # DTensor: own shard
        return sum(t.numel() * t.element_size() for t in local)

    torch.manual_seed(0)
    reference = Stack()
    full = nbytes(reference)
    steps, sizes = {}, {}
    for name in ("torch", "smp_prescaled", "smp_scaled"):
        model = Stack()
        model.load_state_dict(reference.state_dict())
        if name == "torch":
            mesh = init_device_mesh("cpu", (tp,))
            kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            for layer in model.layers:
                parallelize_module(layer, mesh, {k: kinds[v]() for k, v in TORCH_PLAN.items()})
        else:
            smp_tp.set_tensor_parallelism(model.layers)
            smp_tp.parallelize(model, prescaled_batch=name == "smp_prescaled")
        sizes[name] = nbytes(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaled = name == "smp_scaled"  # own samples: the TP group's batch is the global batch
        gen = torch.Generator().manual_seed(1 + (rank if scaled else 0))
        x = torch.randn(LLAMA_BATCH // tp if scaled else LLAMA_BATCH, LLAMA_SEQ, cfg.hidden_size, generator=gen)

        def step(model=model, opt=opt, x=x, smp=name != "torch") -> None:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            if smp:
                smp_tp.sync_gradients(model)
            opt.step()

        step()
        steps[name] = step
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(5):  # interleaved rounds, best of each: the machine is shared
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(2):
                step()
            dist.barrier()
            best[name] = min(best[name], (time.perf_counter() - t0) / 2)
    tok = {k: LLAMA_BATCH * LLAMA_SEQ / v for k, v in best.items()}
    if rank == 0:
        print(f"RESULT llama tp={tp} torch_tok_s={tok['torch']:.0f} smp_prescaled_tok_s={tok['smp_prescaled']:.0f} "
              f"smp_scaled_tok_s={tok['smp_scaled']:.0f} ratio={tok['smp_prescaled'] / tok['torch']:.2f} "
              f"scaled_ratio={tok['smp_scaled'] / tok['torch']:.2f} full_MiB={full / 2**20:.2f} "
              f"smp_rank_MiB={sizes['smp_prescaled'] / 2**20:.2f} torch_rank_MiB={sizes['torch'] / 2**20:.2f}",
              flush=True)


PARAM_MODELS = {  # name: (family, config); built on the meta device (shapes only, no memory)
    "gpt2-small-124M": ("gpt2", {}),  # GPT2Config() is GPT-2 small: 12 x 768, vocab 50257 (tied)
    "llama-small-tied": ("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                       num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                                       tie_word_embeddings=True)),
    "llama-3.2-1B-shape": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         tie_word_embeddings=True)),
}


def bench_params(rank: int, tp: int) -> None:
    """Parameter bytes per TP rank vs the unwrapped model, embeddings and head included."""
    import warnings

    import smp_tp
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def nbytes(model) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once

    for name, (family, cfg) in PARAM_MODELS.items():
        with torch.device("meta"):
            model = (GPT2LMHeadModel(GPT2Config(**cfg)) if family == "gpt2"
                     else LlamaForCausalLM(LlamaConfig(**cfg)))
        full = nbytes(model)
        smp_tp.set_tensor_parallelism(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            smp_tp.parallelize(model)
        left = [str(w.message) for w in caught if "left unreplaced" in str(w.message)]
        local = nbytes(model)
        if rank == 0:
            print(f"RESULT params_{name} tp={tp} full_MiB={full / 2**20:.1f} "
                  f"rank_MiB={local / 2**20:.1f} ratio={local / full:.3f} unreplaced={len(left)}",
                  flush=True)


def worker() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    only = os.environ.get("SMP_BENCH_TP_ONLY", "")
    if not only or only == "params":
        bench_params(rank, tp)
    if not only or only == "memory":
        bench_memory(rank, tp)
    if not only or only == "throughput":
        bench_throughput(rank, tp)
    if (not only or only == "llama") and tp == 2:  # the comparison is at tp=2
        bench_llama(rank, tp)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    """``python benchmarks/bench_tp.py [params|memory|throughput|llama]`` (default: all)."""
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    results: dict[str, dict[int, dict[str, str]]] = {
        "memory128": {}, "memory32": {}, "time128": {}, "smptime128": {}, "throughput": {}, "llama": {},
        **{f"params_{name}": {} for name in PARAM_MODELS}}
    for tp in ((2,) if only == "llama" else (2, 4)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
               "--master-addr", "127.0.0.1", "--master-port", str(_port()), __file__, WORKER_FLAG]
        env = dict(os.environ, OMP_NUM_THREADS="1", SMP_BENCH_TP_ONLY=only)
        # own process group: a timeout kills the workers too, not only the launcher
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            sys.exit(f"bench_tp: tp={tp} timed out after 300 s:\n{stdout}\n{stderr}")
        if proc.returncode != 0:
            sys.exit(f"bench_tp: tp={tp} failed:\n{stdout}\n{stderr}")
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                kind, *fields = line.split()[1:]
                values = dict(f.split("=") for f in fields)
                results[kind][int(values.pop("tp"))] = values
    if not only or only == "params":
        print("parameter bytes per TP rank / unwrapped model (embeddings and head included; "
              "vocabulary-parallel tied embedding, Megatron blocks): " + " | ".join(
                  f"{name}: " + ", ".join(
                      f"tp={tp} {r['ratio']} ({r['rank_MiB']} of {r['full_MiB']} MiB"
                      + (f", {r['unreplaced']} modules left unreplaced" if r["unreplaced"] != "0" else "")
                      + ")" for tp, r in sorted(results[f"params_{name}"].items()))
                  for name in PARAM_MODELS))
    if not only or only == "llama":
        r = results["llama"][2]
        print(f"Llama decoder stack ({LLAMA_LAYERS} layers, hidden {LLAMA_STACK['hidden_size']}, "
              f"GQA {LLAMA_STACK['num_attention_heads']}/{LLAMA_STACK['num_key_value_heads']}, "
              f"{LLAMA_BATCH}x{LLAMA_SEQ} tokens per step, fwd+bwd+SGD) tokens/s at tp=2, smp-tp / "
              f"torch parallelize_module (Colwise/Rowwise): prescaled {r['ratio']}x "
              f"({r['smp_prescaled_tok_s']} vs {r['torch_tok_s']}), scaled batch {r['scaled_ratio']}x "
              f"({r['smp_scaled_tok_s']}); parameter bytes per rank: smp-tp {r['smp_rank_MiB']}, "
              f"torch {r['torch_rank_MiB']} of {r['full_MiB']} MiB")
    if only in ("params", "llama"):
        return
    parts = []
    for seq in (128, 32):
        mem = results[f"memory{seq}"]
        parts.append(f"seq={seq}: " + ", ".join(
            f"tp={tp} {mem[tp]['ratio']} ({mem[tp]['memory_MiB']} vs {mem[tp]['speed_MiB']} MiB; "
            f"without recompute {mem[tp]['norecompute_ratio']}, {mem[tp]['norecompute_MiB']} MiB; "
            f"speed with recompute_attention {mem[tp]['speedrc_ratio']}, {mem[tp]['speedrc_MiB']} MiB; "
            f"speed sequence_parallel {mem[tp]['sp_ratio']}, {mem[tp]['sp_MiB']} MiB; "
            f"sequence_parallel + recompute_attention {mem[tp]['sprc_ratio']}, {mem[tp]['sprc_MiB']} MiB; "
            f"+ recompute_mlp_activation {mem[tp]['sprcmlp_ratio']}, {mem[tp]['sprcmlp_MiB']} MiB)"
            for tp in sorted(mem)) + f"; no-TP device on its own samples {mem[2]['single_MiB']} MiB")
    print("saved activations per rank of one transformer layer, memory (recompute_activations=True)"
          "/speed: " + " | ".join(parts))
    tm = results["time128"]

    def vs_speed(r: dict[str, str], key: str) -> str:  # the median paired ratio, as a change
        return f"{float(r[key + '_paired']) - 1:+.1%}"

    print(f"one layer fwd+bwd, seq=128, with / without recomputation (best of {ROUNDS} interleaved "
          "rounds; in brackets the median over rounds of time / speed's time in the same round): "
          + ", ".join(
              f"tp={tp} memory {tm[tp]['recompute_ms']} vs {tm[tp]['stored_ms']} ms, speed "
              f"{tm[tp]['speed_ms']} ms, + recompute_attention {tm[tp]['speed_recompute_ms']} ms "
              f"({vs_speed(tm[tp], 'speed_recompute')}), sequence_parallel {tm[tp]['sp_ms']} ms "
              f"({vs_speed(tm[tp], 'sp')}), + recompute_attention {tm[tp]['sp_recompute_ms']} ms "
              f"({vs_speed(tm[tp], 'sp_recompute')}), + recompute_mlp_activation "
              f"{tm[tp]['sp_recompute_mlp_ms']} ms ({vs_speed(tm[tp], 'sp_recompute_mlp')})"
              for tp in sorted(tm)))
    mem = results["memory128"]
    print("issue 18, saved activations per rank at seq=128 / the speed layout's, and time / speed "
          "(median paired ratio): "
          + ", ".join(f"tp={tp} sequence_parallel + recompute_attention {mem[tp]['sprc_ratio']} "
                      f"(target <= 0.55), + recompute_mlp_activation {mem[tp]['sprcmlp_ratio']} "
                      f"(target <= 0.40) at {vs_speed(tm[tp], 'sp_recompute_mlp')} time (target <= +10%)"
                      for tp in sorted(mem)))
    st = results["smptime128"]
    if st:
        print("the same, tensor-parallel group on smp-comm's backend (smp-torch's collective_backend='smp'), "
              "time / speed (median paired ratio): " + ", ".join(
                  f"tp={tp} speed {r['speed_ms']} ms, sequence_parallel {vs_speed(r, 'speed_sp')}, "
                  f"+ recompute_attention {vs_speed(r, 'speed_sp_recompute')}, + recompute_mlp_activation "
                  f"{vs_speed(r, 'speed_sp_recompute_mlp')} (target <= +10%)" for tp, r in sorted(st.items())))
    thr = results["throughput"]
    if thr:
        print("recommendation model samples/s, scaled-batch TP / prescaled TP (equal global batch): "
              + ", ".join(f"tp={tp}: {thr[tp]['ratio']}x ({thr[tp]['scaled_samples_per_s']} vs "
                          f"{thr[tp]['prescaled_samples_per_s']})" for tp in sorted(thr)))


if __name__ == "__main__":
    if WORKER_FLAG in sys.argv:
        worker()
    else:
        main()
