// pdserve console: the chat playground and the live view of the stack (router/console.py).
// Same origin only: /v1/models, /v1/chat/completions (streamed) and /console/stack.
"use strict";

const $ = (id) => document.getElementById(id);
const keys = {
  api: sessionStorage.getItem("pdserve.apiKey") || "",
  admin: sessionStorage.getItem("pdserve.adminKey") || "",
};
const chat = { history: [], controller: null, model: null, images: [] };
const POLL_MS = 1000;

function authHeaders(key) {
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

function askForKeys(why) {
  $("keys-why").textContent = why;
  $("api-key").value = keys.api;
  $("admin-key").value = keys.admin;
  $("keys").hidden = false;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- chat ------------------------------------------------------------------------------

async function modelId() {
  if (chat.model) return chat.model;
  const res = await fetch("/v1/models", { headers: authHeaders(keys.api) });
  if (!res.ok) throw await apiError(res);
  chat.model = (await res.json()).data[0].id;
  return chat.model;
}

async function apiError(res) {
  let message = res.status + " " + res.statusText;
  try {
    message = (await res.json()).error.message || message;
  } catch (e) { /* not JSON */ }
  if (res.status === 401) askForKeys(message);
  return new Error(message);
}

// A user turn: its text, or with images its parts (the images as data: URLs).
function userContent(text, images) {
  if (!images.length) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return text ? [...parts, { type: "text", text }] : parts;
}

function request(content) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history, { role: "user", content });
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value || 0),
    max_tokens: Number($("max-tokens").value || 256),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

