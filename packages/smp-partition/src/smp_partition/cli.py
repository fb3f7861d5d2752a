"""``smp-partition GRAPH.json --devices N [--alpha A] [--method M] [--format F] [-o FILE]``.

Exit status 0 on success, 2 on bad input (one line on stderr naming the problem).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from smp_partition.api import METHODS, partition
from smp_partition.graph import ModuleGraph
from smp_partition.render import dot, svg, table

FORMATS = ("table", "json", "dot", "svg")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: scripts grep stderr.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="smp-partition",
        description="Partition a module graph (smp-partition/module-graph@1 JSON) across "
        "pipeline devices.",
    )
    p.add_argument("graph", help="module graph JSON file")
    p.add_argument("-d", "--devices", type=int, required=True, help="number of devices")
    p.add_argument(
        "-a", "--alpha", type=float, default=1.0,
        help="memory weight in [0, 1]; 1 balances memory, 0 compute (default 1.0)",
    )  # fmt: skip
    p.add_argument("-m", "--method", choices=METHODS, default="default")
    p.add_argument("-f", "--format", choices=FORMATS, default="table")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        graph = ModuleGraph.from_json(args.graph)
        result = partition(graph, num_devices=args.devices, alpha=args.alpha, method=args.method)
        name = os.path.basename(args.graph)
        if args.format == "json":
            text = result.to_json(indent=1) + "\n"
        elif args.format == "dot":
            text = dot(graph, result)
        elif args.format == "svg":
            text = svg(graph, result, title=name)
        else:
            text = table(result, title=f"smp-partition: {name}")
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
    except ValueError as e:  # GraphError, PartitionError
        print(f"smp-partition: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"smp-partition: error: {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
