// Chat: a session (the turn API: one conversation with one agent) and its turns. A message is
// `POST /v1/sessions/{id}/turns`; its reply is the turn's run (turn id = run id), followed
// live with followRun; Stop is `POST /v1/turns/{id}/cancel`.

import { api, idempotencyKey } from "./api.js";
import { field, h, replace, showError } from "./dom.js";
import { Reply } from "./items.js";
import { followRun } from "./sse.js";

/** Renders the chat page into `main`; returns a cleanup function (stops the open stream). */
export async function chatPage(main) {
  const agents = (await api.get("/v1/agents")).items.filter((a) => a.enabled);
  let session = null;
  let turn = null; // {id, stream, reply}

  const agentSelect = h("select", { name: "agent" },
    agents.map((a) => h("option", { value: a.agent_id }, `${a.name} (${a.runner_id})`)));
  const newButton = h("button", { type: "button", class: "secondary" }, "New conversation");
  const log = h("div", { class: "chat-log", role: "log", "aria-live": "polite", "aria-label": "Conversation" });
  const input = h("textarea", { name: "message", rows: 3, required: true, placeholder: "Type a message; Enter sends, Shift+Enter adds a line" });
  const send = h("button", { type: "submit" }, "Send");
  const stop = h("button", { type: "button", class: "danger", disabled: true }, "Stop");
  const status = h("p", { class: "chat-status", role: "status" });
  const form = h("form", { class: "composer" },
    field("Message", input),
    h("div", { class: "actions" }, send, stop),
  );
  const sessionInfo = h("p", { class: "session-info" });

  replace(main,
    h("h2", {}, "Chat"),
    agents.length === 0
      ? h("p", {}, "No enabled agent in this workspace: create one under ", h("a", { href: "#/agents" }, "Agents"), ".")
      : null,
    h("div", { class: "toolbar" }, field("Agent", agentSelect), newButton),
    sessionInfo,
    log,
    status,
    form,
  );

  function setBusy(busy) {
    send.disabled = busy;
    stop.disabled = !busy;
    agentSelect.disabled = busy;
    newButton.disabled = busy;
  }

  function reset() {
    turn?.stream.stop();
    turn = null;
    session = null;
    log.replaceChildren();
    replace(sessionInfo, "");
    replace(status, "");
    setBusy(false);
  }
  newButton.addEventListener("click", reset);
  agentSelect.addEventListener("change", reset);

  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || turn) return;
    showError(null);
    setBusy(true);
    try {
      if (!session) {
        session = await api.post("/v1/sessions", { agent_id: agentSelect.value });
        replace(sessionInfo, "Conversation ", h("code", {}, session.conversation_id));
      }
      log.append(h("article", { class: "msg user", "aria-label": "You" }, h("div", { class: "msg-text" }, text)));
      input.value = "";
      const receipt = await api.post(`/v1/sessions/${session.session_id}/turns`, {
        idempotency_key: idempotencyKey(),
        text,
      });
      startReply(receipt.turn_id);
    } catch (error) {
      showError(error);
      setBusy(false);
    }
  });

  function startReply(turnId) {
    const reply = new Reply();
    reply.root.dataset.runId = turnId;
    reply.setStatus(h("span", {}, "run ", h("a", { href: `#/runs/${turnId}` }, turnId), " …"));
    log.append(reply.root);
    const stream = followRun(turnId, {
      onItem: (item) => {
        reply.add(item);
        log.scrollTop = log.scrollHeight;
      },
      onState: (state, detail) => {
        replace(status, state === "live" ? "Receiving…" : state === "reconnecting" ? "Reconnecting…" : "");
        if (state === "failed") showError(detail);
      },
      // Until the orchestrator created the run, the stream is 404: wait while the turn is
      // queued. The run may be created, and even end, between that 404 and this snapshot
      // (a busy host, a fast runner): a running turn, or one whose run has items, is opened
      // again and replays from the ledger. Only a turn that ended without a run (unrouted,
      // rejected) shows its failure here.
      onNotFound: async () => {
        const snapshot = await api.get(`/v1/turns/${turnId}`);
        if (snapshot.status === "queued" || snapshot.status === "running" || snapshot.last_sequence > 0) {
          return true;
        }
        if (snapshot.failure) {
          reply.add({ type: "run.failed", data: { code: snapshot.failure.code, error: snapshot.failure.message } });
        }
        return false;
      },
    });
    turn = { id: turnId, stream, reply };
    stream.done.finally(() => {
      if (turn?.id === turnId) {
        turn = null;
        setBusy(false);
        replace(status, "");
        input.focus();
      }
    });
  }

  stop.addEventListener("click", async () => {
    if (!turn) return;
    stop.disabled = true;
    replace(status, "Stopping…");
    try {
      await api.post(`/v1/turns/${turn.id}/cancel`, {});
    } catch (error) {
      showError(error);
      stop.disabled = false;
    }
  });

  input.focus();
  return () => turn?.stream.stop();
}
