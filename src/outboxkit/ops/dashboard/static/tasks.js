// outboxkit dashboard, the tasks page: task mode's table by state, its queues, a task's detail
// and the actions of `outboxkit tasks replay | cancel | discard | pause | resume`. Renders with textContent only
// (helpers in common.js): payloads, errors and tracebacks are attacker-controlled.
"use strict";

// Which actions a task in each state allows (the store refuses the others anyway).
const ACTIONS = {
  queued: ["cancel"],
  scheduled: ["cancel"],
  waiting: ["cancel"],
  running: ["cancel"],
  failed: ["replay", "discard"],
  cancelled: ["replay", "discard"],
  done: [],
};
const DONE = { replay: "replayed (queued again)", cancel: "cancelled", discard: "discarded" };
const CONFIRM = {
  cancel: (id) => `Cancel task ${id}? A running handler is told to stop.`,
  discard: (id) => `Discard task ${id} for good?`,
};

function when(text) { return text ? new Date(text).toLocaleString() : ""; }

function filters() {
  const query = new URLSearchParams({ state: $("filter-state").value, limit: "100" });
  for (const [key, id] of [["name", "filter-name"], ["queue", "filter-queue"]]) {
    const value = $(id).value.trim();
    if (value) query.set(key, value);
  }
  return query.toString();
}

function actionButtons(task) {
  return (ACTIONS[task.state] || []).map((verb) =>
    actionButton(verb, `${verb === "replay" ? "primary" : "danger"} ${verb}`, () => act(task.id, verb)));
}

async function act(id, verb) {
  if (CONFIRM[verb] && !window.confirm(CONFIRM[verb](id))) return;
  try {
    await post(`api/tasks/${encodeURIComponent(id)}/${verb}`);
    toast(`task ${id}: ${DONE[verb]}`);
    if (!$("detail").hidden && $("detail-id").textContent === String(id)) {
      if (verb === "discard") $("detail").hidden = true; else await showTask(id);
    }
    await refresh();
  } catch (e) {
    toast(`${verb} of task ${id} failed: ${e.message}`);
  }
}

function renderOverview(data) {
  renderMode(data.read_only);
  $("table-name").textContent = data.table;
  $("missing").hidden = !data.missing;
  $("missing-text").textContent = data.missing || "";
  $("present").hidden = Boolean(data.missing);
  showError(data.error ? "cannot read the task table: " + data.error : "");
  if (data.missing || !data.totals) return false;
  for (const key of ["queued", "scheduled", "running", "failed"]) {
    $(`total-${key}`).textContent = String(data.totals[key]);
  }
  $("total-failed").className = "num" + (data.totals.failed > 0 ? " bad" : "");
  $("oldest-age").textContent = age(data.oldest_queued_age_s);
  $("no-names").hidden = data.names.length > 0;
  $("names").tBodies[0].replaceChildren(...data.names.map((n) => {
    const row = el("tr");
    row.dataset.name = n.task_name;
    cell(row, n.task_name);
    for (const key of ["queued", "scheduled", "running", "failed"]) cell(row, n[key], "n");
    cell(row, age(n.oldest_queued_age_s), "n");
    return row;
  }));
  $("task-names").replaceChildren(...data.names.map((n) => {
    const option = el("option");
    option.value = n.task_name;
    return option;
  }));
  return true;
}

function renderTasks(rows) {
  $("tasks-count").textContent = `(${rows.length}${rows.length >= 100 ? "+" : ""})`;
  $("no-tasks").hidden = rows.length > 0;
  $("tasks").tBodies[0].replaceChildren(...rows.map((t) => {
    const row = el("tr");
    row.dataset.id = t.id;
    row.dataset.state = t.state;
    cell(row, t.id, "n");
    cell(row, t.task_name);
    cell(row, t.queue);
    cell(row, t.state);
    cell(row, t.attempts, "n");
    cell(row, when(t.available_at));
    cell(row, t.state === "running" ? (t.claimed_by || "") : "");
    cell(row, t.last_error || "", "err");
    const actions = el("td");
    const view = el("button", "view", "view");
    view.type = "button";
    view.addEventListener("click", () => showTask(t.id));
    actions.append(view, ...actionButtons(t).flatMap((b) => [" ", b]));
    row.appendChild(actions);
    return row;
  }));
}

