// The chat page: talks to the same OpenAI API as any client (streamed chat completions), shows the memory
// plan from /v1/plan and polls /v1/stats while an answer streams. No build step, nothing from another host.
"use strict";

const $ = (id) => document.getElementById(id);
const MiB = 1 << 20;
const history = [];  // the conversation as OpenAI messages (answers without their thinking)
let model = null, ctx = 0, imageURL = null, imageName = "", busy = false;
let running = null;  // the AbortController of the answer streaming now: Stop and New chat abort its fetch
let chatId = 0;      // bumped by New chat: an answer of an earlier chat never writes into this one's history

// A server started with --api-key answers its API 401 without the key: ask for it, keep it for this tab (asked
// again after a wrong one; never again once the question is cancelled).
let keyDeclined = false;
async function api(path, opts = {}) {
  for (let asked = false; ; asked = true) {
    const key = sessionStorage.getItem("streamoe-key");
    const headers = {...(opts.headers || {}), ...(key ? {Authorization: "Bearer " + key} : {})};
    const r = await fetch(path, {...opts, headers});
    if (r.status !== 401 || asked || keyDeclined) return r;
    if (sessionStorage.getItem("streamoe-key") !== key) continue;  // another call was given the key meanwhile
    const typed = window.prompt("This server needs its API key:");
    if (!typed) {
      keyDeclined = true;
      return r;
    }
    sessionStorage.setItem("streamoe-key", typed);
  }
}

function mib(n) { return n >= 1 << 30 ? (n / (1 << 30)).toFixed(2) + " GiB" : (n / MiB).toFixed(1) + " MiB"; }

async function loadPlan() {
  const r = await api("/v1/plan");
  if (!r.ok) throw new Error(await errorOf(r));  // a 401 (no key yet) is no plan: asked again at the next poll
  const p = await r.json();
  model = p.model;
  ctx = p.ctx;
  $("max-tokens").placeholder = p.max_tokens ? String(p.max_tokens) : "context";
  $("model").textContent = `${p.model} · cap ${mib(p.cap)} · ctx ${p.ctx} · experts ${p.expert_format}`;
  const body = $("plan").tBodies[0];
  body.replaceChildren();
  const row = (name, bytes, note, cls) => {
    const tr = body.insertRow();
    if (cls) tr.className = cls;
    tr.insertCell().outerHTML = `<th title="${note || ""}">${name}</th>`;
    tr.insertCell().textContent = mib(bytes);
  };
  for (const [name, bytes] of Object.entries(p.accounts)) row(name, bytes, p.notes[name]);
  row("hot tier", p.hot_slots * p.slot, `${p.hot_slots} expert slots of ${p.n_layers * p.n_experts}`);
  row("total", p.fixed + p.hot_slots * p.slot, "", "total");
  if (p.host) {  // a GPU with memory of its own: the host's accounts under --host-cap, and its tier of records
    const head = body.insertRow();
    head.className = "section";
    head.insertCell().outerHTML = `<th colspan="2">host memory${p.host.cap ? " · cap " + mib(p.host.cap) : " (not capped)"}</th>`;
    for (const [name, bytes] of Object.entries(p.host.accounts)) row(name, bytes, p.notes[name]);
    if (!p.host.host_reads) row("host tier", p.host.tier_slots * p.stride, `${p.host.tier_slots} expert records copied, not read`);
    row("total", p.host.fixed + p.host.tier_slots * p.stride, "", "total");
  }
  const all = p.n_layers * p.n_experts;
  $("plan-note").textContent = (p.host && p.host.host_reads ? "Every expert is in host memory, read by the GPU over the bus." :
    p.hot_slots >= all ? "Every expert is resident." :
    `${p.hot_slots} of ${all} experts fit the hot tier; the rest ` + (!p.host || !p.host.tier_slots ? "stream from the SSD." :
      p.host.tier_slots >= all ? "are copied from the host tier." : "are copied from the host tier or read from the SSD.")) + (p.images ? "" : " Images are off.");
  $("image").disabled = !p.images;
  $("status").textContent = "ready";
}

