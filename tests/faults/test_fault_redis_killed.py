"""Redis SIGKILLed under two gateways that share their cache and limits through it.

A control plane and two gateway processes all on one real redis-server, one
simulated worker. Clients stream and ask through both gateways (cache hits
and fresh questions) while Redis is killed, stays down a few seconds and comes
back empty on the same port. Every request is answered in full, none with an
error; each gateway counts the Redis faults; afterwards an answer stored
through one gateway is an exact hit on the other again (the shared cache
resynced) and the worker is still served (the registry re-seeded).
"""

from __future__ import annotations

import signal
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.redis_server import RedisServer
from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "4"]
POLICY = f"""
hedging: {{enabled: false}}
anonymous_tenant: open
classes:
  - {{name: interactive, ttft_slo_ms: 2000, deadline_ms: 15000}}
tenants:
  - name: open
    class: interactive
    limits: {{requests_per_s: 1000, requests_burst: 1000}}
models:
  - name: {MODEL}
cache:
  redis_timeout_ms: 100
  redis_retry_after_s: 0.5
  semantic: {{enabled: false}}
"""
OUTAGE_S = 3.0


@dataclass
class Cluster:
    stack: Stack
    redis: RedisServer
    urls: tuple[str, str]


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("redis-killed")
    (root / "policy.yaml").write_text(POLICY)
    redis = RedisServer(root)
    redis.start()
    stack = Stack(root)
    try:
        stack.start_control_plane(redis_url=redis.url, policy=root / "policy.yaml")
        stack.start_worker("sim-1", *SIM)
        urls = []
        for name in ("a", "b"):
            stack.start_gateway("--redis", redis.url, "--gateway-id", f"gw-{name}")
            urls.append(stack.gateway_url)
        yield Cluster(stack, redis, (urls[0], urls[1]))
    finally:
        stack.stop_all()
        redis.stop()


def _client(cluster: Cluster, url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10,
                        verify=ssl.create_default_context(cafile=cluster.stack.ca_cert))


def _body(question: str, stream: bool) -> dict[str, object]:
    return {"model": MODEL, "temperature": 0, "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": question}]}


def ask(http: httpx.Client, question: str, stream: bool = False) -> tuple[int, str, bool]:
    """Status, x-hedgerow-cache (else the error code), and whether the answer arrived whole."""
    if not stream:
        response = http.post("/v1/chat/completions", json=_body(question, False))
        if response.status_code != 200:
            return response.status_code, response.json()["error"]["code"], False
        return 200, response.headers.get("x-hedgerow-cache", ""), bool(response.json()["choices"])
    with http.stream("POST", "/v1/chat/completions", json=_body(question, True)) as response:
        if response.status_code != 200:
            return response.status_code, orjson.loads(response.read())["error"]["code"], False
        data = [line for line in response.iter_lines() if line.startswith("data: ")]
        errors = [d for d in data if d != "data: [DONE]" and "error" in orjson.loads(d[6:])]
        whole = bool(data) and data[-1] == "data: [DONE]" and not errors
        return response.status_code, response.headers.get("x-hedgerow-cache", ""), whole


@dataclass
class Traffic:
    answers: list[tuple[float, int, str, bool]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def drive(cluster: Cluster, url: str, traffic: Traffic, tag: str) -> None:
    numbers = count()
    with _client(cluster, url) as http:
        while not traffic.stop.is_set():
            n = next(numbers)
            question = "what grows in a hedgerow" if n % 2 else f"fresh question {tag} {n}"
            try:
                status, cache, whole = ask(http, question, stream=n % 3 == 0)
            except httpx.HTTPError as error:  # a dropped connection is a failure too
                traffic.failures.append(f"{question}: {error!r}")
                continue
            traffic.answers.append((time.monotonic(), status, cache, whole))


def _metric(cluster: Cluster, url: str, name: str, **labels: str) -> float:
    text = cluster.stack.gateway_metrics(url)
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v
                                              for k, v in labels.items()))


def test_redis_killed_mid_traffic_loses_no_request_and_the_cache_resyncs(
        cluster: Cluster) -> None:
    a, b = cluster.urls
    with _client(cluster, a) as http_a, _client(cluster, b) as http_b:
        assert ask(http_a, "what grows in a hedgerow")[0] == 200
        wait_for(lambda: ask(http_b, "what grows in a hedgerow")[1] == "exact",
                 "the answer stored through A to be a hit on B", 10)

    traffic = Traffic()
    drivers = [threading.Thread(target=drive, args=(cluster, url, traffic, tag))
               for url, tag in ((a, "a"), (b, "b"))]
    for driver in drivers:
        driver.start()
    time.sleep(1.0)
    assert cluster.redis.popen is not None
    cluster.redis.popen.send_signal(signal.SIGKILL)
    cluster.redis.popen.wait(10)
    killed_at = time.monotonic()
    time.sleep(OUTAGE_S)
    cluster.redis.popen = None
    cluster.redis.start()  # the same port, empty
    back_at = time.monotonic()
    time.sleep(2.0)
    traffic.stop.set()
    for driver in drivers:
        driver.join(30)

    assert not traffic.failures, traffic.failures[:5]
    bad = [(round(t - killed_at, 2), status, code) for t, status, code, whole in traffic.answers
           if status != 200 or not whole]
    assert not bad, (bad[:5], len(bad), round(back_at - killed_at, 2))
    during = [answer for answer in traffic.answers if killed_at <= answer[0] < back_at]
    assert len(during) >= 10, len(traffic.answers)  # really served while Redis was gone
    assert {answer[2] for answer in during} >= {"exact", "miss"}  # local hits and fresh answers
    for url in (a, b):
        assert _metric(cluster, url, "hedgerow_cache_redis_faults_total") > 0

    questions = count()

    def shared_again() -> bool:
        question = f"after the outage {next(questions)}"
        with _client(cluster, a) as http_a, _client(cluster, b) as http_b:
            assert ask(http_a, question)[0] == 200
            time.sleep(0.2)  # the store runs after the answer is sent
            return ask(http_b, question)[1] == "exact"

    wait_for(shared_again, "an answer stored through A to be a hit on B again", 20)
    assert cluster.stack.worker("sim-1") is not None  # re-registered on the new Redis
