"""Metrics and logs end to end: real gateway, control plane and simulated workers.

What an operator scrapes after real requests: the gateway's latency
histograms count exactly the requests clients saw, refusals and failures are
counted by status, the workers count their generations, the control plane its
workers; and a request's JSON log lines carry the id the client got back,
never its prompt.
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
BROKEN = "broken-model"
FAST = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1",
        "--sim-decode-ms-per-token", "2", "--sim-output-tokens", "8"]
SECRET_PROMPT = "purple-elephant-7f3c"

POLICY = f"""
breaker: {{failures_to_open: 50}}
retries: {{before_first_token: 1}}
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - name: local
    class: interactive
  - name: tiny
    class: interactive
    api_key_sha256: ["{hashlib.sha256(b'sk-tiny').hexdigest()}"]
    limits: {{max_concurrency: 1}}
models:
  - name: {MODEL}
  - name: {BROKEN}
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("observability")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(root)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HEDGEROW_LOG_FORMAT", "json")  # every process inherits it
        try:
            stack.start_control_plane(lease_s=3.0)
            stack.start_worker("a-fast", *FAST, "--slots", "2")
            stack.start_worker("b-broken", *FAST, "--model-name", BROKEN, "--sim-fail-prob", "1")
            stack.start_gateway("--policy", str(policy))
            yield stack
        finally:
            stack.stop_all()


def client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, timeout=30,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def body(model: str = MODEL, stream: bool = True, **extra: object) -> dict[str, object]:
    return {"model": model, "stream": stream,
            "messages": [{"role": "user", "content": SECRET_PROMPT}], **extra}


def scrape(url: str, **kwargs: object) -> Samples:
    response = httpx.get(url + "/metrics", **kwargs)  # type: ignore[arg-type]
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def gateway_scrape(stack: Stack) -> Samples:
    # Its admin listener (the public port has none): mutual TLS, as an admin; the
    # gateway's certificate names its identity, not a host.
    return scrape(stack.gateway_admin_url, verify=stack.admin_tls(check_hostname=False))


def worker_scrape(stack: Stack, worker_id: str) -> Samples:
    record = stack.worker(worker_id)
    assert record is not None
    # As the admin; a worker is known by its certificate's identity, not a hostname.
    return scrape(record["registration"]["url"], verify=stack.admin_tls(check_hostname=False))


def token_chunks(response: httpx.Response) -> int:
    """Events that carried generated text, as the client counts them."""
    count = 0
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = orjson.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            count += bool((choices[0].get("delta") or {}).get("content"))
    return count


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_gateway_histograms_count_what_clients_saw(stack: Stack) -> None:
    by = {"model": MODEL, "class": "interactive"}
    before = gateway_scrape(stack)
    with client(stack) as http:
        streams = [http.post("/v1/chat/completions", json=body()) for _ in range(3)]
        whole = http.post("/v1/chat/completions", json=body(stream=False))
        with http.stream("POST", "/v1/chat/completions", json=body(max_tokens=150),
                         headers={"authorization": "Bearer sk-tiny"}) as held:
            refused = http.post("/v1/chat/completions", json=body(),
                                headers={"authorization": "Bearer sk-tiny"})
            held.read()
        streams.append(held)
        unknown = http.post("/v1/chat/completions", json=body(model="no-such-model"))
    assert [r.status_code for r in streams] == [200] * 4 and whole.status_code == 200
    assert (refused.status_code, unknown.status_code) == (429, 404)
    after = gateway_scrape(stack)

    assert delta(after, before, "hedgerow_ttft_seconds_count", **by) == 4
    ttft_mean = delta(after, before, "hedgerow_ttft_seconds_sum", **by) / 4
    assert 0 < ttft_mean < 2.0
    gaps = sum(token_chunks(r) - 1 for r in streams)
    assert gaps >= 3 * 7 + 149
    assert delta(after, before, "hedgerow_itl_seconds_count", **by) == gaps
    assert delta(after, before, "hedgerow_request_duration_seconds_count", **by) == 5
    assert delta(after, before, "hedgerow_queue_wait_seconds_count", **by) == 5
    overhead = "hedgerow_gateway_overhead_seconds_count"
    assert delta(after, before, overhead, phase="request") == 5
    assert delta(after, before, overhead, phase="first_token") == 4
    assert delta(after, before, overhead, phase="chunk") == gaps
    assert delta(after, before, "hedgerow_requests_total", status="200", **by) == 5
    assert delta(after, before, "hedgerow_requests_total", status="429", **by) == 1
    assert delta(after, before, "hedgerow_requests_total", status="404", model="") == 1
    assert delta(after, before, "hedgerow_shed_total", reason="concurrency") == 1
    # Sampled requests (no temperature 0, no seed) never touch the cache; the
    # refused one was looked at before admission refused it.
    assert delta(after, before, "hedgerow_cache_requests_total", result="uncacheable") == 6
    assert delta(after, before, "hedgerow_cache_requests_total", result="miss") == 0
    assert value(after, "hedgerow_slots", worker="a-fast") == 2
    assert value(after, "hedgerow_slots_in_use", worker="a-fast") == 0


