"""``POST /v1/embeddings`` for a model a worker or an external upstream offers.

A registration (or an upstream's policy entry) lists such models in
``embedding_models``; the gateway's own model (``gateway.corridor.embeddings``) is
answered locally and never forwarded. Embeddings are one short request and one
JSON answer, so they skip the chat scheduler's slots and queue: admission is
the tenant's (key, body limit, requests/s, checked by the caller) and each
attempt is bounded by the policy's TTFT timeout.

Which worker: ``candidates`` (sans-IO) orders the live ones by load, least
loaded first. ``forward`` tries them in that order: a failure before the
answer (unreachable, timeout, a 5xx, a body that is no embeddings list) moves
on to the next, at most ``retries.before_first_token`` times; a 400/413/422
is the client's own mistake and is not retried. Errors are mapped as chat's
(``gateway.upstream.client``): the client never sees an upstream's words or address.
The answer is relayed as the upstream sent it, with ``model`` set back to the
name the client asked for (an upstream may know it by another, ``model_map``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from gateway.corridor.attempt import UpstreamCall, external_request, request_url
from gateway.upstream.client import WorkerClient
from hedgerow.errors import HedgerowError, NoHealthyWorker, UpstreamFailed, UpstreamRejected
from hedgerow.wire import RegistrySnapshot, WorkerRecord

log = logging.getLogger("hedgerow.gateway.embed_route")

PATH = "/v1/embeddings"
# 256 texts of a 4096-dimension model as JSON floats is ~25 MB; beyond that
# the answer is refused rather than buffered.
MAX_ANSWER_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Forwarded:
    """An upstream's embeddings answer, ready to relay."""

    worker_id: str
    body: dict[str, Any]
    prompt_tokens: int | None  # the answer's ``usage.prompt_tokens``; None: it gave none


def candidates(snapshot: RegistrySnapshot, model: str) -> list[WorkerRecord]:
    """The live workers offering ``model`` for embeddings, least loaded first
    (ties by id, so the order is stable)."""
    live = [w for w in snapshot.serving_embeddings(model) if not w.load.draining]
    return sorted(live, key=lambda w: ((w.load.active + w.load.queued) / w.registration.slots,
                                       w.registration.worker_id))


async def forward(workers: WorkerClient, tried_on: Sequence[WorkerRecord],
                  call: UpstreamCall, client_model: str, attempt_timeout_s: float) -> Forwarded:
    """The first good answer from ``tried_on`` (in order); the last error if none."""
    errors: list[HedgerowError] = []
    for worker in tried_on:
        try:
            return await _one(workers, worker, call, client_model, attempt_timeout_s)
        except UpstreamRejected as rejected:  # a 400/404/413/422: not retried
            log.warning("request %s: embeddings refused by %s: %s", call.request_id,
                        worker.registration.worker_id, rejected.detail)
            raise
        except UpstreamFailed as failed:
            log.warning("embeddings on %s failed (%s): %s", worker.registration.worker_id,
                        failed.code, failed.detail)
            errors.append(failed)
    if errors:
        raise errors[-1]
    raise NoHealthyWorker("no worker offers this embedding model now", retry_after=1)


async def _one(workers: WorkerClient, worker: WorkerRecord, call: UpstreamCall,
               client_model: str, timeout_s: float) -> Forwarded:
    worker_id = worker.registration.worker_id
    url = request_url(worker.registration, call.path)
    body, headers = external_request(worker, call)
    with anyio.move_on_after(timeout_s):
        response = await workers.open_stream(worker_id, url, body, call.request_id, headers,
                                             internal=not worker.registration.external)
        try:
            raw = await WorkerClient.read_all(worker_id, response, MAX_ANSWER_BYTES)
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
        answer = checked_answer(worker_id, raw)
        answer["model"] = client_model
        usage = answer.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        counted = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
        return Forwarded(worker_id, answer, tokens if counted else None)
    raise UpstreamFailed(f"worker {worker_id} sent no embeddings within {timeout_s:.1f}s",
                         code="upstream_timeout")


def checked_answer(worker_id: str, raw: bytes) -> dict[str, Any]:
    """The upstream's body if it is an embeddings list; else ``UpstreamFailed``
    (retryable), its excerpt kept for the log only."""
    try:
        answer: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        answer = None
    if not (isinstance(answer, dict) and isinstance(answer.get("data"), list)
            and all(isinstance(item, dict) and "embedding" in item for item in answer["data"])):
        raise UpstreamFailed(f"worker {worker_id} sent no embeddings list: {raw[:512]!r}",
                             code="upstream_malformed")
    return answer


def upstream_call(request_id: str, request_json: dict[str, Any], model: str) -> UpstreamCall:
    """The client's request for ``model`` (canonical); ``external_request`` maps
    the name for an upstream that knows it by another."""
    return UpstreamCall(request_id, PATH, orjson.dumps({**request_json, "model": model}), model)
