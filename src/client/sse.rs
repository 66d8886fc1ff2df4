//! Reconnecting to the gateway's event streams: the delay policy ([`Backoff`]).
//!
//! The events themselves are read by the one event-stream reader of the workspace,
//! [`sb_common::sse`] (re-exported here), which parses by the WHATWG rules (CRLF, LF or CR
//! line ends, comments, multi-line data, `id` and `retry`) with a size cap.
//!
//! Reconnecting is the caller's business (it knows which URL resumes the stream: for the
//! gateway, `POST /v1/events?stream=true` first, `GET /v1/runs/{id}/stream` afterwards);
//! it sends [`SseParser::last_event_id`] in [`LAST_EVENT_ID`] and waits [`Backoff::next_delay`]
//! between attempts.

use std::time::Duration;

use sb_common::retry::{Retry, RetryPolicy};
pub use sb_common::sse::{LAST_EVENT_ID, SseError, SseEvent, SseParser, SseStream};

/// Exponential reconnection delays from the workspace's one retry policy
/// ([`sb_common::retry`]): `initial`, doubling up to `max`; a server `retry:` value replaces
/// the computed delay (still capped by `max`), as the event-stream standard asks.
#[derive(Debug)]
pub struct Backoff {
    retry: Retry,
    max: Duration,
}

impl Backoff {
    /// A policy starting at `initial`, never waiting longer than `max`.
    #[must_use]
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            retry: RetryPolicy::new(initial, max).start(),
            max,
        }
    }

    /// The delay before the next attempt (and counts the attempt).
    pub fn next_delay(&mut self, server_retry: Option<Duration>) -> Duration {
        let computed = self.retry.next_delay();
        server_retry.map_or(computed, |r| r.min(self.max))
    }

    /// Attempts since the last [`reset`](Self::reset).
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.retry.attempts()
    }

    /// Progress was made: the next failure starts from `initial` again.
    pub fn reset(&mut self) {
        self.retry.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<_> = (0..5).map(|_| b.next_delay(None).as_millis()).collect();
        assert_eq!(delays, vec![100, 200, 400, 500, 500]);
        assert_eq!(b.attempts(), 5);
        assert_eq!(
            b.next_delay(Some(Duration::from_secs(9))),
            Duration::from_millis(500),
            "server retry is capped"
        );
        b.reset();
        assert_eq!(
            b.next_delay(Some(Duration::from_millis(30))).as_millis(),
            30
        );
        assert_eq!(b.attempts(), 1);
    }
}
