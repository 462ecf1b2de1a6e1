"""Stopping Hedgerow leaves nothing behind, and an idle gateway stops at once.

Both tests run a policy with the semantic cache on (it ships off), so that the
gateway has a child of its own, its embedding sidecar.

- ``hedgerow up`` killed with SIGKILL (no chance to stop its children): every
  process it started, and theirs (the gateway's embedding sidecar), is gone
  within 2 s, and the ports are free for the next ``hedgerow up``.
- A gateway with nothing in flight exits within 2 s of SIGTERM, while idle
  HTTP/1.1 and HTTP/2 connections are open (a browser tab with the chat page)
  and its embedding sidecar is still starting (an empty ONNX cache: here it
  spends its first 10-20 s exporting the model). Before: 30 s, asyncio's TLS
  shutdown timeout waiting for the idle clients' close_notify; the sidecar's
  export itself never held the exit up (0.2-0.4 s measured without clients).
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bench.shipped_policy import SEMANTIC_ON, shipped_policy_text
from tests.support.stack import Stack, free_port, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = "gateway.cache.embed_server"  # in the embedding sidecar's command line


def _semantic_policy(root: Path) -> Path:
    policy = root / "policy.yaml"
    policy.write_text(shipped_policy_text(SEMANTIC_ON))
    return policy


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():  # /proc's own names: pids are ASCII
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has let go of everything; its parent reaps it


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
    except OSError:
        return False
    return True


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class Launched:
    popen: subprocess.Popen[bytes]
    gateway_port: int
    control_plane_port: int
    seen: set[int] = field(default_factory=set)  # its children, as last looked up


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launched]:
    gateway_port, control_plane_port = free_port(), free_port()
    log = (tmp_path / "up.log").open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "hedgerow.cli", "up", "--port", str(gateway_port),
         "--control-plane-port", str(control_plane_port), "--state-dir", str(tmp_path / "state"),
         "--policy", str(_semantic_policy(tmp_path))],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    launched = Launched(popen, gateway_port, control_plane_port)
    try:
        yield launched
    finally:
        popen.kill()
        popen.wait()
        # Only if the test failed: leave nothing running (orphans no longer
        # descend from the launcher, so the ones seen are killed by pid).
        for pid in launched.seen | _descendants(popen.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_killing_the_launcher_kills_every_process_it_started(launcher: Launched) -> None:
    popen, gateway_port, control_plane_port = (
        launcher.popen, launcher.gateway_port, launcher.control_plane_port)
    wait_for(lambda: _accepts(gateway_port) and _accepts(control_plane_port),
             "the control plane and the gateway to listen", 120)
    wait_for(lambda: {"control-plane", "worker", "gateway", SIDECAR} <= {
        word for pid in _descendants(popen.pid) for word in _command_of(pid).split()},
        "all three children and the gateway's sidecar", 30)
    started = launcher.seen = _descendants(popen.pid)
    assert len(started) >= 4, [_command_of(p) for p in started]

    popen.send_signal(signal.SIGKILL)
    popen.wait(5)
    killed = time.monotonic()
    wait_for(lambda: not any(_alive(pid) for pid in started),
             "the launcher's children to die with it", 2)
    assert time.monotonic() - killed < 2
    assert not _accepts(gateway_port) and not _accepts(control_plane_port)
    # The ports are free again: the next `hedgerow up` can bind them.
    for port in (gateway_port, control_plane_port):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))


@pytest.fixture
def idle_gateway(tmp_path: Path) -> Iterator[Stack]:
    # Not waiting for readiness: the sidecar is still loading the model when the signal comes.
    stack = Stack(tmp_path)
    try:
        stack.start_control_plane(policy=_semantic_policy(tmp_path))
        stack.start_gateway(wait_ready=False)
        yield stack
    finally:
        stack.stop_all()


def test_an_idle_gateway_exits_within_two_seconds_of_sigterm(idle_gateway: Stack) -> None:
    stack = idle_gateway
    gateway = next(p for p in stack.procs if p.name == "gateway")
    # The gateway starts its sidecar once the control plane's first policy
    # (semantic cache on) has reached it: wait for the process, not its model.
    sidecars = wait_for(lambda: {pid for pid in _descendants(gateway.popen.pid)
                                 if SIDECAR in _command_of(pid)},
                        "the gateway's embedding sidecar to start", 10)
    assert sidecars, "the gateway's embedding sidecar is running"
    tls = ssl.create_default_context(cafile=stack.ca_cert)
    with httpx.Client(base_url=stack.gateway_url, verify=tls) as h1, \
            httpx.Client(base_url=stack.gateway_url, verify=tls, http2=True) as h2:
        # Idle connections, as a browser keeps them: open, their last answer read.
        assert h1.get("/healthz").http_version == "HTTP/1.1"
        assert h2.get("/healthz").http_version == "HTTP/2"
        gateway.popen.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = gateway.popen.wait(30)
        took = time.monotonic() - signalled
    assert code == 0, gateway.log()[-2000:]
    assert took < 2.0, f"an idle gateway took {took:.1f}s to exit"
    wait_for(lambda: not any(_alive(pid) for pid in sidecars), "the sidecar to exit", 2)
