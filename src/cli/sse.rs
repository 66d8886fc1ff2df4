//! A small Server-Sent Events client: an incremental parser ([`SseParser`]), a reader over
//! one HTTP response body ([`SseStream`]), and the reconnection delay policy ([`Backoff`]).
//!
//! The parser follows the WHATWG "event stream interpretation" rules, because the gateway's
//! frames go through proxies and axum's encoder and we must not depend on one exact byte
//! layout:
//!
//! - lines end with CRLF, LF or CR (a CRLF split across two reads is still one terminator);
//! - a line starting with `:` is a comment (keep-alives) and is ignored;
//! - `field: value` strips one space after the colon; a line without a colon is a field
//!   with an empty value; unknown fields are ignored;
//! - `data` lines accumulate, joined with `\n`;
//! - a blank line dispatches the event; an event without data is not dispatched;
//! - `id` sets the *last event id*, which persists across events until another `id` line
//!   changes it (an id containing NUL is ignored); it is what a client sends back in
//!   `Last-Event-ID` when it reconnects;
//! - `retry` with only ASCII digits sets the reconnection delay;
//! - an event not terminated by a blank line when the stream ends is discarded.
//!
//! Reconnecting is the caller's business (it knows which URL resumes the stream: for the
//! gateway, `POST /v1/events?stream=true` first, `GET /v1/runs/{id}/stream` afterwards);
//! it sends [`SseParser::last_event_id`] in [`LAST_EVENT_ID`] and waits [`Backoff::next_delay`]
//! between attempts.

use std::time::Duration;

use futures::{Stream, StreamExt as _};

/// The request header carrying the id of the last event received, on reconnection.
pub const LAST_EVENT_ID: &str = "Last-Event-ID";

/// Default cap on one line or one event's data, in bytes. A gateway result is at most
/// 1 MiB of JSON (SPEC §13); the margin covers the envelope and escaping.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The last event id at dispatch time (`None` when no `id` was ever set, or it was
    /// reset with an empty `id:` line).
    pub id: Option<String>,
    /// The `event` field, `message` when absent.
    pub event: String,
    /// The `data` lines joined with `\n`.
    pub data: String,
}

/// Why reading an event stream failed.
#[derive(Debug, thiserror::Error)]
pub enum SseError {
    /// A line or an event's data exceeded the parser's limit.
    #[error("event stream line or event larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// Nothing (not even a keep-alive comment) arrived for the idle timeout.
    #[error("event stream idle for {0:?}")]
    Idle(Duration),
    /// The transport failed (connection reset, truncated chunked body, …).
    #[error("event stream interrupted: {0}")]
    Transport(String),
}

/// Incremental event-stream parser: feed it bytes as they arrive, collect events.
#[derive(Debug)]
pub struct SseParser {
    /// The current, unterminated line.
    line: Vec<u8>,
    /// The previous chunk ended in CR: a LF at the start of the next one belongs to it.
    after_cr: bool,
    /// The next line is the first of the stream (a UTF-8 BOM there is skipped).
    at_start: bool,
    data: String,
    /// Some `data` line was seen in the current event (distinguishes `data:` from none).
    has_data: bool,
    event: String,
    last_event_id: String,
    retry: Option<Duration>,
    max_bytes: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser refusing lines or event data longer than `max_bytes`.
    #[must_use]
    pub fn new(max_bytes: usize) -> Self {
        Self {
            line: Vec::new(),
            after_cr: false,
            at_start: true,
            data: String::new(),
            has_data: false,
            event: String::new(),
            last_event_id: String::new(),
            retry: None,
            max_bytes,
        }
    }

    /// Parses `bytes`, appending every event they complete to `out`.
    pub fn push(&mut self, mut bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
        }
        while let Some(pos) = bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.extend_line(&bytes[..pos])?;
            let line = std::mem::take(&mut self.line);
            self.process_line(&line, out)?;
            // Keep the allocation for the next line.
            self.line = line;
            self.line.clear();
            let terminator = bytes[pos];
            bytes = &bytes[pos + 1..];
            if terminator == b'\r' {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        self.extend_line(bytes)
    }

    /// The last event id (empty when none): send it as [`LAST_EVENT_ID`] to resume.
    #[must_use]
    pub fn last_event_id(&self) -> Option<&str> {
        Some(self.last_event_id.as_str()).filter(|id| !id.is_empty())
    }

    /// The reconnection delay the server asked for with `retry:`, if any.
    #[must_use]
    pub fn retry(&self) -> Option<Duration> {
        self.retry
    }

