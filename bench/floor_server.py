"""The HTTP stack's floor: the gateway's listener serving a stream with no corridor.

A process that serves ``POST /v1/chat/completions`` through exactly the
transport the gateway's public port uses (``gateway.edge.transport.serve``:
hypercorn 0.18 on uvloop, TLS with the given certificate, every
``hedgerow.http_stack`` patch, write coalescing) and answers each request
with a fixed SSE stream shaped like a worker's: a role chunk, ``max_tokens``
content chunks ``decode_ms`` apart (the first after ``prefill_ms``), a
finish chunk with usage, ``[DONE]``. No admission, cache, scheduler,
upstream connection or log: what is left is what any gateway built on this
stack pays to accept a request and write a token stream to a client.

The overhead scenario runs it as a fourth target: its CPU per request and
per token, beside Hedgerow's and nginx's, separates what the corridor costs
from what the HTTP server and TLS cost in Python.

    python -m bench.floor_server --port 8443 --cert cert.pem --key key.pem
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import orjson

from bench.stack import Proc, free_port
from gateway.edge.transport import build_config, serve
from hedgerow.asgi import SSE_DONE, SSE_HEADERS, handle_lifespan
from hedgerow.connection_cap import ConnectionCap

MAX_BODY = 1 << 20
MAX_TOKENS = 4096  # a stream is never longer, whatever a request asks
START_TIMEOUT_S = 30.0


def chunk(index: int, content: str | None, *, finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    delta: dict[str, Any] = ({"role": "assistant", "content": ""} if content is None
                             else {"content": content})
    body: dict[str, Any] = {"id": "chatcmpl-floor", "object": "chat.completion.chunk",
                            "created": 0, "model": "floor",
                            "choices": [] if usage else [{"index": 0, "delta": delta,
                                                          "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"


class FloorApp:
    """ASGI: every POST is answered with ``max_tokens`` streamed tokens."""

    def __init__(self, prefill_ms: float, decode_ms: float) -> None:
        self.prefill_s = prefill_ms / 1000
        self.decode_s = decode_ms / 1000

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await handle_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body") or len(body) > MAX_BODY:
                break
        try:
            tokens = int(orjson.loads(body).get("max_tokens") or 8)
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
            tokens = 8
        tokens = min(max(tokens, 1), MAX_TOKENS)
        await anyio.sleep(self.prefill_s)
        await send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)})
        await send({"type": "http.response.body", "body": chunk(0, None), "more_body": True})
        for i in range(tokens):
            if i:
                await anyio.sleep(self.decode_s)
            await send({"type": "http.response.body", "body": chunk(0, f" t{i}"),
                        "more_body": True})
        tail = (chunk(0, "", finish="length")
                + chunk(0, None, usage={"prompt_tokens": 13, "completion_tokens": tokens,
                                        "total_tokens": 13 + tokens})
                + SSE_DONE)
        await send({"type": "http.response.body", "body": tail})


async def run(port: int, cert: Path, key: Path, prefill_ms: float, decode_ms: float,
              http1: str = "hypercorn") -> None:
    config = build_config(host="127.0.0.1", port=port, certfile=cert, keyfile=key, http3=False,
                          native_http1=http1 == "native")
    stop = anyio.Event()

    async def on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(on_signal)
        # The gateway's accept loop too: the connection cap (as ``--max-connections``).
        await serve(FloorApp(prefill_ms, decode_ms), config, stop.wait,  # type: ignore[arg-type]
                    connection_cap=ConnectionCap())
        tg.cancel_scope.cancel()


def start_floor_server(root: Path, cert: Path, key: Path, *, prefill_ms: float,
                       decode_ms: float, http1: str = "hypercorn") -> tuple[Proc, str]:
    """Start the floor server as its own process; the process and its URL."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = root / f"floor-{http1}.log"
    popen = subprocess.Popen(
        [sys.executable, "-m", "bench.floor_server", "--port", str(port), "--cert", str(cert),
         "--key", str(key), "--prefill-ms", str(prefill_ms), "--decode-ms", str(decode_ms),
         "--http1", http1],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])})
    proc = Proc(f"floor-{http1}", popen, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"the floor server exited with {popen.returncode}:\n{proc.log()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return proc, f"https://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"the floor server did not listen on port {port} within "
                       f"{START_TIMEOUT_S} s:\n{proc.log()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--prefill-ms", type=float, default=2.6)  # 13 prompt tokens x 0.2 ms
    parser.add_argument("--decode-ms", type=float, default=2.0)
    parser.add_argument("--http1", choices=("hypercorn", "native"), default="hypercorn")
    args = parser.parse_args()
    anyio.run(run, args.port, args.cert, args.key, args.prefill_ms, args.decode_ms, args.http1,
              backend_options={"use_uvloop": True})


if __name__ == "__main__":
    main()
