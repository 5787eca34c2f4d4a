// The admin page's chat playground over /ws/chat (loaded after admin.js, whose helpers and state it uses).
"use strict";

// ---- chat playground over /ws/chat ----------------------------------------------------------

function updatePlaygroundModels(models) {
  const select = $("play-model");
  const names = [...new Set(models.map((m) => m.name))].sort();
  const current = [...select.options].map((o) => o.value);
  if (names.join("\n") === current.join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
  if (names.includes(chosen)) select.value = chosen;
}

function socket() {
  const key = $("play-key").value.trim();
  if (state.ws && state.ws.readyState <= WebSocket.OPEN && state.wsKey === key) return Promise.resolve(state.ws);
  if (state.ws) state.ws.close();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${scheme}://${location.host}/ws/chat${key ? `?token=${encodeURIComponent(key)}` : ""}`);
  state.ws = ws; state.wsKey = key;
  ws.addEventListener("message", (e) => onSocketMessage(JSON.parse(e.data)));
  ws.addEventListener("close", () => {
    if (state.ws === ws) state.ws = null;
    if ($("play-send").disabled) setPlayStatus("Connection closed (with --auth, a tenant API key is needed).", true);
    $("play-send").disabled = false;
  });
  return new Promise((resolve, reject) => {
    ws.addEventListener("open", () => resolve(ws), { once: true });
    ws.addEventListener("error", () => reject(new Error("cannot open /ws/chat")), { once: true });
  });
}

function bubble(role, text) {
  const body = el("span", { class: "body" }, text);
  const node = el("div", { class: `msg ${role}` }, el("span", { class: "role" }, role), body);
  $("play-transcript").append(node);
  $("play-transcript").scrollTop = $("play-transcript").scrollHeight;
  return body;
}

function setPlayStatus(text, error = false) {
  $("play-status").textContent = text;
  $("play-status").className = error ? "error" : "muted";
}

function onSocketMessage(m) {
  if (m.type === "start") {
    state.conversationId = m.conversation_id || state.conversationId;
    const body = bubble("assistant", "");
    body.dataset.streamId = m.stream_id;
    state.bubbles.set(m.stream_id, body);
    setPlayStatus("streaming…");
  } else if (m.type === "token") {
    const body = state.bubbles.get(m.stream_id);
    if (body) { body.textContent += m.text; $("play-transcript").scrollTop = $("play-transcript").scrollHeight; }
  } else if (m.type === "done") {
    const u = m.usage || {};
    setPlayStatus(`done: ${m.finish_reason}, ${u.prompt_tokens ?? "?"} prompt + ${u.completion_tokens ?? "?"} completion tokens`);
    $("play-send").disabled = false;
  } else if (m.type === "error") {
    setPlayStatus(`error: ${m.message}`, true);
    $("play-send").disabled = false;
  }
}

async function sendChat(event) {
  event.preventDefault();
  const content = $("play-input").value.trim();
  const model = $("play-model").value;
  if (!content || !model) return;
  $("play-send").disabled = true;
  try {
    const ws = await socket();
    bubble("user", content);
    $("play-input").value = "";
    const message = { type: "chat", model, content, params: { max_tokens: Number($("play-max-tokens").value) || 64 } };
    if (state.conversationId) message.conversation_id = state.conversationId;
    ws.send(JSON.stringify(message));
    setPlayStatus("waiting for the first token…");
  } catch (err) {
    setPlayStatus(`${err.message} (with --auth, paste a tenant API key)`, true);
    $("play-send").disabled = false;
  }
}

function newChat() {
  state.conversationId = null;
  state.bubbles.clear();
  $("play-transcript").replaceChildren();
  setPlayStatus("");
}
