"""The public certificate is replaced on disk; the gateway serves the new one
without dropping a connection.

A gateway serves certificate A (``--certfile``/``--keyfile``). While one
client streams a long reply, A's files are replaced by B's (issued by another
CA). Asserted:

- polling (``--certificate-poll-s 0.2``): within RELOAD_BUDGET_S a new TCP
  connection is handed B, and an HTTP/3 connection that trusts only B's CA
  succeeds; the stream that started before the reload ends with [DONE] on
  the connection it started on (still holding A), and a kept-alive connection
  opened before the reload is served again;
- SIGHUP (``--certificate-poll-s 0``): nothing changes until the signal; a
  key that does not match its certificate is refused and A serves on; the
  matching pair then loads on the next SIGHUP;
- ``hedgerow_certificate_reloads_total{result}`` counts both outcomes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from tests.support.capped import start_capped_stack
from tests.support.h3client import h3_request
from tests.support.stack import Stack, wait_for
from tests.support.streams import chat_body

pytestmark = pytest.mark.e2e

RELOAD_BUDGET_S = 3.0
LONG_STREAM_TOKENS = 1500  # 2 ms a token in the simulated worker: ~3 s


@dataclass(frozen=True)
class Certs:
    a: DevCertificate
    b: DevCertificate
    served: DevCertificate  # the paths the gateway is given
    both_cas: Path


def _certs(root: Path) -> Certs:
    a = ensure_dev_certificate(root / "state")  # the stack's own CA, so its probes pass
    b = ensure_dev_certificate(root / "other")  # another CA, another key
    served = DevCertificate(ca_cert=a.ca_cert, cert=root / "public" / "cert.pem",
                            key=root / "public" / "key.pem")
    served.cert.parent.mkdir()
    shutil.copy(a.cert, served.cert)
    shutil.copy(a.key, served.key)
    both = root / "both-cas.pem"
    both.write_bytes(a.ca_cert.read_bytes() + b.ca_cert.read_bytes())
    return Certs(a, b, served, both)


def _replace(source: Path, target: Path) -> None:
    """As an ACME client does: write aside, then rename over."""
    aside = target.with_suffix(".new")
    shutil.copy(source, aside)
    os.replace(aside, target)


def _der(path: Path) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)


def _presented(port: int, cafile: Path) -> bytes:
    """The certificate a new TCP connection is handed."""
    context = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _reloads(stack: Stack) -> dict[str, float]:
    return {sample.labels["result"]: sample.value
            for family in text_string_to_metric_families(stack.gateway_metrics())
            for sample in family.samples if sample.name == "hedgerow_certificate_reloads_total"}


def _start(root: Path, poll_s: str) -> tuple[Stack, Certs]:
    certs = _certs(root)
    stack = start_capped_stack(root, 64, "--drain-timeout-s", "1", "--certfile",
                               str(certs.served.cert), "--keyfile", str(certs.served.key),
                               "--certificate-poll-s", poll_s)
    return stack, certs


@pytest.fixture
def polling(tmp_path: Path) -> Iterator[tuple[Stack, Certs]]:
    stack, certs = _start(tmp_path, "0.2")
    try:
        yield stack, certs
    finally:
        stack.stop_all()


def test_a_replaced_certificate_is_served_to_new_connections_only(
        polling: tuple[Stack, Certs]) -> None:
    stack, certs = polling
    port = stack.gateway_port
    assert _presented(port, certs.both_cas) == _der(certs.a.cert)
    verify = ssl.create_default_context(cafile=str(certs.both_cas))
    stream_lines: list[str] = []
    stream_cert: list[bytes] = []
    first_line = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=stack.gateway_url, verify=verify, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions",
                             json=chat_body(LONG_STREAM_TOKENS)) as response:
                tls = response.extensions["network_stream"].get_extra_info("ssl_object")
                stream_cert.append(tls.getpeercert(True))  # an _ssl object: positional
                for line in response.iter_lines():
                    stream_lines.append(line)
                    first_line.set()

    with httpx.Client(base_url=stack.gateway_url, verify=verify, timeout=10) as kept:
        assert kept.get("/healthz").status_code == 200
        streamer = threading.Thread(target=stream)
        streamer.start()
        try:
            assert first_line.wait(10)
            # The key first, then the certificate: a poll may see the mismatched
            # pair in between, refuse it, and load the whole pair on the next.
            _replace(certs.b.key, certs.served.key)
            _replace(certs.b.cert, certs.served.cert)
            replaced = time.monotonic()
            wait_for(lambda: _presented(port, certs.both_cas) == _der(certs.b.cert),
                     "the new certificate on a new connection", RELOAD_BUDGET_S)
            took = time.monotonic() - replaced
            assert took < RELOAD_BUDGET_S
            assert streamer.is_alive(), "the stream ended before the reload: make it longer"
            # HTTP/3 trusting only B's CA: only the new certificate passes.
            reply = anyio.run(lambda: h3_request("127.0.0.1", port, path="/healthz",
                                                 cafile=certs.b.ca_cert))
            assert reply.status == 200
            assert kept.get("/healthz").status_code == 200  # opened before, not dropped
        finally:
            streamer.join(30)
    assert stream_cert == [_der(certs.a.cert)]  # the stream's connection kept A
    assert [line for line in stream_lines if line][-1] == "data: [DONE]", stream_lines[-3:]
    assert _reloads(stack)["loaded"] >= 1


@pytest.fixture
def on_signal(tmp_path: Path) -> Iterator[tuple[Stack, Certs]]:
    stack, certs = _start(tmp_path, "0")
    try:
        yield stack, certs
    finally:
        stack.stop_all()


def test_sighup_reloads_and_a_mismatched_pair_is_refused(
        on_signal: tuple[Stack, Certs]) -> None:
    stack, certs = on_signal
    port = stack.gateway_port
    gateway = next(p for p in stack.procs if p.name == "gateway").popen
    _replace(certs.b.cert, certs.served.cert)  # B's certificate with A's key: no pair
    time.sleep(1.0)  # no polling: nothing happens
    assert _presented(port, certs.both_cas) == _der(certs.a.cert)
    gateway.send_signal(signal.SIGHUP)
    wait_for(lambda: _reloads(stack).get("refused", 0) == 1, "the refused reload", 5)
    assert _presented(port, certs.both_cas) == _der(certs.a.cert)  # A serves on
    _replace(certs.b.key, certs.served.key)
    gateway.send_signal(signal.SIGHUP)
    wait_for(lambda: _presented(port, certs.both_cas) == _der(certs.b.cert),
             "the new certificate after SIGHUP", RELOAD_BUDGET_S)
    assert _reloads(stack) == {"loaded": 1, "refused": 1}
    assert gateway.poll() is None
