// slotkeeper dashboard: polls the JSON API every few seconds and renders slots, snapshots and recent requests, and
// calls the operator actions (clear, pin, delete, pre-warm).
// Every value from the server is written with textContent, never as HTML (session ids are client strings).
"use strict";

const POLL_MS = 2000;
const KEY_STORAGE = "slotkeeper.adminKey";
const keyInput = document.getElementById("admin-key");
const modelSelect = document.getElementById("model");
keyInput.value = localStorage.getItem(KEY_STORAGE) || "";
keyInput.addEventListener("change", () => localStorage.setItem(KEY_STORAGE, keyInput.value.trim()));
modelSelect.addEventListener("change", () => refresh());

function headers(json) {
  const key = keyInput.value.trim();
  const h = key ? { Authorization: "Bearer " + key } : {};
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(method, path, body) {
  const init = { method, headers: headers(body !== undefined), cache: "no-store" };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  let data = null;
  try { data = await response.json(); } catch (e) { data = null; }
  if (!response.ok) {
    const message = data && data.error && (data.error.message || data.error) || response.statusText;
    throw new Error(method + " " + path.split("?")[0] + ": " + response.status + " " + message);
  }
  return data;
}

// The backend the per-backend views and actions are about: the chosen model, or the first (only) one.
function chosenModel() {
  return modelSelect.value || null;
}

function withParams(path, params) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && value !== undefined) query.set(name, String(value));
  }
  const text = query.toString();
  return text ? path + "?" + text : path;
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

async function act(run) {
  try {
    setAction(await run(), false);
  } catch (error) {
    setAction(String(error.message || error), true);
  }
  await refresh();
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  return td;
}

