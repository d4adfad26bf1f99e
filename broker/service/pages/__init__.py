"""Web pages for researchers and admins, served by the broker beside its API.

My GPUs, Queue, Projects, Cluster and Usage, under the service's base URL
(``/services/slicebroker/`` as a hub service). Rendered on the server with Jinja
templates (autoescaped), refreshed by a little vendored JavaScript; nothing is
fetched from anywhere else. See docs/web.md.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import jinja2

from ...units import count
from .handlers import page_routes

HERE = Path(__file__).resolve().parent
STATIC_PATH = str(HERE / "static")
TEMPLATE_PATH = str(HERE / "templates")

__all__ = ["STATIC_PATH", "TEMPLATE_PATH", "page_routes", "page_settings"]


def page_settings(base_url: str, hub_oauth: Any = None) -> dict[str, Any]:
    """The tornado settings the pages need under ``base_url``.

    ``hub_oauth`` (a :class:`jupyterhub.services.auth.HubOAuth`) logs people in
    through the hub; without it the pages take a broker token in a form. The
    cookie secret is new at every start: a restart logs everyone out (in hub
    mode the next page view logs them in again without a question).
    """
    templates = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_PATH), autoescape=True)
    templates.filters["count"] = count
    return {
        "pages_base": base_url,
        "pages_templates": templates,
        "hub_oauth": hub_oauth,
        "cookie_secret": secrets.token_bytes(32),
        "xsrf_cookie_kwargs": {"path": base_url, "httponly": False, "samesite": "Strict"},
        "static_path": STATIC_PATH,
        "static_url_prefix": f"{base_url}static/",
    }
