"""The response cache across real processes: two gateways, one real redis-server.

A control plane, one simulated worker and two gateway processes (``--redis
URL``, each with its admin API on ``--admin-port``). What a user of the
gateways notices: an answer generated through one gateway is an exact hit on
the other (the worker runs no second generation); with Redis SIGKILLed mid
traffic every request still succeeds, and once Redis is back the gateways
share again; ``hedgerow cache purge`` makes the next identical request a
miss on both; an OpenAI SDK streaming client gets the same chunk structure
from a replay as from a live generation. The last test starts a third
gateway with the real all-MiniLM-L6-v2 and pair model and checks a paraphrase
is a semantic hit and the opposite action or another object is not, that the models run on ONNX
Runtime in the gateway's embedding sidecar with torch loaded nowhere, and
that the sidecar does not outlive a SIGKILLed gateway.

The two gateways keep semantic caching off (their policy) so that neither
loads the embedding model; each answer is stored just after it was sent, so
a test polls for the hit instead of sleeping.
"""

from __future__ import annotations

import hashlib
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from tests.support.stack import Proc, Stack, free_port, scrape_metrics, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PURGE_KEY = "sk-purgee-2b7d41"
SDK_KEY = "sk-sdk-61f0a3"
ADMIN_TOKEN = "admin-tok-9c1e55"
SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "2", "--sim-jitter", "0", "--sim-output-tokens", "6"]


def _policy(semantic: bool) -> str:
    digest, sdk = (hashlib.sha256(k.encode()).hexdigest() for k in (PURGE_KEY, SDK_KEY))
    return f"""
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 5000, deadline_ms: 20000}}
tenants:
  - name: local
    class: interactive
  - name: purgee
    class: interactive
    api_key_sha256: ["{digest}"]
  - name: sdk
    class: interactive
    api_key_sha256: ["{sdk}"]
models:
  - name: {MODEL}
cache:
  semantic: {{enabled: {str(semantic).lower()}}}
  redis_timeout_ms: 300
  redis_retry_after_s: 0.5
"""


@dataclass
class Gateway:
    url: str
    admin: str  # its admin listener: mutual TLS, an admin's certificate
    proc: Proc
    stack: Stack

    def admin_get(self, path: str, **kwargs: Any) -> httpx.Response:
        # The gateway's certificate names its identity, not a host: no hostname check.
        return httpx.get(self.admin + path, verify=self.stack.admin_tls(check_hostname=False),
                         **kwargs)


@dataclass
class Rig:
    stack: Stack
    redis: RedisServer
    a: Gateway
    b: Gateway
    token_file: Path


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory,
        redis_server: RedisServer) -> Iterator[Rig]:  # noqa: F811
    root = tmp_path_factory.mktemp("cache-e2e")
    policy = root / "policy.yaml"
    policy.write_text(_policy(semantic=False))
    token_file = root / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    stack = Stack(root)
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        gateways = [_start_gateway(stack, name, policy, "--redis", redis_server.url,
                                   "--admin-token-file", str(token_file))
                    for name in ("a", "b")]
        yield Rig(stack, redis_server, gateways[0], gateways[1], token_file)
    finally:
        stack.stop_all()


def _start_gateway(stack: Stack, name: str, policy: Path, *extra: str) -> Gateway:
    admin_port = free_port()
    proc = stack.start_gateway("--policy", str(policy), "--gateway-id", f"gw-{name}",
                               "--admin-port", str(admin_port), *extra)
    return Gateway(stack.gateway_url, f"https://127.0.0.1:{admin_port}", proc, stack)


