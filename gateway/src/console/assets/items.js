// How result items (AgentRunResult: {run_id, type, data, sequence}) are shown: a chat reply
// that grows as deltas arrive, with tool calls, knowledge citations and other non-text
// results as collapsible cards; and the plain item list of a run's page.

import { card, h, pretty, replace } from "./dom.js";

/** The text of a message or chunk `{role, content}`: a string, or the text blocks of a list. */
export function textOf(message) {
  const content = message?.content;
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content.map((block) => (block?.type === "text" ? block.text ?? "" : "")).join("");
  }
  return "";
}

/** The non-text content blocks of a message (tool calls and results, images, reasoning). */
function blocksOf(message) {
  const content = message?.content;
  return Array.isArray(content) ? content.filter((block) => block && block.type !== "text") : [];
}

/**
 * Knowledge citations carried by a result, wherever a runner put them: `data.citations`,
 * `data.message.citations` or `data.message.metadata.citations` (a list of objects such as
 * `{kb_id, document_id, title, text, score}`).
 */
function citationsOf(data) {
  for (const list of [data?.citations, data?.message?.citations, data?.message?.metadata?.citations]) {
    if (Array.isArray(list) && list.length > 0) return list;
  }
  return null;
}

/** A tool that reads a knowledge base (its card is labelled as knowledge). */
function isKnowledgeTool(name) {
  return /knowledge|retriev/i.test(name ?? "");
}

function citationCard(citations) {
  return card(
    "citations",
    `Sources (${citations.length})`,
    h("ol", {}, citations.map((c) => h("li", {},
      h("strong", {}, c.title ?? c.document_id ?? c.kb_id ?? "source"),
      c.score !== undefined ? ` (score ${c.score})` : "",
      c.text ? h("blockquote", {}, c.text) : null,
    ))),
  );
}

/**
 * One assistant reply in the chat. `add(item)` takes the run's items in sequence order:
 * `message.delta` appends to the current message, `message.completed` settles it (its text
 * is authoritative), the next delta starts a new message; tool calls become a card each,
 * filled in when they complete; the terminal item sets `status` (and shows a failure with
 * its code and message).
 */
export class Reply {
  constructor() {
    this.root = h("article", { class: "msg assistant", "aria-label": "Assistant reply" });
    this.body = h("div", { class: "msg-body" });
    this.statusEl = h("p", { class: "msg-status" });
    this.root.append(this.body, this.statusEl);
    this.current = null;
    this.tools = new Map();
    this.status = "running";
    this.hasText = false;
  }

  /** The element the next text goes to: the open message, or a new one. */
  text() {
    if (!this.current) {
      this.current = h("div", { class: "msg-text" });
      this.body.append(this.current);
    }
    return this.current;
  }

  setStatus(text, kind = "") {
    this.statusEl.className = `msg-status ${kind}`;
    replace(this.statusEl, text);
  }

  add(item) {
    const data = item.data ?? {};
    switch (item.type) {
      case "message.delta": {
        const chunk = data.chunk ?? {};
        const piece = textOf(chunk);
        if (piece) {
          this.text().append(piece);
          this.hasText = true;
        }
        this.blocks(chunk);
        break;
      }
      case "message.completed": {
        const text = textOf(data.message);
        if (text) {
          replace(this.text(), text);
          this.hasText = true;
        }
        this.blocks(data.message);
        this.current = null;
        break;
      }
      case "tool.call.started":
      case "tool.call.completed":
        this.tool(item.type, data);
        break;
      case "run.completed": {
        const text = textOf(data.message);
        if (text) {
          replace(this.text(), text);
          this.hasText = true;
        }
        this.status = "completed";
        this.setStatus("completed", "ok");
        break;
      }
      case "run.failed": {
        this.status = data.code === "cancelled" ? "cancelled" : "failed";
        this.setStatus(
          h("span", {}, `${this.status}: `, h("code", {}, data.code ?? "error"), ` ${data.error ?? data.message ?? ""}`),
          "bad",
        );
        break;
      }
      default:
        this.body.append(card("item", item.type, h("pre", {}, pretty(data))));
    }
    const citations = citationsOf(data);
    if (citations) this.body.append(citationCard(citations));
  }

  blocks(message) {
    for (const block of blocksOf(message)) {
      if (block.type === "tool_call") {
        this.tool("tool.call.started", { tool_call_id: block.id, tool_name: block.name, parameters: block.arguments });
      } else if (block.type === "tool_result") {
        this.tool("tool.call.completed", { tool_call_id: block.tool_call_id, result: block.content ?? block.output, error: block.is_error ? "error" : undefined });
      } else {
        this.body.append(card(block.type, block.type, h("pre", {}, pretty(block))));
      }
    }
  }

  /** The card of a tool call, made at its start and completed in place. */
  tool(type, data) {
    const id = data.tool_call_id ?? `call-${this.tools.size}`;
    let entry = this.tools.get(id);
    if (!entry) {
      const name = data.tool_name ?? "tool";
      const kind = isKnowledgeTool(name) ? "knowledge" : "tool";
      const summary = h("summary", {}, `${kind === "knowledge" ? "Knowledge" : "Tool"}: ${name}`);
      const state = h("span", { class: "tool-state" }, " running…");
      summary.append(state);
      const details = h("details", { class: `card card-${kind}` }, summary);
      entry = { details, state };
      this.tools.set(id, entry);
      this.body.append(details);
      this.current = null;
    }
    if (type === "tool.call.started") {
      entry.details.append(h("h4", {}, "Arguments"), h("pre", {}, pretty(data.parameters ?? {})));
    } else {
      const failed = data.error !== undefined && data.error !== null;
      replace(entry.state, failed ? " failed" : " done");
      entry.details.append(
        h("h4", {}, failed ? "Error" : "Result"),
        h("pre", {}, failed ? String(data.error) : pretty(data.result ?? null)),
      );
    }
  }
}

/** A one-line summary of an item for the run page. */
export function summary(item) {
  const data = item.data ?? {};
  switch (item.type) {
    case "message.delta":
      return textOf(data.chunk);
    case "message.completed":
      return textOf(data.message);
    case "tool.call.started":
    case "tool.call.completed":
      return data.tool_name ?? "";
    case "run.completed":
      return data.finish_reason ?? textOf(data.message);
    case "run.failed":
      return `${data.code ?? "error"}: ${data.error ?? data.message ?? ""}`;
    case "state.updated":
      return data.key ?? "";
    case "artifact.created":
      return data.name ?? data.artifact_type ?? "";
    default:
      return "";
  }
}

/** A row of the run page's item list: sequence, type, summary, the whole item on demand. */
export function itemRow(item) {
  return h("li", { class: `item item-${item.type.replaceAll(".", "-")}`, "data-sequence": item.sequence },
    h("details", {},
      h("summary", {},
        h("span", { class: "seq" }, `#${item.sequence}`), " ",
        h("code", { class: "type" }, item.type), " ",
        h("span", { class: "text" }, summary(item)),
      ),
      h("pre", {}, pretty(item)),
    ),
  );
}
