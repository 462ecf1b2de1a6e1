"""Real processes on this machine: control plane, workers, gateway.

Used by end-to-end tests and by benchmark scenarios alike. Everything runs as
the production CLI would run it (``python -m hedgerow.cli ...``) on free
loopback ports, with logs kept in a working directory so a failure can be
read afterwards — internal trust included: the control plane makes its CA,
the stack mints join tokens through the admin API with the admin credential,
and every worker and gateway joins with one (mutual TLS everywhere).
``Stack(insecure=True)`` runs with ``--insecure-internal`` instead.
"""

from __future__ import annotations

import os
import random
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

from hedgerow.trust.pem import KEY_MODE, write_atomically

START_TIMEOUT_S = 60.0


# Ports are drawn below the kernel's ephemeral range (32768-60999 on Linux):
# a port the kernel hands out for bind(0) is free only until some outgoing
# connection takes it as its source port, and the child that is meant to
# listen on it binds seconds later. Below that range only a listener can
# take it, and each port is handed out once per process.
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()
_draw = random.Random()


def _bindable(port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", port))
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                udp.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (the gateway needs both),
    outside the ephemeral range so no outgoing connection takes it before the
    process meant to listen on it binds."""
    for _ in range(500):
        port = _draw.randrange(*_PORT_RANGE)
        if port in _handed_out or not _bindable(port):
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no port free on both TCP and UDP")


def free_port_run(count: int) -> int:
    """A TCP port with the ``count - 1`` after it free too: the admin ports of
    ``hedgerow gateway --processes count`` (process i at the first + i)."""
    for _ in range(50):
        first = free_port()
        if any(port in _handed_out for port in range(first + 1, first + count)):
            continue
        probes: list[socket.socket] = []
        try:
            for port in range(first + 1, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            _handed_out.update(range(first + 1, first + count))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports")


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
    join_port: int = 0
    insecure: bool = False  # --insecure-internal everywhere (plain HTTP)
    _tokens: dict[str, Path] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return "http" if self.insecure else "https"

    @property
    def control_plane_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.control_plane_port}"

    @property
    def join_url(self) -> str:
        return f"https://127.0.0.1:{self.join_port}"

    @property
    def control_plane_state(self) -> Path:
        return self.root / "control-plane"

    @property
    def cluster_ca(self) -> Path:
        """The cluster CA's certificate (in the admin credential: there whether the
        control plane made its CA or was given one)."""
        return self.admin_identity / "ca.pem"

    @property
    def admin_identity(self) -> Path:
        """The admin credential the control plane wrote (key, cert, CA)."""
        return self.control_plane_state / "admin"

    def admin_tls(self, *, check_hostname: bool = True) -> ssl.SSLContext | bool:
        """httpx's ``verify`` for an admin's calls (a worker's URL: no hostname check)."""
        if self.insecure:
            return True
        context = ssl.create_default_context(cafile=self.cluster_ca)
        context.check_hostname = check_hostname
        creds = self.admin_identity
        context.load_cert_chain(creds / "cert.pem", creds / "key.pem")
        return context

    def admin(self, base_url: str | None = None, **kwargs: Any) -> httpx.Client:
        """An httpx client to the control plane (or ``base_url``) as the admin."""
        return httpx.Client(base_url=base_url or self.control_plane_url,
                            verify=self.admin_tls(), **kwargs)

    def admin_env(self) -> dict[str, str]:
        """Environment for `hedgerow policy|status|token ...` run as the admin."""
        return dict(os.environ, HEDGEROW_ADMIN_IDENTITY=str(self.admin_identity),
                    HEDGEROW_CONTROL_PLANE=self.control_plane_url)

    def join_args(self, role: str) -> list[str]:
        """Flags that make a new worker or gateway join this stack's control plane."""
        if self.insecure:
            return ["--insecure-internal"]
        token = self._tokens.get(role)
        if token is None:
            with self.admin() as admin:
                reply = admin.post("/v1/tokens", json={"role": role, "ttl_s": 86400})
            reply.raise_for_status()
            token = self.root / f"{role}.token"
            write_atomically(token, reply.json()["token"].encode(), mode=KEY_MODE)
            self._tokens[role] = token
        return ["--join-url", self.join_url, "--join-token-file", str(token),
                "--ca-file", str(self.cluster_ca)]

    def control_plane_args(self, join_port: int) -> list[str]:
        if self.insecure:
            return ["--insecure-internal"]
        return ["--state-dir", str(self.control_plane_state), "--join-port", str(join_port)]

    @property
    def gateway_url(self) -> str:
        return f"https://127.0.0.1:{self.gateway_port}"

    @property
    def ca_cert(self) -> Path:
        return self.root / "state" / "tls" / "ca.pem"

    def spawn(self, name: str, *args: str) -> Proc:
        # A second process of the same name (two gateways) gets a log of its own.
        same = sum(1 for proc in self.procs if proc.name == name)
        log_path = self.root / (f"{name}.log" if not same else f"{name}-{same + 1}.log")
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
        redis_url: str | None = None, cert_ttl_s: float | None = None,
    ) -> Proc:
        """Start the control plane the workers and gateways started later use.
        ``cert_ttl_s``: the life of the certificates it issues (renewed at 2/3)."""
        self.join_port = free_port()
        proc, url = self.start_control_plane_replica(
            "control-plane", lease_s=lease_s, policy=policy, policy_dir=policy_dir,
            redis_url=redis_url, join_port=self.join_port, cert_ttl_s=cert_ttl_s)
        self.control_plane_port = int(url.rsplit(":", 1)[1])
        return proc

    def start_control_plane_replica(
        self, name: str, lease_s: float = 2.0, policy: Path | None = None,
        policy_dir: Path | None = None, redis_url: str | None = None,
        join_port: int | None = None, port: int | None = None,
        cert_ttl_s: float | None = None,
    ) -> tuple[Proc, str]:
        """Start one more control plane (e.g. a replica on the same Redis, sharing
        this stack's CA); its URL."""
        port = port or free_port()
        extra = [*(["--policy", str(policy)] if policy else []),
                 *(["--policy-dir", str(policy_dir)] if policy_dir else []),
                 *(["--redis", redis_url] if redis_url else []),
                 *self.control_plane_args(join_port or free_port()),
                 *(["--cert-ttl-s", str(cert_ttl_s)] if cert_ttl_s else [])]
        proc = self.spawn(name, "control-plane", "--port", str(port),
                          "--lease-s", str(lease_s), *extra)
        url = f"{self.scheme}://127.0.0.1:{port}"
        self.wait_control_plane(proc, url, name)
        return proc, url

    def wait_control_plane(self, proc: Proc, url: str, name: str = "control plane") -> None:
        def healthy() -> bool:
            if not self.insecure and not (self.admin_identity / "cert.pem").exists():
                return False
            with self.admin(url, timeout=2.0) as admin:
                return admin.get("/healthz").status_code == 200

        wait_for(lambda: _exited(proc) or healthy(), name)
        if _exited(proc):
            raise RuntimeError(f"{name} exited:\n{proc.log()}")

    def start_worker(self, worker_id: str, *extra: str) -> Proc:
        proc = self.spawn(worker_id, "worker", "--control-plane", self.control_plane_url,
                          "--worker-id", worker_id, "--state-dir", str(self.root / "state"),
                          *self.join_args("worker"), *extra)
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
        if "--processes" not in extra:  # one process unless a caller asks for more
            extra = (*extra, "--processes", "1")
        proc = self.spawn("gateway", "gateway", "--port", str(self.gateway_port),
                          "--control-plane", self.control_plane_url,
                          "--state-dir", str(self.root / "state"),
                          *self.join_args("gateway"), *extra)
        probe = "/readyz" if wait_ready else "/healthz"
        wait_for(lambda: self.ca_cert.exists() and httpx.get(
            self.gateway_url + probe, verify=ssl.create_default_context(cafile=self.ca_cert)).status_code == 200,
            f"gateway {probe}")
        return proc

    @property
    def gateway_admin_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.gateway_admin_port}"

    def gateway_metrics(self, gateway_url: str | None = None) -> str:
        """A gateway's Prometheus text (the last one started, or the one serving
        ``gateway_url``), from its admin listener: the public port has none."""
        # The gateway's certificate names its identity, not a host: no hostname check.
        return scrape_metrics(self.gateway_admins[gateway_url or self.gateway_url],
                              verify=self.admin_tls(check_hostname=False))

    def control_plane_metrics(self) -> str:
        """The control plane's Prometheus text (with its admin routes: no --admin-port here)."""
        return scrape_metrics(self.control_plane_url, verify=self.admin_tls())

    def workers(self) -> list[dict[str, Any]]:
        with self.admin() as admin:
            snapshot = admin.get("/v1/workers").json()
        return list(snapshot["workers"])

    def worker(self, worker_id: str) -> dict[str, Any] | None:
        for record in self.workers():
            if record["registration"]["worker_id"] == worker_id:
                return record
        return None

    def worker_status(self, worker_id: str) -> dict[str, Any]:
        record = self.worker(worker_id)
        assert record is not None, f"{worker_id} is not registered"
        # A worker is known by its certificate's identity, not a hostname.
        verify = self.admin_tls(check_hostname=False)
        return dict(httpx.get(record["registration"]["url"] + "/status", verify=verify).json())

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=10)


def scrape_metrics(base_url: str, token: str | None = None, *,
                   verify: ssl.SSLContext | bool = True) -> str:
    """GET ``base_url``/metrics as Prometheus would (``verify``: its TLS client
    context: the admin listeners are mutual TLS); the token defaults to the one
    the processes were started with ($HEDGEROW_METRICS_TOKEN or $HEDGEROW_ADMIN_TOKEN)."""
    token = token or os.environ.get("HEDGEROW_METRICS_TOKEN") or os.environ.get(
        "HEDGEROW_ADMIN_TOKEN")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10,
                         verify=verify)
    response.raise_for_status()
    return response.text


def _exited(proc: Proc) -> bool:
    return proc.popen.poll() is not None