async function send(text) {
  const images = chat.images.splice(0);
  showAttached();
  const body = request(userContent(text, images));
  chat.history.push({ role: "user", content: userContent(text, images) });
  const question = el("div", "message user", text);
  if (images.length) question.prepend(thumbs(images));
  $("messages").append(question);
  const answer = el("div", "message assistant");
  answer.dataset.done = "false";
  const content = el("span", "content");
  const stats = el("span", "stats", "waiting for the first token");
  answer.append(content, stats);
  $("messages").append(answer);
  scrollDown();
  busy(true);
  chat.controller = new AbortController();
  const t0 = performance.now();
  let first = null, chunks = 0, usage = null, stopped = false;
  try {
    body.model = await modelId();
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders(keys.api), body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (!res.ok) throw await apiError(res);
    for await (const event of events(res)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      if (delta && delta.content) {
        if (first === null) first = performance.now();
        chunks += 1;
        content.textContent += delta.content;
        scrollDown();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      stopped = true;
    } else {
      answer.classList.add("error");
      content.textContent += (content.textContent ? "\n" : "") + e.message;
    }
  }
  const end = performance.now();
  const tokens = usage ? usage.completion_tokens : chunks;
  const parts = [];
  if (first !== null) parts.push("TTFT " + Math.round(first - t0) + " ms");
  parts.push(tokens + " tokens");
  if (first !== null && tokens > 1 && end > first) {
    parts.push((((tokens - 1) * 1000) / (end - first)).toFixed(1) + " tok/s");
  }
  if (stopped) parts.push("stopped");
  stats.textContent = parts.join(" \u00b7 ");
  if (answer.classList.contains("error")) chat.history.pop(); // the question goes unanswered
  else chat.history.push({ role: "assistant", content: content.textContent });
  answer.dataset.done = "true";
  busy(false);
}

// Server-sent events of a streamed response: each `data:` line's JSON, until [DONE].
async function* events(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// -- images in the chat ------------------------------------------------------------------

function thumbs(urls, remove) {
  const row = el("div", "thumbs");
  urls.forEach((url, i) => {
    const img = el("img", "thumb");
    img.src = url;
    img.alt = "image " + (i + 1);
    if (remove) {
      img.title = "remove";
      img.addEventListener("click", () => remove(i));
    }
    row.append(img);
  });
  return row;
}

function showAttached() {
  const box = $("attached");
  box.hidden = !chat.images.length;
  box.replaceChildren(...(chat.images.length ? thumbs(chat.images, (i) => {
    chat.images.splice(i, 1);
    showAttached();
  }).children : []));
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => {
      chat.images.push(reader.result);  // a data: URL
      showAttached();
    };
    reader.readAsDataURL(file);
  }
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

// -- the stack -------------------------------------------------------------------------

async function poll() {
  try {
    const res = await fetch("/console/stack", { headers: authHeaders(keys.admin || keys.api) });
    if (res.status === 401) {
      status("bad", "needs a key");
      askForKeys((await res.json()).error.message);
      return;
    }
    if (!res.ok) throw new Error(res.status + " " + res.statusText);
    render(await res.json());
  } catch (e) {
    status("bad", "router unreachable");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function status(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text;
}

function render(view) {
  $("model").textContent = view.model;
  const roles = (role) => view.workers.filter((w) => w.role === role);
  const healthy = view.workers.filter((w) => w.healthy).length;
  $("topology").textContent = view.colocated
    ? "colocated: decode workers compute prompts"
    : roles("prefill").length + " prefill, " + roles("decode").length + " decode";
  status(healthy === view.workers.length && healthy > 0 ? "ok" : "bad",
    healthy + " of " + view.workers.length + " workers healthy");
  $("updated").textContent = "updated " + new Date(view.time * 1000).toLocaleTimeString();
  workers($("prefill-workers"), roles("prefill"),
    view.colocated ? "none: prompts are computed by the decode workers" : "none");
  workers($("decode-workers"), roles("decode"), "none");
  const encoders = roles("encode");
  $("encode-column").hidden = $("encode-arrow").hidden = !encoders.length;
  workers($("encode-workers"), encoders, "none");
  $("attach").hidden = !view.reads_images;
  store(view.store);
  requests(view.requests);
  drawChart(view.latency, view.time);
}

function workers(box, list, none) {
  box.replaceChildren();
  if (!list.length) box.append(el("div", "muted", none));
  for (const w of list) {
    const card = el("div", "worker");
    card.dataset.role = w.role;
    card.dataset.address = w.address;
    card.dataset.healthy = String(w.healthy);
    const name = el("div", "name");
    name.append(el("span", "dot"), el("span", "", w.address));
    const state = w.healthy ? "healthy" : (w.refused ? "refused: " + w.refused : "unhealthy");
    const load = el("div", "", state + " \u00b7 running " + w.running + " \u00b7 waiting " + w.waiting);
    if (w.role === "encode") {
      card.append(name, load, el("div", "muted", "images encoded " + w.images_encoded +
        " \u00b7 found in the store " + w.images_from_store));
      box.append(card);
      continue;
    }
    const kv = el("div", "muted", "KV blocks " + w.blocks_used + " used, " + w.blocks_cached +
      " cached of " + w.blocks_total);
    const meter = el("div", "meter");
    const share = (n) => (w.blocks_total ? (100 * n) / w.blocks_total : 0) + "%";
    const used = el("span", "used");
    used.style.width = share(w.blocks_used);
    const cached = el("span", "cached");
    cached.style.width = share(Math.max(0, w.blocks_cached - w.blocks_used));
    meter.append(used, cached);
    const hits = el("div", "muted hits", "hits: exact " + w.exact_hit_tokens +
      " tokens \u00b7 approximate " + w.approximate_tokens + " tokens (" + w.cached_chunks +
      " chunks kept, " + w.chunks_from_store + " read from the store)");
    card.append(name, load, kv, meter, hits);
    box.append(card);
  }
}

function bytes(n) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) n /= 1000, i += 1;
  return (i ? n.toFixed(1) : Math.round(n)) + " " + units[i];
}

function store(s) {
  const box = $("store");
  box.replaceChildren(
    el("div", "", "hits " + s.hits + " \u00b7 misses " + s.misses + " blocks"),
    el("div", "", "in " + bytes(s.bytes_in_per_s) + "/s \u00b7 out " + bytes(s.bytes_out_per_s) + "/s"),
    el("div", "muted", "since start: in " + bytes(s.bytes_in) + ", out " + bytes(s.bytes_out)),
  );
}

const PHASES = ["queue", "prefill", "transfer", "decode"];

function requests(list) {
  const box = $("requests");
  box.replaceChildren();
  if (!list.length) box.append(el("li", "muted", "none yet"));
  for (const r of list) {
    const item = el("li", "request");
    item.dataset.id = r.id;
    const label = el("div", "label");
    const ttft = r.ttft_ms === null ? "" : " \u00b7 TTFT " + Math.round(r.ttft_ms) + " ms";
    label.append(el("span", "", r.id.slice(0, 22) + " \u00b7 " + r.prompt_tokens + " \u2192 " + r.tokens + " tokens"),
      el("span", "", Math.round(r.total_ms) + " ms" + ttft));
    const bar = el("div", "bar");
    const total = PHASES.reduce((sum, p) => sum + r.phases_ms[p], 0) || 1;
    for (const p of PHASES) {
      const seg = el("span", p);
      seg.dataset.phase = p;
      seg.style.width = (100 * r.phases_ms[p]) / total + "%";
      seg.title = p + " " + r.phases_ms[p].toFixed(1) + " ms";
      bar.append(seg);
    }
    item.append(label, bar);
    box.append(item);
  }
}

function drawChart(points, now) {
  const canvas = $("chart");
  const scale = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600, height = 200;
  canvas.width = width * scale;
  canvas.height = height * scale;
  const g = canvas.getContext("2d");
  g.scale(scale, scale);
  g.clearRect(0, 0, width, height);
  const left = 44, right = 8, top = 10, bottom = 22, span = 600;
  const values = points.flatMap((p) => [p.ttft_ms, p.itl_ms]).filter((v) => v !== null);
  const max = Math.max(10, ...values) * 1.1;
  const x = (t) => left + ((t - (now - span)) / span) * (width - left - right);
  const y = (v) => top + (1 - v / max) * (height - top - bottom);
  g.strokeStyle = "#dde1e7";
  g.fillStyle = "#687385";
  g.font = "11px system-ui, sans-serif";
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    g.beginPath();
    g.moveTo(left, y(v));
    g.lineTo(width - right, y(v));
    g.stroke();
    g.fillText(Math.round(v), 4, y(v) + 4);
  }
  for (let m = 0; m <= 10; m += 2) g.fillText("-" + m + "m", x(now - m * 60) - 10, height - 6);
  const css = getComputedStyle(document.documentElement);
  for (const [key, color] of [["ttft_ms", "--ttft"], ["itl_ms", "--itl"]]) {
    g.strokeStyle = g.fillStyle = css.getPropertyValue(color).trim();
    g.beginPath();
    let started = false;
    for (const p of points) {
      if (p[key] === null) continue;
      if (started) g.lineTo(x(p.t), y(p[key]));
      else g.moveTo(x(p.t), y(p[key])), (started = true);
    }
    g.stroke();
    for (const p of points) {
      if (p[key] !== null) g.fillRect(x(p.t) - 2, y(p[key]) - 2, 4, 4);
    }
  }
}

// -- wiring ----------------------------------------------------------------------------

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if ((!text && !chat.images.length) || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
$("image-file").addEventListener("change", (e) => {
  attach(e.target.files);
  e.target.value = "";
});
$("prompt").addEventListener("paste", (e) => {
  if ($("attach").hidden) return;  // the model reads no images
  const files = [...e.clipboardData.files].filter((f) => f.type.startsWith("image/"));
  if (files.length) {
    e.preventDefault();
    attach(files);
  }
});
$("clear").addEventListener("click", () => {
  chat.history = [];
  chat.images = [];
  showAttached();
  $("messages").replaceChildren();
});
$("keys-button").addEventListener("click", () => askForKeys("Keys are kept for this tab only."));
$("keys").addEventListener("submit", (e) => {
  e.preventDefault();
  keys.api = $("api-key").value.trim();
  keys.admin = $("admin-key").value.trim();
  sessionStorage.setItem("pdserve.apiKey", keys.api);
  sessionStorage.setItem("pdserve.adminKey", keys.admin);
  chat.model = null;
  $("keys").hidden = true;
});
poll();
