"""The ``smp`` torch.distributed backend: collectives through shared memory.

Importing this module registers the backend::

    import smp_comm.torch_backend  # noqa: F401
    dist.init_process_group("smp")            # or dist.new_group(backend="smp")

On CPU tensors, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``,
``broadcast`` and ``barrier`` (and the list forms ``all_gather`` and ``reduce_scatter``), and
``all_to_all_single`` with equal blocks on one host, run
through a shared-memory segment per group and host (:mod:`smp_comm.collectives.local`), and
hierarchically when the group spans hosts (:mod:`smp_comm.collectives.hierarchy`). Every
other collective goes to a gloo group made alongside; CUDA tensors go to NCCL.

torch's functional collectives (hence DTensor, DeviceMesh, FSDP2's state dicts and what
``torch.compile`` lowers to) reach this group through the coalesced methods torch forwards
to a Python group (``all_gather_single_coalesced``, ``reduce_scatter_single_coalesced``).
C++ callers that ask for the group's per-device backend instead get the gloo group, which
is registered as its CPU backend: slower, never missing.

Each group runs its collectives in call order (:mod:`smp_comm.torch_calls`), so ``async_op=True``
returns at once and the caller computes meanwhile; ``Work.wait()`` raises what the collective
raised. Ranks on one host are grouped by hostname, or by ``SMP_COMM_NODE_ID`` when set
(``{rank}`` in it is replaced by the group rank; tests use it to force the cross-host path).
``SMP_COMM_COLL_SLOT_BYTES`` (default 8 MiB, a multiple of 4096) sizes each rank's slot;
a group's segment holds ``2 * ranks_on_host`` slots. Across hosts, tensors move in pieces of
``SMP_COMM_COLL_HOST_CHUNK_BYTES`` (default 4 MiB) so that the host and the inter-host stages
overlap.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo, ReduceOp, Work

from smp_comm import shutdown, torch_p2p
from smp_comm.collectives import express
from smp_comm.collectives.hierarchy import DEFAULT_HOST_CHUNK_BYTES, build_collectives
from smp_comm.collectives.local import (
    REDUCE_OPS,
    LocalCollectives,
    check_reduce,
    flat,
)
from smp_comm.collectives.shm import PeerFailedError
from smp_comm.torch_calls import CallOrder
from smp_comm.torch_work import SmpWork

__all__ = ["BACKEND_NAME", "SmpProcessGroup", "SmpWork", "create_backend"]

BACKEND_NAME = "smp"
_DEFAULT_SLOT_BYTES = 8 << 20
_DEFAULT_INLINE_BYTES = 64 << 10

_RED_OPS = {
    ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.PRODUCT: "product",
    ReduceOp.MIN: "min", ReduceOp.MAX: "max", ReduceOp.BAND: "band",
    ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor",
}
assert set(_RED_OPS.values()) == set(REDUCE_OPS)
# Keyed by the enum's integer: hashing the enum itself costs microseconds per collective.
_RED_OP_VALUES = {k.value: v for k, v in _RED_OPS.items()}
_SUM = ReduceOp.SUM


def _node_id(rank: int) -> str:
    raw = os.environ.get("SMP_COMM_NODE_ID")
    return raw.replace("{rank}", str(rank)) if raw else socket.gethostname()


def _slot_bytes() -> int:
    value = int(os.environ.get("SMP_COMM_COLL_SLOT_BYTES", _DEFAULT_SLOT_BYTES))
    if value <= 0 or value % 4096:
        raise ValueError(f"SMP_COMM_COLL_SLOT_BYTES must be a positive multiple of 4096: {value}")
    return value


def _inline_bytes() -> int:
    value = int(os.environ.get("SMP_COMM_COLL_INLINE_BYTES", _DEFAULT_INLINE_BYTES))
    if value < 0:
        raise ValueError(f"SMP_COMM_COLL_INLINE_BYTES must be >= 0: {value}")
    return value


def _host_chunk_bytes() -> int:
    value = int(os.environ.get("SMP_COMM_COLL_HOST_CHUNK_BYTES", DEFAULT_HOST_CHUNK_BYTES))
    if value <= 0:
        raise ValueError(f"SMP_COMM_COLL_HOST_CHUNK_BYTES must be positive: {value}")
    return value


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class SmpProcessGroup(ProcessGroup):
    """A process group whose collectives run through smp-comm's shared-memory collectives.

    (The ``type: ignore`` marks below: torch's stubs give the user-level overloads of these
    methods; c10d calls a Python group with the low-level signatures used here.)
    """

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        ranks = list(global_ranks) if global_ranks else list(range(size))
        self._store, self._timeout = store, timeout
        # Made now, by every rank together: a fallback made on first use could deadlock in a
        # send/recv that only two ranks enter.
        self._gloo = ProcessGroupGloo(dist.PrefixStore("smp-gloo/", store), rank, size, timeout)
        # C++ callers that ask the group for its per-device backend (rather than calling the
        # methods below, which torch forwards to Python) find gloo for CPU tensors: slower,
        # never "No backend type associated with device type cpu".
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, self._gloo)
        self._nccl: Any = None
        labels = [f"rank {g}" if g == r else f"rank {g} (group rank {r})" for r, g in enumerate(ranks)]
        self._coll = build_collectives(
            store, rank, size, _node_id(rank), _slot_bytes(), timeout.total_seconds(),
            _host_chunk_bytes(), labels,
        )
        # Point to point straight between the callers' tensors over MPI, where the job runs
        # under MPI; None: gloo's.
        self._p2p = torch_p2p.build(store, rank, size, timeout, labels)
        self._quick = self._coll if isinstance(self._coll, LocalCollectives) else None
        self.inline_bytes = _inline_bytes()
        # All-reduce and barrier up to inline_bytes in one C call (None: not built here).
        self._express = express.build(self._quick, self.inline_bytes) if self._quick else None
        self._calls = CallOrder(self._coll.fail, self.inline_bytes)
        # A failed step here must not leave peers waiting in this group's collectives (a
        # fresh-clone run: a peer's exit waited 18 s on an all-reduce this rank never joined).
        ref = weakref.ref(self)

        def on_failed_step() -> None:
            group = ref()
            if group is not None:
                group.abandon("a step failed on this rank")

        shutdown.on_failed_step(on_failed_step)

    def abort(self) -> None:
        """What NCCL's abort does for its communicators: collectives of this group that
        peers wait in raise ``PeerFailedError`` naming this rank (within a wait's check
        interval), and every later one here is refused."""
        self.abandon("the group was aborted")

    def abandon(self, reason: str) -> None:
        """Mark the group failed: peers waiting in its collectives raise ``PeerFailedError``
        within a wait's check interval, and later collectives here are refused."""
        self._calls.abandon(PeerFailedError(f"smp backend: rank {self.rank()}: {reason}"))

    # c10d keeps a group's name on its backend objects, and this group has none, so the
    # name torch gives it is kept here (DeviceMesh, hence FSDP2, reads it).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        super()._set_group_name(name)  # type: ignore[arg-type]

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name torch.distributed gave this group."""
        return getattr(self, "_group_name", "")

    def getBackendName(self) -> str:  # noqa: N802 - the name c10d calls
        """The backend's name, ``"smp"``."""
        return BACKEND_NAME

    def shutdown(self) -> None:
        """Stop the collective thread once queued collectives are done."""
        self._calls.shutdown()

    def _nccl_group(self) -> Any:
        if self._nccl is None:
            self._nccl = dist.ProcessGroupNCCL(  # type: ignore[call-arg]
                dist.PrefixStore("smp-nccl/", self._store), self.rank(), self.size()
            )
        return self._nccl

    def _fallback(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The group for ``tensors`` if they are not CPU tensors, else ``None``."""
        if any(t.device.type != "cpu" for t in tensors):
            if any(t.device.type == "cuda" for t in tensors):
                return self._nccl_group()
            raise ValueError(f"smp backend: unsupported device {tensors[0].device}")
        return None

    # -- the collectives it implements ---------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """In-place all-reduce of each tensor (one per device; here one CPU tensor)."""
        # The express path first: what a small all-reduce costs is mostly this method's own
        # Python, so it tests as little as it can before the one C call.
        fast = self._express
        if fast is not None and opts is not None and len(tensors) == 1:
            t = tensors[0]
            if t.is_cpu and t.is_contiguous():
                # Sum, the common reduction, by one comparison (0.25 us); others by their
                # enum's integer (reading it costs 0.7 us).
                red = opts.reduceOp
                name = "sum" if red == _SUM else _RED_OP_VALUES.get(red.op.value)
                if name is not None and (
                    work := self._calls.express(fast.all_reduce, tensors, opts, t, name)
                ) is not None:
                    return work
        opts = opts if opts is not None else c10d.AllreduceOptions()
        if not all(t.is_cpu for t in tensors) and (other := self._fallback(tensors)) is not None:
            return other.allreduce(tensors, opts)
        op = self._reduce_op(opts.reduceOp)
        for t in tensors:
            check_reduce(t.dtype, op)

        if self._quick is not None and len(tensors) == 1 and tensors[0].is_contiguous():
            t = tensors[0]
            quick = self._quick
            return self._calls.submit(
                lambda: quick.all_reduce(t, op), tensors, _nbytes(tensors),
                lambda: quick.quick_all_reduce(t, op), opts,
            )

        def run() -> None:
            for t in tensors:
                if t.is_contiguous():
                    self._coll.all_reduce(flat(t), op)
                else:
                    buf = flat(t)
                    self._coll.all_reduce(buf, op)
                    t.copy_(buf.view(t.shape))

        return self._calls.submit(run, tensors, _nbytes(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """All-reduce of several tensors of one dtype as one flat buffer."""
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        if (other := self._fallback(tensors)) is not None:
            return other.allreduce_coalesced(tensors, opts)
        op = self._reduce_op(opts.reduceOp)
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError("smp backend: allreduce_coalesced needs tensors of one dtype")
        for t in tensors:
            check_reduce(t.dtype, op)

        def run() -> None:
            buf = torch.cat([t.reshape(-1) for t in tensors])
            self._coll.all_reduce(buf, op)
            at = 0
            for t in tensors:
                t.copy_(buf[at : at + t.numel()].view(t.shape))
                at += t.numel()

        return self._calls.submit(run, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """Every rank's tensor = the root's."""
        opts = opts if opts is not None else c10d.BroadcastOptions()
        if (other := self._fallback(tensors)) is not None:
            return other.broadcast(tensors, opts)
        root = opts.rootRank
        if self._quick is not None and len(tensors) == 1 and tensors[0].is_contiguous():
            t, quick = tensors[0], self._quick
            return self._calls.submit(
                lambda: quick.broadcast(flat(t), root), tensors, _nbytes(tensors),
                lambda: quick.quick_broadcast(t, root), opts,
            )

        def run() -> None:
            for t in tensors:
                buf = flat(t)
                self._coll.broadcast(buf, root)
                if not t.is_contiguous():
                    t.copy_(buf.view(t.shape))

        return self._calls.submit(run, tensors, _nbytes(tensors))

    def barrier(self, opts: Any = None) -> Work:
        """Completes once every rank of the group has called it."""
        fast = self._express
        if fast is not None and (work := self._calls.express(fast.barrier, [], opts)) is not None:
            return work
        quick = self._quick
        return self._calls.submit(
            self._coll.barrier, [], 0, quick.quick_barrier if quick else None, opts
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        """``all_gather_into_tensor``: ``output`` = every rank's ``input``, in rank order."""
        if (other := self._fallback([output, input])) is not None:
            return other._allgather_base(output, input, opts or c10d.AllgatherOptions())
        self._check_sizes(output, input, self.size(), "all_gather_into_tensor")
        if self._quick is not None and output.is_contiguous() and input.is_contiguous():
            quick = self._quick
            return self._calls.submit(
                lambda: quick.all_gather(flat(output), flat(input)), [output],
                _nbytes([output]), lambda: quick.quick_all_gather(output, input), opts,
            )

        def run() -> None:
            out = flat(output) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype)
            self._coll.all_gather(out, flat(input))
            if not output.is_contiguous():
                output.copy_(out.view(output.shape))

        return self._calls.submit(run, [output], _nbytes([output]))

    _allgather_base = all_gather_single  # the name torch used before 2.13

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """Several ``all_gather_into_tensor`` in one call (what functional collectives,
        hence DTensor and FSDP2, call for ``all_gather_tensor``)."""
        return self._coalesced(outputs, inputs, self.all_gather_single, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # older name

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        """``all_gather``: ``output_tensors[0][r]`` = rank ``r``'s ``input_tensors[0]``."""
        if (other := self._fallback([*input_tensors, *output_tensors[0]])) is not None:
            return other.allgather(output_tensors, input_tensors, opts or c10d.AllgatherOptions())
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise ValueError("smp backend: all_gather takes one input tensor per rank")
        inp, outs = input_tensors[0], output_tensors[0]
        if len(outs) != self.size() or any(
            o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs
        ):
            raise ValueError("smp backend: all_gather needs size() outputs shaped like the input")

        def run() -> None:
            gathered = torch.empty((self.size(), inp.numel()), dtype=inp.dtype)
            self._coll.all_gather(gathered.view(-1), flat(inp))
            for o, row in zip(outs, gathered):
                o.copy_(row.view(o.shape))

        return self._calls.submit(run, outs)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None  # noqa: A002
    ) -> Work:
        """``reduce_scatter_tensor``: ``output`` = the reduction of block ``rank`` of
        every rank's ``input``."""
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if (other := self._fallback([output, input])) is not None:
            return other._reduce_scatter_base(output, input, opts)
        op = self._reduce_op(opts.reduceOp)
        check_reduce(input.dtype, op)
        self._check_sizes(input, output, self.size(), "reduce_scatter_tensor")

        def run() -> None:
            out = flat(output) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype)
            self._coll.reduce_scatter(out, flat(input), op)
            if not output.is_contiguous():
                output.copy_(out.view(output.shape))

        return self._calls.submit(run, [output], _nbytes([input]))

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # pre-2.13 name

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """Several ``reduce_scatter_tensor`` in one call (functional collectives'
        ``reduce_scatter_tensor``)."""
        return self._coalesced(outputs, inputs, self.reduce_scatter_single, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # older name

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Work:
        """``reduce_scatter``: ``output_tensors[0]`` = the reduction over ranks of
        ``input_tensors[0][rank]``."""
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        if (other := self._fallback([*output_tensors, *input_tensors[0]])) is not None:
            return other.reduce_scatter(output_tensors, input_tensors, opts)
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError("smp backend: reduce_scatter takes one output tensor per rank")
        out, ins = output_tensors[0], input_tensors[0]
        if len(ins) != self.size() or any(
            i.numel() != out.numel() or i.dtype != out.dtype for i in ins
        ):
            raise ValueError("smp backend: reduce_scatter needs size() inputs shaped like output")
        op = self._reduce_op(opts.reduceOp)
        check_reduce(out.dtype, op)

        def run() -> None:
            stacked = torch.cat([i.reshape(-1) for i in ins])
            buf = torch.empty(out.numel(), dtype=out.dtype)
            self._coll.reduce_scatter(buf, stacked, op)
            out.copy_(buf.view(out.shape))

        return self._calls.submit(run, [out])

    # -- everything else: gloo (CPU) or NCCL (CUDA) ---------------------------------------
    def _other(self, tensors: Sequence[torch.Tensor]) -> Any:
        return self._fallback(tensors) or self._gloo

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any) -> Work:  # noqa: A002
        """``all_to_all_single``: through the segment for equal blocks (no split sizes) of CPU
        tensors on one host (what smp-tp's per-linear split moves, activations every
        microbatch); by gloo (split sizes, a group across hosts) or NCCL otherwise."""
        # Equal blocks only when no split sizes are given: the choice of path must be the
        # same on every rank, and split sizes are each rank's own (expert routing's can be
        # equal on one rank and not on another: one rank in the segment, another in gloo).
        splits = any(len(a) for a in args[:2])
        n = self.size()
        quick = self._quick
        if (
            quick is None or splits or self._fallback([output, input]) is not None
            or output.dtype != input.dtype or output.numel() != input.numel()
            or input.dim() == 0 or input.shape[0] % n or output.shape[0] % n
        ):
            return self._other([output, input]).alltoall_base(output, input, *args)

        def run() -> None:
            src = input if input.is_contiguous() else input.contiguous()
            dst = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
            quick.all_to_all(dst, src)
            if dst is not output:
                output.copy_(dst)

        return self._calls.submit(run, [output], _nbytes([input]))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *args: Any) -> Work:
        """``all_to_all``, by gloo or NCCL."""
        return self._other([*outputs, *inputs]).alltoall(outputs, inputs, *args)

    def allgather_coalesced(self, outputs: Any, inputs: list[torch.Tensor], *args: Any) -> Work:
        """``all_gather_coalesced``, by gloo or NCCL."""
        return self._other(inputs).allgather_coalesced(outputs, inputs, *args)

    def reduce(self, tensors: list[torch.Tensor], *args: Any) -> Work:  # type: ignore[override]
        """``reduce``, by gloo or NCCL."""
        return self._other(tensors).reduce(tensors, *args)

    def gather(self, outputs: Any, inputs: list[torch.Tensor], *args: Any) -> Work:  # type: ignore[override]
        """``gather``, by gloo or NCCL."""
        return self._other(inputs).gather(outputs, inputs, *args)

    def scatter(self, outputs: list[torch.Tensor], inputs: Any, *args: Any) -> Work:  # type: ignore[override]
        """``scatter``, by gloo or NCCL."""
        return self._other(outputs).scatter(outputs, inputs, *args)

    def _mpi(self, tensors: Sequence[torch.Tensor]) -> torch_p2p.MpiPointToPoint | None:
        """The MPI point to point for a single CPU tensor, if the group has one."""
        p2p = self._p2p
        return p2p if p2p is not None and len(tensors) == 1 and tensors[0].is_cpu else None

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        """Point-to-point send: over MPI from the tensor's memory (a job under MPI), else
        by gloo; CUDA tensors by NCCL."""
        if (p2p := self._mpi(tensors)) is not None:
            return p2p.send(tensors[0], dst, tag)
        return self._other(tensors).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        """Point-to-point receive: over MPI into the caller's tensor (a job under MPI), else
        by gloo; CUDA tensors by NCCL."""
        if (p2p := self._mpi(tensors)) is not None:
            return p2p.recv(tensors[0], src, tag)
        return self._other(tensors).recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """Receive from any rank: over MPI (a job under MPI), else by gloo."""
        if (p2p := self._mpi(tensors)) is not None:
            return p2p.recv(tensors[0], -1, tag)
        return self._gloo.recv_anysource(tensors, tag)  # type: ignore[attr-defined]

    # -- helpers -------------------------------------------------------------------------
    def _coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
        one: Callable[[torch.Tensor, torch.Tensor, Any], Work], opts: Any,
    ) -> Work:
        if len(outputs) != len(inputs):
            raise ValueError(
                f"smp backend: {len(outputs)} outputs for {len(inputs)} inputs in a coalesced call"
            )
        works = [one(o, i, opts) for o, i in zip(outputs, inputs)]
        if len(works) == 1:
            return works[0]
        # One handle for all: the collective thread runs them in order, so the last one done
        # means every one is; an error of any is raised by the waiter.
        def run() -> None:
            for w in works:
                w.wait()

        return self._calls.submit(run, outputs)

    @staticmethod
    def _reduce_op(op: Any) -> str:
        kind = op.op if isinstance(op, ReduceOp) else op  # type: ignore[attr-defined]
        name = _RED_OP_VALUES.get(kind.value)
        if name is None:
            raise ValueError(f"smp backend: unsupported reduction {op} on CPU")
        return name

    @staticmethod
    def _check_sizes(big: torch.Tensor, small: torch.Tensor, n: int, what: str) -> None:
        if big.dtype != small.dtype:
            raise ValueError(f"smp backend: {what}: dtypes differ ({big.dtype}, {small.dtype})")
        if big.numel() != n * small.numel():
            raise ValueError(
                f"smp backend: {what}: {big.numel()} elements is not {n} x {small.numel()}"
            )


def create_backend(opts: Any, _backend_options: Any = None) -> SmpProcessGroup:
    """The creator torch calls for ``init_process_group("smp")`` / ``new_group(backend="smp")``
    (its extended form: it carries the group's job-wide ranks, which errors name)."""
    return SmpProcessGroup(
        opts.store, opts.group_rank, opts.group_size, opts.timeout,
        list(opts.global_ranks_in_group or []),
    )


if BACKEND_NAME.upper() not in dist.Backend._plugins:  # importing twice registers once
    dist.Backend.register_backend(
        BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