function showStats(s) {
  $("t-state").textContent = s.state || "idle";
  if (s.tokens !== undefined) $("t-tokens").textContent = s.tokens;
  if (s.tok_s !== undefined) $("t-toks").textContent = s.tok_s.toFixed(2);
  if (s.hit_rate !== undefined) $("t-hit").textContent = (100 * s.hit_rate).toFixed(1) + " %";
  if (s.mib_read_token !== undefined) $("t-read").textContent = s.mib_read_token.toFixed(2);
  if (s.disk_busy !== undefined) $("t-busy").textContent = s.mib_read_token ? (100 * s.disk_busy).toFixed(0) + " %" : "–";
  if (s.prompt_tokens !== undefined) $("t-prompt").textContent = `${s.prompt_tokens} (${s.cached_tokens || 0})`;
  if (s.device !== undefined && s.cap) {  // two memories: the device's against --cap, the host's beside it
    $("t-mem").textContent = `device ${mib(s.device)} of ${mib(s.cap)}` +
      (s.rss ? ` · host ${mib(s.rss)}` + (s.host_cap ? ` of ${mib(s.host_cap)}` : "") : "");
    $("memfill").style.width = Math.min(100, 100 * s.device / s.cap).toFixed(1) + "%";
  } else if (s.rss && s.cap) {
    $("t-mem").textContent = `${mib(s.rss)} of ${mib(s.cap)}`;
    $("memfill").style.width = Math.min(100, 100 * s.rss / s.cap).toFixed(1) + "%";
  }
}

async function poll() {
  try {
    const s = await (await api("/v1/stats")).json();
    showStats(s);
    // the plan failed to load, or the server was gone (perhaps restarted with other options): loaded again
    if (model === null || $("status").textContent === "disconnected") loadPlan().catch(() => {});
    else $("status").textContent = "ready";
    return s;
  } catch (e) {
    $("status").textContent = "disconnected";  // the server is gone; the next poll tells when it is back
    return null;
  }
}

// An error response's message: the API's error object, else what the HTTP status says (a proxy's HTML page)
async function errorOf(r) {
  const text = await r.text();
  try { return JSON.parse(text).error.message; } catch (e) {
    return `HTTP ${r.status} ${r.statusText}` + (text ? `: ${text.slice(0, 120)}` : "");
  }
}

// once an answer has ended here, until the server says so: a stopped one ends there at its next token
async function settle() {
  for (let i = 0; i < 20; i++) {
    const s = await poll();
    if (!s || (s.state !== "prefill" && s.state !== "decode")) return;
    await new Promise((done) => setTimeout(done, 150));
  }
}

// the image the next question carries (none: null), shown by name with a control that takes it off
function attach(url, name) {
  imageURL = url; imageName = url ? name : "";
  $("attached").textContent = imageName;
  $("detach").hidden = !url;
  if (!url) $("image").value = "";
}

function bubble(cls) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.dir = "auto";  // a right-to-left question or answer laid out as it reads
  $("log").appendChild(div);
  return div;
}

function scroll() { $("log").scrollTop = $("log").scrollHeight; }
// whether the log shows its end: a stream follows the answer only then, not while the reader is further up
function atBottom() { const l = $("log"); return l.scrollHeight - l.scrollTop - l.clientHeight < 40; }

