"""hedgerow.http_stack.quic_cid: every id a server connection hands out names its process.

A real aioquic client and server handshake in memory; the ids the client
learns (the server's initial source id and each NEW_CONNECTION_ID) are the ids
it will address datagrams to, including after it migrates.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from gateway.edge.devcert import ensure_dev_certificate
from hedgerow.http_stack import quic_cid
from hedgerow.http_stack.quic_cid import Steering, install_cid_steering, uninstall_cid_steering


@pytest.fixture
def steered() -> Iterator[None]:
    yield
    uninstall_cid_steering()


def test_written_against_the_pinned_aioquic() -> None:
    from hedgerow.http_stack.versions import PINNED

    assert importlib.metadata.version("aioquic") == PINNED["aioquic"]


@pytest.mark.parametrize("count", [2, 3, 7, 16])
def test_first_bytes_cover_every_byte_of_the_process_and_no_other(count: int) -> None:
    for index in range(count):
        steering = Steering(index, count)
        seen = {steering.first_byte() for _ in range(4000)}
        assert seen == {b for b in range(256) if b % count == index}


def _handshake(tmp_path: Path) -> tuple[QuicConnection, QuicConnection]:
    cert = ensure_dev_certificate(tmp_path)
    server_config = QuicConfiguration(is_client=False, alpn_protocols=["h3"])
    server_config.load_cert_chain(cert.cert, cert.key)
    client_config = QuicConfiguration(is_client=True, alpn_protocols=["h3"],
                                      server_name="localhost")
    client_config.load_verify_locations(cafile=str(cert.ca_cert))
    client = QuicConnection(configuration=client_config)
    now = 1.0
    client.connect(("127.0.0.1", 4433), now=now)
    server: QuicConnection | None = None
    for _ in range(20):
        moved = False
        for data, _addr in client.datagrams_to_send(now=now):
            if server is None:
                server = QuicConnection(configuration=server_config,
                                        original_destination_connection_id=data[6:14])
            server.receive_datagram(data, ("127.0.0.1", 5555), now=now)
            moved = True
        assert server is not None
        for data, _addr in server.datagrams_to_send(now=now):
            client.receive_datagram(data, ("127.0.0.1", 4433), now=now)
            moved = True
        now += 0.01
        if not moved:
            break
    assert server is not None and server._handshake_complete and client._handshake_complete
    return client, server


def test_a_handshake_gives_the_client_only_ids_of_this_process(tmp_path: Path,
                                                              steered: None) -> None:
    install_cid_steering(2, 3)
    client, server = _handshake(tmp_path)
    learned = [client._peer_cid.cid] + [c.cid for c in client._peer_cid_available]
    assert len(learned) >= 4  # the initial id and NEW_CONNECTION_ID ones
    assert all(cid[0] % 3 == 2 for cid in learned), [cid.hex() for cid in learned]
    assert {c.cid for c in server._host_cids} >= set(learned)
    # The client's own ids are its business.
    assert client.host_cid == client._host_cids[0].cid


def test_ids_replenished_after_the_client_retires_some_are_steered_too(
        tmp_path: Path, steered: None) -> None:
    install_cid_steering(1, 2)
    client, server = _handshake(tmp_path)
    before = {c.cid for c in server._host_cids}
    for _ in range(3):
        client.change_connection_id()
    now = 2.0
    for _ in range(5):
        for data, _addr in client.datagrams_to_send(now=now):
            server.receive_datagram(data, ("127.0.0.1", 5555), now=now)
        for data, _addr in server.datagrams_to_send(now=now):
            client.receive_datagram(data, ("127.0.0.1", 4433), now=now)
        now += 0.01
    fresh = {c.cid for c in server._host_cids} - before
    assert fresh, "retiring ids made the server issue new ones"
    assert all(cid[0] % 2 == 1 for cid in fresh)


def test_without_steering_ids_are_aiquic_s_own(tmp_path: Path) -> None:
    uninstall_cid_steering()
    firsts = set()
    for _ in range(40):
        _client, server = _handshake(tmp_path)
        firsts.add(server.host_cid[0] % 2)
    assert firsts == {0, 1}


def test_retry_ids_are_steered(steered: None) -> None:
    install_cid_steering(5, 8)
    assert all(quic_cid.new_server_cid(8)[0] % 8 == 5 for _ in range(200))
    assert len(quic_cid.new_server_cid(8)) == 8
