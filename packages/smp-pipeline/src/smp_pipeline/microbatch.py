"""Splitting a step function's arguments into microbatches: the one splitter, used by the
pipeline's ``run_step`` and by ``@smp.step`` (smp-torch).

Every tensor inside an argument (at any nesting depth: tuples, lists, mappings, dataclasses) is
split along that argument's batch axis (0 unless ``input_split_axes`` says otherwise). An
argument named in ``non_split_inputs``, non-tensor values and 0-d tensors are passed whole to
every microbatch. The batch size must be divisible by the number of microbatches, so that every
microbatch has the same size and the mean of per-microbatch mean losses equals the mean loss
over the whole batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from smp_pipeline.errors import PipelineConfigError
from smp_pipeline.messages import flatten, unflatten

MicrobatchArgs = tuple[tuple[Any, ...], dict[str, Any]]


def _split_value(name: str, value: Any, m: int, axis: int) -> list[Any]:
    skeleton, tensors = flatten(value)
    if not tensors:
        return [value] * m
    pieces: list[list[torch.Tensor]] = []
    for t in tensors:
        if t.dim() == 0:
            pieces.append([t] * m)
            continue
        if not -t.dim() <= axis < t.dim():
            raise PipelineConfigError(
                f"input '{name}': split axis {axis} is out of range for a tensor of shape "
                f"{tuple(t.shape)} (set input_split_axes['{name}'])"
            )
        if t.shape[axis] % m != 0:
            raise PipelineConfigError(
                f"input '{name}': size {t.shape[axis]} along axis {axis} is not divisible by "
                f"microbatches={m}; name it in non_split_inputs if it is not batched, or change "
                f"the batch size"
            )
        pieces.append(list(torch.chunk(t, m, dim=axis)))
    return [unflatten(skeleton, [p[i] for p in pieces]) for i in range(m)]


def split_microbatches(
    fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None,
    num_microbatches: int,
    non_split_inputs: Iterable[str | int] = (),
    input_split_axes: Mapping[str | int, int] | None = None,
) -> list[MicrobatchArgs]:
    """Split ``fn(*args, **kwargs)``'s arguments into ``num_microbatches`` argument sets.

    Arguments are named by ``fn``'s signature (or by position ``0, 1, ...`` for positional
    arguments when ``fn`` is None); ``non_split_inputs`` and ``input_split_axes`` use those
    names (a positional index is accepted too).
    """
    if num_microbatches < 1:
        raise PipelineConfigError(f"num_microbatches must be >= 1, got {num_microbatches}")
    kwargs = dict(kwargs or {})
    names: list[str] = [str(i) for i in range(len(args))]
    if fn is not None:
        try:
            params = list(inspect.signature(fn).parameters.values())
            positional = [
                p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            for i in range(min(len(args), len(positional))):
                names[i] = positional[i]
        except (TypeError, ValueError):  # builtins without a signature
            pass
    no_split = {str(x) for x in non_split_inputs}
    axes = {str(k): int(v) for k, v in (input_split_axes or {}).items()}
    known = set(names) | set(kwargs) | {str(i) for i in range(len(args))}
    for key in list(no_split) + list(axes):
        if key not in known:
            raise PipelineConfigError(
                f"'{key}' in non_split_inputs/input_split_axes is not an argument of the step "
                f"(arguments: {sorted(set(names) | set(kwargs))})"
            )
    m = num_microbatches
    if m == 1:  # (nothing to split: the arguments as they are, not views of them)
        return [(tuple(args), kwargs)]

    def split(name: str, index: str | None, value: Any) -> list[Any]:
        if name in no_split or (index is not None and index in no_split):
            return [value] * m
        axis = axes.get(name, axes.get(index, 0) if index is not None else 0)
        return _split_value(name, value, m, axis)

    split_args = [split(names[i], str(i), a) for i, a in enumerate(args)]
    split_kwargs = {k: split(k, None, v) for k, v in kwargs.items()}
    return [
        (
            tuple(s[i] for s in split_args),
            {k: s[i] for k, s in split_kwargs.items()},
        )
        for i in range(m)
    ]
