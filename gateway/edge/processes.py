"""``hedgerow gateway --processes N``: N gateway processes on one port, TCP and UDP.

The parent (``supervise``) binds every listening socket itself, N of each
kind per host, all with SO_REUSEPORT and in a fixed order, then starts N
children -- the same ``hedgerow gateway`` command line, told by
``HEDGEROW_GATEWAY_CHILD`` which sockets are theirs -- and hands socket ``i``
of each group to child ``i``. It serves no request and holds no gateway
state; it keeps every socket open, so a child's socket outlives the child:

- TCP: the kernel spreads new connections over the group by their 4-tuple.
  While a crashed child restarts, the connections hashed to its socket wait
  in that socket's accept queue (they are not refused).
- UDP: a classic BPF program on each group (``SO_ATTACH_REUSEPORT_CBPF``)
  picks socket ``first byte of the destination connection id % N``, and each
  child issues connection ids whose first byte is its index mod N
  (``hedgerow.http_stack.quic_cid``). So a QUIC connection's datagrams reach
  the process that holds it, also after the client's address or port
  changed. A client's first Initials carry an id it chose at random; they
  land on some child, and that child's ids steer everything after. Since the
  group's order is the order of binding, and no socket of the group is ever
  closed while the parent lives, index ``i`` stays socket ``i``. Where the
  program cannot be attached the parent refuses to start (N > 1 with
  HTTP/3), rather than serve QUIC that breaks on migration.

The parent restarts a child that exits (with a backoff while one keeps
crashing), forwards SIGTERM/SIGINT to the children so they drain as one
gateway does, and exits when they all have. A child that fails before it
ever served ends the whole gateway with its exit status (a bad flag or
certificate is the same in every child). Each child gets
``PR_SET_PDEATHSIG``: it does not outlive a parent that was killed.

Processes share nothing in memory: what must be shared (tenants' limits,
the response cache, budgets) goes through Redis, as between gateways. They
do share one embedding sidecar, the parent's, started when a child asks for
it (``gateway.cache.shared_embedder``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.edge.sockets import open_listening_socket

if TYPE_CHECKING:
    from gateway.cache.shared_embedder import SharedSidecar

log = logging.getLogger("hedgerow.gateway.processes")

CHILD_ENV = "HEDGEROW_GATEWAY_CHILD"
ACCEPT_BACKLOG = 1024
PORT_PICK_ATTEMPTS = 32
# A child that crashes again within this of its start waits longer each time.
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
STABLE_AFTER_S = 30.0
# After the drain deadline, children still running are killed.
KILL_GRACE_S = 10.0
POLL_S = 0.1
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")

SO_ATTACH_REUSEPORT_CBPF = 51
PR_SET_PDEATHSIG = 1

# Classic BPF opcodes (linux/filter.h).
_LDB_ABS = 0x30   # BPF_LD | BPF_B | BPF_ABS: A = packet[k]
_JSET = 0x45      # BPF_JMP | BPF_JSET | BPF_K: if A & k then jt else jf
_MOD = 0x94       # BPF_ALU | BPF_MOD | BPF_K: A %= k
_RET_A = 0x16     # BPF_RET | BPF_A
_RET_K = 0x06     # BPF_RET | BPF_K
BY_HASH = 0xFFFFFFFF  # no such socket: the kernel selects by hash instead
# Offsets into the UDP payload: the destination connection id's first byte.
SHORT_HEADER_DCID = 1   # flags, then the id


def steering_program(count: int) -> list[tuple[int, int, int, int]]:
    """Short header: ``return dcid[0] % count`` as classic BPF (a reuseport
    group index). Long header (a handshake: Initial, 0-RTT, Handshake): an
    index past the group, which makes the kernel pick by its keyed hash of the
    addresses, as without a program -- an Initial's id is the client's choice,
    so steering by it would let a client aim its handshakes (or a flood) at one
    process. The process that takes the Initial then issues ids that steer
    every short-header packet after it to itself, wherever the client moves."""
    if not 1 <= count <= 256:
        raise ValueError("1 to 256 processes")
    return [
        (_LDB_ABS, 0, 0, 0),                   # 0: A = flags
        (_JSET, 0, 1, 0x80),                   # 1: long header? -> 2, else -> 3
        (_RET_K, 0, 0, BY_HASH),               # 2
        (_LDB_ABS, 0, 0, SHORT_HEADER_DCID),   # 3
        (_MOD, 0, 0, count),                   # 4
        (_RET_A, 0, 0, 0),                     # 5
    ]


def attach_steering(sock: socket.socket, count: int) -> None:
    """Attach ``steering_program(count)`` to ``sock``'s reuseport group. Raises OSError."""
    program = steering_program(count)
    code = b"".join(struct.pack("HBBI", *insn) for insn in program)
    buffer = ctypes.create_string_buffer(code)
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }
    fprog = struct.pack("HL", len(program), ctypes.addressof(buffer))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


