"""The module graph: what the partitioner reads (schema ``smp-partition/module-graph@1``).

A graph is a list of :class:`Module` records. It is validated once, when the
:class:`ModuleGraph` is constructed, so everything downstream may assume a well-formed,
acyclic graph whose every module is reachable from the root ``""``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from smp_partition._gc import gc_paused
from smp_partition.errors import GraphError

SCHEMA = "smp-partition/module-graph@1"
ROOT = ""


@dataclass(frozen=True, slots=True)
class Module:
    """One ``nn.Module`` of the model.

    ``children`` are direct submodule names in execution (or definition) order; ``params``
    maps a parameter key to its element count, for parameters registered directly on this
    module (a shared parameter carries the same key in every module that holds it);
    ``forward_ms`` is the forward time *including* children, or ``None`` when not measured.
    """

    name: str
    type: str = ""
    children: tuple[str, ...] = ()
    params: Mapping[str, int] = field(default_factory=dict)
    activation_bytes: float = 0
    forward_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """This module as a JSON-ready dict (the schema's ``modules`` entry)."""
        return {
            "name": self.name,
            "type": self.type,
            "children": list(self.children),
            "params": dict(self.params),
            "activation_bytes": self.activation_bytes,
            "forward_ms": self.forward_ms,
        }


def _label(name: str) -> str:
    return repr(name) if name else "'' (the root)"


def _check_number(value: object, what: str, module: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; True as a size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"module {_label(module)}: {what} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise GraphError(f"module {_label(module)}: {what} must be finite, got {value!r}")
    if value < 0:
        raise GraphError(f"module {_label(module)}: {what} is negative ({value!r})")


class ModuleGraph:
    """A validated module graph.

    Build it from a list of :class:`Module` (``ModuleGraph([Module(""), ...])``), from the
    schema dict (:meth:`from_dict`) or from a JSON file (:meth:`from_json`). Construction
    raises :class:`~smp_partition.errors.GraphError` on: a duplicate name, a missing root,
    a child that is not a module, a cycle in ``children`` reachable from the root, a negative
    or non-finite size/time, one parameter key with two different sizes, and modules that
    cannot be reached from the root (every ``nn.Module`` of a model is reachable from it, so
    such a module is a bug in the graph producer, not something to partition silently).
    """

    __slots__ = ("_modules", "_index", "_child_index")

    def __init__(self, modules: Iterable[Module]) -> None:
        with gc_paused():
            self._build(modules)

    def _build(self, modules: Iterable[Module]) -> None:
        self._modules: tuple[Module, ...] = tuple(modules)
        index: dict[str, int] = {}
        for i, m in enumerate(self._modules):
            if not isinstance(m, Module):
                raise GraphError(f"modules[{i}] is not a Module ({type(m).__name__})")
            if not isinstance(m.name, str):
                raise GraphError(f"modules[{i}]: name must be a string, got {m.name!r}")
            if m.name in index:
                raise GraphError(f"duplicate module name {_label(m.name)}")
            index[m.name] = i
        if ROOT not in index:
            raise GraphError("missing root module '' (the root's name is the empty string)")
        self._index = index
        self._child_index = self._resolve_children()
        self._check_costs()
        self._check_acyclic_and_reachable()

    # ------------------------------------------------------------------ validation
    def _resolve_children(self) -> list[tuple[int, ...]]:
        index = self._index
        out: list[tuple[int, ...]] = []
        for m in self._modules:
            names = m.children
            try:
                kids = tuple([index[c] for c in names])
            except (KeyError, TypeError):
                bad = next(c for c in names if not isinstance(c, str) or c not in index)
                raise GraphError(
                    f"module {_label(m.name)} lists child {bad!r} that is not a module"
                ) from None
            if len(kids) > 1 and len(set(kids)) != len(kids):
                # A module called twice lists its child twice: one tree edge is enough.
                kids = tuple(dict.fromkeys(kids))
            out.append(kids)
        return out

    def _check_costs(self) -> None:
        sizes: dict[str, int] = {}
        for m in self._modules:
            params = m.params
            if not isinstance(params, Mapping):
                raise GraphError(f"module {_label(m.name)}: params must be a mapping")
            for key, numel in params.items():
                # Fast path: a str key and a non-negative plain int (bool is excluded).
                if type(numel) is not int or numel < 0 or type(key) is not str:
                    self._bad_param(m, key, numel)
                first = sizes.setdefault(key, numel)
                if first != numel:
                    owner = next(o for o in self._modules if key in o.params)
                    raise GraphError(
                        f"module {_label(m.name)}: shared parameter {key!r} has size {numel} "
                        f"but {first} in module {_label(owner.name)}"
                    )
            act, fwd = m.activation_bytes, m.forward_ms
            if not (act == 0 and type(act) is int):
                _check_number(act, "activation_bytes", m.name)
            if fwd is not None:
                _check_number(fwd, "forward_ms", m.name)

    @staticmethod
    def _bad_param(m: Module, key: object, numel: object) -> None:
        if not isinstance(key, str):
            raise GraphError(f"module {_label(m.name)}: parameter key {key!r} is not a string")
        if isinstance(numel, bool) or not isinstance(numel, int):
            raise GraphError(
                f"module {_label(m.name)}: parameter {key!r} size must be an integer, got {numel!r}"
            )
        if numel < 0:
            raise GraphError(
                f"module {_label(m.name)}: parameter {key!r} has a negative size ({numel})"
            )

    def _check_acyclic_and_reachable(self) -> None:
        # Iterative DFS with three colours (0 new, 1 on the stack, 2 done); the stack is the
        # current path, which is the cycle's witness when an edge leads back onto it.
        kids = self._child_index
        n = len(self._modules)
        colour = bytearray(n)
        cursor = [0] * n
        root = self._index[ROOT]
        colour[root] = 1
        stack = [root]
        while stack:
            node = stack[-1]
            children = kids[node]
            pos = cursor[node]
            if pos < len(children):
                cursor[node] = pos + 1
                child = children[pos]
                state = colour[child]
                if state == 0:
                    colour[child] = 1
                    stack.append(child)
                elif state == 1:
                    path = stack[stack.index(child) :] + [child]
                    cycle = " -> ".join(repr(self._modules[i].name) for i in path)
                    raise GraphError(
                        f"cycle in children at module {_label(self._modules[child].name)}: {cycle}"
                    )
            else:
                colour[node] = 2
                stack.pop()
        if colour.count(0):
            missing = [m.name for m, c in zip(self._modules, colour) if c == 0]
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise GraphError(f"module {_label(missing[0])} is not reachable from the root{more}")

    # ------------------------------------------------------------------ access
    def __repr__(self) -> str:
        if len(self._modules) > 50:
            return f"<ModuleGraph of {len(self._modules)} modules>"
        return f"ModuleGraph({list(self._modules)!r})"

    @property
    def modules(self) -> tuple[Module, ...]:
        """All modules, in the order they were given."""
        return self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __getitem__(self, name: str) -> Module:
        try:
            return self._modules[self._index[name]]
        except KeyError:
            raise KeyError(f"no module named {name!r}") from None

    def index_of(self, name: str) -> int:
        """Position of module ``name`` in :attr:`modules`."""
        return self._index[name]

    def child_indices(self, i: int) -> tuple[int, ...]:
        """Positions of module ``i``'s distinct children, in listed order."""
        return self._child_index[i]

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModuleGraph:
        """Parse the ``smp-partition/module-graph@1`` dict (as loaded from JSON)."""
        if not isinstance(data, Mapping):
            raise GraphError(f"a module graph must be a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise GraphError(f"unknown schema {schema!r} (expected {SCHEMA!r})")
        raw = data.get("modules")
        if not isinstance(raw, list):
            raise GraphError("'modules' must be a list of module objects")
        with gc_paused():
            return cls(cls._parse_modules(raw))

    @staticmethod
    def _parse_modules(raw: list[Any]) -> list[Module]:
        modules: list[Module] = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, Mapping):
                raise GraphError(f"modules[{i}] must be an object, got {type(entry).__name__}")
            name = entry.get("name")
            if not isinstance(name, str):
                raise GraphError(f"modules[{i}]: 'name' must be a string, got {name!r}")
            children = entry.get("children", [])
            if not isinstance(children, list) or not all(isinstance(c, str) for c in children):
                raise GraphError(f"module {_label(name)}: 'children' must be a list of names")
            params = entry.get("params", {})
            if not isinstance(params, Mapping):
                raise GraphError(f"module {_label(name)}: 'params' must be an object")
            type_ = entry.get("type", "")
            if not isinstance(type_, str):
                raise GraphError(f"module {_label(name)}: 'type' must be a string")
            act = entry.get("activation_bytes", 0)
            fwd = entry.get("forward_ms")
            _check_number(act, "activation_bytes", name, allow_none=True)
            _check_number(fwd, "forward_ms", name, allow_none=True)
            modules.append(
                Module(
                    name=name,
                    type=type_,
                    children=tuple(children),
                    params=dict(params),
                    activation_bytes=0 if act is None else act,
                    forward_ms=fwd,
                )
            )
        return modules

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ModuleGraph:
        """Read and validate a module-graph JSON file."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise GraphError(f"{os.fspath(path)}: invalid JSON: {e}") from None
        except OSError as e:
            raise GraphError(f"{os.fspath(path)}: {e.strerror or e}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The graph as a schema dict; ``from_dict(g.to_dict())`` gives an equal graph."""
        return {"schema": SCHEMA, "modules": [m.to_dict() for m in self._modules]}

    def to_json(self, path: str | os.PathLike[str] | None = None, indent: int | None = None) -> str:
        """The graph as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text
