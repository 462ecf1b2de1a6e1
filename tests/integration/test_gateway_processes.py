"""``hedgerow gateway --processes 2``: real processes on one port, TCP and UDP.

A control plane, a sim worker with 2 slots and a gateway supervising two
children (admin listeners on --admin-port and --admin-port + 1). What a user
would notice: both processes answer on the one port over TCP and over QUIC; a
QUIC client that changes its source port mid-stream (connection migration,
the mobile case) still gets its whole streamed answer; a killed process is
restarted while the other keeps serving; the worker never runs more than its
slots however the two processes dispatch; with the semantic cache on (the
control plane's policy turns it on: it ships off) one embedding sidecar, the
supervisor's, serves both processes' semantic caches. Every QUIC connection
here goes through a Retry (``--quic-retry always``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import orjson
import pytest
from aioquic.asyncio import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration

from bench.shipped_policy import SEMANTIC_ON, shipped_policy_text
from tests.support.h3client import _H3ClientProtocol, _send_request, h3_request
from tests.support.stack import Stack, free_port_run, scrape_metrics, wait_for
from tests.support.streams import sse_data

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SLOTS = 2
SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "40", "--sim-jitter", "0"]



@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("procs")
    policy = root / "policy.yaml"
    policy.write_text(shipped_policy_text(SEMANTIC_ON))
    stack = Stack(root)
    try:
        stack.start_control_plane(lease_s=2.0, policy=policy)
        stack.start_worker("sim-2", *SIM, "--slots", str(SLOTS))
        admin = free_port_run(2)
        # Every QUIC client is sent a Retry first: its next Initial, addressed to
        # the Retry's id, must reach the process whose key sealed the token.
        stack.start_gateway("--processes", "2", "--admin-port", str(admin),
                            "--host", "127.0.0.1", "--quic-retry", "always")
        wait_for(lambda: all(_requests(stack, i) >= 0 for i in (0, 1)), "both admin listeners")
        yield stack
    finally:
        stack.stop_all()


def _admin_url(stack: Stack, index: int) -> str:
    return f"https://127.0.0.1:{stack.gateway_admin_port + index}"


def _requests(stack: Stack, index: int) -> float:
    """Completion requests process ``index`` answered (its own /metrics)."""
    text = scrape_metrics(_admin_url(stack, index), verify=stack.admin_tls(check_hostname=False))
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hedgerow_requests_total{"))


def _body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about foxes."}],
            "max_tokens": max_tokens, "stream": stream}


def _tcp_request(stack: Stack, max_tokens: int = 2, timeout: float = 30.0) -> httpx.Response:
    """One request on a fresh TCP connection (so the kernel picks a process anew)."""
    with httpx.Client(base_url=stack.gateway_url, timeout=timeout,
                      verify=ssl.create_default_context(cafile=stack.ca_cert),
                      headers={"cache-control": "no-cache"}) as client:
        response = client.post("/v1/chat/completions", json=_body(max_tokens))
        response.read()
        return response


def _h3(stack: Stack, max_tokens: int = 2, timeout_s: float = 30.0) -> Any:
    return anyio.run(lambda: h3_request(
        "127.0.0.1", stack.gateway_port, "POST", "/v1/chat/completions",
        headers=[("content-type", "application/json"), ("cache-control", "no-cache")],
        body=orjson.dumps(_body(max_tokens)), cafile=stack.ca_cert, server_name="localhost",
        timeout_s=timeout_s, ticket_wait_s=0))


def test_both_processes_serve_tcp_and_quic_on_the_one_port(stack: Stack) -> None:
    before = [_requests(stack, i) for i in (0, 1)]
    for _ in range(16):
        assert _tcp_request(stack).status_code == 200
    after_tcp = [_requests(stack, i) for i in (0, 1)]
    assert all(a > b for a, b in zip(after_tcp, before)), (before, after_tcp)
    assert sum(after_tcp) - sum(before) == 16
    for _ in range(16):
        response = _h3(stack)
        assert response.status == 200 and sse_data(response.body.decode())[-1] == "[DONE]"
    after_quic = [_requests(stack, i) for i in (0, 1)]
    assert all(a > b for a, b in zip(after_quic, after_tcp)), (after_tcp, after_quic)
    assert sum(after_quic) - sum(after_tcp) == 16


def _cache_stats(stack: Stack, index: int) -> dict[str, Any]:
    reply = httpx.get(_admin_url(stack, index) + "/admin/cache",
                      verify=stack.admin_tls(check_hostname=False))
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


def _ask(stack: Stack, question: str) -> str:
    """A cacheable question on a fresh TCP connection; its x-hedgerow-cache."""
    with httpx.Client(base_url=stack.gateway_url, timeout=30,
                      verify=ssl.create_default_context(cafile=stack.ca_cert)) as client:
        reply = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": question}]})
        assert reply.status_code == 200, reply.text
        return reply.headers["x-hedgerow-cache"]


def _embed_servers_under(root: int) -> dict[int, int]:
    """Running embedding sidecars in ``root``'s process tree: pid -> parent pid."""
    parents: dict[int, int] = {}
    sidecars: set[int] = set()
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{stat}/cmdline", "rb").read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents[int(stat)] = int(fields[1])
        if b"gateway.cache.embed_server" in cmdline and fields[0] != "Z":
            sidecars.add(int(stat))

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return {pid: parents[pid] for pid in sidecars if under(pid)}


