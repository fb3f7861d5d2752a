"""Run the import contracts in ``.importlinter`` and prove that they can fail.

``nox -s lint`` calls this. It checks the real tree, then two broken copies of it: one with an
import circle between two modules of a package, one with a package importing the umbrella.
Both copies must be refused, so a contract that silently stopped matching anything (a renamed
package, a typo in the configuration) fails the lint instead of passing it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["smp-partition", "smp-comm", "smp-tp", "smp-pipeline", "smp-torch"]


def lint(src_root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the packages found under ``src_root/<package>/src``."""
    path = os.pathsep.join(str(src_root / p / "src") for p in PACKAGES)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        ["lint-imports", str(ROOT / ".importlinter"), "--no-cache"],
        env=env, capture_output=True, text=True, check=False,
    )


def broken_copy(tmp: Path, edit: dict[str, str]) -> Path:
    """A copy of every package's sources with ``edit`` (path under packages/ -> text) added."""
    for p in PACKAGES:
        shutil.copytree(ROOT / "packages" / p / "src", tmp / p / "src")
    for rel, text in edit.items():
        (tmp / rel).write_text(text)
    return tmp


def main() -> int:
    real = lint(ROOT / "packages")
    print(real.stdout[-4000:], real.stderr[-2000:], sep="")
    if real.returncode != 0:
        return real.returncode
    probes = {
        "an import circle inside smp-pipeline": {
            "smp-pipeline/src/smp_pipeline/_probe_a.py": "from smp_pipeline import _probe_b\n",
            "smp-pipeline/src/smp_pipeline/_probe_b.py": "from smp_pipeline import _probe_a\n",
        },
        "smp-comm importing the umbrella": {
            "smp-comm/src/smp_comm/_probe.py": "import smp_torch\n",
        },
    }
    for what, edit in probes.items():
        with tempfile.TemporaryDirectory() as tmp:
            result = lint(broken_copy(Path(tmp), edit))
        # Refused, and for the probe itself (not for something else in the copy).
        if result.returncode == 0 or "_probe" not in result.stdout:
            print(f"import contracts did not catch {what}:\n{result.stdout}", file=sys.stderr)
            return 1
        print(f"self-check: the contracts refuse {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