def _client(rig: Rig | Stack, url: str) -> httpx.Client:
    stack = rig.stack if isinstance(rig, Rig) else rig
    return httpx.Client(base_url=url, timeout=15,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def _chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": question}], **extra}


def _ask(http: httpx.Client, question: str, key: str | None = None) -> tuple[str, str]:
    """The answer's text and its x-hedgerow-cache header."""
    reply = http.post("/v1/chat/completions", json=_chat(question),
                      headers={"authorization": f"Bearer {key}"} if key else {})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"], reply.headers["x-hedgerow-cache"]


def _until_hit(http: httpx.Client, question: str, kind: str = "exact", key: str | None = None,
               timeout: float = 8.0) -> str:
    """Ask until the answer comes from the cache (it is stored just after it was sent)."""
    found: list[str] = []

    def hit() -> bool:
        text, result = _ask(http, question, key)
        found[:] = [text]
        return result == kind

    wait_for(hit, f"{question!r} to be a {kind} hit", timeout)
    return found[0]


def _generations(rig: Rig | Stack) -> int:
    stack = rig.stack if isinstance(rig, Rig) else rig
    return int(stack.worker_status("sim-1")["generations_total"])


def _metric(gateway: Gateway, name: str, **labels: str) -> float:
    """From the gateway's admin port, with the admin token (no metrics token is set)."""
    total = 0.0
    text = scrape_metrics(gateway.admin, ADMIN_TOKEN,
                          verify=gateway.stack.admin_tls(check_hostname=False))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += float(sample.value)
    return total


def test_an_answer_generated_through_one_gateway_is_an_exact_hit_on_the_other(rig: Rig) -> None:
    question = "What colour is a hedge in spring? (sharing)"
    with _client(rig, rig.a.url) as a, _client(rig, rig.b.url) as b:
        text, result = _ask(a, question)
        assert result == "miss"
        generated = _generations(rig)
        assert _until_hit(b, question) == text
        assert _generations(rig) == generated  # b answered without the worker
        assert _metric(rig.b, "hedgerow_cache_requests_total", result="exact") >= 1


def test_with_redis_killed_mid_traffic_every_request_succeeds_and_sharing_resumes(
        rig: Rig) -> None:
    statuses: list[int] = []
    stop = threading.Event()

    def traffic(url: str, tag: str) -> None:
        with _client(rig, url) as http:
            i = 0
            while not stop.is_set():
                # New questions (misses, generated upstream) and repeats (hits).
                reply = http.post("/v1/chat/completions", json=_chat(f"{tag} {i % 7} {i}"))
                statuses.append(reply.status_code)
                i += 1

    threads = [threading.Thread(target=traffic, args=(g.url, t))
               for g, t in ((rig.a, "outage-a"), (rig.b, "outage-b"))]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        assert rig.redis.popen is not None
        rig.redis.popen.kill()  # SIGKILL: no goodbye to the clients
        rig.redis.popen.wait(5)
        killed_at = len(statuses)
        time.sleep(1.5)
        during = len(statuses)
        with _client(rig, rig.a.url) as a, _client(rig, rig.b.url) as b:
            # Without Redis each gateway still caches in its own memory.
            text, result = _ask(a, "asked during the outage")
            assert result == "miss" and _until_hit(a, "asked during the outage") == text
            assert _ask(b, "asked during the outage")[1] == "miss"
    finally:
        stop.set()
        for thread in threads:
            thread.join(20)
        rig.redis.start()
    assert len(statuses) > during > killed_at > 0  # traffic ran before and all through
    assert set(statuses) == {200}, statuses
    with _client(rig, rig.a.url) as a, _client(rig, rig.b.url) as b:
        assert _metric(rig.a, "hedgerow_cache_redis_faults_total") > 0
        # Redis is back (empty): after the retry pause, one gateway's answer is
        # the other's hit again.
        question = "asked after Redis came back"
        time.sleep(0.6)
        text, _ = _ask(a, question)
        assert _until_hit(b, question, timeout=10) == text


def test_purge_by_tenant_makes_the_next_request_a_miss_on_every_gateway(rig: Rig) -> None:
    first, second = "Name three hedgerow birds. (purge)", "Name three hedgerow trees. (purge)"
    with _client(rig, rig.a.url) as a, _client(rig, rig.b.url) as b:
        for question in (first, second):
            _ask(a, question, PURGE_KEY)
            _until_hit(a, question, key=PURGE_KEY)
            _until_hit(b, question, key=PURGE_KEY)  # now in b's memory too
        _ask(a, first)  # another tenant's answer to the same question...
        _until_hit(a, first)

        # An admin's certificate without the admin token this gateway also asks for.
        refused = httpx.post(rig.a.admin + "/admin/cache/purge", json={"tenant": "purgee"},
                             verify=rig.stack.admin_tls(check_hostname=False))
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_admin_token"
        purged = subprocess.run(
            [sys.executable, "-m", "hedgerow.cli", "cache", "purge", "--gateway-admin",
             rig.a.admin, "--admin-token-file", str(rig.token_file), "--tenant", "purgee"],
            capture_output=True, text=True, timeout=30, env=rig.stack.admin_env())
        assert purged.returncode == 0, purged.stderr
        assert int(orjson.loads(purged.stdout.strip().splitlines()[-1])["purged"]) >= 2

        generated = _generations(rig)
        assert _ask(a, first, PURGE_KEY)[1] == "miss"
        assert _generations(rig) == generated + 1
        assert _ask(a, first)[1] == "exact"  # ...survives the purge
        # The purge reaches b through Redis within about a second.
        wait_for(lambda: _ask(b, second, PURGE_KEY)[1] == "miss", "b to drop the entry", 5)


def _shape(value: Any) -> Any:
    """The key structure of a JSON value (what an SDK client depends on)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _shape(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(sorted({_shape(v) for v in value}))
    return type(value).__name__ if value is not None else "null"


def _sdk_stream(sdk: Any, question: str) -> tuple[str, list[dict[str, Any]]]:
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, stream=True, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": question}],
        stream_options={"include_usage": True})
    chunks = [chunk.to_dict() for chunk in raw.parse()]
    return raw.headers["x-hedgerow-cache"], chunks


def test_an_sdk_streaming_client_gets_the_same_chunk_structure_from_a_hit(rig: Rig) -> None:
    import openai

    question = "Describe a hawthorn hedge in one line. (sdk)"
    http_client = httpx.Client(verify=ssl.create_default_context(cafile=rig.stack.ca_cert))
    with openai.OpenAI(base_url=rig.a.url + "/v1", api_key=SDK_KEY,
                       http_client=http_client) as sdk:
        live_result, live = _sdk_stream(sdk, question)
        deadline = time.monotonic() + 8
        while True:
            hit_result, hit = _sdk_stream(sdk, question)
            if hit_result == "exact" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert (live_result, hit_result) == ("miss", "exact")

    def text(chunks: list[dict[str, Any]]) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])

    assert text(hit) == text(live) and text(live)
    assert hit[-1]["usage"] == live[-1]["usage"]
    # First (role) chunk, content chunks, finish chunk, usage chunk: same fields each.
    for part in (lambda cs: cs[:1], lambda cs: cs[1:-2], lambda cs: cs[-2:-1],
                 lambda cs: cs[-1:]):
        assert {_shape(c) for c in part(hit)} == {_shape(c) for c in part(live)}
    assert hit[0]["choices"][0]["delta"]["role"] == "assistant"
    assert hit[-2]["choices"][0]["finish_reason"] == live[-2]["choices"][0]["finish_reason"]
    assert len({c["id"] for c in hit}) == 1 and hit[0]["id"] != live[0]["id"]


def test_a_paraphrase_is_a_semantic_hit_with_the_real_embedding_model(rig: Rig) -> None:
    policy = rig.stack.root / "semantic-policy.yaml"
    policy.write_text(_policy(semantic=True))
    gateway = _start_gateway(rig.stack, "semantic", policy)
    wait_for(lambda: gateway.admin_get("/admin/cache").json()["semantic_ready"],
             "the embedding model to load", 120)
    with _client(rig, gateway.url) as http:
        text, result = _ask(http, "How do I remove a git submodule?")
        assert result == "miss"
        # Stored (and embedded) just after it was sent: wait until it is indexed.
        stats: dict[str, Any] = {}

        def indexed() -> bool:
            stats.update(gateway.admin_get("/admin/cache").json())
            return int(stats["semantic_entries"]) >= 1

        wait_for(indexed, "the question to be indexed", 10)
        # The shipped judge scores this paraphrase 0.998 against the cached question
        # (the shipped pair_threshold is 0.99; none of these texts is in its training).
        paraphrase, result = _ask(http, "What's the way to delete a git submodule?")
        assert (paraphrase, result) == (text, "semantic")
        # The opposite action (MiniLM cosine 0.754: plain cosine at 0.68 would serve it)
        # and another object (0.655): refused by the pair model, which reads both
        # questions together (it scores them 0.002 and 0.001; the paraphrase's cosine is 0.946).
        assert _ask(http, "How do I add a git submodule?")[1] == "miss"
        assert _ask(http, "How do I remove a git branch?")[1] == "miss"
        assert _metric(gateway, "hedgerow_cache_guard_rejections_total",
                       reason="pair_model") == 2
    # The model runs in the sidecar, on ONNX Runtime: torch is mapped in neither process.
    gateway_pid = gateway.proc.popen.pid
    (sidecar,) = _children(gateway_pid, "gateway.cache.embed_server")
    assert "libtorch" not in Path(f"/proc/{gateway_pid}/maps").read_text()
    sidecar_maps = Path(f"/proc/{sidecar}/maps").read_text()
    assert "libonnxruntime" in sidecar_maps and "libtorch" not in sidecar_maps
    os.kill(gateway_pid, signal.SIGKILL)  # no orphan: the sidecar goes with it
    gateway.proc.popen.wait(10)
    wait_for(lambda: _state(sidecar) in ("gone", "Z"), "the sidecar to exit", 10)


def _state(pid: int) -> str:
    """The process's state letter (Z: exited, not yet reaped), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def _children(parent: int, command: str) -> list[int]:
    """Running processes whose parent is ``parent`` and whose command line holds ``command``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and command in cmdline:
            found.append(int(stat.parent.name))
    return found
