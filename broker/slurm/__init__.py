"""The cluster as Slurm shows it, and slices run as Slurm jobs (design.md §6, §7, §9).

- :mod:`broker.slurm.inventory`: Slurm nodes (``sinfo --json``) -> broker
  :class:`~broker.core.model.Node` values (a pure mapping), the poller that keeps
  the broker's nodes current, and :class:`~broker.slurm.inventory.SlurmInventory`,
  the service's backend (entry point ``slurm``);
- :mod:`broker.slurm.drain`: the broker's drains written into Slurm;
- :mod:`broker.slurm.jobs`: the executor: a slice's job (its comment names the
  slice) signalled at a preemption, cancelled at its end or off its grant, and a
  job that ends in Slurm ending its slice;
- :mod:`broker.slurm.srun`: ``slicebroker run --slurm``, a batch slice's command
  as a job step pinned to the grant;
- :mod:`broker.slurm.commands`: Slurm's commands, run with a timeout.

Needs Slurm's client commands on the broker's machine; see docs/slurm.md.
"""
