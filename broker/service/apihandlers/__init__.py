"""The API's handlers, one module per resource; each exports ``default_handlers``,
a list of ``(path, handler class)`` with paths relative to ``{base_url}api/v1``
written as OpenAPI path templates (``/slices/{id}``)."""

from __future__ import annotations

from . import metrics, nodes, projects, root, slices

default_handlers = [
    *root.default_handlers,
    *slices.default_handlers,
    *projects.default_handlers,
    *nodes.default_handlers,
    *metrics.default_handlers,
]
