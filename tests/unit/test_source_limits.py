"""Per-client connection limits at accept (``gateway.source_limits``), in virtual time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.source_limits import SourceLimits, SourceLimitsConfig, source_keys

OFF = dict(max_open_per_ip=0, max_open_per_prefix=0, rate_per_ip=0.0, rate_per_prefix=0.0)


def limits(**overrides: float) -> SourceLimits:
    return SourceLimits(SourceLimitsConfig(**{**OFF, **overrides}))  # type: ignore[arg-type]


def test_keys_are_the_ip_and_its_24_or_64() -> None:
    assert source_keys("192.0.2.7") == (("ip", "192.0.2.7"), ("net", "192.0.2.0/24"))
    assert source_keys("::ffff:192.0.2.7") == (("ip", "192.0.2.7"), ("net", "192.0.2.0/24"))
    assert source_keys("2001:db8:1:2:3:4:5:6") == (
        ("ip", "2001:db8:1:2:3:4:5:6"), ("net", "2001:db8:1:2::/64"))
    assert source_keys("fe80::1%eth0")[0] == ("ip", "fe80::1")
    assert source_keys("not an ip") == (("ip", "not an ip"), ("net", "not an ip"))


def test_open_per_ip_refuses_the_next_and_frees_on_close() -> None:
    table = limits(max_open_per_ip=2)
    assert table.admit("10.0.0.1", 0.0) is None
    assert table.admit("10.0.0.1", 0.0) is None
    assert table.admit("10.0.0.1", 0.0) == "ip_open"
    assert table.admit("10.0.0.2", 0.0) is None  # another IP, same /24: its own count
    table.release("10.0.0.1", 1.0)
    assert table.admit("10.0.0.1", 1.0) is None
    assert table.refused["ip_open"] == 1


def test_open_per_prefix_counts_every_ip_in_it() -> None:
    table = limits(max_open_per_ip=10, max_open_per_prefix=3)
    for host in (1, 2, 3):
        assert table.admit(f"10.0.0.{host}", 0.0) is None
    assert table.admit("10.0.0.4", 0.0) == "prefix_open"
    assert table.admit("10.0.1.4", 0.0) is None  # the next /24
    assert table.admit("2001:db8::1", 0.0) is None
    assert table.admit("2001:db8::2", 0.0) is None
    assert table.admit("2001:db8::ffff", 0.0) is None
    assert table.admit("2001:db8::abcd", 0.0) == "prefix_open"  # same /64
    assert table.admit("2001:db8:0:1::1", 0.0) is None


def test_rate_per_ip_allows_a_burst_then_the_rate() -> None:
    table = limits(rate_per_ip=5.0)  # burst: 2 s worth = 10
    admitted = [table.admit("10.0.0.1", 0.0) is None for _ in range(15)]
    assert admitted == [True] * 10 + [False] * 5
    assert table.refused["ip_rate"] == 5
    for i in range(10):  # each one still closed: only the rate matters here
        table.release("10.0.0.1", 0.0)
    assert table.admit("10.0.0.1", 0.1) == "ip_rate"  # half a token
    assert table.admit("10.0.0.1", 0.2) is None
    assert table.admit("10.0.0.9", 0.2) is None  # another IP has its own bucket


def test_a_refused_connection_takes_no_token_from_the_other_bucket() -> None:
    table = limits(rate_per_ip=1.0, rate_per_prefix=100.0)  # ip burst 2
    for _ in range(20):
        table.admit("10.0.0.1", 0.0)
    # Only the two admitted took prefix tokens: 198 of 200 remain for the neighbours.
    assert sum(table.admit("10.0.0.2", 0.0) is None for _ in range(300)) == 2
    assert sum(table.admit(f"10.0.0.{h}", 0.0) is None for h in range(3, 250)) == 196


def test_release_of_an_unknown_source_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        limits(max_open_per_ip=1).release("10.0.0.1", 0.0)


def test_idle_table_is_bounded_and_forgets_the_least_recent() -> None:
    table = SourceLimits(SourceLimitsConfig(max_open_per_ip=0, max_open_per_prefix=0,
                                            rate_per_ip=1.0, rate_per_prefix=0.0,
                                            max_idle_sources=100))
    for n in range(1000):  # each drains its bucket a little and closes
        address = f"10.{n // 256}.{n % 256}.1"
        assert table.admit(address, 0.0) is None
        table.release(address, 0.0)
    stats = table.stats()
    assert stats["open_sources"] == 0
    assert stats["idle_sources"] == 100
    assert stats["forgotten"] == 900 * 1  # prefix buckets are off: nothing kept for them


def test_a_refilled_source_is_forgotten_at_once() -> None:
    table = limits(rate_per_ip=10.0, rate_per_prefix=10.0)
    assert table.admit("10.0.0.1", 0.0) is None
    table.release("10.0.0.1", 0.0)
    assert table.stats()["idle_sources"] == 2  # both buckets still refilling: remembered
    assert table.admit("10.0.0.1", 0.05) is None
    table.release("10.0.0.1", 5.0)  # a long connection: both buckets full again by its end
    assert table.stats() == {"open_sources": 0, "idle_sources": 0, "forgotten": 0,
                             "refused": {"ip_open": 0, "prefix_open": 0, "ip_rate": 0,
                                         "prefix_rate": 0}}


@pytest.mark.parametrize("bad", [dict(max_open_per_ip=-1), dict(rate_per_ip=float("nan")),
                                 dict(rate_per_prefix=float("inf")), dict(max_idle_sources=0)])
def test_bad_config_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SourceLimitsConfig(**bad)  # type: ignore[arg-type]


ADDRESSES = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.1.1", "2001:db8::1",
                             "2001:db8::2", "::ffff:10.0.0.1"])


@settings(max_examples=300, deadline=None)
@given(
    max_ip=st.integers(0, 4), max_net=st.integers(0, 6),
    rate_ip=st.sampled_from([0.0, 0.5, 3.0]), rate_net=st.sampled_from([0.0, 1.0, 10.0]),
    steps=st.lists(st.tuples(st.booleans(), ADDRESSES, st.floats(0, 3)), max_size=80),
)
def test_open_counts_never_exceed_the_limits_and_the_table_stays_bounded(
        max_ip: int, max_net: int, rate_ip: float, rate_net: float,
        steps: list[tuple[bool, str, float]]) -> None:
    table = SourceLimits(SourceLimitsConfig(max_ip, max_net, rate_ip, rate_net,
                                            max_idle_sources=3))
    now = 0.0
    held: list[str] = []
    admitted_at: dict[str, list[float]] = {}
    for opening, address, step in steps:
        now += step
        if opening or not held:
            if table.admit(address, now) is None:
                held.append(address)
                admitted_at.setdefault(source_keys(address)[0][1], []).append(now)
        else:
            table.release(held.pop(0), now)
        per_ip: dict[str, int] = {}
        per_net: dict[str, int] = {}
        for a in held:
            ip, net = source_keys(a)
            per_ip[ip[1]] = per_ip.get(ip[1], 0) + 1
            per_net[net[1]] = per_net.get(net[1], 0) + 1
        if max_ip:
            assert max(per_ip.values(), default=0) <= max_ip
        if max_net:
            assert max(per_net.values(), default=0) <= max_net
        stats = table.stats()
        assert stats["open_sources"] == len(per_ip) + len(per_net)
        assert stats["idle_sources"] <= 3
    if rate_ip:  # a bucket never grants more than its burst plus what it refilled
        for times in admitted_at.values():
            assert len(times) <= max(1.0, rate_ip * 2) + rate_ip * (times[-1] - times[0]) + 1e-6 \
                or stats["forgotten"] > 0


def test_exempt_networks_are_neither_limited_nor_tracked() -> None:
    table = SourceLimits(SourceLimitsConfig(max_open_per_ip=1, rate_per_ip=1.0))
    assert table.exempt("127.0.0.1") and table.exempt("127.9.9.9") and table.exempt("::1")
    assert table.exempt("::ffff:127.0.0.1")  # IPv4-mapped loopback too
    assert not table.exempt("10.0.0.1") and not table.exempt("not an ip")
    nothing = SourceLimits(SourceLimitsConfig(exempt=()))
    assert not nothing.exempt("127.0.0.1")
    with pytest.raises(ValueError):
        SourceLimitsConfig(exempt=("not a network",))


def test_check_says_what_admit_would_and_takes_nothing() -> None:
    limits = SourceLimits(SourceLimitsConfig(exempt=(), max_open_per_ip=2, rate_per_ip=1))
    assert limits.check("192.0.2.1", 0.0) is None  # never seen
    for _ in range(2):
        assert limits.check("192.0.2.1", 0.0) is None
        assert limits.admit("192.0.2.1", 0.0) is None
    assert limits.stats()["open_sources"] == 2  # the IP and its /24
    assert limits.check("192.0.2.1", 0.0) == "ip_open"
    assert limits.admit("192.0.2.1", 0.0) == "ip_open"
    assert limits.refused["ip_open"] == 2  # each refusal counted
    limits.release("192.0.2.1", 0.0)
    assert limits.check("192.0.2.1", 0.0) == "ip_rate"  # room again, but the burst (2) is spent
    assert limits.check("192.0.2.1", 1.0) is None  # refilled at 1/s
    limits.release("192.0.2.1", 1.0)
    assert limits.stats()["open_sources"] == 0
