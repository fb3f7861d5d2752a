"""Save on one layout, resume on another, and check training continues exactly.

Usage: ``mpiexec -n N python checkpointing.py DIR CASES_JSON``; each case is
``{"name", "save": config, "load": config, "partial": bool, "optimizer": "adam"|"sgd"}``.
Every rank trains the single-process reference itself for 4 steps; the distributed run trains
2 steps on ``save``, checkpoints, trains 2 more (checked), then re-initialises smp with the
``load`` layout, builds a *differently initialised* model, resumes and trains the last 2
steps again (checked against the same reference).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
import smp_torch as smp  # noqa: E402
from equivalence import check_close, local_slice, make_opt  # noqa: E402

BATCH = 8


def reference(kind: str) -> list[tuple[float, dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    ref = models.TinyLM()
    opt = make_opt(kind, ref.parameters())
    out = []
    for step in range(4):
        x, y = models.global_batch(step, BATCH)
        opt.zero_grad()
        loss = models.lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        out.append((loss.item(), copy.deepcopy(ref.state_dict())))
    return out


def build(
    config: dict, seed: int, kind: str
) -> tuple[smp.DistributedModel, smp.DistributedOptimizer, object]:
    cfg = smp.init(config)
    torch.manual_seed(seed)
    model = smp.DistributedModel(models.TinyLM(tp=cfg.tp > 1))
    opt = smp.DistributedOptimizer(make_opt(kind, model.parameters()))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def train(model, opt, train_step, steps, ref, name) -> None:  # type: ignore[no-untyped-def]
    cfg = smp.state.state().config
    for step in steps:
        x, y = models.global_batch(step, BATCH)
        opt.zero_grad()
        loss = train_step(local_slice(x, cfg), local_slice(y, cfg)).reduce_mean()
        losses = smp.allgather(float(loss), smp.DP_GROUP)
        got = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
        check_close(
            f"loss at step {step}", got, torch.tensor(ref[step][0], dtype=torch.float64), name
        )
        opt.step()
        full = model.state_dict()
        for k, v in ref[step][1].items():
            check_close(f"{k} after step {step}", full[k], v, name)


def run_case(root: str, case: dict) -> None:
    name, kind = case["name"], case.get("optimizer", "adam")
    ref = reference(kind)
    model, opt, train_step = build(case["save"], 0, kind)
    train(model, opt, train_step, range(2), ref, name)
    path = os.path.join(root, name)
    smp.save_checkpoint(
        path, "step2", partial=case["partial"], user_content={"step": 2, "note": "hi"}
    )
    train(model, opt, train_step, range(2, 4), ref, name + "/continued")
    model, opt, train_step = build(case["load"], 123, kind)
    user = smp.resume_from_checkpoint(path)
    assert user == {"step": 2, "note": "hi"}, user
    train(model, opt, train_step, range(2, 4), ref, name + "/resumed")
    if smp.rank() == 0:
        with open(os.path.join(path, "step2", "manifest.json")) as f:
            manifest = json.load(f)
        assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
        assert not [d for d in os.listdir(path) if d.startswith(".")], os.listdir(path)
        print(f"CASE-OK {name}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    root, cases = sys.argv[1], json.loads(sys.argv[2])
    for case in cases:
        run_case(root, case)


if __name__ == "__main__":
    main()
