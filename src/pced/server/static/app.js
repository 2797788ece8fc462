// The pced page: stream /v1/chat/completions (SSE over fetch) and colour each token by its document.
// The first chunk carries the experts (pced.experts), every token chunk its winner (pced.doc_id),
// the last chunk the full trace, betas, timings and citations (one per sentence: the documents whose
// tokens it is made of); hovering a sentence lists its sources. Text is only ever set with textContent.
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#e6730b", "#0e9aa7", "#8c564b", "#d4338f",
                 "#7a8b0f", "#3949ab"];
const $ = (id) => document.getElementById(id);
let experts = new Map();  // doc_id -> {color, title, relevance, wins, winsEl}
let controller = null;

function fmt(x, digits = 3) { return typeof x === "number" ? x.toFixed(digits) : String(x); }

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

function showExperts(list) {
  const ol = $("experts");
  ol.replaceChildren();
  experts = new Map();
  list.forEach((expert, i) => {
    const color = PALETTE[i % PALETTE.length];
    const li = document.createElement("li");
    li.dataset.doc = expert.doc_id;
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = color;
    const name = document.createElement("span");
    name.className = "expert-title";
    name.style.color = color;
    name.textContent = expert.title ? `${expert.title} (${expert.doc_id})` : expert.doc_id;
    const wins = document.createElement("span");
    wins.className = "wins";
    wins.textContent = "0 tokens";
    const meta = document.createElement("span");
    meta.className = "expert-meta";
    const scores = Object.entries(expert.scores || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
    meta.textContent = `relevance ${fmt(expert.relevance)}` + (scores ? `  ·  ${scores}` : "");
    li.append(swatch, name, wins, meta);
    li.addEventListener("mouseenter", () => focusDoc(expert.doc_id));
    li.addEventListener("mouseleave", () => focusDoc(null));
    ol.append(li);
    experts.set(expert.doc_id, {color, title: expert.title || expert.doc_id, relevance: expert.relevance,
                                wins: 0, winsEl: wins});
  });
}

function focusDoc(docId) {
  const answer = $("answer");
  answer.classList.toggle("focus", docId !== null);
  for (const span of answer.querySelectorAll(".tok")) {
    span.classList.toggle("focused", docId !== null && span.dataset.doc === docId);
  }
}

function addToken(text, docId) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text;
  const expert = docId === null || docId === undefined ? null : experts.get(docId);
  if (expert) {
    span.dataset.doc = docId;
    span.style.color = expert.color;
    span.style.backgroundColor = expert.color + "1a";
    span.title = `${expert.title}\nrelevance ${fmt(expert.relevance)}`;
    expert.wins += 1;
    expert.winsEl.textContent = `${expert.wins} token${expert.wins === 1 ? "" : "s"}`;
  } else {
    span.classList.add("amateur");
    span.dataset.doc = "";
    span.title = "amateur: the model without any document";
  }
  $("answer").append(span);
}

function sourceName(docId) {
  const expert = experts.get(docId);
  return expert && expert.title !== docId ? `${expert.title} (${docId})` : docId;
}

// Wrap each cited sentence's tokens in a span (markers [n] after it) and list its sources on hover.
function showCitations(citations) {
  const answer = $("answer");
  const tokens = Array.from(answer.querySelectorAll(".tok"));
  const numbers = new Map();
  for (const c of citations) for (const d of c.doc_ids) if (!numbers.has(d)) numbers.set(d, numbers.size + 1);
  let offset = 0;
  const placed = tokens.map((tok) => {
    const text = tok.textContent;
    const first = offset + (text.length - text.trimStart().length);
    offset += text.length;
    return { tok, first, blank: !text.trim() };
  });
  citations.forEach((c, i) => {
    const members = placed.filter((p) => !p.blank && p.first >= c.start && p.first < c.end).map((p) => p.tok);
    if (!members.length) return;
    const sentence = document.createElement("span");
    sentence.className = "sentence";
    sentence.dataset.index = String(i);
    sentence.dataset.sources = c.doc_ids.join(" ");
    const label = c.doc_ids.length ? `Sources: ${c.doc_ids.map((d) => `[${numbers.get(d)}] ${sourceName(d)}`).join(", ")}`
                                   : "Sources: none (the model wrote this sentence from no document)";
    members[0].before(sentence);
    const last = members[members.length - 1];
    let node = sentence.nextSibling;
    for (;;) {  // move the sentence's tokens (and any blanks between them) into its span
      const next = node.nextSibling;
      sentence.append(node);
      if (node === last) break;
      node = next;
    }
    for (const d of c.doc_ids) {
      const mark = document.createElement("sup");
      mark.className = "cite";
      mark.textContent = `[${numbers.get(d)}]`;
      mark.title = sourceName(d);
      sentence.append(mark);
    }
    sentence.addEventListener("mouseenter", () => { sentence.classList.add("hovered"); $("sources").textContent = label; });
    sentence.addEventListener("mouseleave", () => sentence.classList.remove("hovered"));
  });
}

