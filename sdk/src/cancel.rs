//! A run's cancellation flag ([`CancelToken`]), shared by the run's threads, its Host API
//! calls and the serve loop that sets it when the host cancels the run. It has a module of
//! its own because all three use it and none of them owns it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

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
