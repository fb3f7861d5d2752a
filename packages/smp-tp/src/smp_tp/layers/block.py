"""DistributedBlock: an existing module turned into a Megatron column → row block.

Many blocks of today's models (attention, gated MLP) have the same shape: the block input
goes through one or more linears (*column* linears: q/k/v, gate/up), then only per-channel or
per-head operations follow (rotary embeddings, attention over heads, activation, products),
and one linear (*row* linear: o/down) produces the block output. Splitting the column linears
over their output channels (whole heads) and the row linear over its input channels keeps
everything between local, so the block costs one collective pair:

* prescaled: Megatron's ``f`` on the input (backward all-reduce) and ``g`` on the output
  (forward all-reduce);
* scaled batch: all-gather the TP group's samples on entry (backward reduce-scatter) and
  reduce-scatter the row linear's partial output back by sample (backward all-gather) —
  the volume of one all-reduce each way. Tensor arguments (also inside tuples and lists)
  of at least two dimensions whose first dimension is the batch size (masks, rotary
  ``cos``/``sin``, position ids) are all-gathered too, once per tensor object (the same
  mask given to every layer is gathered once). With one sample per rank a ``(1, ...)``
  argument is therefore gathered as well, which is right for a per-sample or a broadcast
  tensor; an argument that differs between TP ranks for another reason (per-rank heads)
  must not be passed to a block in scaled-batch mode.

:class:`DistributedBlock` keeps the original module's forward: it takes over its attributes
and children (column/row linears replaced by :class:`ColumnParallelLinear` /
:class:`RowParallelLinear` holding slices of the original weights) and calls the original
class's ``forward`` on itself, between the entry and exit collectives. Its state-dict keys
are the original's. The row linear's bias is added after the reduction, so the block output
must be the row linear's output (as in attention and MLP blocks).

Three options cover encoder-decoder blocks (T5): ``shard`` splits further per-head
parameters (a relative position bias table ``(buckets, heads)`` over its head dimension), so
what the forward derives from them is per-rank too; ``local`` names arguments that already
hold per-rank values (the position bias a first layer returns and the next ones reuse) and
are never gathered; ``inputs`` names further block inputs that go through column linears
(cross-attention's encoder states), which get the input's collective (prescaled: ``f``;
scaled: gathered with their gradient).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_tp.checkpoint import load_full_into
from smp_tp.group import ProcessGroup
from smp_tp.layers.region import mark
from smp_tp.mappings import (
    allgather_no_grad,
    bwd_allreduce_for_tp,
    fused_allgather_for_tp,
    fwd_allreduce_for_tp,
    reduce_scatter_for_tp,
)
from smp_tp.module import DistributedModule


class ColumnParallelLinear(DistributedModule):
    """``nn.Linear`` split over output channels (weight and bias rows); no collective.

    Only meaningful inside a :class:`DistributedBlock`, which provides the input of the TP
    group's batch (scaled) or the replicated input with Megatron's ``f`` (prescaled).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 tp_group: ProcessGroup = None, prescaled_batch: bool | None = None) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        self._require_divisible(out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features, **kw))
        mark(self.weight, "shard", 0, self)
        self.bias = nn.Parameter(torch.zeros(out_features // self.tp_size, **kw)) if bias else None
        if self.bias is not None:
            mark(self.bias, "shard", 0, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + super().extra_repr()


class RowParallelLinear(DistributedModule):
    """``nn.Linear`` split over input channels; returns this rank's *partial* output,
    without the bias (the enclosing :class:`DistributedBlock` reduces and adds it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 tp_group: ProcessGroup = None, prescaled_batch: bool | None = None) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        self._require_divisible(in_features=in_features)
        self.in_features, self.out_features = in_features, out_features
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size, **kw))
        mark(self.weight, "shard", 1, self)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        if self.bias is not None:  # added after the reduction: own samples (scaled) / replicated
            mark(self.bias, "dp_replicated", None, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + super().extra_repr()


# Side inputs gathered in scaled-batch mode, by tensor identity: the mask or rotary tables a
# model passes to every layer are gathered once. Consistent across ranks because every rank
# runs the same program (a hit needs the same live tensor object at the same version).
_side_cache: dict[int, tuple[Any, int, Any, torch.Tensor]] = {}


def _gather_side_tensor(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if t.requires_grad:
        return fused_allgather_for_tp(t, 0, group)
    key = id(t)
    hit = _side_cache.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2] is group:
        return hit[3]
    if t.dtype == torch.bool:  # gloo cannot all-gather bool tensors
        out = allgather_no_grad(t.to(torch.uint8).contiguous(), 0, group).bool()
    else:
        out = allgather_no_grad(t.contiguous(), 0, group)
    for k in [k for k, v in _side_cache.items() if v[0]() is None]:
        _side_cache.pop(k, None)
    _side_cache[key] = (weakref.ref(t), t._version, group, out)
    return out


def _shard_parameter(owner: nn.Module, path: str, dim: int, block: DistributedModule) -> None:
    """Replace ``owner``'s parameter at ``path`` by an empty per-rank slice along ``dim``."""
    parent_path, _, name = path.rpartition(".")
    parent = owner.get_submodule(parent_path) if parent_path else owner
    full = getattr(parent, name)
    shape = list(full.shape)
    shape[dim] //= block.tp_size
    local = nn.Parameter(torch.empty(shape, dtype=full.dtype, device=full.device), full.requires_grad)
    mark(local, "shard", dim, block)
    setattr(parent, name, local)


def _gather_side(value: Any, batch: int, group: ProcessGroup, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            return _gather_side_tensor(value, group)
        return value
    if depth < 2 and isinstance(value, (tuple, list)):
        return type(value)(_gather_side(v, batch, group, depth + 1) for v in value)
    return value


_MISSING = object()


class DistributedBlock(DistributedModule):
    """A module whose ``column`` linears are split over outputs and ``row`` linears over
    inputs, running the original class's forward in between (see the module docstring).

    ``sizes(module) -> {name: value}``: sizes that must be divisible by the TP degree (e.g.
    the numbers of query and key/value heads; a linear's feature count alone does not show
    where heads end). ``divide``: integer attributes of the module (e.g. ``"num_heads"``)
    that the forward reads and that become per-rank values (divided by the degree, which
    must divide them) on the block. ``input_name``: the forward argument holding the block input when it
    is passed by keyword (the first positional argument otherwise). ``shard``: further
    parameters (paths inside the module) split along the given dimension, e.g.
    ``{"relative_attention_bias.weight": 1}`` for a ``(buckets, heads)`` table; any other
    parameter outside the column and row linears is rejected (a ``ValueError`` names it).
    ``local``: arguments holding per-rank values, never gathered (scaled batch).
    ``inputs``: further arguments that are block inputs to column linears (e.g. encoder
    states of cross-attention): prescaled, their gradient is all-reduced like the input's;
    scaled, they are gathered with their gradient (as any batch-sized argument).
    """

    def __init__(
        self,
        module: nn.Module,
        column: Sequence[str],
        row: Sequence[str],
        *,
        sizes: Callable[[nn.Module], dict[str, int]] | None = None,
        divide: Sequence[str] = (),
        input_name: str = "hidden_states",
        shard: dict[str, int] | None = None,
        local: Sequence[str] = (),
        inputs: Sequence[str] = (),
        tp_group: ProcessGroup = None,
        prescaled_batch: bool | None = None,
    ) -> None:
        super().__init__(tp_group=tp_group, prescaled_batch=prescaled_batch)
        cls = type(module)
        name = cls.__name__
        children = dict(module.named_children())
        for n in (*column, *row):
            if type(children.get(n)) is not nn.Linear:
                raise ValueError(f"{name}: {n!r} is not an nn.Linear child (column={list(column)}, row={list(row)})")
        if not row:
            raise ValueError(f"{name}: a DistributedBlock needs a row-parallel linear for its output")
        checked = dict(sizes(module)) if sizes is not None else {}
        for key in divide:
            value = getattr(module, key, None)
            if not isinstance(value, int):
                raise ValueError(f"{name}: attribute {key!r} to divide by the degree is not an int ({value!r})")
            checked.setdefault(key, value)
        for key, value in checked.items():
            if value % self.tp_size:
                raise ValueError(
                    f"{name}: {key}={value} is not divisible by the tensor-parallel degree "
                    f"{self.tp_size}; choose a degree that divides it, or leave this module unreplaced"
                )
        split = set(column) | set(row)
        shard = dict(shard or {})
        params = dict(module.named_parameters())
        for key, dim in shard.items():
            if key not in params:
                continue  # e.g. a relative bias table only the first layer has
            if params[key].shape[dim] % self.tp_size:
                raise ValueError(
                    f"{name}: {key} of shape {tuple(params[key].shape)} cannot be split "
                    f"{self.tp_size} ways along dim {dim}"
                )
        extra = [k for k in params if k.split(".")[0] not in split and k not in shard]
        if extra:
            raise ValueError(
                f"{name}: parameters outside the column/row linears ({extra}) are not supported "
                f"by DistributedBlock"
            )
        full = module.state_dict()  # before ``shard`` replaces parameters of shared children
        object.__setattr__(self, "_smp_tp_orig_cls", cls)
        object.__setattr__(self, "_smp_tp_orig_forward", cls.forward)
        self._smp_tp_layout = (tuple(column), tuple(row), input_name)
        # argument names of the original forward after ``self`` and the block input, to
        # recognise ``local``/``inputs`` arguments passed positionally
        names = [p.name for p in inspect.signature(cls.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][2:]
        self._smp_tp_args = (tuple(names), frozenset(local), frozenset(inputs))
        for key, value in vars(module).items():
            if key not in self.__dict__:
                self.__dict__[key] = value
        for key in divide:  # per-rank counts (e.g. heads) for a forward that reads them
            self.__dict__[key] = getattr(module, key) // self.tp_size
        for key, buf in module._buffers.items():
            self.register_buffer(key, buf, persistent=key not in module._non_persistent_buffers_set)
        mode: dict[str, Any] = {"tp_group": self.tp_group, "prescaled_batch": self.prescaled_batch}
        for key, child in children.items():
            if key in split:
                assert isinstance(child, nn.Linear)
                w = child.weight
                kind = ColumnParallelLinear if key in column else RowParallelLinear
                self.add_module(key, kind(child.in_features, child.out_features, child.bias is not None,
                                          dtype=w.dtype, device=w.device, **mode))
            else:
                self.add_module(key, child)
        for key, dim in shard.items():
            if key in params:
                _shard_parameter(self, key, dim, self)
        try:
            load_full_into(self, full)
        except (KeyError, ValueError) as e:  # pragma: no cover - keys are the original's by construction
            raise ValueError(f"{name}: cannot copy the original weights ({e})") from e
        self.train(module.training)

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            cls = self.__dict__.get("_smp_tp_orig_cls")
            attr = inspect.getattr_static(cls, key, _MISSING) if cls is not None else _MISSING
            if attr is _MISSING:
                raise
            # methods, properties and class constants of the original class
            return attr.__get__(self, type(self)) if hasattr(attr, "__get__") else attr

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        column, row, input_name = self._smp_tp_layout
        if args:
            x, rest, keyword = args[0], args[1:], False
        elif input_name in kwargs:
            x, rest, keyword = kwargs.pop(input_name), (), True
        else:
            raise TypeError(f"{self._smp_tp_orig_cls.__name__}: missing the block input {input_name!r}")
        g = self.tp_group
        names, local, inputs = self._smp_tp_args
        scaled = self.scaled_batch and self.tp_size > 1
        if scaled:
            batch = x.shape[0]
            x = fused_allgather_for_tp(x, 0, g)

            def side(key: str | None, v: Any) -> Any:
                return v if key in local else _gather_side(v, batch, g)
        else:
            x = bwd_allreduce_for_tp(x, g)

            def side(key: str | None, v: Any) -> Any:
                if key in inputs and isinstance(v, torch.Tensor) and v.requires_grad:
                    return bwd_allreduce_for_tp(v, g)
                return v
        if scaled or inputs:
            rest = tuple(side(names[i] if i < len(names) else None, a) for i, a in enumerate(rest))
            kwargs = {k: side(k, v) for k, v in kwargs.items()}
        if keyword:
            out = self._smp_tp_orig_forward(self, *rest, **{input_name: x}, **kwargs)
        else:
            out = self._smp_tp_orig_forward(self, x, *rest, **kwargs)
        first, others = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, None)
        y = reduce_scatter_for_tp(first, 0, g) if scaled else fwd_allreduce_for_tp(first, g)
        for n in row:
            b = getattr(self, n).bias
            if b is not None:
                y = y + b
        return y if others is None else (y, *others)

    def extra_repr(self) -> str:
        column, row, _ = self._smp_tp_layout
        return (f"{self._smp_tp_orig_cls.__name__}, column={list(column)}, row={list(row)}, "
                + super().extra_repr())
