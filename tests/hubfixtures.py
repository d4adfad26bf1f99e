"""A real JupyterHub for end-to-end tests: the repository's ``jupyterhub_config.py`` with
configurable-http-proxy, the broker service, and real single-user processes.

:class:`HubProcess` writes a small config file that loads the repository's
config (``load_subconfig``) and then changes only what a test must: free
ports, a cluster file with short contracts, the single-user command
(:mod:`spawner.standin`, a real HTTP server that starts in a fraction of a
second and serves ``/env``), quick heartbeats, and an admin service token for
the test itself. Everything runs as real processes; tests talk to them over
HTTP only, and wait by polling or long-polling, never by sleeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import requests

REPO = Path(__file__).resolve().parent.parent
HUB_CONFIG = REPO / "jupyterhub_config.py"
PASSWORD = "e2e-password"
T = TypeVar("T")

#: A small cluster with short contracts: one node of 2 GPUs.
TEST_CLUSTER = """
admins = ["admin"]

[policy]
window = "7d"
max_min_runtime = "1h"
grace_period = "2s"
debug_max_gpus = 2
debug_max_min_runtime = "15m"
debug_lane_fraction = 1.0
# Requests preempt at once: the wait before a preemption has tests of its own.
batch_preemption_delay = "0s"
interactive_preemption_delay = "0s"

[defaults.interactive]
min_runtime = "15m"
resumable = false

[defaults.batch]
min_runtime = "2s"
resumable = true

[gpu_types]
h100 = 1.0

[[nodes]]
name = "test-0"
gpu_type = "h100"
gpus = 2

[projects.root]

[projects.vision]
parent = "root"
users = ["alice", "bob"]

[projects.nlp]
parent = "root"
users = ["carol"]

[projects.systems]
parent = "root"
users = ["dave", "erin", "frank"]
"""

_TEST_CONFIG = """\
import json, os, sys
c = get_config()
load_subconfig(os.environ["E2E_HUB_CONFIG"])
e2e = json.loads(os.environ["E2E_SETTINGS"])
c.JupyterHub.bind_url = e2e["bind_url"]
c.JupyterHub.hub_bind_url = e2e["hub_bind_url"]
c.ConfigurableHTTPProxy.api_url = e2e["proxy_api_url"]
c.JupyterHub.log_level = "DEBUG"
c.JupyterHub.tornado_settings["slow_spawn_timeout"] = 0.5
c.Spawner.cmd = [sys.executable, "-m", "spawner.standin"]
c.Spawner.poll_interval = 2
c.LocalProcessSpawner.interrupt_timeout = 5
c.LocalProcessSpawner.term_timeout = 5
c.SliceBrokerMixin.heartbeat_interval = 1.0
c.SliceBrokerMixin.queue_refresh_interval = 0.3
c.SliceBrokerMixin.protected_choices = ["2s", "15m", "0"]
c.SliceBrokerMixin.protected_default = "15m"
services = []
for service in c.JupyterHub.services:
    if service["name"] == "slicebroker":
        service["command"] = service["command"] + e2e["broker_args"]
    services.append(service)
