//! Per-API-key limits (SPEC §14): a request rate and a number of open result streams.
//!
//! - **Requests**: a token bucket per key (GCRA, [`governor`]'s keyed limiter), refilled at
//!   `limits.requests_per_second_per_key` and holding `limits.requests_burst_per_key`. A
//!   request over it is refused with `429 rate_limited` and `Retry-After` (the bucket knows
//!   when the next token arrives). It is checked by the API-key middleware
//!   ([`crate::auth::require_api_key`]) on every `/v1` route once the key is known, before
//!   the handler runs, so a refused request has no effect.
//! - **Streams**: at most `limits.streams_per_key` SSE responses open per key
//!   (`GET /v1/runs/{id}/stream`, `POST /v1/events?stream=true`). A handler takes a
//!   [`StreamSlot`] before doing anything else and moves it into the response body; the
//!   slot is given back when the body is dropped, that is when the stream ends or the client
//!   goes away. One more is refused with `429 rate_limited`.
//!
//! Both are counted per gateway process, in memory: with `n` gateways behind a balancer a
//! key can reach `n` times the configured numbers. They bound what one key can take from one
//! process (connections, database transactions, bus subscriptions), which is what they are
//! for; a global quota would cost a session-store round trip per request.

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use governor::clock::Clock as _;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sb_common::config::LimitsConfig;
use uuid::Uuid;

use crate::error::ApiError;

/// The configured per-key limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLimitOptions {
    /// Token bucket refill per second; `None` disables the request limit.
    pub requests_per_second: Option<NonZeroU32>,
    /// Token bucket size.
    pub requests_burst: NonZeroU32,
    /// Open result streams per key.
    pub streams_per_key: NonZeroU32,
}

impl KeyLimitOptions {
    /// The options of the `[limits]` section.
    pub fn from_config(limits: &LimitsConfig) -> Self {
        Self {
            requests_per_second: limits.requests_per_second_per_key,
            requests_burst: limits.requests_burst_per_key,
            streams_per_key: limits.streams_per_key,
        }
    }
}

impl Default for KeyLimitOptions {
    fn default() -> Self {
        Self::from_config(&LimitsConfig::default())
    }
}

/// Idle buckets are dropped every this many admitted requests (see [`KeyLimits::admit`]).
const PRUNE_EVERY: u64 = 4096;

/// The per-key limiters of one gateway process. Cheap to share (`Arc` inside).
pub struct KeyLimits {
    requests: Option<DefaultKeyedRateLimiter<Uuid>>,
    checked: AtomicU64,
    streams: Arc<StreamCounts>,
    streams_per_key: u32,
}

impl std::fmt::Debug for KeyLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyLimits")
            .field("requests_limited", &self.requests.is_some())
            .field("streams_per_key", &self.streams_per_key)
            .finish_non_exhaustive()
    }
}

/// Open streams per key; a key with none has no entry.
#[derive(Debug, Default)]
struct StreamCounts {
    open: Mutex<HashMap<Uuid, NonZeroUsize>>,
}

impl KeyLimits {
    /// Limiters with `options`.
    pub fn new(options: KeyLimitOptions) -> Self {
        Self {
            requests: options.requests_per_second.map(|rate| {
                RateLimiter::keyed(Quota::per_second(rate).allow_burst(options.requests_burst))
            }),
            checked: AtomicU64::new(0),
            streams: Arc::new(StreamCounts::default()),
            streams_per_key: options.streams_per_key.get(),
        }
    }

    /// Takes one token of `key_id`'s bucket, or refuses with `429 rate_limited` and the wait
    /// until the next token as `Retry-After`.
    pub fn admit(&self, key_id: Uuid) -> Result<(), ApiError> {
        let Some(limiter) = &self.requests else {
            return Ok(());
        };
        // A bucket that refilled completely is the same as no bucket: dropping those now and
        // then keeps the map to the keys in use (revoked keys' buckets go too).
        if self.checked.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == PRUNE_EVERY - 1 {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
        limiter.check_key(&key_id).map_err(|not_until| {
            let wait = not_until.wait_time_from(limiter.clock().now());
            ApiError::rate_limited(
                "too many requests with this api key; retry after the time in `Retry-After`",
                wait,
            )
        })
    }

    /// Takes one of `key_id`'s stream slots, or refuses with `429 rate_limited`. The slot is
    /// given back when the returned guard is dropped.
    pub fn open_stream(&self, key_id: Uuid) -> Result<StreamSlot, ApiError> {
        let mut open = self
            .streams
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let count = open.get(&key_id).map_or(0, |n| n.get());
        if count >= self.streams_per_key as usize {
            return Err(ApiError::rate_limited(
                format!(
                    "this api key already has {count} result streams open, the most allowed; \
                     close one first"
                ),
                std::time::Duration::from_secs(1),
            ));
        }
        open.insert(key_id, NonZeroUsize::MIN.saturating_add(count));
        Ok(StreamSlot {
            counts: Arc::clone(&self.streams),
            key_id,
        })
    }

    /// Result streams `key_id` has open on this gateway.
    pub fn open_streams(&self, key_id: Uuid) -> usize {
        self.streams
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key_id)
            .map_or(0, |n| n.get())
    }
}

/// One open result stream of a key; dropping it gives the slot back. Move it into the
/// response body so it lives exactly as long as the stream.
#[derive(Debug)]
pub struct StreamSlot {
    counts: Arc<StreamCounts>,
    key_id: Uuid,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self
            .counts
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get(&self.key_id).copied() {
            match NonZeroUsize::new(n.get() - 1) {
                Some(left) => {
                    open.insert(self.key_id, left);
                }
                None => {
                    open.remove(&self.key_id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn the_bucket_admits_the_burst_then_says_when_to_retry() {
        let limits = KeyLimits::new(KeyLimitOptions {
            requests_per_second: Some(nz(1)),
            requests_burst: nz(2),
            streams_per_key: nz(1),
        });
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        limits.admit(a).unwrap();
        limits.admit(a).unwrap();
        let refused = limits.admit(a).unwrap_err();
        assert_eq!(refused.code(), sb_protocol::error::ErrorCode::RateLimited);
        // another key has its own bucket
        limits.admit(b).unwrap();
    }

    #[test]
    fn no_rate_means_no_request_limit() {
        let limits = KeyLimits::new(KeyLimitOptions {
            requests_per_second: None,
            requests_burst: nz(1),
            streams_per_key: nz(1),
        });
        let key = Uuid::now_v7();
        for _ in 0..10_000 {
            limits.admit(key).unwrap();
        }
    }

    #[test]
    fn stream_slots_are_counted_per_key_and_given_back_on_drop() {
        let limits = KeyLimits::new(KeyLimitOptions {
            streams_per_key: nz(2),
            ..KeyLimitOptions::default()
        });
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let first = limits.open_stream(a).unwrap();
        let second = limits.open_stream(a).unwrap();
        assert_eq!(limits.open_streams(a), 2);
        assert!(limits.open_stream(a).is_err());
        let other = limits.open_stream(b).unwrap();
        drop(first);
        assert_eq!(limits.open_streams(a), 1);
        let third = limits.open_stream(a).unwrap();
        drop((second, third, other));
        assert_eq!(limits.open_streams(a), 0);
        assert!(limits.streams.open.lock().unwrap().is_empty());
    }
}
