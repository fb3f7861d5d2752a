"""Shared helpers for the multi-process check scripts (run under torch.distributed.run)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import smp_tp
import torch
import torch.distributed as dist
from smp_tp.mappings import _all_gather

RTOL, ATOL = 1e-5, 1e-6


def setup() -> tuple[int, int, object]:
    """Initialise gloo; return (rank, world size, this rank's singleton group)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    single = None
    for r in range(world):  # every rank must create every group
        g = dist.new_group([r])
        if r == rank:
            single = g
    return rank, world, single


def log(*args: object) -> None:
    # One write per line: print() writes its pieces separately, and unbuffered ranks sharing
    # a pipe then interleave mid-line (a test counting "[rank r] ..." lines misses one).
    line = " ".join(map(str, (f"[rank {dist.get_rank()}]", *args)))
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def gather_batch(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's samples along dim 0 (no gradient)."""
    return _all_gather(x.contiguous(), 0, None, "forward")


def close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> None:
    """allclose with ``atol`` taken relative to the tensor's largest magnitude (when > 1).

    The parallel modules sum partial products in a different order than the single-rank
    module (reduce-scatter / all-reduce of partial sums), so an element that is near zero
    in a tensor of magnitude ~5 can differ by a few float32 ulps *of that magnitude*.
    """
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    atol = atol * max(1.0, want.float().abs().max().item()) if want.numel() else atol
    if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol):
        err = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        raise AssertionError(
            f"{name}: max abs error {err:.3e}, max |value| {scale:.3e} (rtol={rtol}, atol={atol})"
        )


def close_dicts(name: str, got: dict, want: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    if set(got) != set(want):
        raise AssertionError(f"{name}: keys differ: {sorted(set(got) ^ set(want))}")
    for k in want:
        close(f"{name}[{k}]", got[k], want[k], rtol, atol)


def close_norm(name: str, got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """``||got - want|| <= rel * ||want||`` (plus a float32 floor), the whole tensor at once.

    For gradients of vocabulary-parallel and column/row-parallel models: the softmax
    denominators are sums of per-rank partial sums, row-parallel outputs and input
    gradients are all-reduced / reduce-scattered partial products, so every element is
    the same sum taken in another order. An elementwise bound then has to be loose for
    the elements that happen to be near zero; the norm of the difference is a bound on
    the whole tensor that stays tight (a wrong shard or a missing term moves it by O(1)).
    1e-5 is about 100 float32 epsilons; the largest difference measured (printed by
    ``finish``) is 4.3e-6, a key-projection gradient of Llama on 4 ranks, one sample each.
    """
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    g, w = got.double(), want.double()
    err, ref = (g - w).norm().item(), w.norm().item()
    floor = 1e-7 * max(1.0, w.numel()) ** 0.5
    if err > floor and err / ref > _worst[0]:
        _worst[:] = [err / ref, name]
    if not err <= rel * ref + floor:
        raise AssertionError(f"{name}: ||diff|| {err:.3e} > {rel} x ||want|| {ref:.3e} (+{floor:.1e})")


_worst: list = [0.0, ""]  # largest ||got - want|| / ||want|| seen, reported by finish()


def close_norm_dicts(name: str, got: dict, want: dict, rel: float = 1e-5) -> None:
    if set(got) != set(want):
        raise AssertionError(f"{name}: keys differ: {sorted(set(got) ^ set(want))}")
    for k in want:
        close_norm(f"{name}[{k}]", got[k], want[k], rel)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters (a tied parameter counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def randomize(module: torch.nn.Module, seed: int = 1234) -> None:
    """Give every parameter non-trivial values, identically on every rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            shift = 1.0 if p.dim() == 1 and "norm" in name.lower() and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + shift)


def finish(failures: list[str]) -> None:
    dist.barrier()
    if failures:
        log("FAILURES:\n  " + "\n  ".join(failures))
        sys.exit(1)
    if _worst[1]:
        log(f"largest norm-relative difference {_worst[0]:.2e} ({_worst[1]})")
    log("ALL OK")
    dist.destroy_process_group()
    # Leave without interpreter finalization: torch's own teardown there (a std::thread of
    # the rendezvous store or of gloo, destroyed while still joinable) aborts the process now
    # and then on a loaded machine ("terminate called without an active exception", status
    # 6, on local rank 0, after every check passed: 2 of 12 runs of check_modules with two
    # CPU hogs beside it). smp-tp has no threads or exit-time state of its own to tear down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


__all__ = ["smp_tp", "os"]


#: The failed checks of this rank (``check``), reported by ``finish(FAILURES)``.
FAILURES: list[str] = []


def check(label: str, fn: Callable[..., object], *args: object) -> None:
    """Run one check, recording its traceback in :data:`FAILURES` instead of stopping (every
    rank runs every check, so the collectives stay in step); ``SMP_TP_FAILFAST=1`` raises."""
    if os.environ.get("SMP_TP_VERBOSE"):
        log("check", label)
    try:
        fn(*args)
    except Exception:
        if os.environ.get("SMP_TP_FAILFAST"):
            raise
        FAILURES.append(f"{label}: {traceback.format_exc()}")


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of
    ``model`` on ``x`` (parameters excluded); runs the backward too."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    y.sum().backward()
    return sum(seen.values())
