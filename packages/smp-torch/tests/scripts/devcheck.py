"""Test-only: refuse a tensor handed to a ``torch.distributed`` collective on a device its
group does not serve, on a machine without a GPU (issue 42).

On CUDA smp's groups are NCCL groups, which take CUDA tensors only: a flag made with
``torch.tensor([...])`` (the default device: the host) breaks the job there, while on a CPU
test machine it is just another CPU tensor. Both the right tensors (on ``ctx.device``) and the
wrong ones are CPU tensors here, so this module keeps a second, *virtual* device per tensor:

* :class:`HostTracker`, a ``TorchFunctionMode`` entered in every Python thread of the process
  (:func:`install` wraps ``threading.Thread.run``: modes are thread-local, and smp runs steps,
  pipeline stages and its reducer's hooks on helper threads), marks as **host** what would be
  on the host on a GPU machine:

  - what a factory (``torch.zeros``, ``torch.tensor``, ... every function
    ``torch.set_default_device`` redirects) makes without a device, or with the device spelled
    as the *string* ``"cpu"`` (how code says "the host"; a ``torch.device`` object, such as
    ``ctx.device`` or ``t.device``, is the device the code computed: here the stand-in for
    CUDA);
  - ``torch.from_numpy``/``torch.frombuffer``, ``Tensor.cpu()``, ``Tensor.to("cpu")``, and
    every tensor ``torch.load`` returns;
  - a ``nn.Parameter`` around host data (``Parameter.__new__`` is wrapped: no mode sees it);
  - the result of any other op whose tensor inputs are *all* host. One input on the device
    makes the result a device tensor, as CUDA does when it combines a device tensor with a
    0-dim CPU scalar. An in-place op keeps its target's mark. When smp_torch's own code
    combines a host tensor of one or more dimensions with a device tensor (``torch.cat`` of
    device gradients and host flags), CUDA would refuse the op: the tracker raises
    :class:`DeviceMismatchError` there (only for smp_torch's calls: smp-tp's numpy mask
    packing is a CPU-only branch a GPU run never takes).

  Everything else counts as on the device smp drives: tensors made or moved with an explicit
  ``torch.device``, gradients (autograd puts them beside their parameter), FSDP2's and
  DTensor's buffers (made on their mesh's device). Marks live in a weak table keyed by tensor
  identity, so nothing is added to tensors (or to what ``torch.save`` writes).

* :func:`install` replaces the ``torch.distributed`` collectives and point-to-point calls
  (before smp and smp-tp import, which bind some of them at import) with checked versions:
  every tensor argument must be on the device its group declares (:meth:`DeviceCheck.declare`;
  by default every group serves ``"cuda"``, as on a GPU machine where smp's groups are NCCL),
  else :class:`DeviceMismatchError` names the collective, its caller, the tensor's device and
  where it was put on the host, *before* anything is sent: every rank raises alike, none
  hangs. Object collectives (``*_object*``) are not checked: they stage through the host by
  design, and smp moves objects over MPI.

:attr:`DeviceCheck.calls` counts the checked calls per (caller file, caller function,
collective), so a test can show that the call sites it claims were really exercised.

A checked function that torch calls from inside another (``batch_isend_irecv``'s ``isend``,
a collective handing itself to a torch-function mode) is checked once, at the outer call.

What this cannot see: a tensor made with an explicit ``torch.device("cpu")`` object (it
counts as on the device), collectives issued below ``torch.distributed``'s Python functions
(DTensor's functional collectives), threads whose class overrides ``run`` (not tracked),
and code that only runs on a real GPU (branches on ``device.type == "cuda"``, such as the
reducer's ``wait`` on NCCL work).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ACCELERATOR", "DeviceCheck", "DeviceMismatchError", "HostTracker", "install"]

#: The device every group serves unless declared otherwise: what smp's groups serve on a GPU.
ACCELERATOR = "cuda"

# The collectives and point-to-point calls smp and smp-tp use, and the rest of the family.
CHECKED = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_FACTORIES = frozenset(_device_constructors())
_ALWAYS_HOST = frozenset({torch.from_numpy, torch.frombuffer})
_TO, _CPU, _CUDA = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda
# ``t.data = other`` (the setter of this descriptor): the tensor object now holds other's
# storage, so it takes other's mark.
_DATA = torch._C.TensorBase.__dict__["data"]

#: Code objects whose frames an origin or call site never names (a test's wrappers).
SKIP_CODE: set[Any] = set()

# tensor -> where it was put on the host (for the error message).
_HOST: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LOCK = threading.RLock()


class DeviceMismatchError(RuntimeError):
    """A collective was handed a tensor on a device its group does not serve."""


def _site(skip: int = 1) -> str:
    """``file:line (function)`` of the nearest frame outside torch and this module."""
    frame = sys._getframe(skip)
    while frame is not None:
        path = frame.f_code.co_filename
        if (
            not path.startswith(_TORCH_DIR)
            and os.path.abspath(path) != _THIS_FILE
            and frame.f_code not in SKIP_CODE
        ):
            return f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return "<torch internals>"


def _short(path: str) -> str:
    parts = path.split(os.sep)
    return os.sep.join(parts[-2:])


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or nested lists/tuples/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def host_origin(t: torch.Tensor) -> str | None:
    """Where ``t`` was put on the host, or None when it counts as on the device."""
    with _LOCK:
        return _HOST.get(t)


def mark_host(obj: Any, origin: str) -> None:
    """Mark every tensor in ``obj`` as on the host (``origin``: how it got there)."""
    with _LOCK:
        for t in _tensors(obj):
            _HOST[t] = origin


def _unmark(obj: Any) -> None:
    with _LOCK:
        for t in _tensors(obj):
            _HOST.pop(t, None)


def _spells_host(device: Any) -> bool:
    """Whether a ``device`` argument means the host: none (the default device) or the string
    ``"cpu"``. A ``torch.device`` object or an index is the device the code computed."""
    if device is None:
        return True
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _to_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, Any]:
    """What ``Tensor.to(*args, **kwargs)`` moves to: ``("device", d)``, ``("other", t)`` or
    ``(None, None)`` (a dtype change only)."""
    if kwargs.get("device") is not None:
        return "device", kwargs["device"]
    if torch.is_tensor(kwargs.get("other")):
        return "other", kwargs["other"]
    if len(args) > 1:
        first = args[1]
        if torch.is_tensor(first):
            return "other", first
        if isinstance(first, (str, torch.device)) or (isinstance(first, int) and not isinstance(first, bool)):
            return "device", first
    return None, None


def _in_place(func: Any, kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    if kwargs.get("out") is not None:
        return True
    if name.startswith("__i") and name.endswith("__"):  # __iadd__, ...
        return True
    return name.endswith("_") and not name.endswith("__")


# Ops CUDA lets combine a device tensor with a host tensor of any shape: copies and indexing.
_MAY_MIX = frozenset({"copy_", "__getitem__", "__setitem__", "__set__", "__get__", "set_"})
_SMP_TORCH = f"{os.sep}smp_torch{os.sep}"


def _refuse_mixing(name: str, inputs: list[torch.Tensor], origins: list[str | None]) -> None:
    """Raise when smp_torch's own code combines a host tensor of more than 0 dimensions with
    a device tensor in one op: CUDA refuses that (only a 0-dim host scalar may join device
    tensors), so the op cannot run on a GPU. Only smp_torch's calls: elsewhere (smp-tp's
    numpy mask packing, torch internals) a CPU-only branch legitimately makes host tensors
    that a GPU run would never see."""
    mixed = [o for t, o in zip(inputs, origins) if o is not None and t.dim() > 0]
    if not mixed or all(o is not None for o in origins):
        return
    site = _site()
    if _SMP_TORCH not in site and not site.startswith(f"smp_torch{os.sep}"):
        return
    raise DeviceMismatchError(
        f"device check: {name} at {site} combines a host tensor ({mixed[0]}) with tensors on "
        f"the device; CUDA refuses that, only 0-dim host tensors may join device ones"
    )


class HostTracker(TorchFunctionMode):
    """Marks the tensors that would be on the host on a GPU machine (see the module
    docstring). One instance per thread; the marks are shared."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, (torch.Tensor, list, tuple)):
            try:
                out = self._track(func, args, kwargs, out)
            except DeviceMismatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - the tracker must never break the run
                print(f"devcheck: tracking {func} failed: {exc!r}", file=sys.stderr, flush=True)
        return out

    def _track(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        name = getattr(func, "__name__", str(func))
        if func in _ALWAYS_HOST:
            mark_host(out, f"torch.{name} at {_site()}")
        elif func in _FACTORIES or kwargs.get("device") is not None:
            device = kwargs.get("device")
            if device is None and args and torch.is_tensor(args[0]):
                self._inherit(out, args[:1])  # torch.as_tensor(t): where t is
            elif _spells_host(device):
                how = "without a device" if device is None else f"on device {device!r}"
                mark_host(out, f"torch.{name} {how} at {_site()}")
            else:
                _unmark(out)
        elif func is _TO or func is _CPU or func is _CUDA:
            out = self._moved(func, args, kwargs, out)
        elif name == "__set__" and getattr(func, "__self__", None) is _DATA:
            origin = host_origin(args[1]) if torch.is_tensor(args[1]) else None
            if origin is None:
                _unmark(args[0])
            else:
                mark_host(args[0], origin)
        else:
            inputs = list(_tensors((args, kwargs)))
            origins = [host_origin(t) for t in inputs]
            if name not in _MAY_MIX:
                _refuse_mixing(name, inputs, origins)
            if not _in_place(func, kwargs) and origins and all(o is not None for o in origins):
                mark_host(out, origins[0])
        return out

    def _inherit(self, out: Any, inputs: Any) -> None:
        """``out`` is host when every tensor of ``inputs`` is (with the first one's origin)."""
        origins = [host_origin(t) for t in _tensors(inputs)]
        if origins and all(o is not None for o in origins):
            mark_host(out, origins[0])  # type: ignore[arg-type]

    def _moved(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        src = args[0]
        if func is _CUDA:
            kind, target = "device", 0
        elif func is _CPU:
            kind, target = "device", "cpu"
        else:
            kind, target = _to_target(args, kwargs)
        if kind is None:
            self._inherit(out, args[:1])
            return out
        if kind == "other":
            to_host = host_origin(target) is not None
        else:
            to_host = _spells_host(target)
        if not to_host:
            # (On CPU, a move to the device returns the tensor itself: it is now the moved
            # one, e.g. a parameter in module.to(ctx.device).)
            _unmark(out)
            return out
        if out is src and host_origin(src) is None:
            # A device tensor moved to the host: on a GPU a copy, here the tensor itself.
            # Mark a view, not the original, which stays on the device.
            out = out.view_as(out)
        how = "Tensor.cpu()" if func is _CPU else f"Tensor.to({target!r})" if kind == "device" else "Tensor.to(host tensor)"
        mark_host(out, f"{how} at {_site()}")
        return out


class DeviceCheck:
    """The installed checker: declared devices per group and counts of checked calls."""

    def __init__(self, accelerator: str = ACCELERATOR) -> None:
        self.accelerator = accelerator
        self._declared: dict[int, str] = {}
        self._lock = threading.Lock()
        #: (caller file, caller function, collective) -> calls checked
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self.originals: dict[str, Callable[..., Any]] = {}

    def declare(self, group: Any, device: str) -> None:
        """``group`` serves ``device`` (``"cpu"``: a host group, e.g. gloo for CPU tensors)."""
        self._declared[id(group)] = device

    def group_device(self, group: Any) -> str:
        """The device ``group`` serves (None: the default group)."""
        if group is None:
            group = dist.group.WORLD
        return self._declared.get(id(group), self.accelerator)

    def device_of(self, t: torch.Tensor) -> str:
        """``t``'s device on the machine being imitated: ``"cpu"`` for a host tensor, the
        accelerator for a CPU tensor that counts as on the device."""
        if host_origin(t) is not None:
            return "cpu"
        return self.accelerator if t.device.type == "cpu" else t.device.type

    def check(self, name: str, group: Any, tensors: list[tuple[str, torch.Tensor]], caller: Any) -> None:
        """Raise :class:`DeviceMismatchError` unless every tensor is on ``group``'s device."""
        code = caller.f_code
        where = f"{_short(code.co_filename)}:{caller.f_lineno} ({code.co_name})"
        with self._lock:
            self.calls[(os.path.basename(code.co_filename), code.co_name, name)] += 1
        serves = self.group_device(group)
        for arg, t in tensors:
            device = self.device_of(t)
            if device != serves:
                origin = host_origin(t)
                made = f"; it was put on the host by {origin}" if origin else ""
                raise DeviceMismatchError(
                    f"device check: torch.distributed.{name} called from {where} got {arg} "
                    f"(shape {tuple(t.shape)}, {t.dtype}) on device {device}, but its group "
                    f"serves {serves}{made}. Every tensor handed to a collective must be on "
                    f"the group's device (ctx.device)."
                )

    def summary(self, prefix: str = "") -> list[str]:
        """``caller-file:function:collective xN`` for every checked call site."""
        with self._lock:
            items = sorted(self.calls.items())
        return [f"{f}:{fn}:{name} x{n}" for (f, fn, name), n in items if f.startswith(prefix)]

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()


def _tensor_args(
    name: str, sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """(group, [(argument description, tensor)]) of a call of ``torch.distributed.<name>``."""
    bound = sig.bind_partial(*args, **kwargs)
    group = bound.arguments.get("group")
    found: list[tuple[str, torch.Tensor]] = []
    for param, value in bound.arguments.items():
        if name == "batch_isend_irecv" and param == "p2p_op_list":
            for i, op in enumerate(value):
                found.append((f"p2p_op_list[{i}].tensor", op.tensor))
                group = op.group if op.group is not None else group
            continue
        for i, t in enumerate(_tensors(value)):
            label = param if torch.is_tensor(value) else f"{param}[{i}]"
            found.append((label, t))
    return group, found


_CHECK: DeviceCheck | None = None
_INSIDE = threading.local()


def _checked(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    def checked(*args: Any, **kwargs: Any) -> Any:
        check = _CHECK
        if check is None or getattr(_INSIDE, "depth", 0):
            # (torch calling a checked function inside one: batch_isend_irecv's isend, a
            # collective handing itself to a torch-function mode. Checked once, outside.)
            return original(*args, **kwargs)
        group, tensors = _tensor_args(name, sig, args, kwargs)
        check.check(name, group, tensors, sys._getframe(1))
        _INSIDE.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            _INSIDE.depth = 0

    checked.__name__ = checked.__qualname__ = name
    checked.__doc__ = original.__doc__
    checked.__wrapped__ = original  # type: ignore[attr-defined]
    return checked


def install(accelerator: str = ACCELERATOR) -> DeviceCheck:
    """Start checking in this process (idempotent); call before importing smp.

    Enters :class:`HostTracker` in this thread and in every thread started from now on, and
    replaces the checked ``torch.distributed`` functions (and ``torch.load``, whose tensors
    are marked host)."""
    global _CHECK
    if _CHECK is not None:
        return _CHECK
    check = DeviceCheck(accelerator)
    for name in CHECKED:
        original = getattr(dist, name, None)
        if original is None:
            continue
        check.originals[name] = original
        wrapped = _checked(name, original)
        setattr(dist, name, wrapped)
        # And in distributed_c10d, whose own checks compare against these (P2POp's op).
        if getattr(dist.distributed_c10d, name, None) is original:
            setattr(dist.distributed_c10d, name, wrapped)
    _CHECK = check

    # A Parameter is a new tensor object around its data (torch.Tensor._make_subclass, which
    # no mode sees): it is where its data is.
    new = torch.nn.Parameter.__new__

    def tracked_new(cls: type, data: Any = None, requires_grad: bool = True) -> Any:
        param = new(cls, data, requires_grad)
        origin = host_origin(data) if torch.is_tensor(data) else None
        if origin is not None:
            mark_host(param, origin)
        return param

    torch.nn.Parameter.__new__ = staticmethod(tracked_new)  # type: ignore[assignment]

    load = torch.load

    def checked_load(*args: Any, **kwargs: Any) -> Any:
        result = load(*args, **kwargs)
        location = kwargs.get("map_location", args[1] if len(args) > 1 else None)
        if location is None or _spells_host(location):
            mark_host(_all_tensors(result), f"torch.load at {_site()}")
        return result

    torch.load = checked_load  # type: ignore[assignment]

    run = threading.Thread.run

    def tracked_run(self: threading.Thread) -> None:
        with HostTracker():
            run(self)

    threading.Thread.run = tracked_run  # type: ignore[method-assign]
    HostTracker().__enter__()  # this thread, for the rest of the process
    return check


def _all_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a loaded object (nested dicts and lists of any depth)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return out


def current() -> DeviceCheck:
    """The installed checker (:func:`install` first)."""
    if _CHECK is None:
        raise RuntimeError("devcheck.install() was not called")
    return _CHECK
