"""Virtual keys and budgets at the gateway's door.

The request path calls it at three points: ``identify`` (the one place a
request's identity is resolved: legacy digests, then virtual keys with their
expiry), ``admit`` once the model is known (the key's model allowlist, its own
requests/s and tokens/min, then every tenant and key budget reserved) and
``settle`` when the request has ended (budgets and the key's tokens bucket
corrected with the usage the worker reported). The decisions are sans-IO in
``policies.keys``, ``policies.tenancy`` and ``policies.budget``; this module
holds the state: the key secret (``gateway.followers.key_secret`` fetches it), the
keyring of the policy in force, the per-key buckets and the open reservations.

Per-key rates are this gateway's own token buckets (like a tenant's local
buckets) and, with ``--redis``, the same buckets in Redis for all gateways
(``shared_rates``: ``gateway.corridor.shared_limits``, checked first). Budgets go
through ``budgets``: this gateway's ``LocalBudgets`` or, with ``--redis``,
``gateway.corridor.shared_budgets`` for all gateways.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from gateway.admin.usage_metrics import Price, Usage, policy_prices
from hedgerow.errors import BudgetExceeded, RateLimited
from policies.budget import BudgetLedger, BudgetLine, Spend, budget_lines
from policies.keys import Keyring, check_model_allowed
from policies.schema import Policy, VirtualKey
from policies.tenancy import Identity, identify
from policies.token_bucket import TokenBucket

log = logging.getLogger("hedgerow.gateway.keys")

# Open reservations kept at once (a request holds one from admission to its end).
MAX_OPEN = 65_536
# Per-key bucket pairs kept; the least recently used beyond it start full again.
MAX_KEY_BUCKETS = 16_384
# How long settling one request may take: each Redis call is bounded on its own
# (``REDIS_TIMEOUT_S``), this bounds them all, whatever the budget store.
SETTLE_TIMEOUT_S = 2.0


class Budgets(Protocol):
    async def reserve(self, lines: tuple[BudgetLine, ...], asked: Spend,
                      now: float) -> BudgetExceeded | None: ...

    async def settle(self, lines: tuple[BudgetLine, ...], reserved: Spend, actual: Spend,
                     now: float) -> None: ...


class SharedKeyRates(Protocol):
    async def take_key(self, key_id: str, requests_per_s: float | None,
                       tokens_per_min: float | None, tokens: float
                       ) -> tuple[str, float] | None: ...

    async def settle_key(self, key_id: str, tokens_per_min: float, change: float) -> None: ...


class LocalBudgets:
    """This gateway's own ledger: without Redis each gateway holds every budget."""

    def __init__(self) -> None:
        self.ledger = BudgetLedger()

    async def reserve(self, lines: tuple[BudgetLine, ...], asked: Spend,
                      now: float) -> BudgetExceeded | None:
        return self.ledger.reserve(lines, asked, now)

    async def settle(self, lines: tuple[BudgetLine, ...], reserved: Spend, actual: Spend,
                     now: float) -> None:
        self.ledger.settle(lines, reserved, actual, now)


@dataclass(frozen=True)
class Held:
    """What an admitted request holds until it ends."""

    lines: tuple[BudgetLine, ...]
    reserved: Spend
    price: Price | None
    key: VirtualKey | None
    key_tokens: float  # taken from the key's tokens bucket
    shared_key_tokens: float  # taken from its shared (Redis) tokens bucket


class _KeyBuckets:
    def __init__(self, key: VirtualKey) -> None:
        limits = key.limits
        self.limits = limits
        self.requests = (TokenBucket(limits.requests_per_s, max(1.0, limits.requests_per_s))
                         if limits.requests_per_s else None)
        self.tokens = (TokenBucket(limits.tokens_per_min / 60.0, limits.tokens_per_min)
                       if limits.tokens_per_min else None)


