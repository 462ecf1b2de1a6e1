"""The browser chat page served at ``GET /``: one dependency-free HTML file.

It streams with ``fetch`` and a ``ReadableStream``, renders tokens as they
arrive, shows time to first token and tokens/s, and its Stop button aborts
the request (the gateway then cancels the generation upstream).
"""

CHAT_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Hedgerow chat</title>
<style>
  body { font: 16px/1.5 system-ui, sans-serif; margin: 0 auto; max-width: 46rem; padding: 1rem; }
  #log { white-space: pre-wrap; border: 1px solid #ccc; border-radius: .5rem; padding: .75rem;
         min-height: 10rem; margin: .75rem 0; }
  form { display: flex; gap: .5rem; flex-wrap: wrap; }
  textarea { flex: 1 1 20rem; font: inherit; min-height: 3rem; }
  button, select { font: inherit; padding: .4rem .9rem; }
  #stats { color: #555; font-size: .9rem; }
</style>
</head>
<body>
<h1>Hedgerow</h1>
<form id="form">
  <label for="model">Model</label>
  <select id="model" name="model"></select>
  <label for="prompt" class="visually-hidden">Message</label>
  <textarea id="prompt" name="prompt" required>Write a haiku about hedgerows.</textarea>
  <button id="send" type="submit">Send</button>
  <button id="stop" type="button" disabled>Stop</button>
</form>
<div id="log" role="log" aria-live="polite"></div>
<div id="stats" aria-live="polite"></div>
<script>
const $ = (id) => document.getElementById(id);
let controller = null;
fetch("/v1/models").then(r => r.json()).then(list => {
  for (const m of list.data) { const o = document.createElement("option"); o.textContent = m.id; $("model").append(o); }
});
$("stop").onclick = () => controller && controller.abort();
$("form").onsubmit = async (event) => {
  event.preventDefault();
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false; $("log").textContent = "";
  const started = performance.now(); let first = null; let tokens = 0;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal, headers: {"content-type": "application/json"},
      body: JSON.stringify({model: $("model").value, stream: true,
                            messages: [{role: "user", content: $("prompt").value}]}),
    });
    const meta = `worker ${response.headers.get("x-hedgerow-worker")}, cache ${response.headers.get("x-hedgerow-cache")}, hedged ${response.headers.get("x-hedgerow-hedged")}`;
    if (!response.ok) { $("log").textContent = (await response.json()).error.message; return; }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
        const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        const data = block.split("\\n").filter(l => l.startsWith("data:")).map(l => l.slice(5).trim()).join("");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) { $("log").textContent += "\\n[error] " + chunk.error.message; continue; }
        const text = (chunk.choices[0] && chunk.choices[0].delta.content) || "";
        if (text) { if (first === null) first = performance.now(); tokens++; $("log").textContent += text; }
      }
      const secs = (performance.now() - (first ?? started)) / 1000;
      $("stats").textContent = `TTFT ${first ? Math.round(first - started) : "–"} ms · ${(tokens / Math.max(secs, 1e-3)).toFixed(1)} tokens/s · ${meta}`;
    }
  } catch (error) {
    if (error.name !== "AbortError") $("log").textContent += "\\n[error] " + error.message;
    else $("log").textContent += " [stopped]";
  } finally { $("send").disabled = false; $("stop").disabled = true; controller = null; }
};
</script>
</body>
</html>
"""
