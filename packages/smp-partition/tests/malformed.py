"""A deterministic generator of malformed partitioner inputs, each with what the error must say.

Every case is derived from a valid graph (the bundled ``examples/graphs/t5-small.json`` when
the checkout has it, and small T5-like graphs built by ``conftest.t5_like``) by one defect,
chosen with a seeded :class:`random.Random`, so a failure reproduces from its case id alone.
A case is the bytes of the graph file (or a missing file / a directory) plus the command line
arguments, and the fragments the one-line error must contain: the key, module, option or file
at fault. ``POSITIVE`` holds a few valid but extreme inputs that must still succeed.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import t5_like
from smp_partition import SCHEMA

SEED = 20261124
HANG_TIMEOUT_S = 10.0
"""Per case: longer than this counts as a hang (the only wall-clock limit asserted)."""
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "graphs" / "t5-small.json"
GRAPH = "{graph}"  # replaced in argv by the path of the case's file
TMP = "{tmp}"  # replaced in argv by the case's scratch directory
DEFAULT_ARGS = ("--devices", "2")


@dataclass(frozen=True)
class Case:
    """One input for the CLI and what its error must say.

    ``content`` is written to ``{tmp}/graph.json`` (``None``: no file is written). ``argv``
    may use ``{graph}`` and ``{tmp}``. ``expect`` are fragments of the stderr line after the
    ``smp-partition: error: `` prefix. ``api`` tells whether the case is about the graph
    (so ``ModuleGraph.from_json`` must raise ``GraphError`` for it too).
    """

    id: str
    content: bytes | None
    expect: tuple[str, ...]
    argv: tuple[str, ...] = (GRAPH, *DEFAULT_ARGS)
    api: bool = True
    rc: int = 2


def argv_for(case: Case, tmp: Path) -> list[str]:
    """Write the case's file under ``tmp`` and return its command line."""
    graph = tmp / "graph.json"
    if case.content is not None:
        graph.write_bytes(case.content)
    return [a.replace(GRAPH, str(graph)).replace(TMP, str(tmp)) for a in case.argv]


# ---------------------------------------------------------------------------- bases
def _bases() -> list[dict[str, Any]]:
    bases = [t5_like(1).to_dict(), t5_like(3).to_dict()]
    timed = t5_like(2).to_dict()
    for i, m in enumerate(timed["modules"]):
        m["forward_ms"] = float(len(timed["modules"]) - i)
        m["activation_bytes"] = 4 * i
    bases.append(timed)
    if EXAMPLE.exists():
        bases.append(json.loads(EXAMPLE.read_text(encoding="utf-8")))
    return bases


def _dump(doc: Any) -> bytes:
    # allow_nan: NaN and Infinity are the json module's extension, and our reader takes them.
    return json.dumps(doc, allow_nan=True).encode("utf-8")


def _label(name: str) -> str:
    """How error messages quote a module name."""
    return repr(name) if name else "'' (the root)"


def _chain(depth: int) -> dict[str, Any]:
    """A root over a ``depth``-long chain c0 -> c1 -> ... (each with one parameter)."""
    mods = [{"name": "", "children": ["c0"]}]
    for i in range(depth):
        kids = [f"c{i + 1}"] if i + 1 < depth else []
        mods.append({"name": f"c{i}", "type": "M", "children": kids, "params": {f"c{i}.w": 1}})
    return {"schema": SCHEMA, "modules": mods}


def _unreachable(doc: dict[str, Any]) -> list[str]:
    """Names not reachable from the root, in list order (an independent BFS)."""
    kids = {m["name"]: m.get("children", []) for m in doc["modules"]}
    seen = {""}
    queue = [""]
    while queue:
        for c in kids.get(queue.pop(), []):
            if c not in seen:
                seen.add(c)
                queue.append(c)
    return [m["name"] for m in doc["modules"] if m["name"] not in seen]


def _ancestors(doc: dict[str, Any], name: str) -> list[str]:
    """Modules on one path from the root to ``name`` (root first, ``name`` last)."""
    parent: dict[str, str] = {}
    queue = [""]
    kids = {m["name"]: m.get("children", []) for m in doc["modules"]}
    while queue:
        p = queue.pop(0)
        for c in kids[p]:
            if c not in parent and c != "":
                parent[c] = p
                queue.append(c)
    path = [name]
    while path[-1] != "":
        path.append(parent[path[-1]])
    return path[::-1]


