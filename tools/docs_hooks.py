"""MkDocs hooks of the docs site (``mkdocs.yml``: ``hooks``).

``on_files`` adds the configuration reference, rendered from smp-torch's config definition by
``tools/config_reference.py`` on every build, so the page is never stored and cannot go stale.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import config_reference  # noqa: E402  (tools/ is not a package)
from mkdocs.structure.files import File, Files  # noqa: E402


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, config_reference.PAGE, content=config_reference.render()))
    return files
