// outboxkit dashboard, the outbox's page: polls the JSON API and renders with textContent
// only (helpers in common.js). Payloads, headers and errors are attacker-controlled.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const WINDOW_S = 15 * 60;

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function chart(container, points, key) {
  const w = 600, h = 170, left = 44, right = 8, top = 8, bottom = 20;
  const now = Date.now() / 1000;
  const data = points.filter((p) => p[key] !== null && p[key] !== undefined && now - p.t <= WINDOW_S);
  const max = Math.max(1, ...data.map((p) => p[key]));
  const x = (t) => left + (w - left - right) * (1 - (now - t) / WINDOW_S);
  const y = (v) => top + (h - top - bottom) * (1 - v / max);
  const root = svg("svg", { viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none", role: "img" });
  for (const frac of [0, 0.5, 1]) {
    root.appendChild(svg("line", { x1: left, x2: w - right, y1: y(max * frac), y2: y(max * frac), class: "grid" }));
    const label = svg("text", { x: left - 4, y: y(max * frac) + 3, "text-anchor": "end", class: "axis" });
    label.textContent = (max * frac >= 100 ? Math.round(max * frac) : +(max * frac).toFixed(1)).toString();
    root.appendChild(label);
  }
  for (const [t, text] of [[now - WINDOW_S, "-15 min"], [now - WINDOW_S / 3 * 2, "-10 min"], [now - WINDOW_S / 3, "-5 min"], [now, "now"]]) {
    const label = svg("text", { x: x(t), y: h - 4, "text-anchor": t === now ? "end" : "middle", class: "axis" });
    label.textContent = text;
    root.appendChild(label);
  }
  if (data.length > 0) {
    const coords = data.map((p) => `${x(p.t).toFixed(1)},${y(p[key]).toFixed(1)}`);
    const base = y(0).toFixed(1);
    root.appendChild(svg("polygon", {
      points: `${x(data[0].t).toFixed(1)},${base} ${coords.join(" ")} ${x(data[data.length - 1].t).toFixed(1)},${base}`,
      class: "area",
    }));
    root.appendChild(svg("polyline", { points: coords.join(" "), class: "line" }));
  }
  container.replaceChildren(root);
}

function renderOverview(data) {
  renderMode(data.read_only);
  pollMs = Math.max(1000, (data.sample_interval || 2) * 1000);
  $("table-name").textContent = data.table;
  showError(data.error ? "cannot read the outbox: " + data.error : "");
  const s = data.status;
  if (!s) return;
  $("total-backlog").textContent = String(s.pending);
  $("total-in-flight").textContent = String(s.in_flight);
  $("total-failed").textContent = String(s.failed);
  $("total-failed").className = "num" + (s.failed > 0 ? " bad" : "");
  $("oldest-age").textContent = age(s.oldest_pending_age_s);
  const history = data.history.map((p) => ({ ...p, pending: p.backlog + p.in_flight }));
  const last = history.filter((p) => p.throughput !== null).pop();
  $("throughput").textContent = last ? last.throughput.toFixed(1) + " /s" : "–";
  chart($("chart-throughput"), history, "throughput");
  chart($("chart-backlog"), history, "pending");
  const body = $("topics").tBodies[0];
  const rows = s.topics.map((t) => {
    const row = el("tr");
    row.dataset.topic = t.topic;
    cell(row, t.topic);
    cell(row, t.pending, "n");
    cell(row, t.in_flight, "n");
    cell(row, t.failed, "n");
    cell(row, age(t.oldest_pending_age_s), "n");
    // The server's recent activity (Dashboard._bounded_topics): a drained topic stays listed.
    cell(row, t.topic === "(other)" ? "" : t.published, "n");
    return row;
  });
  body.replaceChildren(...rows);
}

async function act(id, verb) {
  if (verb === "discard" && !window.confirm(`Discard failed event ${id} for good?`)) return;
  try {
    await post(`api/events/${encodeURIComponent(id)}/${verb}`);
    toast(`event ${id}: ${verb === "replay" ? "replayed (back to pending)" : "discarded"}`);
    if (String($("detail-id").textContent) === String(id)) $("detail").hidden = true;
    await refresh();
  } catch (e) {
    toast(`${verb} of event ${id} failed: ${e.message}`);
  }
}

// The heading counts what the card counts (the overview's status, one read): the list
// is read at another moment and holds at most 100 rows, so its length is only "shown".
function renderFailed(rows, total) {
  const count = total === undefined ? rows.length : total;
  $("failed-count").textContent = rows.length < count ? `(${count}, ${rows.length} shown)` : `(${count})`;
  $("no-failed").hidden = rows.length > 0;
  const body = $("failed").tBodies[0];
  body.replaceChildren(...rows.map((r) => {
    const row = el("tr");
    row.dataset.id = r.id;
    cell(row, r.id, "n");
    cell(row, r.topic);
    cell(row, r.event_type);
    cell(row, r.attempts, "n");
    cell(row, r.last_error || "", "err");
    cell(row, r.created_at ? new Date(r.created_at).toLocaleString() : "");
    const actions = el("td");
    actions.append(
      actionButton("view", "view", () => showEvent(r.id)),
      " ",
      actionButton("replay", "primary replay", () => act(r.id, "replay")),
      " ",
      actionButton("discard", "danger discard", () => act(r.id, "discard")),
    );
    actions.querySelector(".view").disabled = false;
    actions.querySelector(".view").title = "";
    row.appendChild(actions);
    return row;
  }));
}

function renderBlocked(rows) {
  $("blocked-section").hidden = rows.length === 0;
  $("blocked-count").textContent = `(${rows.length}${rows.length >= 100 ? "+" : ""})`;
  $("blocked").tBodies[0].replaceChildren(...rows.map((r) => {
    const row = el("tr");
    row.dataset.key = r.key;
    cell(row, r.key);
    cell(row, r.id, "n");
    cell(row, r.topic);
    cell(row, r.attempts, "n");
    cell(row, r.waiting, "n");
    cell(row, r.last_error || "", "err");
    const actions = el("td");
    const view = actionButton("view", "view", () => showEvent(r.id));
    view.disabled = false;
    view.title = "";
    actions.append(
      view,
      " ",
      actionButton("replay", "primary replay", () => act(r.id, "replay")),
      " ",
      actionButton("discard", "danger discard", () => act(r.id, "discard")),
    );
    row.appendChild(actions);
    return row;
  }));
}

async function showEvent(id) {
  try {
    const e = await api(`api/events/${encodeURIComponent(id)}`);
    $("detail-id").textContent = String(e.id);
    const fields = ["event_id", "topic", "key", "event_type", "aggregate_type", "aggregate_id",
      "status", "attempts", "last_error", "created_at", "available_at", "claimed_by", "published_at"];
    kvRows($("detail-fields").tBodies[0], fields.map((f) => [f, e[f]]));
    kvRows($("detail-headers").tBodies[0], Object.entries(e.headers || {}));
    $("detail-payload").textContent = e.payload;
    $("detail-payload-info").textContent =
      `(${e.payload_kind}, ${e.payload_bytes} bytes${e.payload_truncated ? ", cut to the first 64 KiB" : ""})`;
    $("detail").hidden = false;
    $("detail").scrollIntoView({ block: "nearest" });
  } catch (err) {
    toast(`event ${id}: ${err.message}`);
  }
}

async function refresh() {
  try {
    const [overview, failed, blocked] = await Promise.all(
      [api("api/overview"), api("api/failed?limit=100"), api("api/blocked?limit=100")]);
    renderOverview(overview);
    renderFailed(failed, overview.status ? overview.status.failed : undefined);
    renderBlocked(blocked);
    document.body.dataset.loaded = String(Date.now());
  } catch (e) {
    showError("dashboard API unreachable: " + e.message);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  setUpTokenForm(refresh);
  $("detail-close").addEventListener("click", () => { $("detail").hidden = true; });
  poll(refresh);
});