@dataclass
class Groups:
    """The parent's sockets: ``tcp[h][i]``, ``udp[h][i]`` for host h, child i."""

    port: int
    tcp: list[list[socket.socket]] = field(default_factory=list)
    udp: list[list[socket.socket]] = field(default_factory=list)

    def for_child(self, index: int) -> tuple[list[socket.socket], list[socket.socket]]:
        return [g[index] for g in self.tcp], [g[index] for g in self.udp]

    def close(self) -> None:
        for group in self.tcp + self.udp:
            for sock in group:
                sock.close()


def bind_groups(hosts: Sequence[str], port: int, count: int, *, quic: bool = True,
                backlog: int = ACCEPT_BACKLOG) -> Groups:
    """N reuseport sockets per host on TCP (listening) and, with ``quic``, on UDP
    (steered); port 0 picks one free on both, a bounded number of tries."""
    for _ in range(PORT_PICK_ATTEMPTS if port == 0 else 1):
        try:
            return _bind_groups(hosts, port, count, quic, backlog)
        except OSError as error:
            if port != 0 or error.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, "no port free on TCP and UDP")


def _bind_groups(hosts: Sequence[str], port: int, count: int, quic: bool,
                 backlog: int) -> Groups:
    groups = Groups(port)
    try:
        for host in hosts:
            tcp: list[socket.socket] = []
            groups.tcp.append(tcp)
            if groups.port:
                _refuse_if_taken(host, groups.port, socket.SOCK_STREAM)
            for _ in range(count):
                tcp.append(open_listening_socket(host, groups.port, socket.SOCK_STREAM, backlog,
                                                 reuseport=True))
                groups.port = tcp[0].getsockname()[1]
        for host in hosts if quic else ():
            udp: list[socket.socket] = []
            groups.udp.append(udp)
            _refuse_if_taken(host, groups.port, socket.SOCK_DGRAM)
            for _ in range(count):
                udp.append(open_listening_socket(host, groups.port, socket.SOCK_DGRAM, backlog,
                                                 reuseport=True))
            if count > 1:
                try:
                    attach_steering(udp[0], count)
                except OSError as error:
                    raise SteeringUnavailable(
                        f"cannot steer QUIC datagrams to the process owning their connection "
                        f"on this kernel (SO_ATTACH_REUSEPORT_CBPF: {error.strerror}); run "
                        f"--processes 1, or one gateway per port") from error
    except BaseException:
        groups.close()
        raise
    return groups


class SteeringUnavailable(RuntimeError):
    """The kernel refused the reuseport BPF program."""