async function showTask(id) {
  try {
    const t = await api(`api/tasks/${encodeURIComponent(id)}`);
    $("detail-id").textContent = String(t.id);
    const fields = [
      ["task", t.task_name], ["queue", t.queue], ["state", t.state], ["attempts", t.attempts],
      ["max attempts", t.max_attempts === null ? "the handler's" : t.max_attempts],
      ["error type", t.error_type], ["priority", t.priority], ["key", t.key], ["unique key", t.unique_key],
      [t.state === "running" ? "lease until" : "run at", when(t.available_at)],
      ["lease holder", t.state === "running" ? t.claimed_by : null],
      ["last worker", t.state === "running" ? null : t.claimed_by],
      ["created", when(t.created_at)], ["started", when(t.started_at)], ["finished", when(t.finished_at)],
      ["progress", t.progress], ["result kept until", t.kept_until ? when(t.kept_until) : null],
      ["waits for (upstream)", t.upstream.length ? t.upstream.join(", ") : null],
      ["waited for by (downstream)", t.downstream.length ? t.downstream.join(", ") : null],
    ];
    kvRows($("detail-fields").tBodies[0], fields);
    $("detail-actions").replaceChildren(...actionButtons(t).flatMap((b) => [b, " "]));
    $("detail-error").textContent = t.last_error || "(none)";
    $("detail-traceback").textContent = t.traceback_excerpt || "(none)";
    $("detail-payload").textContent = t.payload;
    $("detail-payload-info").textContent = `(${t.payload_kind}${t.payload_truncated ? ", cut to the first 64 KiB" : ""})`;
    $("detail-result").textContent = t.result === null ? "(none: not finished, or its handler keeps no result)" : t.result;
    $("detail-result-info").textContent = t.result_truncated ? "(cut to the first 64 KiB)" : "";
    $("detail").hidden = false;
    $("detail").scrollIntoView({ block: "nearest" });
  } catch (err) {
    toast(`task ${id}: ${err.message}`);
  }
}

// A paused queue: no worker claims from it (running tasks finish, enqueue goes on).
function renderQueues(rows) {
  $("no-queues").hidden = rows.length > 0;
  $("queues").tBodies[0].replaceChildren(...rows.map((q) => {
    const row = el("tr");
    row.dataset.queue = q.queue;
    row.dataset.paused = String(q.paused);
    cell(row, q.queue);
    cell(row, q.paused ? "paused" : "running", q.paused ? "bad" : "");
    cell(row, q.queued, "n");
    cell(row, q.running, "n");
    cell(row, when(q.changed_at));
    cell(row, q.changed_by || "");
    const actions = el("td");
    const verb = q.paused ? "resume" : "pause";
    actions.append(actionButton(verb, `${q.paused ? "primary" : "danger"} ${verb}`, () => switchQueue(q.queue, verb)));
    row.appendChild(actions);
    return row;
  }));
}

async function switchQueue(queue, verb) {
  if (verb === "pause" && !window.confirm(`Pause queue ${queue}? No worker claims from it until it is resumed; running tasks finish.`)) return;
  try {
    await post(`api/tasks/queues/${encodeURIComponent(queue)}/${verb}`);
    toast(`queue ${queue}: ${verb === "pause" ? "paused" : "resumed"}`);
    await refresh();
  } catch (e) {
    toast(`${verb} of queue ${queue} failed: ${e.message}`);
  }
}

async function refresh() {
  try {
    const overview = await api("api/tasks/overview");
    if (renderOverview(overview)) {
      renderQueues(await api("api/tasks/queues"));
      renderTasks(await api(`api/tasks?${filters()}`));
    }
    document.body.dataset.loaded = String(Date.now());
  } catch (e) {
    showError("dashboard API unreachable: " + e.message);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  setUpTokenForm(refresh);
  $("filters").addEventListener("submit", (ev) => { ev.preventDefault(); refresh(); });
  $("filter-state").addEventListener("change", () => refresh());
  $("detail-close").addEventListener("click", () => { $("detail").hidden = true; });
  poll(refresh);
});
