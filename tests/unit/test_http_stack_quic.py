"""``http_stack.quic_connection``, ``.quic_certificates`` and ``.quic_front_door``
on a real QUIC listener: resumption with session tickets, the listener's
configuration reaching the certificate reloader, and a Retry before admission."""

from __future__ import annotations

import functools

import hypercorn.protocol.h3
import hypercorn.protocol.quic
import pytest

from gateway.edge.cert_reload import CertificateReloader
from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.quic_admission import QuicFrontDoor, QuicLimits
from gateway.edge.quic_cap import BoundedH3Connection
from hedgerow.http_stack.quic_connection import BoundedQuicConnection
from tests.support.h3client import h3_request
from tests.support.http_stack import gateway_listener

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("state"))


async def test_http3_clients_resume_with_the_tickets_hypercorn_would_not_issue(
        cert: DevCertificate) -> None:
    async with gateway_listener(cert) as port:
        factory = hypercorn.protocol.quic.QuicConnection  # type: ignore[attr-defined]
        assert isinstance(factory, functools.partial) and factory.func is BoundedQuicConnection
        first = await h3_request("127.0.0.1", port, "POST", body=b"x", cafile=cert.ca_cert,
                                 server_name="localhost")
        assert first.status == 200 and first.session_ticket is not None
        again = await h3_request("127.0.0.1", port, "POST", body=b"x", cafile=cert.ca_cert,
                                 server_name="localhost", session_ticket=first.session_ticket)
        assert again.status == 200 and again.session_resumed


async def test_the_quic_listener_configuration_reaches_the_reloader(
        cert: DevCertificate) -> None:
    reloader = CertificateReloader(cert.cert, cert.key, poll_s=0)
    async with gateway_listener(cert, certificates=reloader) as port:
        response = await h3_request("127.0.0.1", port, "POST", body=b"x",
                                    cafile=cert.ca_cert, server_name="localhost")
        assert response.status == 200
        configurations = [ref() for ref in reloader._quic if ref() is not None]
        assert len(configurations) == 1  # the one UDP listener's
        assert configurations[0].certificate is not None


async def test_the_front_door_retries_before_admitting(cert: DevCertificate) -> None:
    door = QuicFrontDoor(QuicLimits(retry="always"))
    async with gateway_listener(cert, quic_door=door) as port:
        assert hypercorn.protocol.h3.H3Connection is BoundedH3Connection  # type: ignore[attr-defined]
        response = await h3_request("127.0.0.1", port, "POST", body=b"x",
                                    cafile=cert.ca_cert, server_name="localhost")
        assert response.status == 200 and response.body == b"hello"
        assert door.retries_sent == 1