# ---------------------------------------------------------------------------- families
Gen = Iterator[Case]

_BAD_VALUES: dict[str, list[tuple[str, Any]]] = {
    "type": [("int", 3), ("null", None), ("list", []), ("object", {}), ("bool", True)],
    "children": [
        ("string", "abc"), ("int", 3), ("null", None), ("object", {}), ("bool", False),
    ],
    "params": [("list", [1]), ("string", "x"), ("int", 3), ("null", None), ("bool", True)],
    "activation_bytes": [
        ("string", "3"), ("negative", -1), ("negative float", -0.5), ("nan", float("nan")),
        ("inf", float("inf")), ("-inf", float("-inf")), ("bool", True), ("false", False),
        ("list", [1]), ("object", {}), ("huge float", 1e300), ("over int64", 2**63),
        ("huge int", 10**400),
    ],
    "forward_ms": [
        ("string", "1.5"), ("negative", -0.5), ("nan", float("nan")), ("inf", float("inf")),
        ("-inf", float("-inf")), ("bool", True), ("list", []), ("object", {"ms": 1}),
        ("huge float", 1e300), ("huge int", 10**400), ("nested", [[[[1]]]]),
    ],
}  # fmt: skip

_BAD_PARAM_SIZES: list[tuple[str, Any]] = [
    ("string", "3"), ("float", 1.5), ("integral float", 1e10), ("bool", True), ("null", None),
    ("negative", -1), ("list", [1]), ("object", {}), ("inf", float("inf")),
    ("nan", float("nan")), ("over int64", 2**63), ("huge int", 10**400),
]  # fmt: skip

_BAD_CHILD_ENTRIES: list[tuple[str, Any]] = [
    ("int", 3),
    ("null", None),
    ("list", []),
    ("object", {}),
    ("bool", True),
]


def _field_types(rng: random.Random, bases: list[dict[str, Any]]) -> Gen:
    """Every bad value of every field, twice, on random modules of random bases."""
    for rep in range(2):
        for key, values in _BAD_VALUES.items():
            for what, value in values:
                doc = copy.deepcopy(rng.choice(bases))
                entry = rng.choice(doc["modules"])
                entry[key] = value
                yield Case(f"field-{key}-{what}-{rep}", _dump(doc), (_label(entry["name"]), key))
        for what, value in _BAD_PARAM_SIZES:
            doc = copy.deepcopy(rng.choice(bases))
            entry = rng.choice(doc["modules"])
            key = f"{entry['name']}.bad{rep}"
            entry.setdefault("params", {})[key] = value
            yield Case(f"param-size-{what}-{rep}", _dump(doc), (_label(entry["name"]), repr(key)))
        for what, value in _BAD_CHILD_ENTRIES:
            doc = copy.deepcopy(rng.choice(bases))
            entry = rng.choice(doc["modules"])
            kids = list(entry.get("children", []))
            at = rng.randint(0, len(kids))
            entry["children"] = kids[:at] + [value] + kids[at:]
            yield Case(f"child-entry-{what}-{rep}", _dump(doc), (_label(entry["name"]), f"[{at}]"))
        for what, value in [("int", 3), ("string", "m"), ("null", None), ("list", [])]:
            doc = copy.deepcopy(rng.choice(bases))
            i = rng.randrange(len(doc["modules"]))
            doc["modules"][i] = value
            yield Case(f"entry-{what}-{rep}", _dump(doc), (f"modules[{i}]", "object"))
        for what, value in [("int", 3), ("null", None), ("list", ["a"]), ("bool", True)]:
            doc = copy.deepcopy(rng.choice(bases))
            i = rng.randrange(len(doc["modules"]))
            doc["modules"][i]["name"] = value
            yield Case(f"name-{what}-{rep}", _dump(doc), (f"modules[{i}]", "'name'"))
        doc = copy.deepcopy(rng.choice(bases))
        i = rng.randrange(len(doc["modules"]))
        del doc["modules"][i]["name"]
        yield Case(f"name-missing-{rep}", _dump(doc), (f"modules[{i}]", "missing key 'name'"))