def _refuse_if_taken(host: str, port: int, kind: socket.SocketKind) -> None:
    """EADDRINUSE when anything holds the port, even another reuseport group
    (another gateway, or a dead supervisor's children still draining): the
    group's sockets alone would join it, share its connections and replace its
    steering program. Binding without SO_REUSEPORT finds out."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as probe:
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if kind == socket.SOCK_STREAM:  # a TIME_WAIT left by a stopped gateway is no owner
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))



# --- the child's side ------------------------------------------------------


@dataclass(frozen=True)
class ChildSlot:
    """What the parent tells child ``index`` of ``count``: its sockets' descriptors."""

    index: int
    count: int
    port: int
    tcp_fds: tuple[int, ...]
    udp_fds: tuple[int, ...]
    ready_fd: int
    # The supervisor's shared embedding sidecar: its socket, and the pipe on which
    # a child asks for it to be started (``gateway.cache.shared_embedder``).
    embed_socket: str | None = None
    embed_want_fd: int | None = None

    def to_env(self) -> str:
        return json.dumps({"index": self.index, "count": self.count, "port": self.port,
                           "tcp": list(self.tcp_fds), "udp": list(self.udp_fds),
                           "ready": self.ready_fd, "embed_socket": self.embed_socket,
                           "embed_want": self.embed_want_fd})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ChildSlot | None:
        raw = (os.environ if environ is None else environ).get(CHILD_ENV)
        if not raw:
            return None
        data = json.loads(raw)
        want = data.get("embed_want")
        return cls(int(data["index"]), int(data["count"]), int(data["port"]),
                   tuple(int(fd) for fd in data["tcp"]), tuple(int(fd) for fd in data["udp"]),
                   int(data["ready"]), data.get("embed_socket"),
                   None if want is None else int(want))

    def want_embedder(self) -> None:
        """Ask the supervisor to start the shared embedding sidecar (once is enough)."""
        if self.embed_want_fd is None:
            return
        try:
            os.set_blocking(self.embed_want_fd, False)
            os.write(self.embed_want_fd, b"1")
        except OSError:
            pass  # full: the supervisor has been asked already; closed: it is going away

    def sockets(self) -> tuple[tuple[socket.socket, ...], tuple[socket.socket, ...]]:
        """The inherited sockets, non-blocking, for ``gateway.edge.transport.Listeners``."""
        tcp = tuple(socket.socket(fileno=fd) for fd in self.tcp_fds)
        udp = tuple(socket.socket(fileno=fd) for fd in self.udp_fds)
        for sock in tcp + udp:
            sock.setblocking(False)
        return tcp, udp

    def announce_ready(self) -> None:
        try:
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)
        except OSError:
            pass


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        raise SystemExit("hedgerow gateway: the supervising process is gone")


# --- the parent's side -----------------------------------------------------


@dataclass
class _Child:
    index: int
    process: subprocess.Popen[bytes] | None = None
    ready_read: int | None = None
    started_at: float = 0.0
    ready: bool = False
    ever_ready: bool = False
    crashes: int = 0
    restart_at: float | None = None


def child_command(argv: Sequence[str]) -> list[str]:
    """The same ``hedgerow`` command line, run by this Python."""
    return [sys.executable, "-c", "import sys; from hedgerow.cli import main; sys.exit(main())",
            *argv]


