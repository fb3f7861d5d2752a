"""Reproducible and pinned partitions through smp (2 ranks, pp = 2). Prints ``CASE-OK <name>``.

- five constructions of the same pipelined model give the same partition;
- ``partition_file``: a run without the file writes the automatic partition there, and a
  run with it splits the model as the file says (here: a hand-edited, different split).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402
from equivalence import local_slice  # noqa: E402


def first_step(config: dict) -> dict[str, int]:
    """Build TinyLM under ``config``, run one step; the partition it got."""
    cfg = smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **config})
    torch.manual_seed(0)
    model = smp.DistributedModel(models.TinyLM(layers=4))

    @smp.step
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = models.global_batch(0, 8)
    step(local_slice(x, cfg), local_slice(y, cfg))
    assignment = dict(model.engine.runtime.assignment)
    assert smp.allgather(assignment) == [assignment] * smp.size()
    return assignment


def ok(name: str) -> None:
    smp.barrier()
    if smp.rank() == 0:
        print(f"CASE-OK {name}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    runs = [first_step({}) for _ in range(5)]
    assert all(r == runs[0] for r in runs[1:]), runs
    assert set(runs[0].values()) == {0, 1}, runs[0]
    ok("five-constructions")

    folder = smp.allgather(tempfile.mkdtemp() if smp.rank() == 0 else None)[0]
    path = os.path.join(folder, "partition.json")
    written = first_step({"partition_file": path})
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["schema"] == "smp-partition/assignment@1" and saved["num_devices"] == 2
    assert written == runs[0]
    ok("partition-file-written")

    # Pin another split: every block on stage 1 (the tied embedding/head stays on 0).
    pinned = {k: (1 if k.startswith("blocks") or k == "ln" else 0) for k in saved["assignment"]}
    smp.barrier()
    if smp.rank() == 0:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**saved, "assignment": pinned}, f)
    smp.barrier()
    got = first_step({"partition_file": path})
    assert {k: v for k, v in got.items() if k in pinned} == pinned, got
    ok("partition-file-read")


if __name__ == "__main__":
    main()
