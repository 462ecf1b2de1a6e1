"""CPU per parsed streamed reply: ``gateway.upstream.http1`` next to h11 (and httptools if present).

One reply as a worker streams it: a 200 head, then 300 SSE events (chat
completion chunks of about 190 bytes) chunked, then ``data: [DONE]`` and the
last chunk. Each parser is driven over the same bytes, cut two ways:

* ``per_event``: one network read per SSE event (a token per write with
  TCP_NODELAY, the streaming case at low load);
* ``mss``: 1,448-byte reads (coalesced writes under load), cut anywhere,
  mid-chunk-size line included.

Ours is driven as ``gateway.upstream.worker_http`` drives it (``parse_head``,
``body_framing``, one ``decode`` per read). h11 is driven as a pooled client
would: per reply, ``send`` the request events, feed each read with
``receive_data`` and pull events until ``NEED_DATA``, then
``start_next_cycle``; ``h11_request_us`` is its request half alone, so the
parsing half is the difference. httptools (llhttp, C) is measured when it is
importable: a ``HttpResponseParser`` per reply, ``feed_data`` per read, body
bytes collected by its ``on_body`` callback.

Prints one JSON line: microseconds per reply (best of ``--repeat`` runs of
``--number`` replies each), and h11/ours ratios.

    PYTHONPATH=. .venv/bin/python -m bench.http1_parse [--number 200] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import timeit
from importlib.metadata import version
from collections.abc import Callable
from typing import Any

import h11

from gateway.upstream.http1 import body_framing, parse_head

EVENTS = 300
MSS = 1448
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"x-request-id: 7f3c2a9e-1b4d-4c8e-9f0a-2d6b8e1c3a5f\r\n"
        b"date: Tue, 01 Dec 2026 11:00:00 GMT\r\ntransfer-encoding: chunked\r\n\r\n")


def sse_event(index: int) -> bytes:
    return (b'data: {"id":"chatcmpl-7f3c2a9e","object":"chat.completion.chunk",'
            b'"created":1796122800,"model":"qwen2.5-0.5b","choices":[{"index":0,'
            b'"delta":{"content":" tok%d"},"finish_reason":null}]}\n\n' % index)


def reply_reads() -> tuple[list[bytes], list[bytes], bytes]:
    """The reply cut per event and per MSS, and the body both must decode."""
    events = [sse_event(i) for i in range(EVENTS)] + [b"data: [DONE]\n\n"]
    framed = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
    per_event = [HEAD + framed[0]] + framed[1:-1] + [framed[-1] + b"0\r\n\r\n"]
    whole = b"".join(per_event)
    mss = [whole[i:i + MSS] for i in range(0, len(whole), MSS)]
    return per_event, mss, b"".join(events)


def ours(reads: list[bytes]) -> bytes:
    buffer = bytearray()
    head = None
    out = []
    for data in reads:
        buffer += data
        if head is None:
            head = parse_head(buffer)
            if head is None:
                continue
            body = body_framing(head)
        if buffer:
            out.append(body.decode(buffer))
    assert body.done
    return b"".join(out)


REQUEST = h11.Request(method="POST", target="/v1/chat/completions",
                      headers=[("host", "worker:8000"), ("content-type", "application/json"),
                               ("x-request-id", "7f3c2a9e"), ("content-length", "64")])
REQUEST_BODY = h11.Data(data=b"x" * 64)


def h11_client() -> Callable[[list[bytes]], bytes]:
    conn = h11.Connection(our_role=h11.CLIENT)

    def one_reply(reads: list[bytes]) -> bytes:
        conn.send(REQUEST)
        conn.send(REQUEST_BODY)
        conn.send(h11.EndOfMessage())
        out = []
        for data in reads:
            conn.receive_data(data)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    break
                if type(event) is h11.Data:
                    out.append(event.data)
                elif type(event) is h11.EndOfMessage:
                    conn.start_next_cycle()
                    return b"".join(out)
        raise AssertionError("h11 did not see the end of the reply")
    return one_reply


def h11_request_only() -> Callable[[], None]:
    conn = h11.Connection(our_role=h11.CLIENT)

    def one_request() -> None:
        conn.send(REQUEST)
        conn.send(REQUEST_BODY)
        conn.send(h11.EndOfMessage())
        conn.receive_data(b"HTTP/1.1 204 No Content\r\n\r\n")  # the least reply to cycle
        while type(conn.next_event()) is not h11.EndOfMessage:
            pass
        conn.start_next_cycle()
    return one_request


def httptools_client() -> Callable[[list[bytes]], bytes] | None:
    try:
        import httptools
    except ImportError:
        return None

    class Sink:
        def __init__(self) -> None:
            self.out: list[bytes] = []
            self.done = False

        def on_body(self, body: bytes) -> None:
            self.out.append(body)

        def on_message_complete(self) -> None:
            self.done = True

    def one_reply(reads: list[bytes]) -> bytes:
        sink = Sink()
        parser = httptools.HttpResponseParser(sink)
        for data in reads:
            parser.feed_data(data)
        assert sink.done and parser.get_status_code() == 200
        return b"".join(sink.out)
    return one_reply


def best_us(action: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(action, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=200, help="replies per timed run")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs; the best is kept")
    args = parser.parse_args()
    per_event, mss, body = reply_reads()
    theirs, fast = h11_client(), httptools_client()
    result: dict[str, Any] = {
        "bench": "http1_parse", "events": EVENTS, "reply_bytes": len(b"".join(per_event)),
        "python": platform.python_version(), "h11": version("h11"),
    }
    result["h11_request_us"] = round(best_us(h11_request_only(), args.number, args.repeat), 1)
    for name, reads in (("per_event", per_event), ("mss", mss)):
        assert ours(reads) == body and theirs(reads) == body
        row: dict[str, Any] = {"reads": len(reads)}
        row["ours_us"] = best_us(lambda: ours(reads), args.number, args.repeat)
        row["h11_us"] = best_us(lambda: theirs(reads), args.number, args.repeat)
        if fast is not None:
            assert fast(reads) == body
            row["httptools_us"] = best_us(lambda: fast(reads), args.number, args.repeat)
        row["h11_over_ours"] = row["h11_us"] / row["ours_us"]
        result[name] = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
