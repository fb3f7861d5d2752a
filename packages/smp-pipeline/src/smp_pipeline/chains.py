"""``fast_mode`` for loops over an ``nn.ModuleList``: one request per run of blocks.

A model that calls the children of a ``ModuleList`` in a loop of its own (Hugging Face
GPT-2 and Llama: ``for layer in self.layers: h = layer(h, mask=m, ...)``) cannot be planned
like an ``nn.Sequential`` (:mod:`smp_pipeline.seqruns`): the loop is the model's own Python,
so each block living on another rank is a request of its own, forward and backward, per
microbatch. Here the caller *chains* instead: when it calls block ``j`` and blocks ``j+1 ..
j+n`` live on the same rank, the request asks that rank to run them all, each on its
predecessor's output with ``j``'s other arguments (the *chaining rule*: block ``i+1`` gets
``(first(out_i), *args[1:]), kwargs``, :func:`chain_input`), and to send back every
block's output. The caller returns ``j``'s output; when the loop then calls ``j+1`` with
exactly what the rule predicted (its first argument *is* ``first(out_j)``, the other
arguments are the same objects, no tensor among them changed in place since (version
counters), the same grad and autocast state), the call returns ``j+1``'s
output from the chain without a request (a *hit*). Every output enters autograd through
the one request's boundary, so backward is one request too, with the gradients of all the
outputs that got one: the owner runs one engine run over the chain, which sums a
gradient reaching ``out_j`` both through block ``j+1`` and through another use of it, as
one process does.

Exactness: on a hit the result is the one the loop would have got from its own request (the
same blocks on the same inputs). Anything else is a *miss* — the loop called another block
of the list than the predicted one, or the predicted one with other arguments — and the call
goes out as a request of its own; the chained outputs nobody took get no gradient, so the
work they did adds nothing. A miss turns that link off for good (the loop is not the shape
chaining assumes; LayerDrop, say). A link is chained only after the rank *saw* it
unchained (block ``j+1`` called by the rule right after block ``j``, in one microbatch), so a
loop that never follows the rule costs nothing but the checks. What a step sees takes
effect at the next step (:meth:`ModuleListChains.begin_step`), so all microbatches of a step
are chained alike, whatever the timing: the same requests, and on a miss the same wasted
work, run after run.

Cost of a miss: the owner ran blocks whose outputs nobody used (compute, and a dropout mask
or another random draw more than without chaining; module state such as batch-norm
statistics updated by them).

Not detected: a non-tensor argument (a dict, a cache object) is the same argument when it is
the same object, so a loop that changes one in place between blocks, where the blocks read
it, would get outputs computed before the change: such a loop needs ``fast_mode=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from smp_pipeline.messages import flatten

# A chained call's state that must match for a hit: (grad mode, autocast contexts).
State = tuple[bool, Any]


def chain_input(out: Any) -> torch.Tensor | None:
    """The next block's first argument under the chaining rule: ``out`` if a tensor,
    ``out[0]`` if a tuple or list starting with a tensor; None: ``out`` does not chain."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _same(a: Any, b: Any) -> bool:
    """The same argument for a hit: the same object (plain values may be equal copies)."""
    if a is b:
        return True
    return type(a) is type(b) and isinstance(a, (int, float, bool, str)) and a == b


def _same_args(args: tuple[Any, ...], kwargs: dict[str, Any], rest: tuple[Any, ...],
               kw: dict[str, Any]) -> bool:  # fmt: skip
    return (
        len(args) == len(rest) + 1
        and all(_same(a, b) for a, b in zip(args[1:], rest))
        and kwargs.keys() == kw.keys()
        and all(_same(v, kw[k]) for k, v in kwargs.items())
    )


def _version(x: torch.Tensor | None) -> int:
    return -1 if x is None else x._version


