"""The broker as an HTTP service: ``slicebroker serve`` / ``python -m broker.service``.

- :mod:`~broker.service.app` — :class:`~broker.service.app.BrokerApp`, its options, ``main``;
- :mod:`~broker.service.runner` — database work off the event loop, the scheduling loop,
  long-poll waiters;
- :mod:`~broker.service.auth` — tokens and identities (standalone and JupyterHub);
- :mod:`~broker.service.apihandlers` — one module per resource;
- :mod:`~broker.service.schema` / :mod:`~broker.service.openapi` — the schemas and the
  OpenAPI document (``python -m broker.service.openapi --markdown`` writes docs/api.md);
- :mod:`~broker.service.metrics` — Prometheus metrics.
"""