// One turn: the question, then its answer streamed. False where it failed: the turn is out of the conversation
// (its bubbles marked, the answer so far kept on the page) and the caller gives the question back to the box.
async function send(text) {
  const parts = imageURL ? [{type: "image_url", image_url: {url: imageURL}}, {type: "text", text}] : text;
  const user = bubble("user");
  if (imageURL) {
    const img = document.createElement("img");
    img.src = imageURL; img.alt = "attached image " + imageName;
    user.appendChild(img);
  }
  user.appendChild(document.createTextNode(text));
  history.push({role: "user", content: parts});
  attach(null);

  const out = bubble("assistant");
  out.dataset.state = "waiting";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  thinking.innerHTML = "<summary>Thinking</summary><pre></pre>";
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  out.append(thinking, content, meta);
  thinking.hidden = true;

  const req = {model, messages: history, stream: true, stream_options: {include_usage: true},
               chat_template_kwargs: {enable_thinking: $("think").checked}};
  if ($("max-tokens").value !== "") req.max_tokens = Number($("max-tokens").value);  // else the server's
  if ($("temperature").value !== "") req.temperature = Number($("temperature").value);
  const timer = setInterval(poll, 300);
  const mine = chatId, abort = new AbortController();
  running = abort;
  $("stop").disabled = false;
  $("log").setAttribute("aria-busy", "true");  // a screen reader reads the answer once, when it is whole
  let answer = "", reasoning = "", calls = [], usage = null, tele = null, chunks = 0, finish = null, ended = false;
  try {
    // aborting closes the connection, and the server stops generating at its next token
    const r = await api("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                                body: JSON.stringify(req), signal: abort.signal});
    if (!r.ok) throw new Error(await errorOf(r));
    out.dataset.state = "streaming";
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut); buf = buf.slice(cut + 2);
        if (line === "data: [DONE]") ended = true;
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const ev = JSON.parse(line.slice(6));
        if (ev.error) throw new Error(ev.error.message);
        out.dataset.chunks = ++chunks;
        if (ev.usage) usage = ev.usage;
        if (ev.streamoe) tele = ev.streamoe;
        const d = ev.choices.length ? ev.choices[0].delta : {};
        if (ev.choices.length && ev.choices[0].finish_reason) finish = ev.choices[0].finish_reason;
        const follow = atBottom();
        if (d.reasoning_content) {
          reasoning += d.reasoning_content; thinking.hidden = false;
          thinking.querySelector("pre").textContent = reasoning;
        }
        if (d.content) { answer += d.content; content.textContent = answer; }
        for (const c of d.tool_calls || []) {
          calls.push(c);
          const t = document.createElement("div");
          t.className = "tool"; t.textContent = `→ ${c.function.name}(${c.function.arguments})`;
          out.insertBefore(t, meta);
        }
        if (follow) scroll();
      }
    }
    if (!ended) throw new Error("the answer was cut off: its stream ended before the server finished it");
    const msg = {role: "assistant", content: answer};
    if (calls.length) msg.tool_calls = calls.map(({index, ...c}) => c);
    history.push(msg);
    if (tele) showStats({...tele, state: "idle", tokens: tele.tokens, rss: tele.rss, cap: tele.cap,
                         prompt_tokens: usage && usage.prompt_tokens, cached_tokens: tele.cached_tokens});
    const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    if (usage) meta.textContent = `${usage.completion_tokens} tokens · prompt ${usage.prompt_tokens} ` +
      `(${cached} cached)` + (tele ? ` · ${tele.tok_s.toFixed(2)} tok/s` : "");
    if (finish === "length") {  // cut by max tokens or the context: said, and a thought cut short shown
      const full = usage && ctx && usage.prompt_tokens + usage.completion_tokens >= ctx;
      meta.textContent += full ? ` · cut by the context (${ctx} tokens): start a New chat to go on` : " · cut at max tokens";
      if (!answer && !calls.length) { meta.textContent += ", still thinking"; thinking.open = true; }
    }
    out.dataset.state = "done";
    return true;
  } catch (e) {
    if (abort.signal.aborted) {  // Stop (the answer so far stays, in the page and the conversation) or New chat
      if (mine === chatId) history.push({role: "assistant", content: answer});
      meta.textContent = "stopped";
      out.dataset.state = "stopped";
    } else {  // the answer so far stays on the page, the error under it; the turn leaves the conversation
      out.classList.add("error");
      user.classList.add("failed");
      const err = document.createElement("div");
      err.className = "error-line";
      err.textContent = "Error: " + e.message + " (not in the conversation; the question is back in the box" +
        (history.length > 1 ? "; a New chat starts without the turns before it)" : ")");
      out.insertBefore(err, meta);
      if (mine === chatId) history.pop();
      out.dataset.state = "error";
      return false;
    }
    return true;
  } finally {
    clearInterval(timer);
    $("log").setAttribute("aria-busy", "false");
    if (running === abort) { running = null; $("stop").disabled = true; }
    settle();  // not awaited: the page takes the next question at once
  }
}

$("form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const typed = $("prompt").value, text = typed.trim();
  if (!text || busy) return;
  keyDeclined = false;  // a question asked is a chance to give the key that was declined
  const image = [imageURL, imageName];
  busy = true; $("send").disabled = true; $("prompt").value = "";
  let sent = false;
  try { sent = await send(text); } finally {
    busy = false; $("send").disabled = false;
    if (!sent && !$("prompt").value) {  // a failed turn's question back in the box, its image attached again
      $("prompt").value = typed;
      if (image[0] && !imageURL) attach(...image);  // taken off with its control, or replaced
    }
    $("prompt").focus(); scroll();
  }
});

$("prompt").addEventListener("keydown", (ev) => {
  if (ev.isComposing || ev.keyCode === 229) return;  // Enter that picks an input method's candidate: not a send
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});

$("image").addEventListener("change", () => {
  const f = $("image").files[0];
  if (!f) { attach(null); return; }
  const rd = new FileReader();
  rd.onload = () => attach(rd.result, f.name);
  rd.readAsDataURL(f);
});

$("detach").addEventListener("click", () => attach(null));

$("stop").addEventListener("click", () => { if (running) running.abort(); });

$("new").addEventListener("click", () => {
  chatId++;
  if (running) running.abort();  // the answer of the old chat stops; its send() ends and frees Send
  history.length = 0;
  attach(null);
  $("log").replaceChildren();
});

// a page left (closed, reloaded, or kept in the back/forward cache) stops its answer on the server
window.addEventListener("pagehide", () => { if (running) running.abort(); });

loadPlan().catch((e) => { $("status").textContent = "error: " + e.message; });
poll();
