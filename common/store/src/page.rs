//! Pagination: [`Page`], opaque cursors and limit clamping, shared by every paged read.
//!
//! Cursors are opaque to clients (PROTOCOL_V1 §7.4): a cursor is the URL-safe base64 of a
//! tagged position such as `ev1:42`. The tag names the sequence the position belongs to, so
//! a transcript cursor handed to the event log is rejected as `invalid_argument` instead of
//! silently pointing somewhere else, and the encoding can change without breaking anyone
//! who treats cursors as opaque.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Result, StoreError};

/// Largest page any paged read returns.
pub const MAX_PAGE_LIMIT: u64 = 100;
/// Page size of event and history reads when the caller gives none.
pub const DEFAULT_PAGE_LIMIT: u64 = 50;

/// One page of a paged read.
///
/// - `next_cursor` continues in the direction of the read (older items for a backward read,
///   newer for a forward one). It is set only when `has_more`.
/// - `prev_cursor` is the position of the first item of this page, for reading the other way
///   from here; `None` when the page is empty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    /// The items, in the order of the read.
    pub items: Vec<T>,
    /// Where the next page starts, if there is one.
    pub next_cursor: Option<String>,
    /// Position of the first item (for paging the opposite way).
    pub prev_cursor: Option<String>,
    /// Whether more items exist past this page.
    pub has_more: bool,
}

impl<T> Page<T> {
    /// An empty page.
    #[must_use]
    pub fn empty() -> Self {
        Self {
            items: Vec::new(),
            next_cursor: None,
            prev_cursor: None,
            has_more: false,
        }
    }

    /// Builds a page from `limit + 1` fetched rows: the extra row only proves there is more.
    pub(crate) fn from_overfetch(
        mut rows: Vec<T>,
        limit: u64,
        cursor_of: impl Fn(&T) -> String,
    ) -> Self {
        let has_more = rows.len() as u64 > limit;
        rows.truncate(limit as usize);
        let next_cursor = if has_more {
            rows.last().map(&cursor_of)
        } else {
            None
        };
        let prev_cursor = rows.first().map(&cursor_of);
        Self {
            items: rows,
            next_cursor,
            prev_cursor,
            has_more,
        }
    }
}

/// Clamps a requested page size to `[1, max]`, using `default` when none was given.
///
/// Out-of-range limits are clamped rather than rejected (SPEC §8 rule 6): a runner asking
/// for 0 or 10 000 items gets 1 or 100.
#[must_use]
pub fn clamp_limit(limit: Option<i64>, default: u64, max: u64) -> u64 {
    match limit {
        None => default.clamp(1, max),
        Some(n) if n < 1 => 1,
        Some(n) => (n as u64).min(max),
    }
}

/// Which sequence a cursor position belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CursorKind {
    /// `event_log.seq`
    Event,
    /// `transcript.seq`
    Transcript,
    /// an `agent_state` key
    StateKey,
    /// `(runs.created_at, runs.id)`
    Run,
    /// `schedules.id` (UUID v7, creation order)
    Schedule,
    /// `turn_sessions.id` (UUID v7, creation order)
    Session,
}

impl CursorKind {
    fn tag(self) -> &'static str {
        match self {
            Self::Event => "ev1",
            Self::Transcript => "tr1",
            Self::StateKey => "st1",
            Self::Run => "ru1",
            Self::Schedule => "sc1",
            Self::Session => "se1",
        }
    }
}

fn encode(kind: CursorKind, position: &str) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}:{position}", kind.tag()))
}

fn decode(kind: CursorKind, cursor: &str) -> Result<String> {
    let bad = || StoreError::invalid("invalid cursor");
    let bytes = URL_SAFE_NO_PAD.decode(cursor.trim()).map_err(|_| bad())?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    let (tag, position) = text.split_once(':').ok_or_else(bad)?;
    if tag != kind.tag() {
        return Err(bad());
    }
    Ok(position.to_owned())
}

/// Cursor for an integer sequence position (`seq`).
pub(crate) fn encode_seq(kind: CursorKind, seq: i64) -> String {
    encode(kind, &seq.to_string())
}

/// Decodes a cursor made by [`encode_seq`] for the same kind.
pub(crate) fn decode_seq(kind: CursorKind, cursor: &str) -> Result<i64> {
    let position = decode(kind, cursor)?;
    match position.parse::<i64>() {
        Ok(seq) if seq >= 0 => Ok(seq),
        _ => Err(StoreError::invalid("invalid cursor")),
    }
}

