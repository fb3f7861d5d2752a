"""Context parallelism (``context_parallel_degree`` 1, 2, 4) on one long sequence: step time,
tokens/s, the activation bytes each rank saves for backward, and the share of the step a rank
spends blocked on the attention's exchange (ring or all-to-all over heads).

Run: python benchmarks/bench_cp.py   (spawns `mpiexec -n 1`, `-n 2` (twice), `-n 4` of itself, in turn,
``BENCH_CP_ROUNDS`` = 2 times; ~4 minutes on a quiet 2-core machine (an estimate from the
smoke run), of which ~1.5 minutes per round is the jobs' start-up: importing
torch/transformers, smp.init, tracing the model)
Smoke: BENCH_CP_SEQS=256 BENCH_CP_ROUNDS=1 BENCH_CP_STEPS=2 python benchmarks/bench_cp.py

The model: transformers' ``LlamaForCausalLM`` built from a config (hidden ``HIDDEN``, 4 heads,
2 key/value heads, ``LAYERS`` layers, intermediate ``INTER``, vocabulary 256, no KV cache),
fp32, Adam; ``model(input_ids=x, labels=x).loss`` inside an ``@smp.step`` function, on a
global batch of ONE sequence of ``SEQ`` tokens (``BENCH_CP_SEQS``, default 1024 and 4096).
Every rank receives the whole sequence; smp keeps 1/cp of it per rank (activations split).
Four contenders:

- ``cp1``: one process, ``smp.init({})`` in a 1-rank job: the whole sequence, transformers'
  own attention (SDPA) — the baseline every ratio is against;
- ``cp2-ring`` / ``cp2-a2a``: ``context_parallel_degree`` 2 on 2 ranks with
  ``context_parallel_attention`` "ring" (smp-tp's ring attention) / "all_to_all" (one
  all-to-all over heads each way around SDPA; what the default "auto" picks here, since cp
  divides the 2 key/value heads);
- ``cp4-ring``: ``context_parallel_degree`` 4 on 4 ranks (2 key/value heads: only the ring
  applies). On a 2-core machine this job is OVERSUBSCRIBED (4 processes on 2 cores): its
  step times count two ranks per core and say little about cp=4 on 4 cores; its bytes are
  exact all the same.

smp's topology spans ``MPI.COMM_WORLD``, so each degree is a job of its own size (one per
contender, unlike ``bench_moe.py``'s single job): the jobs alternate round by round
(cp1, cp2-ring, cp2-a2a, cp4-ring, cp1, ...) so the machine's load falls on all alike, and the medians are over
every round's timed steps. Each job builds the model once per sequence length, runs
``WARMUP`` untimed and ``STEPS`` timed steps (a barrier before each, untimed), then one more
forward under ``saved_tensors_hooks``.

Per contender and sequence: the median step time; tokens/s = the global batch's tokens (one
sequence) / that time; the bytes of the distinct non-parameter tensors autograd saves for
backward in one forward, per rank (the largest rank's), and their ratio to cp1; and the
exchange share: ``smp_tp.layers.context._wait`` and ``_Ring.shift`` (the ring) and the
all-to-all over heads' ``all_to_all_rows`` are wrapped with timers during the timed steps,
and the share is (time blocked + time posting hops) / step time, averaged over the ranks (the worst rank in brackets; the detail lines also give
the blocked milliseconds per step). cp1 exchanges nothing: 0. For the ring, ``_wait`` is the
time a rank is BLOCKED on the k/v (forward and backward) and dk/dv (backward) hops, not the
transfers' total time: a hop is started before the block's math and mostly travels under it;
``shift`` is the time to post a hop (contiguous copies, ``batch_isend_irecv``). The
all-to-all is blocking: all of its time counts as blocked. The table at
the end puts the contenders side by side, each ratio against cp1 at the same length.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time

import workers  # (this folder)

HIDDEN = int(os.environ.get("BENCH_CP_HIDDEN", "256"))
INTER = int(os.environ.get("BENCH_CP_INTER", "512"))
LAYERS = int(os.environ.get("BENCH_CP_LAYERS", "2"))
SEQS = [int(s) for s in os.environ.get("BENCH_CP_SEQS", "1024,4096").split(",")]
WARMUP = int(os.environ.get("BENCH_CP_WARMUP", "1"))
STEPS = int(os.environ.get("BENCH_CP_STEPS", "3"))
ROUNDS = int(os.environ.get("BENCH_CP_ROUNDS", "2"))
VOCAB = 256
# (name, cp, context_parallel_attention): the ring at every degree, the all-to-all over heads
# where cp divides the 2 key/value heads (what smp's default "auto" picks there).
CONTENDERS = (("cp1", 1, "auto"), ("cp2-ring", 2, "ring"), ("cp2-a2a", 2, "all_to_all"), ("cp4-ring", 4, "ring"))
OVERSUBSCRIBED = {name for name, cp, _ in CONTENDERS if cp > (os.cpu_count() or 1)}


class _ExchangeClock:
    """Wall time inside the ring's ``_wait`` and ``_Ring.shift``, and inside the all-to-all
    over heads' exchanges, while ``on``."""

    def __init__(self) -> None:
        from smp_tp.layers import context, ulysses

        self.on = False
        self.wait_s = self.shift_s = 0.0
        wait, shift = context._wait, context._Ring.shift

        def timed_wait(works):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return wait(works)
            finally:
                if self.on:
                    self.wait_s += time.perf_counter() - t0

        def timed_shift(ring, tensors, tag):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return shift(ring, tensors, tag)
            finally:
                if self.on:
                    self.shift_s += time.perf_counter() - t0

        exchange = ulysses.all_to_all_rows

        def timed_exchange(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return exchange(*args, **kwargs)
            finally:
                if self.on:  # (a blocking all-to-all: all of it is the exchange)
                    self.wait_s += time.perf_counter() - t0

        # The attention functions look these up at call time: patched for this process.
        context._wait = timed_wait
        context._Ring.shift = timed_shift
        ulysses.all_to_all_rows = timed_exchange


def _worker(cp: int, attention: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import smp_torch as smp
    import torch
    from mpi4py import MPI
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    clock = _ExchangeClock()
    smp.init({"context_parallel_degree": cp, "context_parallel_attention": attention} if cp > 1 else {})
    assert smp.cp_size() == cp and smp.dp_size() == 1

    def measure(seq: int) -> dict:
        torch.manual_seed(0)
        net = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(SEQS),
            use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        ))  # fmt: skip
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(x: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=x, labels=x).loss
            model.backward(loss)
            return loss

        exchange: list[tuple[float, float]] = []

        def step(x: torch.Tensor) -> None:
            clock.wait_s = clock.shift_s = 0.0
            clock.on = True
            opt.zero_grad()
            train_step(x)
            opt.step()
            clock.on = False
            exchange.append((clock.wait_s, clock.shift_s))

        # The same global batch (one sequence) on every rank, as the user would feed it.
        x = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))
        timed = workers.timed_steps(functools.partial(step, x), WARMUP, STEPS, smp.barrier)
        wait_s = sum(w for w, _ in exchange[WARMUP:])
        shift_s = sum(s for _, s in exchange[WARMUP:])
        saved = smp.saved_activation_bytes(lambda: model(input_ids=x, labels=x).loss, model.parameters())
        step_s = sum(timed.times)
        per_rank = MPI.COMM_WORLD.gather((wait_s / step_s, shift_s / step_s, wait_s / STEPS, saved), root=0)
        return {
            "times": timed.times,
            "wait": [r[0] for r in per_rank or []],
            "shift": [r[1] for r in per_rank or []],
            "wait_per_step": [r[2] for r in per_rank or []],
            "saved": [r[3] for r in per_rank or []],
        }

    result: dict = {"rank": smp.rank(), "cp": cp, "load": " ".join(open("/proc/loadavg").read().split()[:3])}
    for seq in SEQS:
        result[str(seq)] = measure(seq)
    smp.barrier()
    return result


