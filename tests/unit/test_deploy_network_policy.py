"""The Kubernetes recipe's NetworkPolicies let through exactly the paths Hedgerow needs.

The policies are evaluated here as the API defines them (a connection needs
the source's egress and the destination's ingress to allow it; a pod no
policy selects for a direction is open in it; rules of the policies that do
select it are unioned), over the recipe's own pods plus a Prometheus, a pod of
another namespace wearing Hedgerow's labels, the cluster DNS and a host on the
internet. Every (source, destination port) pair is checked, not samples.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from tests.support.deploy_recipes import manifests, of_kind, pod_labels, pod_spec, workloads

NAMESPACE = next(d for _, d in manifests() if d["kind"] == "Kustomization")["namespace"]
NAME = "app.kubernetes.io/name"


@dataclass(frozen=True)
class Peer:
    role: str
    namespace: str | None  # None: outside the cluster
    labels: dict[str, str] = field(default_factory=dict)
    ports: tuple[tuple[str, int, str], ...] = ()  # (name, port, protocol) it listens on
    ip: str = "10.0.0.1"


def hedgerow_pods() -> list[Peer]:
    pods = []
    for doc in workloads():
        listening = tuple((p.get("name", ""), p["containerPort"], p.get("protocol", "TCP"))
                          for c in pod_spec(doc)["containers"] for p in c.get("ports", []))
        labels = pod_labels(doc)
        pods.append(Peer(labels[NAME], NAMESPACE, labels, listening))
    return pods


PROMETHEUS = Peer("prometheus", "monitoring", {NAME: "prometheus"})
DNS = Peer("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, (("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")))
# Another namespace's pod that copies a gateway's labels: labels alone open nothing.
STRANGER = Peer("stranger", "elsewhere", {NAME: "hedgerow-gateway", "app.kubernetes.io/part-of": "hedgerow"})
INTERNET = Peer("internet", None, ip="203.0.113.7", ports=(("https", 443, "TCP"),))


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if not {"In": present and labels.get(key) in values,
                "NotIn": not present or labels[key] not in values,
                "Exists": present, "DoesNotExist": not present}[operator]:
            return False
    return True


def namespace_labels(peer: Peer) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": peer.namespace or ""}


def peer_matches(rule_peer: dict[str, Any], peer: Peer) -> bool:
    if "ipBlock" in rule_peer:
        block = rule_peer["ipBlock"]
        address = ipaddress.ip_address(peer.ip)
        inside = address in ipaddress.ip_network(block["cidr"])
        return peer.namespace is None and inside and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", []))
    if peer.namespace is None:
        return False
    if "namespaceSelector" in rule_peer:
        if not selects(rule_peer["namespaceSelector"], namespace_labels(peer)):
            return False
    elif peer.namespace != NAMESPACE:
        return False
    return selects(rule_peer.get("podSelector", {}), peer.labels)


def port_matches(rule_ports: list[dict[str, Any]] | None, dst: Peer, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        wanted = entry.get("port")
        if isinstance(wanted, str):  # a named port: the destination's
            wanted = next((p for n, p, proto in dst.ports if n == wanted and proto == protocol), None)
        if wanted is None or wanted <= port <= entry.get("endPort", wanted):
            return True
    return False


def policies_for(pod: Peer, direction: str) -> list[dict[str, Any]]:
    if pod.namespace != NAMESPACE:
        return []
    return [p for p in of_kind("NetworkPolicy")
            if direction in p["spec"].get("policyTypes", ["Ingress"])
            and selects(p["spec"]["podSelector"], pod.labels)]


def allows(policy: dict[str, Any], direction: str, other: Peer, dst: Peer, port: int,
           protocol: str) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any((not rule.get(peers_key) or any(peer_matches(p, other) for p in rule[peers_key]))
               and port_matches(rule.get("ports"), dst, port, protocol)
               for rule in policy["spec"].get(key) or [])


def connects(src: Peer, dst: Peer, port: int, protocol: str) -> bool:
    out = policies_for(src, "Egress")
    into = policies_for(dst, "Ingress")
    return ((not out or any(allows(p, "Egress", dst, dst, port, protocol) for p in out))
            and (not into or any(allows(p, "Ingress", src, dst, port, protocol) for p in into)))


def reachable() -> set[tuple[str, str, int, str]]:
    pods = hedgerow_pods()
    return {(src.role, dst.role, port, protocol)
            for src in [*pods, PROMETHEUS, STRANGER, INTERNET]
            for dst in pods
            for _, port, protocol in dst.ports
            if src is not dst and connects(src, dst, port, protocol)}


GW, CP, WK, REDIS = "hedgerow-gateway", "hedgerow-control-plane", "hedgerow-worker", "redis"
OUTSIDE = ("internet", "prometheus", "stranger")
EXPECTED = {
    *{(src, GW, 8443, proto) for src in OUTSIDE for proto in ("TCP", "UDP")},
    (GW, CP, 8500, "TCP"), (GW, CP, 8501, "TCP"),
    (WK, CP, 8500, "TCP"), (WK, CP, 8501, "TCP"),
    (GW, WK, 8600, "TCP"),
    (GW, REDIS, 6380, "TCP"), (CP, REDIS, 6380, "TCP"),
    ("prometheus", GW, 8444, "TCP"), ("prometheus", CP, 8502, "TCP"),
    ("prometheus", WK, 8600, "TCP"),
}


def test_exactly_the_paths_hedgerow_needs_are_open() -> None:
    found = reachable()
    assert found - EXPECTED == set(), "open beyond what Hedgerow needs"
    assert EXPECTED - found == set(), "a path Hedgerow needs is closed"


def test_a_default_deny_selects_every_pod_both_ways() -> None:
    deny = [p for p in of_kind("NetworkPolicy")
            if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
            and not p["spec"].get("egress")]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    for pod in hedgerow_pods():
        assert policies_for(pod, "Ingress") and policies_for(pod, "Egress"), pod.role


def test_every_pod_resolves_names_and_reaches_nothing_else_outside() -> None:
    for pod in hedgerow_pods():
        assert connects(pod, DNS, 53, "UDP") and connects(pod, DNS, 53, "TCP"), pod.role
        assert not connects(pod, DNS, 80, "TCP"), pod.role
        assert not connects(pod, INTERNET, 443, "TCP"), f"{pod.role} reaches the internet"
        assert not connects(pod, PROMETHEUS, 9090, "TCP"), pod.role


def test_the_evaluator_tells_open_from_closed() -> None:
    # A namespace without policies (the old recipe) is open to everyone; in
    # Hedgerow's, a pod that no allow rule names reaches nothing and is
    # reached by nothing. If the model got either wrong, the tests above
    # could pass by mistake.
    cp = next(p for p in hedgerow_pods() if p.role == CP)
    assert connects(INTERNET, Peer(cp.role, "elsewhere", cp.labels, cp.ports), 8500, "TCP")
    assert connects(STRANGER, Peer(cp.role, "elsewhere", cp.labels, cp.ports), 8502, "TCP")
    unnamed = Peer("unnamed", NAMESPACE, {"app.kubernetes.io/part-of": "hedgerow"}, cp.ports)
    assert not connects(INTERNET, unnamed, 8500, "TCP")
    assert not connects(unnamed, cp, 8500, "TCP") and not connects(unnamed, DNS, 80, "TCP")
