from __future__ import annotations

import pytest

from control_plane.gateways import GatewayAnswer, GatewayBook
from gateway.followers.policy_follower import PolicyEvent, PolicyFollower, RunningPolicy
from policies.loader import parse_policy_document, policy_checksum
from policies.schema import DEFAULT_POLICY_PATH, Policy

GOOD = DEFAULT_POLICY_PATH.read_text()


def follower(applied: list[Policy]) -> PolicyFollower:
    async def apply(policy: Policy) -> None:
        applied.append(policy)

    return PolicyFollower("http://cp", "gw-1", apply, RunningPolicy(0, "none"))


@pytest.mark.anyio
async def test_good_version_is_applied_and_acked() -> None:
    applied: list[Policy] = []
    f = follower(applied)
    checksum = policy_checksum(parse_policy_document(GOOD))
    ack = await f.consider(PolicyEvent(version=3, checksum=checksum, text=GOOD))
    assert ack.accepted and ack.version == 3 and ack.checksum == checksum
    assert len(applied) == 1 and f.running.version == 3


@pytest.mark.anyio
async def test_bad_version_is_nacked_and_the_last_good_stays() -> None:
    applied: list[Policy] = []
    f = follower(applied)
    ack = await f.consider(PolicyEvent(version=4, checksum="x", text="limitz: {}\n"))
    assert not ack.accepted and ack.error and "limitz" in ack.error
    assert applied == [] and f.running.version == 0


@pytest.mark.anyio
async def test_same_checksum_is_acked_without_reapplying() -> None:
    applied: list[Policy] = []
    f = follower(applied)
    checksum = policy_checksum(parse_policy_document(GOOD))
    f.running.checksum = checksum
    ack = await f.consider(PolicyEvent(version=9, checksum=checksum, text=GOOD))
    assert ack.accepted and applied == [] and f.running.version == 9


def test_gateway_book_keeps_running_version_across_a_nack_and_is_bounded() -> None:
    book = GatewayBook(max_gateways=2)
    book.record(GatewayAnswer("a", 1, True, "c1", None, at=0.0))
    book.record(GatewayAnswer("a", 2, False, None, "bad", at=1.0))
    assert book.running("a") == 1
    row = book.rows(now=3.0)[0]
    assert row["running_version"] == 1 and row["last_answer"] == {
        "version": 2, "accepted": False, "error": "bad"}
    book.record(GatewayAnswer("b", 1, True, "c1", None, at=2.0))
    book.record(GatewayAnswer("c", 1, True, "c1", None, at=2.0))
    assert book.running("a") is None and [r["gateway_id"] for r in book.rows(3.0)] == ["b", "c"]