class _Call:
    """The last chainable call of a context, or what its chain holds for the next calls.

    Tensors are compared by identity *and* version counter: one changed in place since (an
    output the loop scaled with ``mul_``, a mask edited between blocks) is not what the
    chained blocks ran on, so the call misses.
    """

    __slots__ = ("after", "held", "kwargs", "outputs", "path", "rest", "state", "versions")

    def __init__(
        self,
        path: str,
        outputs: list[Any],
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: State,
    ) -> None:
        self.path = path  # the block whose output ``outputs[0]`` is
        self.outputs = outputs  # its output, then those of the chained blocks after it
        self.rest = rest  # args[1:] and kwargs of the call, passed to every block
        self.kwargs = kwargs
        self.state = state
        self.after = 0  # outputs taken (0: only ``path``'s own, returned by its request)
        # The next block's input from each output, and the other arguments' tensors, with
        # their version counters as they were when the chained blocks ran.
        self.versions = [_version(chain_input(o)) for o in outputs]
        self.held = [(t, t._version) for t in flatten((rest, kwargs))[1]]

    def unchanged(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the tensors in ``args[1:]`` and ``kwargs`` are the ones held, unchanged."""
        now = flatten((args[1:], kwargs))[1]
        held = self.held
        return len(now) == len(held) and all(
            a is t and a._version == v for a, (t, v) in zip(now, held)
        )


class ModuleListChains:
    """Which owned-elsewhere ``ModuleList`` blocks chain, and each context's chain.

    Args:
        links: ``{block path: next block path}`` for the consecutive children of a
            ``ModuleList`` that live on one other rank, whole subtrees (see
            :func:`chain_links`).
    """

    def __init__(self, links: dict[str, str]) -> None:
        self.links = links
        self._siblings = {p: p.rsplit(".", 1)[0] for p in (*links, *links.values())}
        self.seen: set[str] = set()  # links j -> j+1 (by j) seen followed unchained
        self.off: set[str] = set()  # links that missed, or were seen not followed
        # What this step saw, in force from the next step on: so every microbatch of a step
        # is chained alike whatever the timing (the requests, and the work a miss wastes,
        # are the same run to run).
        self._seen_now: set[str] = set()
        self._off_now: set[str] = set()
        self.hits = 0
        self.misses = 0

    def begin_step(self) -> None:
        """Put what the last step saw in force (see :attr:`seen`, :attr:`off`)."""
        self.seen |= self._seen_now
        self.off |= self._off_now
        self._seen_now.clear()
        self._off_now.clear()

    def chain_after(self, path: str) -> tuple[str, ...]:
        """The blocks to chain after a call of ``path``: the run of seen links from it."""
        out: list[str] = []
        nxt = path
        while nxt in self.seen and nxt not in self.off:
            nxt = self.links[nxt]
            out.append(nxt)
        return tuple(out)

    def take(
        self,
        last: _Call | None,
        path: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: State,
    ) -> tuple[bool, Any]:
        """A call of ``path`` in a context whose last chainable call is ``last``: (True, its
        output) on a hit; (False, None) if it must go out as a request (and ``last`` is
        then done with, unless the call is not a block of the same list)."""
        if last is None:
            return False, None
        if self._siblings.get(path) != self._siblings.get(last.path):
            return False, None  # another module: the loop may come back to the list
        predicted = self.links.get(last.path)
        x = chain_input(last.outputs[last.after])
        follows = (
            path == predicted
            and last.state == state
            and bool(args)
            and args[0] is x
            and _version(x) == last.versions[last.after]
            and _same_args(args, kwargs, last.rest, last.kwargs)
            and last.unchanged(args, kwargs)
        )
        chained = last.after + 1 < len(last.outputs)
        if follows and chained:
            self.hits += 1
            last.after += 1
            last.path = path
            return True, last.outputs[last.after]
        if predicted is not None:
            if follows:
                self._seen_now.add(last.path)  # followed, unchained: chain it next step
            else:
                self._off_now.add(last.path)
                self.misses += chained
        return False, None

    def after_request(
        self,
        last: _Call | None,
        path: str,
        outputs: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: State,
    ) -> _Call | None:
        """A context's last chainable call once a request for ``path`` returned
        ``outputs`` (its own output, then the chained blocks' ones): unchanged if ``path`` is
        no block that chains (the loop may come back to the list), else this call."""
        if path not in self._siblings:
            return last
        return _Call(path, outputs, tuple(args[1:]), dict(kwargs), state)


def chain_links(
    module: nn.Module,
    assignment: dict[str, int],
    pp_rank: int,
    local_to: Callable[[int], Iterable[str]],
) -> dict[str, str]:
    """``{path: next path}`` for consecutive children of every ``nn.ModuleList`` in
    ``module`` that both live on one rank other than ``pp_rank`` with their whole subtrees
    (``local_to(rank)``: such paths of ``rank``), so a chained request never leaves it."""
    links: dict[str, str] = {}
    locals_of: dict[int, set[str]] = {}
    for path, m in module.named_modules():
        if not isinstance(m, nn.ModuleList):
            continue
        names = [f"{path}.{n}" if path else n for n, _ in m.named_children()]
        for a, b in zip(names, names[1:]):
            owner = assignment.get(a)
            if owner is None or owner == pp_rank or assignment.get(b) != owner:
                continue
            if owner not in locals_of:
                locals_of[owner] = set(local_to(owner))
            if a in locals_of[owner] and b in locals_of[owner]:
                links[a] = b
    return links
