"""gateway.edge.processes: the socket groups on this kernel, and the supervisor's rules.

The steering tests send real datagrams through the kernel's reuseport group
with the BPF program attached: a datagram reaches socket ``dcid[0] % N``
whatever its source port, which is what keeps a migrated QUIC client on the
process that holds its connection. The supervisor tests run small stand-in
children (the real gateway children: tests/integration/test_gateway_processes.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from gateway.edge.processes import (CHILD_ENV, ChildSlot, Supervisor, bind_groups, default_processes,
                               steering_program)


def _receiver(sockets: list[socket.socket]) -> int | None:
    for index, sock in enumerate(sockets):
        try:
            sock.recv(2048)
            return index
        except BlockingIOError:
            continue
    return None


def _wait_receiver(sockets: list[socket.socket]) -> int | None:
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        got = _receiver(sockets)
        if got is not None:
            return got
        time.sleep(0.001)
    return None


@pytest.mark.parametrize("count", [2, 3, 5])
def test_datagrams_reach_the_socket_their_connection_id_names_from_any_source_port(
        count: int) -> None:
    groups = bind_groups(["127.0.0.1"], 0, count)
    try:
        udp = groups.udp[0]
        for sock in udp:
            sock.setblocking(False)
        misses = []
        for first in range(0, 256, 7):
            for _ in range(3):  # a fresh source port each time: a "migrated" client
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                    client.sendto(bytes([0x41, first]) + b"\x00" * 30, ("127.0.0.1", groups.port))
                    got = _wait_receiver(udp)
                if got != first % count:
                    misses.append((first, got))
        assert not misses
    finally:
        groups.close()


def test_handshakes_are_spread_by_address_not_by_the_id_the_client_chose() -> None:
    # An Initial's connection id is the client's choice: steering by it would
    # let one client aim every handshake (or a flood) at one process.
    groups = bind_groups(["127.0.0.1"], 0, 2)
    try:
        udp = groups.udp[0]
        for sock in udp:
            sock.setblocking(False)
        reached = set()
        for _ in range(24):  # fresh source ports, all with an id "for" process 0
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
                receivers = set()
                for _ in range(3):  # one client's handshake packets stay together
                    client.sendto(bytes([0xC3, 0, 0, 0, 1, 8, 0]) + b"\x00" * 30,
                                  ("127.0.0.1", groups.port))
                    receivers.add(_wait_receiver(udp))
            assert len(receivers) == 1 and None not in receivers
            reached |= receivers
        assert reached == {0, 1}
    finally:
        groups.close()


def test_ipv6_groups_are_steered_too() -> None:
    groups = bind_groups(["::1"], 0, 2)  # this machine (and CI's) has an IPv6 loopback
    try:
        udp = groups.udp[0]
        for sock in udp:
            sock.setblocking(False)
        for first in (0, 1, 2, 3, 200, 201):
            with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as client:
                client.sendto(bytes([0x40, first]) + b"\x00" * 30, ("::1", groups.port))
                assert _wait_receiver(udp) == first % 2
    finally:
        groups.close()


def test_tcp_and_udp_groups_share_one_port_and_are_refused_to_a_plain_socket() -> None:
    groups = bind_groups(["127.0.0.1"], 0, 2)
    try:
        assert {s.getsockname()[1] for g in groups.tcp + groups.udp for s in g} == {groups.port}
        assert len(groups.tcp[0]) == len(groups.udp[0]) == 2
        # A gateway without --processes (no SO_REUSEPORT) cannot take the port.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", groups.port))
    finally:
        groups.close()


def test_the_program_is_six_instructions_ending_in_a_return() -> None:
    program = steering_program(4)
    assert len(program) == 6 and program[-1][0] == 0x16 and program[4] == (0x94, 0, 0, 4)
    with pytest.raises(ValueError):
        steering_program(0)


def test_default_is_the_cores_this_process_may_use_within_its_cgroup_quota(
        tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    assert default_processes(tmp_path / "absent") == cores
    cpu_max.write_text("max 100000\n")
    assert default_processes(cpu_max) == cores
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs: 2 processes at most
    assert default_processes(cpu_max) == min(cores, 2)
    cpu_max.write_text("50000 100000\n")
    assert default_processes(cpu_max) == 1


# --- the supervisor, with stand-in children ---------------------------------

CHILD = """
import json, os, signal, sys, time, socket
slot = json.loads(os.environ[{env!r}])
mode, log = sys.argv[1], sys.argv[2]
def note(text):
    with open(log, "a") as f:
        f.write(text + "\\n")
