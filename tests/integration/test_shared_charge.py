"""The shared (Redis) requests/s bucket charged at the door, then skipped at Submit."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.corridor.shared_limits import SharedRequestLimits
from gateway.corridor.tickets import Ticket
from policies.schema import parse_policy
from policies.scoring import RouteRequest
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio

POLICY = parse_policy("""
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants: [{name: a, class: interactive, limits: {requests_per_s: 0.01, requests_burst: 2}}]
""", "test")


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:  # noqa: F811
    client = Redis.from_url(redis_server.url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


def _ticket(charged: bool) -> Ticket:
    ticket = Ticket(request_id="r", tenant="a", model="m", arrival=0.0, deadline=10.0,
                    estimated_tokens=10, route=RouteRequest(prompt_tokens=5), hedgeable=False,
                    policy=POLICY)
    ticket.request_charged = charged
    return ticket


async def test_charged_at_the_door_then_not_again_at_submit(redis: Redis) -> None:
    limits = SharedRequestLimits(redis)
    assert await limits.charge_request("a", POLICY) is None  # a cache hit, say
    assert await limits.charge_request("a", POLICY) is None  # a leader, charged at the door
    assert await limits.check(_ticket(charged=True)) is None  # its Submit: no second charge
    refused = await limits.charge_request("a", POLICY)  # the burst of two is spent
    assert refused is not None and (refused.status, refused.reason) == (429, "requests_rate")
    refused = await limits.check(_ticket(charged=False))
    assert refused is not None and refused.reason == "requests_rate"
    assert await limits.charge_request("nobody", POLICY) is None  # no limits: nothing to charge
    assert limits.counters["fallback"] == 0


TOKEN_POLICY = parse_policy("""
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants: [{name: a, class: interactive, limits: {tokens_per_min: 0.01, tokens_burst: 20}}]
""", "test")


async def test_a_request_without_a_ticket_takes_shared_tokens_and_settles_them(
        redis: Redis) -> None:
    # An embedding: its input tokens come out of the tenant's shared tokens/min
    # at the door, and what it did not use goes back when it settles.
    limits = SharedRequestLimits(redis)
    assert await limits.charge_request("a", TOKEN_POLICY, 12, "r1") is None
    refused = await limits.charge_request("a", TOKEN_POLICY, 12, "r2")  # 8 left of 20
    assert refused is not None and (refused.status, refused.reason) == (429, "tokens_rate")
    await limits.settle_request("r1", "a", TOKEN_POLICY, 0)  # r1 failed: all 12 back
    assert await limits.charge_request("a", TOKEN_POLICY, 12, "r3") is None
    await limits.settle_request("r3", "a", TOKEN_POLICY, 12)  # used as charged: no change
    await limits.settle_request("r3", "a", TOKEN_POLICY, 0)  # settled once only
    refused = await limits.charge_request("a", TOKEN_POLICY, 12, "r4")
    assert refused is not None and refused.reason == "tokens_rate"
    assert limits.counters["fallback"] == 0
