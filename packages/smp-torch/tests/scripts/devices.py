"""Every smp path under a device check: no host tensor reaches a collective (issue 42).

Usage: ``mpiexec -n 2 python devices.py ROOT CASE [CASE ...]``; ROOT is a scratch directory
(checkpoints). :mod:`devcheck` is installed before smp is imported: every collective refuses a
tensor that would sit on the host on a GPU machine, where smp's groups are NCCL groups serving
``ctx.device`` (see :mod:`devcheck` for how a CPU run tells the two apart). Each case trains
a tiny model for a few steps with its configuration, then prints, from rank 0,
``CHECKED <case> <json list of caller-file:function:collective xN>`` (every rank's checked
call sites) and ``CASE-OK <case>``.

A case ``mutant:<module>[:<case>]`` first makes every tensor factory of ``smp_torch.<module>``
forget its device (the mistake of issue 42, e.g. ``torch.zeros(2)`` for
``torch.zeros(2, device=ctx.device)``), runs the case (default: the one that exercises that
module), and prints ``CAUGHT <mutant> <message>`` when the check refuses a tensor there, or
raises when nothing is refused: the check is shown able to fail.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import devcheck  # noqa: E402

# Before smp and smp-tp: they bind some torch.distributed functions at import.
CHECK = devcheck.install()

import models  # noqa: E402
import smp_torch as smp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from equivalence import local_slice  # noqa: E402

BATCH = 8

CASES: dict[str, dict[str, Any]] = {
    # Data parallelism, reduction overlapped with backward (the default), 3 steps: the late
    # agreement runs from the second step on.
    "dp": {"config": {}},
    "dp-no-overlap": {"config": {}, "overlap": False},
    "fp16": {"config": {"fp16": True}},
    "bf16": {"config": {"bf16": True}},
    # The model's clip_grad_norm_ (via sdp_gradient_clipping, applied by the optimizer, and
    # called directly): its sums cross the pipeline / tensor-parallel groups.
    "clip-pp2": {
        "config": {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
                   "sdp_gradient_clipping": 0.05},
        "manual": True, "clip": 0.05,
    },  # fmt: skip
    "clip-tp2": {"config": {"tensor_parallel_degree": 2, "sdp_gradient_clipping": 0.05}, "clip": 0.05},
    "sdp2-clip": {
        "config": {"sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.05,
                   "sdp_param_persistence_threshold": 100},
        "clip": 0.05,
    },  # fmt: skip
    # Optimizer-state sharding, with a full checkpoint round trip (its state is gathered).
    "shard-opt": {"config": {"shard_optimizer_state": True}, "checkpoint": ["full"]},
    # Checkpoints, partial and full, with tensor parallelism (state gathered over TP).
    "checkpoint-tp2": {"config": {"tensor_parallel_degree": 2}, "checkpoint": ["partial", "full"]},
}

# Which case exercises a module's collectives, for mutants.
MUTANT_CASE = {"grads": "dp", "precision": "fp16", "model": "clip-pp2", "sharded": "sdp2-clip"}


def train(name: str, spec: dict[str, Any], steps: range, model: Any, opt: Any) -> None:
    """``steps`` training steps on the local slice of the global batch, inputs on
    ``ctx.device`` (as a user's script puts them)."""
    cfg = smp.state.state().config
    device = smp.state.state().device

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(model(x), y)
        model.backward(loss)
        return loss

    for step in steps:
        x, y = models.global_batch(step, BATCH)
        opt.zero_grad()
        out = train_step(local_slice(x, cfg).to(device), local_slice(y, cfg).to(device))
        loss = float(out.reduce_mean())
        assert loss == loss, f"[{name}] loss is NaN at step {step}"
        if "clip" in spec:
            norm = model.clip_grad_norm_(spec["clip"])
            assert torch.isfinite(norm).all(), (name, norm)
        opt.step()


def build(spec: dict[str, Any]) -> tuple[Any, Any]:
    cfg = smp.state.state().config
    torch.manual_seed(0)
    net = models.TinyLM(tp=cfg.tp > 1, manual=spec.get("manual", False))
    model = smp.DistributedModel(net, overlap_grad_reduction=spec.get("overlap", True))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt


def run_case(root: str, name: str) -> None:
    spec = CASES[name]
    smp.init({**spec["config"], "timeout_s": 120})
    CHECK.reset()
    model, opt = build(spec)
    train(name, spec, range(3), model, opt)
    for form in spec.get("checkpoint", []):
        path = os.path.join(root, f"{name}-{form}")
        smp.save_checkpoint(path, "t", partial=form == "partial", user_content={"form": form})
        model, opt = build(spec)  # fresh weights: the checkpoint must bring them back
        assert smp.resume_from_checkpoint(path) == {"form": form}
        train(name, spec, range(3, 5), model, opt)
    calls = sorted({line for lines in smp.allgather(CHECK.summary(), smp.WORLD) for line in lines})
    smp.barrier()
    if smp.rank() == 0:
        print(f"CHECKED {name} {json.dumps(calls)}", flush=True)
        print(f"CASE-OK {name}", flush=True)


# ------------------------------------------------------------------------- self-test


def selftest() -> None:
    """Each checked entry point refuses a host tensor (on every rank, before sending
    anything) and takes device tensors; a group declared ``"cpu"`` refuses device ones."""
    smp.init({"timeout_s": 120})
    ctx = smp.state.state()
    dev = ctx.device
    group = ctx.process_groups["dp"]  # smp's dp group: the whole job of 2 ranks
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    # (torch 2.13's names; older torch has only the *_tensor ones)
    gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def on_dev(*shape: int) -> torch.Tensor:
        return torch.full(shape, float(me + 1), device=dev)

    def on_host(*shape: int) -> torch.Tensor:
        return torch.full(shape, float(me + 1))  # the default device: the host

    calls = {
        "all_reduce": lambda mk: dist.all_reduce(mk(4), group=group),
        "broadcast": lambda mk: dist.broadcast(mk(4), src=0, group=group),
        "all_gather": lambda mk: dist.all_gather([mk(2), mk(2)], mk(2), group=group),
        "all_gather_single": lambda mk: gather_flat(mk(4), mk(2), group=group),
        "reduce_scatter_single": lambda mk: scatter_flat(mk(2), mk(4), group=group),
        "all_to_all_single": lambda mk: dist.all_to_all_single(mk(4), mk(4), group=group),
        "all_to_all": lambda mk: dist.all_to_all([mk(2), mk(2)], [mk(2), mk(2)], group=group),
        "send/recv": lambda mk: (
            dist.send(mk(3), dst=1, group=group) if me == 0 else dist.recv(mk(3), src=0, group=group)
        ),
        "isend/irecv": lambda mk: (
            dist.isend(mk(3), dst=peer, group=group) if me == 0 else dist.irecv(mk(3), src=peer, group=group)
        ).wait(),
        "batch_isend_irecv": lambda mk: [
            w.wait()
            for w in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, mk(2), peer, group), dist.P2POp(dist.irecv, mk(2), peer, group)]
            )
        ],
    }
    for what, call in calls.items():
        try:
            call(on_host)
        except devcheck.DeviceMismatchError as exc:
            assert "on device cpu, but its group serves cuda" in str(exc), str(exc)
        else:
            raise AssertionError(f"the device check let a host tensor into {what}")
        call(on_dev)  # the same call on the device goes through
    # A mixed list: one host tensor among device ones is refused, and named.
    try:
        dist.all_gather([on_dev(2), on_host(2)], on_dev(2), group=group)
    except devcheck.DeviceMismatchError as exc:
        assert "tensor_list[1]" in str(exc), str(exc)
    else:
        raise AssertionError("a host tensor in all_gather's output list went through")
    # Any group may declare another device: a host group refuses device tensors.
    world = dist.group.WORLD
    CHECK.declare(world, "cpu")
    try:
        dist.all_reduce(on_host(2), group=world)
        try:
            dist.all_reduce(on_dev(2), group=world)
        except devcheck.DeviceMismatchError as exc:
            assert "on device cuda, but its group serves cpu" in str(exc), str(exc)
        else:
            raise AssertionError("a group declared cpu took a device tensor")
    finally:
        CHECK.declare(world, devcheck.ACCELERATOR)
    smp.barrier()
    if smp.rank() == 0:
        print("CASE-OK selftest", flush=True)


