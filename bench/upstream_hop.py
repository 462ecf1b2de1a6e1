"""The gateway's side of the upstream hop: CPU per streamed request, in one process.

``bench/corridor.py`` drives the corridor against in-memory workers, so the
HTTP/1.1 client that reaches a real worker (``gateway.upstream.worker_http``:
the pool, the request, the response head, the chunked body) is not in it.
This drives that client: ``WorkerClient.open_stream`` over loopback TCP to a
worker-shaped server in a child process, then the stream read as the
generation reads it (``gateway.corridor.attempt.upstream_events``: the SSE
parse, and ``upstream_chunk`` on each event). The server answers every POST
with a chunked SSE stream shaped like a worker's -- a role chunk, ``TOKENS``
content chunks, a finish chunk, a usage chunk, ``[DONE]`` -- each event its
own chunk and its own write, as a worker sends them. Only this process's CPU
is counted (``time.process_time``); the server's is not. On uvloop, as the
gateway runs. No TLS: what TLS costs per byte is the same whatever parses
the bytes.

    PYTHONPATH=$PWD .venv/bin/python bench/upstream_hop.py 3000 100     # requests, streams
    PYTHONPATH=$PWD .venv/bin/python bench/upstream_hop.py 3000 100 8   # tokens (default 8)

Run it as a script path to measure another checkout with the same file:
``PYTHONPATH=/path/to/that/tree .venv/bin/python bench/upstream_hop.py ...``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from typing import Any

import anyio
import orjson

WARM_UP_PER_STREAM = 10
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n")


def events(tokens: int) -> list[bytes]:
    """A worker's SSE events for one answer, each framed as one chunk."""
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish}]}

    payloads = [chunk({"role": "assistant", "content": ""})]
    payloads += [chunk({"content": f" w{i}"}) for i in range(tokens)]
    payloads.append(chunk({}, "stop"))
    payloads.append({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                     "model": "m", "choices": [],
                     "usage": {"prompt_tokens": 7, "completion_tokens": tokens,
                               "total_tokens": 7 + tokens}})
    wire = [b"data: " + orjson.dumps(p) + b"\n\n" for p in payloads] + [b"data: [DONE]\n\n"]
    return [b"%x\r\n" % len(e) + e + b"\r\n" for e in wire]


class _Worker(asyncio.Protocol):
    """Keep-alive HTTP/1.1: each POST gets the stream, one write per event."""

    def __init__(self, answer: list[bytes]) -> None:
        self.answer = answer
        self.buffer = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            start = head.find(b"content-length:")
            length = int(head[start + 15:].split(b"\r\n", 1)[0]) if start >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            asyncio.get_running_loop().create_task(self.answer_one())

    async def answer_one(self) -> None:
        first, *rest = self.answer
        self.transport.write(HEAD + b"\r\n" + first)
        for event in rest:
            await asyncio.sleep(0)  # each event its own segment, as tokens are
            self.transport.write(event)
        self.transport.write(b"0\r\n\r\n")


async def serve(port: int, tokens: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Worker(events(tokens)), "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


async def measure(total: int, streams: int, tokens: int, port: int) -> dict[str, Any]:
    from gateway.corridor.attempt import upstream_chunk, upstream_events
    from gateway.upstream.client import WorkerClient

    client = WorkerClient()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = orjson.dumps({"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    expected = tokens + 4  # role, tokens, finish, usage, [DONE]
    ids = iter(range(10**9))

    async def one() -> None:
        response = await client.open_stream("w", url, body, f"r{next(ids)}")
        seen = 0
        async for event in upstream_events("w", response):
            upstream_chunk(event)
            seen += 1
        if seen != expected:
            raise RuntimeError(f"read {seen} events, not {expected}")

    async def run(per_stream: int) -> None:
        async def lane() -> None:
            for _ in range(per_stream):
                await one()

        await asyncio.gather(*(lane() for _ in range(streams)))

    try:
        await run(WARM_UP_PER_STREAM)
        cpu, wall = time.process_time(), time.perf_counter()
        await run(total // streams)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await client.aclose()
    done = (total // streams) * streams
    return {"streams": streams, "requests": done, "tokens": tokens,
            "cpu_ms_per_request": round(cpu * 1000 / done, 4),
            "requests_per_s": round(done / wall, 1)}


def main(args: list[str]) -> None:
    if args[0] == "serve":
        asyncio.run(serve(int(args[1]), int(args[2])))
        return
    total, streams = int(args[0]), int(args[1])
    tokens = int(args[2]) if len(args) > 2 else 8
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "serve", str(port), str(tokens)],
                              stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        # On uvloop, as ``hedgerow gateway`` runs (``hedgerow.cli``).
        print(json.dumps(anyio.run(measure, total, streams, tokens, port,
                                   backend_options={"use_uvloop": True})))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
