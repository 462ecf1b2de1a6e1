"""The QUIC front door's decisions, sans-IO (``gateway.edge.quic_admission``)."""

from __future__ import annotations

import pytest

from hedgerow.connection_cap import ConnectionCap
from hedgerow.source_limits import SourceLimits, SourceLimitsConfig
from gateway.edge.quic_admission import (
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
    door.closed(0, 0.0, timed_out=True)
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
    door.closed(1, 0.0)
    door.closed(2, 0.0)
    door.closed(2, 0.0)  # twice: no effect
    assert cap.open == 0


def _limited_door(**config: object) -> tuple[QuicFrontDoor, SourceLimits]:
    sources = SourceLimits(SourceLimitsConfig(exempt=(), **config))  # type: ignore[arg-type]
    door = QuicFrontDoor(QuicLimits(retry="never"), ConnectionCap(100, sources))
    return door, sources


def test_quic_connections_count_against_the_tcp_per_client_limits() -> None:
    door, sources = _limited_door(max_open_per_ip=3, rate_per_ip=0, rate_per_prefix=0)
    client = ("192.0.2.7", 5000)
    assert sources.admit(client[0], 0.0) is None  # one TCP connection already open
    for handle in (1, 2):
        assert _screen(door, (client[0], 5000 + handle)) is Verdict.ADMIT
        assert door.open(handle, (client[0], 5000 + handle), 0.0)
    # The limit is 3 in all, TCP and QUIC: a third QUIC connection is dropped.
    assert _screen(door, (client[0], 6000)) is Verdict.DROP
    assert sources.admit(client[0], 0.0) == "ip_open"  # and TCP is refused too
    assert _screen(door, ("192.0.2.8", 1)) is Verdict.ADMIT  # another IP is not affected
    door.established(1)
    door.closed(1, 1.0)  # an established one closes: its slot is back
    assert _screen(door, (client[0], 6001)) is Verdict.ADMIT
    assert door.stats()["refused"]["per_client"] == 1
    assert sources.refused["ip_open"] == 2  # the QUIC drop and the TCP refusal
    door.closed(2, 1.0)
    sources.release(client[0], 1.0)
    assert sources.stats()["open_sources"] == 0


def test_new_quic_connections_spend_the_same_rate_bucket_as_tcp() -> None:
    door, sources = _limited_door(rate_per_ip=2, rate_per_prefix=0)  # burst: 4
    host = "198.51.100.1"
    for _ in range(2):
        assert sources.admit(host, 0.0) is None  # TCP
    for handle in (1, 2):
        assert door.open(handle, (host, handle), 0.0)  # QUIC
    assert _screen(door, (host, 9)) is Verdict.DROP
    assert not door.open(9, (host, 9), 0.0)  # ``open`` decides again, for a race
    assert sources.refused["ip_rate"] == 2
    assert _screen(door, (host, 9), now=0.5) is Verdict.ADMIT  # 0.5 s at 2/s: one more


def test_screening_takes_nothing_and_a_dropped_open_gives_everything_back() -> None:
    sources = SourceLimits(SourceLimitsConfig(exempt=(), max_open_per_ip=1))
    cap = ConnectionCap(1, sources)
    door = QuicFrontDoor(QuicLimits(retry="never"), cap)
    for _ in range(10):  # screened many times (each datagram), opened never
        assert _screen(door, ("203.0.113.5", 1)) is Verdict.ADMIT
    assert cap.try_open()  # TCP took the cap's last slot meanwhile
    assert not door.open(1, ("203.0.113.5", 1), 0.0)
    assert door.stats()["refused"]["connection_cap"] == 1
    assert sources.stats()["open_sources"] == 0  # the client's slots were given back
    cap.close()
    assert door.open(1, ("203.0.113.5", 1), 0.0)


def test_exempt_and_unlimited_quic_clients_hold_no_per_client_slots() -> None:
    sources = SourceLimits(SourceLimitsConfig(max_open_per_ip=1))  # loopback exempt
    door = QuicFrontDoor(QuicLimits(retry="never"), ConnectionCap(100, sources))
    for handle in range(5):
        assert door.open(handle, ("127.0.0.1", handle), 0.0)
    assert sources.stats()["open_sources"] == 0
    for handle in range(5):
        door.closed(handle, 0.0)  # nothing to release, nothing raised
    no_limits = QuicFrontDoor(QuicLimits(retry="never"), ConnectionCap(100))
    assert no_limits.open(1, ("192.0.2.1", 1), 0.0)
    no_limits.closed(1, 0.0)


def test_a_retried_client_is_counted_only_once_it_returns_with_its_token() -> None:
    sources = SourceLimits(SourceLimitsConfig(exempt=(), rate_per_ip=1))  # burst: 2
    door = QuicFrontDoor(QuicLimits(retry="always"), ConnectionCap(100, sources))
    victim = ("192.0.2.50", 443)
    for _ in range(100):  # Initials claiming the victim's address: Retried, uncounted
        assert _screen(door, victim) is Verdict.RETRY
    assert sources.check(victim[0], 0.0) is None
    retry_cid = b"\x05" * 8
    token = door.retry_token(victim, ODCID, retry_cid, now=0.0)
    assert _screen(door, victim, retry_cid, token) is Verdict.ADMIT


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
