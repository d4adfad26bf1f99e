"""The pure scheduling core: a pass from a snapshot to decisions.

Nothing here reads a database, the network or a clock: the service
(``broker.store``), the simulator (``broker.sim``) and the benchmarks build a
:class:`~broker.core.model.Snapshot`, call :func:`broker.core.scheduler.schedule`
and apply the :class:`~broker.core.model.Decisions` with
:mod:`broker.core.transitions` (docs/design.md §5).
"""
