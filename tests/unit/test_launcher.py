from __future__ import annotations

import socket
import sys
from pathlib import Path

from hedgerow.launcher import Stack, banner, busy_ports
from tests.support.stack import free_port


def stack_on(port: int, cp_port: int) -> Stack:
    return Stack(python=sys.executable, host="127.0.0.1", gateway_port=port,
                 control_plane_port=cp_port, state_dir=Path("state"), join_port=free_port())



def test_busy_ports_names_what_is_taken() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        taken = int(udp.getsockname()[1])
        busy = busy_ports(stack_on(taken, free_port()))
    assert len(busy) == 1 and "UDP" in busy[0] and str(taken) in busy[0]


def test_free_ports_are_not_reported() -> None:
    assert busy_ports(stack_on(free_port(), free_port())) == []


def test_children_and_banner() -> None:
    stack = stack_on(8443, 8500)
    commands = stack.commands()
    assert set(commands) == {"control-plane", "worker", "gateway"}
    # A restarted worker must come back under the same id.
    assert commands["worker"][commands["worker"].index("--worker-id") + 1] == "cpu-local-1"
    text = banner(stack, Path("/x/ca.pem"))
    assert "https://127.0.0.1:8443" in text and "--cacert /x/ca.pem" in text
    # Internal trust needs no flag: the worker and gateway join with the tokens
    # `up` mints, trusting the CA the control plane made in its state directory.
    for role in ("worker", "gateway"):
        command = commands[role]
        assert command[command.index("--join-token-file") + 1] == f"state/tokens/{role}.token"
        assert command[command.index("--ca-file") + 1] == "state/control-plane/ca/ca.pem"
        assert "--insecure-internal" not in command
    assert commands["control-plane"][commands["control-plane"].index("--state-dir") + 1] \
        == "state/control-plane"
    assert "admin credential: state/control-plane/admin" in text
    # Its state is in-process (no Redis): one gateway process, one cache.
    gateway = commands["gateway"]
    assert gateway[gateway.index("--processes") + 1] == "1"


def test_local_gateway_serves_ipv6_loopback_too() -> None:
    """Browsers try ::1 first for localhost: `hedgerow up` binds it as well."""
    stack = stack_on(8443, 8500)
    gateway = stack.commands()["gateway"]
    hosts = [gateway[i + 1] for i, arg in enumerate(gateway) if arg == "--host"]
    assert hosts == ["127.0.0.1", "::1"]
    assert "https://localhost:8443/" in banner(stack, Path("/x/ca.pem"))
    # ...and a port taken on ::1 only is reported before anything starts.
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as tcp6:
        tcp6.bind(("::1", 0))
        taken = int(tcp6.getsockname()[1])
        busy = busy_ports(stack_on(taken, free_port()))
    assert len(busy) == 1 and "::1" in busy[0] and "TCP" in busy[0]
    # An explicit other address is taken as given.
    other = Stack(python=sys.executable, host="10.1.2.3", gateway_port=8443,
                  control_plane_port=8500, state_dir=Path("state")).commands()["gateway"]
    assert [other[i + 1] for i, arg in enumerate(other) if arg == "--host"] == ["10.1.2.3"]
