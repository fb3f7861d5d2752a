"""``python -m smp_torch.plan pkg.module:model_fn --world-size 4 --memory 2GiB``.

Profiles the model on this process and prints the planner's ranked table. The sample batch
comes from ``--batch pkg.module:fn`` (a function returning one step's global batch), by
default ``sample_batch`` in the model function's module; ``--step pkg.module:fn`` names a
``step_fn(model, batch) -> loss`` (default: that module's ``step_fn`` if any, else the
model's output summed). ``--pin key=value`` fixes a key; ``--why-not key=value,...`` asks
about one configuration; ``--json PATH`` writes every candidate; ``--plot PATH`` draws the top
candidates' predicted step time and per-stage peak memory against the budget (a PNG; needs
matplotlib). Exit status 2 on bad input, with one line naming what is wrong.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from smp_partition.errors import GraphError, PartitionError

from smp_torch.plan import parse_bytes, plan

PROG = "python -m smp_torch.plan"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _load(spec: str, what: str) -> Any:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} must look like 'pkg.module:name', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import {module!r} ({e})") from None
    if not hasattr(mod, attr):
        raise ValueError(f"{what}: module {module!r} has no attribute {attr!r}")
    return getattr(mod, attr)


def _pairs(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {item!r}")
        v = value.strip().lower()
        out[key.strip()] = True if v == "true" else False if v == "false" else int(v)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; returns the exit status."""
    ap = _Parser(prog=PROG, description="Rank smp configurations for a model before launching it.")
    ap.add_argument("model", help="pkg.module:model_fn (a function returning the nn.Module)")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--memory", required=True, help="per-rank budget, e.g. 2GiB, 512MiB")
    ap.add_argument("--batch", help="pkg.module:fn returning one step's global batch")
    ap.add_argument("--step", help="pkg.module:step_fn(model, batch) -> loss")
    ap.add_argument("--pin", action="append", default=[], help="key=value (repeatable)")
    ap.add_argument("--why-not", help="key=value,... of one configuration to explain")
    ap.add_argument("--top", type=int, default=10, help="rows of fitting candidates to print")
    ap.add_argument("--json", help="write every candidate to this file")
    ap.add_argument("--plot", help="draw the top candidates against the budget into this PNG")
    args = ap.parse_args(argv)
    try:
        budget = parse_bytes(args.memory)
        model_fn = _load(args.model, "model")
        home = args.model.partition(":")[0]
        batch_fn = _load(args.batch or f"{home}:sample_batch", "--batch")
        step_fn = _load(args.step, "--step") if args.step else getattr(sys.modules[home], "step_fn", None)
        pinned: dict[str, Any] = {}
        for p in args.pin:
            pinned.update(_pairs(p))
        why = _pairs(args.why_not) if args.why_not else None
        result = plan(model_fn, batch_fn() if callable(batch_fn) else batch_fn, args.world_size, budget,
                      step_fn, pinned=pinned)  # fmt: skip
    except (ValueError, PartitionError, GraphError) as e:
        ap.error(str(e).replace("\n", " "))
    _say(result.table(limit=args.top))
    if why is not None:
        _say(f"why not: {result.why_not(why)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
    if args.plot:
        from smp_torch.plan.picture import plot_plan  # (matplotlib: only when asked for)

        plot_plan(result, args.plot, top=args.top)
        _say(f"picture: {args.plot}")
    return 0


def _say(text: str) -> None:
    """Print ``text``; a reader that left (``... | head``) ends the printing, not the run:
    the files asked for are still written."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