# --------------------------------------------------------------------------- mutants


def _forgetful(factory: Any, *args: Any, **kwargs: Any) -> Any:
    kwargs.pop("device", None)
    return factory(*args, **kwargs)


devcheck.SKIP_CODE.add(_forgetful.__code__)  # origins name smp's line, not this one


class _ForgetfulTorch:
    """``torch``, except that its tensor factories drop their ``device`` argument."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in ("zeros", "ones", "full", "empty", "tensor", "arange"):
            return functools.partial(_forgetful, value)
        return value


def mutant(root: str, what: str) -> None:
    module, _, case = what.partition(":")
    case = case or MUTANT_CASE[module]
    target = sys.modules[f"smp_torch.{module}"]
    real = target.torch  # type: ignore[attr-defined]
    target.torch = _ForgetfulTorch()  # type: ignore[attr-defined]
    try:
        run_case(root, case)
    except devcheck.DeviceMismatchError as exc:
        text = str(exc)
        if f"smp_torch{os.sep}{module}.py" not in text:
            raise
        smp.barrier()
        if smp.rank() == 0:
            print(f"CAUGHT mutant:{module} {text}", flush=True)
        return
    finally:
        target.torch = real  # type: ignore[attr-defined]
    raise AssertionError(f"mutant:{module}: smp_torch.{module} made host tensors, and no collective refused one")


def main() -> None:
    torch.set_num_threads(1)
    root, names = sys.argv[1], sys.argv[2:]
    for name in names:
        if name == "selftest":
            selftest()
        elif name.startswith("mutant:"):
            mutant(root, name[len("mutant:") :])
        else:
            run_case(root, name)


if __name__ == "__main__":
    main()
