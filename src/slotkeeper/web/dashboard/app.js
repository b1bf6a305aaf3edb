// slotkeeper dashboard: polls the JSON API every few seconds and renders slots, sessions and recent requests.
// Every value from the server is written with textContent, never as HTML (session ids are client strings).
"use strict";

const POLL_MS = 2000;
const KEY_STORAGE = "slotkeeper.adminKey";
const keyInput = document.getElementById("admin-key");
keyInput.value = localStorage.getItem(KEY_STORAGE) || "";
keyInput.addEventListener("change", () => localStorage.setItem(KEY_STORAGE, keyInput.value.trim()));

function headers() {
  const key = keyInput.value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(method, path) {
  const response = await fetch(path, { method, headers: headers(), cache: "no-store" });
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) {
    const message = body && body.error && (body.error.message || body.error) || response.statusText;
    throw new Error(method + " " + path + ": " + response.status + " " + message);
  }
  return body;
}

function setStatus(text, isError) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = "status" + (isError ? " error" : "");
}

// The outcome of the last action stays shown; the polling status line is rewritten on every refresh.
function setAction(text, isError) {
  const el = document.getElementById("action");
  el.textContent = text;
  el.className = "action" + (isError ? " error" : "");
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  return td;
}

function fillBody(table, rows) {
  const body = document.querySelector("#" + table + " tbody");
  body.replaceChildren(...rows);
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function ago(iso) {
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 60) return Math.round(seconds) + " s ago";
  if (seconds < 3600) return Math.round(seconds / 60) + " min ago";
  if (seconds < 86400) return (seconds / 3600).toFixed(1) + " h ago";
  return (seconds / 86400).toFixed(1) + " d ago";
}

function renderSummary(current, sessions, backend) {
  const total = sessions.sessions.reduce((sum, s) => sum + s.bytes, 0);
  const items = [
    ["model", current.model],
    ["slots", current.slots.length],
    ["waiting", current.queue],
    ["saves", current.saves],
    ["failed saves", current.failed_saves],
    ["restores", current.restores],
    ["restores reused", current.restores_effective + " / " + (current.restores_effective + current.restores_ineffective)],
    ["restoring", current.restore_effective ? "on" : "off (restores did not help)"],
    ["snapshots", sessions.sessions.length],
    ["on disk", bytes(total)],
  ];
  const dl = document.getElementById("summary");
  dl.replaceChildren(...items.map(([name, value]) => {
    const div = document.createElement("div");
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = String(value);
    div.dataset.metric = name;
    div.append(dt, dd);
    return div;
  }));
  const free = backend && backend.slot_dir_free_bytes;
  document.getElementById("disk").textContent = bytes(total) + " in " + sessions.slot_dir +
    (free !== null && free !== undefined ? " (" + bytes(free) + " free; no budget configured)" : "");
  if (backend) {
    document.getElementById("backend").textContent = backend.model + " at " + backend.url + " (" +
      (backend.up ? "up" : "DOWN") + ", " + backend.slots + " slot(s) of " + backend.ctx_per_slot + " tokens)";
  }
}

function renderSlots(current) {
  fillBody("slots", current.slots.map((slot) => {
    const tr = document.createElement("tr");
    tr.dataset.slot = String(slot.id);
    const state = [slot.busy ? "busy" : "idle", slot.dirty ? "unsaved changes" : "saved"].join(", ");
    tr.append(cell(slot.id, "num"), cell(slot.session || "(empty)", "session"), cell(slot.model),
      cell(slot.n_tokens, "num"), cell(state));
    return tr;
  }));
}

function renderSessions(sessions, totals) {
  const saved = new Map(totals.map((t) => [t.model + "\u0000" + t.session, t]));
  fillBody("sessions", sessions.sessions.map((s) => {
    const tr = document.createElement("tr");
    tr.dataset.session = s.session;
    const t = saved.get(s.model + "\u0000" + s.session);
    const button = document.createElement("button");
    button.type = "button";
    button.className = "danger delete";
    button.textContent = "delete";
    button.addEventListener("click", () => deleteSession(s.session, s.model));
    const action = document.createElement("td");
    action.append(button);
    tr.append(cell(s.session, "session"), cell(s.model), cell(s.tokens, "num"), cell(bytes(s.bytes), "num"),
      cell(ago(s.last_used)), cell(s.hits, "num"), cell(t ? t.seconds_saved.toFixed(1) + " s" : "", "num"),
      cell(s.hot_in_slot === null ? "" : s.hot_in_slot), action);
    return tr;
  }));
  document.getElementById("no-sessions").hidden = sessions.sessions.length > 0;
}

function renderRequests(recent) {
  fillBody("requests", recent.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.append(cell(new Date(r.time * 1000).toLocaleTimeString()), cell(r.api + (r.side ? " (side)" : "")),
      cell(r.session, "session"), cell(r.slot, "num"), cell(r.cache, "cache-" + r.cache), cell(r.cache_n, "num"),
      cell(r.prompt_n, "num"), cell(r.restore_ms.toFixed(1), "num"), cell(r.save_ms.toFixed(1), "num"),
      cell(r.status, "num"), cell(Math.round(r.ms), "num"));
    return tr;
  }));
}

async function refresh() {
  try {
    const [current, sessions, recent, backend] = await Promise.all([
      api("GET", "/api/sessions/current"), api("GET", "/api/sessions"), api("GET", "/api/requests/recent"),
      api("GET", "/api/backend").catch(() => null),
    ]);
    renderSummary(current, sessions, backend);
    renderSlots(current);
    renderSessions(sessions, recent.session_totals);
    renderRequests(recent);
    setStatus("updated " + new Date().toLocaleTimeString(), false);
  } catch (error) {
    setStatus(String(error.message || error), true);
  }
}

async function deleteSession(session, model) {
  if (!confirm("Delete the snapshot of session '" + session + "'?")) return;
  try {
    const result = await api("DELETE", "/api/sessions/" + encodeURIComponent(session) + "?model=" +
      encodeURIComponent(model));
    setAction("deleted " + result.deleted + " (" + bytes(result.bytes) + ")", false);
  } catch (error) {
    setAction(String(error.message || error), true);
  }
  await refresh();
}

document.getElementById("clear-slots").addEventListener("click", async () => {
  if (!confirm("Save changed slots, then erase every slot?")) return;
  try {
    const result = await api("POST", "/api/sessions/clear");
    setAction("erased slot(s) " + result.erased_slots.join(", "), false);
  } catch (error) {
    setAction(String(error.message || error), true);
  }
  await refresh();
});

refresh();
setInterval(refresh, POLL_MS);
