"""Run under mpiexec by test_offload_mpi.py: activation offloading vs one process.

Usage: python offload_cases.py SUITE   (SUITE: offload | offload4)

Each case is an :func:`mpi_cases.run_case` with checkpointing and ``offload_activations``:
losses and gradients must equal one process accumulating the same microbatches in the same
order bit for bit, and the offloading counters of every rank must show that tensors really
went to the host pool and came back within the horizon. Prints ``CASE-OK <name>`` per case
and ``STATS <name> <per-rank counters>`` (read by a person, not asserted further).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from mpi4py import MPI  # noqa: E402
from mpi_cases import comm_allgather, data, gpt2, hf_loss_step, reference_hf, run_case, token_batch  # noqa: E402
from smp_comm import Communicator  # noqa: E402

CHAIN_CKPT = {f"blocks.{i}": None for i in range(4)}


def offload_case(comm, name, *args, horizon=1, offloaded_per_rank=None, full_window=False, **kwargs):
    """``run_case`` with offloading at ``horizon``, then check every rank's counters.

    ``offloaded_per_rank[r]``: tensors pp rank r must have offloaded over the case (its
    checkpointed calls x microbatches x steps). ``full_window``: every backward starts after
    every forward (simple schedule), so each rank must have held exactly ``horizon``
    microbatches ahead (capped by the microbatches left)."""
    rt = run_case(comm, name, *args, offload_activations=True,
                  activation_loading_horizon=horizon, **kwargs)  # fmt: skip
    off = rt.offloader
    assert off is not None
    stats = comm_allgather(off.stats.as_dict())
    leftovers = comm_allgather((off.host_bytes, off.device_bytes, off.pooled_microbatches))
    assert all(left == (0, 0, []) for left in leftovers), f"{name}: pool not empty: {leftovers}"
    assert sum(s["tensors_offloaded"] for s in stats) > 0, f"{name}: nothing offloaded: {stats}"
    for r, s in enumerate(stats):
        assert s["max_ahead"] <= horizon, f"{name}: pp rank {r} loaded too far ahead: {s}"
        assert s["bytes_reloaded"] >= s["bytes_offloaded"], f"{name}: pp rank {r}: {s}"
        if s["tensors_offloaded"]:
            assert s["prefetch_hits"] > 0, f"{name}: pp rank {r} never prefetched: {s}"
        if offloaded_per_rank is not None:
            want = offloaded_per_rank[r]
            assert s["tensors_offloaded"] == want, f"{name}: pp rank {r} offloaded {s}, want {want}"
        if full_window and s["tensors_offloaded"]:
            m = args[3]
            assert s["max_ahead"] == min(horizon, m - 1), f"{name}: pp rank {r}: {s}"
    if comm.rank == 0:
        print(f"STATS {name} {stats}", flush=True)
    return rt


def suite_offload(comm):
    """pp=2: schedules, horizons, out-of-order backwards, fast_mode runs, grouped
    checkpointing, tied weights, control flow, segment mode, GPT-2."""
    chain_assign = {"blocks.1": 1, "blocks.3": 1, "head": 1}
    # Two checkpointed blocks per rank, 8 microbatches, 2 steps: 32 tensors each.
    for schedule, horizon in (("simple", 1), ("simple", 3), ("interleaved", 1), ("interleaved", 4)):
        offload_case(comm, f"chain-offload-{schedule}-h{horizon}", models.Chain, data(),
                     chain_assign, 8, schedule, checkpointing=CHAIN_CKPT, horizon=horizon,
                     offloaded_per_rank=[32, 32], full_window=schedule == "simple")
    # Backwards in another order than the forwards: the prefetcher's guess is wrong, some
    # loads are evicted or synchronous; the results are the same.
    custom = [(0, "forward"), (1, "forward"), (2, "forward"), (3, "forward"), (2, "backward"),
              (0, "backward"), (3, "backward"), (1, "backward")]
    offload_case(comm, "chain-offload-custom", models.Chain, data(), chain_assign, 4, custom,
                 checkpointing=CHAIN_CKPT, offloaded_per_rank=[16, 16])
    seq_assign = {"1": 1, "2": 1, "3": 1, "5": 1}
    for fast in (True, False):
        offload_case(comm, f"seqrun-offload{'' if fast else '-fast-off'}", models.seq_model,
                     data(), seq_assign, 4, checkpointing={"2": None, "4": None}, fast_mode=fast,
                     offloaded_per_rank=[8, 8])
    offload_case(comm, "seq-contiguous-offload", models.seq_model, data(), seq_assign, 4,
                 checkpointing={"": "contiguous"})
    ids, tgt = token_batch(n=8, t=5)
    tied_assign = {"": 0, "embed": 1, "head": 1, "blocks.1": 0}
    for strategy in ("each", "group_2"):
        offload_case(comm, f"tied-offload-{strategy}", models.TiedLM, (ids % 11, tgt % 11),
                     tied_assign, 4, step_of=_tied_step, ref_loss=_tied_ref,
                     checkpointing={"blocks": strategy})
    # Control flow: each microbatch takes one branch, so each rank's pool holds some
    # microbatches and not others.
    offload_case(comm, "branch-offload", models.Branch, data(sign_pattern=True),
                 {"left": 1, "right.1": 1}, 4, per_microbatch_reference=True,
                 checkpointing={"pre": None, "left": None, "right.0": None, "right.1": None})
    offload_case(comm, "chain-offload-segments", models.Chain, data(), chain_assign, 4,
                 checkpointing=CHAIN_CKPT, backward_mode="segments", offloaded_per_rank=[16, 16])
    offload_case(comm, "gpt2-offload", gpt2, token_batch(), {"transformer.h.1": 1,
                 "transformer.ln_f": 1}, 4, step_of=hf_loss_step, ref_loss=reference_hf,
                 checkpointing={"transformer.h.0": None, "transformer.h.1": None}, horizon=2)


def _tied_step(model, rt):
    import torch.nn.functional as F

    def step(ids, target):
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        rt.backward(loss)
        return loss

    return step


def _tied_ref(model, batch):
    import torch.nn.functional as F

    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def suite_offload4(comm):
    """pp=4: both schedules, fast_mode runs over three stages, control flow."""
    assign = {"blocks.0": 1, "blocks.1": 2, "blocks.2": 3, "blocks.3": 3, "head": 2}
    for schedule, horizon in (("simple", 2), ("interleaved", 1)):
        offload_case(comm, f"chain4-offload-{schedule}-h{horizon}", models.Chain, data(n=16),
                     assign, 8, schedule, checkpointing=CHAIN_CKPT, horizon=horizon,
                     offloaded_per_rank=[0, 16, 16, 32], full_window=schedule == "simple")
    runs = {"1": 1, "2": 1, "3": 2, "4": 2, "5": 3, "6": 3}
    offload_case(comm, "seq4-offload", lambda: models.nested_seq_model(n=7), data(n=16), runs, 8,
                 checkpointing={str(i): None for i in range(7)}, horizon=2,
                 offloaded_per_rank=[16, 32, 32, 32])
    offload_case(comm, "branch4-offload", models.Branch, data(sign_pattern=True),
                 {"pre": 1, "left": 2, "right.0": 3, "right.1": 2}, 4,
                 per_microbatch_reference=True,
                 checkpointing={"pre": None, "left": None, "right.0": None, "right.1": None})


def main() -> None:
    comm = Communicator(MPI.COMM_WORLD)
    suite = sys.argv[1]
    t0 = time.monotonic()
    {"offload": suite_offload, "offload4": suite_offload4}[suite](comm)
    if comm.rank == 0:
        print(f"SUITE-OK {suite} in {time.monotonic() - t0:.1f}s", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
