"""The browser chat page served at ``GET /``: one dependency-free HTML file.

No build step and no external resources. It streams with ``fetch`` and a
``ReadableStream``, parses SSE as the HTML standard defines it (``data:``,
``event:``, ``id:`` fields; ``:`` comment lines such as heartbeats are
ignored), renders tokens as they arrive, and shows time to first token,
tokens/s, the protocol the browser used (``nextHopProtocol`` from the
Resource Timing API: ``h2``, ``h3``...), the worker, cache and hedge headers
and the request id. The model picker lists ``/v1/models``; Max tokens is optional. Stop (or Escape)
aborts the fetch and posts ``…/{request_id}/cancel``, so the gateway stops
the generation at once (a client that just went away would keep it alive for
``streams.resume_grace_ms``, waiting for a resume). A stream cut by the network is resumed from the last
event id (``GET /v1/chat/completions/{request_id}/events`` with
``Last-Event-ID``) a few times before the page gives up.

Accessible: every control has a label, the answer is an ``aria-live`` log
(``aria-busy`` while streaming, so screen readers read it once, whole), errors
are ``role="alert"``, Ctrl/Cmd+Enter sends. Fits a phone-sized viewport.
``window.hedgerow.SseParser`` is exposed for tests.
"""

import base64
import hashlib

