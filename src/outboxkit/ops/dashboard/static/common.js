// outboxkit dashboard: what both pages share (the outbox's app.js, the tasks page's tasks.js).
// Every value is rendered with textContent: payloads, headers and errors are
// attacker-controlled, never innerHTML with data.
"use strict";

const TOKEN_KEY = "outboxkit-admin-token";
let readOnly = true;
let pollMs = 2000;

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 120) return seconds.toFixed(1) + " s";
  if (seconds < 7200) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

// An action: the admin token travels in a header, which a page of another origin cannot send
// here (the browser's CORS preflight is refused), so a cross-site form or fetch cannot act.
function post(path) {
  return api(path, { method: "POST", headers: { "X-Outboxkit-Token": token() } });
}

async function api(path, options) {
  const response = await fetch(path, options);
  let body = null;
  try { body = await response.json(); } catch (_e) { body = null; }
  if (!response.ok) {
    const message = body && body.error ? body.error : response.status + " " + response.statusText;
    throw new Error(message);
  }
  return body;
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

function toast(message) {
  const box = $("toast");
  box.textContent = message;
  box.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { box.hidden = true; }, 4000);
}

function cell(row, text, cls) {
  row.appendChild(el("td", text, cls));
}

function actionButton(label, cls, run) {
  const button = el("button", label, cls);
  button.type = "button";
  // Enabled only once this tab has the admin token: a click before would only be refused.
  button.disabled = readOnly || !token();
  button.title = readOnly ? "read-only: start the dashboard with --admin-token"
    : (token() ? "" : "enter the admin token above to act");
  button.addEventListener("click", run);
  return button;
}

function kvRows(tbody, entries) {
  tbody.replaceChildren(...entries.map(([k, v]) => {
    const row = el("tr");
    cell(row, k);
    cell(row, v === null || v === undefined ? "" : (typeof v === "object" ? JSON.stringify(v) : v));
    return row;
  }));
}

// Refresh now and then every pollMs (the outbox's page sets it from its sample interval).
async function poll(refresh) {
  await refresh();
  setTimeout(() => poll(refresh), pollMs);
}

function renderMode(isReadOnly) {
  readOnly = isReadOnly;
  const mode = $("mode");
  mode.textContent = readOnly ? "read-only" : (token() ? "admin" : "admin token needed for actions");
  mode.className = "badge" + (readOnly ? "" : " admin");
  $("token-form").hidden = readOnly;
}

function setUpTokenForm(refresh) {
  $("token").value = token();
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value);
    toast("admin token set for this tab");
    refresh();
  });
}
