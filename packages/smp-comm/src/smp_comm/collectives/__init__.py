"""Collectives for the ``smp`` torch.distributed backend (:mod:`smp_comm.torch_backend`).

- :mod:`~smp_comm.collectives.shm`: a shared-memory segment per group on a host and the step
  clock that orders it (torch-free);
- :mod:`~smp_comm.collectives.local`: all-gather, reduce-scatter, all-reduce, broadcast and
  barrier among the ranks of one host (torch);
- :mod:`~smp_comm.collectives.hierarchy`: the same across hosts: within each host through its
  segment, between hosts through one leader per host (torch).

Nothing here is imported by ``import smp_comm``: the package stays usable without torch.
"""
