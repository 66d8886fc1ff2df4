//! Result output for one run.

use std::io;
use std::sync::{Arc, Mutex};

use sb_protocol::content::{Message, MessageChunk};
use sb_protocol::wire::{LogLevel, RunnerToHost};
use serde_json::{Map, Value, json};

use crate::output::Output;

/// Why an [`Emitter`] call did not write anything.
#[derive(Debug, thiserror::Error)]
pub enum EmitError {
    /// The run already has a terminal result (`run.completed` / `run.failed`) or `done` was
    /// sent; the host would drop anything more, so nothing is written.
    #[error("run already finished")]
    Finished,
    /// Writing to stdout failed (the host is gone).
    #[error("writing to the host failed: {0}")]
    Io(#[from] io::Error),
}

#[derive(Debug, Default)]
struct EmitState {
    /// Sequence of the next result (the first result is 1).
    next_sequence: u64,
    terminal: bool,
    done: bool,
}

/// Writes the results of one run. Obtained from [`crate::Runner::run`]'s arguments; can be
/// shared across the run's helper threads (`&Emitter` is `Sync`).
///
/// Every result gets the next `sequence` (1, 2, 3, …) and the run's `run_id`. After a terminal
/// result only [`Emitter::done`] and [`Emitter::log`] still write; other calls return
/// [`EmitError::Finished`].
pub struct Emitter {
    run_id: String,
    out: Arc<Output>,
    state: Mutex<EmitState>,
}

impl Emitter {
    pub(crate) fn new(run_id: String, out: Arc<Output>) -> Self {
        Self {
            run_id,
            out,
            state: Mutex::new(EmitState {
                next_sequence: 1,
                ..EmitState::default()
            }),
        }
    }

    /// The run id as written on the wire.
    #[must_use]
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// `message.delta` with an assistant text chunk.
    pub fn delta(&self, text: impl Into<String>) -> Result<(), EmitError> {
        self.delta_chunk(MessageChunk::assistant(text.into()))
    }

    /// `message.delta` with a full chunk (tool calls, `is_final`, …).
    pub fn delta_chunk(&self, chunk: MessageChunk) -> Result<(), EmitError> {
        self.result("message.delta", json!({ "chunk": chunk }))
    }

    /// `message.completed` with an assistant text message.
    pub fn completed_text(&self, text: impl Into<String>) -> Result<(), EmitError> {
        self.completed(Message::assistant(text.into()))
    }

    /// `message.completed`.
    pub fn completed(&self, message: Message) -> Result<(), EmitError> {
        self.result("message.completed", json!({ "message": message }))
    }

    /// `run.completed {finish_reason: "stop"}`.
    pub fn run_completed(&self) -> Result<(), EmitError> {
        self.run_completed_with("stop", None)
    }

    /// `run.completed` with a finish reason and, optionally, the final message.
    pub fn run_completed_with(
        &self,
        finish_reason: &str,
        message: Option<Message>,
    ) -> Result<(), EmitError> {
        let mut data = Map::new();
        data.insert("finish_reason".into(), Value::from(finish_reason));
        if let Some(message) = message {
            data.insert(
                "message".into(),
                serde_json::to_value(message).unwrap_or(Value::Null),
            );
        }
        self.result("run.completed", Value::Object(data))
    }

    /// `run.failed {code, error, retryable: false}`. Codes are dotted and owned by the runner
    /// (`runner.error` is the generic one; `cancelled` for an honoured cancel).
    pub fn run_failed(&self, code: &str, message: impl Into<String>) -> Result<(), EmitError> {
        self.run_failed_with(code, message, false)
    }

    /// `run.failed` with an explicit `retryable` flag.
    pub fn run_failed_with(
        &self,
        code: &str,
        message: impl Into<String>,
        retryable: bool,
    ) -> Result<(), EmitError> {
        self.result(
            "run.failed",
            json!({ "code": code, "error": message.into(), "retryable": retryable }),
        )
    }

    /// Any result type with its `data` payload (e.g. `state.updated`, `artifact.created`,
    /// `tool.call.started`). The host validates the payload (SPEC §4.3).
    pub fn result(&self, result_type: &str, data: Value) -> Result<(), EmitError> {
        let mut envelope = Map::new();
        envelope.insert("type".into(), Value::from(result_type));
        envelope.insert("data".into(), data);
        self.raw(Value::Object(envelope))
    }

    /// A whole `AgentRunResult` envelope as JSON. `run_id` and `sequence` are filled in (any
    /// given values are replaced: the SDK owns the numbering).
    pub fn raw(&self, mut envelope: Value) -> Result<(), EmitError> {
        let terminal = matches!(
            envelope.get("type").and_then(Value::as_str),
            Some("run.completed" | "run.failed")
        );
        let mut state = self.lock();
        if state.terminal || state.done {
            return Err(EmitError::Finished);
        }
        if let Value::Object(map) = &mut envelope {
            map.insert("run_id".into(), Value::from(self.run_id.as_str()));
            map.insert("sequence".into(), Value::from(state.next_sequence));
        }
        let msg = RunnerToHost::Result {
            run_id: self.run_id.clone(),
            result: envelope,
        };
        // Written while holding the run's lock so sequences reach the wire in order even when
        // several threads emit for the same run.
        self.out.send(&msg)?;
        state.next_sequence += 1;
        state.terminal |= terminal;
        Ok(())
    }

    /// Sends `done`: the run's result stream ended. Idempotent. The SDK calls it when
    /// [`crate::Runner::run`] returns, so runners rarely need it.
    pub fn done(&self) -> Result<(), EmitError> {
        let mut state = self.lock();
        if state.done {
            return Ok(());
        }
        state.done = true;
        self.out.send(&RunnerToHost::Done {
            run_id: self.run_id.clone(),
        })?;
        Ok(())
    }

    /// A log line for the worker's log, tagged with this run.
    pub fn log(&self, level: LogLevel, message: impl Into<String>) -> Result<(), EmitError> {
        self.out.send(&RunnerToHost::Log {
            level,
            message: message.into(),
            run_id: Some(self.run_id.clone()),
        })?;
        Ok(())
    }

    /// True once a terminal result was written.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        self.lock().terminal
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EmitState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
