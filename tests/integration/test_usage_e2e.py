"""Usage per tenant, its cost, and the access log, end to end: a real control
plane, gateway and simulated worker (it reports usage like the real one).

What an operator bills from: the gateway's token counters per tenant equal the
usage the worker reported (and counted on its own /metrics), priced with the
policy's prices; a cache hit is counted as cached, not as work; every request
leaves one JSON access line with its tenant, tokens and timings, and no
prompt or key.
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "6"]
KEY = "sk-acme-usage-5d1e"
SECRET_PROMPT = "tangerine-walrus-91b2"
PRICE_IN, PRICE_OUT, PRICE_CACHED = 2.0, 8.0, 0.5

POLICY = f"""
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 5000, deadline_ms: 20000}}
tenants:
  - name: local
    class: interactive
  - name: acme
    class: interactive
    api_key_sha256: ["{hashlib.sha256(KEY.encode()).hexdigest()}"]
models:
  - name: {MODEL}
    price_per_million_tokens: {{input: {PRICE_IN}, output: {PRICE_OUT}, cached: {PRICE_CACHED}}}
cache:
  semantic: {{enabled: false}}
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("usage")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(root)
    try:
        stack.start_control_plane()
        stack.start_worker("w-sim", *SIM, "--slots", "2")
        stack.start_gateway("--policy", str(policy))  # the access log: stderr, the default
        yield stack
    finally:
        stack.stop_all()


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def worker_samples(stack: Stack) -> Samples:
    record = stack.worker("w-sim")
    assert record is not None
    response = httpx.get(record["registration"]["url"] + "/metrics",
                         verify=stack.admin_tls(check_hostname=False))
    return parse(response.text)