services.append({"name": "e2e", "api_token": e2e["token"]})
c.JupyterHub.services = services
c.JupyterHub.load_roles.append(
    {
        "name": "e2e",
        "scopes": [
            "admin:users",
            "admin:servers",
            "admin:server_state",
            "access:servers",
            "read:metrics",
            "read:roles",
            "read:services",
            "custom:slicebroker:admin",
            "access:services!service=slicebroker",
        ],
        "services": ["e2e"],
    }
)
c.JupyterHub.load_groups = {"demo-users": {"users": ["alice"]}}
"""


def session_environ(server: dict) -> dict[str, str]:
    """A local single-user process's environment, as its kernels' and terminals' children
    get it (read from ``/proc``, so nothing is asked of the session itself)."""
    raw = Path(f"/proc/{server['state']['pid']}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


#: Its own source of chance: choosing a port leaves the tests' seeded ones alone.
_PORT_CHOICE = random.SystemRandom()


def free_port() -> int:
    """A port of 127.0.0.1 free now, for a server a test starts (and may restart on
    it): chosen below the kernel's range of ports for outgoing connections, so that
    no client connection takes it as its own while the server is down."""
    lowest_outgoing = _lowest_outgoing_port()
    for _ in range(50):
        port = _PORT_CHOICE.randrange(10_000, max(10_001, lowest_outgoing))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: try another
            return port
    with socket.socket() as sock:  # no luck below the range: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lowest_outgoing_port() -> int:
    """The first of the kernel's local ports for outgoing connections (Linux's default
    where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_until(check: Callable[[], T], timeout: float = 30.0, what: str = "a condition") -> T:
    """Poll ``check`` until it returns something truthy; that value. Fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    interval = 0.02
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)  # a poll interval, not a synchronisation
        interval = min(interval * 1.5, 0.25)


def proxy_available() -> str | None:
    """Why the hub cannot run here (no configurable-http-proxy), or ``None``."""
    if shutil.which("configurable-http-proxy") is None:
        return "configurable-http-proxy is not installed (npm install -g configurable-http-proxy)"
    return None


class HubProcess:
    """``jupyterhub`` in ``workdir`` with the repository's config and test overrides."""

    def __init__(
        self,
        workdir: Path,
        *,
        cluster: str = TEST_CLUSTER,
        broker_args: list[str] | None = None,
        extra_config: str = "",
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(24)
        self.public_port = free_port()
        self.broker_port = free_port()
        self.settings = {
            "bind_url": f"http://127.0.0.1:{self.public_port}",
            "hub_bind_url": f"http://127.0.0.1:{free_port()}",
            "proxy_api_url": f"http://127.0.0.1:{free_port()}",
            "token": self.token,
            "broker_args": broker_args or ["--pass-interval=1", "--lease=15", "--max-wait=5"],
        }
        (self.workdir / "cluster.toml").write_text(cluster)
        (self.workdir / "e2e_config.py").write_text(_TEST_CONFIG + extra_config)
        self.url = self.settings["bind_url"]
        self.broker_url = f"http://127.0.0.1:{self.broker_port}/services/slicebroker/api/v1"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "hub.log"
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {self.token}"
        self.pids: set[int] = set()

    # ---- life cycle ------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> HubProcess:
        env = {
            **os.environ,
            "E2E_HUB_CONFIG": str(HUB_CONFIG),
            "E2E_SETTINGS": json.dumps(self.settings),
            "SLICEBROKER_CONFIG": str(self.workdir / "cluster.toml"),
            "SLICEBROKER_PORT": str(self.broker_port),
            "SLICEBROKER_DEMO_PASSWORD": PASSWORD,
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("SLICEBROKER_DB_URL", None)
        log = open(self.log_path, "a")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            ["jupyterhub", "-f", str(self.workdir / "e2e_config.py")],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_until(self._ready, timeout, f"the hub to answer (log: {self.log_path})")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(
                f"jupyterhub exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
        try:
            hub = self.http.get(f"{self.url}/hub/api/", timeout=2)
            broker = self.http.get(f"{self.broker_url}/projects", timeout=2)
        except requests.RequestException:
            return False
        return hub.status_code == 200 and broker.status_code == 200

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the hub and wait (servers are left running: cleanup_servers is off)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.remember_pids()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def shutdown(self) -> None:
        """Stop every server, the hub, and any single-user process left behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.remember_pids()
            for user in self.users():
                for name in user.get("servers") or {}:
                    self.stop_server(user["name"], name, wait=False)
            self.stop()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def remember_pids(self) -> None:
        try:
            for user in self.users():
                for server in (user.get("servers") or {}).values():
                    pid = (server.get("state") or {}).get("pid")
                    if pid:
                        self.pids.add(pid)
        except requests.RequestException:
            pass

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text()

    # ---- the hub's API ------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", 30)
        return self.http.request(method, f"{self.url}/hub/api{path}", **kwargs)

    def users(self) -> list[dict[str, Any]]:
        response = self.api("GET", "/users")
        response.raise_for_status()
        return response.json()

    def user(self, name: str) -> dict[str, Any]:
        response = self.api("GET", f"/users/{name}")
        response.raise_for_status()
        return response.json()

    def server(self, name: str, server_name: str = "") -> dict[str, Any] | None:
        return (self.user(name).get("servers") or {}).get(server_name)

    def start_server(self, name: str, **options: Any) -> requests.Response:
        self.api("POST", "/users", json={"usernames": [name]})
        return self.api("POST", f"/users/{name}/server", json={"user_options": options})

    def stop_server(self, name: str, server_name: str = "", *, wait: bool = True) -> None:
        path = f"/users/{name}/server" + (f"s/{server_name}" if server_name else "")
        response = self.api("DELETE", path)
        assert response.status_code in (202, 204, 404), response.text
        if wait:
            wait_until(
                lambda: self.server(name, server_name) is None, 30, f"{name}'s server to stop"
            )

    def wait_ready(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            server = self.server(name)
            return server if server and server.get("ready") else None

        return wait_until(ready, timeout, f"{name}'s server to be ready")

    def progress_events(self, name: str, until: Callable[[dict], bool], timeout: float = 30.0):
        """Read the server's progress stream (SSE) up to the first event ``until`` accepts;
        every event read, in order."""
        events = []
        with self.api(
            "GET", f"/users/{name}/server/progress", stream=True, timeout=timeout
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:") :])
                events.append(event)
                if until(event) or event.get("ready") or event.get("failed"):
                    break
        return events

    def user_get(self, name: str, path: str) -> requests.Response:
        """GET a path of a user's server through the proxy, as the admin service."""
        return self.http.get(f"{self.url}/user/{name}/{path.lstrip('/')}", timeout=10)

    # ---- the broker's API -----------------------------------------------------------------

    def broker(self, method: str, path: str, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", 30)
        response = self.http.request(method, f"{self.broker_url}{path}", **kwargs)
        assert response.status_code < 400, (
            f"{method} {path}: {response.status_code} {response.text}"
        )
        return response.json()

    def slices(self, **filters: str) -> list[dict[str, Any]]:
        return self.broker("GET", "/slices", params=filters)["slices"]

    def slice_of(self, user: str, state: str = "live") -> dict[str, Any] | None:
        found = self.slices(user=user, state=state)
        return found[-1] if found else None

    def wait_slice(self, slice_id: int, known_state: str, timeout: float = 30.0) -> dict[str, Any]:
        """Long-poll the broker until the slice leaves ``known_state``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            slice_ = self.broker(
                "GET", f"/slices/{slice_id}", params={"wait": max(left, 0.0), "state": known_state}
            )
            if slice_["state"] != known_state:
                return slice_
            if left <= 0:
                raise AssertionError(f"slice {slice_id} stayed {known_state} for {timeout:g} s")

    # ---- a browser-like session ------------------------------------------------------------------

    def login(self, name: str) -> requests.Session:
        """A cookie session of ``name`` through the hub's login form."""
        session = requests.Session()
        page = session.get(f"{self.url}/hub/login", timeout=10)
        xsrf = session.cookies.get("_xsrf") or _form_xsrf(page.text)
        response = session.post(
            f"{self.url}/hub/login",
            data={"username": name, "password": PASSWORD, "_xsrf": xsrf},
            timeout=10,
            allow_redirects=False,
        )
        assert response.status_code in (302, 303), f"login of {name} failed: {response.status_code}"
        return session


def _form_xsrf(html: str) -> str:
    match = re.search(r'name="_xsrf"\s+value="([^"]+)"', html)
    return match.group(1) if match else ""


def hub_processes(workdir: Path, **kwargs: Any) -> Iterator[HubProcess]:
    """A started :class:`HubProcess`, shut down (with its servers) afterwards."""
    hub = HubProcess(workdir, **kwargs)
    try:
        yield hub.start()
    finally:
        hub.shutdown()


if __name__ == "__main__":  # pragma: no cover - manual use: a hub to click through
    hub = HubProcess(Path(sys.argv[1] if len(sys.argv) > 1 else "e2e-hub"))
    hub.start()
    print(f"hub at {hub.url} (password {PASSWORD!r}); Ctrl-C stops it")
    try:
        hub.proc.wait()
    except KeyboardInterrupt:
        hub.shutdown()
