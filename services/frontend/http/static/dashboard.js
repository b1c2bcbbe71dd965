// kvmesh's live dashboard: polls GET /stats every second and draws each worker's
// KV blocks, queues, prefix hit rate, tokens/s and draft acceptance. No build step,
// no dependencies.
"use strict";

const POLL_INTERVAL_MS = 1000;
const EVENT_SHOWN_MS = 1500;
const FREE = 0, CACHED_FREE = 1, USED = 2;  // block map cell states (kvmesh.v1.WorkerStats)

const css = getComputedStyle(document.documentElement);
const COLORS = {
  [FREE]: css.getPropertyValue("--free").trim(),
  [CACHED_FREE]: css.getPropertyValue("--cached").trim(),
  [USED]: css.getPropertyValue("--used").trim(),
  changed: css.getPropertyValue("--changed").trim(),
  line: css.getPropertyValue("--good").trim(),
  grid: css.getPropertyValue("--free").trim(),
};

// With API keys on, /stats needs the admin key: /dashboard#key=ADMIN_KEY (a
// fragment never leaves the browser, so the key is in no server log).
const apiKey = new URLSearchParams(location.hash.slice(1)).get("key");
const panels = new Map();  // worker id -> Panel
let numUpdates = 0;

const $ = (id) => document.getElementById(id);
const percent = (value) => `${(100 * value).toFixed(1)}%`;
const last = (values) => (values.length ? values[values.length - 1] : 0);

function decodeBlockMap(base64) {
  const raw = atob(base64 || "");
  const cells = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) cells[i] = raw.charCodeAt(i);
  return cells;
}

class Panel {
  constructor(workerId) {
    this.root = $("worker-template").content.firstElementChild.cloneNode(true);
    this.root.dataset.workerId = workerId;
    this.field("worker-id").textContent = workerId;
    this.previous = null;  // the last stats, for what changed since
    this.previousCells = new Uint8Array(0);
    this.maxQueue = 1;
    $("workers").appendChild(this.root);
  }

  field(name) {
    return this.root.querySelector(`.${name}`);
  }

  update(stats) {
    const cells = decodeBlockMap(stats.block_map);
    drawBlockMap(this.field("block-map"), cells, this.previousCells);
    const numFree = stats.num_free_blocks - stats.num_cached_free_blocks;
    this.field("cell-id").textContent = stats.cell_id ? `in ${stats.cell_id}` : "";
    this.field("blocks-summary").textContent =
      `${stats.num_total_blocks} blocks` +
      (stats.blocks_per_cell > 1 ? `, ${stats.blocks_per_cell} per cell` : "");
    this.field("num-used").textContent = stats.num_total_blocks - stats.num_free_blocks;
    this.field("num-cached-free").textContent = stats.num_cached_free_blocks;
    this.field("num-free").textContent = numFree;
    this.updateQueues(stats);
    this.updateRates(stats);
    this.previous = stats;
    this.previousCells = cells;
  }

  updateQueues(stats) {
    this.maxQueue = Math.max(this.maxQueue, stats.num_running_reqs, stats.num_waiting_reqs);
    for (const [name, value] of [["running", stats.num_running_reqs],
                                 ["waiting", stats.num_waiting_reqs]]) {
      this.root.querySelector(`.fill.${name}`).style.width = `${(100 * value) / this.maxQueue}%`;
      this.field(`num-${name}`).textContent = value;
    }
  }

  updateRates(stats) {
    const previous = this.previous;
    this.field("hit-rate").textContent = percent(stats.prefix_cache_hit_rate);
    if (previous) {
      const queries = stats.prefix_cache_queries - previous.prefix_cache_queries;
      const hits = stats.prefix_cache_hits - previous.prefix_cache_hits;
      this.field("recent-hit-rate").textContent = queries > 0 ? `(${percent(hits / queries)} last second)` : "";
      flash(this.field("hits"), hits, `+${hits} hit tokens`);
      const evicted = stats.num_evicted_blocks - previous.num_evicted_blocks;
      flash(this.field("evictions"), evicted, `+${evicted} evicted`);
    }
    const history = stats.generation_tokens_per_s;
    this.field("tokens-per-s").textContent = last(history).toFixed(1);
    this.field("generation-tokens").textContent = stats.num_generation_tokens;
    this.field("num-preemptions").textContent = stats.num_preemptions;
    this.updateSpecDecoding(stats);
    drawHistory(this.field("history"), history);
    const seconds = history.length * stats.history_interval_s;
    const span = seconds >= 120 ? `${(seconds / 60).toFixed(0)} min` : `${seconds.toFixed(0)} s`;
    this.field("history-caption").textContent =
      `generated tokens/s over the last ${span}, in ${stats.history_interval_s} s steps`;
  }

