// The admin page: plain JS over the /admin/api/* JSON endpoints (and /api/v1/deployments, /ws/chat; the try-a-model
// panel, predict.js, calls the models' own endpoints).
// The admin key lives in sessionStorage only; every call sends it as a Bearer token.
"use strict";

const KEY_STORAGE = "galley.adminKey";
const STATS_MS = 2000, SLOW_MS = 5000;
const state = {
  key: null, timers: [], charts: {}, last: null, tenantsSeen: new Set(),
  ws: null, wsKey: null, conversationId: null, bubbles: new Map(), dirty: new Set(), selectedConversation: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fill(tbody, rows) { tbody.replaceChildren(...rows); }
function bytes(n) {
  if (!n) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0; while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}
function ms(s) { return s === null || s === undefined ? "–" : `${(s * 1000).toFixed(s < 0.1 ? 1 : 0)} ms`; }
function pillClass(s) {
  if (["ready", "stop", "length", "resolved", "inactive"].includes(s)) return "pill ok";
  if (["loading", "pending", "draining", "cancelled", "unloaded"].includes(s)) return "pill warn";
  if (["failed", "error", "timeout", "rejected", "firing"].includes(s)) return "pill danger";
  return "pill";
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${state.key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!resp.ok) throw new ApiError(resp.status, (data && data.error && data.error.message) || `HTTP ${resp.status}`);
  return data;
}

// ---- login ------------------------------------------------------------------------------

async function signIn(key) {
  state.key = key;
  try {
    const stats = await api("GET", "/admin/api/stats");
    sessionStorage.setItem(KEY_STORAGE, key);
    showApp(stats);
    return true;
  } catch (err) {
    state.key = null;
    sessionStorage.removeItem(KEY_STORAGE);
    const message = err.status === 403 ? "That is a tenant key: the admin page needs the admin key."
      : err.status === 401 ? "Invalid admin key." : `Cannot reach the server: ${err.message}`;
    $("login-error").textContent = message;
    $("login").hidden = false;
    $("app").hidden = true;
    return false;
  }
}

function signOut() {
  sessionStorage.removeItem(KEY_STORAGE);
  state.timers.forEach(clearInterval);
  state.timers = [];
  if (state.ws) state.ws.close();
  state.key = null;
  $("app").hidden = true;
  $("login").hidden = false;
  $("admin-key").value = "";
}

function showApp(stats) {
  $("login").hidden = true;
  $("app").hidden = false;
  $("login-error").textContent = "";
  initCharts();
  onStats(stats);
  refreshSlow();
  loadTenants();
  loadConversations();
  state.timers.push(setInterval(pollStats, STATS_MS), setInterval(refreshSlow, SLOW_MS));
}

async function pollStats() {
  try { onStats(await api("GET", "/admin/api/stats")); }
  catch (err) { if (err.status === 401 || err.status === 403) signOut(); else $("status").textContent = "unreachable"; }
}

function refreshSlow() {
  loadModels(); loadDeployments(); loadAlerts(); loadRequests();
}

// ---- live charts ------------------------------------------------------------------------

function initCharts() {
  if (state.charts.tokens) return;
  const make = (id, opts) => new LineChart($(id), opts);
  state.charts = {
    tokens: make("chart-tokens"), ttft: make("chart-ttft"), queuePriority: make("chart-queue-priority"),
    queueTenant: make("chart-queue-tenant"), kv: make("chart-kv", { max: 100 }), batch: make("chart-batch"),
  };
  window.addEventListener("resize", () => Object.values(state.charts).forEach((c) => c.draw()));
}

function onStats(s) {
  const status = s.draining ? "draining" : s.ready ? "ready" : "loading";
  $("status").textContent = status;
  $("status").className = pillClass(status);
  const firing = s.alerts_firing || [];
  $("alert-badge").hidden = firing.length === 0;
  $("alert-badge").textContent = `${firing.length} alert${firing.length === 1 ? "" : "s"} firing`;
  const total = Object.values(s.requests || {}).reduce((a, b) => a + b, 0);
  $("summary").textContent = `${s.models.length} loaded · ${s.running} running · ${s.waiting} waiting · ` +
    `${formatNumber(total)} requests · ${formatNumber(s.generation_tokens)} tokens out`;
  const last = state.last;
  let tps = null, perStep = null;
  if (last && s.time > last.time) {
    const dt = s.time - last.time;
    tps = Math.max(0, (s.generation_tokens - last.generation_tokens) / dt);
    const steps = s.engine_steps - last.engine_steps;
    perStep = steps > 0 ? (s.batched_tokens - last.batched_tokens) / steps : 0;
  }
  state.last = s;
  const c = state.charts;
  c.tokens.push({ "tokens/s": tps });
  c.ttft.push({ p50: s.ttft.p50, p99: s.ttft.p99 });
  const bp = s.queue.by_priority;
  c.queuePriority.push({ high: bp.high || 0, normal: bp.normal || 0, low: bp.low || 0 });
  Object.keys(s.queue.by_tenant).forEach((t) => state.tenantsSeen.add(t));
  const byTenant = {};
  state.tenantsSeen.forEach((t) => { byTenant[t] = s.queue.by_tenant[t] || 0; });
  if (!state.tenantsSeen.size) byTenant.default = 0;
  c.queueTenant.push(byTenant);
  c.kv.push({ "used %": s.kv.usage * 100 });
  c.batch.push({ running: s.running, "tokens/step": perStep });
  Object.values(c).forEach((chart) => chart.draw());
  updatePlaygroundModels(s.models);
  state.statsModels = s.models;
}

// ---- models and deployments -------------------------------------------------------------

async function loadModels() {
  let versions = null;
  try {
    const [data] = await Promise.all([api("GET", "/admin/api/models"), loadSignatures()]);
    versions = Array.isArray(data) ? data : data.data;
  } catch (err) {
    if (err.status !== 404 && err.status !== 405) return;
  }
  const live = new Map((state.statsModels || []).map((m) => [`${m.name}@${m.version}`, m]));
  if (versions === null) {
    versions = (state.statsModels || []).map((m) => ({
      name: m.name, version: m.version, kind: "generate", state: m.state,
      devices: m.replicas.map((r) => r.device), num_in_flight: m.in_flight,
      mem_bytes: m.replicas.reduce((a, r) => a + r.weights_bytes + r.kv_cache_bytes, 0),
    }));
  }
  fill($("models-table").tBodies[0], versions.map((v) => {
    const m = live.get(`${v.name}@${v.version}`);
    const kv = m ? m.replicas.map((r) => `${r.kv_blocks_used}/${r.kv_blocks_total}`).join(", ") : "–";
    const hitRate = (r) => (r.prefix_cache_hit_rate == null ? "–" : `${(100 * r.prefix_cache_hit_rate).toFixed(1)}%`);
    const hits = m ? m.replicas.map(hitRate).join(", ") : "–";
    const accepted = (r) => (r.spec_decode_acceptance_rate == null ? "–"
      : `${(100 * r.spec_decode_acceptance_rate).toFixed(1)}%`);
    const drafts = m ? m.replicas.map(accepted).join(", ") : "–";
    const stateText = v.draining ? "draining" : v.state === "loading" && v.load_progress != null
      ? `loading ${Math.round(100 * v.load_progress)}% (${v.load_phase})` : v.state;
    return el("tr", { dataset: { model: v.name, version: v.version } },
      el("td", {}, v.name), el("td", {}, v.version), el("td", {}, v.kind || "generate"),
      signatureCell(`${v.name}@${v.version}`),
      el("td", {}, el("span", { class: pillClass(v.draining ? "draining" : v.state), title: v.error || "" }, stateText)),
      el("td", {}, (v.devices || []).join(", ") || "–"), el("td", { class: "num" }, bytes(v.mem_bytes)),
      el("td", { class: "num" }, v.num_in_flight ?? "–"), el("td", { class: "num" }, kv),
      el("td", { class: "num", title: "share of admitted prompt tokens whose KV was reused" }, hits),
      el("td", { class: "num", title: "share of speculative draft tokens the model accepted" }, drafts));
  }));
}

async function loadDeployments() {
  let data;
  try { data = await api("GET", "/api/v1/deployments"); }
  catch (err) {
    if (err.status === 404) return;
    $("deployments-list").replaceChildren(el("p", { class: "error" }, `Deployments: ${err.message}`));
    return;
  }
  const container = $("deployments-list");
  const list = data.data || [];
  if (!list.length) { container.replaceChildren(el("p", { class: "muted" }, "No deployments.")); return; }
  const keep = new Map([...container.querySelectorAll(".deployment")].map((d) => [d.dataset.model, d]));
  const nodes = list.map((d) => (state.dirty.has(d.model_name) && keep.get(d.model_name)) || renderDeployment(d));
  container.replaceChildren(...nodes);
}

function renderDeployment(d) {
  const versions = [...new Set([...Object.keys(d.versions || {}), ...Object.keys(d.traffic)])].sort();
  const sliders = new Map();
  const sum = el("span", { class: "muted" });
  const apply = el("button", { type: "button", class: "small", "data-testid": "apply-traffic" }, "Apply split");
  const updateSum = () => {
    const total = [...sliders.values()].reduce((a, s) => a + Number(s.value), 0);
    sum.textContent = `total ${total}%`;
    apply.disabled = total !== 100;
  };
  const rows = versions.map((v) => {
    const info = (d.versions || {})[v] || {};
    const slider = el("input", { type: "range", min: 0, max: 100, step: 1, value: d.traffic[v] || 0,
      "data-version": v, "aria-label": `traffic for version ${v}` });
    const out = el("output", {}, `${d.traffic[v] || 0}%`);
    slider.addEventListener("input", () => {
      state.dirty.add(d.model_name);
      if (versions.length === 2) {
        const other = sliders.get(versions.find((x) => x !== v));
        other.value = 100 - Number(slider.value);
        other.nextSibling.textContent = `${other.value}%`;
      }
      out.textContent = `${slider.value}%`;
      updateSum();
    });
    sliders.set(v, slider);
    const label = `v${v}${v === d.stable_version ? " (stable)" : ""}`;
    return el("div", { class: "split-row" },
      el("span", { title: info.state || "" }, label, " ", el("span", { class: pillClass(info.state || "unloaded") },
        info.state || "unloaded")), slider, out);
  });
  apply.addEventListener("click", async () => {
    const traffic = {};
    sliders.forEach((s, v) => { if (Number(s.value) > 0) traffic[v] = Number(s.value); });
    try {
      await api("PUT", `/api/v1/deployments/${encodeURIComponent(d.model_name)}/traffic`, traffic);
      state.dirty.delete(d.model_name);
      loadDeployments(); loadModels();
    } catch (err) { alert(`Traffic split not applied: ${err.message}`); }
  });
  const rollback = el("button", { type: "button", class: "small danger", "data-testid": "rollback" }, "Roll back");
  rollback.addEventListener("click", async () => {
    if (!confirm(`Send all of ${d.model_name}'s traffic back to its stable version?`)) return;
    try { await api("POST", `/api/v1/deployments/${encodeURIComponent(d.model_name)}/rollback`); }
    catch (err) { alert(`Rollback failed: ${err.message}`); }
    state.dirty.delete(d.model_name);
    loadDeployments();
  });
  const events = (d.events || []).slice(0, 5).map((e) =>
    el("li", {}, `${e.created_at} ${e.kind}: ${JSON.stringify(e.traffic_after)}${e.reason ? ` (${e.reason})` : ""}`));
  const node = el("div", { class: "deployment", dataset: { model: d.model_name } },
    el("div", { class: "row" }, el("strong", {}, d.model_name), el("span", { class: "muted" },
      `stable v${d.stable_version}`), el("span", { class: "spacer" }), sum, apply, rollback),
    ...rows, events.length ? el("ul", { class: "events" }, ...events) : null);
  updateSum();
  return node;
}

// ---- tenants and keys -------------------------------------------------------------------

async function loadTenants() {
  let tenants;
  try { tenants = (await api("GET", "/admin/api/tenants")).data; } catch (_) { return; }
  const rows = await Promise.all(tenants.map(async (t) => {
    let keys = [];
    try { keys = (await api("GET", `/admin/api/tenants/${encodeURIComponent(t.name)}/keys`)).data; } catch (_) { keys = []; }
    const limits = ["max_concurrent", "requests_per_minute", "tokens_per_minute", "max_tokens"]
      .filter((k) => t[k] !== null).map((k) => `${k}=${t[k]}`).join(" ") || "none";
    const keyList = el("div", { class: "keys" }, ...keys.map((k) => el("div", {},
      el("code", { class: k.revoked_at ? "revoked" : "" }, `${k.prefix}…`), " ",
      k.revoked_at ? el("span", { class: "muted" }, "revoked") :
        el("button", { type: "button", class: "small danger", onclick: () => revokeKey(k.prefix) }, "Revoke"))));
    const actions = el("td", {},
      el("button", { type: "button", class: "small", "data-testid": `new-key-${t.name}`,
        onclick: () => createKey(t.name) }, "New key"), " ",
      t.name === "default" ? null : el("button", { type: "button", class: "small danger",
        onclick: () => deleteTenant(t.name) }, "Delete"));
    return el("tr", { dataset: { tenant: t.name } }, el("td", {}, t.name), el("td", { class: "num" }, t.weight),
      el("td", {}, t.max_priority), el("td", {}, limits), el("td", {}, keyList), actions);
  }));
  fill($("tenants-table").tBodies[0], rows);
}

async function createTenant(event) {
  event.preventDefault();
  const name = $("tenant-name").value.trim();
  try {
    await api("POST", "/admin/api/tenants", { name, weight: Number($("tenant-weight").value) || 1 });
    $("tenant-name").value = "";
    await loadTenants();
  } catch (err) { alert(`Tenant not created: ${err.message}`); }
}

async function createKey(tenant) {
  try {
    const made = await api("POST", `/admin/api/tenants/${encodeURIComponent(tenant)}/keys`);
    $("new-key-tenant").textContent = tenant;
    $("new-key-value").textContent = made.key;
    $("new-key").hidden = false;
    await loadTenants();
  } catch (err) { alert(`Key not created: ${err.message}`); }
}

function dismissKey() {
  $("new-key-value").textContent = "";
  $("new-key").hidden = true;
}

async function revokeKey(prefix) {
  if (!confirm(`Revoke the key ${prefix}…? Requests with it are refused at once.`)) return;
  try { await api("DELETE", `/admin/api/keys/${encodeURIComponent(prefix)}`); } catch (err) { alert(err.message); }
  loadTenants();
}

async function deleteTenant(name) {
  if (!confirm(`Delete the tenant ${name}, its keys and conversations?`)) return;
  try { await api("DELETE", `/admin/api/tenants/${encodeURIComponent(name)}`); } catch (err) { alert(err.message); }
  loadTenants();
}

// ---- wiring -----------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (e) => { e.preventDefault(); signIn($("admin-key").value.trim()); });
  $("logout").addEventListener("click", signOut);
  $("tenant-form").addEventListener("submit", createTenant);
  $("new-key-dismiss").addEventListener("click", dismissKey);
  $("new-key-use").addEventListener("click", () => {
    $("play-key").value = $("new-key-value").textContent;
    dismissKey();
    location.hash = "#playground";
  });
  $("requests-refresh").addEventListener("click", loadRequests);
  $("conversations-refresh").addEventListener("click", loadConversations);
  $("profile-button").addEventListener("click", recordProfile);
  $("play-form").addEventListener("submit", sendChat);
  $("play-new").addEventListener("click", newChat);
  $("try-model").addEventListener("change", () => chooseTry($("try-model").value, false));
  $("try-example").addEventListener("click", () => chooseTry($("try-model").value, false));
  $("try-image").addEventListener("change", useImageFile);
  $("try-send").addEventListener("click", sendTry);
  const saved = sessionStorage.getItem(KEY_STORAGE);
  if (saved) signIn(saved); else $("login").hidden = false;
});