def test_both_processes_share_one_embedding_sidecar_and_get_semantic_hits(
        stack: Stack) -> None:
    # The control plane's policy (the shipped one, semantic part on) turns it on.
    wait_for(lambda: all(_cache_stats(stack, i)["semantic_ready"] for i in (0, 1)),
             "both processes to reach the embedding sidecar", 120)
    supervisor = next(p for p in stack.procs if p.name == "gateway").popen.pid
    sidecars = _embed_servers_under(supervisor)
    assert list(sidecars.values()) == [supervisor], sidecars  # one, the supervisor's own
    # Each process keeps a cache of its own (no --redis): ask until both stored the
    # question, then ask a paraphrase until both answered it as a semantic hit.
    for _ in range(60):
        if all(_cache_stats(stack, i)["semantic_entries"] >= 1 for i in (0, 1)):
            break
        _ask(stack, "How do I remove a git submodule?")
    else:
        pytest.fail("the question never reached both processes")
    for _ in range(60):
        if all(_cache_stats(stack, i)["semantic"] >= 1 for i in (0, 1)):
            break
        assert _ask(stack, "What's the way to delete a git submodule?") == "semantic"
    else:
        pytest.fail("the paraphrase never reached both processes")
    assert _embed_servers_under(supervisor) == sidecars


async def _migrating_stream(stack: Stack, tokens: int, moves: int) -> tuple[Any, list[float]]:
    """A streamed request over QUIC whose client moves to a new UDP port (and a
    new connection id) ``moves`` times while the answer streams."""
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                      server_name="localhost")
    configuration.load_verify_locations(cafile=str(stack.ca_cert))
    loop = asyncio.get_running_loop()
    moved_at: list[float] = []
    progressed: list[float] = []
    opened: list[asyncio.BaseTransport] = []
    with anyio.fail_after(30):
        async with connect("127.0.0.1", stack.gateway_port, configuration=configuration,
                           create_protocol=_H3ClientProtocol) as client:
            assert isinstance(client, _H3ClientProtocol)
            _send_request(client, "127.0.0.1", stack.gateway_port, "POST",
                          "/v1/chat/completions",
                          [("content-type", "application/json"), ("cache-control", "no-cache")],
                          orjson.dumps(_body(tokens)))
            while not client.response.chunks:
                await asyncio.sleep(0.01)
            for _ in range(moves):
                old = client._transport
                assert old is not None
                # As aioquic's connect() makes its socket: dual-stack IPv6.
                sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(("::", 0, 0, 0))
                transport, _ = await loop.create_datagram_endpoint(lambda: client, sock=sock)
                opened.append(transport)
                old.close()  # nothing reaches the old port any more
                client.change_connection_id()
                client.transmit()
                moved_at.append(time.monotonic())
                # The answer must go on arriving at the new port before the next
                # move: a datagram of the connection handed to the other process
                # would be dropped there, and the stream would stall.
                seen = len(client.response.chunks)
                with anyio.fail_after(3):
                    while len(client.response.chunks) <= seen and not client.done.done():
                        await asyncio.sleep(0.005)
                if len(client.response.chunks) > seen:
                    progressed.append(moved_at[-1])
            await client.done
    for transport in opened:
        transport.close()
    assert progressed == moved_at, "the answer went on after every move"
    return client.response, moved_at


