"""Virtual keys: recognised by HMAC, expiry, allowlist, per-key rates, budgets at
the gateway's door, and the keys block that policy edits and rollbacks keep."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import anyio
import pytest

from control_plane.policy_store import PolicyStore
from gateway.corridor import key_gate
from gateway.corridor.key_gate import KeyGate, LocalBudgets
from gateway.admin.usage_metrics import Usage
from hedgerow.errors import (AuthenticationFailed, BudgetExceeded, PermissionDenied,
                             PolicyUnavailable, RateLimited)
from policies.keys import (KEY_PREFIX, Keyring, carry_keys, key_digest, new_key,
                           split_keys_block, with_keys)
from policies.budget import BudgetLine, Spend
from policies.loader import parse_policy_document
from policies.schema import Budget, KeyLimits, Policy, VirtualKey
from policies.tenancy import Identity, identify

SECRET = bytes(range(32))
LEGACY = "sk-legacy-1"
LEGACY_DIGEST = hashlib.sha256(LEGACY.encode()).hexdigest()
BASE = f"""# the operator's own comment stays
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - {{name: acme, class: interactive, api_key_sha256: ["{LEGACY_DIGEST}"]}}
models:
  - {{name: big, price_per_million_tokens: {{input: 1000, output: 2000}}}}
  - {{name: small}}
