"""Bad sharded-data-parallel configurations raise smp.ConfigError on every rank, naming the key.

Run on 4 ranks; prints ``RANK <r> CONFIGERROR <case> <key>`` for every case.
"""

from __future__ import annotations

import os

import smp_torch as smp


def say(line: str) -> None:
    """One line in ONE write: ``print`` writes the text and its newline separately, and the
    launcher forwards each write of each rank as it comes, so four ranks' printed lines can
    arrive glued together (seen: one rank's case count off by one on a loaded machine)."""
    os.write(1, (line + "\n").encode())

SDP2 = {"sharded_data_parallel_degree": 2}
CASES = [
    ("not-dividing", {"sharded_data_parallel_degree": 3}, "sharded_data_parallel_degree"),
    ("not-dividing-dp", {"sharded_data_parallel_degree": 4, "pipeline_parallel_degree": 2}, "sharded_data_parallel_degree"),
    ("zero", {"sharded_data_parallel_degree": 0}, "sharded_data_parallel_degree"),
    ("string", {"sharded_data_parallel_degree": "2"}, "sharded_data_parallel_degree"),
    ("with-shard-optimizer-state", {**SDP2, "shard_optimizer_state": True}, "shard_optimizer_state"),
    ("negative-bucket", {**SDP2, "sdp_reduce_bucket_size": -1}, "sdp_reduce_bucket_size"),
    ("negative-threshold", {**SDP2, "sdp_param_persistence_threshold": -5}, "sdp_param_persistence_threshold"),
    ("negative-live", {**SDP2, "sdp_max_live_parameters": -1}, "sdp_max_live_parameters"),
    ("negative-clipping", {**SDP2, "sdp_gradient_clipping": -1.0}, "sdp_gradient_clipping"),
    ("hierarchical-int", {**SDP2, "sdp_hierarchical_allgather": 1}, "sdp_hierarchical_allgather"),
    # tp=2 leaves 2 ranks per tensor-parallel slice: a sharding degree of 4 cannot fit.
    ("not-dividing-tp-slice", {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2}, "sharded_data_parallel_degree"),
    ("without-ddp", {**SDP2, "ddp": False}, "ddp"),
]


def main() -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    for case, config, key in CASES:
        try:
            smp.init(config)
        except smp.ConfigError as exc:
            assert exc.key == key, (case, exc.key, key)
            assert repr(key) in str(exc), (case, str(exc))
            say(f"RANK {rank} CONFIGERROR {case} {key}")
        else:
            raise AssertionError(f"config {config} was accepted")
    assert not smp.is_initialized()
    say(f"RANK {rank} ALL {len(CASES)}")


if __name__ == "__main__":
    main()
