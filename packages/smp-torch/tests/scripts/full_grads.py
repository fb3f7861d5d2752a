"""``DistributedModel.full_grad_dict()`` equals the unwrapped model's gradients on the global
batch, for a pipeline, tensor parallelism, sharded and plain data parallelism (2 ranks).
Prints ``CASE-OK <name>`` for each case."""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402
from equivalence import local_slice  # noqa: E402

CASES = {
    "pp2": {"pipeline_parallel_degree": 2, "microbatches": 2},
    "tp2": {"tensor_parallel_degree": 2},
    "sdp2": {"sharded_data_parallel_degree": 2},
    "dp2": {},
}


def check(name: str, config: dict) -> None:
    cfg = smp.init(config)
    torch.manual_seed(0)
    net = models.TinyLM(tp=cfg.tp > 1)
    ref = copy.deepcopy(net)
    model = smp.DistributedModel(net)

    @smp.step
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = models.global_batch(0, 8)
    step(local_slice(x, cfg), local_slice(y, cfg))
    got = model.full_grad_dict()
    models.lm_loss(ref(x), y).backward()
    want = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    assert got.keys() == want.keys(), (name, sorted(got), sorted(want))
    for key, g in want.items():
        # Data-parallel all-reduces sum in another order than one process: 1e-5 relative.
        torch.testing.assert_close(got[key], g, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-OK {name}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case in sys.argv[1:] or CASES:
        check(case, CASES[case])
