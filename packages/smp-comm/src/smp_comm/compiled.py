"""The optional compiled fast path: ``_fastlane.c``, built on first use, cached on disk.

A 1 KiB message's round trip is dominated by Python's per-step costs (attribute reads,
calls, ``struct`` packs; figures in docs/perf-notes.md). The C file does one message's
byte-level work in one call each way; every decision stays in Python.

It is compiled, not shipped: it must call the very MPI library mpi4py has loaded (an mpich
wheel, a cluster's MPICH or Open MPI, the MPI standard ABI), which is known only at run
time. :func:`load` therefore finds that library and its ``mpi.h``, compiles with the C
compiler Python was built with (``cc`` otherwise) into a cache directory keyed by every
input, and imports the result. Several ranks building at once each write their own file
and rename it into place. Anything missing (no compiler, no headers, a non-Linux host, a
big-endian machine) or failing: :func:`load` returns ``None``, :func:`why_not` says why, and
the communicator uses the pure-Python fast path, which sends the same frames.

Setting ``compiled=False`` / ``SMP_COMM_COMPILED=0`` skips it; ``SMP_COMM_CACHE_DIR`` moves
the cache (default ``$XDG_CACHE_HOME/smp-comm``, else ``~/.cache/smp-comm``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from smp_comm import fastpath

__all__ = ["load", "load_extension", "load_library", "why_not"]

_SOURCE = Path(__file__).with_name("_fastlane.c")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" and "why", once tried


def load() -> ModuleType | None:
    """The compiled fast-path module, building it if needed; ``None`` if unavailable."""
    with _lock:
        if "why" not in _state:
            try:
                _state["module"], _state["why"] = _build(), ""
            except _Unavailable as exc:
                _state["module"], _state["why"] = None, str(exc)
            except Exception as exc:  # noqa: BLE001 - any failure means: use Python
                _state["module"], _state["why"] = None, f"{type(exc).__name__}: {exc}"
        return _state["module"]  # type: ignore[return-value]


def why_not() -> str:
    """Why :func:`load` returned ``None`` ("" if it did not, or was not tried)."""
    return str(_state.get("why", ""))


class _Unavailable(Exception):
    pass


def _loaded_libmpi() -> Path:
    """The MPI shared library mpi4py has loaded into this process."""
    from mpi4py import MPI  # noqa: F401 - loads libmpi

    if not sys.platform.startswith("linux"):
        raise _Unavailable("only built on Linux (the loaded MPI library is found in /proc)")
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            name = os.path.basename(path)
            if name.startswith(("libmpi.so", "libmpi_abi.so")) and path not in found:
                found.append(path)
    if len(found) != 1:
        raise _Unavailable(f"expected one loaded libmpi, found {found or 'none'}")
    return Path(found[0])


def _header(lib: Path) -> tuple[str, Path]:
    """(the header to include, its directory) matching the loaded library's ABI."""
    name = "mpi_abi.h" if lib.name.startswith("libmpi_abi") else "mpi.h"
    for include in (lib.parent.parent / "include", lib.parent.parent / "include" / "mpich"):
        if (include / name).is_file():
            return name, include
    mpicc = shutil.which("mpicc")
    if mpicc:  # a system MPI: ask its wrapper where the headers are
        try:
            flags = subprocess.run(
                [mpicc, "-show"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise _Unavailable(f"{mpicc} -show failed: {exc}") from exc
        for flag in shlex.split(flags):
            if flag.startswith("-I") and (Path(flag[2:]) / name).is_file():
                return name, Path(flag[2:])
    raise _Unavailable(f"no {name} found for {lib}")


def _cache_dir() -> Path:
    base = os.environ.get("SMP_COMM_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "smp-comm"


def _compiler() -> list[str]:
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if not shutil.which(cc[0]):
        cc = ["cc"]
        if not shutil.which("cc"):
            raise _Unavailable("no C compiler (cc) on PATH")
    return cc


def _compile(source: Path, target: Path, cmd: list[str]) -> None:
    """Run ``cmd`` (which writes ``{out}``) into a temporary file, then rename it to
    ``target``: a rank racing us loads a whole file either way."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [part.replace("{out}", tmp) for part in cmd], capture_output=True, text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        os.unlink(tmp)
        raise _Unavailable(f"compiler failed to run: {exc}") from exc
    if done.returncode != 0:
        os.unlink(tmp)
        raise _Unavailable(f"compiling {source.name} failed: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)


def _cached(source: Path, name: str, *inputs: bytes | str) -> Path:
    key = hashlib.sha256(source.read_bytes())
    for part in inputs:
        key.update(part if isinstance(part, bytes) else part.encode())
    return _cache_dir() / key.hexdigest()[:20] / name


def _allowed() -> bool:
    """Whether plain C files may be built here (Linux, and not ``SMP_COMM_COMPILED=0``)."""
    return os.environ.get("SMP_COMM_COMPILED", "1") != "0" and sys.platform.startswith("linux")


_libraries: dict[Path, ctypes.CDLL | None] = {}


def load_library(source: Path) -> ctypes.CDLL | None:
    """A plain C file (no Python or MPI headers) built into a shared library on first use,
    cached like the fast path, and loaded with ctypes; ``None`` if it cannot be built
    (no compiler, not Linux, ``SMP_COMM_COMPILED=0``)."""
    with _lock:
        if source not in _libraries:
            _libraries[source] = None
            if _allowed():
                try:
                    cc = _compiler()
                    target = _cached(source, source.stem + ".so", " ".join(cc))
                    if not target.is_file():
                        _compile(source, target, [
                            *cc, "-O2", "-fwrapv", "-shared", "-fPIC", "-o", "{out}", str(source),
                        ])
                    _libraries[source] = ctypes.CDLL(str(target))
                except (_Unavailable, OSError):
                    pass
        return _libraries[source]


def _build() -> ModuleType:
    if sys.byteorder != "little":
        raise _Unavailable("frames are written little-endian; this host is big-endian")
    lib = _loaded_libmpi()
    header, include = _header(lib)
    py_include = sysconfig.get_paths()["include"]
    if not Path(py_include, "Python.h").is_file():
        raise _Unavailable(f"no Python.h in {py_include} (install the Python headers)")
    cc = _compiler()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = _cached(
        _SOURCE, f"_fastlane{suffix}", (include / header).read_bytes(), str(lib.resolve()),
        suffix, " ".join(cc),
    )
    if not target.is_file():
        _compile(_SOURCE, target, [
            *cc, "-O2", "-shared", "-fPIC", "-o", "{out}", str(_SOURCE),
            f"-DSMP_MPI_HEADER=<{header}>", f"-I{py_include}", f"-I{include}",
            # Linked by file name: the loader then reuses the copy mpi4py has loaded.
            f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}",
        ])  # fmt: skip
    module = _import(target, "smp_comm._fastlane")
    fastpath.configure_compiled(module)
    return module


def _import(target: Path, name: str) -> ModuleType:
    """Import the built extension module at ``target`` as ``name``."""
    spec = importlib.util.spec_from_file_location(
        name, target, loader=importlib.machinery.ExtensionFileLoader(name, str(target))
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_extensions: dict[Path, ModuleType | None] = {}


def load_extension(source: Path, name: str, *includes: Path) -> ModuleType | None:
    """A C file using only Python's C API (no MPI) built into the extension module ``name``
    on first use, cached like the fast path, and imported; the files it includes from
    its own directory are listed in ``includes`` (they are part of the cache key). ``None``
    if it cannot be built (no compiler or Python headers, not Linux, ``SMP_COMM_COMPILED=0``).
    """
    with _lock:
        if source not in _extensions:
            _extensions[source] = None
            if _allowed():
                try:
                    _extensions[source] = _build_extension(source, name, includes)
                except (_Unavailable, OSError, ImportError):
                    pass
        return _extensions[source]


def _build_extension(source: Path, name: str, includes: tuple[Path, ...]) -> ModuleType:
    py_include = sysconfig.get_paths()["include"]
    if not Path(py_include, "Python.h").is_file():
        raise _Unavailable(f"no Python.h in {py_include} (install the Python headers)")
    cc = _compiler()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    leaf = name.rsplit(".", 1)[-1]
    target = _cached(
        source, f"{leaf}{suffix}", *(p.read_bytes() for p in includes), suffix, " ".join(cc),
        py_include,
    )
    if not target.is_file():
        _compile(source, target, [
            *cc, "-O2", "-fwrapv", "-shared", "-fPIC", "-o", "{out}", str(source),
            f"-I{py_include}", f"-I{source.parent}",
        ])  # fmt: skip
    return _import(target, name)
