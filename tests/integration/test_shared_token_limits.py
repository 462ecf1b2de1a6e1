"""A tenant's tokens/min limit holds across two gateways sharing one Redis.

Two gateway processes (``--redis URL``) in front of one simulated worker
(which generates exactly ``max_tokens``). A tenant whose token burst covers
four requests gets four in all, alternating between the gateways — not four
from each — and then 429 ``tokens_rate``. Tokens a request did not use are
given back to the shared bucket when it ends, whichever gateway served it.
With Redis stopped each gateway applies its own limits: more is served in
all, refusals are 429s from the local buckets, and nothing fails with a 5xx.
"""

from __future__ import annotations

import hashlib
import ssl
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.redis_gateways import Gateways, start_two_gateways
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
KEYS = {"shared": "sk-tokens-shared-81c4", "refund": "sk-tokens-refund-2d07",
        "outage": "sk-tokens-outage-5a9e"}
MAX_TOKENS = 100
# Each request is charged about MAX_TOKENS + 3 (prompt): a burst of 450 holds
# four, and the refill (60/min, one a second) adds nothing that matters here.
TOKENS_BURST, TOKENS_PER_MIN = 450, 60
SIM = ["--backend", "sim", "--slots", "16", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "0.2", "--sim-output-tokens", "2"]


def _tenant(name: str) -> str:
    digest = hashlib.sha256(KEYS[name].encode()).hexdigest()
    return f"""  - name: {name}
    class: interactive
    api_key_sha256: ["{digest}"]
    limits: {{tokens_per_min: {TOKENS_PER_MIN}, tokens_burst: {TOKENS_BURST}}}
"""


POLICY = f"""
hedging: {{enabled: false}}
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
{"".join(_tenant(name) for name in KEYS)}models:
  - name: {MODEL}
"""


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory,
             redis_server: RedisServer) -> Iterator[Gateways]:  # noqa: F811
    started = start_two_gateways(tmp_path_factory.mktemp("shared-tokens"), POLICY, redis_server, SIM)
    try:
        yield started
    finally:
        started.stack.stop_all()


def _client(gateways: Gateways, url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10,
                        verify=ssl.create_default_context(cafile=gateways.stack.ca_cert))


def _post(gateways: Gateways, url: str, tenant: str, max_tokens: int | None) -> httpx.Response:
    body: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    with _client(gateways, url) as http:
        return http.post("/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {KEYS[tenant]}"})


def _alternate(gateways: Gateways, tenant: str, count: int,
               max_tokens: int | None = MAX_TOKENS) -> list[httpx.Response]:
    """``count`` requests, one after another, alternating between the gateways."""
    responses = []
    for index in range(count):
        responses.append(_post(gateways, gateways.urls[index % 2], tenant, max_tokens))
        time.sleep(0.1)  # the previous request's tokens are settled when it ends
    return responses


def _metric(gateways: Gateways, url: str, name: str, **labels: str) -> float:
    text = gateways.stack.gateway_metrics(url)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_a_tenant_gets_its_tokens_across_both_gateways_not_from_each(
        gateways: Gateways) -> None:
    responses = _alternate(gateways, "shared", 10)
    statuses = [r.status_code for r in responses]
    # Four fit the shared burst; alone, each gateway's own bucket would have
    # served four (eight in all).
    assert statuses[:4] == [200] * 4 and set(statuses[4:]) == {429}, statuses
    refused = responses[4].json()["error"]
    assert refused["code"] == "tokens_rate" and "shared by all gateways" in refused["message"]
    assert int(responses[4].headers["retry-after"]) >= 1
    for url in gateways.urls:
        assert _metric(gateways, url, "hedgerow_shed_total", reason="shared_tokens_rate") > 0


def test_unused_tokens_go_back_to_the_shared_bucket(gateways: Gateways) -> None:
    # Without max_tokens a request is charged prompt + 256 tokens, more than
    # half the burst; it uses 2 + prompt, and the rest is given back when it
    # ends, so every one of these is served. Without the give-back, the shared
    # bucket would refuse the second.
    statuses = [r.status_code for r in _alternate(gateways, "refund", 8, max_tokens=None)]
    assert statuses == [200] * 8


def test_with_redis_down_each_gateway_applies_its_own_limits(gateways: Gateways) -> None:
    gateways.redis.stop()
    try:
        started = time.monotonic()
        statuses = [r.status_code for r in _alternate(gateways, "outage", 12)]
        assert time.monotonic() - started < 12  # an outage costs at most one short timeout
    finally:
        gateways.redis.start()
    assert set(statuses) <= {200, 429}, statuses  # never a 5xx
    # Each gateway's own burst holds four: eight in all, more than the shared four.
    assert statuses.count(200) == 8, statuses
    assert _metric(gateways, gateways.urls[0], "hedgerow_shared_limits_fallback_total") >= 1
