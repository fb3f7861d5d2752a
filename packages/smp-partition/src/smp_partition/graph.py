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
MAX_VALUE = (1 << 63) - 1
"""Largest parameter size, ``activation_bytes`` or ``forward_ms`` accepted. Sizes are int64
in torch; and below this bound, totals over any number of modules stay finite floats, so
the cost model never meets an overflow, ``inf`` or ``nan``."""

_SHOW_MAX = 80  # characters of a user value quoted in an error message


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


def _show(value: object, limit: int = _SHOW_MAX) -> str:
    """A short one-line rendering of a value read from the input, for error messages."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        # repr() of an int over 4300 digits raises, and a long one helps nobody.
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    if value is None or isinstance(value, (str, int, float)):
        text = repr(value)  # repr escapes newlines: the message stays on one line
        return text if len(text) <= limit else text[: limit - 3] + "..."
    if isinstance(value, (list, tuple)):
        return f"a list of length {len(value)}"
    if isinstance(value, Mapping):
        return f"an object of {len(value)} key(s)"
    return f"a {type(value).__name__}"


def _label(name: str) -> str:
    return _show(name, 2 * _SHOW_MAX) if name else "'' (the root)"


def _is_text(text: str) -> bool:
    """Whether ``text`` can be written out as UTF-8.

    JSON's ``\\ud800`` escapes yield lone surrogates, which no output format can encode.
    """
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path_label(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if text and text.isprintable() else repr(text)


def _check_number(value: object, what: str, module: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; True as a size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"module {_label(module)}: {what} must be a number, got {_show(value)}")
    # math.isfinite(int) converts to float, which overflows for huge ints: ints are finite.
    if isinstance(value, float) and not math.isfinite(value):
        raise GraphError(f"module {_label(module)}: {what} must be finite, got {value!r}")
    if value < 0:
        raise GraphError(f"module {_label(module)}: {what} is negative ({_show(value)})")
    if value > MAX_VALUE:
        raise GraphError(
            f"module {_label(module)}: {what} is too large ({_show(value)}; at most 2**63 - 1)"
        )


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
                raise GraphError(f"modules[{i}]: name must be a string, got {_show(m.name)}")
            if not _is_text(m.name):
                raise GraphError(
                    f"modules[{i}]: name {_label(m.name)} is not valid Unicode (lone surrogate)"
                )
            if not isinstance(m.type, str) or not _is_text(m.type):
                raise GraphError(
                    f"module {_label(m.name)}: 'type' must be a Unicode string, got {_show(m.type)}"
                )
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
            # A str is iterable too: "abc" would silently mean children "a", "b", "c".
            if type(names) is not tuple and not isinstance(names, (list, tuple)):
                raise GraphError(
                    f"module {_label(m.name)}: children must be a sequence of module names, "
                    f"got {_show(names)}"
                )
            try:
                kids = tuple([index[c] for c in names])
            except (KeyError, TypeError):  # TypeError: an unhashable child entry
                bad = next(c for c in names if not isinstance(c, str) or c not in index)
                raise GraphError(
                    f"module {_label(m.name)} lists child {_show(bad)} that is not a module"
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
                raise GraphError(
                    f"module {_label(m.name)}: params must be a mapping, got {_show(params)}"
                )
            for key, numel in params.items():
                # Fast path: a str key and a plain int in range (bool is excluded).
                if type(numel) is not int or not 0 <= numel <= MAX_VALUE or type(key) is not str:
                    self._bad_param(m, key, numel)
                first = sizes.setdefault(key, numel)
                if first != numel:
                    owner = next(o for o in self._modules if key in o.params)
                    raise GraphError(
                        f"module {_label(m.name)}: shared parameter {_show(key)} has size {numel} "
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
            raise GraphError(f"module {_label(m.name)}: parameter key {_show(key)} is not a string")
        what = f"module {_label(m.name)}: parameter {_show(key)}"
        if isinstance(numel, bool) or not isinstance(numel, int):
            raise GraphError(f"{what} size must be an integer, got {_show(numel)}")
        if numel < 0:
            raise GraphError(f"{what} has a negative size ({_show(numel)})")
        if numel > MAX_VALUE:
            raise GraphError(f"{what} size is too large ({_show(numel)}; at most 2**63 - 1)")

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
                    names = [_show(self._modules[i].name) for i in path]
                    if len(names) > 9:  # a 10,000-module cycle is not a one-line message
                        names[4:-4] = [f"... ({len(names) - 8} more)"]
                    cycle = " -> ".join(names)
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
        """Parse the ``smp-partition/module-graph@1`` dict (as loaded from JSON).

        Raises :class:`~smp_partition.errors.GraphError` naming the key or module at fault.
        Keys the schema does not define are ignored (a newer producer may add some).
        """
        if not isinstance(data, Mapping):
            raise GraphError(f"a module graph must be a JSON object, got {_show(data)}")
        if "schema" not in data:
            raise GraphError(f"missing key 'schema' (expected {SCHEMA!r})")
        schema = data["schema"]
        if schema != SCHEMA:
            raise GraphError(f"unknown schema {_show(schema)} (expected {SCHEMA!r})")
        if "modules" not in data:
            raise GraphError("missing key 'modules' (a list of module objects)")
        raw = data["modules"]
        if not isinstance(raw, list):
            raise GraphError(f"'modules' must be a list of module objects, got {_show(raw)}")
        with gc_paused():
            return cls(cls._parse_modules(raw))

    @staticmethod
    def _parse_modules(raw: list[Any]) -> list[Module]:
        modules: list[Module] = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, Mapping):
                raise GraphError(f"modules[{i}] must be an object, got {_show(entry)}")
            if "name" not in entry:
                raise GraphError(f"modules[{i}]: missing key 'name'")
            name = entry["name"]
            if not isinstance(name, str):
                raise GraphError(f"modules[{i}]: 'name' must be a string, got {_show(name)}")
            children = entry.get("children", [])
            if not isinstance(children, list):
                raise GraphError(
                    f"module {_label(name)}: 'children' must be a list of names, "
                    f"got {_show(children)}"
                )
            for j, child in enumerate(children):
                if not isinstance(child, str):
                    raise GraphError(
                        f"module {_label(name)}: 'children'[{j}] must be a module name, "
                        f"got {_show(child)}"
                    )
            params = entry.get("params", {})
            if not isinstance(params, Mapping):
                raise GraphError(
                    f"module {_label(name)}: 'params' must be an object, got {_show(params)}"
                )
            type_ = entry.get("type", "")
            if not isinstance(type_, str):
                raise GraphError(
                    f"module {_label(name)}: 'type' must be a string, got {_show(type_)}"
                )
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
        """Read and validate a module-graph JSON file (UTF-8).

        Every problem with the file, from a missing file or bytes that are not UTF-8 to
        JSON nested too deeply to parse, is a :class:`~smp_partition.errors.GraphError`
        whose message starts with the path.
        """
        where = _path_label(path)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError as e:
            raise GraphError(f"{where}: {e.strerror or e}") from None
        try:
            # Decoded here rather than by json: json.loads(bytes) would also accept UTF-16
            # and UTF-32, and a text-mode reader reports decode errors per chunk.
            text = blob.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GraphError(
                f"{where}: not UTF-8 text ({e.reason}, byte 0x{blob[e.start]:02x} at offset "
                f"{e.start})"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraphError(f"{where}: invalid JSON: {e}") from None
        except RecursionError:
            # The decoder recurses per nesting level; a graph never nests more than 4 deep.
            raise GraphError(f"{where}: invalid JSON: nested too deeply") from None
        except ValueError as e:
            # int() refuses numbers over sys.get_int_max_str_digits() digits.
            raise GraphError(f"{where}: invalid JSON: {str(e).split(';')[0]}") from None
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