def test_a_quic_client_that_changes_its_port_mid_stream_gets_its_whole_answer(
        stack: Stack) -> None:
    # Without steering by connection id each move's datagrams would reach
    # either process by the kernel's hash of the new addresses: the answer
    # going on after all four moves by luck, 1 in 16.
    tokens = 60
    response, moved_at = anyio.run(_migrating_stream, stack, tokens, 4)
    assert response.status == 200
    events = sse_data(response.body.decode())
    assert events[-1] == "[DONE]"
    text = "".join(orjson.loads(e)["choices"][0]["delta"].get("content", "")
                   for e in events[:-1] if orjson.loads(e)["choices"])
    assert text == "".join(f"tok{i} " for i in range(1, tokens + 1))
    # The answer kept coming after the last move, through the new port only.
    assert any(chunk.received_at > moved_at[-1] for chunk in response.chunks)


def _children(stack: Stack) -> dict[int, int]:
    """Process index -> pid, from the supervisor's log (latest start of each)."""
    gateway = next(p for p in stack.procs if p.name == "gateway")
    found: dict[int, int] = {}
    for match in re.finditer(r"gateway process (\d+) of 2 started \(pid (\d+)\)", gateway.log()):
        found[int(match.group(1))] = int(match.group(2))
    return found


def test_a_killed_process_is_restarted_and_the_other_keeps_serving(stack: Stack) -> None:
    supervisor = next(p for p in stack.procs if p.name == "gateway").popen.pid
    sidecars = _embed_servers_under(supervisor)
    killed = wait_for(lambda: _children(stack).get(0), "process 0's pid")
    survivor = _children(stack)[1]
    served_by_survivor = _requests(stack, 1)
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: not _pid_alive(killed), "process 0 to die", timeout=10)
    # While process 0 is gone, new QUIC connections whose first packets the
    # kernel hands to process 1 are answered.
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _try(lambda: _h3(stack, timeout_s=4.0)), range(8)))
    assert any(r is not None and r.status == 200 for r in results)
    assert _requests(stack, 1) > served_by_survivor
    restarted = wait_for(lambda: _children(stack).get(0) not in (None, killed)
                         and _children(stack)[0], "process 0 restarted")
    wait_for(lambda: _requests(stack, 0) >= 0, "the new process 0's admin listener")
    assert _children(stack)[1] == survivor and _pid_alive(survivor)
    assert restarted != killed
    for _ in range(6):
        assert _tcp_request(stack).status_code == 200
    # The new process embeds through the sidecar that was already running.
    wait_for(lambda: _cache_stats(stack, 0)["semantic_ready"], "process 0's embedder", 30)
    assert _embed_servers_under(supervisor) == sidecars and len(sidecars) == 1


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _try(call: Any) -> Any:
    try:
        return call()
    except Exception:
        return None


