"""Budgets in a real redis-server, as two gateways would hold them (two
``SharedBudgets`` on one Redis): all-or-nothing reservations, settling, the
refusal of the other gateway, and the fall back to a gateway's own ledger
when Redis is gone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from redis.asyncio import Redis

from gateway.corridor.shared_budgets import SharedBudgets
from policies.budget import Spend, budget_lines
from policies.schema import Budget, Policy, PriorityClass, Tenant, VirtualKey
from tests.support.redis_server import RedisServer, redis_server
from tests.support.stack import free_port

__all__ = ["redis_server"]

pytestmark = pytest.mark.anyio

# Tomorrow, 10:00 UTC: Redis expires a counter after its window ends (EXPIREAT), so
# a fixed date would run these tests against counters Redis deletes at once.
TOMORROW = datetime.now(UTC).replace(hour=10, minute=0, second=0, microsecond=0) + timedelta(days=1)
NOW = TOMORROW.timestamp()
DAY, MONTH = TOMORROW.strftime("%Y-%m-%d"), TOMORROW.strftime("%Y-%m")
KEY = VirtualKey(id="key_00000000000000aa", tenant="acme", hmac_sha256="a" * 64,
                 created_at=0.0, budgets=(Budget(period="day", tokens=100),))
POLICY = Policy(classes=(PriorityClass(name="interactive", ttft_slo_ms=1000, deadline_ms=1000),),
                tenants=(Tenant(name="acme", budgets=(Budget(period="month", cost=1.0),)),),
                keys=(KEY,))
LINES = budget_lines(POLICY, "acme", KEY, NOW)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_budget_spent_on_one_gateway_is_refused_on_the_other(redis: Redis) -> None:
    first, second = SharedBudgets(redis), SharedBudgets(redis)
    assert await first.reserve(LINES, Spend(80, 0.1), NOW) is None
    refused = await second.reserve(LINES, Spend(30, 0.1), NOW)
    assert refused is not None and refused.code == "budget_exceeded"
    assert "key key_00000000000000aa may use 100 tokens per day" in refused.message
    # Nothing was reserved by the refusal, on either budget.
    assert float(await redis.get(f"hedgerow:budget:key:key_00000000000000aa:day:tokens:{DAY}")
                 ) == 80
    await first.settle(LINES, Spend(80, 0.1), Spend(20, 0.05), NOW)  # used less
    assert await second.reserve(LINES, Spend(30, 0.1), NOW) is None
    cost = await redis.get(f"hedgerow:budget:tenant:acme:month:cost:{MONTH}")
    assert float(cost) == pytest.approx(0.15)
    assert await redis.ttl(f"hedgerow:budget:tenant:acme:month:cost:{MONTH}") > 0


async def test_without_redis_a_gateway_holds_budgets_on_its_own() -> None:
    client = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0",  # nothing listens
                            socket_timeout=0.2, socket_connect_timeout=0.2)
    try:
        alone = SharedBudgets(client)
        assert await alone.reserve(LINES, Spend(80, 0), NOW) is None  # its own ledger
        assert await alone.reserve(LINES, Spend(30, 0), NOW) is not None
    finally:
        await client.aclose()