def chat(http: httpx.Client, *, stream: bool, key: str | None = None,
         **extra: object) -> httpx.Response:
    body = {"model": MODEL, "stream": stream, "max_tokens": 6,
            "messages": [{"role": "user", "content": SECRET_PROMPT}], **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return http.post("/v1/chat/completions", json=body, headers=headers)


def usage_of(response: httpx.Response) -> tuple[int, int]:
    """The usage the client was told (the worker's, relayed)."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        chunks = [orjson.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        usage = next(c["usage"] for c in chunks if c.get("usage"))
    else:
        usage = response.json()["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


def test_tenant_usage_equals_what_the_worker_reported_and_is_priced(stack: Stack) -> None:
    gateway_before, worker_before = parse(stack.gateway_metrics()), worker_samples(stack)
    with httpx.Client(base_url=stack.gateway_url, timeout=30,
                      verify=ssl.create_default_context(cafile=stack.ca_cert)) as http:
        local = [chat(http, stream=True) for _ in range(2)] + [chat(http, stream=False)]
        acme = [chat(http, stream=True, key=KEY), chat(http, stream=False, key=KEY)]
        # Cacheable (temperature 0): the second is an exact hit, served without the worker.
        fresh = chat(http, stream=False, key=KEY, temperature=0, seed=1)
        hit = chat(http, stream=False, key=KEY, temperature=0, seed=1)
        refused = chat(http, stream=True, key="sk-wrong")
    assert fresh.headers["x-hedgerow-cache"] == "miss"
    assert hit.headers["x-hedgerow-cache"] == "exact"
    assert refused.status_code == 401
    gateway, worker = parse(stack.gateway_metrics()), worker_samples(stack)

    def grew(name: str, **labels: str) -> float:
        return value(gateway, name, **labels) - value(gateway_before, name, **labels)

    computed = {"local": [usage_of(r) for r in local], "acme": [usage_of(r) for r in
                                                                 (*acme, fresh)]}
    for tenant, usages in computed.items():
        prompt, completion = sum(u[0] for u in usages), sum(u[1] for u in usages)
        assert prompt > 0 and completion > 0
        by = {"tenant": tenant, "model": MODEL}
        assert grew("hedgerow_tenant_tokens_total", type="prompt", **by) == prompt
        assert grew("hedgerow_tenant_tokens_total", type="completion", **by) == completion
        assert grew("hedgerow_tenant_requests_total", status="200", **by) == len(usages) + (
            tenant == "acme")
    cached = sum(usage_of(hit))
    assert grew("hedgerow_tenant_tokens_total", tenant="acme", type="cached") == cached
    assert grew("hedgerow_tenant_tokens_total", tenant="local", type="cached") == 0
    assert grew("hedgerow_tenant_requests_total", tenant="_unknown", status="401") == 1

    # The worker's own count of the tokens it generated: the same, all tenants together
    # (the cache hit generated nothing).
    all_usage = [u for usages in computed.values() for u in usages]
    worker_generated = (value(worker, "hedgerow_worker_tokens_total")
                        - value(worker_before, "hedgerow_worker_tokens_total"))
    assert worker_generated == sum(u[1] for u in all_usage)

    acme_prompt = sum(u[0] for u in computed["acme"])
    acme_completion = sum(u[1] for u in computed["acme"])
    expected = (acme_prompt * PRICE_IN + acme_completion * PRICE_OUT
                + cached * PRICE_CACHED) / 1e6
    assert grew("hedgerow_tenant_cost_total", tenant="acme") == pytest.approx(expected)

    # The GenAI names beside them: one input and one output observation per answer.
    assert grew("gen_ai_client_token_usage_count", gen_ai_token_type="input",
                gen_ai_operation_name="chat") == 7
    assert grew("gen_ai_client_token_usage_sum", gen_ai_token_type="output") == (
        sum(u[1] for u in all_usage) + usage_of(hit)[1])
    assert grew("gen_ai_server_time_to_first_token_seconds_count",
                gen_ai_request_model=MODEL) == 3
    assert grew("gen_ai_server_request_duration_seconds_count", error_type="") == 7


def test_each_request_leaves_one_json_access_line_without_prompt_or_key(
        stack: Stack) -> None:
    with httpx.Client(base_url=stack.gateway_url, timeout=30,
                      verify=ssl.create_default_context(cafile=stack.ca_cert)) as http:
        streamed = chat(http, stream=True, key=KEY)
        missing = http.post("/v1/chat/completions", json={"model": "no-such", "messages": []},
                            headers={"authorization": f"Bearer {KEY}"})
    assert missing.status_code in (400, 404)
    gateway = next(p for p in stack.procs if p.name == "gateway")

    def lines_for(request_id: str) -> list[dict[str, object]]:
        lines = [orjson.loads(line) for line in gateway.log().splitlines()
                 if line.startswith("{") and '"hedgerow.access"' in line]
        return [e for e in lines if e["request_id"] == request_id]

    line, = wait_for(lambda: lines_for(streamed.headers["x-request-id"]), "the access line")
    prompt, completion = usage_of(streamed)
    assert {k: line[k] for k in ("logger", "tenant", "model", "status", "error_code",
                                 "prompt_tokens", "completion_tokens", "cached_tokens",
                                 "worker", "hedged", "protocol", "method", "path")} == {
        "logger": "hedgerow.access", "tenant": "acme", "model": MODEL, "status": 200,
        "error_code": "", "prompt_tokens": prompt, "completion_tokens": completion,
        "cached_tokens": 0, "worker": "w-sim", "hedged": False, "protocol": "HTTP/1.1",
        "method": "POST", "path": "/v1/chat/completions"}
    assert line["client"] == "127.0.0.1"
    assert isinstance(line["ttft_ms"], float) and isinstance(line["duration_ms"], float)
    assert 0 < line["ttft_ms"] <= line["duration_ms"]  # type: ignore[operator]
    refused, = wait_for(lambda: lines_for(missing.headers["x-request-id"]), "the refusal")
    assert (refused["status"], refused["tenant"]) == (missing.status_code, "acme")
    assert refused["error_code"] == missing.json()["error"]["code"]
    assert refused["ttft_ms"] is None and refused["prompt_tokens"] == 0
    log = Path(gateway.log_path).read_text()
    assert SECRET_PROMPT not in log and KEY not in log
