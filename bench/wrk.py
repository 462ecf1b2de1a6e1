"""Closed-loop latency from ``wrk``, a C client, so the client's own cost stays out.

The Python client (httpx) adds about 2 ms and its own tail to every request on
these 2-core VMs; for sub-millisecond answers such as cache hits that is more
than the gateway's part. ``wrk -t1 -c1 --latency`` keeps one TLS connection
and sends the next request as soon as the last answer arrived, and reports
latency percentiles from its own histogram. Debian package ``wrk``; without it
callers get None and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_PERCENTILE = re.compile(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", re.MULTILINE)
_REQUESTS = re.compile(r"(\d+) requests in ([\d.]+)(us|ms|s|m)")
_NON_2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_TO_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


@dataclass(frozen=True)
class WrkLatency:
    requests: int
    non_2xx: int
    p50_ms: float
    p99_ms: float

    def summary(self) -> dict[str, object]:
        return {"client": "wrk -t1 -c1 (C, one TLS connection, closed loop)",
                "requests": self.requests, "non_2xx": self.non_2xx,
                "p50_ms": self.p50_ms, "p99_ms": self.p99_ms}


def parse_wrk(output: str) -> WrkLatency:
    percentiles = {int(q): float(v) * _TO_MS[unit] for q, v, unit in _PERCENTILE.findall(output)}
    requests = _REQUESTS.search(output)
    if requests is None or set(percentiles) != {50, 99}:
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    non_2xx = _NON_2XX.search(output)
    return WrkLatency(int(requests.group(1)), int(non_2xx.group(1)) if non_2xx else 0,
                      round(percentiles[50], 3), round(percentiles[99], 3))


def wrk_latency(url: str, seconds: float, workdir: Path,
                json_body: bytes | None = None) -> WrkLatency | None:
    """GET ``url`` (or POST ``json_body``) for ``seconds``; None when wrk is missing."""
    binary = shutil.which("wrk")
    if binary is None:
        return None
    script: list[str] = []
    if json_body is not None:
        lua = workdir / "wrk-post.lua"
        body = json_body.decode()
        if "]==]" in body:  # a Lua long string of level 2 holds anything else verbatim
            raise ValueError("the body must not contain ']==]'")
        lua.write_text('wrk.method = "POST"\n'
                       'wrk.headers["Content-Type"] = "application/json"\n'
                       f"wrk.body = [==[{body}]==]\n")
        script = ["-s", str(lua)]
    done = subprocess.run([binary, "-t1", "-c1", f"-d{max(1, round(seconds))}s", "--latency",
                           *script, url], capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return parse_wrk(done.stdout)