    /// Forgets a partly received event (the connection it came from is gone), keeping the
    /// last event id and the retry delay, as a reconnecting client must.
    pub fn reset_connection(&mut self) {
        self.line.clear();
        self.after_cr = false;
        self.at_start = true;
        self.data.clear();
        self.has_data = false;
        self.event.clear();
    }

    fn extend_line(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len() + bytes.len() > self.max_bytes {
            return Err(SseError::TooLarge {
                limit: self.max_bytes,
            });
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn process_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut line = line;
        if std::mem::take(&mut self.at_start) {
            line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        let value = String::from_utf8_lossy(value);
        match field {
            b"data" => {
                if self.data.len() + value.len() + 1 > self.max_bytes {
                    return Err(SseError::TooLarge {
                        limit: self.max_bytes,
                    });
                }
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&value);
                self.has_data = true;
            }
            b"event" => {
                self.event.clear();
                self.event.push_str(&value);
            }
            b"id" if !value.contains('\0') => {
                self.last_event_id.clear();
                self.last_event_id.push_str(&value);
            }
            b"retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                if let Ok(ms) = value.parse::<u64>() {
                    self.retry = Some(Duration::from_millis(ms));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        let event = std::mem::take(&mut self.event);
        if !std::mem::take(&mut self.has_data) {
            return;
        }
        out.push(SseEvent {
            id: self.last_event_id().map(str::to_owned),
            event: if event.is_empty() {
                "message".to_owned()
            } else {
                event
            },
            data: std::mem::take(&mut self.data),
        });
    }
}

/// The events of one HTTP response body.
///
/// Generic over the byte stream so tests can feed it without a socket; in production it
/// wraps `reqwest::Response::bytes_stream()`.
pub struct SseStream<S> {
    body: S,
    parser: SseParser,
    ready: std::collections::VecDeque<SseEvent>,
    scratch: Vec<SseEvent>,
    idle_timeout: Option<Duration>,
    ended: bool,
}

impl<S, B, E> SseStream<S>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    /// Reads `body` with `parser` (pass the parser of the previous connection to keep its
    /// last event id). With `idle_timeout`, a body silent for that long is an error.
    pub fn new(body: S, mut parser: SseParser, idle_timeout: Option<Duration>) -> Self {
        parser.reset_connection();
        Self {
            body,
            parser,
            ready: std::collections::VecDeque::new(),
            scratch: Vec::new(),
            idle_timeout,
            ended: false,
        }
    }

    /// The next event; `Ok(None)` when the server closed the stream.
    pub async fn next_event(&mut self) -> Result<Option<SseEvent>, SseError> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Ok(Some(event));
            }
            if self.ended {
                return Ok(None);
            }
            let chunk = match self.idle_timeout {
                Some(limit) => tokio::time::timeout(limit, self.body.next())
                    .await
                    .map_err(|_| SseError::Idle(limit))?,
                None => self.body.next().await,
            };
            match chunk {
                None => self.ended = true,
                Some(Err(e)) => return Err(SseError::Transport(e.to_string())),
                Some(Ok(bytes)) => {
                    self.parser.push(bytes.as_ref(), &mut self.scratch)?;
                    self.ready.extend(self.scratch.drain(..));
                }
            }
        }
    }

    /// The parser, to carry its last event id over to the next connection.
    pub fn into_parser(self) -> SseParser {
        self.parser
    }

    /// The last event id seen so far.
    #[cfg(test)]
    pub fn last_event_id(&self) -> Option<&str> {
        self.parser.last_event_id()
    }
}

