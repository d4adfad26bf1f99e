"""``python -m broker.bench spawn``: what the broker adds to starting a notebook server.

Runs two real JupyterHubs side by side (the repository's ``jupyterhub_config.py``,
with configurable-http-proxy and the broker as a hub-managed service), each in
a temporary directory:

1. with the slice-broker spawner (``SimpleSliceBrokerSpawner``): a spawn asks
   the broker for one GPU of an idle demo cluster (8 GPUs, so one is always
   free), then launches;
2. with JupyterHub's plain ``SimpleLocalProcessSpawner``, everything else alike.

Repetitions alternate between the two hubs, so both see the same background
load. Each times ``POST /hub/api/users/<name>/server`` from the request
to the answer, which the hub sends once the server is up and routed (the
hub's ``slow_spawn_timeout`` is raised so that it waits), then stops the
server (not timed). The single-user server is :mod:`spawner.standin`, which
starts in a few tens of milliseconds, so that Jupyter's own start-up (seconds)
does not drown what is measured. The first spawn of each hub is a warm-up.
The goal: the broker adds at most 150 ms at the median.

On a small machine the two hubs' processes (each with its proxy, the broker,
single-user servers) make the end-to-end difference noisy, so the report also
gives what the spawner itself logs for each spawn: the time spent on the
broker (checking the options, requesting the slice, waiting for the grant on
an idle cluster) — the broker's exact share of the critical path.

Needs configurable-http-proxy on the PATH and a checkout (for ``jupyterhub_config.py``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HUB_CONFIG = Path(__file__).resolve().parents[2] / "jupyterhub_config.py"
GOAL_MS = 150.0
_BROKER_TIME = re.compile(r"granted to \S+: broker time ([\d.]+) ms")
USER = "alice"
OPTIONS = {"project": "vision", "gpus": 1, "protected": "15m"}

_BENCH_CONFIG = """\
import json, os, sys
c = get_config()
load_subconfig(os.environ["BENCH_HUB_CONFIG"])
bench = json.loads(os.environ["BENCH_SETTINGS"])
c.JupyterHub.bind_url = bench["bind_url"]
c.JupyterHub.hub_bind_url = bench["hub_bind_url"]
c.ConfigurableHTTPProxy.api_url = bench["proxy_api_url"]
c.JupyterHub.tornado_settings["slow_spawn_timeout"] = 60
c.Spawner.cmd = [sys.executable, "-m", "spawner.standin"]
c.Spawner.args = []
c.JupyterHub.services = [s for s in c.JupyterHub.services if s["name"] != "slicebroker-culler"]
c.JupyterHub.load_roles = [r for r in c.JupyterHub.load_roles if r["name"] != "slicebroker-culler"]
c.JupyterHub.services.append({"name": "bench", "api_token": bench["token"]})
c.JupyterHub.load_roles.append(
    {"name": "bench", "scopes": ["admin:users", "admin:servers"], "services": ["bench"]}
)
if bench["plain"]:
    c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Hub:
    def __init__(self, workdir: Path, plain: bool):
        self.workdir = workdir
        self.token = secrets.token_hex(24)
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/hub/api"
        self.settings = {
            "bind_url": f"http://127.0.0.1:{port}",
            "hub_bind_url": f"http://127.0.0.1:{_free_port()}",
            "proxy_api_url": f"http://127.0.0.1:{_free_port()}",
            "token": self.token,
            "plain": plain,
        }
        self.proc: subprocess.Popen | None = None

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                text = response.read()
                return response.status, json.loads(text) if text else None
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode("utf-8", "replace")

    def start(self) -> None:
        config = self.workdir / "bench_config.py"
        config.write_text(_BENCH_CONFIG)
        env = {
            **os.environ,
            "BENCH_HUB_CONFIG": str(HUB_CONFIG),
            "BENCH_SETTINGS": json.dumps(self.settings),
            "SLICEBROKER_PORT": str(_free_port()),
        }
        for key in ("SLICEBROKER_CONFIG", "SLICEBROKER_DB_URL"):
            env.pop(key, None)
        self.log = open(self.workdir / "hub.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["jupyterhub", "-f", str(config)],
            cwd=self.workdir,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyterhub exited; see {self.workdir / 'hub.log'}")
            try:
                if self.request("GET", "/")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("jupyterhub did not answer within 120 s")
            time.sleep(0.1)

    def spawn_seconds(self) -> float:
        started = time.perf_counter()
        status, body = self.request("POST", f"/users/{USER}/server", {"user_options": OPTIONS})
        seconds = time.perf_counter() - started
        if status != 201:
            raise RuntimeError(f"spawn answered {status} (not ready in time?): {body}")
        return seconds

    def stop_server(self) -> None:
        status, _ = self.request("DELETE", f"/users/{USER}/server")
        deadline = time.monotonic() + 60
        while status == 202 or self._running():
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not stop within 60 s")
            time.sleep(0.05)
            status = 0

    def _running(self) -> bool:
        status, user = self.request("GET", f"/users/{USER}")
        return status == 200 and bool(user.get("servers"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _summary(samples: list[float]) -> dict[str, Any]:
    ms = sorted(1000 * s for s in samples)
    p90 = ms[min(len(ms) - 1, max(0, round(0.9 * len(ms)) - 1))]
    return {
        "median_ms": round(statistics.median(ms), 1),
        "p90_ms": round(p90, 1),
        "min_ms": round(ms[0], 1),
        "max_ms": round(ms[-1], 1),
        "samples_ms": [round(x, 1) for x in ms],
    }


def _broker_times(log: Path) -> list[float]:
    """What each spawn spent on the broker (seconds), as the spawner logs it."""
    return [float(m) / 1000 for m in _BROKER_TIME.findall(log.read_text())]


def measure(repeat: int) -> tuple[list[float], list[float], list[float]]:
    """Spawn times (seconds) with the broker and without, alternating between the two hubs
    (both running all along, so that both see the same background load)."""
    with tempfile.TemporaryDirectory(prefix="slicebroker-bench-") as workdir:
        hubs = {
            "broker": _Hub(Path(workdir) / "broker", plain=False),
            "plain": _Hub(Path(workdir) / "plain", plain=True),
        }
        samples: dict[str, list[float]] = {"broker": [], "plain": []}
        try:
            for hub in hubs.values():
                hub.workdir.mkdir()
                hub.start()
                hub.request("POST", "/users", {"usernames": [USER]})
                hub.spawn_seconds()  # warm-up: first imports, first token checks
                hub.stop_server()
            for i in range(repeat):
                order = ("broker", "plain") if i % 2 == 0 else ("plain", "broker")
                for name in order:
                    samples[name].append(hubs[name].spawn_seconds())
                    hubs[name].stop_server()
        finally:
            for hub in hubs.values():
                hub.stop()
        inside = _broker_times(hubs["broker"].workdir / "hub.log")[1:]  # less the warm-up
        return samples["broker"], samples["plain"], inside


def run(repeat: int = 20) -> dict[str, Any]:
    """Spawn ``repeat`` times with the broker and without; the figures, as JSON-able data."""
    if not HUB_CONFIG.exists():
        raise SystemExit(f"{HUB_CONFIG.name} not found: run the benchmark from a checkout")
    with_broker, without, inside = measure(repeat)
    broker, plain = _summary(with_broker), _summary(without)
    overhead = broker["median_ms"] - plain["median_ms"]
    return {
        "benchmark": "spawn request to server ready, one free GPU",
        "repetitions": repeat,
        "single_user_server": "spawner.standin",
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "with_broker": broker,
        "plain_local_process_spawner": plain,
        "broker_time_in_spawn": _summary(inside) if inside else None,
        "broker_overhead_median_ms": round(overhead, 1),
        "broker_overhead_p90_ms": round(broker["p90_ms"] - plain["p90_ms"], 1),
        "goal_ms": GOAL_MS,
        "meets_goal": overhead <= GOAL_MS
        and (not inside or _summary(inside)["median_ms"] <= GOAL_MS),
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m broker.bench.spawn", description=__doc__)
    parser.add_argument("--repeat", type=int, default=20, help="spawns timed per hub")
    args = parser.parse_args(argv)
    json.dump(run(repeat=args.repeat), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