CHAT_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>Hedgerow chat</title>
<style>
  *, *::before, *::after { box-sizing: border-box; }
  body { font: 16px/1.5 system-ui, sans-serif; margin: 0 auto; max-width: 46rem; padding: 1rem; }
  h1 { font-size: 1.4rem; margin: 0 0 .75rem; }
  form { display: grid; gap: .5rem; grid-template-columns: 1fr auto auto; align-items: end; }
  .field { display: grid; gap: .2rem; grid-column: 1 / -1; min-width: 0; }
  .row { display: flex; gap: .5rem; grid-column: 1 / -1; }
  .row .grow { flex: 1; }
  #max-tokens { width: 7.5rem; padding: .35rem; font: inherit; }
  .field label { font-weight: 600; font-size: .9rem; }
  select, textarea, button { font: inherit; max-width: 100%; }
  select { padding: .35rem; }
  textarea { min-height: 4.5rem; resize: vertical; padding: .4rem; width: 100%; }
  button { padding: .45rem 1.1rem; border-radius: .4rem; border: 1px solid #567; cursor: pointer; }
  button:disabled { opacity: .5; cursor: default; }
  #send { background: #2d6a4f; color: #fff; border-color: #2d6a4f; }
  .hint { grid-column: 1; font-size: .8rem; color: #666; align-self: center; }
  :focus-visible { outline: 3px solid #f4a261; outline-offset: 2px; }
  #output { white-space: pre-wrap; overflow-wrap: anywhere; border: 1px solid #bbb;
            border-radius: .5rem; padding: .75rem; min-height: 8rem; margin: .75rem 0 .5rem; }
  #output:empty::before { content: "The answer appears here."; color: #888; }
  #error:not(:empty) { color: #b00020; border-left: 4px solid #b00020; padding: .25rem .5rem;
                       margin: .5rem 0; overflow-wrap: anywhere; }
  dl { display: grid; grid-template-columns: repeat(auto-fill, minmax(9rem, 1fr)); gap: .4rem .75rem;
       margin: 0; font-size: .85rem; }
  dl div { min-width: 0; }
  dt { color: #666; }
  dd { margin: 0; font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
  .visually-hidden { position: absolute; width: 1px; height: 1px; overflow: hidden;
                     clip: rect(0 0 0 0); white-space: nowrap; }
</style>
</head>
<body>
<main>
<h1>Hedgerow chat</h1>
<form id="form" aria-describedby="hint">
  <div class="row">
    <div class="field grow">
      <label for="model">Model</label>
      <select id="model" name="model"></select>
    </div>
    <div class="field">
      <label for="max-tokens">Max tokens</label>
      <input id="max-tokens" name="max_tokens" type="number" min="1" inputmode="numeric"
             placeholder="default">
    </div>
  </div>
  <div class="field">
    <label for="prompt">Message</label>
    <textarea id="prompt" name="prompt" required>Write a haiku about hedgerows.</textarea>
  </div>
  <span id="hint" class="hint">Ctrl+Enter sends, Escape stops.</span>
  <button id="send" type="submit">Send</button>
  <button id="stop" type="button" disabled>Stop</button>
</form>
<h2 class="visually-hidden" id="answer-heading">Answer</h2>
<div id="output" role="log" aria-live="polite" aria-labelledby="answer-heading"></div>
<div id="error" role="alert"></div>
<h2 class="visually-hidden">Statistics</h2>
<dl id="stats">
  <div><dt>Status</dt><dd id="status">idle</dd></div>
  <div><dt>Time to first token</dt><dd id="ttft">–</dd></div>
  <div><dt>Tokens/s</dt><dd id="rate">–</dd></div>
  <div><dt>Tokens</dt><dd id="tokens">0</dd></div>
  <div><dt>Protocol</dt><dd id="protocol">–</dd></div>
  <div><dt>Cache</dt><dd id="cache">–</dd></div>
  <div><dt>Hedged</dt><dd id="hedged">–</dd></div>
  <div><dt>Worker</dt><dd id="worker">–</dd></div>
  <div><dt>Request id</dt><dd id="request-id">–</dd></div>
</dl>
</main>
<script>
"use strict";
// SSE as the HTML standard parses it: fields data/event/id, ":" comments ignored,
// CR, LF or CRLF line ends, chunks split anywhere (also between CR and LF).
class SseParser {
  constructor() { this.buffer = ""; this.data = []; this.event = ""; this.lastEventId = ""; this.sawCR = false; }
  feed(text) {
    const events = [];
    if (this.sawCR && text.startsWith("\\n")) text = text.slice(1);
    this.sawCR = false;
    this.buffer += text;
    let start = 0;
    for (;;) {
      const cr = this.buffer.indexOf("\\r", start), lf = this.buffer.indexOf("\\n", start);
      if (cr < 0 && lf < 0) break;
      const end = cr < 0 ? lf : lf < 0 ? cr : Math.min(cr, lf);
      let next = end + 1;
      if (end === cr && this.buffer[end + 1] === "\\n") next++;
      else if (end === cr && end + 1 === this.buffer.length) this.sawCR = true;
      const event = this.line(this.buffer.slice(start, end));
      if (event) events.push(event);
      start = next;
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }
  line(line) {
    if (line === "") {
      const event = this.data.length ? {type: this.event || "message", data: this.data.join("\\n"), id: this.lastEventId} : null;
      this.data = []; this.event = "";
      return event;
    }
    if (line.startsWith(":")) return null;  // a comment: heartbeats
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.event = value;
    else if (field === "id" && !value.includes("\\0")) this.lastEventId = value;
    return null;
  }
}
window.hedgerow = {SseParser};

const $ = (id) => document.getElementById(id);
const RESUME_ATTEMPTS = 3;
let controller = null;
let current = null;  // the run being streamed

// Stop: abort the fetch, and tell the gateway to stop the generation now
// (a client that merely went away keeps it alive a few seconds for a resume).
function stop() {
  if (!controller) return;
  controller.abort();
  if (current && current.requestId) {
    fetch(`/v1/chat/completions/${encodeURIComponent(current.requestId)}/cancel`,
          {method: "POST", keepalive: true}).catch(() => {});
  }
}

function protocolOf(url) {
  const entries = performance.getEntriesByType("resource").filter(e => e.name === url && e.nextHopProtocol);
  if (entries.length) return entries[entries.length - 1].nextHopProtocol;
  const nav = performance.getEntriesByType("navigation")[0];
  return (nav && nav.nextHopProtocol) || "–";
}

function showProtocol(url) { $("protocol").textContent = protocolOf(url); }

async function loadModels() {
  const url = new URL("/v1/models", location.href).href;
  try {
    const response = await fetch(url);
    const list = await response.json();
    for (const m of list.data) {
      if (m.kind === "embedding") continue;  // /v1/embeddings only: not a chat model
      const option = document.createElement("option");
      option.value = option.textContent = m.id;
      $("model").append(option);
    }
  } catch (error) {
    $("error").textContent = "Could not list models: " + error.message;
  }
  showProtocol(url);
}

function showHeaders(response) {
  $("cache").textContent = response.headers.get("x-hedgerow-cache") || "–";
  $("hedged").textContent = {"1": "yes", "0": "no"}[response.headers.get("x-hedgerow-hedged")] || "–";
  $("worker").textContent = response.headers.get("x-hedgerow-worker") || "–";
  $("request-id").textContent = response.headers.get("x-request-id") || "–";
}

async function errorMessage(response) {
  try { return (await response.json()).error.message; } catch { return response.statusText; }
}

// One run of a stream: parse events, render tokens. Returns "done" or throws.
async function pump(response, parser, run) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return run.finished ? "done" : "cut";
    for (const event of parser.feed(value)) handleEvent(event, run);
    updateStats(run);
  }
}

function handleEvent(event, run) {
  if (event.data === "[DONE]") { run.finished = true; return; }
  let chunk;
  try { chunk = JSON.parse(event.data); } catch { chunk = {error: {message: event.data}}; }
  if (event.type === "error" || chunk.error) {
    run.finished = run.failed = true;
    $("error").textContent = "Error: " + ((chunk.error && chunk.error.message) || event.data);
    return;
  }
  if (chunk.usage && chunk.usage.completion_tokens) run.usageTokens = chunk.usage.completion_tokens;
  const choice = chunk.choices && chunk.choices[0];
  const text = (choice && choice.delta && choice.delta.content) || (choice && choice.text) || "";
  if (!text) return;
  if (run.first === null) run.first = performance.now();
  run.last = performance.now();
  run.tokens++;
  $("output").append(document.createTextNode(text));
}

function updateStats(run) {
  if (run.first !== null) $("ttft").textContent = Math.round(run.first - run.started) + " ms";
  const tokens = run.usageTokens || run.tokens;
  $("tokens").textContent = String(tokens);
  if (run.tokens > 1) $("rate").textContent = ((run.tokens - 1) / ((run.last - run.first) / 1000)).toFixed(1);
}

async function resume(run, parser) {
  for (let attempt = 1; attempt <= RESUME_ATTEMPTS; attempt++) {
    $("status").textContent = `reconnecting (${attempt}/${RESUME_ATTEMPTS})`;
    await new Promise(ok => setTimeout(ok, 250 * attempt));
    try {
      const response = await fetch(`/v1/chat/completions/${encodeURIComponent(run.requestId)}/events`, {
        signal: controller.signal,
        headers: {"accept": "text/event-stream", "last-event-id": parser.lastEventId}});
      if (!response.ok) {  // 404 unknown, 410 expired: final; 5xx: try again
        const refused = new Error(`resume refused: ${response.status} ${await errorMessage(response)}`);
        refused.final = response.status < 500;
        throw refused;
      }
      $("status").textContent = "streaming";
      if (await pump(response, parser, run) === "done") return;
    } catch (error) {
      if (error.name === "AbortError" || error.final || attempt === RESUME_ATTEMPTS) throw error;
    }
  }
  throw new Error("the stream was cut and could not be resumed");
}

async function send() {
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  $("output").textContent = ""; $("error").textContent = "";
  for (const id of ["ttft", "rate", "cache", "hedged", "worker", "request-id"]) $(id).textContent = "–";
  $("tokens").textContent = "0";
  $("status").textContent = "waiting";
  $("output").setAttribute("aria-busy", "true");
  const url = new URL("/v1/chat/completions", location.href).href;
  const run = {started: performance.now(), first: null, last: null, tokens: 0, usageTokens: 0,
               finished: false, failed: false, requestId: null};
  const parser = new SseParser();
  current = run;
  try {
    const response = await fetch(url, {
      method: "POST", signal: controller.signal,
      headers: {"content-type": "application/json", "accept": "text/event-stream"},
      body: JSON.stringify({model: $("model").value, stream: true,
                            stream_options: {include_usage: true},
                            ...($("max-tokens").value ? {max_tokens: Number($("max-tokens").value)} : {}),
                            messages: [{role: "user", content: $("prompt").value}]}),
    });
    showHeaders(response);
    run.requestId = response.headers.get("x-request-id");
    if (!response.ok) throw new Error(`${response.status}: ${await errorMessage(response)}`);
    $("status").textContent = "streaming";
    let outcome;
    try { outcome = await pump(response, parser, run); }
    catch (error) { if (error.name === "AbortError") throw error; outcome = "cut"; }
    if (outcome === "cut" && run.requestId && parser.lastEventId) await resume(run, parser);
    else if (outcome === "cut") throw new Error("the stream ended before it finished");
    $("status").textContent = run.failed ? "failed" : "done";
  } catch (error) {
    if (error.name === "AbortError") $("status").textContent = "stopped";
    else { $("status").textContent = "failed"; $("error").textContent = "Error: " + error.message; }
  } finally {
    updateStats(run);
    $("output").setAttribute("aria-busy", "false");
    $("send").disabled = false; $("stop").disabled = true; controller = null;
    // Resource Timing records the request once its body ended.
    setTimeout(() => showProtocol(url), 0);
  }
}

$("form").addEventListener("submit", (event) => { event.preventDefault(); if (!controller) send(); });
$("stop").addEventListener("click", stop);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); $("form").requestSubmit(); }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && controller) { stop(); $("prompt").focus(); }
});
loadModels();
</script>
</body>
</html>
"""


def _inline_hash(tag: str) -> str:
    """The CSP source that admits the page's one inline ``<tag>`` element, by its SHA-256."""
    body = CHAT_PAGE.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
    return f"'sha256-{digest}'"


# Nothing runs or styles the page but its own inline script and style (by
# hash, so an injected element would not run); it talks only to its origin
# and cannot be framed. Sent with the page by ``GatewayApp.page``.
CHAT_PAGE_CSP = (
    "default-src 'none'; "
    f"script-src {_inline_hash('script')}; "
    f"style-src {_inline_hash('style')}; "
    "connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