/// Exponential reconnection delays: `initial`, doubling up to `max`; a server `retry:`
/// value replaces the computed delay (still capped by `max`).
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// A policy starting at `initial`, never waiting longer than `max`.
    #[must_use]
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            attempt: 0,
        }
    }

    /// The delay before the next attempt (and counts the attempt).
    pub fn next_delay(&mut self, server_retry: Option<Duration>) -> Duration {
        let computed = self
            .initial
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        server_retry.map_or(computed, |r| r.min(self.max))
    }

    /// Attempts since the last [`reset`](Self::reset).
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Progress was made: the next failure starts from `initial` again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_chunks(chunks: &[&[u8]]) -> (Vec<SseEvent>, SseParser) {
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        for chunk in chunks {
            parser.push(chunk, &mut out).unwrap();
        }
        (out, parser)
    }

    fn ev(id: Option<&str>, event: &str, data: &str) -> SseEvent {
        SseEvent {
            id: id.map(str::to_owned),
            event: event.to_owned(),
            data: data.to_owned(),
        }
    }

    #[test]
    fn parses_id_event_and_multiline_data() {
        let (events, parser) = parse_chunks(&[
            b"id: 1\nevent: message.delta\ndata: {\"a\":\ndata: 1}\n\n",
            b": keep-alive\n\nid: 2\nevent: run.completed\ndata: {}\n\n",
        ]);
        assert_eq!(
            events,
            vec![
                ev(Some("1"), "message.delta", "{\"a\":\n1}"),
                ev(Some("2"), "run.completed", "{}"),
            ]
        );
        assert_eq!(parser.last_event_id(), Some("2"));
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let stream: &[u8] =
            b"\xEF\xBB\xBFretry: 250\r\nid: 7\r\nevent: x\r\ndata:a\r\ndata:  b\r\n\r\ndata: c\r\r: c\nid\ndata\n\n";
        let (whole, _) = parse_chunks(&[stream]);
        assert_eq!(
            whole,
            vec![
                ev(Some("7"), "x", "a\n b"),
                ev(Some("7"), "message", "c"),
                // `id` alone resets the last event id; `data` alone is an empty data line.
                ev(None, "message", ""),
            ]
        );
        for split in 0..=stream.len() {
            let (a, b) = stream.split_at(split);
            let (events, parser) = parse_chunks(&[a, b]);
            assert_eq!(events, whole, "split at {split}");
            assert_eq!(parser.retry(), Some(Duration::from_millis(250)));
        }
        // Byte by byte (a CRLF split across reads is one terminator, not two).
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(parse_chunks(&bytes).0, whole);
    }

    #[test]
    fn events_without_data_are_not_dispatched_and_ids_persist() {
        let (events, parser) = parse_chunks(&[b"id: 3\nevent: ping\n\ndata: x\n\n"]);
        assert_eq!(events, vec![ev(Some("3"), "message", "x")]);
        assert_eq!(parser.last_event_id(), Some("3"));
    }

    #[test]
    fn ignores_unknown_fields_bad_retry_and_nul_ids() {
        let (events, parser) =
            parse_chunks(&[b"id: 1\nfoo: bar\nretry: 1x\nid: a\0b\ndata: y\n\n"]);
        assert_eq!(events, vec![ev(Some("1"), "message", "y")]);
        assert_eq!(parser.retry(), None);
    }

    #[test]
    fn unterminated_event_is_dropped_on_reconnect() {
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        parser
            .push(
                b"id: 4\ndata: done\n\nid: 5\nevent: half\ndata: partial",
                &mut out,
            )
            .unwrap();
        assert_eq!(out.len(), 1);
        // The `id: 5` line was complete, so it counts (WHATWG: ids apply as they are read).
        assert_eq!(parser.last_event_id(), Some("5"));
        parser.reset_connection();
        out.clear();
        parser.push(b"data: fresh\n\n", &mut out).unwrap();
        assert_eq!(out, vec![ev(Some("5"), "message", "fresh")]);
    }

    #[test]
    fn oversized_lines_and_events_are_refused() {
        let mut parser = SseParser::new(16);
        let mut out = Vec::new();
        assert!(matches!(
            parser.push(&[b'x'; 17], &mut out),
            Err(SseError::TooLarge { limit: 16 })
        ));
        let mut parser = SseParser::new(16);
        parser.push(b"data: 01234567\n", &mut out).unwrap();
        assert!(parser.push(b"data: 01234567\n", &mut out).is_err());
    }

    #[tokio::test]
    async fn stream_reads_events_then_end() {
        let chunks: Vec<Result<&[u8], String>> = vec![
            Ok(b"id: 1\ndata: a\n"),
            Ok(b"\nid: 2\ndata: b\n\n"),
            Ok(b"data: never terminated"),
        ];
        let mut s = SseStream::new(futures::stream::iter(chunks), SseParser::default(), None);
        assert_eq!(s.next_event().await.unwrap().unwrap().data, "a");
        assert_eq!(s.next_event().await.unwrap().unwrap().data, "b");
        assert!(s.next_event().await.unwrap().is_none());
        assert_eq!(s.last_event_id(), Some("2"));
    }

    #[tokio::test]
    async fn stream_reports_transport_errors_and_idleness() {
        let chunks: Vec<Result<&[u8], String>> =
            vec![Ok(b"data: a\n\n"), Err("connection reset".into())];
        let mut s = SseStream::new(futures::stream::iter(chunks), SseParser::default(), None);
        assert!(s.next_event().await.unwrap().is_some());
        let err = s.next_event().await.unwrap_err();
        assert!(matches!(err, SseError::Transport(ref m) if m == "connection reset"));

        let silent = futures::stream::pending::<Result<&[u8], String>>();
        let mut s = SseStream::new(
            silent,
            SseParser::default(),
            Some(Duration::from_millis(20)),
        );
        assert!(matches!(s.next_event().await, Err(SseError::Idle(_))));
    }

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
