"""A model that does not fit one rank: a ~0.66 B-parameter Hugging Face Llama trained on
4 CPU processes under delayed initialization (issue 42's acceptance figure).

Run: python benchmarks/bench_big_model.py   (~5-10 minutes on 2 cores, ~12 GiB of memory)

The model (fp32 parameters 2.65 GB) is built under ``smp.delay_param_initialization()`` and
trained 2 SGD steps at ``pipeline_parallel_degree=4`` (with the default deterministic
accumulation, and without: ``pp4-stream``) and, separately, at
``sharded_data_parallel_degree=4``; one process then builds it normally from the same seed
and accumulates the same microbatches. Printed per configuration: each rank's peak RSS growth
(``/proc/self/status`` VmHWM after a reset at the start, over the RSS then) as a ratio of the
model's fp32 parameter bytes — the budget is 0.75, so no rank could hold the whole model —
and the largest relative difference of the losses from the one process's.

``BENCH_BIG_SIZE`` (a JSON object of LlamaConfig fields) overrides the model's size,
``BENCH_BIG_MODES`` (comma-separated) the configurations run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "packages", "smp-torch", "tests", "scripts", "big_model.py")
# 22 layers of 1024 (MLP 8192) and an 8000-token vocabulary, untied: 0.663 B parameters,
# 2.65 GB in fp32. Many narrow layers keep a shard unit (one layer, 4.4 % of the model) small
# beside the budget; MLP weights of 32 MiB are above glibc's largest mmap threshold, so a freed
# one goes back to the system instead of fragmenting the heap.
SIZE = {
    "hidden_size": 1024,
    "intermediate_size": 8192,
    "num_hidden_layers": 22,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 8000,
}
BUDGET = 0.75


def _run(cmd: list[str]) -> dict:
    # A fixed trim threshold stops glibc from keeping freed tensors in its heaps (see
    # packages/smp-torch/tests/test_big_model.py); BENCH_BIG_MALLOC=default measures without.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SMP_CONFIG": ""}
    if os.environ.get("BENCH_BIG_MALLOC") != "default":
        env["MALLOC_TRIM_THRESHOLD_"] = str(1 << 20)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BIG-RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    out = json.loads(lines[-1][len("BIG-RESULT ") :])
    out["wall_s"] = wall
    return out


def main() -> None:
    from smp_comm.testing import mpiexec_path

    size = json.loads(os.environ.get("BENCH_BIG_SIZE", json.dumps(SIZE)))
    print(f"bench_big_model: Llama {size}", flush=True)
    modes = os.environ.get("BENCH_BIG_MODES", "pp4,pp4-stream,sdp4").split(",")
    for mode in modes:
        got = _run([mpiexec_path(), "-n", "4", sys.executable, SCRIPT, json.dumps(size), mode])
        ref = _run([sys.executable, SCRIPT, json.dumps(size), mode, "reference"])
        total = got["param_bytes"]
        print(f"  {mode}: model fp32 parameters {total / 2**30:.2f} GiB; 4 ranks took {got['wall_s']:.0f} s", flush=True)
        worst = 0.0
        for row in got["ranks"]:
            ratio = row["peak_growth"] / total
            worst = max(worst, ratio)
            print(
                f"    rank {row['rank']}: peak RSS growth {row['peak_growth'] / 2**30:.2f} GiB = "
                f"{ratio:.3f}x the model (budget {BUDGET}); parameters held "
                f"{row['param_bytes_held'] / total:.3f}x; most microbatch gradient buffers at once "
                f"{row['peak_microbatch_buffers']}",
                flush=True,
            )
        diffs = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
        print(
            f"    losses {[f'{v:.6f}' for v in got['losses']]} vs one process "
            f"{[f'{v:.6f}' for v in ref['losses']]}: max relative difference {max(diffs):.2e}",
            flush=True,
        )
        verdict = "within" if worst <= BUDGET else "OVER"
        print(f"    worst rank {worst:.3f}x: {verdict} the {BUDGET}x budget", flush=True)


if __name__ == "__main__":
    main()
