"""A save that fails on one rank must fail on every rank and leave nothing behind; a corrupt
file must be refused at resume."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402


class Unpicklable:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("cannot pickle this")


def main() -> None:
    root = os.path.join(sys.argv[1], "ck")
    smp.init({})
    torch.manual_seed(0)
    model = smp.DistributedModel(models.TinyLM())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    smp.save_checkpoint(root, "good", partial=False, user_content={"ok": 1})
    try:
        # user_content is written by rank 0 only: rank 1 succeeds, and must still fail.
        smp.save_checkpoint(root, "bad", partial=False, user_content=Unpicklable())
    except smp.CheckpointError as exc:
        assert "cannot pickle" in str(exc), exc
        print(f"RANK {smp.rank()} save failed as expected", flush=True)
    else:
        raise AssertionError("save with unpicklable user content succeeded")
    smp.barrier()
    if smp.rank() == 0:
        path = os.path.join(root, "good", "model.pt")
        data = bytearray(open(path, "rb").read())
        data[-10] ^= 0xFF
        open(path, "wb").write(bytes(data))
    smp.barrier()
    try:
        smp.resume_from_checkpoint(root, "good", model=model, optimizer=opt)
    except smp.CheckpointError as exc:
        assert "checksum" in str(exc)
    else:
        raise AssertionError("corrupt checkpoint was loaded")
    smp.barrier()
    if smp.rank() == 0:
        print("FAILURE-OK", flush=True)


if __name__ == "__main__":
    main()
