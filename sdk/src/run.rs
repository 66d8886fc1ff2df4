//! One run as the runner sees it: its context, its cancellation flag and its Host API handle.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sb_protocol::context::AgentRunContext;
use sb_protocol::ids::RunId;

use crate::api::HostApi;

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

/// A run's cancellation flag. Cheap to clone; all clones see the same state.
#[derive(Clone, Default)]
pub struct CancelToken {
    inner: Arc<(Mutex<Option<String>>, Condvar)>,
}

impl CancelToken {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks the run cancelled (first reason wins) and wakes every waiter.
    pub fn cancel(&self, reason: impl Into<String>) {
        let (lock, cvar) = &*self.inner;
        let mut state = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.is_none() {
            *state = Some(reason.into());
        }
        cvar.notify_all();
    }

    #[must_use]
    pub fn is_cancelled(&self) -> bool {
        self.reason().is_some()
    }

    /// The reason the host gave, once cancelled.
    #[must_use]
    pub fn reason(&self) -> Option<String> {
        self.inner
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Waits up to `timeout` for a cancel; true if cancelled.
    #[must_use]
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let (lock, cvar) = &*self.inner;
        let guard = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (guard, _) = cvar
            .wait_timeout_while(guard, timeout, |state| state.is_none())
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn cancel_wakes_waiters_and_keeps_the_first_reason() {
        let token = CancelToken::new();
        assert!(!token.wait_timeout(Duration::from_millis(10)));
        let t2 = token.clone();
        let waiter = std::thread::spawn(move || {
            let start = Instant::now();
            let cancelled = t2.wait_timeout(Duration::from_secs(10));
            (cancelled, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(20));
        token.cancel("user");
        token.cancel("deadline");
        let (cancelled, waited) = waiter.join().unwrap();
        assert!(cancelled);
        assert!(waited < Duration::from_secs(5));
        assert_eq!(token.reason().as_deref(), Some("user"));
    }
}
