"""Communicator settings: constructor keyword arguments, else environment variables.

=============================  ==================================  ===========================
setting (kwarg)                environment variable                default
=============================  ==================================  ===========================
``buffer_bytes``               ``SMP_COMM_BUFFER_BYTES``           128 MiB (host receive buffer
                                                                   per path, split among the
                                                                   peers that may write to it)
``gpu_buffer_bytes``           ``SMP_COMM_GPU_BUFFER_BYTES``       256 MiB (CUDA receive buffer)
``inline_bytes``               ``SMP_COMM_INLINE_BYTES``           16 KiB (smaller payloads ride
                                                                   inside the MPI header)
``small_message_bytes``        ``SMP_COMM_SMALL_MESSAGE_BYTES``    192 KiB: a lone CPU tensor or
                                                                   array up to this size takes
                                                                   the fast path (see
                                                                   :mod:`smp_comm.fastpath`);
                                                                   0 turns it off
``caller_copy_bytes``          ``SMP_COMM_CALLER_COPY_BYTES``      1 MiB: CPU payloads up to this
                                                                   size are routed and copied on
                                                                   the sending thread, and
                                                                   rebuilt on the thread that
                                                                   probes them (no hand-off to
                                                                   the router/copy/post threads)
``stream_min_bytes``           ``SMP_COMM_STREAM_MIN_BYTES``       0 (off): a CPU payload at least
                                                                   this large that finds no room
                                                                   in a host buffer streams
                                                                   through it in chunks
                                                                   (:mod:`smp_comm.stream`);
                                                                   0: never (the MPI fallback)
``single_copy_min_bytes``      ``SMP_COMM_SINGLE_COPY_MIN_BYTES``  4 MiB: a lone CPU tensor at
                                                                   least this large, sent to a
                                                                   node peer that receives into
                                                                   ``irecv(out=...)``, is read by
                                                                   the receiver straight from
                                                                   the sender's memory (one
                                                                   copy; :mod:`smp_comm.cma`);
                                                                   0: never
``disable``                    ``SMP_COMM_DISABLE``                none; e.g. ``"shm,rma"``
``node_id``                    ``SMP_COMM_NODE_ID``                real node (shared-memory
                                                                   domain); ``"{rank}"`` is
                                                                   replaced by the rank
``shm_zero_copy``              ``SMP_COMM_SHM_ZERO_COPY``          1: shm receives are views of
                                                                   the receive buffer, freed
                                                                   when garbage collected; 0:
                                                                   copied out at once
``close_timeout``              ``SMP_COMM_CLOSE_TIMEOUT``          60 s
``poll_spin``                  ``SMP_COMM_POLL_SPIN``              ``auto``: 0.002 s of busy
                                                                   polling after the last event,
                                                                   then sleep; 0 (sleep at once)
                                                                   when this node runs more
                                                                   ranks than it has cores
``doorbell``                   ``SMP_COMM_DOORBELL``               1: when all ranks share one
                                                                   Linux host, an idle tracker
                                                                   sleeps until a sender wakes
                                                                   it (:mod:`smp_comm.doorbell`);
                                                                   0: it polls every 1 ms
``compiled``                   ``SMP_COMM_COMPILED``               1: the small-message fast path
                                                                   runs in C, built on first use
                                                                   (:mod:`smp_comm.compiled`;
                                                                   Python if it cannot be
                                                                   built); 0: Python only
=============================  ==================================  ===========================

Sizes accept a plain integer or a suffix ``K``, ``M``, ``G`` (powers of 1024).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["DIRECT_PATHS", "PATHS", "SPIN_S", "CommSettings", "auto_poll_spin", "parse_bytes"]

PATHS = ("mpi", "shm", "cuda_ipc", "rma")
DIRECT_PATHS = ("shm", "cuda_ipc", "rma")

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(value: str | int, name: str) -> int:
    """``"64M"`` -> 67108864; raises ``ValueError`` naming the setting on bad input."""
    if isinstance(value, int):
        n = value
    else:
        text = value.strip().upper().removesuffix("B").removesuffix("I")
        scale = 1
        if text and text[-1] in _SUFFIX:
            scale = _SUFFIX[text[-1]]
            text = text[:-1]
        try:
            n = int(float(text) * scale)
        except ValueError:
            raise ValueError(f"smp-comm setting {name}={value!r} is not a byte size") from None
    if n < 0:
        raise ValueError(f"smp-comm setting {name}={value!r} must be >= 0")
    return n


@dataclass(frozen=True)
class CommSettings:
    """Resolved settings of one :class:`~smp_comm.Communicator` (see the module docstring)."""

    buffer_bytes: int = 128 << 20
    gpu_buffer_bytes: int = 256 << 20
    inline_bytes: int = 16 << 10
    # Up to ~192 KiB one frame beats the general path (pickled header, shm copy, tracker
    # hand-off) in latency and in a stream; beyond, the stream is faster on the general path
    # (docs/packages/smp-comm.md, "Why 192 KiB").
    small_message_bytes: int = 192 << 10
    caller_copy_bytes: int = 1 << 20
    stream_min_bytes: int = 0
    single_copy_min_bytes: int = 4 << 20
    disable: frozenset[str] = field(default_factory=frozenset)
    node_id: str | None = None
    shm_zero_copy: bool = True
    close_timeout: float = 60.0
    poll_spin: float | None = None  # None: "auto", resolved by the Communicator (auto_poll_spin)
    doorbell: bool = True
    compiled: bool = True

    @classmethod
    def resolve(
        cls,
        rank: int,
        buffer_bytes: int | str | None = None,
        gpu_buffer_bytes: int | str | None = None,
        inline_bytes: int | str | None = None,
        small_message_bytes: int | str | None = None,
        caller_copy_bytes: int | str | None = None,
        stream_min_bytes: int | str | None = None,
        single_copy_min_bytes: int | str | None = None,
        disable: str | set[str] | frozenset[str] | list[str] | tuple[str, ...] | None = None,
        node_id: str | int | None = None,
        shm_zero_copy: bool | None = None,
        close_timeout: float | None = None,
        poll_spin: float | None = None,
        doorbell: bool | None = None,
        compiled: bool | None = None,
    ) -> CommSettings:
        """Keyword arguments win over ``SMP_COMM_*`` environment variables, which win over defaults."""
        env = os.environ

        def size(arg: int | str | None, var: str, default: int) -> int:
            raw = arg if arg is not None else env.get(var)
            return default if raw is None or raw == "" else parse_bytes(raw, var)

        raw_disable: object = disable if disable is not None else env.get("SMP_COMM_DISABLE", "")
        if isinstance(raw_disable, str):
            names = {p.strip() for p in raw_disable.split(",") if p.strip()}
        else:
            names = {str(p) for p in raw_disable}  # type: ignore[attr-defined]
        unknown = names - set(DIRECT_PATHS)
        if unknown:
            raise ValueError(
                f"smp-comm setting disable={sorted(unknown)}: only direct paths "
                f"{list(DIRECT_PATHS)} can be disabled (mpi is the fallback)"
            )
        raw_node = node_id if node_id is not None else env.get("SMP_COMM_NODE_ID") or None
        node = None if raw_node is None else str(raw_node).replace("{rank}", str(rank))
        ct = (
            close_timeout
            if close_timeout is not None
            else float(env.get("SMP_COMM_CLOSE_TIMEOUT", 60))
        )
        ps = poll_spin
        if ps is None:
            raw_spin = env.get("SMP_COMM_POLL_SPIN", "auto").strip().lower()
            ps = None if raw_spin in ("", "auto") else float(raw_spin)
        if shm_zero_copy is None:
            shm_zero_copy = _flag(env, "SMP_COMM_SHM_ZERO_COPY")
        if doorbell is None:
            doorbell = _flag(env, "SMP_COMM_DOORBELL")
        if compiled is None:
            compiled = _flag(env, "SMP_COMM_COMPILED")
        return cls(
            buffer_bytes=size(buffer_bytes, "SMP_COMM_BUFFER_BYTES", cls.buffer_bytes),
            gpu_buffer_bytes=size(
                gpu_buffer_bytes, "SMP_COMM_GPU_BUFFER_BYTES", cls.gpu_buffer_bytes
            ),
            inline_bytes=size(inline_bytes, "SMP_COMM_INLINE_BYTES", cls.inline_bytes),
            small_message_bytes=size(
                small_message_bytes, "SMP_COMM_SMALL_MESSAGE_BYTES", cls.small_message_bytes
            ),
            caller_copy_bytes=size(
                caller_copy_bytes, "SMP_COMM_CALLER_COPY_BYTES", cls.caller_copy_bytes
            ),
            stream_min_bytes=size(
                stream_min_bytes, "SMP_COMM_STREAM_MIN_BYTES", cls.stream_min_bytes
            ),
            single_copy_min_bytes=size(
                single_copy_min_bytes,
                "SMP_COMM_SINGLE_COPY_MIN_BYTES",
                cls.single_copy_min_bytes,
            ),
            disable=frozenset(names),
            node_id=node,
            shm_zero_copy=bool(shm_zero_copy),
            close_timeout=ct,
            poll_spin=ps,
            doorbell=bool(doorbell),
            compiled=bool(compiled),
        )


# Busy polling after the last event, where the node's ranks each have a core.
SPIN_S = 0.002


def auto_poll_spin(ranks_on_node: int, cores: int | None) -> float:
    """``poll_spin``'s ``auto`` value: spin (``SPIN_S``) only where every rank of the node can
    have a core of its own. A rank that spins on a shared core takes the CPU from the very
    rank whose message it waits for, and since a waiting thread sleeps on its own doorbell
    (:mod:`smp_comm.doorbell`) a sleep costs one wake-up, so it sleeps at once there
    (docs/perf-notes.md, "Waiting on the doorbell")."""
    return SPIN_S if cores is None or ranks_on_node <= cores else 0.0


def _flag(env: os._Environ[str], var: str) -> bool:
    raw = env.get(var, "1").strip().lower()
    if raw not in ("0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"smp-comm setting {var}={raw!r}: use 0 or 1")
    return raw in ("1", "true", "yes")
