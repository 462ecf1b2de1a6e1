"""Flushes and writes per HTTP/2 read: what one received chunk costs the gateway.

A raw HTTP/2 client (``bench.h2raw``) sends, on one connection, ``--requests``
POSTs each as ONE write (HEADERS, ``--frames`` DATA frames, END_STREAM), and
waits for each answer. The server is ``gateway.edge.transport.serve`` in a child
process, counting:

- ``reader_flushes``: ``H2Connection.data_to_send`` calls (hypercorn's flush)
  from the task that reads the connection (the task with the most),
- ``raw_sends``: ``RawData`` events handed to ``TCPServer.protocol_send``
  (each takes the connection's send lock, writes and drains),
- ``transport_writes``: writes that reach the TLS transport (after
  ``gateway.edge.write_coalescing``): a TLS record and a ``send`` each,
- ``send_syscalls`` (with ``--strace``): ``sendto``/``sendmsg``/``write`` on
  the server process, as ``strace -c -f`` counts them,
- ``cpu_us``: the server process's CPU time (run without ``--strace`` for
  this one: tracing slows every syscall).

Reported per request (per received chunk), setup subtracted (a run with 0
requests). Runs on any checkout that has ``gateway.edge.transport``, so the same
file measures before and after a change::

    PYTHONPATH=$PWD python -m bench.h2_flushes --frames 1 8 32 --requests 200 [--strace]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hyperframe.frame import Frame

from bench.h2raw import RawH2


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _serve(state: Path) -> None:
    import anyio
    from h2.connection import H2Connection
    from hypercorn.asyncio.tcp_server import TCPServer
    from hypercorn.events import RawData

    from gateway.edge.devcert import ensure_dev_certificate
    from gateway.edge.transport import build_config, serve
    from gateway.edge.write_coalescing import CoalescingWriter

    counts: Counter[str] = Counter()
    writers: list[Any] = []
    data_to_send = H2Connection.data_to_send
    protocol_send = TCPServer.protocol_send
    coalescing_init = CoalescingWriter.__init__

    per_task: Counter[int] = Counter()

    def counted_data_to_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The task that reads the connection flushes the most (one per read at
        # least); the application's and the sending task's are short or few.
        per_task[id(asyncio.current_task())] += 1
        return data_to_send(self, *args, **kwargs)

    async def counted_protocol_send(self: Any, event: Any) -> None:
        if isinstance(event, RawData):
            counts["raw_sends"] += 1
        await protocol_send(self, event)

    def kept_init(self: Any, *args: Any, **kwargs: Any) -> None:
        coalescing_init(self, *args, **kwargs)
        writers.append(self)

    H2Connection.data_to_send = counted_data_to_send  # type: ignore[method-assign]
    TCPServer.protocol_send = counted_protocol_send  # type: ignore[method-assign]
    CoalescingWriter.__init__ = kept_init  # type: ignore[method-assign]

    cert = ensure_dev_certificate(state)
    config = build_config(host="127.0.0.1", port=0, certfile=cert.cert, keyfile=cert.key,
                          http3=False)

    async def main() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve, _app, config, stop.wait)
            print(json.dumps({"port": port, "ca": str(cert.ca_cert)}), flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)
            counts["transport_writes"] = sum(writer.writes for writer in writers)
            counts["reader_flushes"] = max(per_task.values(), default=0)
            counts["cpu_us"] = int(time.process_time() * 1e6)
            print(json.dumps(dict(counts)), flush=True)
            stop.set()

    anyio.run(main)


def _client(port: int, ca: str, requests: int, frames: int) -> None:
    conn = RawH2(port, ca)
    try:
        conn.read(0.2)
        for _ in range(requests):
            stream = conn.new_stream()
            batch: list[Frame] = [conn.request_headers(stream, "/", "POST", end_stream=False)]
            batch += [conn.data(stream, b"y" * 100) for _ in range(frames)]
            batch.append(conn.data(stream, b"", end_stream=True))
            conn.send(*batch)
            deadline = time.monotonic() + 5
            while stream not in conn.read(0.05).ended_streams:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stream {stream} unanswered")
        conn.read(0.2)
    finally:
        conn.close()


def _syscalls(strace_output: str) -> int:
    total = 0
    for line in strace_output.splitlines():
        fields = line.split()
        if fields and fields[-1] in ("sendto", "sendmsg", "write", "writev"):
            total += int(fields[3]) if re.fullmatch(r"\d+", fields[3]) else 0
    return total


def run_once(requests: int, frames: int, use_strace: bool) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as state:
        server = subprocess.Popen([sys.executable, "-m", "bench.h2_flushes", "--serve", state],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert server.stdin is not None and server.stdout is not None
        started = json.loads(server.stdout.readline())
        tracer = None
        if use_strace:
            trace_file = Path(state) / "strace.txt"
            tracer = subprocess.Popen(["strace", "-c", "-f", "-o", str(trace_file),
                                       "-e", "trace=sendto,sendmsg,write,writev",
                                       "-p", str(server.pid)], stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        _client(started["port"], started["ca"], requests, frames)
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(10)
        server.stdin.close()
        counts: dict[str, int] = json.loads(server.stdout.readline())
        server.wait(30)
        if tracer is not None:
            counts["send_syscalls"] = _syscalls(trace_file.read_text())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", metavar="STATE_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--strace", action="store_true")
    args = parser.parse_args()
    if args.serve:
        _serve(Path(args.serve))
        return
    print(f"{'DATA frames/read':>16} {'reader flushes':>15} {'raw sends':>10} "
          f"{'transport writes':>17} {'send syscalls':>14} {'server CPU us':>13}  (per request)")
    for frames in args.frames:
        base = run_once(0, frames, args.strace)
        full = run_once(args.requests, frames, args.strace)
        per = {key: (full.get(key, 0) - base.get(key, 0)) / args.requests
               for key in ("reader_flushes", "raw_sends", "transport_writes", "send_syscalls",
                           "cpu_us")}
        syscalls = f"{per['send_syscalls']:14.2f}" if args.strace else f"{'-':>14}"
        print(f"{frames:>16} {per['reader_flushes']:15.2f} {per['raw_sends']:10.2f} "
              f"{per['transport_writes']:17.2f} {syscalls} {per['cpu_us']:11.0f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
