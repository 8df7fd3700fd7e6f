// Small DOM helpers shared by both pages, and the calls to the JSON API.

/** h("div", {class: "x", "data-a": 1}, child, "text") -> element. `on*` attributes become listeners. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  el.append(...children.filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

let hideTimer = 0;

/** Show an error to the user in the page's #error banner (until dismissed, or for 15 s). */
export function showError(message) {
  const box = document.getElementById("error");
  box.querySelector(".message").textContent = message;
  box.hidden = false;
  clearTimeout(hideTimer);
  hideTimer = setTimeout(() => { box.hidden = true; }, 15000);
}

export function wireErrorBox() {
  const box = document.getElementById("error");
  box.querySelector("button").addEventListener("click", () => { box.hidden = true; });
}

/**
 * Call the API. Replies are {"ok": true, ...} or {"ok": false, "error": ...}: the error (or the
 * HTTP status when the body is not that JSON, e.g. a proxy's page) is thrown as an Error.
 * The token travels in the cookie set by the login URL: same-origin fetches send it.
 */
export async function api(method, path, body) {
  const init = { method, headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let reply;
  try {
    const resp = await fetch(path, init);
    reply = await resp.json().catch(() => ({ ok: false, error: `${method} ${path}: HTTP ${resp.status}` }));
  } catch (err) {
    throw new Error(`${method} ${path}: ${err.message} (is the engine running?)`);
  }
  if (!reply.ok) throw new Error(reply.error || `${method} ${path} failed`);
  return reply;
}

/** Run an API call and show its error, if any; true on success. */
export async function tryApi(method, path, body) {
  try {
    await api(method, path, body);
    return true;
  } catch (err) {
    showError(err.message);
    return false;
  }
}
