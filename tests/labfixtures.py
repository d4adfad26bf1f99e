"""A Jupyter server with a session's environment, reading a real broker: what the Lab
extension's server side and the Lab tests start."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import requests
from hubfixtures import wait_until
from servicefixtures import BrokerService, free_port

from slicebroker_lab import CULL_ENV, session_env


class JupyterServer:
    """``jupyter server`` with the session's environment, on a free port."""

    def __init__(self, workdir: Path, env: dict[str, str], args: tuple[str, ...] = ()):
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jupyter_server",
                    f"--port={self.port}",
                    "--ip=127.0.0.1",
                    f"--IdentityProvider.token={self.token}",
                    f"--ServerApp.root_dir={workdir}",
                    "--no-browser",
                    "--allow-root",
                    *args,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        wait_until(self._up, 60, f"the Jupyter server (log: {self.log_path})")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"jupyter server exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            return requests.get(f"{self.url}/api/status", timeout=2, params=self._auth).ok
        except requests.RequestException:
            return False

    @property
    def _auth(self) -> dict[str, str]:
        return {"token": self.token}

    def activity(self, **kwargs: object) -> requests.Response:
        method = "POST" if "json" in kwargs else "GET"
        headers = {"Authorization": f"token {self.token}"}
        url = f"{self.url}/slicebroker/activity"
        return requests.request(method, url, headers=headers, timeout=30, **kwargs)

    def session(self, token: str | None = None) -> requests.Response:
        params = {} if token == "" else {"token": token or self.token}
        return requests.get(f"{self.url}/slicebroker/session", params=params, timeout=30)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def session_environment(broker: BrokerService, token: str, slice_id: int | None) -> dict:
    """The variables the spawner gives a session, with the test's broker."""
    env = {k: v for k, v in broker.env.items() if not k.startswith(("JUPYTER", "SLICEBROKER"))}
    env.update(session_env(env))
    env.update({"SLICEBROKER_URL": broker.url, "SLICEBROKER_TOKEN": token})
    env.update({CULL_ENV["idle"]: "3600", CULL_ENV["busy"]: "900", CULL_ENV["protected"]: "0"})
    if slice_id is not None:
        env["SLICEBROKER_SLICE_ID"] = str(slice_id)
        env["SLICEBROKER_GPU_TYPE"] = "h100"  # the granted type, as the spawner names it
    return env
