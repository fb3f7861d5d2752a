"""A Hugging Face Llama that does not fit a rank's memory budget, trained under delayed
initialization, with its per-rank peak memory measured (issue 42's acceptance run).

Usage (one JSON line ``BIG-RESULT {...}`` on rank 0 / the single process):

    mpiexec -n 4 python big_model.py SIZE pp4     # pipeline_parallel_degree=4, 4 microbatches
    mpiexec -n 4 python big_model.py SIZE pp4-stream   # the same, deterministic_accumulation off
    mpiexec -n 4 python big_model.py SIZE sdp4    # sharded_data_parallel_degree=4
    python big_model.py SIZE MODE reference       # one process, built normally, same seed

``SIZE`` is a JSON object of LlamaConfig fields (hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, vocab_size). Every run builds the model from
``torch.manual_seed(SEED)`` and trains ``STEPS`` SGD steps on the same global batches; the
distributed runs accumulate one-row microbatches, each contributing ``loss / (dp *
microbatches)``, and the reference takes each global batch in one pass, whose mean loss is the
same up to rounding (every row has SEQ tokens); the test compares losses at 1e-5.

Memory: after ``smp.init`` (interpreter, torch, MPI and the backend already resident) the
peak-RSS mark is reset (``/proc/self/clear_refs``), so ``peak_growth`` is each rank's highest
RSS from building the model to the end of the last step, over the RSS before it: measured,
not estimated. SGD without momentum keeps the optimizer state out of the figure.
"""

from __future__ import annotations

import json
import re
import sys

import torch

# 8 tokens a row: what the test checks (peak memory against the parameters, losses against one
# process) does not depend on the sequence, and a pass's compute does (at 32 tokens the
# pp4-stream job took 48 s, at 8 tokens 32 s; peak growth 0.56-0.69x and 0.53-0.64x).
SEED, STEPS, SEQ, LR = 1234, 2, 8, 1e-3
GLOBAL_BATCH = 4
MICROBATCHES = {"pp4": 4, "pp4-stream": 4, "sdp4": 1}
CONFIGS = {
    "pp4": {"pipeline_parallel_degree": 4, "microbatches": 4},
    # Gradients summed in autograd's order: no per-microbatch gradient buffers (the default's
    # deterministic order buffers a microbatch whose backward reaches a parameter before an
    # earlier one's did: a gradient-sized copy of what it reached).
    "pp4-stream": {"pipeline_parallel_degree": 4, "microbatches": 4, "deterministic_accumulation": False},
    "sdp4": {"sharded_data_parallel_degree": 4, "microbatches": 1},
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"{field}:\s+(\d+)", f.read())
    assert m is not None, field
    return int(m.group(1))


def _reset_peak() -> int:
    """Reset the peak-RSS mark to the current RSS; return that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _config(size: dict) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **size,
    )


def _batch(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def reference(size: dict, mode: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(_config(size))
    total = _param_bytes(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x = _batch(step, size["vocab_size"])
        opt.zero_grad()
        # The whole global batch in one pass: every row predicts SEQ - 1 tokens, so its mean
        # loss is the mean of the distributed runs' per-microbatch means, equal up to rounding
        # (the test compares at 1e-5). A pass costs about the same at 1 row as at 4 (it reads
        # and writes 1.5 GB of weights and gradients), so this is 2 passes instead of 8.
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        step_loss = float(loss)
        opt.step()
        losses.append(step_loss)
    print("BIG-RESULT " + json.dumps({"mode": "reference", "losses": losses, "param_bytes": total}), flush=True)


def distributed(size: dict, mode: str) -> None:
    import smp_torch as smp
    from transformers import LlamaForCausalLM

    smp.init({"delayed_parameter_initialization": True, **CONFIGS[mode]})
    baseline = _reset_peak()
    torch.manual_seed(SEED)
    with smp.delay_param_initialization():
        net = LlamaForCausalLM(_config(size))
    total = _param_bytes(net)  # (meta: sizes only)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=x, labels=x).loss
        model.backward(loss)
        return loss

    cfg = smp.state.state().config
    losses = []
    for step in range(STEPS):
        x = _batch(step, size["vocab_size"])
        share = x.chunk(cfg.rdp * cfg.sdp if cfg.pp == 1 else 1)[smp.dp_rank() if cfg.pp == 1 else 0]
        opt.zero_grad()
        out = train_step(share)
        # The mean over this rank's microbatches, then over the data-parallel ranks.
        local = float(out.reduce_mean())
        losses.append(sum(smp.allgather(local, smp.DP_GROUP)) / smp.dp_size())
        opt.step()
    growth = _status_kib("VmHWM") * 1024 - baseline
    held = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters()
    )
    # Under pipelining, the most microbatches whose gradients this rank held apart at once
    # (deterministic accumulation buffers a contribution that arrives before an earlier
    # microbatch's: each buffer is a gradient-sized copy of what the microbatch reached).
    runtime = getattr(model.engine, "runtime", None)
    buffered = runtime.server.grads.peak_buffers if runtime is not None else 0
    rows = smp.allgather(
        {"rank": smp.rank(), "peak_growth": growth, "param_bytes_held": held, "peak_microbatch_buffers": buffered},
        smp.WORLD,
    )
    if smp.rank() == 0:
        print("BIG-RESULT " + json.dumps({"mode": mode, "losses": losses, "param_bytes": total, "ranks": rows}), flush=True)


def main() -> None:
    size = json.loads(sys.argv[1])
    mode = sys.argv[2]
    if len(sys.argv) > 3 and sys.argv[3] == "reference":
        reference(size, mode)
    else:
        distributed(size, mode)


if __name__ == "__main__":
    main()
