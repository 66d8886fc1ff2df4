// Runs: the list (status, agent and conversation filters; paged with the API's cursor) and a
// run's page (its fields, and its items live: ledger first, then as they are produced,
// resumed after a reconnect from the last sequence shown).

import { api, withQuery } from "./api.js";
import { field, h, replace, show, showError, time } from "./dom.js";
import { itemRow } from "./items.js";
import { followRun } from "./sse.js";

const STATUSES = ["queued", "running", "completed", "failed", "cancelled", "timeout", "interrupted"];
const ACTIVE = new Set(["queued", "running"]);
const PAGE_SIZE = 20;

/** The list page; filters and the page position live in the URL (`#/runs?status=…`). */
export async function runsPage(main, params) {
  const agents = (await api.get("/v1/agents").catch(() => ({ items: [] }))).items;
  const filters = {
    status: params.get("status") ?? "",
    agent_id: params.get("agent_id") ?? "",
    conversation_id: params.get("conversation_id") ?? "",
    // Page size (the API clamps it to 1–100).
    limit: params.get("limit") ?? "",
  };
  // Cursors of the pages before this one, for "Newer".
  const cursors = params.get("cursors")?.split(",").filter(Boolean) ?? [];
  const cursor = params.get("cursor") ?? "";

  const status = h("select", { name: "status" }, h("option", { value: "" }, "any"),
    STATUSES.map((s) => h("option", { value: s, selected: s === filters.status }, s)));
  const agent = h("select", { name: "agent_id" }, h("option", { value: "" }, "any"),
    agents.map((a) => h("option", { value: a.agent_id, selected: a.agent_id === filters.agent_id }, a.name)));
  const conversation = h("input", { name: "conversation_id", value: filters.conversation_id, autocomplete: "off" });
  const form = h("form", { class: "filters", "aria-label": "Filter runs" },
    field("Status", status), field("Agent", agent), field("Conversation", conversation),
    h("div", { class: "actions" }, h("button", { type: "submit" }, "Filter")));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    go({ status: status.value, agent_id: agent.value, conversation_id: conversation.value.trim(), limit: filters.limit });
  });

  const page = await api.get(withQuery("/v1/runs", { ...filters, cursor, limit: filters.limit || PAGE_SIZE }));
  const rows = page.items.map((run) => h("tr", { "data-run-id": run.run_id },
    h("td", {}, h("a", { href: `#/runs/${run.run_id}` }, h("code", {}, run.run_id))),
    h("td", {}, h("span", { class: `badge status-${run.status}` }, run.status)),
    h("td", {}, agentName(agents, run.agent_id)),
    h("td", {}, run.conversation_id ?? ""),
    h("td", {}, time(run.created_at)),
  ));
  const newer = h("button", { type: "button", class: "secondary", disabled: cursors.length === 0 && !cursor }, "Newer");
  const older = h("button", { type: "button", class: "secondary", disabled: !page.has_more }, "Older");
  newer.addEventListener("click", () => {
    const previous = cursors.slice(0, -1);
    go({ ...filters, cursor: cursors.at(-1) ?? "", cursors: previous.join(",") });
  });
  older.addEventListener("click", () => {
    go({ ...filters, cursor: page.next_cursor, cursors: [...cursors, cursor].join(",") });
  });

  replace(main,
    h("h2", {}, "Runs"),
    form,
    page.items.length === 0
      ? h("p", { class: "empty" }, "No run matches.")
      : h("div", { class: "table-wrap" }, h("table", {},
        h("caption", {}, "Runs, newest first"),
        h("thead", {}, h("tr", {}, ["Run", "Status", "Agent", "Conversation", "Created"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, rows))),
    h("nav", { class: "pager", "aria-label": "Pages" }, newer, older),
  );
}

function go(params) {
  location.hash = withQuery("#/runs", params);
}

function agentName(agents, id) {
  if (!id) return "";
  return agents.find((a) => a.agent_id === id)?.name ?? id;
}

/** A run's page; returns a cleanup function (stops its stream). */
export async function runPage(main, runId) {
  let run = await api.get(`/v1/runs/${encodeURIComponent(runId)}`);
  const fields = h("dl", { class: "fields" });
  const cancel = h("button", { type: "button", class: "danger" }, "Cancel run");
  const state = h("p", { class: "stream-state", role: "status" });
  const items = h("ol", { class: "items", "aria-live": "polite", "aria-label": "Items" });

  function renderFields() {
    const entries = [
      ["Status", h("span", { class: `badge status-${run.status}` }, run.status)],
      ["Agent", run.agent_id ?? ""],
      ["Runner", run.runner_id],
      ["Conversation", run.conversation_id ? h("a", { href: withQuery("#/runs", { conversation_id: run.conversation_id }) }, run.conversation_id) : ""],
      ["Attempt", run.attempt],
      ["Worker", run.worker_id ?? ""],
      ["Created", time(run.created_at)],
      ["Started", time(run.started_at)],
      ["Ended", time(run.ended_at)],
      ["Error", run.error ? `${run.error.code ?? ""}: ${run.error.message ?? ""}` : ""],
      ["Usage", show(run.usage)],
    ];
    replace(fields, entries.flatMap(([name, value]) => [h("dt", {}, name), h("dd", {}, value)]));
    cancel.hidden = !ACTIVE.has(run.status);
  }
  renderFields();

  cancel.addEventListener("click", async () => {
    cancel.disabled = true;
    try {
      await api.post(`/v1/runs/${encodeURIComponent(runId)}/cancel`, { reason: "cancelled from the console" });
    } catch (error) {
      showError(error);
    } finally {
      cancel.disabled = false;
    }
  });

  replace(main,
    h("p", {}, h("a", { href: "#/runs" }, "← All runs")),
    h("h2", {}, "Run ", h("code", {}, run.run_id)),
    fields,
    cancel,
    h("h3", {}, "Items"),
    state,
    items,
  );

  const labels = { connecting: "Connecting…", live: "Live", reconnecting: "Reconnecting…", ended: "Ended", stopped: "", failed: "Stream failed" };
  const stream = followRun(runId, {
    onItem: (item) => items.append(itemRow(item)),
    onState: (s, detail) => {
      replace(state, labels[s] ?? s);
      state.dataset.state = s;
      if (s === "failed") showError(detail);
    },
  });
  stream.done.then(async (final) => {
    if (final !== "ended") return;
    run = await api.get(`/v1/runs/${encodeURIComponent(runId)}`).catch(() => run);
    renderFields();
  });
  return () => stream.stop();
}