@dataclass
class KeyGate:
    budgets: Budgets = field(default_factory=LocalBudgets)
    # Wall clock (epoch seconds): expiries and budget windows are calendar times;
    # the key buckets use it too (a clock stepping back only pauses their refill).
    clock: Callable[[], float] = time.time
    # The cluster's key secret (None until ``gateway.followers.key_secret`` has it).
    secret: bytes | None = None
    # A key's rates across gateways (``gateway.corridor.shared_limits``); None: this gateway's only.
    shared_rates: SharedKeyRates | None = None
    _keyring: tuple[Policy, bytes, Keyring] | None = field(default=None, init=False)
    _buckets: OrderedDict[str, _KeyBuckets] = field(default_factory=OrderedDict, init=False)
    _held: dict[str, Held] = field(default_factory=dict, init=False)

    def identify(self, policy: Policy, authorization: str | None) -> Identity:
        return identify(policy, authorization, self._keyring_of(policy), self.clock())

    def _keyring_of(self, policy: Policy) -> Keyring | None:
        if self.secret is None:
            return None
        cached = self._keyring
        if cached is None or cached[0] is not policy or cached[1] != self.secret:
            cached = (policy, self.secret, Keyring.of(policy, self.secret))
            self._keyring = cached
        return cached[2]

    async def admit(self, request_id: str, identity: Identity, policy: Policy, model: str,
                    prompt_tokens: int, max_output_tokens: int) -> None:
        """Raises 403 ``model_not_allowed``, 429 ``requests_rate``/``tokens_rate``
        (the key's own) or 429 ``budget_exceeded``; nothing is held after a refusal."""
        key = identity.key
        check_model_allowed(key, model)
        now = self.clock()
        price = policy_prices(policy)(model)
        tokens = float(prompt_tokens + max_output_tokens)
        shared_tokens = await self._take_shared_key_rate(key, tokens)
        try:
            key_tokens = self._take_key_rate(key, tokens, now)
        except RateLimited:
            await self._settle_shared(key, shared_tokens, 0.0)
            raise
        lines = budget_lines(policy, identity.tenant, key, now)
        asked = Spend(tokens, _cost(price, Usage(prompt_tokens, max_output_tokens)))
        refusal = await self.budgets.reserve(lines, asked, now) if lines else None
        if refusal is not None:
            self._give_back_key_tokens(key, key_tokens, 0.0)
            await self._settle_shared(key, shared_tokens, 0.0)
            raise refusal
        if (lines or key_tokens or shared_tokens) and len(self._held) < MAX_OPEN:
            self._held[request_id] = Held(lines, asked, price, key, key_tokens, shared_tokens)

    async def settle(self, request_id: str, usage: Usage | None) -> None:
        """The request has ended with ``usage`` (None: no tokens were computed).
        Shielded from cancellation, bounded by ``SETTLE_TIMEOUT_S``; an error is logged."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        used = usage or Usage()
        actual = Spend(float(used.prompt_tokens + used.completion_tokens), _cost(held.price, used))
        # Settling must finish even when the client's cancellation (or the drain's
        # cut) ends the request, and each part whatever the one before it raised;
        # bounded, so that a store that stalls cannot hold up the request or a shutdown.
        # It never raises: it runs in the request's ``finally`` (completions and
        # embeddings), where an error would replace the request's own outcome.
        with anyio.move_on_after(SETTLE_TIMEOUT_S, shield=True) as bounded:
            try:
                try:
                    self._give_back_key_tokens(held.key, held.key_tokens, actual.tokens)
                finally:
                    try:
                        await self._settle_shared(held.key, held.shared_key_tokens,
                                                  actual.tokens)
                    finally:
                        if held.lines:
                            await self.budgets.settle(held.lines, held.reserved, actual,
                                                      self.clock())
            except Exception:
                log.exception("request %s: settling its budgets failed", request_id)
        if bounded.cancelled_caught:
            log.warning("request %s: settling its budgets took over %.1fs and was given up; "
                        "its reservation stays counted as spent", request_id, SETTLE_TIMEOUT_S)

    async def _take_shared_key_rate(self, key: VirtualKey | None, tokens: float) -> float:
        """What was taken from the key's shared tokens bucket (0: none, or no Redis)."""
        if self.shared_rates is None or key is None or (
                key.limits.requests_per_s is None and key.limits.tokens_per_min is None):
            return 0.0
        limits = key.limits
        charge = min(tokens, limits.tokens_per_min) if limits.tokens_per_min else 0.0
        refused = await self.shared_rates.take_key(key.id, limits.requests_per_s,
                                                   limits.tokens_per_min, charge)
        if refused is None:
            return charge
        by, wait = refused
        if by == "tokens":
            raise RateLimited(f"API key {key.id} exceeded {limits.tokens_per_min:g} tokens per "
                              "minute (shared by all gateways)", code="tokens_rate",
                              retry_after=wait)
        raise RateLimited(f"API key {key.id} exceeded {limits.requests_per_s:g} requests per "
                          "second (shared by all gateways)", code="requests_rate",
                          retry_after=wait)

    async def _settle_shared(self, key: VirtualKey | None, charged: float,
                             actual: float) -> None:
        if self.shared_rates is None or key is None or not charged:
            return
        if key.limits.tokens_per_min is not None:
            await self.shared_rates.settle_key(key.id, key.limits.tokens_per_min,
                                               charged - actual)

    def _take_key_rate(self, key: VirtualKey | None, tokens: float, now: float) -> float:
        buckets = self._buckets_of(key)
        if buckets is None or key is None:
            return 0.0
        limits = buckets.limits
        if buckets.requests is not None and not buckets.requests.try_take(1.0, now):
            raise RateLimited(f"API key {key.id} exceeded {limits.requests_per_s:g} requests "
                              "per second", code="requests_rate",
                              retry_after=buckets.requests.time_until(1.0, now))
        if buckets.tokens is None:
            return 0.0
        charge = min(tokens, buckets.tokens.burst)
        if not buckets.tokens.try_take(charge, now):
            if buckets.requests is not None:
                buckets.requests.give_back(1.0, now)
            raise RateLimited(f"API key {key.id} exceeded {limits.tokens_per_min:g} tokens "
                              "per minute", code="tokens_rate",
                              retry_after=buckets.tokens.time_until(charge, now))
        return charge

    def _give_back_key_tokens(self, key: VirtualKey | None, charged: float,
                              actual: float) -> None:
        buckets = self._buckets_of(key) if charged else None
        if buckets is None or buckets.tokens is None:
            return
        now = self.clock()
        if actual < charged:
            buckets.tokens.give_back(charged - actual, now)
        else:
            buckets.tokens.drain(actual - charged, now)

    def _buckets_of(self, key: VirtualKey | None) -> _KeyBuckets | None:
        if key is None or (key.limits.requests_per_s is None
                           and key.limits.tokens_per_min is None):
            return None
        found = self._buckets.get(key.id)
        if found is None or found.limits != key.limits:  # new, or its limits were changed
            found = _KeyBuckets(key)
            self._buckets[key.id] = found
            while len(self._buckets) > MAX_KEY_BUCKETS:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(key.id)
        return found


def _cost(price: Price | None, usage: Usage) -> float:
    return 0.0 if price is None else price.cost(usage)
