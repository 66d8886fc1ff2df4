// Small DOM helpers: build elements without innerHTML (nothing from the API is ever parsed
// as HTML), format values, show errors.

/**
 * h("button", {type: "button", onclick: f}, "Send"): an element with attributes, event
 * handlers (`on…` keys take functions) and children (strings become text nodes; null and
 * false are skipped; arrays are flattened).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs ?? {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "class") {
      el.className = value;
    } else if (value === true) {
      el.setAttribute(name, "");
    } else {
      el.setAttribute(name, String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replaces the children of `el`. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** Epoch seconds as a local date and time ("" for none). */
export function time(epochSeconds) {
  if (epochSeconds === null || epochSeconds === undefined) return "";
  return new Date(epochSeconds * 1000).toLocaleString();
}

/** Any JSON value as display text. */
export function show(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "string") return value;
  // Unset (null) fields of an object are noise in a table cell.
  return JSON.stringify(value, (_key, v) => (v === null ? undefined : v));
}

/** Pretty JSON for <pre> blocks. */
export function pretty(value) {
  return JSON.stringify(value, null, 2);
}

/** A collapsible card: <details><summary>title</summary>body</details>. */
export function card(kind, title, ...body) {
  return h("details", { class: `card card-${kind}` }, h("summary", {}, title), ...body);
}

/** The error banner: `code: message`, or hidden for null. */
export function showError(error) {
  const banner = document.getElementById("error");
  if (!error) {
    banner.hidden = true;
    banner.replaceChildren();
    return;
  }
  const code = error.code ?? "error";
  const message = error.message ?? String(error);
  replace(
    banner,
    h("strong", { class: "error-code" }, code),
    ": ",
    h("span", { class: "error-message" }, message),
    h("button", { type: "button", class: "link", "aria-label": "Dismiss error", onclick: () => showError(null) }, "×"),
  );
  banner.hidden = false;
}

/** A labelled form control; `control` gets the id the label points at. */
let nextId = 0;
export function field(labelText, control, hint) {
  const id = control.id || `f${++nextId}`;
  control.id = id;
  const hintEl = hint ? h("small", { id: `${id}-hint`, class: "hint" }, hint) : null;
  if (hintEl) control.setAttribute("aria-describedby", hintEl.id);
  return h("div", { class: "field" }, h("label", { for: id }, labelText), control, hintEl);
}

/** Resolves after `ms`, or rejects when `signal` aborts. */
export function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(new DOMException("aborted", "AbortError"));
    }, { once: true });
  });
}
