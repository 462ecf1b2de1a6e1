"""``hedgerow up``: control plane, CPU worker and gateway as supervised processes.

Separate processes, as in production, and as secure: the control plane makes
its cluster CA and an admin credential in ``STATE/control-plane``; the launcher
then mints one join token each for the worker and the gateway through the
admin API (bound to their names, kept in ``STATE/tokens`` with mode 0600), and
they join with them. No flag and no extra command: internal mutual TLS is the
default on one machine as on many. A child that dies is restarted with
exponential backoff; Ctrl-C or SIGTERM stops them all (SIGTERM first, so the
worker drains and deregisters, then SIGKILL after a grace period). If the
launcher itself is killed, the kernel kills its children too (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ssl

import anyio
import httpx

from hedgerow.trust.pem import KEY_MODE, write_atomically

log = logging.getLogger("hedgerow.up")

READY_TIMEOUT_S = 300.0
TOKEN_TTL_S = 3600.0  # a child restarted later holds its certificate and needs no token
STOP_GRACE_S = 40.0  # > the gateway's default drain (30 s) + hypercorn's margin
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 10.0
STABLE_AFTER_S = 30.0


@dataclass(frozen=True)
class Stack:
    python: str
    host: str
    gateway_port: int
    control_plane_port: int
    state_dir: Path
    slots: int = 1
    model_path: Path | None = None
    policy: Path | None = None
    policy_dir: Path | None = None
    # The control plane's admin API on a port of its own (on loopback: `up`
    # gives it no token); None: on control_plane_port with the rest.
    admin_port: int | None = None
    join_port: int = 8501
    worker_id: str = "cpu-local-1"
    gateway_id: str = "gw-local"

    @property
    def control_plane_url(self) -> str:
        return f"https://{_bracket(self.host)}:{self.control_plane_port}"

    @property
    def join_url(self) -> str:
        return f"https://{_bracket(self.host)}:{self.join_port}"

    @property
    def control_plane_state(self) -> Path:
        return self.state_dir / "control-plane"

    @property
    def admin_identity(self) -> Path:
        return self.control_plane_state / "admin"

    @property
    def cluster_ca(self) -> Path:
        return self.control_plane_state / "ca" / "ca.pem"

    def token_file(self, role: str) -> Path:
        return self.state_dir / "tokens" / f"{role}.token"

    @property
    def admin_url(self) -> str:
        if self.admin_port is None:
            return self.control_plane_url
        return f"https://127.0.0.1:{self.admin_port}"

    @property
    def gateway_url(self) -> str:
        return f"https://{self.host}:{self.gateway_port}"

    @property
    def gateway_hosts(self) -> tuple[str, ...]:
        """The default 127.0.0.1 also brings ::1: browsers try it first for localhost."""
        if self.host == "127.0.0.1":
            from gateway.edge.transport import local_hosts

            return local_hosts()
        return (self.host,)

    def commands(self) -> dict[str, list[str]]:
        base = [self.python, "-m", "hedgerow.cli"]
        # A stable id: a restarted worker replaces its old registry entry at
        # once instead of leaving it to expire.
        worker = base + ["worker", "--control-plane", self.control_plane_url,
                         "--worker-id", self.worker_id,
                         "--slots", str(self.slots), "--host", self.host,
                         "--state-dir", str(self.state_dir), *self._join_args("worker")]
        if self.model_path:
            worker += ["--model-path", str(self.model_path)]
        gateway = base + ["gateway", *(a for h in self.gateway_hosts for a in ("--host", h)),
                          "--port", str(self.gateway_port),
                          "--control-plane", self.control_plane_url,
                          "--gateway-id", self.gateway_id,
                          # In-process state (no Redis): one process, so one cache and
                          # one set of limits.
                          "--processes", "1",
                          "--state-dir", str(self.state_dir), *self._join_args("gateway")]
        control_plane = base + ["control-plane", "--host", self.host,
                                "--port", str(self.control_plane_port),
                                "--join-port", str(self.join_port),
                                "--state-dir", str(self.control_plane_state)]
        # The policy lives in the control plane; the gateway follows its versions.
        if self.policy:
            control_plane += ["--policy", str(self.policy)]
        if self.policy_dir:
            control_plane += ["--policy-dir", str(self.policy_dir)]
        if self.admin_port is not None:
            control_plane += ["--admin-port", str(self.admin_port)]
        return {
            "control-plane": control_plane,
            "worker": worker,
            "gateway": gateway,
        }

    def _join_args(self, role: str) -> list[str]:
        return ["--join-url", self.join_url, "--join-token-file", str(self.token_file(role)),
                "--ca-file", str(self.cluster_ca)]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def bootstrap_trust(stack: Stack) -> None:
    """Once the control plane is up: a join token each for the worker and the
    gateway, bound to their names, minted through the admin API (as an operator
    would with `hedgerow token create`) and left where they read them."""
    from hedgerow.trust.credentials import Credentials, TlsContexts

    admin = Credentials(stack.admin_identity)
    with anyio.fail_after(READY_TIMEOUT_S):
        while not admin.exists():
            await anyio.sleep(0.1)
        verify = TlsContexts(admin).client()
        async with httpx.AsyncClient(base_url=stack.admin_url, verify=verify,
                                     timeout=5.0) as client:
            while True:
                try:
                    if (await client.get("/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.1)
            for role, name in (("worker", stack.worker_id), ("gateway", stack.gateway_id)):
                reply = await client.post("/v1/tokens", json={
                    "role": role, "name": name, "ttl_s": TOKEN_TTL_S,
                    "description": "hedgerow up"})
                reply.raise_for_status()
                path = stack.token_file(role)
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                write_atomically(path, reply.json()["token"].encode(), mode=KEY_MODE)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die (SIGKILL) when the launcher does.

    A child in its own session outlives a launcher that is killed (SIGKILL,
    OOM): it would hold its ports, and the next ``hedgerow up`` fail. The
    kernel's parent-death signal (Linux) ends it with the launcher however the
    launcher ends; it is delivered when the *thread* that forked the child
    exits, so children are forked from the event loop's thread, never a worker
    thread. libc is loaded here, before the fork. None where prctl is missing.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec() -> None:  # in the forked child, before exec: kept to two system calls
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class ChildProcess:
    """One supervised child: restarted with backoff whenever it exits."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.command = command
        self.process: asyncio.subprocess.Process | None = None
        self.stopping = False

    async def supervise(self) -> None:
        delay = BACKOFF_INITIAL_S
        while not self.stopping:
            started = anyio.current_time()
            self.process = await self._spawn()
            code = await self.process.wait()
            if self.stopping:
                return
            if anyio.current_time() - started > STABLE_AFTER_S:
                delay = BACKOFF_INITIAL_S
            log.error("%s exited with status %s; restarting in %.1fs", self.name, code, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _spawn(self) -> asyncio.subprocess.Process:
        # Own session: a Ctrl-C in the terminal reaches only us, and we stop the
        # children in order (worker drains before the control plane goes); and
        # they die with us if we are killed. asyncio's own subprocess API, as
        # anyio's open_process takes no preexec_fn (``up`` runs on asyncio).
        return await asyncio.create_subprocess_exec(
            *self.command, stdout=None, stderr=None, start_new_session=True,
            preexec_fn=die_with_launcher())

    async def stop(self) -> None:
        self.stopping = True
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(STOP_GRACE_S):
            await process.wait()
            return
        log.warning("%s did not stop in %.0fs; killing it", self.name, STOP_GRACE_S)
        process.kill()
        await process.wait()


async def wait_until_ready(url: str, ca_cert: Path) -> None:
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca_cert), timeout=2.0) as client:
        with anyio.fail_after(READY_TIMEOUT_S):
            while True:
                try:
                    if (await client.get(url + "/readyz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.25)


def banner(stack: Stack, ca_cert: Path) -> str:
    url = stack.gateway_url
    localhost = (f"   (or https://localhost:{stack.gateway_port}/)"
                 if "::1" in stack.gateway_hosts else "")
    body = ('{"model": "smollm2-135m-instruct", "stream": true, '
            '"messages": [{"role": "user", "content": "Say hello in five words."}]}')
    return f"""
Hedgerow is up: {url}   (HTTP/1.1, HTTP/2 and HTTP/3 on this port)
  chat page:        {url}/{localhost}
  control plane:    {stack.control_plane_url}{_admin_line(stack)}
  dev certificate:  {ca_cert}   (trust it, or pass it as --cacert)

Stream a chat with curl:
  curl -N --http2 --cacert {ca_cert} {url}/v1/chat/completions \\
    -H 'content-type: application/json' \\
    -d '{body}'

With the OpenAI Python SDK (key sk-demo is the default policy's demo tenant):
  import ssl
  from openai import OpenAI, DefaultHttpxClient
  tls = ssl.create_default_context(cafile="{ca_cert}")
  client = OpenAI(base_url="{url}/v1", api_key="sk-demo", http_client=DefaultHttpxClient(verify=tls))
  for chunk in client.chat.completions.create(model="smollm2-135m-instruct", stream=True,
          messages=[{{"role": "user", "content": "Say hello in five words."}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True)

Press Ctrl-C to stop.
"""


def _admin_line(stack: Stack) -> str:
    identity = f"\n  admin credential: {stack.admin_identity}   (mutual TLS; `hedgerow status` " \
               "and `hedgerow policy` find it there)"
    if stack.admin_port is None:
        return identity
    return identity + (f"\n  admin API:        {stack.admin_url}   (for `hedgerow policy` and "
                       f"`hedgerow status`: export HEDGEROW_ADMIN_URL={stack.admin_url})")


def busy_ports(stack: Stack) -> list[str]:
    """Ports the stack needs that something else already holds."""
    wanted = [(host, stack.gateway_port, kind, what) for host in stack.gateway_hosts
              for kind, what in ((socket.SOCK_STREAM, "gateway TCP"),
                                 (socket.SOCK_DGRAM, "gateway UDP (HTTP/3)"))]
    wanted.append((stack.host, stack.control_plane_port, socket.SOCK_STREAM, "control plane"))
    wanted.append((stack.host, stack.join_port, socket.SOCK_STREAM, "control plane join"))
    if stack.admin_port is not None:
        wanted.append(("127.0.0.1", stack.admin_port, socket.SOCK_STREAM, "control plane admin"))
    busy: list[str] = []
    for host, port, kind, what in wanted:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, kind) as probe:
            if family == socket.AF_INET6:  # as the gateway binds it
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if kind == socket.SOCK_STREAM:  # as the servers do: TIME_WAIT is no conflict
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as error:
                busy.append(f"{what} port {port} on {host}: {error.strerror}")
    return busy


def run_stack(stack: Stack) -> int:
    from gateway.edge.devcert import ensure_dev_certificate

    busy = busy_ports(stack)
    if busy:
        print("hedgerow up: cannot start, " + "; ".join(busy) +
              ".\nStop what holds it, or choose others with --port / --control-plane-port / --admin-port.",
              file=sys.stderr)
        return 2
    ca_cert = ensure_dev_certificate(stack.state_dir).ca_cert.resolve()

    async def main() -> None:
        children = [ChildProcess(name, cmd) for name, cmd in stack.commands().items()]
        async with anyio.create_task_group() as tg:
            tg.start_soon(children[0].supervise)  # the control plane, which makes the CA
            try:
                await bootstrap_trust(stack)
                for child in children[1:]:
                    tg.start_soon(child.supervise)
                await wait_until_ready(stack.gateway_url, ca_cert)
                print(banner(stack, ca_cert), flush=True)
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
            finally:
                with anyio.CancelScope(shield=True):
                    print("\nstopping Hedgerow…", file=sys.stderr, flush=True)
                    for child in reversed(children):
                        await child.stop()
                tg.cancel_scope.cancel()

    anyio.run(main)
    return 0


__all__ = ["Stack", "run_stack"]
