//! Write Switchboard agent runners in Rust.
//!
//! A runner is a process that the Switchboard worker starts and talks to over stdin/stdout,
//! one JSON object per line (SPEC §4.2). This crate implements that wire so a runner only
//! implements [`Runner::run`]:
//!
//! ```no_run
//! use sb_runner::{Emitter, Run, RunError, Runner};
//!
//! struct Shout;
//!
//! impl Runner for Shout {
//!     fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError> {
//!         let text = run.input_text().to_uppercase();
//!         out.delta(text.clone())?;
//!         out.completed_text(text)?;
//!         out.run_completed()?;
//!         Ok(())
//!     }
//! }
//!
//! fn main() -> std::io::Result<()> {
//!     sb_runner::serve(Shout)
//! }
//! ```
//!
//! # Model
//! - [`serve`] reads host messages on one thread and starts **each run on its own thread** (a
//!   thread whose run ended waits a few seconds for the next run instead of exiting), so
//!   one process serves many runs at once (`mode = "shared"` in the manifest) as well as one run
//!   per process (`mode = "per_run"`). A runner is `Sync` and shared by all run threads.
//! - Output goes through an [`Emitter`] bound to the run: results are numbered (`sequence`
//!   1, 2, 3, …) and queued as whole lines for one writer thread, so lines of concurrent runs
//!   never interleave; it writes every line queued since its last write in one `write` and
//!   flushes it (a run's burst of items reaches the host together, in one syscall).
//! - The host can cancel a run; the runner sees it through [`Run::is_cancelled`] /
//!   [`Run::cancelled_within`] and should stop soon. If it returns without a terminal result
//!   after a cancel, the SDK ends the run with `run.failed {code: "cancelled"}`.
//! - [`HostApi`] (from [`Run::api`]) calls the host's API for this run. Calls block the calling
//!   thread until the matching answer arrives; answers are routed by call id from the reader
//!   thread, so any number of run threads can have calls in flight. Calls are bounded by the
//!   run's deadline (`context.runtime.deadline_at`).
//! - When [`Runner::run`] returns, the SDK finishes the run: an `Err` becomes `run.failed`
//!   (unless a terminal result was already emitted), a panic becomes
//!   `run.failed {code: "runner.error"}`, and `done` is always sent. A run that produced
//!   messages but no terminal result is completed by the host (`finish_reason: "stop"`); a run
//!   that produced nothing at all is failed by the host (`runner.empty_output`).
//! - `{"op":"shutdown"}` or end of stdin: no new runs are accepted; in-flight runs finish
//!   (after [`ServeOptions::eof_grace`] at end of stdin they are cancelled), then [`serve`]
//!   returns.
//!
//! The crate uses only `std` threads: no async runtime is required to write a runner.
//!
//! # Layout
//! - [`serve`](crate::serve()) / [`serve_io`]: the main loop and run dispatch (`serve.rs`).
//! - [`Run`]: one run's context (`run.rs`); [`CancelToken`]: its cancellation (`cancel.rs`).
//! - [`Emitter`]: result output (`emit.rs`), written by the process's writer thread
//!   (`output.rs`); the threads runs execute on (`threads.rs`).
//! - [`HostApi`]: blocking Host API client with typed helpers (`api.rs`).

mod api;
mod cancel;
mod emit;
mod output;
mod run;
mod serve;
mod threads;

pub use api::{
    EventPageParams, HistoryPageParams, HistorySearchParams, HostApi, StorageOwner, actions,
};
pub use cancel::CancelToken;
pub use emit::{EmitError, Emitter};
pub use run::Run;
pub use serve::{RunError, Runner, ServeOptions, serve, serve_io, serve_with};

/// The protocol types (context, results, content, errors), re-exported so a runner needs only
/// this crate.
pub use sb_protocol;
pub use sb_protocol::content::{Message, MessageChunk};
pub use sb_protocol::context::AgentRunContext;
pub use sb_protocol::error::{AgentApiError, ErrorCode};
pub use sb_protocol::wire::LogLevel;
