// Server-sent events read with fetch (EventSource cannot send the Authorization header, and
// the API key never goes into a URL), and a run's result stream that resumes after a dropped
// connection without gap or duplicate.

import { ApiError, authHeaders, errorOf } from "./api.js";
import { sleep } from "./dom.js";

/**
 * The WHATWG event-stream parser (https://html.spec.whatwg.org/multipage/server-sent-events.html):
 * `feed(text)` returns the frames `{id, event, data}` completed by `text`. Lines end with CR,
 * LF or CRLF; `data` lines accumulate; comments (`:`) and unknown fields are ignored; `id`
 * persists across frames (the last event id), as in EventSource.
 */
export class SseParser {
  constructor() {
    this.buffer = "";
    this.data = [];
    this.event = "";
    this.lastEventId = "";
  }

  feed(text) {
    this.buffer += text;
    const frames = [];
    let start = 0;
    for (let i = 0; i < this.buffer.length; i++) {
      const c = this.buffer[i];
      if (c !== "\n" && c !== "\r") continue;
      // A CR at the very end may be the first half of a CRLF split across chunks.
      if (c === "\r" && i + 1 === this.buffer.length) break;
      const line = this.buffer.slice(start, i);
      if (c === "\r" && this.buffer[i + 1] === "\n") i++;
      start = i + 1;
      this.line(line, frames);
    }
    this.buffer = this.buffer.slice(start);
    return frames;
  }

  line(line, frames) {
    if (line === "") {
      if (this.data.length > 0) {
        frames.push({ id: this.lastEventId, event: this.event || "message", data: this.data.join("\n") });
      }
      this.data = [];
      this.event = "";
      return;
    }
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "data") this.data.push(value);
    else if (name === "event") this.event = value;
    else if (name === "id" && !value.includes("\0")) this.lastEventId = value;
  }
}

/** Result types after which a run's stream ends. */
export const TERMINAL = new Set(["run.completed", "run.failed"]);

/** Delay before reconnect attempt `n` (1, 2, …): 250 ms doubling, at most 5 s. */
function backoff(n) {
  return Math.min(250 * 2 ** (n - 1), 5000);
}

/**
 * Follows `GET /v1/runs/{runId}/stream` from `after` (a sequence; 0 = from the start).
 * `onItem(item)` is called once per result, in sequence order: after a dropped connection the
 * stream is opened again with `after_sequence` = the last sequence delivered, and anything at
 * or below it is skipped, so nothing is shown twice and nothing is missed.
 *
 * Options: `onState(state, detail)` with "connecting" | "live" | "reconnecting" | "ended" |
 * "stopped" | "failed"; `onNotFound()` → a promise of true to try again (a turn whose run is
 * not created yet), false to give up.
 *
 * Returns `{stop(), done, last}`: `done` resolves to the final state, `last()` is the last
 * sequence delivered.
 */
export function followRun(runId, { after = 0, onItem, onState = () => {}, onNotFound } = {}) {
  const controller = new AbortController();
  const { signal } = controller;
  let last = after;
  const url = () => `/v1/runs/${encodeURIComponent(runId)}/stream?after_sequence=${last}`;

  async function once() {
    const response = await fetch(url(), {
      headers: { Accept: "text/event-stream", ...authHeaders() },
      cache: "no-store",
      signal,
    });
    if (!response.ok) throw errorOf(response.status, await response.text());
    onState("live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SseParser();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return false;
        for (const frame of parser.feed(value)) {
          if (frame.event === "error") {
            const body = JSON.parse(frame.data);
            throw new ApiError(200, body.code ?? "stream_error", body.message ?? "the stream failed");
          }
          const item = JSON.parse(frame.data);
          const sequence = Number(item.sequence ?? frame.id);
          if (sequence <= last) continue;
          last = sequence;
          onItem(item);
          if (TERMINAL.has(item.type)) return true;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  const done = (async () => {
    let attempt = 0;
    onState("connecting");
    while (!signal.aborted) {
      try {
        if (await once()) {
          onState("ended");
          return "ended";
        }
        // The server closed the stream before the terminal item (shutdown, a proxy): resume.
        attempt = 0;
      } catch (error) {
        if (signal.aborted) break;
        const notFound = error instanceof ApiError && error.status === 404;
        if (notFound && onNotFound && (await onNotFound().catch(() => false))) {
          // Try again below.
        } else if (error instanceof ApiError && !error.retryable) {
          onState("failed", error);
          return "failed";
        }
      }
      attempt++;
      onState("reconnecting");
      try {
        await sleep(backoff(attempt), signal);
      } catch {
        break;
      }
    }
    onState("stopped");
    return "stopped";
  })();

  return { stop: () => controller.abort(), done, last: () => last };
}
