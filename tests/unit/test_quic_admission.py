"""The QUIC front door's decisions, sans-IO (``gateway.quic_admission``)."""

from __future__ import annotations

import pytest

from gateway.connection_cap import ConnectionCap
from gateway.quic_admission import (
    QuicFrontDoor,
    QuicLimits,
    RetryTokens,
    Verdict,
    source_key,
)

CLIENT = ("127.0.0.1", 40000)
ODCID = b"\x01" * 8


def _door(**limits: object) -> QuicFrontDoor:
    return QuicFrontDoor(QuicLimits(**limits), ConnectionCap(100))  # type: ignore[arg-type]


def _screen(door: QuicFrontDoor, address: tuple[str, int] = CLIENT, cid: bytes = ODCID,
            token: bytes = b"", now: float = 0.0) -> Verdict:
    return door.screen(address=address, destination_cid=cid, token=token, now=now).verdict


def test_auto_retry_starts_at_the_half_open_threshold_and_stops_below_it() -> None:
    door = _door(retry_above_half_open=2)
    for handle in range(2):
        assert _screen(door) is Verdict.ADMIT
        assert door.open(handle, ("127.0.0.%d" % (handle + 2), 1), 0.0)
    assert _screen(door) is Verdict.RETRY
    door.established(0)
    assert _screen(door) is Verdict.ADMIT
    assert door.stats()["retries_sent"] == 1


def test_retry_always_and_never() -> None:
    assert _screen(_door(retry="always")) is Verdict.RETRY
    door = _door(retry="never", retry_above_half_open=0)
    assert _screen(door) is Verdict.ADMIT


def test_a_token_admits_only_its_address_its_retry_id_and_only_until_it_expires() -> None:
    door = _door(retry="always", token_lifetime_s=10.0)
    retry_cid = b"\x02" * 8
    token = door.retry_token(CLIENT, ODCID, retry_cid, now=100.0)
    admitted = door.screen(address=CLIENT, destination_cid=retry_cid, token=token, now=105.0)
    assert admitted.verdict is Verdict.ADMIT
    assert admitted.original_destination_cid == ODCID
    assert admitted.retry_source_cid == retry_cid
    # Another port, another host, another id, too late, tampered, another process's key.
    assert _screen(door, ("127.0.0.1", 40001), retry_cid, token, 105.0) is Verdict.INVALID_TOKEN
    assert _screen(door, ("127.0.0.2", 40000), retry_cid, token, 105.0) is Verdict.INVALID_TOKEN
    assert _screen(door, CLIENT, b"\x03" * 8, token, 105.0) is Verdict.INVALID_TOKEN
    assert _screen(door, CLIENT, retry_cid, token, 110.5) is Verdict.INVALID_TOKEN
    forged = token[:-1] + bytes([token[-1] ^ 1])
    assert _screen(door, CLIENT, retry_cid, forged, 105.0) is Verdict.INVALID_TOKEN
    other = RetryTokens(10.0).seal(CLIENT, ODCID, retry_cid, 100.0)
    assert _screen(door, CLIENT, retry_cid, other, 105.0) is Verdict.INVALID_TOKEN
    assert door.stats()["refused"]["invalid_token"] == 6


def test_half_open_is_capped_per_source_and_in_all() -> None:
    door = _door(retry="never", max_half_open=5, max_half_open_per_source=2)
    handle = 0
    for host in ("127.0.0.2", "127.0.0.3"):
        for port in (1, 2):
            assert _screen(door, (host, port)) is Verdict.ADMIT
            assert door.open(handle, (host, port), 0.0)
            handle += 1
        assert _screen(door, (host, 3)) is Verdict.DROP  # this source's limit
    assert _screen(door, ("127.0.0.4", 1)) is Verdict.ADMIT
    assert door.open(handle, ("127.0.0.4", 1), 0.0)
    assert _screen(door, ("127.0.0.5", 1)) is Verdict.DROP  # the total
    door.closed(0, timed_out=True)
    assert _screen(door, ("127.0.0.2", 9)) is Verdict.ADMIT
    stats = door.stats()
    assert stats["refused"] == {"per_source": 2, "half_open": 1}
    assert stats["half_open"] == 4 and stats["handshake_timeouts"] == 1


def test_established_connections_leave_the_half_open_count_but_keep_their_slot() -> None:
    cap = ConnectionCap(2)
    door = QuicFrontDoor(QuicLimits(retry="never", max_half_open_per_source=1), cap)
    assert door.open(1, CLIENT, 0.0)
    door.established(1)
    assert door.half_open == 0 and cap.open == 1
    assert _screen(door) is Verdict.ADMIT  # per-source counts half-open ones only
    assert door.open(2, CLIENT, 0.0)
    assert _screen(door) is Verdict.DROP  # the shared cap is full
    door.closed(1)
    door.closed(2)
    door.closed(2)  # twice: no effect
    assert cap.open == 0


def test_ipv6_sources_are_grouped_by_64() -> None:
    assert source_key(("2001:db8::1", 1)) == source_key(("2001:db8::ffff:1", 2))
    assert source_key(("2001:db8:0:1::1", 1)) != source_key(("2001:db8::1", 1))
    assert source_key(("::ffff:10.0.0.1", 1)) == "10.0.0.1"


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        QuicLimits(retry="sometimes")
    with pytest.raises(ValueError):
        QuicLimits(max_half_open=0)
    with pytest.raises(ValueError):
        QuicLimits(handshake_timeout_s=0)