def _top_level(rng: random.Random, bases: list[dict[str, Any]]) -> Gen:
    """The document as a whole: wrong type, missing or wrong schema and modules, empty."""
    base = bases[0]
    for what, doc in [
        ("list", []), ("int", 3), ("string", "graph"), ("null", None), ("bool", True),
        ("float", 1.5), ("nan", float("nan")), ("modules-list", base["modules"]),
    ]:  # fmt: skip
        yield Case(f"top-{what}", _dump(doc), ("JSON object",))
    for what, schema in [
        ("next-version", "smp-partition/module-graph@2"), ("empty", ""), ("null", None),
        ("int", 1), ("list", [SCHEMA]), ("assignment", "smp-partition/assignment@1"),
        ("case", SCHEMA.upper()), ("space", SCHEMA + " "),
    ]:  # fmt: skip
        yield Case(f"schema-{what}", _dump({**base, "schema": schema}), ("unknown schema",))
    for what, modules in [
        ("object", {}), ("string", "m"), ("null", None), ("int", 3), ("graph", base),
    ]:  # fmt: skip
        doc = {**base, "modules": modules}
        yield Case(f"modules-{what}", _dump(doc), ("'modules' must be a list",))
    yield Case("missing-schema", _dump({"modules": base["modules"]}), ("missing key 'schema'",))
    yield Case("missing-modules", _dump({"schema": SCHEMA}), ("missing key 'modules'",))
    yield Case("empty-object", b"{}", ("missing key 'schema'",))
    yield Case("empty-modules", _dump({"schema": SCHEMA, "modules": []}), ("missing root",))
    for name in ("model", "root", " "):
        doc = copy.deepcopy(rng.choice(bases))
        doc["modules"] = [m for m in doc["modules"] if m["name"] != ""]
        doc["modules"].insert(0, {"name": name, "children": []})
        yield Case(f"no-root-{name.strip() or 'blank'}", _dump(doc), ("missing root",))


def _structure(rng: random.Random, bases: list[dict[str, Any]]) -> Gen:
    """Defects only the whole tree shows: duplicates, dangling children, cycles, orphans,
    inconsistent shared parameters."""
    for rep in range(10):
        doc = copy.deepcopy(rng.choice(bases))
        mods = doc["modules"]
        name = rng.choice(mods)["name"]
        mods.insert(rng.randint(0, len(mods)), {"name": name})
        yield Case(f"duplicate-{rep}", _dump(doc), (f"duplicate module name {_label(name)}",))

        doc = copy.deepcopy(rng.choice(bases))
        entry = rng.choice(doc["modules"])
        entry["children"] = [*entry.get("children", []), f"ghost{rep}"]
        expect = (f"module {_label(entry['name'])} lists child 'ghost{rep}'",)
        yield Case(f"ghost-child-{rep}", _dump(doc), expect)

        # A module removed: its parents now list a child that does not exist.
        doc = copy.deepcopy(rng.choice(bases))
        gone = doc["modules"].pop(rng.randrange(1, len(doc["modules"])))
        yield Case(f"deleted-{rep}", _dump(doc), (f"lists child {_label(gone['name'])}",))

        # A parent listed as a child of one of its descendants (or of itself).
        doc = copy.deepcopy(rng.choice(bases))
        entry = rng.choice(doc["modules"])
        path = _ancestors(doc, entry["name"])
        back = rng.choice(path)
        entry["children"] = [*entry.get("children", []), back]
        expect = ("cycle in children", repr(entry["name"]), repr(back))
        yield Case(f"cycle-{rep}", _dump(doc), expect)

        # One edge from a parent dropped: that part of the tree has no root any more.
        doc = copy.deepcopy(rng.choice(bases))
        parents = [m for m in doc["modules"] if m.get("children")]
        entry = rng.choice(parents)
        entry["children"] = entry["children"][:-1]
        lost = _unreachable(doc)
        if lost:  # a reused child may still be reachable through another parent
            expect = (f"module {_label(lost[0])} is not reachable from the root",)
            yield Case(f"unlinked-{rep}", _dump(doc), expect)

        # A second (third, ...) root: modules nobody lists.
        doc = copy.deepcopy(rng.choice(bases))
        extra = [{"name": f"root{rep}.{k}", "children": []} for k in range(rep % 3 + 1)]
        for k in range(1, len(extra)):
            extra[0]["children"].append(extra[k]["name"])
        doc["modules"] += extra
        yield Case(f"second-root-{rep}", _dump(doc), (f"'root{rep}.0' is not reachable",))

        # One parameter key with two sizes (the same key means the same tied tensor).
        doc = copy.deepcopy(rng.choice(bases))
        holders = [m for m in doc["modules"] if m.get("params")]
        src = rng.choice(holders)
        dst = rng.choice([m for m in doc["modules"] if m is not src])
        key = rng.choice(sorted(src["params"]))
        dst.setdefault("params", {})[key] = src["params"][key] + rng.randint(1, 1000)
        yield Case(f"shared-size-{rep}", _dump(doc), (f"shared parameter {key!r} has size",))


