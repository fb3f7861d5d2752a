"""``@smp.step``: run a training step once per microbatch and collect the outputs.

The decorated function holds the forward pass, the loss and ``model.backward(loss)`` — but not
the optimizer step. Each call splits its tensor arguments into ``microbatches`` slices (along
axis 0, or the axis named in ``input_split_axes``; arguments named in ``non_split_inputs`` are
passed whole to every microbatch), runs the function once per microbatch through the active
:class:`~smp_torch.model.DistributedModel` (pipelined when ``pipeline_parallel_degree > 1``),
and returns the function's result with every leaf replaced by a :class:`StepOutput` holding the
per-microbatch values.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, overload

import torch
from smp_pipeline.errors import PipelineConfigError
from smp_pipeline.messages import is_container, map_structure
from smp_pipeline.microbatch import split_microbatches

from smp_torch.consistency import StepInputs
from smp_torch.errors import SMPError
from smp_torch.model import current_model

__all__ = ["StepOutput", "step", "split_inputs", "tree_map"]

F = TypeVar("F", bound=Callable[..., Any])


def _is_leaf(x: Any) -> bool:
    return not is_container(x)


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every leaf of nested tuples, lists, mappings and dataclasses (the
    pipeline's walker, :func:`smp_pipeline.messages.map_structure`, whose docstring says why
    not ``torch.utils._pytree``)."""
    return map_structure(obj, fn, _is_leaf)


def split_inputs(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    microbatches: int,
    non_split_inputs: Iterable[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Split the arguments of a call to ``fn`` into per-microbatch ``(args, kwargs)``: smp-
    pipeline's :func:`~smp_pipeline.microbatch.split_microbatches`, its errors raised as
    :class:`SMPError` (smp's own error type) with the same message."""
    try:
        axes: dict[str | int, int] = {k: v for k, v in (input_split_axes or {}).items()}
        return split_microbatches(fn, args, kwargs, microbatches, non_split_inputs, axes)
    except PipelineConfigError as e:
        raise SMPError(str(e)) from e


def step_inputs(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    non_split_inputs: Iterable[str] = (),
    input_split_axes: Mapping[str, int] | None = None,
) -> StepInputs:
    """What the ranks' arguments to a step must agree on (:mod:`smp_torch.consistency`): the
    first split tensor's length along its split axis, and every tensor's shape and dtype."""
    axes = dict(input_split_axes or {})
    whole = set(non_split_inputs)
    try:
        named = list(inspect.signature(fn).bind(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):
        named = [(str(i), v) for i, v in enumerate([*args, *kwargs.values()])]
    shapes: list[str] = []
    batch = 0
    for name, value in named:
        leaves: list[Any] = []
        tree_map(leaves.append, value)
        for t in (x for x in leaves if isinstance(x, torch.Tensor)):
            shapes.append(f"{name}{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}")
            axis = axes.get(name, 0)
            if not batch and name not in whole and t.dim() > 0 and -t.dim() <= axis < t.dim():
                batch = int(t.shape[axis])
    return StepInputs(batch, tuple(shapes))


class StepOutput:
    """One value of a step, for every microbatch (``outputs[i]`` is microbatch ``i``'s)."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = list(outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"

    def _tensors(self) -> list[torch.Tensor]:
        return [o if isinstance(o, torch.Tensor) else torch.as_tensor(o) for o in self.outputs]

    def reduce_mean(self) -> torch.Tensor:
        """Mean over microbatches (of this rank; not across data-parallel ranks)."""
        return torch.stack(self._tensors()).mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        """Sum over microbatches."""
        return torch.stack(self._tensors()).sum(dim=0)

    def concat(self, dim: int = 0) -> torch.Tensor:
        """The microbatch values concatenated along ``dim`` (undoes the input split)."""
        return torch.cat(self._tensors(), dim=dim)

    def stack(self, dim: int = 0) -> torch.Tensor:
        """The microbatch values stacked along a new ``dim``."""
        return torch.stack(self._tensors(), dim=dim)


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def collect_outputs(per_microbatch: list[Any]) -> Any:
    """Turn ``[out_mb0, out_mb1, ...]`` into ``out`` with each leaf a :class:`StepOutput`."""
    if not per_microbatch:
        return None
    flat: list[list[Any]] = []

    def gather(x: Any) -> Any:
        flat.append([])
        return len(flat) - 1

    skeleton = tree_map(gather, per_microbatch[0])
    for out in per_microbatch:
        leaves: list[Any] = []

        def keep(x: Any, _leaves: list[Any] = leaves) -> None:
            _leaves.append(_detach(x))

        tree_map(keep, out)
        if len(leaves) != len(flat):
            raise SMPError("the step function returned differently structured outputs")
        for i, leaf in enumerate(leaves):
            flat[i].append(leaf)
    return tree_map(lambda i: StepOutput(flat[i]), skeleton)


@overload
def step(fn: F) -> F: ...


@overload
def step(
    fn: None = None,
    *,
    non_split_inputs: Iterable[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
) -> Callable[[F], F]: ...


def step(
    fn: Callable[..., Any] | None = None,
    *,
    non_split_inputs: Iterable[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
) -> Any:
    """Decorate a training (or evaluation) step; see the module docstring.

    Usable bare (``@smp.step``) or with arguments
    (``@smp.step(non_split_inputs=["mask"], input_split_axes={"x": 1})``).
    """

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        whole = tuple(non_split_inputs or ())
        axes = dict(input_split_axes or {})

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            model = current_model()
            m = model.context.config.microbatches
            mbs = split_inputs(f, args, kwargs, m, whole, axes)
            inputs = step_inputs(f, args, kwargs, whole, axes)
            return collect_outputs(model.run_step(f, mbs, inputs))

        wrapper.__smp_step__ = True  # type: ignore[attr-defined]
        return wrapper

    if fn is not None:
        return decorate(fn)
    return decorate
