"""The ``smp`` torch.distributed backend (smp_comm.torch_backend) against gloo, under mpiexec.

One MPI job per layout: one host with 2 and 4 ranks, and two pretend hosts (the node-identity
override) with 3 ranks (hosts {0, 1}, {2}) and 4 ranks (hosts {0, 2}, {1, 3}), so the
hierarchical path runs. 8 KiB slots make the larger cases take several steps, and ~12 KB
host pieces several overlapped exchanges between the pretend hosts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

LAYOUTS = [(2, "one"), (3, "split"), (4, "one"), (4, "interleave")]
CASES = ["gather-broadcast", "reductions", "names-fallback", "all-to-all", "mismatch-async", "subgroup"]
ENV = {"SMP_COMM_COLL_SLOT_BYTES": "8192", "SMP_COMM_COLL_HOST_CHUNK_BYTES": "12000"}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("n", "hosts"), LAYOUTS)
def test_backend(mpi_job, assert_case, n: int, hosts: str, case: str) -> None:
    job = mpi_job("torch_backend.py", hosts, n=n, timeout=300, env=ENV)
    assert_case(job, case, range(n))


def test_dead_peer_raises(mpi_job, assert_case) -> None:
    # The dead rank ends with os._exit and no MPI_Finalize: without -disable-auto-cleanup the
    # launcher kills the survivors at once, and under load that came before they noticed the
    # death (a fresh-clone CI run: exit 9, ranks 0 and 1 silent).
    job = mpi_job("dead_peer.py", n=3, timeout=120, launcher_args=("-disable-auto-cleanup",))
    assert_case(job, "dead-peer", range(3))


def test_registers_without_process_group() -> None:
    import smp_comm.torch_backend as tb
    import torch.distributed as dist

    assert "smp" in dist.Backend.backend_list
    assert tb.BACKEND_NAME == "smp"


@pytest.mark.parametrize(
    "case", ["functional", "compiled", "dtensor", "fsdp2", "ddp", "subgroup-functional"]
)
def test_torch_apis_match_gloo(mpi_job, assert_case, case: str) -> None:
    # Functional collectives (eager and compiled), DTensor, FSDP2 with its full state dict,
    # DDP: each on an smp group equal to the same call on gloo, 4 ranks.
    job = mpi_job("torch_apis.py", n=4, timeout=300)
    assert_case(job, case, range(4))


@pytest.mark.parametrize("case", ["absent-small", "absent-large", "absent-subgroup", "abort"])
def test_absent_peer_and_abort_name_the_rank(mpi_job, assert_case, case: str) -> None:
    # A collective a peer never joins raises within the group's timeout (3 s) naming the
    # peer's job-wide rank; abort() on one rank ends its peers' waits at once.
    job = mpi_job("absent_peer.py", n=3, timeout=180)
    assert_case(job, case, range(3))


@pytest.mark.parametrize(
    "case", ["p2p-ring", "p2p-anysource", "p2p-batch", "p2p-subgroup", "p2p-size", "p2p-absent"]
)
@pytest.mark.parametrize("n", [2, 3])
def test_point_to_point_over_mpi(mpi_job, assert_case, n: int, case: str) -> None:
    # Under MPI an smp group's send/recv go between the callers' tensors over MPI: every
    # dtype, strided, any source, subgroups; sizes that disagree and an absent sender raise
    # naming the peer.
    job = mpi_job("torch_p2p.py", n=n, timeout=180)
    assert_case(job, case, range(n))


@pytest.mark.parametrize(("n", "compiled"), [(2, "1"), (3, "1"), (4, "1"), (3, "0")])
def test_large_all_reduce_is_rank_order_bit_for_bit(mpi_job, assert_case, n: int,
                                                    compiled: str) -> None:
    # The two-step all-reduce, with its C kernel and without (SMP_COMM_COMPILED=0): byte for
    # byte the left-to-right rank-order reduction, on every rank. 3 ranks: a rank's own part
    # read from its tensor, not its slot, lands mid-sum on rank 1.
    env = {**ENV, "SMP_COMM_COMPILED": compiled}
    job = mpi_job("large_all_reduce.py", n=n, timeout=300, env=env)
    assert_case(job, "large-all-reduce", range(n))
