"""TLS ticket keys rotated on a schedule (``gateway.edge.ticket_keys``).

The ring is tested in virtual time; then real OpenSSL handshakes (in memory,
TLS 1.3 and 1.2) with the ring installed on the server's context and a clock
the test moves: a ticket issued before a rotation still resumes within the
next period, and not in the one after.
"""

from __future__ import annotations

import itertools
import ssl
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.ticket_keys import TicketKeyRing, install_ticket_keys

PERIOD = 100.0


def counting_random() -> object:
    counter = itertools.count()
    return lambda n: next(counter).to_bytes(n, "big")


def test_a_key_opens_in_its_period_and_the_next_and_renews_there() -> None:
    ring = TicketKeyRing(PERIOD, random=counting_random())  # type: ignore[arg-type]
    first = ring.sealing_key(10.0)
    assert ring.sealing_key(99.9) == first  # one key per period
    opened = ring.opening_key(first.name, 50.0)
    assert opened is not None and not opened.renew
    second = ring.sealing_key(100.0)  # rotated
    assert second.name != first.name and ring.rotations == 1
    opened = ring.opening_key(first.name, 199.9)  # the grace: one period
    assert opened is not None and opened.renew and opened.key == first
    assert ring.opening_key(first.name, 200.0) is None  # two rotations later: gone
    assert ring.opening_key(b"x" * 16, 150.0) is None
    assert ring.stats()["opened"] == {"current": 1, "previous": 1, "unknown": 2}


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 1e6)), max_size=60))
def test_tickets_open_exactly_within_one_rotation(steps: list[tuple[bool, float]]) -> None:
    ring = TicketKeyRing(PERIOD, random=counting_random())  # type: ignore[arg-type]
    sealed: list[tuple[bytes, int]] = []
    now = 0.0
    for seal, step in steps:
        now += step % (3 * PERIOD)
        period = int(now // PERIOD)
        if seal:
            key = ring.sealing_key(now)
            assert key.period == period
            sealed.append((key.name, period))
        for name, at in sealed:
            assert (ring.opening_key(name, now) is not None) == (period - at <= 1), (now, at)
        assert len(ring._keys) <= 2  # bounded


def test_bad_period_is_refused() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            TicketKeyRing(bad)


# -- real handshakes, in memory ------------------------------------------------


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("tickets"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pump(client: ssl.SSLObject, c_in: ssl.MemoryBIO, c_out: ssl.MemoryBIO,
          server: ssl.SSLObject, s_in: ssl.MemoryBIO, s_out: ssl.MemoryBIO) -> None:
    """Drive both handshakes to the end, then one request/reply, so the client
    has read the server's post-handshake tickets (TLS 1.3)."""
    done = [False, False]
    for _ in range(20):
        for i, side in enumerate((client, server)):
            if not done[i]:
                try:
                    side.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done):
            break
    assert all(done)
    client.write(b"ping")
    s_in.write(c_out.read())
    assert server.read(4) == b"ping"
    server.write(b"pong")
    c_in.write(s_out.read())
    assert client.read(4) == b"pong"


def _connect(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
             session: ssl.SSLSession | None) -> ssl.SSLObject:
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost", session=session)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    _pump(client, c_in, c_out, server, s_in, s_out)
    return client


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
def test_a_ticket_resumes_across_one_rotation_and_not_two(
        cert: DevCertificate, version: ssl.TLSVersion) -> None:
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert.cert, cert.key)
    clock = Clock()
    ring = TicketKeyRing(PERIOD)
    assert install_ticket_keys(server_ctx, ring, clock)
    client_ctx = ssl.create_default_context(cafile=str(cert.ca_cert))
    client_ctx.maximum_version = version

    first = _connect(server_ctx, client_ctx, None)
    assert not first.session_reused and first.session is not None
    assert ring.sealed >= 1
    clock.now += 10
    assert _connect(server_ctx, client_ctx, first.session).session_reused  # same period

    ticket = _connect(server_ctx, client_ctx, None).session  # issued at 1010, period 10
    clock.now = 1100.0 + 99  # period 11: rotated once, the grace
    within = _connect(server_ctx, client_ctx, ticket)
    assert within.session_reused
    assert ring.rotations >= 1 and ring.opened["previous"] >= 1
    clock.now = 1200.0  # period 12: rotated twice
    after = _connect(server_ctx, client_ctx, ticket)
    assert not after.session_reused  # a full handshake, which still succeeds
    assert ring.opened["unknown"] >= 1


def test_without_the_ring_openssl_keeps_one_key_forever(cert: DevCertificate) -> None:
    # The baseline this replaces: the same ticket, two "periods" on, still resumes.
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert.cert, cert.key)
    client_ctx = ssl.create_default_context(cafile=str(cert.ca_cert))
    ticket = _connect(server_ctx, client_ctx, None).session
    assert _connect(server_ctx, client_ctx, ticket).session_reused


def test_an_unexpected_context_layout_installs_nothing(tmp_path: Path) -> None:
    class NotAContext:
        options = 0
        verify_mode = ssl.CERT_NONE

    # A Python object of another shape: its "SSL_CTX" slot is not one.
    assert not install_ticket_keys(NotAContext(), TicketKeyRing())  # type: ignore[arg-type]
