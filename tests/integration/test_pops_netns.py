"""The multi-PoP harness: namespaces joined only through the delaying relay,
and the benchmark's stack on it (two control-plane replicas, one cluster CA).

Runs as root (as CI does). If the namespaces cannot be built this FAILS with
the command that did not work: the harness is part of the product's
benchmarks, and a skip would hide that it cannot run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.pops.netns import NetnsUnavailable, PopNetwork
from bench.pops.relay import LinkShape, RelayConfig
from bench.pops.scenario import CONTROL_PLANE, PopsSetup, PopsStack, summarize

PORT = 7999
RTT_MS = 100.0

ECHO_SERVER = f"""
import asyncio
async def echo(r, w):
    while data := await r.read(1024):
        w.write(data); await w.drain()
    w.close()
async def main():
    server = await asyncio.start_server(echo, "0.0.0.0", {PORT})
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""

# Connect, send, read the echo: seconds for the whole exchange, or the error.
PING = """
import socket, sys, time, json
start = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:
        s.sendall(b"ping"); got = s.recv(16)
    print(json.dumps({"s": time.monotonic() - start, "got": got.decode()}))
except OSError as e:
    print(json.dumps({"error": type(e).__name__}))
"""


def ping(net: PopNetwork, namespace: str, host: str) -> dict[str, object]:
    out = subprocess.run([*net.exec_prefix(namespace), sys.executable, "-c", PING, host,
                          str(PORT)], capture_output=True, text=True, timeout=20, check=True)
    result: dict[str, object] = json.loads(out.stdout)
    return result


def started(net: PopNetwork, namespace: str, *argv: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*net.exec_prefix(namespace), sys.executable, *argv],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def network() -> Iterator[PopNetwork]:
    try:
        net = PopNetwork(("ams", "fra")).build()
    except NetnsUnavailable as error:
        pytest.fail(f"cannot build network namespaces here (run as root with iproute2): {error}")
    try:
        yield net
    finally:
        net.teardown()


def test_cross_pop_traffic_pays_the_wan_and_only_goes_through_the_relay(
        network: PopNetwork, tmp_path: Path) -> None:
    ams, fra = network.pop("ams"), network.pop("fra")
    config = RelayConfig(ports=[PORT], pops={1: "ams", 2: "fra"}, links={
        ("ams", "fra"): LinkShape(RTT_MS), ("fra", "ams"): LinkShape(RTT_MS)})
    (tmp_path / "relay.json").write_text(json.dumps(config.to_json()))
    echo = started(network, fra.namespace, "-c", ECHO_SERVER)
    relay = started(network, network.wan_namespace, "-m", "bench.pops.relay",
                    str(tmp_path / "relay.json"))
    try:
        local = ping(network, fra.namespace, fra.address)
        remote = ping(network, ams.namespace, fra.address)
        assert local["got"] == remote["got"] == "ping"
        assert float(local["s"]) < 0.05  # type: ignore[arg-type]
        # Handshake (one RTT) + the request there and its echo back (one RTT).
        assert 2 * RTT_MS / 1000 <= float(remote["s"]) < 2 * RTT_MS / 1000 + 0.5  # type: ignore[arg-type]
        # Clients reach only their own PoP.
        assert "error" in ping(network, ams.client_namespace, fra.address)
        relay.terminate()
        relay.wait(10)
        # No relay, no WAN: nothing is forwarded around it.
        assert "error" in ping(network, ams.namespace, fra.address)
    finally:
        for proc in (relay, echo):
            proc.kill()
            proc.wait(10)


def test_both_pops_join_one_cluster_and_serve_each_other_over_mutual_tls(tmp_path: Path) -> None:
    """The benchmark's stack as it runs: every process joins (no --insecure-internal);
    a gateway verifies the other PoP's workers by the same cluster CA."""
    stack = PopsStack(PopsSetup(rate_per_pop=3.0), tmp_path / "pops")
    try:
        try:
            stack.start()
        except NetnsUnavailable as error:
            pytest.fail(f"cannot build network namespaces here (run as root with iproute2): "
                        f"{error}")
        stack.apply_routing("blind")  # any PoP's worker: some requests cross the WAN
        records = stack.drive(4.0, seed=1)
        summary = summarize(records)
        assert summary["requests"] > 0 and summary["served_fraction"] == 1.0, summary
        assert summary["served_in_other_pop"] > 0, summary
        logs = {proc.name: proc.log() for proc in stack.procs.procs}
        assert not any("INSECURE" in text for text in logs.values())
        assert "joined as worker/fra-1" in logs["fra-1"]
        # With the admin credential the PoP's control plane answers; without it, nothing.
        assert stack.status("fra")["gateways"], "the operator reads fra's status"
        outsider = stack.ops["fra"].ask({"op": "get", "url": CONTROL_PLANE + "/v1/status",
                                         "ca": str(stack.cluster_ca)})
        assert "error" in outsider or outsider["status"] in (401, 403), outsider
    finally:
        stack.stop()