def test_the_worker_never_runs_more_than_its_slots_under_two_processes(stack: Stack) -> None:
    peak = {"active": 0, "queued": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            load = stack.worker_status("sim-2")
            peak["active"] = max(peak["active"], load["active"])
            peak["queued"] = max(peak["queued"], load["queued"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(lambda _: _tcp_request(stack, max_tokens=15).status_code,
                                     range(24)))
    finally:
        stop.set()
        watcher.join()
    assert statuses.count(200) + statuses.count(429) + statuses.count(503) == 24
    assert statuses.count(200) >= 12
    assert peak["active"] == SLOTS, peak  # saturated, never beyond
    print(f"worker peak: {peak}")


# --- EDF across processes ---------------------------------------------------------


def _edf_policy() -> str:
    """The overload scenario's two classes (interactive, batch: EDF), with
    deadlines long enough that nothing is shed here and no SLO refusals."""
    from bench.scenarios import overload_policy

    policy = overload_policy("edf")
    for old, new in (("slo_admission: true", "slo_admission: false"),
                     ("ttft_slo_ms: 1000, deadline_ms: 800", "ttft_slo_ms: 20000, deadline_ms: 20000"),
                     ("ttft_slo_ms: 10000, deadline_ms: 5000",
                      "ttft_slo_ms: 120000, deadline_ms: 120000")):
        assert old in policy
        policy = policy.replace(old, new)
    return policy


def _stream(stack: Stack, key: str, index: int, tokens: int) -> tuple[int, float, float]:
    """(status, first chunk at, end at) of one streamed request on a fresh connection."""
    body = {"model": MODEL, "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"note {index}"}]}
    with httpx.Client(base_url=stack.gateway_url, timeout=60,
                      verify=ssl.create_default_context(cafile=stack.ca_cert)) as client:
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"authorization": f"Bearer {key}"}) as response:
            first = 0.0
            for _ in response.iter_raw():
                first = first or time.monotonic()
            return response.status_code, first, time.monotonic()


def test_an_urgent_request_overtakes_work_queued_in_either_process(tmp_path: Any) -> None:
    """A 1-slot worker, 16 batch requests spread over both processes, then two
    interactive ones. Each process queues by deadline, but what a process has
    already sent to the worker waits there in arrival order, and each process
    sends up to the worker's slots (1 here) by its own count. So an urgent
    request that reaches process A waits for what the worker has (at most one
    request per process, running or waiting) and for what the other process
    sends while A's own is ahead of it: at most (2N - 1) x slots = 3 batch
    requests, never the ones still queued in either process. (With one FIFO
    for all it would wait for every batch request sent before it.)"""
    stack = Stack(tmp_path)
    (tmp_path / "policy.yaml").write_text(_edf_policy())
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", "--backend", "sim", "--slots", "1",
                           "--sim-prefill-ms-per-token", "0.1",
                           "--sim-decode-ms-per-token", "60", "--sim-jitter", "0")
        admin = free_port_run(2)
        stack.start_gateway("--policy", str(tmp_path / "policy.yaml"), "--processes", "2",
                            "--admin-port", str(admin), "--host", "127.0.0.1")
        wait_for(lambda: all(_requests(stack, i) >= 0 for i in (0, 1)), "both admin listeners")
        with ThreadPoolExecutor(16) as pool:
            batch = [pool.submit(_stream, stack, "sk-jobs", i, 5) for i in range(16)]
            time.sleep(1.0)  # every batch request queued or running
            sent = time.monotonic()
            urgent = [pool.submit(_stream, stack, "sk-web", 100 + i, 5) for i in range(2)]
            batch_results = [f.result() for f in batch]
            urgent_results = [f.result() for f in urgent]
        assert all(status == 200 for status, _, _ in batch_results + urgent_results)
        assert all(_requests(stack, i) > 0 for i in (0, 1))  # both processes took some
        batch_ends = sorted(end for _, _, end in batch_results)
        print("batch ends after the urgent ones were sent:",
              [round(end - sent, 2) for end in batch_ends],
              "urgent first chunks:", [round(first - sent, 2) for _, first, _ in urgent_results])
        assert batch_ends[-1] > max(first for _, first, _ in urgent_results), \
            "batch work was still waiting when the urgent requests started"
        for _, first, _ in urgent_results:
            ahead = sum(1 for end in batch_ends if sent < end < first)
            behind = sum(1 for end in batch_ends if end > first)
            # The bound above, plus one for the urgent request arriving just after
            # its process dispatched, and one for the other urgent request.
            assert ahead <= 5, (ahead, "batch requests finished before an urgent one began")
            assert behind >= 6, (behind, "batch requests the urgent one overtook")
    finally:
        stack.stop_all()


