// The console's entry point: sign-in, navigation (hash routes, so every page has a URL and
// the back button works) and the page of the current route.
//
// Routes: #/chat, #/runs[?filters], #/runs/{id}, #/agents, #/runners, #/models, #/tools,
// #/knowledge-bases, #/schedules. Without a key in this tab's session, the sign-in form.

import { api, apiKey, onUnauthorized, setApiKey, signOut } from "./api.js";
import { field, h, replace, showError } from "./dom.js";
import { chatPage } from "./chat.js";
import { runPage, runsPage } from "./runs.js";
import { RESOURCE_PAGES, resourcePage } from "./resources.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
let cleanup = null;
let rendering = 0;

function signInPage() {
  nav.hidden = true;
  const key = h("input", { name: "api_key", type: "password", required: true, autocomplete: "off", spellcheck: "false" });
  const button = h("button", { type: "submit" }, "Sign in");
  const form = h("form", { class: "sign-in", "aria-label": "Sign in" },
    field("API key", key, "Kept in this browser tab only (session storage); sent as a bearer token to /v1."),
    h("div", { class: "actions" }, button));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(null);
    button.disabled = true;
    setApiKey(key.value.trim());
    try {
      // Any key may list agents: this checks the key without needing admin rights.
      await api.get("/v1/agents");
      if (!location.hash || location.hash === "#/") location.hash = "#/chat";
      else render();
    } catch (error) {
      signOut();
      showError(error);
      button.disabled = false;
      key.focus();
    }
  });
  replace(main, h("h2", {}, "Sign in"), form);
  key.focus();
}

function route() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, query = ""] = hash.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { page: parts[0] ?? "chat", id: parts[1], params: new URLSearchParams(query) };
}

async function render() {
  cleanup?.();
  cleanup = null;
  if (!apiKey()) {
    signInPage();
    return;
  }
  nav.hidden = false;
  const { page, id, params } = route();
  for (const link of nav.querySelectorAll("a[data-page]")) {
    if (link.dataset.page === page) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const ticket = ++rendering;
  // The route this render shows, recorded once it is done (`main[data-route]`): a page
  // changed by a link or a button shows the old route's content until its render ends,
  // so "not busy" alone cannot tell the old page from the new one.
  const shown = location.hash;
  main.setAttribute("aria-busy", "true");
  main.dataset.page = page;
  try {
    let done;
    if (page === "chat") done = await chatPage(main);
    else if (page === "runs" && id) done = await runPage(main, id);
    else if (page === "runs") await runsPage(main, params);
    else if (RESOURCE_PAGES.includes(page)) await resourcePage(main, page, render);
    else replace(main, h("h2", {}, "Not found"), h("p", {}, "No such page. ", h("a", { href: "#/chat" }, "Go to the chat.")));
    if (ticket === rendering) cleanup = done ?? null;
    else done?.();
  } catch (error) {
    showError(error);
    if (ticket === rendering) replace(main, h("h2", {}, "Could not load this page"), h("p", {}, `${error.code ?? "error"}: ${error.message}`));
  } finally {
    if (ticket === rendering) {
      main.dataset.route = shown;
      main.removeAttribute("aria-busy");
    }
  }
}

document.getElementById("sign-out").addEventListener("click", () => {
  signOut();
  showError(null);
  render();
});
onUnauthorized((error) => {
  signOut();
  render();
  showError(error);
});
window.addEventListener("hashchange", () => {
  showError(null);
  render();
});
render();