def test_a_failure_after_admission_is_counted_and_its_json_log_carries_the_request_id(
        stack: Stack) -> None:
    before = gateway_scrape(stack)
    with client(stack) as http:
        failed = http.post("/v1/chat/completions", json=body(model=BROKEN))
    assert failed.status_code == 503
    request_id = failed.headers["x-request-id"]
    after = gateway_scrape(stack)
    assert delta(after, before, "hedgerow_requests_total", status="503", model=BROKEN) == 1
    assert delta(after, before, "hedgerow_queue_wait_seconds_count", model=BROKEN) == 1
    assert delta(after, before, "hedgerow_ttft_seconds_count", model=BROKEN) == 0

    gateway = next(p for p in stack.procs if p.name == "gateway")

    def logged() -> list[dict[str, object]]:
        entries = [orjson.loads(line) for line in gateway.log().splitlines()
                   if line.startswith("{")]
        return [e for e in entries if e.get("request_id") == request_id]

    mine = wait_for(logged, "the gateway to log the failed attempt", timeout=5)
    assert any(e["level"] == "warning" and "b-broken" in str(e["message"]) for e in mine)
    assert all({"ts", "level", "logger", "message"} <= set(e) for e in mine)
    for proc in stack.procs:
        assert SECRET_PROMPT not in proc.log(), f"{proc.name} logged a prompt"


def test_workers_count_their_generations(stack: Stack) -> None:
    fast_before, broken_before = worker_scrape(stack, "a-fast"), worker_scrape(stack, "b-broken")
    with client(stack) as http:
        for _ in range(2):
            assert http.post("/v1/chat/completions", json=body()).status_code == 200
        assert http.post("/v1/chat/completions", json=body(model=BROKEN)).status_code == 503
    fast, broken = worker_scrape(stack, "a-fast"), worker_scrape(stack, "b-broken")
    generations = "hedgerow_worker_generations_total"
    assert delta(fast, fast_before, generations, model=MODEL, finish_reason="stop") == 2
    assert delta(fast, fast_before, "hedgerow_worker_prefill_seconds_count", model=MODEL) == 2
    assert delta(fast, fast_before, "hedgerow_worker_decode_seconds_per_token_count") == 2
    per_token = (delta(fast, fast_before, "hedgerow_worker_decode_seconds_per_token_sum") / 2)
    assert 0.001 < per_token < 0.5  # the sim decodes a token every 2 ms
    assert delta(fast, fast_before, "hedgerow_worker_tokens_total") == 16
    assert value(fast, "hedgerow_worker_slots") == 2
    assert value(fast, "hedgerow_worker_active") == 0
    assert delta(broken, broken_before, generations, model=BROKEN, finish_reason="error") == 1


def test_the_public_port_answers_metrics_404_like_any_unknown_path(stack: Stack) -> None:
    with client(stack) as http:
        for method, path in (("GET", "/metrics"), ("HEAD", "/metrics"),
                             ("GET", "/metrics/"), ("GET", "/admin/cache")):
            response = http.request(method, path)
            assert response.status_code == 404, (method, path)
            if method == "GET":
                assert response.json()["error"]["code"] == "not_found"
                assert "hedgerow_" not in response.text


def test_control_plane_counts_workers_and_watchers(stack: Stack) -> None:
    samples = scrape(stack.control_plane_url, verify=stack.admin_tls())  # an admin route
    assert value(samples, "hedgerow_control_plane_workers") == 2
    assert value(samples, "hedgerow_control_plane_slots") == 3
    assert value(samples, "hedgerow_control_plane_registrations_total") >= 2
    assert value(samples, "hedgerow_control_plane_watchers") >= 1
    assert value(samples, "hedgerow_control_plane_lease_expiries_total") == 0


def test_every_process_logs_json(stack: Stack) -> None:
    for proc in stack.procs:
        entries = [orjson.loads(line) for line in Path(proc.log_path).read_text().splitlines()
                   if line.startswith("{")]
        assert entries, f"{proc.name} wrote no JSON log lines"
        assert all(isinstance(e["message"], str) for e in entries)
