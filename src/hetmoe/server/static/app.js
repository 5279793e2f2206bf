// hetmoe chat page: multi-turn chat over /v1/chat/completions with SSE streaming.
// Plain browser JavaScript, no build step, no outside scripts.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // [{role, content}] of the conversation so far
let modelName = null;
let aborter = null;  // AbortController of the answer being streamed

$("api-key").value = localStorage.getItem("hetmoe-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("hetmoe-api-key", $("api-key").value);
  loadModel();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;  // text only: model output is never interpreted as HTML
  $("log").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error.message}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    $("model").textContent = "(" + (await errorText(response)) + ")";
    return;
  }
  modelName = (await response.json()).data[0].id;
  $("model").textContent = modelName;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Yields the JSON payload of each `data:` line of an SSE body until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  if (modelName === null) await loadModel();
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  bubble.dataset.state = "streaming";
  setBusy(true);
  aborter = new AbortController();
  const started = performance.now();
  let firstAt = null, tokens = 0, answer = "", finish = null, failed = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: aborter.signal,
      body: JSON.stringify({
        model: modelName,
        messages: history,
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: Number($("max-tokens").value) || undefined,
        temperature: Number($("temperature").value),
      }),
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices[0];
      if (!choice) continue;
      if (choice.finish_reason) finish = choice.finish_reason;
      const piece = choice.delta.content;
      if (!piece) continue;
      if (firstAt === null) firstAt = performance.now();
      tokens += 1;
      answer += piece;
      bubble.textContent = answer;
      bubble.scrollIntoView({ block: "end" });
      const seconds = (performance.now() - firstAt) / 1000;
      if (seconds > 0) $("status").textContent = `${(tokens / seconds).toFixed(1)} tokens/s`;
    }
    const seconds = firstAt === null ? 0 : (performance.now() - firstAt) / 1000;
    const rate = seconds > 0 ? `, ${(tokens / seconds).toFixed(1)} tokens/s` : "";
    const ttft = firstAt === null ? "" : `, first token ${((firstAt - started) / 1000).toFixed(2)} s`;
    $("status").textContent = `${tokens} tokens (${finish})${rate}${ttft}`;
  } catch (err) {
    if (err.name === "AbortError") {
      $("status").textContent = "stopped";
    } else {
      failed = true;
      addMessage("error", String(err.message || err));
      $("status").textContent = "";
    }
  } finally {
    if (failed && !answer) {
      history.pop();  // the turn never happened: the user may edit and resend it
      bubble.remove();
    } else {
      history.push({ role: "assistant", content: answer });
    }
    bubble.dataset.state = "done";
    aborter = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || aborter) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => aborter && aborter.abort());
$("clear").addEventListener("click", () => {
  if (aborter) aborter.abort();
  history.length = 0;
  $("log").textContent = "";
  $("status").textContent = "";
});

loadModel();