class Supervisor:
    """Starts, watches and restarts the children; see the module docstring."""

    def __init__(self, argv: Sequence[str], groups: Groups, count: int, *,
                 drain_timeout_s: float,
                 command: Callable[[Sequence[str]], list[str]] = child_command,
                 sidecar: SharedSidecar | None = None) -> None:
        self.argv = list(argv)
        self.sidecar = sidecar
        self.command = command
        self.groups = groups
        self.count = count
        self.drain_timeout_s = drain_timeout_s
        self.children = [_Child(i) for i in range(count)]
        self.stopping_since: float | None = None
        self.status = 0

    def start(self, child: _Child, now: float) -> None:
        tcp, udp = self.groups.for_child(child.index)
        read, write = os.pipe()
        sidecar = self.sidecar
        slot = ChildSlot(child.index, self.count, self.groups.port,
                         tuple(s.fileno() for s in tcp), tuple(s.fileno() for s in udp), write,
                         str(sidecar.socket_path) if sidecar else None,
                         sidecar.want_write if sidecar else None)
        env = dict(os.environ, **{CHILD_ENV: slot.to_env()})
        fds = (*slot.tcp_fds, *slot.udp_fds, write, *([sidecar.want_write] if sidecar else []))
        try:
            child.process = subprocess.Popen(self.command(self.argv), env=env, pass_fds=fds)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        os.set_blocking(read, False)
        child.ready_read, child.ready = read, False
        child.started_at, child.restart_at = now, None
        log.info("gateway process %d of %d started (pid %d)", child.index, self.count,
                 child.process.pid)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            log.info("%s: draining %d gateway process(es)", signal.Signals(signum).name,
                     sum(1 for c in self.children if c.process is not None))
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    def forward(self, signum: int) -> None:
        """SIGHUP: each process reloads its certificate, as a single gateway does."""
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signum)

    def step(self, now: float) -> bool:
        """One look at every child; False once all are gone after ``stop``."""
        if self.sidecar is not None and self.stopping_since is None:
            self.sidecar.poll()
        for child in self.children:
            self._check_ready(child)
            process = child.process
            if process is None:
                if (self.stopping_since is None and child.restart_at is not None
                        and now >= child.restart_at):
                    try:
                        self.start(child, now)
                    except OSError as error:  # no fork, pipe or memory now: later
                        child.restart_at = now + RESTART_BACKOFF_S[-1]
                        log.error("gateway process %d could not be restarted (%s); "
                                  "trying again in %.0f s", child.index, error,
                                  RESTART_BACKOFF_S[-1])
                continue
            code = process.poll()
            if code is None:
                continue
            child.process = None
            self._close_ready(child)
            if self.stopping_since is not None:
                continue
            if not child.ever_ready:
                log.error("gateway process %d exited (%s) before it served; stopping",
                          child.index, _describe(code))
                self.status = code if code > 0 else 1
                self.stop()
                continue
            child.crashes = child.crashes + 1 if now - child.started_at < STABLE_AFTER_S else 1
            delay = RESTART_BACKOFF_S[min(child.crashes, len(RESTART_BACKOFF_S)) - 1]
            child.restart_at = now + delay
            log.warning("gateway process %d exited (%s); restarting in %.1f s", child.index,
                        _describe(code), delay)
        if self.stopping_since is not None:
            alive = [c for c in self.children if c.process is not None]
            if now - self.stopping_since > self.drain_timeout_s + KILL_GRACE_S:
                for child in alive:
                    assert child.process is not None
                    log.warning("gateway process %d still running after the drain; killed",
                                child.index)
                    child.process.kill()
            return bool(alive)
        return True

    def _check_ready(self, child: _Child) -> None:
        if child.ready_read is None or child.ready:
            return
        try:
            got = os.read(child.ready_read, 1)
        except BlockingIOError:
            return
        if got:
            child.ready = child.ever_ready = True
            if all(c.ready for c in self.children):
                log.info("gateway: %d processes serving port %d", self.count, self.groups.port)

    def _close_ready(self, child: _Child) -> None:
        if child.ready_read is not None:
            os.close(child.ready_read)
            child.ready_read = None

    def start_all(self, now: float) -> None:
        for child in self.children:
            self.start(child, now)

    def pids(self) -> list[int | None]:
        return [c.process.pid if c.process is not None else None for c in self.children]

    def close(self) -> None:
        """Kill what still runs and close every socket (the end of ``run``)."""
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
                child.process.wait()
            self._close_ready(child)
        self.groups.close()
        if self.sidecar is not None:
            self.sidecar.close()

    def run(self) -> int:
        """Until every child has exited after SIGTERM/SIGINT (or a failed start)."""
        received: list[int] = []
        previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum))
                    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self.start_all(time.monotonic())
            while True:
                while received:
                    signum = received.pop(0)
                    if signum == signal.SIGHUP:
                        self.forward(signum)
                    else:
                        self.stop(signum)
                if not self.step(time.monotonic()):
                    return self.status
                time.sleep(POLL_S)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def default_processes(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its affinity mask (not the host's
    count), and no more than a cgroup v2 CPU quota allows (a container limited
    to 2 CPUs on a 64-core host runs 2, not 64)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit(cpu_max)
    return max(1, min(cores, quota)) if quota is not None else cores


def cgroup_cpu_limit(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """CPUs a cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") allows, rounded up."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None
