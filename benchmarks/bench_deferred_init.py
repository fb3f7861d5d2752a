"""Memory and time of exact delayed initialisation on a ~100M-parameter Hugging Face Llama.

Run: python benchmarks/bench_deferred_init.py      (one process; ~1 minute)

Each measurement runs in a fresh child process, so ``ru_maxrss`` (the process's peak resident
memory) is its own:

- ``normal``: ``LlamaForCausalLM(config)`` on CPU, as a program without smp builds it;
- ``replay``: the same under ``smp.delay_param_initialization()``, then
  ``DeferredInit.replay`` of every parameter and buffer to a sink that drops each value (what
  a rank that keeps only a shard of everything does);
- ``replay-1/4``: the same, wanting only the first quarter of the decoder layers (a pipeline
  stage's share).

It prints the peak RSS growth of each step against the model's parameter bytes, the
replayer's own count of the bytes it held at once (``DeferredInit.peak_bytes``), and the
times. Hugging Face initialises every Linear in ``__init__`` and again in ``post_init``: the
replay allocates each weight only at its last full overwrite and frees it once handed over,
so it holds about one weight at a time, while every random op still runs (on scratch memory,
one at a time) so the numbers drawn are those of the full construction.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import time

import torch

CONFIG = dict(
    vocab_size=16000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=10,
    num_attention_heads=12,
    num_key_value_heads=12,
    tie_word_embeddings=False,
)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(kind: str, out: mp.Queue) -> None:
    import smp_torch as smp
    import transformers
    from smp_torch.deferred import DeferredInit

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(**CONFIG)
    # import the model's modules first (transformers loads them lazily), so RSS counts tensors
    tiny = dict(CONFIG, vocab_size=8, hidden_size=12, intermediate_size=8, num_hidden_layers=1)
    with smp.delay_param_initialization():
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny))
    torch.manual_seed(0)
    base = _rss_mib()
    t0 = time.perf_counter()
    if kind == "normal":
        model = transformers.LlamaForCausalLM(config)
        n = sum(p.numel() for p in model.parameters())
        out.put(
            {
                "kind": kind,
                "params": n,
                "bytes": n * 4,
                "rss_growth_mib": _rss_mib() - base,
                "seconds": time.perf_counter() - t0,
            }
        )
        return
    with smp.delay_param_initialization():
        model = transformers.LlamaForCausalLM(config)
    record_s = time.perf_counter() - t0
    after_record = _rss_mib()
    deferred = DeferredInit.of(model)
    names = None
    if kind == "replay-1/4":
        layers = CONFIG["num_hidden_layers"] // 4
        names = [
            n
            for n, _ in model.named_parameters()
            if any(n.startswith(f"model.layers.{i}.") for i in range(layers))
        ]
    targets = deferred.targets(model, names)
    wanted = sum(t.numel() * t.element_size() for t in targets.values())
    count = 0

    def sink(name: str, value: torch.Tensor) -> None:
        nonlocal count
        count += 1

    t1 = time.perf_counter()
    deferred.replay(targets, torch.device("cpu"), sink)
    out.put(
        {
            "kind": kind,
            "targets": count,
            "target_bytes": wanted,
            "record_rss_growth_mib": after_record - base,
            "record_s": record_s,
            "replay_rss_growth_mib": _rss_mib() - after_record,
            "replayer_peak_mib": deferred.peak_bytes / 2**20,
            "replay_s": time.perf_counter() - t1,
        }
    )


def main() -> None:
    ctx = mp.get_context("spawn")
    results = []
    for kind in ("normal", "replay", "replay-1/4"):
        q: mp.Queue = ctx.Queue()
        p = ctx.Process(target=_child, args=(kind, q))
        p.start()
        results.append(q.get(timeout=600))
        p.join()
    normal = results[0]
    mib = normal["bytes"] / 2**20
    print(f"model: {normal['params'] / 1e6:.1f}M parameters, {mib:.0f} MiB (fp32)")
    print(
        f"normal construction: peak RSS +{normal['rss_growth_mib']:.0f} MiB, "
        f"{normal['seconds']:.2f} s"
    )
    for r in results[1:]:
        print(
            f"{r['kind']}: {r['targets']} targets ({r['target_bytes'] / 2**20:.0f} MiB); "
            f"recording +{r['record_rss_growth_mib']:.0f} MiB in {r['record_s']:.2f} s; "
            f"replay peak RSS +{r['replay_rss_growth_mib']:.0f} MiB "
            f"({r['replay_rss_growth_mib'] / mib:.3f} x the parameter bytes), replayer held "
            f"at most {r['replayer_peak_mib']:.1f} MiB, {r['replay_s']:.2f} s"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
