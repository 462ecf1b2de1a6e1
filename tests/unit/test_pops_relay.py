"""The WAN emulation's delay line: delay, jitter without reordering, loss as a late resend."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.pops.relay import DelayLine, LinkShape, RelayConfig


def test_every_chunk_is_delayed_one_way() -> None:
    line = DelayLine(LinkShape(rtt_ms=40), random.Random(1))
    assert line.deliver_at(10.0) == pytest.approx(10.020)
    assert line.deliver_at(10.5) == pytest.approx(10.520)


def test_a_lost_chunk_comes_one_retransmission_timeout_late_and_holds_back_the_rest() -> None:
    line = DelayLine(LinkShape(rtt_ms=40, loss=0.999999), random.Random(1))
    first = line.deliver_at(0.0)
    assert first == pytest.approx(0.020 + 0.200)  # Linux's 200 ms minimum RTO
    clean = DelayLine(LinkShape(rtt_ms=300, loss=0.999999), random.Random(1))
    assert clean.deliver_at(0.0) == pytest.approx(0.150 + 0.600)  # 2 x RTT when longer


def test_nothing_arrives_before_the_handshake_would_have_finished() -> None:
    line = DelayLine(LinkShape(rtt_ms=40), random.Random(1), not_before=0.060)
    assert line.deliver_at(0.0) == pytest.approx(0.060)


@given(st.lists(st.floats(0, 0.05), min_size=1, max_size=50), st.integers(0, 1000))
def test_jitter_never_reorders_a_stream(gaps: list[float], seed: int) -> None:
    line = DelayLine(LinkShape(rtt_ms=40, jitter_ms=30, loss=0.1), random.Random(seed))
    now, delivered = 0.0, []
    for gap in gaps:
        now += gap
        delivered.append(line.deliver_at(now))
        assert delivered[-1] >= now + 0.020 - 0.015  # at least one-way minus half the jitter
    assert delivered == sorted(delivered)


def test_links_are_read_from_the_two_addresses() -> None:
    config = RelayConfig(ports=[1], pops={1: "ams", 2: "fra"},
                         links={("ams", "fra"): LinkShape(40)})
    assert config.link_of("10.77.1.2", "10.77.2.2") == ("ams", "fra")
    assert config.link_of("10.77.2.2", "10.77.1.2") is None  # no shape: refused
    assert config.link_of("127.0.0.1", "10.77.2.2") is None
    assert RelayConfig.from_json(config.to_json()) == config
