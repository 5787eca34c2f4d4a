// The admin page's models' inputs and outputs (/admin/api/signatures) and its "try a model" panel: an example
// request for the model's kind, sent to the model's own endpoint (loaded after admin.js, whose helpers it uses).
"use strict";

const SAMPLE_TEXT = "The harbour was calm at dawn.";

function tensorText(t) { return `${t.name} ${t.datatype} [${t.shape.join(", ")}]`; }

async function loadSignatures() {
  try { state.signatures = new Map((await api("GET", "/admin/api/signatures")).data.map((s) => [refOf(s), s])); }
  catch (_) { state.signatures = state.signatures || new Map(); }  // an older server: the table shows none
  updateTryModels();
}

function refOf(s) { return `${s.name}@${s.version}`; }

function signatureCell(ref) {
  const s = (state.signatures || new Map()).get(ref);
  if (!s) return el("td", { class: "muted" }, "–");
  return el("td", { class: "io" },
    el("div", {}, el("span", { class: "muted" }, "in "), s.inputs.map(tensorText).join("; ")),
    el("div", {}, el("span", { class: "muted" }, "out "), s.outputs.map(tensorText).join("; ")),
    el("button", { type: "button", class: "small ghost", "data-testid": `try-${ref}`, onclick: () => chooseTry(ref) },
      "Try"));
}

// ---- an example request per kind -------------------------------------------------------

function zeros(t) {
  const shape = t.shape.map((d) => (d === -1 ? 1 : d));  // one row where the size is free
  const size = shape.reduce((a, d) => a * d, 1);
  const value = t.datatype === "BYTES" ? "" : t.datatype === "BOOL" ? false : 0;
  return { name: t.name, datatype: t.datatype, shape, data: Array(size).fill(value) };
}

function sampleImage() {
  const canvas = el("canvas", { width: 32, height: 32 });
  const g = canvas.getContext("2d");
  g.fillStyle = "#7a8fb0"; g.fillRect(0, 0, 32, 32);
  g.fillStyle = "#f4d35e"; g.fillRect(8, 8, 16, 16);
  return canvas.toDataURL("image/png");
}

// Where a kind's requests go and a body its endpoint takes (see api/native/schemas.py and api/oip.py).
function exampleRequest(s) {
  const predict = `/api/v1/models/${encodeURIComponent(s.name)}@${encodeURIComponent(s.version)}/predict`;
  const features = Math.max(1, (s.inputs[0] || { shape: [] }).shape[1] || 1);  // a tabular input is [-1, features]
  if (s.kind === "tabular") return { path: predict, body: { inputs: [{ features: Array(features).fill(0) }] } };
  if (s.kind === "classify") return { path: predict, body: { inputs: [{ text: SAMPLE_TEXT }] } };
  if (s.kind === "image-classify") return { path: predict, body: { inputs: [{ image: sampleImage() }] } };
  if (s.kind === "embed") return { path: "/api/v1/embed", body: { model: refOf(s), inputs: [SAMPLE_TEXT] } };
  const infer = `/v2/models/${encodeURIComponent(s.name)}/versions/${encodeURIComponent(s.version)}/infer`;
  return { path: infer, body: { inputs: s.inputs.map(zeros) } };
}

// ---- the panel --------------------------------------------------------------------------

function updateTryModels() {
  const select = $("try-model");
  const refs = [...state.signatures.keys()];
  if (refs.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(...refs.map((r) => el("option", { value: r }, `${r} (${state.signatures.get(r).kind})`)));
  $("try-send").disabled = refs.length === 0;
  if (refs.includes(chosen)) select.value = chosen;
  else if (refs.length) chooseTry(refs[0], false);
  else {
    state.tryPath = null;
    $("try-path").textContent = ""; $("try-body").value = "";
    setTryStatus("No embed, classify or tensor model is loaded.");
  }
}

function chooseTry(ref, scroll = true) {
  const s = state.signatures.get(ref);
  if (!s) return;
  $("try-model").value = ref;
  const { path, body } = exampleRequest(s);
  state.tryPath = path;
  $("try-path").textContent = `POST ${path}`;
  $("try-body").value = JSON.stringify(body, null, 2);
  $("try-image").hidden = s.kind !== "image-classify";
  $("try-image").value = "";
  $("try-output").textContent = "";
  setTryStatus("");
  if (scroll) $("try").scrollIntoView();
}

function setTryStatus(text, error = false) {
  $("try-status").textContent = text;
  $("try-status").className = error ? "error" : "muted";
}

function useImageFile() {
  const file = $("try-image").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => { $("try-body").value = JSON.stringify({ inputs: [{ image: reader.result }] }, null, 2); };
  reader.onerror = () => setTryStatus(`cannot read ${file.name}`, true);
  reader.readAsDataURL(file);
}

// Inference paths take a tenant key, not the admin key: the playground's, when one is given (needed with --auth).
async function sendTry() {
  if (!state.tryPath) return;
  let body;
  try { body = JSON.parse($("try-body").value); }
  catch (err) { setTryStatus(`The body is not JSON: ${err.message}`, true); return; }
  const headers = { "Content-Type": "application/json" };
  const key = $("play-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  $("try-send").disabled = true;
  setTryStatus("sending…");
  $("try-output").textContent = "";
  try {
    const resp = await fetch(state.tryPath, { method: "POST", headers, body: JSON.stringify(body) });
    const text = await resp.text();
    let data = null;
    try { data = JSON.parse(text); } catch (_) { data = null; }
    if (resp.ok) {
      $("try-output").textContent = JSON.stringify(data, null, 2);
      setTryStatus(`HTTP ${resp.status}`);
    } else {
      const error = data && data.error;  // OpenAI-shaped ({"error": {"message"}}) or the protocol's ({"error": "..."})
      const hint = resp.status === 401 ? " (paste a tenant API key in the playground)" : "";
      setTryStatus(`HTTP ${resp.status}: ${(error && error.message) || error || text}${hint}`, true);
    }
  } catch (err) {
    setTryStatus(`Cannot reach the server: ${err.message}`, true);
  } finally {
    $("try-send").disabled = false;
  }
}