function button(text, className, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = text;
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function actions(...buttons) {
  const td = document.createElement("td");
  td.className = "actions";
  td.append(...buttons);
  return td;
}

// Rows are patched in place, not rebuilt on every poll: a row (or a cell holding buttons) that looks the same is kept,
// so a click that lands while the page refreshes reaches the button it was aimed at.
function fillBody(table, rows) {
  const body = document.querySelector("#" + table + " tbody");
  const old = [...body.children];
  if (old.length !== rows.length || rows.some((row, i) => !sameRow(old[i], row))) {
    body.replaceChildren(...rows);
    return;
  }
  rows.forEach((row, i) => patchRow(old[i], row));
}

function sameRow(a, b) {
  return a.children.length === b.children.length && JSON.stringify(a.dataset) === JSON.stringify(b.dataset);
}

function patchRow(old, row) {
  [...row.children].forEach((td, j) => {
    const current = old.children[j];
    if (current.outerHTML === td.outerHTML) return;  // unchanged: its buttons and their handlers stay
    if (td.querySelector("button") || current.querySelector("button")) current.replaceWith(td);
    else {
      current.textContent = td.textContent;
      current.className = td.className;
      current.title = td.title;
      current.style.cssText = td.style.cssText;
    }
  });
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

function renderModels(backend) {
  if (!backend || !backend.models) return;
  const models = backend.models;
  document.getElementById("model-choice").hidden = models.length < 2;
  const shown = Array.from(modelSelect.options).map((o) => o.value);
  if (shown.join("\u0000") === models.join("\u0000")) return;
  const chosen = modelSelect.value;
  modelSelect.replaceChildren(...models.map((m) => {
    const option = document.createElement("option");
    option.value = m;
    option.textContent = m;
    return option;
  }));
  modelSelect.value = models.includes(chosen) ? chosen : models[0];
}

function renderModelStates(data) {
  const section = document.getElementById("models-section");
  section.hidden = !data || !data.take_turns;
  if (section.hidden) return;
  const now = Date.now() / 1000;
  fillBody("models", data.models.map((m) => {
    const tr = document.createElement("tr");
    tr.dataset.model = m.model;
    const until = m.expires_at === null ? "when another model needs the room"
      : "in " + Math.max(0, Math.round(m.expires_at - now)) + " s";
    tr.append(cell(m.model), cell(m.status, "state"), cell(m.turns_running, "num"), cell(m.loads, "num"),
      cell(m.unloads, "num"), cell(m.saved_at_last_unload.join(", ") || "-", "session"),
      cell(m.status === "loaded" ? until : "-"));
    return tr;
  }));
}

function renderSummary(current, sessions, systems, backend) {
  const items = [
    ["model", current.model],
    ["slots", current.slots.length],
    ["waiting", current.queue],
    ["saves", current.saves],
    ["failed saves", current.failed_saves],
    ["restores", current.restores],
    ["restores reused", current.restores_effective + " / " + (current.restores_effective + current.restores_ineffective)],
    ["restoring", current.restore_effective ? "on" : "off (restores did not help)"],
    ["warm-ups", current.warm_ups + (current.failed_warm_ups ? " (" + current.failed_warm_ups + " failed)" : "")],
    ["snapshots", sessions.length],
    ["system snapshots", systems.length],
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
  if (backend) {
    document.getElementById("backend").textContent = backend.model + " at " + backend.url + " (" +
      (backend.up ? "up" : "DOWN") + ", " + backend.slots + " slot(s) of " + backend.ctx_per_slot + " tokens)";
  }
}

// "X used of budget Y (N evicted)", with a bar for the share of the budget in use.
function renderDisk(disk) {
  const budget = disk.budget.max_bytes;
  let text = bytes(disk.bytes) + " used " + (budget ? "of budget " + bytes(budget) : "(no size budget)") +
    " (" + disk.evictions + " evicted)";
  const limits = [];
  if (disk.budget.max_age_seconds) limits.push("max age " + (disk.budget.max_age_seconds / 86400).toFixed(1) + " d");
  if (disk.budget.max_system_snapshots) limits.push(disk.budget.max_system_snapshots + " system snapshot(s) per model");
  if (limits.length) text += "; " + limits.join(", ");
  text += "; " + bytes(disk.disk_free_bytes) + " free in " + disk.slot_dir;
  document.getElementById("disk-text").textContent = text;
  const share = budget ? Math.min(1, disk.bytes / budget) : 0;
  const bar = document.getElementById("disk-bar");
  bar.style.width = (share * 100).toFixed(1) + "%";
  bar.className = share >= 0.9 ? "full" : "";
  bar.parentElement.hidden = !budget;
}

function renderSlots(current) {
  const model = chosenModel();
  fillBody("slots", current.slots.map((slot) => {
    const tr = document.createElement("tr");
    tr.dataset.slot = String(slot.id);
    tr.dataset.model = model || "";  // what its clear button acts on
    const state = [slot.busy ? "busy" : "idle", slot.dirty ? "unsaved changes" : "saved"].join(", ");
    const clear = button("clear", "danger clear", "Save this slot's session if it changed, then erase the slot",
      () => clearSlot(slot.id, model));
    // A slot whose conversation was saved and then cut back to its system part still holds that part's tokens.
    const holds = slot.session || (slot.n_tokens > 0 ? "(a shared beginning, no conversation)" : "(empty)");
    tr.append(cell(slot.id, "num"), cell(holds, "session"), cell(slot.model),
      cell(slot.n_tokens, "num"), cell(state), actions(clear));
    return tr;
  }));
}

function pinButton(s) {
  const verb = s.pinned ? "unpin" : "pin";
  const title = s.pinned ? "Let the disk budget evict this snapshot again" : "Keep this snapshot from the disk budget";
  return button(verb, "pin", title, () => setPinned(s, verb));
}

function renderSessions(sessions, totals) {
  const saved = new Map(totals.map((t) => [t.model + "\u0000" + t.session, t]));
  fillBody("sessions", sessions.map((s) => {
    const tr = document.createElement("tr");
    tr.dataset.session = s.session;
    tr.dataset.model = s.model;  // what its buttons act on
    const t = saved.get(s.model + "\u0000" + s.session);
    const remove = button("delete", "danger delete", "", () => deleteSnapshot(s));
    tr.append(cell(s.session, "session"), cell(s.model), cell(s.tokens, "num"), cell(bytes(s.bytes), "num"),
      cell(ago(s.last_used)), cell(s.hits, "num"), cell(t ? t.seconds_saved.toFixed(1) + " s" : "", "num"),
      cell(s.hot_in_slot === null ? "" : s.hot_in_slot), cell(s.pinned ? "yes" : "no", "pinned"),
      actions(pinButton(s), remove));
    return tr;
  }));
  document.getElementById("no-sessions").hidden = sessions.length > 0;
}

function renderSystems(systems) {
  fillBody("systems", systems.map((s) => {
    const tr = document.createElement("tr");
    tr.dataset.system = s.session;
    tr.dataset.model = s.model;  // what its buttons act on
    const key = cell(s.session.slice(0, 12), "key");
    key.title = s.session;
    const remove = button("delete", "danger delete", "", () => deleteSnapshot(s));
    tr.append(key, cell(s.model), cell(s.tokens, "num"), cell(bytes(s.bytes), "num"), cell(ago(s.last_used)),
      cell(s.hits, "num"), cell(s.pinned ? "yes" : "no", "pinned"), actions(pinButton(s), remove));
    return tr;
  }));
  document.getElementById("no-systems").hidden = systems.length > 0;
}

function renderRequests(recent) {
  fillBody("requests", recent.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.append(cell(new Date(r.time * 1000).toLocaleTimeString()), cell(r.api + (r.side ? " (side)" : "")),
      cell(r.model), cell(r.session, "session"), cell(r.slot, "num"), cell(r.cache, "cache-" + r.cache),
      cell(r.cache_n, "num"), cell(r.prompt_n, "num"), cell(r.restore_ms.toFixed(1), "num"),
      cell(r.save_ms.toFixed(1), "num"), cell(r.status, "num"), cell(Math.round(r.ms), "num"), whyCell(r));
    return tr;
  }));
}

function whyCell(r) {
  const td = cell(r.why || "-", "why");
  if (r.why_detail) td.title = r.why_detail;
  td.style.color = reasonColor(r.why);
  return td;
}

// Reused state in greens and blues, misses a client or the set-up caused in warm colours, the rest grey.
const REASON_COLORS = {
  "hot": "#1a7f37", "own": "#2a6f97", "prefix": "#4f8fbf", "system": "#7fb3d5", "in-slot": "#59a96a",
  "new-session": "#9aa5b1", "side-task": "#c8ccd1", "rewritten": "#d97706", "evicted": "#b42318",
  "not-restorable": "#8e3a59", "quarantined": "#7a1f1f", "backend-restarted": "#e4572e", "slot-taken": "#f59e0b",
  "not-extended": "#a16207", "keep-hot": "#ca8a04", "too-short": "#b8c0c8", "too-long": "#6b7280",
  "warm-up": "#94a3b8", "nothing-shared": "#aab4be", "restore-failed": "#dc2626", "default-session": "#d1d5db",
};

function reasonColor(reason) {
  return REASON_COLORS[reason] || "#66707a";
}

function renderReasons(recent) {
  const rows = recent.requests.filter((r) => r.why);
  const chart = document.getElementById("reasons-chart");
  const legend = document.getElementById("reasons-legend");
  document.getElementById("no-reasons").hidden = rows.length > 0;
  chart.replaceChildren();
  legend.replaceChildren();
  if (!rows.length) return;
  const minute = (r) => Math.floor(r.time / 60);
  const last = Math.max(...rows.map(minute));
  const first = Math.max(Math.min(...rows.map(minute)), last - 29);  // at most the last 30 minutes
  const counts = new Map();  // minute -> reason -> count
  const totals = new Map();
  for (const r of rows) {
    if (minute(r) < first) continue;
    const byReason = counts.get(minute(r)) || new Map();
    byReason.set(r.why, (byReason.get(r.why) || 0) + 1);
    counts.set(minute(r), byReason);
    totals.set(r.why, (totals.get(r.why) || 0) + 1);
  }
  const reasons = [...totals.keys()].sort((a, b) => totals.get(b) - totals.get(a));
  const tallest = Math.max(...[...counts.values()].map((m) => [...m.values()].reduce((a, b) => a + b, 0)));
  const n = last - first + 1, width = 720 / n, height = 120, ns = "http://www.w3.org/2000/svg";
  for (let m = first; m <= last; m++) {
    let y = height;
    const byReason = counts.get(m) || new Map();
    for (const reason of reasons) {
      const count = byReason.get(reason) || 0;
      if (!count) continue;
      const h = (count / tallest) * height;
      y -= h;
      const rect = document.createElementNS(ns, "rect");
      rect.setAttribute("x", String((m - first) * width + 1));
      rect.setAttribute("y", String(y));
      rect.setAttribute("width", String(Math.max(width - 2, 1)));
      rect.setAttribute("height", String(h));
      rect.setAttribute("fill", reasonColor(reason));
      const title = document.createElementNS(ns, "title");
      title.textContent = `${new Date(m * 60000).toLocaleTimeString()}: ${count} ${reason}`;
      rect.append(title);
      chart.append(rect);
    }
  }
  const axis = document.createElementNS(ns, "text");
  axis.setAttribute("x", "0");
  axis.setAttribute("y", "136");
  axis.setAttribute("class", "axis");
  axis.textContent = `${new Date(first * 60000).toLocaleTimeString()} to ${new Date(last * 60000).toLocaleTimeString()}`;
  chart.append(axis);
  for (const reason of reasons) {
    const item = document.createElement("span");
    item.className = "reason";
    item.dataset.reason = reason;
    const swatch = document.createElement("i");
    swatch.style.background = reasonColor(reason);
    item.append(swatch, `${reason} ${totals.get(reason)}`);
    legend.append(item);
  }
}

// Only the newest refresh renders: an older poll that answers late must not overwrite what an action just showed.
let refreshes = 0;

async function refresh() {
  const seq = ++refreshes;
  try {
    const model = { model: chosenModel() };
    // First, and on its own: in front of a router, the rest answers only once a model was loaded.
    const models = await api("GET", "/api/models").catch(() => null);
    if (seq !== refreshes) return;
    renderModelStates(models);
    const [current, listed, recent, disk, backend] = await Promise.all([
      api("GET", withParams("/api/sessions/current", model)), api("GET", "/api/sessions?kind=all"),
      api("GET", "/api/requests/recent"), api("GET", withParams("/api/sessions/disk", model)),
      api("GET", withParams("/api/backend", model)).catch(() => null),
    ]);
    if (seq !== refreshes) return;
    const sessions = listed.sessions.filter((s) => s.kind !== "system");
    const systems = listed.sessions.filter((s) => s.kind === "system");
    renderModels(backend);
    renderSummary(current, sessions, systems, backend);
    renderDisk(disk);
    renderSlots(current);
    renderSessions(sessions, recent.session_totals);
    renderSystems(systems);
    renderRequests(recent);
    renderReasons(recent);
    setStatus("updated " + new Date().toLocaleTimeString(), false);
  } catch (error) {
    if (seq === refreshes) setStatus(String(error.message || error), true);
  }
}

function snapshotPath(s, action) {
  const path = "/api/sessions/" + encodeURIComponent(s.session) + (action ? "/" + action : "");
  return withParams(path, { model: s.model, kind: s.kind === "system" ? "system" : null });
}

function describe(s) {
  return s.kind === "system" ? "system prompt " + s.session.slice(0, 12) : s.session;
}

async function deleteSnapshot(s) {
  if (!confirm("Delete the snapshot of " + (s.kind === "system" ? "" : "session ") + "'" + describe(s) + "'?")) return;
  await act(async () => {
    const result = await api("DELETE", snapshotPath(s, ""));
    return "deleted " + describe({ ...s, session: result.deleted }) + " (" + bytes(result.bytes) + ")";
  });
}

async function setPinned(s, verb) {
  await act(async () => {
    const result = await api("POST", snapshotPath(s, verb));
    return (result.pinned ? "pinned " : "unpinned ") + describe(s);
  });
}

async function clearSlot(slot, model) {
  if (!confirm("Save slot " + slot + " if it changed, then erase it?")) return;
  await act(async () => {
    const result = await api("POST", withParams("/api/sessions/clear", { slot, model }));
    return "erased slot " + slot + (result.held ? " (held " + result.held + ", saved first if it had changed)" : "");
  });
}

document.getElementById("clear-slots").addEventListener("click", async () => {
  if (!confirm("Save changed slots, then erase every slot?")) return;
  await act(async () => {
    const result = await api("POST", withParams("/api/sessions/clear", { model: chosenModel() }));
    return "erased slot(s) " + result.erased_slots.join(", ");
  });
});

const PREWARM_STATUS = {
  saved: "saved as a system snapshot",
  exists: "already had a system snapshot",
  "too-short": "is too short to be worth a snapshot (its restore would cost more than its prefill)",
};

document.getElementById("prewarm-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = document.getElementById("prewarm-system").value;
  const result = document.getElementById("prewarm-result");
  const submit = document.getElementById("prewarm-button");
  if (!text.trim()) {
    result.textContent = "give a system prompt first";
    result.className = "error";
    return;
  }
  submit.disabled = true;
  result.textContent = "warming up…";
  result.className = "muted";
  try {
    const body = { system: text };
    if (chosenModel()) body.model = chosenModel();
    const r = await api("POST", "/api/sessions/prewarm", body);
    result.textContent = "system prompt " + r.system.slice(0, 12) + " (" + r.model + ", " + r.tokens + " tokens) " +
      PREWARM_STATUS[r.status] + (r.status === "saved" ? ", " + bytes(r.bytes) : "") + " in " +
      (r.ms / 1000).toFixed(1) + " s";
    result.className = "ok";
    result.dataset.system = r.system;
  } catch (error) {
    result.textContent = String(error.message || error);
    result.className = "error";
  } finally {
    submit.disabled = false;
  }
  await refresh();
});

refresh();
setInterval(refresh, POLL_MS);