/// Cursor for a text key position.
pub(crate) fn encode_key(kind: CursorKind, key: &str) -> String {
    encode(kind, key)
}

/// Decodes a cursor made by [`encode_key`] for the same kind.
pub(crate) fn decode_key(kind: CursorKind, cursor: &str) -> Result<String> {
    decode(kind, cursor)
}

/// Cursor for a `(timestamp, uuid)` position, e.g. runs listed newest first.
pub(crate) fn encode_time_id(kind: CursorKind, at: DateTime<Utc>, id: Uuid) -> String {
    encode(kind, &format!("{}:{id}", at.timestamp_micros()))
}

/// Decodes a cursor made by [`encode_time_id`] for the same kind.
pub(crate) fn decode_time_id(kind: CursorKind, cursor: &str) -> Result<(DateTime<Utc>, Uuid)> {
    let bad = || StoreError::invalid("invalid cursor");
    let position = decode(kind, cursor)?;
    let (micros, id) = position.split_once(':').ok_or_else(bad)?;
    let micros: i64 = micros.parse().map_err(|_| bad())?;
    let at = DateTime::<Utc>::from_timestamp_micros(micros).ok_or_else(bad)?;
    let id = Uuid::parse_str(id).map_err(|_| bad())?;
    Ok((at, id))
}

/// How a read filters on `thread_id`.
///
/// Host API reads are *strict* (SPEC §8, host-behaviour §22.1): a run in thread `t` sees
/// only thread `t`, and a run outside any thread sees only rows without a thread.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ThreadFilter {
    /// Every thread of the conversation (operator/API reads).
    #[default]
    Any,
    /// Exactly this thread; `None` matches only rows without a thread.
    Exactly(Option<String>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_cursors_roundtrip_and_are_tagged() {
        let c = encode_seq(CursorKind::Event, 42);
        assert_eq!(decode_seq(CursorKind::Event, &c).unwrap(), 42);
        // Not a plain number, and not usable for another sequence.
        assert!(c.parse::<i64>().is_err());
        assert!(decode_seq(CursorKind::Transcript, &c).is_err());
    }

    #[test]
    fn garbage_cursors_are_invalid_argument() {
        for bad in [
            "",
            "42",
            "!!!",
            "ZXYx",
            &URL_SAFE_NO_PAD.encode("ev1:-3"),
            &URL_SAFE_NO_PAD.encode("ev1:x"),
        ] {
            let err = decode_seq(CursorKind::Event, bad).unwrap_err();
            assert!(
                matches!(err, StoreError::InvalidArgument(_)),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn key_and_time_cursors_roundtrip() {
        let k = encode_key(CursorKind::StateKey, "a:b:c");
        assert_eq!(decode_key(CursorKind::StateKey, &k).unwrap(), "a:b:c");
        let at = DateTime::<Utc>::from_timestamp_micros(1_700_000_000_123_456).unwrap();
        let id = Uuid::now_v7();
        let c = encode_time_id(CursorKind::Run, at, id);
        assert_eq!(decode_time_id(CursorKind::Run, &c).unwrap(), (at, id));
    }

    #[test]
    fn limits_are_clamped() {
        assert_eq!(clamp_limit(None, 50, 100), 50);
        assert_eq!(clamp_limit(Some(0), 50, 100), 1);
        assert_eq!(clamp_limit(Some(-7), 50, 100), 1);
        assert_eq!(clamp_limit(Some(1000), 50, 100), 100);
        assert_eq!(clamp_limit(Some(7), 50, 100), 7);
    }

    #[test]
    fn overfetch_sets_cursors() {
        let page = Page::from_overfetch(vec![5, 4, 3], 2, |n| n.to_string());
        assert_eq!(page.items, vec![5, 4]);
        assert!(page.has_more);
        assert_eq!(page.next_cursor.as_deref(), Some("4"));
        assert_eq!(page.prev_cursor.as_deref(), Some("5"));
        let last = Page::from_overfetch(vec![2], 2, |n| n.to_string());
        assert!(!last.has_more);
        assert_eq!(last.next_cursor, None);
        assert_eq!(last.prev_cursor.as_deref(), Some("2"));
        let empty = Page::<i32>::from_overfetch(vec![], 2, |n| n.to_string());
        assert_eq!(empty, Page::empty());
    }
}
