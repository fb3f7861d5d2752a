"""Run the import contracts in ``.importlinter`` and prove that they can fail.

``nox -s lint`` calls this. It checks the real tree, then two broken copies of it: one with an
import circle between two modules of a package, one with a package importing the umbrella.
Both copies must be refused, so a contract that silently stopped matching anything (a renamed
package, a typo in the configuration) fails the lint instead of passing it.

It also lists every import inside a function in ``packages/*/src``: each must be one of
:data:`LOCAL_IMPORTS`, with the reason it cannot be at the module's top (an optional
dependency, an import with a side effect wanted only on demand). A local import that avoids
nothing hides a module's dependencies and costs a lookup per call; the self-check adds one
to a copy and must see it refused.
"""

from __future__ import annotations

import ast
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


# (file under packages/, module imported) -> why it is imported inside a function.
LOCAL_IMPORTS = {
    ("smp-torch/src/smp_torch/context_parallel.py", "transformers"): (
        "optional: context parallelism routes Hugging Face models' attention, only with cp > 1"
    ),
    ("smp-torch/src/smp_torch/context_parallel.py", "transformers.loss.loss_utils"): (
        "optional: context parallelism routes Hugging Face models' attention, only with cp > 1"
    ),
    ("smp-pipeline/src/smp_pipeline/timeline.py", "matplotlib"): "optional ([plot] extra)",
    ("smp-pipeline/src/smp_pipeline/timeline.py", "matplotlib.pyplot"): "optional ([plot] extra)",
    ("smp-torch/src/smp_torch/plan/picture.py", "matplotlib"): "optional (not a dependency)",
    ("smp-torch/src/smp_torch/plan/picture.py", "matplotlib.pyplot"): "optional (not a dependency)",
    ("smp-torch/src/smp_torch/plan/__main__.py", "smp_torch.plan.picture"): "--plot only (matplotlib)",
    ("smp-torch/src/smp_torch/context.py", "smp_comm.torch_backend"): (
        "registers the smp backend with torch.distributed: only when that backend is chosen"
    ),
    ("smp-comm/src/smp_comm/compiled.py", "mpi4py"): "importing mpi4py.MPI initialises MPI",
    ("smp-comm/src/smp_comm/shutdown.py", "mpi4py"): "importing mpi4py.MPI initialises MPI",
    ("smp-comm/src/smp_comm/shutdown.py", "smp_comm.communicator"): (
        "the communicator needs mpi4py.MPI (initialising MPI); an exit path must not start it"
    ),
    **{
        (f"smp-torch/src/smp_torch/{f}", m): (
            "FSDP2 and DTensor take ~0.6 s to import: only a job that shards pays it"
        )
        for f, m in (
            ("sharded.py", "torch.distributed.fsdp"),
            ("sharded.py", "torch.distributed.tensor"),
            ("sharded_agree.py", "torch.distributed.fsdp"),
            ("sharded_pp.py", "torch.distributed.fsdp"),
            ("plan/profiling.py", "torch.distributed.fsdp"),
        )
    },
    ("smp-comm/src/smp_comm/paths.py", "torch.multiprocessing.reductions"): (
        "torch is optional in smp-comm (GPU peers only)"
    ),
}


def local_imports(src_root: Path) -> set[tuple[str, str]]:
    """``(file under src_root, module)`` for every import inside a function (an import under
    ``if TYPE_CHECKING:`` is at module level, so it does not count)."""
    found = set()
    for p in PACKAGES:
        for path in sorted((src_root / p / "src").rglob("*.py")):
            rel = path.relative_to(src_root).as_posix()
            for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        found |= {(rel, a.name) for a in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.module:
                        found.add((rel, node.module))
    return found


def unexplained_local_imports(src_root: Path) -> list[str]:
    return [f"{f}: {m}" for f, m in sorted(local_imports(src_root) - set(LOCAL_IMPORTS))]


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
    unexplained = unexplained_local_imports(ROOT / "packages")
    if unexplained:
        print(
            "imports inside functions that avoid no cycle and guard no optional dependency "
            "(move them to the module's top, or add them to LOCAL_IMPORTS with the reason):\n  "
            + "\n  ".join(unexplained),
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        probe = "smp-pipeline/src/smp_pipeline/_probe.py"
        copy = broken_copy(Path(tmp), {probe: "def f():\n    import os\n    return os\n"})
        if unexplained_local_imports(copy) != [f"{probe}: os"]:
            print("the local-import check did not catch a probe's import of os", file=sys.stderr)
            return 1
    print("self-check: the local-import check refuses an import inside a function")
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
