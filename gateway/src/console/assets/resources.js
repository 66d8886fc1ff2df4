// The workspace's configuration: agents, runners, models, tools, knowledge bases and
// schedules, each a table with a create form, and edit (PATCH) and delete where the API
// has them. One descriptor per resource says which fields it has and what the API allows.

import { api } from "./api.js";
import { card, field, h, pretty, replace, show, showError, time } from "./dom.js";

/**
 * Form fields: `{name, label, type, required, options, hint}` with type "text" (default),
 * "textarea", "number", "checkbox", "select" (options: a list, or a function of the page's
 * lookups) or "json" (a textarea parsed as JSON; empty = not sent).
 */
const RESOURCES = {
  agents: {
    title: "Agents",
    path: "/v1/agents",
    id: "agent_id",
    columns: ["name", "runner_id", "enabled", "scope", "event_types"],
    lookups: { runners: "/v1/runners" },
    fields: [
      { name: "name", label: "Name", required: true },
      { name: "description", label: "Description" },
      { name: "runner_id", label: "Runner", type: "select", required: true, options: (l) => l.runners.map((r) => r.runner_id) },
      { name: "enabled", label: "Enabled", type: "checkbox", default: true },
      { name: "event_types", label: "Event types", type: "json", hint: 'e.g. ["message.received"] (the default)' },
      { name: "scope", label: "Scope", type: "json", hint: 'e.g. {"conversation_id": "support"}; empty: the whole workspace' },
      { name: "runner_config", label: "Runner config", type: "json", hint: "a JSON object for the runner" },
      { name: "filters", label: "Filters", type: "json" },
      { name: "resource_policy", label: "Resource policy", type: "json" },
      { name: "budgets", label: "Budgets", type: "json" },
    ],
    edit: true,
    remove: true,
  },
  runners: {
    title: "Runners",
    path: "/v1/runners",
    id: "runner_id",
    columns: ["runner_id", "plugin_id", "pool", "version", "seen_at"],
    note: "Runners register themselves when a worker loads their plugin; they are not created here.",
  },
  models: {
    title: "Models",
    path: "/v1/models",
    id: "model_id",
    columns: ["name", "kind", "model_name", "base_url", "enabled"],
    fields: [
      { name: "name", label: "Name", required: true },
      { name: "kind", label: "Kind", type: "select", options: ["llm", "rerank"], required: true },
      { name: "base_url", label: "Base URL", required: true, hint: "an OpenAI-compatible endpoint" },
      { name: "model_name", label: "Model name", required: true },
      { name: "api_key_env", label: "API key variable", hint: "the name of an environment variable of the workers, never the key" },
      { name: "context_window", label: "Context window", type: "number" },
      { name: "extra_args", label: "Extra arguments", type: "json" },
    ],
    edit: true,
    remove: true,
  },
  tools: {
    title: "Tools",
    path: "/v1/tools",
    id: "tool_id",
    columns: ["name", "kind", "url", "description", "enabled"],
    fields: [
      { name: "name", label: "Name", required: true },
      { name: "description", label: "Description", type: "textarea", required: true },
      { name: "kind", label: "Kind", type: "select", options: ["http"], required: true },
      { name: "url", label: "URL", required: true },
      { name: "parameters", label: "Parameters (JSON schema)", type: "json" },
      { name: "timeout_ms", label: "Timeout (ms)", type: "number" },
      { name: "max_response_bytes", label: "Largest response (bytes)", type: "number" },
      { name: "headers_env", label: "Headers from variables", type: "json", hint: '{"Authorization": "TOOL_TOKEN"}' },
    ],
    edit: true,
    remove: true,
  },
  "knowledge-bases": {
    title: "Knowledge bases",
    path: "/v1/knowledge-bases",
    id: "kb_id",
    columns: ["name", "description", "created_at"],
    fields: [
      { name: "name", label: "Name", required: true },
      { name: "description", label: "Description" },
    ],
    edit: true,
    remove: true,
    document: {
      label: "Add document",
      path: (kb) => `/v1/knowledge-bases/${kb.kb_id}/documents`,
      fields: [
        { name: "title", label: "Title", required: true },
        { name: "text", label: "Text", type: "textarea", required: true },
      ],
    },
  },
  schedules: {
    title: "Schedules",
    path: "/v1/schedules",
    id: "schedule_id",
    columns: ["name", "kind", "spec", "enabled", "next_fire_at", "last_fired_at"],
    fields: [
      { name: "name", label: "Name" },
      { name: "kind", label: "Kind", type: "select", options: ["interval", "cron", "once"], required: true },
      { name: "spec", label: "When", required: true, hint: '"15m" (interval), "0 9 * * 1-5" (cron, UTC) or an RFC 3339 time (once)' },
      { name: "event", label: "Event", type: "json", required: true, hint: "a POST /v1/events body" },
      { name: "enabled", label: "Enabled", type: "checkbox", default: true },
    ],
    edit: true,
    remove: true,
    pause: true,
  },
};

/** The names of the resource pages, in navigation order. */
export const RESOURCE_PAGES = Object.keys(RESOURCES);

/** Columns whose values are epoch seconds. */
const TIMES = new Set(["created_at", "updated_at", "seen_at", "next_fire_at", "last_fired_at"]);

