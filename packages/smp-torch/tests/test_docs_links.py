"""The READMEs and docs pages point at files that exist (issue 48: READMEs became short and
link into ``docs/``; a moved or renamed page must not leave a dead link on GitHub).

``nox -s docs`` checks the links between docs pages with MkDocs (``--strict``); this checks,
without MkDocs, the links GitHub follows from the READMEs, and that the top-level README keeps
the two set-up commands verbatim. Skipped when the package is tested outside the monorepo.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if not (ROOT / "mkdocs.yml").exists():  # pragma: no cover - a copy of the package alone
    pytest.skip("not inside the smp monorepo", allow_module_level=True)

READMES = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_links_resolve(readme: Path) -> None:
    dead = [t for t in _relative_links(readme) if not (readme.parent / t.split("#")[0]).exists()]
    assert not dead, f"{readme.relative_to(ROOT)} links to missing files: {dead}"


def test_package_readmes_link_into_the_docs() -> None:
    for readme in READMES[1:]:
        assert any(t.startswith("../../docs/") for t in _relative_links(readme)), readme


def test_top_readme_keeps_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert "python3 -m pip install nox && python3 -m nox -s demo" in lines
    assert "python3 -m pip install nox && python3 -m nox -s tests" in lines
