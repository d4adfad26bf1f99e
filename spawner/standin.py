"""A minimal single-user server: just enough of the hub's protocol to check a deployment.

``python -m spawner.standin`` (as ``c.Spawner.cmd``) listens where the hub says
(``JUPYTERHUB_SERVICE_URL``) and serves, under ``JUPYTERHUB_SERVICE_PREFIX``:

- ``api`` — what the hub polls to see that the server is up;
- ``env`` — the server's environment as JSON (``CUDA_VISIBLE_DEVICES``,
  ``SLICEBROKER_*``, ...), without any variable whose name suggests a secret;
- ``broker`` — who the broker says this session is (``GET /whoami`` with the
  session's ``SLICEBROKER_URL`` and ``SLICEBROKER_TOKEN``), as a process in a
  real session (a terminal, a notebook) would call it;
- anything else — a one-line page.

It starts in a fraction of the time a Jupyter server takes and needs nothing
but tornado, which is why the end-to-end tests and ``python -m broker.bench
spawn`` use it: what they measure is the hub, the spawner and the broker, not
Jupyter's start-up. It does no authentication: never leave it on a hub that
real users reach.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from urllib.parse import urlparse

from tornado import web

SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|COOKIE", re.IGNORECASE)


def public_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` without variables whose names suggest secrets."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if not SECRET_NAME.search(k)}


class _Api(web.RequestHandler):
    def get(self) -> None:
        from jupyterhub import __version__

        self.set_header("X-JupyterHub-Version", __version__)
        self.write({"version": "standin"})


class _Env(web.RequestHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(public_env()))


class _Broker(web.RequestHandler):
    async def get(self) -> None:
        from broker.client import BrokerAPIError, BrokerClient

        self.set_header("Content-Type", "application/json")
        try:
            async with BrokerClient(retries=0) as broker:
                self.write(json.dumps(await broker.whoami()))
        except (BrokerAPIError, ValueError) as err:
            self.set_status(502)
            self.write(json.dumps({"error": str(err)}))


class _Page(web.RequestHandler):
    def get(self) -> None:
        user = os.environ.get("JUPYTERHUB_USER", "?")
        self.write(f"<p>slicebroker stand-in server of {user}</p>")


def make_app(prefix: str) -> web.Application:
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    quoted = re.escape(prefix)
    return web.Application(
        [
            (f"{quoted}api/?", _Api),
            (f"{quoted}env/?", _Env),
            (f"{quoted}broker/?", _Broker),
            (r".*", _Page),
        ]
    )


async def serve() -> None:
    url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL") or "http://127.0.0.1:8888")
    app = make_app(os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/"))
    server = app.listen(url.port or 80, url.hostname or "127.0.0.1")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.stop()


def main() -> None:
    asyncio.run(serve())


if __name__ == "__main__":
    main()