function showSummary(extra, usage, finishReason) {
  const t = extra.timings || {};
  const parts = [`method ${extra.method || "?"}`];
  if (t.ttft_s !== undefined) parts.push(`first token ${fmt(t.ttft_s, 2)} s`);
  if (t.total_s !== undefined) parts.push(`total ${fmt(t.total_s, 2)} s`);
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  if (Array.isArray(extra.beta) && extra.beta.length) parts.push(`beta ${extra.beta.map((b) => fmt(b, 2)).join(" ")}`);
  if (finishReason === "length") parts.push("stopped at max tokens");
  setStatus(parts.join("  ·  "));
}

function handleChunk(chunk) {
  if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
  const extra = chunk.pced || {};
  if (Array.isArray(extra.experts) && (!chunk.choices || !chunk.choices[0] || !chunk.choices[0].finish_reason)) {
    showExperts(extra.experts);
  }
  const choice = (chunk.choices || [])[0];
  if (!choice) return;
  const text = choice.delta && choice.delta.content;
  if (text) addToken(text, extra.doc_id);
  if (choice.finish_reason) {
    if (Array.isArray(extra.citations)) showCitations(extra.citations);
    showSummary(extra, chunk.usage, choice.finish_reason);
  }
}

async function readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      handleChunk(JSON.parse(data));
    }
  }
}

async function ask(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question) return;
  $("answer").replaceChildren();
  $("experts").replaceChildren();
  $("sources").textContent = "Hover a sentence to see the documents it was made of.";
  setStatus("waiting for the model ...");
  $("ask").disabled = true;
  $("stop").disabled = false;
  controller = new AbortController();
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  const body = {
    model: "pced",
    stream: true,
    messages: [{ role: "user", content: question }],
    pced: { method: $("method").value },
  };
  // a field left empty is left out: the server's default applies, as for pced ask
  if ($("max-tokens").value) body.max_tokens = Number($("max-tokens").value);
  if ($("top-k").value) body.pced.top_k = Number($("top-k").value);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error((error && error.error && error.error.message) || `HTTP ${response.status}`);
    }
    await readEvents(response);
    document.body.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") setStatus("stopped");
    else setStatus(`error: ${err.message}`, true);
    document.body.dataset.state = "error";
  } finally {
    $("ask").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

async function showModel() {
  try {
    const health = await (await fetch("/health")).json();
    $("model").textContent = `Model ${health.model}, ${health.documents} documents. ` +
      "Every answer token is coloured by the document that won it; hover a token for its source.";
  } catch (err) { /* the page still works without it */ }
}

async function showDefaults() {
  // the form starts from the server's defaults (those of pced ask), never from numbers of its own
  const defaults = await (await fetch("/defaults")).json();
  $("method").replaceChildren(...defaults.methods.map((name) => new Option(name, name, false, name === defaults.method)));
  Object.assign($("top-k"), { value: defaults.top_k, max: defaults.max_top_k });
  Object.assign($("max-tokens"), { value: defaults.max_tokens, max: defaults.max_tokens_limit });
}

$("ask-form").addEventListener("submit", ask);
$("stop").addEventListener("click", () => controller && controller.abort());
$("question").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask-form").requestSubmit(); }
});
showDefaults();
showModel();
