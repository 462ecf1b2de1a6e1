"""Usage per tenant, model prices and the access line, without processes."""

from __future__ import annotations

import logging
import textwrap

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin.access_log import AccessLog, access_record, configure_access_log
from gateway.admin.metrics import GatewayMetrics
from gateway.admin.usage_metrics import MAX_TENANTS, OTHER_TENANT, Price, Usage, policy_prices
from hedgerow.errors import ModelNotFound
from hedgerow.wire import RegistrySnapshot
from policies.loader import parse_policy_document
from policies.schema import PolicyError

CLASSES = """\
classes:
  - {name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}
"""
NO_STATS = {"counters": {}, "breakers": {}, "queued": {}, "inflight": {},
            "hedge_budget": {"level": 0.0}}


def samples(metrics: GatewayMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = metrics.render(NO_STATS, RegistrySnapshot(version=0)).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples(metrics).items() if n == name and wanted <= ls)


def test_a_price_is_optional_per_model_and_validated() -> None:
    policy = parse_policy_document(CLASSES + textwrap.dedent("""\
        models:
          - name: priced
            price_per_million_tokens: {input: 0.5, output: 1.5}
          - name: free
        """))
    prices = policy_prices(policy)
    assert prices("priced") == Price(0.5, 1.5, 0.0)
    assert prices("free") is None and prices("undeclared") is None
    for bad in ("{input: -1, output: 1}", "{input: 1}", "{input: 1, output: 1, reasoning: 2}",
                "{input: .inf, output: 1}"):
        with pytest.raises(PolicyError, match="price_per_million_tokens"):
            parse_policy_document(CLASSES + f"models:\n  - name: m\n"
                                  f"    price_per_million_tokens: {bad}\n")


def test_cost_prices_work_and_cached_answers_apart() -> None:
    price = Price(input=2.0, output=8.0, cached=0.5)
    assert price.cost(Usage(1_000_000, 500_000)) == pytest.approx(6.0)
    assert price.cost(Usage(600_000, 400_000, cached=True)) == pytest.approx(0.5)


def test_a_request_counts_its_tokens_cost_and_genai_series_once_it_ends() -> None:
    metrics = GatewayMetrics()
    request = metrics.request(10.0)
    request.identified("acme", "interactive", lambda model: Price(1.0, 3.0))
    request.labelled("m", "interactive")
    request.responded(200)
    request.relayed(10.2, 10.25, token=True)
    request.used(120, 30)
    request.finished(11.0)
    hit = metrics.request(12.0)
    hit.identified("acme", "interactive", lambda model: Price(1.0, 3.0, cached=0.1))
    hit.labelled("m", "interactive")
    hit.responded(200)
    hit.used(120, 30, cached="exact")
    hit.finished(12.01)
    by = {"tenant": "acme", "model": "m"}
    assert value(metrics, "hedgerow_tenant_tokens_total", type="prompt", **by) == 120
    assert value(metrics, "hedgerow_tenant_tokens_total", type="completion", **by) == 30
    assert value(metrics, "hedgerow_tenant_tokens_total", type="cached", **by) == 150
    assert value(metrics, "hedgerow_tenant_requests_total", status="200", **by) == 2
    assert value(metrics, "hedgerow_tenant_cost_total", **by) == pytest.approx(
        (120 * 1.0 + 30 * 3.0 + 150 * 0.1) / 1e6)
    assert value(metrics, "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == 240
    assert value(metrics, "gen_ai_client_token_usage_count", gen_ai_token_type="output",
                 gen_ai_operation_name="chat", gen_ai_request_model="m") == 2
    assert value(metrics, "gen_ai_server_time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(metrics, "gen_ai_server_request_duration_seconds_count", error_type="") == 2


def test_refusals_count_under_a_fixed_label_and_tenants_stay_bounded() -> None:
    metrics = GatewayMetrics()
    refused = metrics.request(1.0)
    refused.failed(ModelNotFound("no such model"))
    refused.finished(1.1)
    assert value(metrics, "hedgerow_tenant_requests_total", tenant="_unknown",
                 status="404") == 1
    assert value(metrics, "gen_ai_server_request_duration_seconds_count") == 0
    for i in range(MAX_TENANTS + 5):
        assert metrics.usage.tenant_label(f"t{i}") == (f"t{i}" if i < MAX_TENANTS
                                                        else OTHER_TENANT)


def test_the_access_record_has_ids_and_numbers_never_text() -> None:
    metrics = GatewayMetrics()
    request = metrics.request(5.0)
    request.identified("acme", "interactive")
    request.labelled("m", "interactive")
    request.responded(200)
    request.served_by("w-1", hedged=True)
    request.relayed(5.0, 5.125, token=True)
    request.used(7, 9, error_code="upstream_truncated")
    request.finished(5.5)
    scope = {"hedgerow.request_id": "abc", "method": "POST", "path": "/v1/chat/completions",
             "query_string": b"key=sk-secret", "http_version": "2",
             "client": ("2001:db8::1", 51000), "headers": [(b"authorization", b"Bearer sk-x")]}
    line = access_record(request, scope)
    assert {k: v for k, v in line.items() if k != "ts"} == {
        "level": "info", "logger": "hedgerow.access", "message": "access",
        "request_id": "abc", "method": "POST", "path": "/v1/chat/completions",
        "tenant": "acme", "model": "m", "status": 200, "error_code": "upstream_truncated",
        "prompt_tokens": 7, "completion_tokens": 9, "cached_tokens": 0, "cache": "",
        "ttft_ms": 125.0, "duration_ms": 500.0, "worker": "w-1", "hedged": True,
        "protocol": "HTTP/2", "client": "2001:db8::1"}
    assert "sk-" not in orjson.dumps(line).decode()


def test_the_access_log_goes_where_it_is_told(tmp_path: pytest.TempPathFactory,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    metrics = GatewayMetrics()
    request = metrics.request(1.0)
    request.finished(1.0)
    path = tmp_path / "access.log"  # type: ignore[operator]
    try:
        configure_access_log(str(path))
        AccessLog().write(request, {"hedgerow.request_id": "r1"})
        configure_access_log("off")
        AccessLog().write(request, {"hedgerow.request_id": "r2"})
        configure_access_log("stderr")
        AccessLog().write(request, {"hedgerow.request_id": "r3"})
    finally:
        logger = logging.getLogger("hedgerow.access")
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate, logger.level = True, logging.NOTSET
    assert [orjson.loads(line)["request_id"] for line in path.read_text().splitlines()] == ["r1"]
    assert orjson.loads(capsys.readouterr().err)["request_id"] == "r3"
