"""``run_mpi(fast_exit=True)``: each rank freezes the garbage collector at exit; without it,
a rank exits as a user's process does."""

from __future__ import annotations

import os

from smp_comm.testing import FAST_EXIT_SITE, run_mpi

# Prints, from the rank's last exit handler, whether the collector's objects are frozen by
# then (registered here, after sitecustomize's, so it runs before it: it checks the site
# is loaded from the installed package and the handler is in place, then calls it).
PROBE = """
import atexit, gc, sys
site = sys.modules.get("sitecustomize")
print("SITE", getattr(site, "__file__", None))
def probe():
    print("FROZEN-BEFORE", gc.get_freeze_count() > 0, flush=True)
atexit.register(probe)
"""


def _run(tmp_path: object, fast_exit: bool) -> str:
    script = os.path.join(str(tmp_path), "probe.py")
    with open(script, "w") as f:
        f.write(PROBE)
    return run_mpi([script], 2, timeout=60, fast_exit=fast_exit)


def test_fast_exit_loads_the_shipped_site_on_every_rank(tmp_path: object) -> None:
    assert os.path.isfile(os.path.join(FAST_EXIT_SITE, "sitecustomize.py")), FAST_EXIT_SITE
    out = _run(tmp_path, True)
    sites = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("SITE ")]
    assert sites == [os.path.join(FAST_EXIT_SITE, "sitecustomize.py")] * 2, out
    # Its handler runs after every handler a program registers: nothing is frozen before.
    assert out.count("FROZEN-BEFORE False") == 2, out


def test_without_fast_exit_no_site_is_added(tmp_path: object) -> None:
    out = _run(tmp_path, False)
    assert not any(
        line.startswith("SITE ") and FAST_EXIT_SITE in line for line in out.splitlines()
    ), out