def _text(rng: random.Random, bases: list[dict[str, Any]]) -> Gen:
    """Bytes that are not a JSON document, or not UTF-8, or nested beyond any graph."""
    good = _dump(bases[0])
    for what, blob in [
        ("empty", b""), ("blank", b" \n\t"), ("word", b"hello"), ("xml", b"<graph/>"),
        ("python-dict", b"{'schema': 1}"), ("missing-value", b'{"schema": }'),
        ("nul", b"\x00\x00"), ("open-list", b"[1, 2"), ("two-documents", b"{} {}"),
        ("trailing-comma", b'{"schema": "x",}'), ("bare-nan-word", b"nan"),
        ("comment", b"// graph\n{}"), ("bom", b"\xef\xbb\xbf" + good),
    ]:  # fmt: skip
        yield Case(f"not-json-{what}", blob, ("invalid JSON",))
    for rep in range(20):
        cut = rng.randrange(1, len(good))
        yield Case(f"truncated-{rep}-at-{cut}", good[:cut], ("invalid JSON",))
    at = good.index(b'"encoder"') + 3  # inside a module name
    for what, blob in [
        ("ff", good[:at] + b"\xff" + good[at:]),
        ("continuation", good[:at] + b"\x80" + good[at:]),
        ("overlong", good[:at] + b"\xc0\xaf" + good[at:]),
        ("surrogate-bytes", good[:at] + b"\xed\xa0\x80" + good[at:]),
        ("cut-sequence", good[:at] + b"\xe2\x82" + good[at:]),
        ("latin-1", good.replace(b'"encoder"', "\"encodér\"".encode("latin-1"))),
        ("utf-16", good.decode("utf-8").encode("utf-16")),
        ("utf-32", good.decode("utf-8").encode("utf-32")),
    ]:  # fmt: skip
        yield Case(f"not-utf8-{what}", blob, ("not UTF-8",))
    deep = 100_000
    for what, blob in [
        ("lists", b"[" * deep + b"]" * deep),
        ("objects", b'{"a":' * deep + b"1" + b"}" * deep),
        ("open-lists", b"[" * deep),
        ("in-params", good.replace(b'"params": {}', b'"params": ' + b"[" * deep + b"]" * deep, 1)),
    ]:  # fmt: skip
        yield Case(f"deep-{what}", blob, ("nested too deeply",))
    digits = b"9" * 5000
    yield Case("digits-5000", good.replace(b'"params": {}', b'"params": {"x": ' + digits + b"}", 1),
               ("invalid JSON", "digits"))  # fmt: skip
    # JSON's \ud800 escape gives a lone surrogate: valid JSON, but no output can encode it.
    doc = copy.deepcopy(bases[0])
    doc["modules"][1]["type"] = "\udc80"
    yield Case("surrogate-type", _dump(doc), ("'type'", "Unicode"))
    for rep in range(3):
        doc = copy.deepcopy(rng.choice(bases))
        entry = rng.choice(doc["modules"][1:])
        old, new = entry["name"], entry["name"] + "\ud800"
        for m in doc["modules"]:
            m["children"] = [new if c == old else c for c in m.get("children", [])]
        entry["name"] = new
        yield Case(f"surrogate-name-{rep}", _dump(doc), ("not valid Unicode", "name"))


