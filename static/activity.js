// The admin page's alerts, request log, conversations and profiling (loaded after admin.js, whose
// helpers and state it uses).
"use strict";

// ---- alerts, requests, conversations ------------------------------------------------------

async function loadAlerts() {
  let data;
  try { data = await api("GET", "/admin/api/alerts"); } catch (_) { return; }
  $("alerts-firing").replaceChildren(...(data.firing.length ? data.firing.map((a) => el("div", { class: "firing" },
    el("strong", {}, a.name), ` ${a.kind} = ${formatNumber(a.value)} > ${a.threshold}`,
    el("span", { class: "muted" }, ` since ${new Date(a.since * 1000).toLocaleTimeString()}`)))
    : [el("p", { class: "muted" }, "Nothing firing.")]));
  fill($("alerts-table").tBodies[0], data.rules.map((r) => el("tr", { dataset: { alert: r.name } },
    el("td", {}, r.name, r.model ? ` (${r.model})` : ""), el("td", {}, r.kind), el("td", { class: "num" }, r.threshold),
    el("td", { class: "num" }, formatNumber(r.value)), el("td", {}, el("span", { class: pillClass(r.state) }, r.state)))));
  $("alerts-history").replaceChildren(...data.history.slice(0, 30).map((h) => el("li", {},
    `${new Date(h.at * 1000).toLocaleTimeString()} `, el("span", { class: pillClass(h.state) }, h.state),
    ` ${h.name} (${formatNumber(h.value)} vs ${h.threshold})`)));
}

async function loadRequests() {
  let data;
  try { data = (await api("GET", "/admin/api/requests?limit=100")).data; } catch (_) { return; }
  fill($("requests-table").tBodies[0], data.map((r) => el("tr", { dataset: { requestId: r.request_id } },
    el("td", {}, new Date(r.time * 1000).toLocaleTimeString()), el("td", {}, el("code", {}, r.request_id)),
    el("td", {}, r.tenant), el("td", {}, r.model),
    el("td", {}, el("span", { class: pillClass(r.status), title: r.error || "" }, r.status)),
    el("td", { class: "num" }, r.prompt_tokens), el("td", { class: "num" }, r.output_tokens),
    el("td", { class: "num" }, ms(r.queue_s)), el("td", { class: "num" }, ms(r.prefill_s)),
    el("td", { class: "num" }, ms(r.decode_s)), el("td", { class: "num" }, ms(r.total_s)))));
}

async function loadConversations() {
  const tenant = $("conversations-tenant").value.trim();
  let data;
  try {
    data = (await api("GET", `/admin/api/conversations?limit=100${tenant ? `&tenant=${encodeURIComponent(tenant)}` : ""}`)).data;
  } catch (_) { return; }
  $("conversations-list").replaceChildren(...(data.length ? data.map((c) => el("li", {
    dataset: { id: c.id }, class: c.id === state.selectedConversation ? "active" : "",
    onclick: () => showConversation(c.id),
  }, el("strong", {}, c.title || c.id.slice(0, 13)), el("br"),
  el("span", { class: "muted" }, `${c.tenant} · ${c.model}@${c.model_version} · ${c.num_messages} messages`)))
    : [el("li", { class: "muted" }, "No conversations.")]));
}

async function showConversation(id) {
  state.selectedConversation = id;
  document.querySelectorAll("#conversations-list li").forEach((li) => li.classList.toggle("active", li.dataset.id === id));
  try {
    const c = await api("GET", `/admin/api/conversations/${encodeURIComponent(id)}`);
    $("conversation-view").replaceChildren(el("p", { class: "muted" }, `${c.tenant} · ${c.model}@${c.model_version}`),
      ...c.messages.map((m) => el("div", { class: `msg ${m.role}` }, el("span", { class: "role" }, m.role),
        el("span", { class: "body" }, m.content))));
  } catch (err) { $("conversation-view").replaceChildren(el("p", { class: "error" }, err.message)); }
}

// ---- profiling --------------------------------------------------------------------------

async function recordProfile() {
  const seconds = Number($("profile-seconds").value) || 3;
  const button = $("profile-button");
  button.disabled = true;
  button.textContent = `Recording ${seconds}s…`;
  try {
    const resp = await fetch(`/admin/api/profile?seconds=${seconds}`, {
      method: "POST", headers: { Authorization: `Bearer ${state.key}` } });
    if (!resp.ok) throw new Error((await resp.json()).error.message);
    const blob = await resp.blob();
    const match = /filename="([^"]+)"/.exec(resp.headers.get("Content-Disposition") || "");
    const link = el("a", { href: URL.createObjectURL(blob), download: match ? match[1] : "galley-profile.json" });
    document.body.append(link); link.click(); link.remove();
  } catch (err) { alert(`Profile failed: ${err.message}`); }
  button.disabled = false;
  button.textContent = "Record profile";
}