  // Shown for a worker that drafts (speculative decoding), once it verified a draft.
  updateSpecDecoding(stats) {
    const drafts = stats.spec_num_drafts;
    this.field("spec-decoding").hidden = !drafts;
    if (!drafts) return;
    this.field("acceptance-rate").textContent =
      percent(stats.spec_num_accepted_tokens / Math.max(stats.spec_num_draft_tokens, 1));
    this.field("acceptance-length").textContent =
      (1 + stats.spec_num_accepted_tokens / drafts).toFixed(2);
  }
}

function flash(element, count, text) {
  if (count <= 0) return;
  element.textContent = text;
  element.classList.add("shown");
  clearTimeout(element.hideTimer);
  element.hideTimer = setTimeout(() => element.classList.remove("shown"), EVENT_SHOWN_MS);
}

function drawBlockMap(canvas, cells, previousCells) {
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, canvas.width, canvas.height);
  if (!cells.length) return;
  // The largest square cells that fit every cell on the canvas.
  let size = Math.floor(Math.sqrt((canvas.width * canvas.height) / cells.length));
  while (size > 1 && Math.floor(canvas.width / size) * Math.floor(canvas.height / size) < cells.length) size--;
  const columns = Math.floor(canvas.width / size);
  const gap = size >= 6 ? 1 : 0;
  for (let i = 0; i < cells.length; i++) {
    const x = (i % columns) * size, y = Math.floor(i / columns) * size;
    context.fillStyle = COLORS[cells[i]];
    context.fillRect(x, y, size - gap, size - gap);
    if (i < previousCells.length && previousCells[i] !== cells[i] && size >= 4) {
      context.strokeStyle = COLORS.changed;
      context.strokeRect(x + 0.5, y + 0.5, size - gap - 1, size - gap - 1);
    }
  }
}

function drawHistory(canvas, values) {
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  context.clearRect(0, 0, width, height);
  context.strokeStyle = COLORS.grid;
  context.beginPath();
  context.moveTo(0, height - 0.5);
  context.lineTo(width, height - 0.5);
  context.stroke();
  if (values.length < 2) return;
  const top = Math.max(...values, 1);
  context.strokeStyle = COLORS.line;
  context.lineWidth = 2;
  context.beginPath();
  values.forEach((value, i) => {
    const x = (i / (values.length - 1)) * width;
    const y = height - 4 - (value / top) * (height - 8);
    if (i === 0) context.moveTo(x, y); else context.lineTo(x, y);
  });
  context.stroke();
  context.fillStyle = COLORS.line;
  context.font = "11px system-ui, sans-serif";
  context.fillText(`${top.toFixed(0)} tok/s`, 4, 12);
}

function render(body) {
  $("model").textContent = body.model;
  const workers = body.workers;
  const seen = new Set();
  for (const stats of workers) {
    seen.add(stats.worker_id);
    if (!panels.has(stats.worker_id)) panels.set(stats.worker_id, new Panel(stats.worker_id));
    panels.get(stats.worker_id).update(stats);
  }
  for (const [workerId, panel] of panels) {
    if (!seen.has(workerId)) {
      panel.root.remove();
      panels.delete(workerId);
    }
  }
  const sum = (field) => workers.reduce((total, w) => total + w[field], 0);
  const queries = sum("prefix_cache_queries");
  $("num-workers").textContent = workers.length;
  $("num-running").textContent = sum("num_running_reqs");
  $("num-waiting").textContent = sum("num_waiting_reqs");
  $("tokens-per-s").textContent =
    workers.reduce((total, w) => total + last(w.generation_tokens_per_s), 0).toFixed(1);
  $("hit-rate").textContent = queries ? percent(sum("prefix_cache_hits") / queries) : "–";
  renderCells(body.cells || []);
  $("updates").textContent = ++numUpdates;
}

// One row per cell (a scheduler and its workers) this frontend routes between.
function renderCells(cells) {
  const table = $("cells");
  table.hidden = cells.length === 0;
  const rows = table.querySelector("tbody");
  rows.replaceChildren(...cells.map((cell) => {
    const routed = cell.routed_requests;
    const values = [cell.cell_id || "–", cell.address, cell.connected ? "up" : "down",
      cell.num_workers, cell.load_tokens,
      ["prefix", "load", "fallback", "resubmit"].map((r) => routed[r] || 0).join(" · ")];
    const row = document.createElement("tr");
    row.className = cell.connected ? "" : "down";
    for (const value of values) {
      const td = document.createElement("td");
      td.textContent = value;
      row.appendChild(td);
    }
    return row;
  }));
}

function setStatus(text, kind) {
  const status = $("status");
  status.textContent = text;
  status.className = `status ${kind}`;
}

async function poll() {
  try {
    const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
    const response = await fetch("/stats", { headers, cache: "no-store" });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    render(body);
    setStatus(`live · ${new Date(body.time * 1000).toLocaleTimeString()}`, "ok");
  } catch (error) {
    setStatus(`no data: ${error.message}`, "error");
  } finally {
    setTimeout(poll, POLL_INTERVAL_MS);
  }
}

poll();
