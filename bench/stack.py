"""Real processes on this machine: control plane, workers, gateway.

Used by end-to-end tests and by benchmark scenarios alike. Everything runs as
the production CLI would run it (``python -m hedgerow.cli ...``) on free
loopback ports, with logs kept in a working directory so a failure can be
read afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT_S = 60.0


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (the gateway needs both)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on both TCP and UDP")


def wait_for(predicate: Any, what: str, timeout: float = START_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except (httpx.HTTPError, OSError) as error:
            last_error = error
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last_error})")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return int(self.popen.returncode)


@dataclass
class Stack:
    root: Path
    control_plane_port: int = 0
    gateway_port: int = 0
    # The last gateway's admin listener, where its /metrics is (``gateway_metrics``).
    gateway_admin_port: int = 0
    # Every gateway's admin URL by its public URL (``gateway_metrics(url)``).
    gateway_admins: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    @property
    def control_plane_url(self) -> str:
        return f"http://127.0.0.1:{self.control_plane_port}"

    @property
    def gateway_url(self) -> str:
        return f"https://127.0.0.1:{self.gateway_port}"

    @property
    def ca_cert(self) -> Path:
        return self.root / "state" / "tls" / "ca.pem"

    def spawn(self, name: str, *args: str) -> Proc:
        log_path = self.root / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        popen = subprocess.Popen(
            [sys.executable, "-m", "hedgerow.cli", *args],
            stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env,
        )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def start_control_plane(
        self, lease_s: float = 2.0, policy: Path | None = None, policy_dir: Path | None = None,
        redis_url: str | None = None,
    ) -> Proc:
        """Start the control plane the workers and gateways started later use."""
        proc, url = self.start_control_plane_replica(
            "control-plane", lease_s=lease_s, policy=policy, policy_dir=policy_dir,
            redis_url=redis_url)
        self.control_plane_port = int(url.rsplit(":", 1)[1])
        return proc

    def start_control_plane_replica(
        self, name: str, lease_s: float = 2.0, policy: Path | None = None,
        policy_dir: Path | None = None, redis_url: str | None = None,
    ) -> tuple[Proc, str]:
        """Start one more control plane (e.g. a replica on the same Redis); its URL."""
        port = free_port()
        extra = [*(["--policy", str(policy)] if policy else []),
                 *(["--policy-dir", str(policy_dir)] if policy_dir else []),
                 *(["--redis", redis_url] if redis_url else [])]
        proc = self.spawn(name, "control-plane", "--port", str(port),
                          "--lease-s", str(lease_s), *extra)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/healthz").status_code == 200 or _exited(proc),
                 name)
        if _exited(proc):
            raise RuntimeError(f"{name} exited:\n{proc.log()}")
        return proc, url

    def start_worker(self, worker_id: str, *extra: str) -> Proc:
        proc = self.spawn(worker_id, "worker", "--control-plane", self.control_plane_url,
                          "--worker-id", worker_id, *extra)
        wait_for(lambda: self.worker(worker_id) is not None or _exited(proc),
                 f"worker {worker_id} to register")
        if proc.popen.poll() is not None:
            raise RuntimeError(f"worker {worker_id} exited:\n{proc.log()}")
        return proc

    def start_gateway(self, *extra: str, wait_ready: bool = True) -> Proc:
        """Start a gateway; wait for /readyz (a worker known) or just /healthz.
        It gets an admin listener (for /metrics) unless ``extra`` names one."""
        self.gateway_port = free_port()
        if "--admin-port" in extra:
            self.gateway_admin_port = int(extra[extra.index("--admin-port") + 1])
        else:
            self.gateway_admin_port = free_port()
            extra = (*extra, "--admin-port", str(self.gateway_admin_port))
        self.gateway_admins[self.gateway_url] = self.gateway_admin_url
        proc = self.spawn("gateway", "gateway", "--port", str(self.gateway_port),
                          "--control-plane", self.control_plane_url,
                          "--state-dir", str(self.root / "state"), *extra)
        probe = "/readyz" if wait_ready else "/healthz"
        wait_for(lambda: self.ca_cert.exists() and httpx.get(
            self.gateway_url + probe, verify=ssl.create_default_context(cafile=self.ca_cert)).status_code == 200,
            f"gateway {probe}")
        return proc

    @property
    def gateway_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_admin_port}"

    def gateway_metrics(self, gateway_url: str | None = None) -> str:
        """A gateway's Prometheus text (the last one started, or the one serving
        ``gateway_url``), from its admin listener: the public port has none."""
        return scrape_metrics(self.gateway_admins[gateway_url or self.gateway_url])

    def control_plane_metrics(self) -> str:
        """The control plane's Prometheus text (with its admin routes: no --admin-port here)."""
        return scrape_metrics(self.control_plane_url)

    def workers(self) -> list[dict[str, Any]]:
        snapshot = httpx.get(self.control_plane_url + "/v1/workers").json()
        return list(snapshot["workers"])

    def worker(self, worker_id: str) -> dict[str, Any] | None:
        for record in self.workers():
            if record["registration"]["worker_id"] == worker_id:
                return record
        return None

    def worker_status(self, worker_id: str) -> dict[str, Any]:
        record = self.worker(worker_id)
        assert record is not None, f"{worker_id} is not registered"
        return dict(httpx.get(record["registration"]["url"] + "/status").json())

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=10)


def scrape_metrics(base_url: str, token: str | None = None) -> str:
    """GET ``base_url``/metrics as Prometheus would; the token defaults to the one
    the processes were started with ($HEDGEROW_METRICS_TOKEN or $HEDGEROW_ADMIN_TOKEN)."""
    token = token or os.environ.get("HEDGEROW_METRICS_TOKEN") or os.environ.get(
        "HEDGEROW_ADMIN_TOKEN")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    return response.text


def _exited(proc: Proc) -> bool:
    return proc.popen.poll() is not None