def _fmt_share(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):5.2f}% ({100 * max(values):5.2f}%)"


def main() -> None:
    label = {name: name + (" (oversubscribed)" if name in OVERSUBSCRIBED else "") for name, _, _ in CONTENDERS}
    cores = os.cpu_count()
    print(
        f"context parallelism (Llama {LAYERS} layers, hidden {HIDDEN}, 4 heads / 2 kv, inter {INTER}, "
        f"vocab {VOCAB}, fp32, Adam; global batch 1 sequence of {'/'.join(map(str, SEQS))} tokens; "
        f"{ROUNDS} rounds x {STEPS} timed steps after {WARMUP} warm-up; {cores} cores)",
        flush=True,
    )
    if OVERSUBSCRIBED:
        names = ", ".join(sorted(OVERSUBSCRIBED))
        print(f"  NOTE: {names} run(s) more processes than the {cores} cores here (oversubscribed): "
              "their step times share cores, their bytes are exact", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in CONTENDERS}
    for r in range(ROUNDS):
        for name, cp, _ in CONTENDERS:
            t0 = time.perf_counter()
            out = workers.run_self(__file__, cp, [name])
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if not lines:
                raise SystemExit(f"bench_cp: {name} printed no result:\n{out}")
            runs[name].append(json.loads(lines[0][7:]))
            print(f"  round {r + 1}/{ROUNDS} {label[name]}: job {time.perf_counter() - t0:.1f} s, "
                  f"load {runs[name][-1]['load']}", flush=True)
    rows = []
    for seq in SEQS:
        key = str(seq)
        for name, cp, _ in CONTENDERS:
            got = [run[key] for run in runs[name]]
            med = statistics.median([t for g in got for t in g["times"]])
            saved = max(b for g in got for b in g["saved"])
            wait = [statistics.mean(g["wait"][i] for g in got) for i in range(cp)]
            shift = [statistics.mean(g["shift"][i] for g in got) for i in range(cp)]
            share = [w + s for w, s in zip(wait, shift, strict=True)]
            blocked_ms = 1e3 * statistics.mean(w for g in got for w in g["wait_per_step"])
            rows.append((seq, name, cp, med, saved, share))
            print(
                f"  seq {seq:5d} {label[name]:<26} step {med * 1e3:8.1f} ms  {seq / med:8.0f} tokens/s  "
                f"saved {saved / 2**20:7.2f} MiB/rank  blocked in the exchange {_fmt_share(wait)} "
                f"= {blocked_ms:6.1f} ms/step  posting hops {_fmt_share(shift)}  "
                f"(mean over {cp} rank(s), worst in brackets)",
                flush=True,
            )
    print("\n  side by side (ratios against cp1 at the same sequence; exchange = blocked + posting, "
          "mean over ranks; * = oversubscribed):", flush=True)
    print(f"  {'seq':>5} {'contender':<10} {'ranks':>5} {'step ms':>9} {'tokens/s':>9} {'x cp1':>6} "
          f"{'saved MiB/rank':>14} {'x cp1':>6} {'exchange':>9}", flush=True)
    base = {seq: (med, saved) for seq, name, _, med, saved, _ in rows if name == "cp1"}
    for seq, name, cp, med, saved, share in rows:
        b_med, b_saved = base[seq]
        star = "*" if name in OVERSUBSCRIBED else ""
        print(f"  {seq:>5} {name + star:<10} {cp:>5} {med * 1e3:>9.1f} {seq / med:>9.0f} {b_med / med:>6.2f} "
              f"{saved / 2**20:>14.2f} {saved / b_saved:>6.3f} {100 * statistics.mean(share):>8.2f}%", flush=True)


if __name__ == "__main__":
    if not workers.serve_worker({name: functools.partial(_worker, cp, att) for name, cp, att in CONTENDERS}):
        main()
