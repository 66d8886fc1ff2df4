//! One run as the runner sees it: its context, its cancellation flag and its Host API handle.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sb_protocol::context::AgentRunContext;
use sb_protocol::ids::RunId;

use crate::api::HostApi;
use crate::cancel::CancelToken;

/// A run handed to [`crate::Runner::run`].
pub struct Run {
    pub(crate) run_id: RunId,
    pub(crate) runner: String,
    pub(crate) context: AgentRunContext,
    pub(crate) cancel: CancelToken,
    pub(crate) api: HostApi,
}

impl Run {
    /// The run id (also the key of every Host API call).
    #[must_use]
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// The runner id this run is for (`plugin:<author>/<name>/<runner>`); lets one binary serve
    /// several runners of a plugin.
    #[must_use]
    pub fn runner(&self) -> &str {
        &self.runner
    }

    /// The full `AgentRunContext`.
    #[must_use]
    pub fn context(&self) -> &AgentRunContext {
        &self.context
    }

    /// The input text (`context.input.text`), or `""`.
    #[must_use]
    pub fn input_text(&self) -> &str {
        self.context.input.text.as_deref().unwrap_or("")
    }

    /// The run's deadline (`context.runtime.deadline_at`), if any.
    #[must_use]
    pub fn deadline(&self) -> Option<SystemTime> {
        deadline_of(&self.context)
    }

    /// True once the host asked to cancel the run.
    #[must_use]
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Sleeps up to `timeout`, waking early on cancel. Returns true if the run is cancelled.
    /// Use it instead of `thread::sleep` in waits and polling loops.
    #[must_use]
    pub fn cancelled_within(&self, timeout: Duration) -> bool {
        self.cancel.wait_timeout(timeout)
    }

    /// The cancellation token (clone it into helper threads).
    #[must_use]
    pub fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// The Host API client for this run.
    #[must_use]
    pub fn api(&self) -> &HostApi {
        &self.api
    }
}

pub(crate) fn deadline_of(context: &AgentRunContext) -> Option<SystemTime> {
    let secs = context.runtime.deadline_at?;
    if !secs.is_finite() || secs <= 0.0 {
        return None;
    }
    UNIX_EPOCH.checked_add(Duration::from_secs_f64(secs))
}
