"""Several PoPs on one machine: network namespaces joined by veth links.

Layout (PoP number ``k`` = 1, 2, ...)::

    client-k ──veth── pop-k ──veth── wan ──veth── pop-j ──veth── client-j
    10.78.k.2   10.78.k.1  10.77.k.2  10.77.k.1 │ 10.77.j.1  10.77.j.2 ...
                                               └ the delaying relay

Every process of PoP ``k`` (gateway, workers, control plane) runs in
``pop-k``; other PoPs reach it at ``10.77.k.2``. The load generator of PoP
``k`` runs in ``client-k`` and reaches only its own PoP (``10.78.k.1``).
The ``wan`` namespace joins the PoPs but forwards nothing (IP forwarding is
off there): a policy rule makes every address in ``10.77.0.0/16`` *local* for
packets arriving from a PoP, so each cross-PoP TCP connection lands on the
relay (``bench.pops.relay``), which reads where it was headed (its local
address) and where it came from, delays it by that link's shape and connects
onward. Nothing crosses PoPs without the relay; nothing leaves the namespaces
this harness created (no route to the host, which is never touched).

Needs root and iproute2 (``ip netns``, veth). ``PopNetwork.build`` raises
``NetnsUnavailable`` with the failing command and its error when it cannot.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass, field

WAN_PREFIX = "10.77"
CLIENT_PREFIX = "10.78"
RELAY_TABLE = "100"
COMMAND_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """This machine cannot build the namespaces (not root, no iproute2, no netns)."""


def ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {error}") from error
    if done.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(argv)}` exited {done.returncode}: "
                               f"{done.stderr.strip()} (the PoP harness needs root and iproute2)")


@dataclass(frozen=True)
class Pop:
    name: str
    number: int  # 1-based; the third octet of its addresses
    namespace: str
    client_namespace: str

    @property
    def address(self) -> str:
        """Where other PoPs reach this PoP's processes (through the relay)."""
        return f"{WAN_PREFIX}.{self.number}.2"

    @property
    def client_facing_address(self) -> str:
        """Where this PoP's clients reach its gateway."""
        return f"{CLIENT_PREFIX}.{self.number}.1"


def pop_number_of(address: str) -> int | None:
    """The PoP an address in ``10.77.k.0/24`` belongs to."""
    parts = address.split(".")
    if len(parts) != 4 or ".".join(parts[:2]) != WAN_PREFIX:
        return None
    return int(parts[2])


@dataclass
class PopNetwork:
    pop_names: tuple[str, ...]
    tag: str = field(default_factory=lambda: f"hrp{os.getpid()}{secrets.token_hex(2)}")
    pops: list[Pop] = field(default_factory=list)
    created: list[str] = field(default_factory=list)

    @property
    def wan_namespace(self) -> str:
        return f"{self.tag}-wan"

    def pop(self, name: str) -> Pop:
        return next(p for p in self.pops if p.name == name)

    def build(self) -> PopNetwork:
        """Create every namespace and link; on any failure, remove what was made."""
        if not 1 <= len(self.pop_names) <= 200:
            raise ValueError("between 1 and 200 PoPs")
        try:
            self._namespace(self.wan_namespace)
            self._wan_rules()
            for number, name in enumerate(self.pop_names, start=1):
                self.pops.append(self._pop(name, number))
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Delete the namespaces (their veths go with them); never raises."""
        for namespace in reversed(self.created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True,
                           timeout=COMMAND_TIMEOUT_S, check=False)
        self.created.clear()

    def exec_prefix(self, namespace: str) -> list[str]:
        """Argv prefix that runs a command inside ``namespace``."""
        return ["ip", "netns", "exec", namespace]

    def __enter__(self) -> PopNetwork:
        return self.build()

    def __exit__(self, *_: object) -> None:
        self.teardown()

    def _namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.created.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _wan_rules(self) -> None:
        wan = self.wan_namespace
        # Arriving from any PoP, every 10.77/16 address is ours: the relay gets it.
        ip("-n", wan, "route", "add", "local", f"{WAN_PREFIX}.0.0/16", "dev", "lo",
           "table", RELAY_TABLE)
        for knob in ("all", "default"):
            _run([*self.exec_prefix(wan), "sysctl", "-q", "-w",
                  f"net.ipv4.conf.{knob}.rp_filter=0"])
        _run([*self.exec_prefix(wan), "sysctl", "-q", "-w", "net.ipv4.ip_forward=0"])

    def _pop(self, name: str, k: int) -> Pop:
        pop = Pop(name, k, f"{self.tag}-{k}", f"{self.tag}-{k}c")
        wan = self.wan_namespace
        self._namespace(pop.namespace)
        self._namespace(pop.client_namespace)
        self._veth(pop.namespace, "wan", f"{WAN_PREFIX}.{k}.2/24",
                   wan, f"p{k}", f"{WAN_PREFIX}.{k}.1/24")
        ip("-n", pop.namespace, "route", "add", "default", "via", f"{WAN_PREFIX}.{k}.1")
        ip("-n", wan, "rule", "add", "iif", f"p{k}", "lookup", RELAY_TABLE)
        self._veth(pop.client_namespace, "pop", f"{CLIENT_PREFIX}.{k}.2/24",
                   pop.namespace, "client", f"{CLIENT_PREFIX}.{k}.1/24")
        return pop

    def _veth(self, ns_a: str, name_a: str, addr_a: str, ns_b: str, name_b: str,
              addr_b: str) -> None:
        ip("link", "add", "name", name_a, "netns", ns_a, "type", "veth",
           "peer", "name", name_b, "netns", ns_b)
        for ns, name, addr in ((ns_a, name_a, addr_a), (ns_b, name_b, addr_b)):
            ip("-n", ns, "addr", "add", addr, "dev", name)
            ip("-n", ns, "link", "set", name, "up")
