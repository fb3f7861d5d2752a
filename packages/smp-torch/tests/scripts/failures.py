"""Usage: failures.py TP:PP [TP:PP ...]. For each layout in turn (re-initialising smp after
the failure, as a user may): an exception inside the step function of ONE pipeline must
raise on every rank of the job (no rank left waiting in a collective). Prints ``RANK <r>
RAISED <tp>:<pp> <type> <seconds>`` on each rank, the seconds from the layout's first step
to the raise. One launch for every layout: the job's imports cost more than a layout."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402


def run(tp: int, pp: int) -> None:
    config = {
        "pipeline_parallel_degree": pp,
        "tensor_parallel_degree": tp,
        "microbatches": 2,
        "timeout_s": 60,
    }
    cfg = smp.init(config)
    torch.manual_seed(0)
    model = smp.DistributedModel(models.TinyLM(tp=cfg.tp > 1))
    # The last pipeline fails (with pp=1: the last rank).
    first = smp.get_pp_group()[0]
    bad_pipeline = first == max(smp.allgather(first))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        if step == 1 and bad_pipeline:
            raise ValueError("boom in the last pipeline")
        model.backward(loss)
        return loss

    layout = f"{tp}:{pp}"
    start = time.monotonic()
    try:
        for step in range(3):
            x, y = models.global_batch(step, 8)
            n, i = smp.dp_size(), smp.dp_rank()
            train_step(x.chunk(n)[i], y.chunk(n)[i], step)
            print(f"RANK {smp.rank()} {layout} finished step {step}", flush=True)
    except Exception as exc:  # noqa: BLE001
        first_line = str(exc).splitlines()[0][:120] if str(exc) else ""
        took = time.monotonic() - start
        print(f"\nRANK {smp.rank()} RAISED {layout} {type(exc).__name__} {took:.2f}: {first_line}", flush=True)
        return
    print(f"RANK {smp.rank()} {layout} NO ERROR", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    for layout in sys.argv[1:]:
        tp, pp = (int(v) for v in layout.split(":"))
        run(tp, pp)
    # A normal exit: smp's exit handlers must cope with threads still blocked in collectives
    # the failing ranks never joined, one set per layout (without them: exit status 6,
    # "terminate called without an active exception").


if __name__ == "__main__":
    main()
