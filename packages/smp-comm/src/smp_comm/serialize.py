"""Split a Python object into a pickled skeleton plus raw tensor bytes, and back.

Each torch tensor / numpy array found anywhere in the object (lists, tuples, dicts,
dataclasses, namedtuples, any picklable class) is replaced by a :class:`TensorStub` through
pickle's persistent-id hook, so the skeleton stays small and the tensor bytes can travel by
whichever path the router picks. The same tensor object referenced twice is sent once and
arrives as one tensor referenced twice.

torch is optional: without it only numpy arrays are split out.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from smp_comm.hugepages import advise_huge_pages

try:  # torch is an optional dependency
    import torch
except ImportError:  # pragma: no cover - exercised by the no-torch test in a subprocess
    torch = None  # type: ignore[assignment]

__all__ = ["ALIGN", "Packed", "TensorStub", "pack", "unpack", "new_buffers", "torch"]

ALIGN = 64  # byte alignment of each tensor inside a direct-path region


class TensorStub(NamedTuple):
    """Stands in for one tensor/array in the pickled skeleton.

    ``offset`` is the byte offset of the tensor's bytes inside the message payload (the
    reserved region for direct paths, ``ALIGN``-aligned); ``device`` is where the sender
    had it. (A named tuple: cheap to build and to pickle, which small messages feel.)
    """

    id: int
    kind: str  # "torch" or "numpy"
    dtype: Any  # torch dtype name ("bfloat16") or a numpy dtype
    shape: tuple[int, ...]
    nbytes: int
    requires_grad: bool = False
    device: str = "cpu"
    offset: int = 0


@dataclass
class Packed:
    """A serialized object: skeleton bytes, one stub and one byte source per tensor."""

    skeleton: bytes
    stubs: list[TensorStub]
    # Per stub: a flat uint8 numpy array (CPU) or a flat uint8 torch tensor (GPU).
    sources: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stubs)

    @property
    def region_bytes(self) -> int:
        """Bytes needed to lay every tensor out at ``ALIGN``-aligned offsets."""
        return _layout([s.nbytes for s in self.stubs])[1]

    def on_gpu(self) -> list[bool]:
        return [s.device.startswith("cuda") for s in self.stubs]


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += (n + ALIGN - 1) // ALIGN * ALIGN
    return offsets, pos


_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> "float32" (str() of a dtype is not free)


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _torch_bytes(t: Any, idx: int, offset: int) -> tuple[TensorStub, Any]:
    src = t.detach()
    if src.is_conj():
        src = src.resolve_conj()
    if src.is_neg():
        src = src.resolve_neg()
    if not src.is_contiguous():
        src = src.contiguous()  # non-contiguous -> one contiguous copy
    if src.device.type == "cpu" and src.dtype in _NUMPY_DTYPES:
        # numpy reshapes and reinterprets bytes faster than torch views, which small
        # messages feel (docs/perf-notes.md).
        flat: Any = src.numpy().reshape(-1).view(np.uint8)
        device = "cpu"
    else:
        flat = src.reshape(-1).view(torch.uint8)
        device = str(t.device)
        if not flat.is_cuda:
            flat = flat.numpy()
    stub = TensorStub(
        idx,
        "torch",
        _dtype_name(t.dtype),
        tuple(t.shape),
        flat.nbytes if isinstance(flat, np.ndarray) else flat.numel(),
        bool(t.requires_grad),
        device,
        offset,
    )
    return stub, flat


def _numpy_bytes(a: np.ndarray, idx: int, offset: int) -> tuple[TensorStub, Any]:
    src = np.ascontiguousarray(a)
    flat = src.reshape(-1).view(np.uint8)
    stub = TensorStub(idx, "numpy", a.dtype, tuple(a.shape), flat.size, False, "cpu", offset)
    return stub, flat


def _splittable_tensor(obj: Any) -> bool:
    return (
        torch is not None
        and isinstance(obj, torch.Tensor)
        and obj.layout == torch.strided
        and obj.device.type in ("cpu", "cuda")
        and not obj.is_quantized
    )


# torch dtypes that numpy can view (bfloat16, float8, ... go through torch views).
_NUMPY_DTYPES = (
    frozenset(
        {
            torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
            torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
        }
    )
    if torch is not None
    else frozenset()
)


# Types that never hold tensor bytes of their own (containers are looked into by pickle).
_PLAIN = frozenset({str, int, float, bool, type(None), bytes, tuple, list, dict})


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.stubs: list[TensorStub] = []
        self.sources: list[Any] = []
        self._seen: dict[int, int] = {}
        self._end = 0  # payload bytes laid out so far
        self._keep: list[Any] = []  # keeps id()s unique while pickling

    def persistent_id(self, obj: Any) -> int | None:
        # Called for every object pickled (each key, int, string): plain types leave first.
        if type(obj) in _PLAIN:
            return None
        make: Callable[[Any, int, int], tuple[TensorStub, Any]]
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject or obj.dtype.itemsize == 0:
                return None  # object arrays have no raw bytes to move: pickle them whole
            make = _numpy_bytes
        elif _splittable_tensor(obj):
            make = _torch_bytes
        else:
            return None
        key = id(obj)
        if key in self._seen:
            return self._seen[key]
        idx = len(self.stubs)
        stub, src = make(obj, idx, self._end)
        self._end += (stub.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.stubs.append(stub)
        self.sources.append(src)
        self._seen[key] = idx
        self._keep.append(obj)
        return idx


def pack(obj: Any) -> Packed:
    """Serialize ``obj``: tensors/arrays become stubs with their payload offsets assigned."""
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    return Packed(buf.getvalue(), p.stubs, p.sources)


def new_buffers(stubs: list[TensorStub], rank: int) -> tuple[list[Any], list[np.ndarray]]:
    """Allocate host memory for incoming tensors.

    Returns ``(finals, byte_views)``: the tensor/array objects to hand to the user (shaped,
    typed) and flat uint8 numpy views of the same memory to receive the bytes into.
    """
    finals: list[Any] = []
    views: list[np.ndarray] = []
    for s in stubs:
        if s.kind == "torch":
            if torch is None:
                raise ImportError(
                    f"smp-comm rank {rank}: a message holds torch tensors but torch is not importable"
                )
            raw = torch.empty(s.nbytes, dtype=torch.uint8)
            advise_huge_pages(raw.data_ptr(), s.nbytes)  # before the first touch
            t = raw.view(getattr(torch, s.dtype)).view(s.shape)
            views.append(raw.numpy())
            finals.append(t)
        else:
            raw_np = np.empty(s.nbytes, dtype=np.uint8)
            views.append(raw_np)
            finals.append(raw_np.view(s.dtype).reshape(s.shape))
    return finals, views


def out_buffers(stubs: list[TensorStub], out: Any) -> tuple[list[Any], list[np.ndarray]] | None:
    """``new_buffers``' result made of the caller's tensor ``out`` (``irecv(out=...)``): when
    the message is that one tensor, of ``out``'s shape and dtype; else ``None`` (the message
    lands in new buffers and the handle reports the mismatch)."""
    if len(stubs) != 1 or stubs[0].kind != "torch" or torch is None:
        return None
    s = stubs[0]
    if getattr(torch, s.dtype) != out.dtype or tuple(s.shape) != tuple(out.shape):
        return None
    raw = out.view(-1).view(torch.uint8) if s.nbytes else torch.empty(0, dtype=torch.uint8)
    return [out], [raw.numpy()]


def from_blobs(stubs: list[TensorStub], blobs: list[bytes], rank: int) -> list[Any]:
    """Tensors/arrays for an inline payload (``blobs[i]`` holds stub ``i``'s bytes)."""
    out: list[Any] = []
    for s, b in zip(stubs, blobs):
        if s.kind == "torch":
            if torch is None:
                raise ImportError(
                    f"smp-comm rank {rank}: a message holds torch tensors but torch is not importable"
                )
            dtype = getattr(torch, s.dtype)
            if s.nbytes:  # typed straight from the bytes: one view less per tensor
                out.append(torch.frombuffer(bytearray(b), dtype=dtype).view(s.shape))
            else:
                out.append(torch.empty(s.shape, dtype=dtype))
        else:
            out.append(np.frombuffer(bytearray(b), dtype=np.uint8).view(s.dtype).reshape(s.shape))
    return out


def finish_tensor(stub: TensorStub, value: Any) -> Any:
    """Restore device placement and the requires_grad flag of a received tensor."""
    if stub.kind != "torch":
        return value
    if stub.device.startswith("cuda") and value.device.type != "cuda" and torch.cuda.is_available():
        value = value.to(torch.device("cuda", torch.cuda.current_device()))
    if stub.requires_grad and (value.is_floating_point() or value.is_complex()):
        value.requires_grad_(True)
    return value


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, values: list[Any]) -> None:
        super().__init__(file)
        self._values = values

    def persistent_load(self, pid: Any) -> Any:
        return self._values[pid]


def unpack(skeleton: bytes, values: list[Any]) -> Any:
    """Rebuild the object, putting ``values[i]`` where stub ``i`` stood."""
    return _Unpickler(io.BytesIO(skeleton), values).load()
