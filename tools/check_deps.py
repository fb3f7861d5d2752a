"""Check that each package declares what it imports, and that the packages agree on versions.

``nox -s lint`` calls this. For every package under ``packages/``:

- every third-party module its ``src`` imports unconditionally (at module level, not inside a
  ``try`` that catches ``ImportError``) is in its ``dependencies`` or one of its extras (a
  module only used with that extra: smp-comm's torch backend); a guarded or function-local
  import is optional and needs no declaration;
- every ``torch`` requirement in ``dependencies`` or an extra (not ``test``, which pins it)
  has the floor nox pins for the tests
  (``TORCH_PIN`` in ``noxfile.py``): the lowest version the tests run on is what is promised;
- every ``transformers`` requirement in a ``test`` extra is the same one.

Then it proves it can fail: a copy of the tree where smp-pipeline no longer declares numpy
must be refused.
"""

from __future__ import annotations

import ast
import re
import shutil
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*(.*)$")


def _dist(requirement: str) -> tuple[str, str]:
    """``("torch", ">=2.13")`` from ``"torch>=2.13"`` (names normalised: ``_`` → ``-``)."""
    match = _NAME.match(requirement.split(";")[0])
    assert match, requirement
    return match.group(1).lower().replace("_", "-"), match.group(2).strip()


def _version(text: str) -> tuple[int, ...]:
    """``(2, 13)`` from ``"2.13.0"``: trailing zeros dropped, so 2.13 == 2.13.0."""
    parts = [int(p) for p in text.strip().split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _guarded(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = handler.type
        caught = [names] if not isinstance(names, ast.Tuple) else list(names.elts) if names else []
        if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in caught):
            return True
    return False


def _required_imports(source: str) -> set[str]:
    """Top-level names of the modules a file imports whatever happens."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Import):
                found.update(alias.name.split(".")[0] for alias in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                found.add(stmt.module.split(".")[0])
            elif isinstance(stmt, ast.Try) and not _guarded(stmt):
                visit(stmt.body)
            elif isinstance(stmt, ast.If):
                # `if TYPE_CHECKING:` imports never run; any other branch may not either.
                continue

    visit(ast.parse(source).body)
    return found


def problems(root: Path) -> list[str]:
    """Every mismatch between what the packages under ``root`` import and declare."""
    out: list[str] = []
    pin = re.search(r'TORCH_PIN = "torch==([0-9.]+)"', (root / "noxfile.py").read_text())
    torch_floor = _version(pin.group(1)) if pin else None
    transformers: dict[str, str] = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        package = pyproject.parent.name
        project = tomllib.loads(pyproject.read_text())["project"]
        declared = dict(_dist(r) for r in project.get("dependencies", []))
        extras = {_dist(r)[0] for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
        own = package.replace("-", "_")
        for path in sorted((pyproject.parent / "src").rglob("*.py")):
            for module in sorted(_required_imports(path.read_text())):
                dist = module.replace("_", "-")
                if module == own or module in sys.stdlib_module_names or module.startswith("_"):
                    continue
                if dist not in declared and dist not in extras:
                    rel = path.relative_to(root)
                    out.append(f"{package}: {rel} imports {module}, which its dependencies lack")
        # The floor in dependencies and in any extra but the test one (which pins it exactly).
        floors = [("dependencies", declared.get("torch"))] + [
            (f"extra [{extra}]", dict(_dist(r) for r in reqs).get("torch"))
            for extra, reqs in project.get("optional-dependencies", {}).items() if extra != "test"
        ]  # fmt: skip
        for where, spec in floors:
            if spec is not None and torch_floor and not (spec.startswith(">=") and _version(spec[2:]) == torch_floor):
                out.append(f"{package}: {where} declares torch{spec}, the tests run on torch "
                           f"{'.'.join(map(str, torch_floor))} (noxfile's TORCH_PIN)")
        for requirement in project.get("optional-dependencies", {}).get("test", []):
            name, spec = _dist(requirement)
            if name == "transformers":
                transformers[package] = spec
    if len(set(transformers.values())) > 1:
        out.append(f"the test extras disagree on transformers: {transformers}")
    return out


def main() -> int:
    found = problems(ROOT)
    for line in found:
        print(line)
    if found:
        return 1
    # Prove the check can fail: smp-pipeline without its numpy declaration.
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        shutil.copy(ROOT / "noxfile.py", copy / "noxfile.py")
        shutil.copytree(ROOT / "packages" / "smp-pipeline", copy / "packages" / "smp-pipeline",
                        ignore=shutil.ignore_patterns("tests", "__pycache__", "*.egg-info"))
        pyproject = copy / "packages" / "smp-pipeline" / "pyproject.toml"
        pyproject.write_text(re.sub(r'\n\s*"numpy[^"]*",', "", pyproject.read_text()))
        if not any("imports numpy" in line for line in problems(copy)):
            print("self-check failed: an undeclared numpy import went unnoticed")
            return 1
    print("dependencies: every unconditional import declared; torch floors and transformers agree")
    print("self-check: an undeclared import is refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
