"""``run_mpi(fast_exit=True)``: each rank freezes the garbage collector as its last exit
handler, so interpreter finalization leaves the cyclic garbage it would have collected;
without it, a rank exits as a user's process does (the cycle is collected)."""

from __future__ import annotations

import os

from smp_comm.testing import FAST_EXIT_SITE, run_mpi

# Which sitecustomize was loaded, and an unreachable reference cycle whose finalizer says when
# it is collected: by finalization's collection unless the collector was frozen first (the
# cycle is left with few enough allocations after it that no automatic collection runs).
PROBE = """
import os, sys
site = sys.modules.get("sitecustomize")
# one write per line: the ranks share the output pipe, and print() writes its pieces apart
# when unbuffered, so two ranks' pieces interleaved ("SITESITE /..." in a CI run, 2 Dec)
os.write(1, f"SITE {getattr(site, '__file__', None)}\\n".encode())
class Cycle:
    def __del__(self):
        os.write(1, b"CYCLE-COLLECTED\\n")
c = Cycle()
c.self = c
del c
"""


def _run(tmp_path: object, fast_exit: bool) -> str:
    script = os.path.join(str(tmp_path), "probe.py")
    with open(script, "w") as f:
        f.write(PROBE)
    return run_mpi([script], 2, timeout=60, fast_exit=fast_exit)


def test_fast_exit_loads_the_shipped_site_and_skips_the_final_collection(tmp_path: object) -> None:
    assert os.path.isfile(os.path.join(FAST_EXIT_SITE, "sitecustomize.py")), FAST_EXIT_SITE
    out = _run(tmp_path, True)
    sites = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("SITE ")]
    assert sites == [os.path.join(FAST_EXIT_SITE, "sitecustomize.py")] * 2, out
    assert "CYCLE-COLLECTED" not in out, out


def test_without_fast_exit_no_site_is_added_and_the_cycle_is_collected(tmp_path: object) -> None:
    out = _run(tmp_path, False)
    assert not any(line.startswith("SITE ") and FAST_EXIT_SITE in line for line in out.splitlines()), out
    assert out.count("CYCLE-COLLECTED") == 2, out
