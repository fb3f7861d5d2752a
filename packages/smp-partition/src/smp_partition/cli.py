"""``smp-partition GRAPH.json --devices N [--alpha A] [--method M] [--format F] [-o FILE]``.

Exit status 0 on success, 2 on bad input: one line ``smp-partition: error: ...`` on stderr
naming the file, key, module or option at fault, never a traceback. Only the errors bad
input can cause are caught; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from smp_partition.api import MAX_DEVICES, METHODS, partition
from smp_partition.errors import GraphError, PartitionError
from smp_partition.graph import ModuleGraph
from smp_partition.render import dot, svg, table

PROG = "smp-partition"
FORMATS = ("table", "json", "dot", "svg")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: scripts grep stderr.
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\n")


def _one_line(text: str) -> str:
    # Messages quote user input with repr(), but a path or an OS message could still hold
    # a line break; the one-line promise must not depend on every message's author.
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _devices(text: str) -> int:
    """argparse type of ``--devices``: an integer in [1, MAX_DEVICES]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= value <= MAX_DEVICES:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_DEVICES}], got {text!r}")
    return value


def _alpha(text: str) -> float:
    """argparse type of ``--alpha``: a number in [0, 1] (not nan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Partition a module graph (smp-partition/module-graph@1 JSON) across "
        "pipeline devices.",
    )
    p.add_argument("graph", help="module graph JSON file")
    p.add_argument(
        "-d", "--devices", type=_devices, required=True,
        help=f"number of devices, 1 to {MAX_DEVICES}",
    )  # fmt: skip
    p.add_argument(
        "-a", "--alpha", type=_alpha, default=1.0,
        help="memory weight in [0, 1]; 1 balances memory, 0 compute (default 1.0)",
    )  # fmt: skip
    p.add_argument("-m", "--method", choices=METHODS, default="default")
    p.add_argument("-f", "--format", choices=FORMATS, default="table")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    return p


def _fail(message: str) -> int:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 itself on bad options)."""
    args = _parser().parse_args(argv)
    try:
        graph = ModuleGraph.from_json(args.graph)
    except GraphError as e:
        return _fail(str(e))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, RecursionError) as e:
        # from_json turns all of these into GraphError; kept so a regression there still
        # gives one line for what is certainly bad input, not a traceback.
        return _fail(f"{args.graph}: {type(e).__name__}: {e}")
    try:
        result = partition(graph, num_devices=args.devices, alpha=args.alpha, method=args.method)
    except PartitionError as e:
        return _fail(str(e))
    # A non-UTF-8 file name arrives with surrogate escapes, which the output cannot encode.
    name = os.path.basename(args.graph).encode("utf-8", "backslashreplace").decode("utf-8")
    if args.format == "json":
        text = result.to_json(indent=1) + "\n"
    elif args.format == "dot":
        text = dot(graph, result)
    elif args.format == "svg":
        text = svg(graph, result, title=name)
    else:
        text = table(result, title=f"{PROG}: {name}")
    try:
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
    except OSError as e:
        return _fail(f"{args.output or '<stdout>'}: {e.strerror or e}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
