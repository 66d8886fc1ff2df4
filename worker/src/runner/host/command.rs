//! What the host and the run handles send a process's actor, and what a start hands back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sb_protocol::context::AgentRunContext;
use sb_protocol::ids::RunId;
use tokio::sync::{OwnedSemaphorePermit, mpsc, oneshot};
use tokio::time::Instant;

use crate::runner::link::StartRefused;
use crate::sequencer::RunItem;

/// Where each active run lives: the command channel of its actor.
pub(super) type Routes = Arc<Mutex<HashMap<RunId, mpsc::UnboundedSender<Command>>>>;

/// A request to a process's actor.
pub(super) enum Command {
    Start {
        run_id: RunId,
        context: Box<AgentRunContext>,
        deadline: Option<Instant>,
        slot: RunSlot,
        reply: oneshot::Sender<Result<(), Refusal>>,
    },
    Cancel {
        run_id: RunId,
        reason: String,
    },
    Drain,
    Abort {
        detail: String,
    },
}

/// A refused start hands everything back so the host can retry on another process.
pub(super) struct Refusal {
    pub(super) reason: StartRefused,
    pub(super) slot: RunSlot,
    pub(super) context: Box<AgentRunContext>,
}

/// Per-run resources held by the actor until the run ends.
pub(super) struct RunSlot {
    pub(super) events: mpsc::Sender<RunItem>,
    /// Concurrency permit, released when the run ends.
    pub(super) _permit: OwnedSemaphorePermit,
}