"""
NOW = 1_800_000_000.0


def make_key(key_text: str, **fields: object) -> VirtualKey:
    values: dict[str, object] = {"id": "key_00000000000000aa", "tenant": "acme",
                                 "hmac_sha256": key_digest(SECRET, key_text),
                                 "created_at": NOW - 10}
    values.update(fields)
    return VirtualKey.model_validate(values)


def policy_with(*keys: VirtualKey) -> Policy:
    return parse_policy_document(with_keys(BASE, keys), "test")


def test_new_keys_are_long_random_and_prefixed() -> None:
    first, second = new_key(), new_key()
    assert first.startswith(KEY_PREFIX) and len(first) == len(KEY_PREFIX) + 43
    assert first != second


def test_a_virtual_key_identifies_its_tenant_and_the_legacy_digest_still_works() -> None:
    text = new_key()
    policy = policy_with(make_key(text, name="ci"))
    keyring = Keyring.of(policy, SECRET)
    found = identify(policy, f"Bearer {text}", keyring, NOW)
    assert (found.tenant, found.key and found.key.name) == ("acme", "ci")
    legacy = identify(policy, f"Bearer {LEGACY}", keyring, NOW)
    assert legacy.tenant == "acme" and legacy.key is None
    with pytest.raises(AuthenticationFailed):
        identify(policy, f"Bearer {new_key()}", keyring, NOW)
    # The same key under another secret (or a bare sha256) is not that key.
    with pytest.raises(AuthenticationFailed):
        identify(policy, f"Bearer {text}", Keyring.of(policy, b"x" * 32), NOW)


def test_an_expired_key_is_refused_and_one_without_the_secret_gets_a_retry() -> None:
    text = new_key()
    policy = policy_with(make_key(text, expires_at=NOW))
    with pytest.raises(AuthenticationFailed) as expired:
        identify(policy, f"Bearer {text}", Keyring.of(policy, SECRET), NOW)
    assert expired.value.code == "expired_api_key"
    assert identify(policy, f"Bearer {text}", Keyring.of(policy, SECRET), NOW - 1).key
    with pytest.raises(PolicyUnavailable):
        identify(policy, f"Bearer {text}", None, NOW)


def test_the_policy_text_never_holds_the_key() -> None:
    text = new_key()
    rendered = with_keys(BASE, [make_key(text)])
    assert text not in rendered and text[len(KEY_PREFIX):] not in rendered
    assert rendered.startswith(BASE)  # the operator's part, comments included, untouched


def test_applying_a_document_without_keys_keeps_them_and_rollback_never_revives_one() -> None:
    store = PolicyStore(parse_policy_document(BASE, "v1"), BASE, now=0)
    first, second = make_key(new_key()), make_key(new_key(), id="key_00000000000000bb")
    store.apply(with_keys(store.current.text, [first, second]), "key create", 1)
    store.apply(with_keys(store.current.text, [second]), "key revoke", 2)  # v3
    edited = BASE.replace("ttft_slo_ms: 1000", "ttft_slo_ms: 900")
    v4 = store.apply(edited, "operator.yaml", 3)
    assert [k.id for k in v4.policy.keys] == [second.id]
    v5 = store.rollback(2, 4)  # v2 had both keys and the old SLO
    assert [k.id for k in v5.policy.keys] == [second.id]
    assert v5.policy.classes[0].ttft_slo_ms == 1000
    assert split_keys_block(carry_keys(BASE, v5.text))[1] == split_keys_block(v5.text)[1]


def test_unknown_tenant_and_duplicate_ids_are_policy_errors() -> None:
    from policies.schema import PolicyError

    with pytest.raises(PolicyError, match="unknown tenant"):
        policy_with(make_key(new_key(), tenant="nobody"))
    with pytest.raises(PolicyError, match="duplicate key id"):
        policy_with(make_key(new_key()), make_key(new_key()))


def gate_for(policy: Policy) -> KeyGate:
    return KeyGate(clock=lambda: NOW, secret=SECRET)


def test_the_gate_refuses_a_model_outside_the_allowlist() -> None:
    text = new_key()
    policy = policy_with(make_key(text, models=("small",)))
    gate = gate_for(policy)
    identity = gate.identify(policy, f"Bearer {text}")

    async def main() -> None:
        await gate.admit("r1", identity, policy, "small", 10, 10)
        with pytest.raises(PermissionDenied) as refused:
            await gate.admit("r2", identity, policy, "big", 10, 10)
        assert refused.value.status == 403 and refused.value.code == "model_not_allowed"

    anyio.run(main)


def test_per_key_rate_and_cost_budget_reserve_then_settle() -> None:
    text = new_key()
    key = make_key(text, limits=KeyLimits(requests_per_s=1),
                   budgets=(Budget(period="month", cost=1.0),))
    policy = policy_with(key)
    gate = gate_for(policy)
    identity = gate.identify(policy, f"Bearer {text}")

    async def main() -> None:
        # big: 1000/M input, 2000/M output → 100 + 200 tokens reserve 0.1 + 0.4 = 0.5.
        await gate.admit("r1", identity, policy, "big", 100, 200)
        with pytest.raises(RateLimited) as limited:
            await gate.admit("r2", identity, policy, "big", 100, 200)
        assert limited.value.code == "requests_rate"
        await gate.settle("r1", Usage(100, 50))  # cost 0.1 + 0.1 = 0.2

    anyio.run(main)
    gate.clock = lambda: NOW + 10  # the request bucket has refilled

    async def later() -> None:
        await gate.admit("r3", identity, policy, "big", 100, 200)  # 0.2 + 0.5 ≤ 1
        await gate.settle("r3", Usage(100, 200))  # 0.7 used
        gate.clock = lambda: NOW + 20
        with pytest.raises(BudgetExceeded) as spent:
            await gate.admit("r4", identity, policy, "big", 100, 200)
        assert "per month" in spent.value.message

    anyio.run(later)


class _SlowStores:
    """A key's shared tokens bucket and the budgets, each taking ``delay_s`` to settle
    (a Redis round trip), the shared one raising ``fail`` if set; settles are recorded."""

    def __init__(self, delay_s: float, fail: Exception | None = None) -> None:
        self.delay_s, self.fail = delay_s, fail
        self.local = LocalBudgets()
        self.settled: list[str] = []

    async def take_key(self, key_id: str, requests_per_s: float | None,
                       tokens_per_min: float | None, tokens: float) -> tuple[str, float] | None:
        return None

    async def settle_key(self, key_id: str, tokens_per_min: float, change: float) -> None:
        await anyio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        self.settled.append("key tokens")

    async def reserve(self, lines: tuple[BudgetLine, ...], asked: Spend,
                      now: float) -> BudgetExceeded | None:
        return await self.local.reserve(lines, asked, now)

    async def settle(self, lines: tuple[BudgetLine, ...], reserved: Spend, actual: Spend,
                     now: float) -> None:
        await anyio.sleep(self.delay_s)
        await self.local.settle(lines, reserved, actual, now)
        self.settled.append("budgets")


def _gate_with(stores: _SlowStores) -> tuple[KeyGate, Policy, Identity]:
    text = new_key()
    # big: 100 + 400 tokens reserve 0.1 + 0.8 = 0.9 of the 1.0 budget: a second
    # request fits only once the first one's reservation is settled.
    policy = policy_with(make_key(text, limits=KeyLimits(tokens_per_min=100_000),
                                  budgets=(Budget(period="month", cost=1.0),)))
    gate = KeyGate(budgets=stores, clock=lambda: NOW, secret=SECRET, shared_rates=stores)
    return gate, policy, gate.identify(policy, f"Bearer {text}")


def test_a_request_cancelled_while_settling_is_still_settled() -> None:
    stores = _SlowStores(delay_s=0.05)
    gate, policy, identity = _gate_with(stores)

    async def main() -> None:
        await gate.admit("r1", identity, policy, "big", 100, 400)
        with pytest.raises(BudgetExceeded):
            await gate.admit("r2", identity, policy, "big", 100, 400)
        stores.settled.clear()  # r2's refusal gave its key tokens back
        with anyio.CancelScope() as request:  # the request's own scope
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(gate.settle, "r1", None)  # no token was computed
                await anyio.sleep(0.01)  # in its first Redis round trip
                request.cancel()  # the client left, or the drain cut it
        assert stores.settled == ["key tokens", "budgets"]
        await gate.admit("r3", identity, policy, "big", 100, 400)  # the 0.9 came back

    anyio.run(main)


def test_a_failing_shared_bucket_still_lets_the_budgets_settle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stores = _SlowStores(delay_s=0, fail=RuntimeError("injected: a bug in the Redis client"))
    gate, policy, identity = _gate_with(stores)

    async def main() -> None:
        await gate.admit("r1", identity, policy, "big", 100, 400)
        await gate.settle("r1", None)  # logged, not raised: it runs in a request's finally
        assert stores.settled == ["budgets"]
        assert "request r1: settling its budgets failed" in caplog.text
        assert "injected: a bug in the Redis client" in caplog.text
        await gate.admit("r2", identity, policy, "big", 100, 400)

    anyio.run(main)


def test_a_stalled_store_cannot_hold_a_request_past_the_settle_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(key_gate, "SETTLE_TIMEOUT_S", 0.2)
    stores = _SlowStores(delay_s=5.0)  # each a stalled round trip, with no timeout of its own
    gate, policy, identity = _gate_with(stores)

    async def main() -> float:
        await gate.admit("r1", identity, policy, "big", 100, 400)
        started = anyio.current_time()
        await gate.settle("r1", None)
        return anyio.current_time() - started

    assert anyio.run(main) < 1.0
    assert "request r1: settling its budgets took over 0.2s" in caplog.text


class _StoreRef:
    """The policy actor's ref, answering ApplyPolicy from a PolicyStore."""

    def __init__(self, store: PolicyStore) -> None:
        self.store = store

    async def ask(self, message: object, *, timeout: float = 5.0) -> object:
        from control_plane.policy_actor import ApplyPolicy

        assert isinstance(message, ApplyPolicy)
        return self.store.apply(message.text, message.source, 0)


def test_keys_survive_a_control_plane_restart_without_redis(tmp_path: Path) -> None:
    from control_plane.key_file import restore_keys, save_keys
    from hedgerow.latest import LatestValue

    path = tmp_path / "keys.yaml"
    key = make_key(new_key())
    before = PolicyStore(parse_policy_document(BASE, "v1"), BASE)
    published = LatestValue(before.current, 1)

    async def run_and_save() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(save_keys, published, path)
            created = before.apply(with_keys(BASE, [key]), "key create", 1)
            published.publish(created, created.version)
            with anyio.fail_after(5):
                while not path.exists():
                    await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()

    anyio.run(run_and_save)
    assert key.hmac_sha256 in path.read_text()
    # The restarted control plane starts from the policy file alone, then restores.
    after = PolicyStore(parse_policy_document(BASE, "v1"), BASE)
    ref: Any = _StoreRef(after)  # stands in for the policy actor's ActorRef
    anyio.run(restore_keys, ref, LatestValue(after.current, 1), path)
    assert [k.id for k in after.current.policy.keys] == [key.id]
