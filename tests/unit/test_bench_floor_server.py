"""``bench.floor_server``: the overhead scenario's floor target serves a
worker-shaped stream through the gateway's own listener, in its own process."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import orjson

from bench.floor_server import start_floor_server
from gateway.edge.devcert import ensure_dev_certificate


def test_the_floor_server_streams_max_tokens_tokens_over_tls(tmp_path: Path) -> None:
    cert = ensure_dev_certificate(tmp_path / "state")
    proc, url = start_floor_server(tmp_path / "floor", cert.cert, cert.key,
                                   prefill_ms=0.5, decode_ms=0.5)
    try:
        context = ssl.create_default_context(cafile=str(cert.ca_cert))
        context.check_hostname = False
        body = {"model": "m", "stream": True, "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(verify=context) as client, client.stream(
                "POST", f"{url}/v1/chat/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            data = [line[len("data: "):] for line in response.iter_lines()
                    if line.startswith("data: ")]
    finally:
        assert proc.stop() == 0, proc.log()
    assert data[-1] == "[DONE]"
    chunks = [orjson.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c["choices"])
    assert text == " t0 t1 t2 t3 t4"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