function control(spec, lookups, value) {
  const attrs = { name: spec.name, required: spec.required && spec.type !== "checkbox" };
  switch (spec.type) {
    case "checkbox":
      return h("input", { ...attrs, type: "checkbox", checked: value ?? spec.default ?? false });
    case "number":
      return h("input", { ...attrs, type: "number", value: value ?? "" });
    case "textarea":
      return h("textarea", { ...attrs, rows: 3 }, value ?? "");
    case "json":
      return h("textarea", { ...attrs, rows: 3, class: "json", spellcheck: "false" }, value === undefined || value === null ? "" : pretty(value));
    case "select": {
      const options = typeof spec.options === "function" ? spec.options(lookups) : spec.options;
      return h("select", attrs, options.map((o) => h("option", { value: o, selected: o === value }, o)));
    }
    default:
      return h("input", { ...attrs, type: "text", value: value ?? "", autocomplete: "off" });
  }
}

/** The request body of a form: empty optional fields are left out; JSON is parsed. */
function bodyOf(form, specs) {
  const body = {};
  for (const spec of specs) {
    const el = form.elements.namedItem(spec.name);
    if (spec.type === "checkbox") {
      body[spec.name] = el.checked;
      continue;
    }
    const raw = el.value.trim();
    if (raw === "") continue;
    if (spec.type === "number") body[spec.name] = Number(raw);
    else if (spec.type === "json") {
      try {
        body[spec.name] = JSON.parse(raw);
      } catch (error) {
        throw { code: "invalid_json", message: `${spec.label}: ${error.message}` };
      }
    } else body[spec.name] = raw;
  }
  return body;
}

/** A form of `specs`, prefilled from `values`; `onSubmit(body)` is awaited, errors shown. */
function formOf(specs, lookups, values, submitLabel, onSubmit, label) {
  const form = h("form", { class: "resource-form", "aria-label": label },
    specs.map((spec) => field(spec.label, control(spec, lookups, values?.[spec.name]), spec.hint)),
    h("div", { class: "actions" }, h("button", { type: "submit" }, submitLabel)));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(null);
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    try {
      await onSubmit(bodyOf(form, specs));
    } catch (error) {
      showError(error);
    } finally {
      button.disabled = false;
    }
  });
  return form;
}

/** Renders resource page `name` into `main`. */
export async function resourcePage(main, name, rerender) {
  const resource = RESOURCES[name];
  const lookups = {};
  for (const [key, path] of Object.entries(resource.lookups ?? {})) {
    lookups[key] = (await api.get(path).catch(() => ({ items: [] }))).items;
  }
  const list = await api.get(resource.path);
  const status = h("p", { role: "status", class: "resource-status" });

  const rows = list.items.map((item) => {
    const id = item[resource.id];
    const actions = h("td", { class: "row-actions" });
    if (resource.edit) {
      const editable = resource.fields;
      actions.append(card("edit", "Edit", formOf(editable, lookups, item, "Save", async (body) => {
        await api.patch(`${resource.path}/${id}`, changed(body, item));
        replace(status, `Saved ${item.name ?? id}.`);
        rerender();
      }, `Edit ${item.name ?? id}`)));
    }
    if (resource.pause) {
      actions.append(h("button", {
        type: "button",
        class: "secondary",
        onclick: async () => {
          try {
            await api.patch(`${resource.path}/${id}`, { enabled: !item.enabled });
            rerender();
          } catch (error) {
            showError(error);
          }
        },
      }, item.enabled ? "Pause" : "Resume"));
    }
    if (resource.document) {
      const doc = resource.document;
      actions.append(card("add", doc.label, formOf(doc.fields, lookups, {}, "Add", async (body) => {
        await api.post(doc.path(item), body);
        replace(status, `Added "${body.title}" to ${item.name}.`);
      }, `${doc.label} to ${item.name}`)));
    }
    if (resource.remove) {
      actions.append(h("button", {
        type: "button",
        class: "danger",
        "aria-label": `Delete ${item.name ?? id}`,
        onclick: async () => {
          if (!confirm(`Delete ${item.name ?? id}?`)) return;
          try {
            await api.delete(`${resource.path}/${id}`);
            rerender();
          } catch (error) {
            showError(error);
          }
        },
      }, "Delete"));
    }
    return h("tr", { "data-id": id },
      resource.columns.map((c) => h("td", {}, TIMES.has(c) ? time(item[c]) : show(item[c]))),
      resource.fields || resource.remove ? actions : null);
  });

  const create = resource.fields
    ? card("create", `New ${resource.title.toLowerCase().replace(/s$/, "")}`,
      formOf(resource.fields, lookups, {}, "Create", async (body) => {
        const created = await api.post(resource.path, body);
        replace(status, `Created ${created.name ?? created[resource.id]}.`);
        rerender();
      }, `New ${resource.title}`))
    : null;

  replace(main,
    h("h2", {}, resource.title),
    resource.note ? h("p", {}, resource.note) : null,
    create,
    status,
    list.items.length === 0
      ? h("p", { class: "empty" }, `No ${resource.title.toLowerCase()} yet.`)
      : h("div", { class: "table-wrap" }, h("table", { class: `resources resources-${name}` },
        h("caption", {}, resource.title),
        h("thead", {}, h("tr", {},
          resource.columns.map((c) => h("th", { scope: "col" }, c.replaceAll("_", " "))),
          resource.fields || resource.remove ? h("th", { scope: "col" }, "Actions") : null)),
        h("tbody", {}, rows))),
  );
  if (create && list.items.length === 0) create.open = true;
}

/** The fields of `body` that differ from `item` (a PATCH sends only what changed). */
function changed(body, item) {
  const patch = {};
  for (const [key, value] of Object.entries(body)) {
    if (JSON.stringify(value) !== JSON.stringify(item[key])) patch[key] = value;
  }
  return patch;
}
