"""A tenant's requests/s limit holds across two gateways sharing one Redis.

Two gateway processes (``--redis URL``) in front of one simulated worker; a
tenant limited to RATE requests/s with a burst of BURST is hammered through
both at once and gets about BURST + RATE x seconds in all, not that much from
each. With Redis stopped both keep serving on their own limits (counted in
``hedgerow_shared_limits_fallback_total``), and share again once it is back.
"""

from __future__ import annotations

import hashlib
import ssl
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.redis_gateways import Gateways, start_two_gateways
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from tests.support.stack import wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
KEY = "sk-metered-4f1d9a"
OPEN_KEY = "sk-open-77c2e0"
SECRET_PROMPT = "tangerine-heron-0b5e"
RATE, BURST = 4, 4
HAMMER_S = 3.0
SIM = ["--backend", "sim", "--slots", "16", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "2"]


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


POLICY = f"""
hedging: {{enabled: false}}
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - name: metered
    class: interactive
    api_key_sha256: ["{_digest(KEY)}"]
    limits: {{requests_per_s: {RATE}, requests_burst: {BURST}}}
  - name: open
    class: interactive
    api_key_sha256: ["{_digest(OPEN_KEY)}"]
models:
  - name: {MODEL}
"""


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory,
             redis_server: RedisServer) -> Iterator[Gateways]:  # noqa: F811
    started = start_two_gateways(tmp_path_factory.mktemp("shared-limits"), POLICY, redis_server, SIM)
    try:
        yield started
    finally:
        started.stack.stop_all()


def _client(gateways: Gateways, url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10,
                        verify=ssl.create_default_context(cafile=gateways.stack.ca_cert))


def _post(http: httpx.Client, key: str) -> int:
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    return http.post("/v1/chat/completions", json=body,
                     headers={"authorization": f"Bearer {key}"}).status_code


def _hammer(gateways: Gateways, url: str, seconds: float, statuses: list[int]) -> None:
    with _client(gateways, url) as http:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            statuses.append(_post(http, KEY))


def _metric(gateways: Gateways, url: str, name: str, **labels: str) -> float:
    text = gateways.stack.gateway_metrics(url)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_a_tenant_gets_its_rate_across_both_gateways_not_from_each(gateways: Gateways) -> None:
    seen: tuple[list[int], list[int]] = ([], [])
    threads = [threading.Thread(target=_hammer, args=(gateways, url, HAMMER_S, statuses))
               for url, statuses in zip(gateways.urls, seen)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # The bucket refills for as long as requests arrive: the last one sent
    # before the deadline may be answered well after it on a loaded machine.
    span = time.monotonic() - started
    served = [statuses.count(200) for statuses in seen]
    assert all(set(statuses) <= {200, 429} for statuses in seen), seen
    # Each gateway alone would allow BURST + RATE x HAMMER_S (16): both together
    # get about that in all, not twice it.
    allowed = BURST + RATE * HAMMER_S
    assert allowed * 0.6 <= sum(served) <= BURST + RATE * span + 2, (served, span)
    assert sum(served) < 2 * allowed, served  # one shared bucket, not one each
    assert all(n >= 1 for n in served), served
    assert sum(len(statuses) for statuses in seen) > 2 * allowed  # the limit was really tested
    for url in gateways.urls:
        assert _metric(gateways, url, "hedgerow_shed_total", reason="shared_requests_rate") > 0


def test_with_redis_down_both_keep_serving_and_share_again_when_it_is_back(
        gateways: Gateways) -> None:
    url_a, url_b = gateways.urls
    gateways.redis.stop()
    try:
        with _client(gateways, url_a) as http:
            started = time.monotonic()
            assert [_post(http, OPEN_KEY) for _ in range(5)] == [200] * 5
            assert time.monotonic() - started < 5  # an outage costs at most one short timeout
        assert _metric(gateways, url_a, "hedgerow_shared_limits_fallback_total") >= 5
        wait_for(lambda: "Redis unreachable" in gateways.procs[0].log(), "the outage logged", 5)
    finally:
        gateways.redis.start()
    time.sleep(1.5)  # past the retry pause
    before = _metric(gateways, url_b, "hedgerow_shed_total", reason="shared_requests_rate")
    statuses: list[int] = []
    _hammer(gateways, url_b, 1.0, statuses)
    assert statuses.count(200) <= BURST + RATE + 1 and 429 in statuses
    after = _metric(gateways, url_b, "hedgerow_shed_total", reason="shared_requests_rate")
    assert after > before
    with _client(gateways, url_a) as http:
        _post(http, OPEN_KEY)  # gateway a notices Redis is back on its next request
    wait_for(lambda: "Redis is back" in gateways.procs[0].log(), "the recovery logged", 5)


def test_no_api_key_or_prompt_reaches_any_log(gateways: Gateways) -> None:
    with _client(gateways, gateways.urls[0]) as http:
        _post(http, KEY)
        assert _post(http, "sk-wrong-" + KEY) == 401
    for proc in gateways.stack.procs:
        log = proc.log()
        assert KEY not in log and OPEN_KEY not in log, f"{proc.name} logged an API key"
        assert SECRET_PROMPT not in log, f"{proc.name} logged a prompt"
