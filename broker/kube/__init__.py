"""The cluster as Kubernetes shows it (design.md §6, §9): GPU inventory and drain reports.

- :mod:`broker.kube.inventory`: node objects -> broker :class:`~broker.core.model.Node`
  values (a pure mapping), and :class:`~broker.kube.inventory.InventoryWatcher`,
  which lists and watches the nodes and pushes the inventory to a sink
  (:meth:`broker.store.Broker.sync_inventory`).
- :mod:`broker.kube.drain`: :class:`~broker.kube.drain.DrainReporter`, which
  marks a Kubernetes node once the broker has drained it, for repair automation.
- :mod:`broker.kube.reaper`: :class:`~broker.kube.reaper.PodReaper`, which deletes
  notebook pods whose slice is over.

Needs the ``kubernetes`` extra (``kubernetes-asyncio``).
"""