note(f"start {{slot['index']}} {{os.getpid()}}")
if mode == "fail":
    sys.exit(3)
for fd in slot["tcp"] + slot["udp"]:
    s = socket.socket(fileno=fd)
    assert s.getsockname()[1] == slot["port"]
    s.detach()
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
signal.signal(signal.SIGHUP, lambda *a: note(f"hup {{slot['index']}}"))
os.write(slot["ready"], b"1")
while not stop:
    time.sleep(0.02)
note(f"drained {{slot['index']}}")
"""


def _supervisor(tmp_path: Path, mode: str, count: int = 2) -> tuple[Supervisor, Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(env=CHILD_ENV))
    log = tmp_path / "log"
    log.touch()

    def command(argv: Sequence[str]) -> list[str]:
        return [sys.executable, str(script), *argv]

    groups = bind_groups(["127.0.0.1"], 0, count)
    return Supervisor([mode, str(log)], groups, count, drain_timeout_s=1.0,
                      command=command), log


def _run_until(supervisor: Supervisor, done: object, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        alive = supervisor.step(time.monotonic())
        if callable(done) and done():
            return True
        if not alive:
            return False
        time.sleep(0.02)
    raise AssertionError("supervisor did not get there in time")


def test_a_child_that_dies_is_restarted_and_the_other_keeps_running(tmp_path: Path) -> None:
    supervisor, log = _supervisor(tmp_path, "serve")
    try:
        supervisor.start_all(time.monotonic())
        _run_until(supervisor, lambda: all(c.ready for c in supervisor.children))
        first, second = supervisor.pids()
        assert first is not None and second is not None
        supervisor.children[0].process.kill()  # type: ignore[union-attr]
        _run_until(supervisor, lambda: supervisor.pids()[0] not in (None, first)
                   and supervisor.children[0].ready)
        assert supervisor.pids()[1] == second  # untouched
        supervisor.stop()
        assert _run_until(supervisor, lambda: False) is False
        lines = log.read_text().split("\n")
        assert lines.count("start 0 " + str(first)) == 1
        assert sum(line.startswith("start 0 ") for line in lines) == 2
        assert {"drained 0", "drained 1"} <= set(lines)  # SIGTERM reached both
        assert supervisor.status == 0
    finally:
        supervisor.close()


def test_a_child_that_fails_before_serving_stops_the_gateway_with_its_status(
        tmp_path: Path) -> None:
    supervisor, log = _supervisor(tmp_path, "fail")
    try:
        supervisor.start_all(time.monotonic())
        assert _run_until(supervisor, lambda: False) is False
        assert supervisor.status == 3
        assert sum(line.startswith("start") for line in log.read_text().splitlines()) >= 1
    finally:
        supervisor.close()


def test_sighup_reaches_every_child_and_stops_none(tmp_path: Path) -> None:
    # SIGHUP reloads a single gateway's certificate; under a supervisor it
    # must not end the gateway (the default action of SIGHUP kills).
    supervisor, log = _supervisor(tmp_path, "serve")
    try:
        supervisor.start_all(time.monotonic())
        _run_until(supervisor, lambda: all(c.ready for c in supervisor.children))
        pids = supervisor.pids()
        supervisor.forward(signal.SIGHUP)
        _run_until(supervisor, lambda: {"hup 0", "hup 1"} <= set(log.read_text().split("\n")))
        assert supervisor.pids() == pids and supervisor.stopping_since is None
    finally:
        supervisor.close()


def test_a_restart_that_cannot_fork_is_tried_again_later_and_kills_nobody(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor, log = _supervisor(tmp_path, "serve")
    try:
        supervisor.start_all(time.monotonic())
        _run_until(supervisor, lambda: all(c.ready for c in supervisor.children))
        second = supervisor.pids()[1]
        real_command = supervisor.command

        def no_fork(argv: Sequence[str]) -> list[str]:
            raise OSError(11, "Resource temporarily unavailable")

        supervisor.command = no_fork
        supervisor.children[0].process.kill()  # type: ignore[union-attr]
        _run_until(supervisor, lambda: supervisor.children[0].restart_at is not None
                   and supervisor.children[0].process is None)
        now = supervisor.children[0].restart_at
        assert now is not None
        assert supervisor.step(now + 0.01)  # the failed fork: still supervising
        assert supervisor.pids()[1] == second and supervisor.stopping_since is None
        retry_at = supervisor.children[0].restart_at
        assert retry_at is not None and retry_at > now
        supervisor.command = real_command
        assert supervisor.step(retry_at + 0.01)
        _run_until(supervisor, lambda: supervisor.children[0].ready)
    finally:
        supervisor.close()


def test_a_port_another_gateway_serves_is_refused_not_shared() -> None:
    import errno

    first = bind_groups(["127.0.0.1"], 0, 2)
    try:
        with pytest.raises(OSError) as refused:
            bind_groups(["127.0.0.1"], first.port, 2)
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        first.close()
    again = bind_groups(["127.0.0.1"], first.port, 2)  # free again once it is gone
    again.close()


def test_child_slot_round_trips_through_the_environment() -> None:
    slot = ChildSlot(1, 4, 8443, (5, 6), (7, 8), 9)
    assert ChildSlot.from_env({CHILD_ENV: slot.to_env()}) == slot
    assert ChildSlot.from_env({}) is None
    assert json.loads(slot.to_env())["udp"] == [7, 8]


def test_a_kernel_without_the_steering_program_refuses_several_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import gateway.edge.processes as processes

    def refuse(sock: socket.socket, count: int) -> None:
        raise OSError(errno.ENOPROTOOPT, "Protocol not available")

    monkeypatch.setattr(processes, "attach_steering", refuse)
    with pytest.raises(processes.SteeringUnavailable, match="--processes 1"):
        bind_groups(["127.0.0.1"], 0, 2)
    # One process needs no steering.
    groups = bind_groups(["127.0.0.1"], 0, 1)
    groups.close()


def test_processes_option_from_the_command_line_and_the_environment(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hedgerow.cli import build_parser, main

    assert build_parser({}).parse_args(["gateway"]).processes is None  # the cores
    assert build_parser({"HEDGEROW_GATEWAY_PROCESSES": "3"}).parse_args(
        ["gateway"]).processes == 3
    assert main(["gateway", "--processes", "0", "--insecure-internal"]) == 1
    assert "--processes must be 1 to 256" in capsys.readouterr().err


def test_the_admin_ports_of_all_processes_must_be_ports_clear_of_the_public_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hedgerow.cli import main

    # Process 3 of 4 would take 8443, the public port every process binds.
    assert main(["gateway", "--processes", "4", "--port", "8443", "--admin-port", "8440",
                 "--insecure-internal"]) == 1
    err = capsys.readouterr().err
    assert "--port 8443 is in the admin ports of --processes 4" in err
    assert "8440..8443" in err
    assert main(["gateway", "--processes", "2", "--port", "8443", "--admin-port", "65535",
                 "--insecure-internal"]) == 1
    assert "needs ports up to 65536" in capsys.readouterr().err
    assert main(["gateway", "--processes", "1", "--port", "8443", "--admin-port", "8443",
                 "--insecure-internal"]) == 1
    assert "--port 8443 is in the admin ports" in capsys.readouterr().err


def test_default_processes_fall_back_to_one_where_the_kernel_cannot_steer(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A gateway upgraded onto a kernel (or sandbox) without the reuseport
    # program keeps serving as one process unless --processes was asked for.
    import errno
    from types import SimpleNamespace

    import gateway.edge.processes as processes
    from hedgerow.cli import _supervise_gateways

    def refuse(sock: socket.socket, count: int) -> None:
        raise OSError(errno.ENOPROTOOPT, "Protocol not available")

    monkeypatch.setattr(processes, "attach_steering", refuse)
    options = SimpleNamespace(certfile="cert.pem", keyfile="key.pem", state_dir=None,
                              host="127.0.0.1", port=0)
    assert _supervise_gateways(SimpleNamespace(processes=None), options, 2) is None  # type: ignore[arg-type]
    assert _supervise_gateways(SimpleNamespace(processes=2), options, 2) == 1  # type: ignore[arg-type]
    assert "--processes 2" in capsys.readouterr().err
