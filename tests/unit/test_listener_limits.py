"""The control plane's listener limits: flags to limits, and what they admit."""

from __future__ import annotations

import pytest

from hedgerow.cli import build_parser
from hedgerow.cli_flags import listener_limits
from hedgerow.listener_limits import INTERNAL, JOIN, ListenerLimits


def parse(*argv: str) -> tuple[ListenerLimits, ListenerLimits]:
    args = build_parser({}).parse_args(["control-plane", *argv])
    return listener_limits(args, ("127.0.0.1/32",))


def test_defaults_are_a_small_join_listener_and_a_fleet_sized_internal_one() -> None:
    internal, join = parse()
    assert (internal.max_connections, internal.max_per_ip) == (INTERNAL.max_connections,
                                                               INTERNAL.max_per_ip)
    assert (join.max_connections, join.max_per_ip, join.new_per_ip) == (64, 8, 5.0)
    assert join.max_connections < internal.max_connections
    assert internal.exempt == join.exempt == ("127.0.0.1/32",)


def test_each_listener_takes_its_own_flags_and_environment() -> None:
    env = {"HEDGEROW_CONTROL_PLANE_JOIN_MAX_CONNECTIONS_PER_IP": "3"}
    args = build_parser(env).parse_args(["control-plane", "--join-max-connections", "10",
                                         "--max-connections-per-ip", "100",
                                         "--join-handshake-timeout-s", "2"])
    internal, join = listener_limits(args, ())
    assert (join.max_connections, join.max_per_ip, join.handshake_timeout_s) == (10, 3, 2.0)
    assert (internal.max_connections, internal.max_per_ip) == (INTERNAL.max_connections, 100)
    assert internal.handshake_timeout_s == INTERNAL.handshake_timeout_s


@pytest.mark.parametrize("flag, value", [("--join-max-connections", "0"),
                                         ("--max-connections-per-ip", "-1"),
                                         ("--join-new-connections-per-ip", "inf"),
                                         ("--handshake-timeout-s", "0"),
                                         ("--join-handshake-timeout-s", "nan")])
def test_a_bad_value_is_refused(flag: str, value: str) -> None:
    with pytest.raises(ValueError):
        parse(flag, value)


def test_a_bad_exempt_network_is_refused() -> None:
    with pytest.raises(ValueError):
        ListenerLimits(8, 2, 1.0, 5.0, exempt=("not-a-network",))


def test_one_ip_is_held_to_its_share_and_others_still_get_in() -> None:
    cap = ListenerLimits(max_connections=4, max_per_ip=2, new_per_ip=0.0,
                         handshake_timeout_s=5.0, exempt=()).cap("join-")
    assert cap.sources is not None
    assert cap.sources.admit("10.0.0.7", 0.0) is None
    assert cap.sources.admit("10.0.0.7", 0.0) is None
    assert cap.sources.admit("10.0.0.7", 0.0) == "ip_open"
    # No per-prefix limit: a fleet's hosts share one /24.
    for host in range(8, 20):
        assert cap.sources.admit(f"10.0.0.{host}", 0.0) is None
    cap.sources.release("10.0.0.7", 1.0)
    assert cap.sources.admit("10.0.0.7", 1.0) is None


def test_one_ip_opening_too_fast_is_refused_past_its_burst() -> None:
    cap = JOIN.cap("join-")
    assert cap.sources is not None
    admitted = 0
    for _ in range(50):
        if cap.sources.admit("192.0.2.1", 0.0) is None:
            admitted += 1
            cap.sources.release("192.0.2.1", 0.0)
    assert admitted == int(JOIN.new_per_ip * 2)  # the burst: 2 s worth
    assert cap.sources.refused["ip_rate"] == 50 - admitted
    assert cap.sources.exempt("127.0.0.1")  # loopback exempt by default