def test_sigterm_drains_every_process_and_the_gateway_exits_0(stack: Stack) -> None:
    """Last in the module: it stops the module's gateway. A stream running when
    the gateway is stopped ends in full; then every process has exited. Stopped
    as systemd stops a unit (SIGTERM to every process of it, so each child gets
    one directly and one forwarded by the supervisor) or Ctrl-C does (SIGINT to
    the process group): a second signal must not cut the drain short."""
    children = wait_for(lambda: len(_children(stack)) == 2 and _children(stack), "children")
    gateway = next(p for p in stack.procs if p.name == "gateway")
    with httpx.Client(base_url=stack.gateway_url, timeout=30,
                      verify=ssl.create_default_context(cafile=stack.ca_cert),
                      headers={"cache-control": "no-cache"}) as client:
        with client.stream("POST", "/v1/chat/completions", json=_body(50)) as response:
            raw = response.iter_raw()
            received = next(raw)
            for pid in children.values():
                os.kill(pid, signal.SIGTERM)
            gateway.popen.send_signal(signal.SIGTERM)
            for chunk in raw:
                received += chunk
    assert response.status_code == 200
    events = sse_data(received.decode())
    assert events[-1] == "[DONE]" and len(events) > 50
    assert gateway.popen.wait(timeout=40) == 0
    assert not any(_pid_alive(pid) for pid in children.values())
    assert "draining 2 gateway process(es)" in gateway.log()


def test_processes_sharing_one_identity_renew_it_one_at_a_time(tmp_path: Any) -> None:
    """Certificates that live 20 s (renewed every ~13 s: two thirds into their
    life) under --processes 2: the
    identity's key and certificate on disk always stay a pair (the processes
    renew under a file lock, the second loading what the first wrote), so
    requests keep reaching the worker over mutual TLS and a process started
    after the renewals loads the files."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    stack = Stack(tmp_path)
    try:
        # Long enough for the children to start on the certificate the parent
        # joined with (several seconds on a busy machine).
        stack.start_control_plane(lease_s=2.0, cert_ttl_s=20)
        stack.start_worker("sim-r", *SIM, "--slots", "2")
        stack.start_gateway("--processes", "2", "--admin-port", str(free_port_run(2)),
                            "--host", "127.0.0.1", "--gateway-id", "gw-pair")
        identity = tmp_path / "state" / "identity-gateway-gw-pair"
        gateway = next(p for p in stack.procs if p.name == "gateway")
        # The stack's readiness check reached one process; fresh connections
        # reach either, and neither accepts before its first registry snapshot
        # (it answered 503 no_healthy_worker for its first ~100 ms before).
        for _ in range(6):
            assert _tcp_request(stack).status_code == 200
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert _tcp_request(stack).status_code == 200
            log = gateway.log()
            if log.count("renewed gateway/gw-pair") >= 2 and "renewed by another process" in log:
                break
            time.sleep(0.3)
        log = gateway.log()
        assert log.count("renewed gateway/gw-pair") >= 2
        assert "renewed by another process" in log
        key = load_pem_private_key((identity / "key.pem").read_bytes(), None)
        cert = x509.load_pem_x509_certificate((identity / "cert.pem").read_bytes())
        assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
        os.kill(_children(stack)[1], signal.SIGKILL)
        wait_for(lambda: len(re.findall(r"gateway process 1 of 2 started", gateway.log())) == 2
                 and _requests(stack, 1) >= 0, "process 1 restarted")
        for _ in range(6):
            assert _tcp_request(stack).status_code == 200
    finally:
        stack.stop_all()
