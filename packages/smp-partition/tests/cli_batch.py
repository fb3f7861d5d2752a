"""Run many ``smp-partition`` command lines in one interpreter (a helper of test_malformed.py).

Reads ``[[case_id, argv], ...]`` as JSON on stdin and prints one JSON object per case:
``{"id", "rc", "stdout", "stderr", "exception", "seconds"}``. Each case calls the function the
``smp-partition`` console script calls (resolved through its entry point when the package is
installed) exactly as the script's wrapper does, ``sys.exit(main())``, with stdout and stderr
replaced by UTF-8 streams configured like the real ones (strict stdout, backslashreplace
stderr), so encoding errors surface as they would in a terminal. An interpreter per case
costs ~80 ms here; this runs a few hundred cases in about a second.

A case that runs longer than ``--timeout`` seconds is stopped by SIGALRM and reported as a
hang; an exception other than ``SystemExit`` is reported with its traceback.
"""

from __future__ import annotations

import argparse
import io
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from types import FrameType
from typing import Any


class Hang(BaseException):
    """Raised by the alarm: BaseException, so the code under test cannot swallow it."""


def console_main() -> Callable[[], Any]:
    """The callable behind the ``smp-partition`` console script."""
    for ep in metadata.entry_points(group="console_scripts", name="smp-partition"):
        loaded: Callable[[], Any] = ep.load()
        return loaded
    from smp_partition.cli import main  # not installed (running from a source tree)

    return main


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise Hang()


def run_one(main: Callable[[], Any], argv: list[str], timeout: float) -> dict[str, Any]:
    """Run ``main`` as the console script would with ``sys.argv[1:] == argv``."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace")
    saved = sys.argv, sys.stdout, sys.stderr
    sys.argv, sys.stdout, sys.stderr = ["smp-partition", *argv], out, err
    exception = None
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            sys.exit(main())
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except SystemExit as e:
        # As the interpreter does: None is 0, an int is itself, anything else is printed.
        code = e.code
        if code is None:
            rc = 0
        elif isinstance(code, int):
            rc = code
        else:
            print(code, file=err)
            rc = 1
    except Hang:
        rc, exception = -1, f"hang: no exit within {timeout} s"
    except BaseException:
        rc, exception = 1, traceback.format_exc()
    seconds = time.perf_counter() - start
    try:
        out.flush()
        err.flush()
    except UnicodeEncodeError:  # only the strict stdout can fail
        exception = (exception or "") + traceback.format_exc()
    sys.argv, sys.stdout, sys.stderr = saved
    stdout = out_bytes.getvalue().decode("utf-8", "replace")
    return {
        "rc": rc,
        "stdout": stdout[-2000:],  # enough to show a stray traceback; outputs can be large
        "stderr": err_bytes.getvalue().decode("utf-8", "replace"),
        "exception": exception,
        "seconds": seconds,
    }


def main() -> None:
    """Run every case from stdin, one JSON line per case, flushed as it finishes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, required=True)
    timeout = parser.parse_args().timeout
    signal.signal(signal.SIGALRM, _on_alarm)
    cases = json.load(sys.stdin)
    target = console_main()
    report = sys.stdout
    for case_id, argv in cases:
        result = run_one(target, argv, timeout)
        report.write(json.dumps({"id": case_id, **result}) + "\n")
        report.flush()


if __name__ == "__main__":
    main()
