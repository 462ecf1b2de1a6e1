"""``hedgerow bench run URL``: drive any OpenAI-compatible server and report.

Open loop (``--rate`` Poisson arrivals/s, latency from the intended send time)
or closed loop (``--concurrency`` users back to back). Writes the summary as
JSON (also printed as the last line), a markdown table, the per-request
records, and PNG plots (TTFT and end-to-end latency: CDF and over time, per
request tag) into ``--out``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import orjson

from bench.loadgen import ClosedLoop, OpenLoop, RequestSpec, Target, run_load
from bench.records import LoadResult

PERCENTILE_KEYS = ("p50", "p95", "p99", "p999")


@dataclass(frozen=True)
class RunOptions:
    url: str
    model: str
    prompt: str
    max_tokens: int
    http_version: Literal["1.1", "2", "3"]
    ca_file: Path | None
    api_key: str | None
    rate: float | None
    concurrency: int | None
    duration_s: float | None
    count: int | None
    out: Path | None
    seed: int = 1


def chat_factory(model: str, prompt: str, max_tokens: int) -> Callable[[int, random.Random], RequestSpec]:
    def factory(index: int, rng: random.Random) -> RequestSpec:
        body = {"model": model, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": prompt}]}
        return RequestSpec("chat", body)
    return factory


def run_bench(options: RunOptions) -> dict[str, Any]:
    if (options.rate is None) == (options.concurrency is None):
        raise SystemExit("hedgerow bench run: give exactly one of --rate or --concurrency")
    if options.duration_s is None and options.count is None:
        raise SystemExit("hedgerow bench run: give --duration and/or --count")
    load: OpenLoop | ClosedLoop
    if options.rate is not None:
        load = OpenLoop(rate_per_s=options.rate, duration_s=options.duration_s, count=options.count)
    else:
        assert options.concurrency is not None
        load = ClosedLoop(options.concurrency, duration_s=options.duration_s, count=options.count)
    headers = {"authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    target = Target(options.url.rstrip("/"), http_version=options.http_version,
                    ca_file=options.ca_file, headers=headers)
    factory = chat_factory(options.model, options.prompt, options.max_tokens)
    result = anyio.run(lambda: run_load(target, load, factory, seed=options.seed))
    summary = result.summary()
    summary["target"] = {"url": options.url, "http_version": options.http_version,
                         "model": options.model}
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
        (options.out / "records.json").write_bytes(orjson.dumps(result.record_dicts()))
        (options.out / "summary.md").write_text(markdown(summary))
        write_plots(result, options.out)
    return summary


def write_plots(result: LoadResult, out: Path) -> list[Path]:
    """``ttft_*.png`` and ``e2e_*.png`` (CDF, over time) of ``result``, one series per tag."""
    from bench.plots import write_latency_plots  # matplotlib: only when plots are asked for

    tags = sorted({record.tag for record in result.records})
    ttft = {tag: [(r.intended_s, r.ttft_s) for r in result.records
                  if r.tag == tag and r.ttft_s is not None] for tag in tags}
    e2e = {tag: [(r.intended_s, r.e2e_s) for r in result.records
                 if r.tag == tag and r.ok and r.e2e_s is not None] for tag in tags}
    title = f"{result.load.get('mode', '')} loop"
    return [*write_latency_plots(out, ttft, title=title, metric="TTFT", prefix="ttft"),
            *write_latency_plots(out, e2e, title=title, metric="end-to-end", prefix="e2e")]


def markdown(summary: dict[str, Any]) -> str:
    overall = summary["overall"]
    lines = [
        f"# {summary['target']['url']} over HTTP/{summary['target']['http_version']}",
        "",
        f"load: `{orjson.dumps(summary['load']).decode()}`, wall {summary['wall_s']} s; "
        f"{overall['ok']}/{overall['requests']} ok, {overall['throughput_rps']} req/s, "
        f"{overall['tokens_per_s']} tokens/s; errors {overall['errors'] or 'none'}",
        "",
        "| ms | " + " | ".join(PERCENTILE_KEYS) + " | max |",
        "|---|" + "---|" * (len(PERCENTILE_KEYS) + 1),
    ]
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        row = overall[name]
        cells = [_cell(row.get(key)) for key in (*PERCENTILE_KEYS, "max")]
        lines.append(f"| {name.removesuffix('_ms')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    return "–" if value is None else f"{value:.1f}"