def _deep_chain(rng: random.Random, bases: list[dict[str, Any]]) -> Gen:
    """A 10,000-deep module chain with one defect at the bottom (no RecursionError)."""
    depth = 10_000
    last = f"c{depth - 1}"
    doc = _chain(depth)
    doc["modules"][-1]["children"] = ["c0"]
    yield Case("chain-cycle", _dump(doc), ("cycle in children", "'c0'", repr(last)))
    doc = _chain(depth)
    doc["modules"][-1]["children"] = ["nowhere"]
    yield Case("chain-ghost", _dump(doc), (f"module {last!r} lists child 'nowhere'",))
    doc = _chain(depth)
    doc["modules"][-1]["params"] = {"w": -1}
    yield Case("chain-negative", _dump(doc), (f"module {last!r}: parameter 'w'", "negative"))
    doc = _chain(depth)
    doc["modules"][depth // 2]["children"] = []  # modules[i] is c{i-1}: c{depth//2} is lost
    yield Case("chain-cut", _dump(doc), (f"module 'c{depth // 2}' is not reachable",))


def _arguments(rng: random.Random, bases: list[dict[str, Any]]) -> Gen:
    """Command line errors with a valid graph file."""
    good = _dump(bases[0])
    for value in ("0", "-1", "x", "1.5", "", "1048577", str(10**30), "2e3"):
        yield Case(f"devices-{value or 'empty'}", good, ("--devices",),
                   (GRAPH, "--devices", value), api=False)  # fmt: skip
    for value in ("1.5", "-0.1", "nan", "inf", "x", ""):
        yield Case(f"alpha-{value or 'empty'}", good, ("--alpha",),
                   (GRAPH, *DEFAULT_ARGS, "--alpha", value), api=False)  # fmt: skip
    for name, args, expect in [
        ("method", (GRAPH, *DEFAULT_ARGS, "--method", "greedy"), "--method"),
        ("format", (GRAPH, *DEFAULT_ARGS, "--format", "png"), "--format"),
        ("unknown-flag", (GRAPH, *DEFAULT_ARGS, "--frobnicate"), "--frobnicate"),
        ("two-graphs", (GRAPH, *DEFAULT_ARGS, "extra.json"), "extra.json"),
        ("no-devices", (GRAPH,), "--devices"),
        ("nothing", (), "required"),
        ("devices-without-value", (GRAPH, "--devices"), "--devices"),
        ("output-in-missing-dir", (GRAPH, *DEFAULT_ARGS, "-o", TMP + "/no/dir/out.txt"), "out.txt"),
        ("output-is-directory", (GRAPH, *DEFAULT_ARGS, "-o", TMP), "Is a directory"),
    ]:  # fmt: skip
        yield Case(f"args-{name}", good, (expect,), args, api=False)
    yield Case("missing-file", None, ("missing.json", "No such file"),
               (TMP + "/missing.json", *DEFAULT_ARGS))  # fmt: skip
    yield Case("directory", None, ("Is a directory",), (TMP, *DEFAULT_ARGS))
    yield Case("empty-path", None, ("No such file",), ("", *DEFAULT_ARGS))
    yield Case("newline-path", None, ("\\n",), (TMP + "/a\nb.json", *DEFAULT_ARGS))


FAMILIES: list[Callable[[random.Random, list[dict[str, Any]]], Gen]] = [
    _text, _top_level, _field_types, _structure, _deep_chain, _arguments,
]  # fmt: skip


def cases() -> list[Case]:
    """All malformed cases, in a fixed order (same seed, same cases)."""
    rng = random.Random(SEED)
    bases = _bases()
    out = [c for family in FAMILIES for c in family(rng, bases)]
    ids = [c.id for c in out]
    assert len(set(ids)) == len(ids), "case ids must be unique"
    return out


def positive() -> list[Case]:
    """Valid but unusual inputs: these must succeed (exit 0), through the same runner."""
    bases = _bases()
    big = copy.deepcopy(bases[0])
    big["modules"][1]["params"] = {"huge": 2**63 - 1}
    big["modules"][2]["activation_bytes"] = float(2**62)
    extra = copy.deepcopy(bases[0])
    extra["producer"] = "a newer tool"  # keys the schema does not define are ignored
    extra["modules"][1]["dtype"] = "bf16"
    one = {"schema": SCHEMA, "modules": [{"name": ""}]}
    return [
        Case("ok-base", _dump(bases[0]), (), rc=0),
        Case("ok-chain-10000", _dump(_chain(10_000)), (), (GRAPH, "-d", "8", "-f", "svg"), rc=0),
        Case("ok-more-devices-than-modules", _dump(one), (), (GRAPH, "-d", "8"), rc=0),
        Case("ok-largest-sizes", _dump(big), (), rc=0),
        Case("ok-unknown-keys", _dump(extra), (), rc=0),
    ]
