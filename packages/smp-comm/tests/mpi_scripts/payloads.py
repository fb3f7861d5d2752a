"""Deterministic payloads of every kind, rebuilt on the receiver to check byte for byte."""

from __future__ import annotations

import dataclasses
import traceback
from collections import namedtuple
from typing import Any

import numpy as np

try:
    import torch
except ImportError:
    torch = None

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Box:
    name: str
    tensors: list
    meta: dict


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: Any


def make(src: int, dst: int, tag: int, big: int = 1 << 18) -> Any:
    """A payload named by (src, dst, tag); ``big`` bytes of float32 push it past inline size."""
    seed = (src * 7919 + dst * 104729 + tag * 13) % (2**31)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {
        "np_f64": rng.standard_normal((3, 5)),
        "np_i8": rng.integers(-128, 127, size=17, dtype=np.int8),
        "np_struct": np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")]),
        "np_empty": np.zeros((0, 4), dtype=np.float32),
        "np_strided": rng.standard_normal((6, 4))[::2, ::-1],
        "np_big": rng.standard_normal(big // 8),
        "np_objects": np.array(["x", 1], dtype=object),
        "plain": ("tag", tag, [1.5, None], {"k": b"bytes"}),
    }
    if torch is not None:
        g = torch.Generator().manual_seed(seed)
        shared = torch.randn(4, generator=g)
        out.update(
            f32_grad=torch.randn(2, 3, generator=g).requires_grad_(),
            bf16=torch.randn(5, 7, generator=g).to(torch.bfloat16),
            bf16_grad=torch.randn(3, generator=g).to(torch.bfloat16).requires_grad_(),
            f16=torch.randn(9, generator=g).half(),
            i64=torch.randint(-(2**40), 2**40, (11,), generator=g),
            u8=torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
            boolean=torch.rand(6, generator=g) > 0.5,
            c64=torch.randn(4, generator=g, dtype=torch.complex64),
            transposed=torch.randn(5, 3, generator=g).t(),
            sliced=torch.randn(10, generator=g)[1::3],
            zero_size=torch.empty(0, 3),
            scalar=torch.tensor(3.25),
            big=torch.randn(big // 4, generator=g),
            nested=[Pair(shared, (shared, {"deep": [torch.ones(2, dtype=torch.int32)]}))],
            box=Box("b", [torch.full((2, 2), float(tag))], {"t": torch.arange(3)}),
            frozen=Frozen(torch.zeros(1, dtype=torch.float64)),
        )
    return out


def _same(a: Any, b: Any, path: str) -> None:
    assert type(a) is type(b), f"{path}: type {type(a)} != {type(b)}"
    if torch is not None and isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad {a.requires_grad}"
        assert a.is_contiguous(), f"{path}: not contiguous"
        x, y = a.detach().contiguous(), b.detach().contiguous()
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (
            f"{path}: bytes differ"
        )
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        )
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist(), path
        else:
            assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), (
                f"{path}: bytes differ"
            )
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {a.keys()} != {b.keys()}"
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def check(got: Any, src: int, dst: int, tag: int, big: int = 1 << 18) -> None:
    """Assert ``got`` equals ``make(src, dst, tag)`` byte for byte, types and flags included."""
    _same(got, make(src, dst, tag, big), f"msg({src}->{dst}, tag {tag})")
    if torch is not None:
        left, (again, _) = got["nested"][0]
        assert left is again, "a tensor referenced twice must arrive as one tensor"


def own_shm_files() -> list[str]:
    """Shared-memory files this process created and has not unlinked (must be none once
    a Communicator is constructed: they are unlinked as soon as every peer mapped them)."""
    import glob
    import os

    return glob.glob(f"/dev/shm/smp-comm-{os.getpid()}-*")


def guarded_by(errors: list[BaseException]):  # type: ignore[no-untyped-def]
    """Decorator for thread bodies: an exception is appended to ``errors`` (the main thread
    raises the first one after joining) instead of dying silently with its thread."""

    def guarded(fn):  # type: ignore[no-untyped-def]
        def run(*a):  # type: ignore[no-untyped-def]
            try:
                fn(*a)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        return run

    return guarded


def run_threads(threads: list, errors: list[BaseException]) -> None:  # type: ignore[type-arg]
    """Start and join ``threads`` (bodies wrapped by :func:`guarded_by`), then raise the first
    error any of them recorded."""
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def case_ok(case: str) -> None:
    """Report that ``case`` passed on this rank: ``rank R CASE-OK [case]`` (the tests make
    one pytest item per case from these lines, see tests/conftest.py). One write: the
    launcher interleaves the ranks' output write by write."""
    import sys

    from mpi4py import MPI

    sys.stdout.write(f"rank {MPI.COMM_WORLD.rank} CASE-OK [{case}]\n")
    sys.stdout.flush()


def main_guard(fn) -> None:
    """Run ``fn``; on any failure print the traceback and abort the whole MPI job."""
    from mpi4py import MPI

    try:
        fn()
    except BaseException:
        traceback.print_exc()
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def init_smp_world(timeout_s: float) -> Any:
    """``init_process_group("smp")`` over MPI's world with a group timeout of ``timeout_s``:
    a TCPStore on rank 0, its port shared by broadcast. Returns the store."""
    import os
    from datetime import timedelta

    import smp_comm.torch_backend  # noqa: F401 - registers "smp"
    import torch.distributed as dist
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    port = world.bcast(29400 + os.getpid() % 1000 if world.rank == 0 else None)
    store = dist.TCPStore("127.0.0.1", port, world.size, world.rank == 0, timedelta(seconds=60))
    dist.init_process_group("smp", store=store, rank=world.rank, world_size=world.size,
                            timeout=timedelta(seconds=timeout_s))
    return store
