"""Every developer and CI task for the smp monorepo.

Each package is tested in a virtual environment that holds only that package, its declared
dependencies (the smp ones installed from their local folders) and its ``test`` extra.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
PACKAGES = ["smp-partition", "smp-comm", "smp-tp", "smp-pipeline", "smp-torch"]
# torch is pinned everywhere we install it: a CPU build of this version is available offline,
# and an unpinned torch would pull several GB of CUDA wheels.
TORCH_PIN = "torch==2.13.0"

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _pyproject(package: str) -> dict:
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _requirement_name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return req.strip()


def _local_closure(package: str) -> list[str]:
    """The package and every smp package it depends on, dependencies first."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for req in _pyproject(name).get("dependencies", []):
            dep = _requirement_name(req)
            if dep in PACKAGES:
                visit(dep)
        order.append(name)

    visit(package)
    return order


def _declares(packages: list[str], requirement: str) -> bool:
    return any(
        _requirement_name(r) == requirement
        for p in packages
        for r in _pyproject(p).get("dependencies", [])
    )


def _needs_torch(packages: list[str]) -> bool:
    return _declares(packages, "torch")


# pip byte-compiles all of torch (~40 s per environment, five environments in `tests`), most
# of which no test imports. Instead each environment installs without compiling and lets the
# imports compile what they use, once, into the environment's own cache folder
# (PYTHONPYCACHEPREFIX: nothing is written into the checkout). The development and CI
# machines set PYTHONDONTWRITEBYTECODE, under which `--no-compile` alone made every test
# process compile torch again (smp-comm's session took 327 s against 217 s), so the session
# turns that off for itself. uv, when nox uses it, does not compile by default.
def _install_compiling_on_import(session: nox.Session, *args: str) -> None:
    """``session.install(*args)`` without byte-compiling; imports compile into the cache."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty counts as unset
    session.env["PYTHONPYCACHEPREFIX"] = str(Path(session.virtualenv.location) / "pycache")
    extra = ["--no-compile"] if session.venv_backend not in ("uv", "none") else []
    session.install(*extra, *args)


def _install(session: nox.Session, package: str, extra: str | None = "test") -> None:
    closure = _local_closure(package)
    args = [TORCH_PIN] if _needs_torch(closure) else []
    for name in closure:
        path = f"./packages/{name}"
        args.append(f"{path}[{extra}]" if (name == package and extra) else path)
    _install_compiling_on_import(session, *args)


@nox.session
@nox.parametrize("package", [*PACKAGES, "docs"])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests in an environment holding only that package and its deps;
    ``docs``: build the docs site with warnings as errors (so CI builds it too)."""
    if package == "docs":
        docs(session)
        return
    _install(session, package)
    session.chdir(ROOT / "packages" / package)
    # pytest exits 5 when it collected nothing; nox treats any non-zero exit as failure.
    # --durations: the slowest tests, printed, for the suite's 30-minute budget.
    session.run(
        "python", "-m", "pytest", "-ra", "-p", "no:cacheprovider", "--durations=15",
        *session.posargs,
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree, the import contracts in ``.importlinter``, then the declared
    dependencies against the imports (``tools/check_deps.py``)."""
    session.install("ruff", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("python", "tools/check_imports.py")
    session.run("python", "tools/check_deps.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy: strict for smp-partition, the default level elsewhere."""
    session.install("mypy", TORCH_PIN, "numpy", "mpi4py")
    for name in PACKAGES:
        session.install("--no-deps", f"./packages/{name}")
    session.run("mypy", "--strict", "packages/smp-partition/src/smp_partition")
    for name in PACKAGES[1:]:
        mod = name.replace("-", "_")
        session.run("mypy", "--ignore-missing-imports", f"packages/{name}/src/{mod}")


@nox.session
def build(session: nox.Session) -> None:
    """Build every wheel, then install each with only its deps into a fresh venv and import it."""
    session.install("build", "virtualenv")
    dist = ROOT / "dist"
    for name in PACKAGES:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist), f"packages/{name}")
    for name in PACKAGES:
        venv = Path(session.create_tmp()) / f"venv-{name}"
        session.run("python", "-m", "virtualenv", "-q", str(venv))
        py = str(venv / "bin" / "python")
        closure = _local_closure(name)
        wheels = []
        for dep in closure:
            mod = dep.replace("-", "_")
            wheels += sorted(glob.glob(str(dist / f"{mod}-*.whl")))[-1:]
        pin = [TORCH_PIN] if _needs_torch(closure) else []
        # mpi4py needs an MPI library: a cluster has one, here the mpich wheel stands in.
        mpi = ["mpich"] if _declares(closure, "mpi4py") else []
        session.run(py, "-m", "pip", "install", "-q", *pin, *mpi, *wheels, external=True)
        mod = name.replace("-", "_")
        session.run(py, "-c", f"import {mod}; print({mod}.__name__, {mod}.__version__)", external=True)


def _install_everything(session: nox.Session) -> None:
    _install_compiling_on_import(session, TORCH_PIN, "mpich", "transformers>=5.0", "matplotlib", "tqdm")
    _install_compiling_on_import(session, *[f"./packages/{name}" for name in PACKAGES])


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: train the GPT example on 4 CPU processes (pp=2 x tp=2)."""
    demo_script = ROOT / "examples" / "demo.py"
    if demo_script.exists():
        _install_everything(session)
        session.run("python", str(demo_script), *session.posargs)
    else:
        _install(session, "smp-partition", extra=None)
        graph = ROOT / "examples" / "graphs" / "t5-small.json"
        session.run("smp-partition", str(graph), "--devices", "4", "--alpha", "0.8")


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark script in benchmarks/, each printing its ratios (not tests)."""
    _install_everything(session)
    scripts = sorted(glob.glob(str(ROOT / "benchmarks" / "bench_*.py")))
    only = session.posargs
    for script in scripts:
        if only and not any(o in os.path.basename(script) for o in only):
            continue
        session.run("python", script, env={"PYTHONUNBUFFERED": "1"})
    if not scripts:
        session.error("no benchmarks found in benchmarks/")


# The docs site's tools, pinned so that a build today and a build next year render the same.
DOCS_PINS = [
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings==1.0.8",
    "mkdocstrings-python==2.0.11",
    "griffe==2.4.1",
]

# mkdocs-material prints a banner about its successor on every build; the build log stays
# for what the build says.
_QUIET_MKDOCS = {"NO_MKDOCS_2_WARNING": "1"}


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site into ``site/`` with warnings as errors (``mkdocs.yml``).

    The configuration reference is generated from smp-torch's config definition during the
    build (``tools/docs_hooks.py``), so smp-torch and its dependencies are installed too.
    ``nox -s docs -- serve`` previews it instead.
    """
    _install_compiling_on_import(session, *DOCS_PINS, TORCH_PIN, "mpich")
    _install_compiling_on_import(session, *[f"./packages/{name}" for name in PACKAGES])
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:], env=_QUIET_MKDOCS)
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs, env=_QUIET_MKDOCS)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run me through nox: python3 -m nox -l")
