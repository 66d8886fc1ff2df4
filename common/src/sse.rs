//! Server-sent events (`text/event-stream`), read by the book: the one event-stream reader
//! of Switchboard, used by the model provider client (OpenAI-compatible streams), the CLI
//! (`send`, `runs tail`) and the end-to-end harness (the gateway's streams).
//!
//! Parsing is done by the [`sse_parse`] crate, which implements the WHATWG "interpreting an
//! event stream" algorithm in linear time whatever the chunking, because neither a model
//! provider nor a proxy in front of the gateway promises one exact byte layout:
//!
//! - lines end with CRLF, LF or CR, and a CRLF split across two reads is one line end;
//! - a line starting with `:` is a comment (keep-alives) and is ignored;
//! - `field: value` strips one space after the colon; a line without a colon is a field
//!   with an empty value; unknown fields are ignored;
//! - `data` lines accumulate, joined with `\n` (one event's JSON may span several lines);
//! - a blank line dispatches the event; an event without data is not dispatched;
//! - `id` sets the *last event id*, which persists across events until another `id` line
//!   changes it (an id containing NUL is ignored); it is what a client sends back in
//!   [`LAST_EVENT_ID`] when it reconnects;
//! - `retry` with only ASCII digits sets the reconnection delay;
//! - a leading UTF-8 byte order mark is skipped; invalid UTF-8 becomes U+FFFD;
//! - an event not terminated by a blank line when the stream ends is discarded.
//!
//! On top, this module adds what every caller here needs: a cap on the bytes held for one
//! line or event ([`SseError::TooLarge`] instead of unbounded buffering), reconnection that
//! keeps the last event id and the retry delay ([`SseParser::reset_connection`]), and
//! [`SseStream`], the events of one HTTP response body with an idle timeout.

use std::collections::VecDeque;
use std::time::Duration;

use futures::{Stream, StreamExt as _};

/// The request header carrying the id of the last event received, on reconnection.
pub const LAST_EVENT_ID: &str = "Last-Event-ID";

/// Default cap on one line or one event's data, in bytes. A gateway result is at most
/// 1 MiB of JSON (SPEC §13) and a model's stream chunk far less; the margin covers the
/// envelope and escaping.
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
///
/// Contract: any split of a byte stream into chunks yields the same events as the whole
/// stream; events come out in stream order as soon as their blank line has been fed; a
/// line or event larger than the limit is an error (the event is lost, the parser stays
/// usable and resynchronises at the next blank line).
#[derive(Debug, Clone)]
pub struct SseParser {
    inner: sse_parse::SseParser,
    max_bytes: usize,
    /// The most recent `retry`, kept across connections (the inner parser is per
    /// connection).
    retry: Option<Duration>,
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
            inner: sse_parse::SseParser::new().max_buffer(max_bytes),
            max_bytes,
            retry: None,
        }
    }

    /// Parses `bytes`, appending every event they complete to `out` (also when the chunk
    /// then overflows the limit: the events before the oversized one are kept).
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let overflows = self.inner.overflows();
        self.inner.feed(bytes);
        while let Some(event) = self.inner.next_event() {
            out.push(SseEvent {
                id: Some(event.id).filter(|id| !id.is_empty()),
                event: event.event,
                data: event.data,
            });
        }
        if let Some(retry) = self.inner.retry() {
            self.retry = Some(retry);
        }
        if self.inner.overflows() > overflows {
            return Err(SseError::TooLarge {
                limit: self.max_bytes,
            });
        }
        Ok(())
    }

    /// The last event id (empty when none): send it as [`LAST_EVENT_ID`] to resume.
    #[must_use]
    pub fn last_event_id(&self) -> Option<&str> {
        Some(self.inner.last_event_id()).filter(|id| !id.is_empty())
    }

    /// The reconnection delay the server asked for with `retry:`, if any.
    #[must_use]
    pub fn retry(&self) -> Option<Duration> {
        self.retry
    }

    /// Forgets a partly received event (the connection it came from is gone), keeping the
    /// last event id and the retry delay, as a reconnecting client must.
    pub fn reset_connection(&mut self) {
        self.inner = sse_parse::SseParser::with_last_event_id(self.inner.last_event_id())
            .max_buffer(self.max_bytes);
    }
}

/// The events of one HTTP response body.
///
/// Generic over the byte stream so tests can feed it without a socket; in production it
/// wraps `reqwest::Response::bytes_stream()`.
pub struct SseStream<S> {
    body: S,
    parser: SseParser,
    ready: VecDeque<SseEvent>,
    scratch: Vec<SseEvent>,
    idle_timeout: Option<Duration>,
    ended: bool,
    /// An error met after some events of the same chunk: reported once those are read.
    failed: Option<SseError>,
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
            ready: VecDeque::new(),
            scratch: Vec::new(),
            idle_timeout,
            ended: false,
            failed: None,
        }
    }

    /// The next event; `Ok(None)` when the server closed the stream. An error comes after
    /// the events that preceded it in the stream.
    pub async fn next_event(&mut self) -> Result<Option<SseEvent>, SseError> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Ok(Some(event));
            }
            if let Some(error) = self.failed.take() {
                return Err(error);
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
                    let pushed = self.parser.push(bytes.as_ref(), &mut self.scratch);
                    self.ready.extend(self.scratch.drain(..));
                    self.failed = pushed.err();
                }
            }
        }
    }

    /// The parser, to carry its last event id over to the next connection.
    pub fn into_parser(self) -> SseParser {
        self.parser
    }

    /// The last event id seen so far.
    pub fn last_event_id(&self) -> Option<&str> {
        self.parser.last_event_id()
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

    /// Every split of `stream` into two chunks, and byte by byte, gives `expected`.
    #[track_caller]
    fn same_events_at_every_split(stream: &[u8], expected: &[SseEvent]) {
        assert_eq!(parse_chunks(&[stream]).0, expected, "whole");
        for split in 0..=stream.len() {
            let (a, b) = stream.split_at(split);
            assert_eq!(parse_chunks(&[a, b]).0, expected, "split at {split}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(parse_chunks(&bytes).0, expected, "byte by byte");
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
    fn crlf_line_ends_split_anywhere() {
        same_events_at_every_split(
            b"data: {\"choices\":[]}\r\n\r\n: ping\r\n\r\ndata: [DONE]\r\n\r\n",
            &[
                ev(None, "message", "{\"choices\":[]}"),
                ev(None, "message", "[DONE]"),
            ],
        );
    }

    #[test]
    fn cr_only_line_ends_split_anywhere_and_the_last_event_is_not_held_back() {
        let stream: &[u8] = b"data: a\r\rdata: [DONE]\r\r";
        same_events_at_every_split(
            stream,
            &[ev(None, "message", "a"), ev(None, "message", "[DONE]")],
        );
        // The final CR dispatches at once: nothing waits for a possible LF.
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        parser.push(b"data: x\r", &mut out).unwrap();
        assert!(out.is_empty());
        parser.push(b"\r", &mut out).unwrap();
        assert_eq!(out, vec![ev(None, "message", "x")]);
    }

    #[test]
    fn multi_line_data_and_comments_split_anywhere() {
        same_events_at_every_split(
            b": stream opened\n\ndata: {\"choices\":\ndata:  [{\"delta\":\ndata: {\"content\":\"hi\"}}]}\n: a comment in between\ndata\n\n",
            &[ev(
                None,
                "message",
                "{\"choices\":\n [{\"delta\":\n{\"content\":\"hi\"}}]}\n",
            )],
        );
    }

    #[test]
    fn mixed_line_ends_bom_retry_and_id_reset() {
        let stream: &[u8] =
            b"\xEF\xBB\xBFretry: 250\r\nid: 7\r\nevent: x\r\ndata:a\r\ndata:  b\r\n\r\ndata: c\r\r: c\nid\ndata\n\n";
        same_events_at_every_split(
            stream,
            &[
                ev(Some("7"), "x", "a\n b"),
                ev(Some("7"), "message", "c"),
                // `id` alone resets the last event id; `data` alone is an empty data line.
                ev(None, "message", ""),
            ],
        );
        assert_eq!(
            parse_chunks(&[stream]).1.retry(),
            Some(Duration::from_millis(250))
        );
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
    fn unterminated_event_is_dropped_on_reconnect_and_state_is_kept() {
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        parser
            .push(
                b"retry: 90\nid: 4\ndata: done\n\nid: 5\nevent: half\ndata: partial",
                &mut out,
            )
            .unwrap();
        assert_eq!(out.len(), 1);
        parser.reset_connection();
        // The `id: 5` block never ended, so the last event id is still the dispatched one.
        assert_eq!(parser.last_event_id(), Some("4"));
        assert_eq!(parser.retry(), Some(Duration::from_millis(90)));
        out.clear();
        parser.push(b"data: fresh\n\n", &mut out).unwrap();
        assert_eq!(out, vec![ev(Some("4"), "message", "fresh")]);
    }

    #[test]
    fn oversized_lines_and_events_are_refused_and_the_parser_recovers() {
        let mut parser = SseParser::new(16);
        let mut out = Vec::new();
        assert!(matches!(
            parser.push(&[b'x'; 17], &mut out),
            Err(SseError::TooLarge { limit: 16 })
        ));
        let mut parser = SseParser::new(16);
        parser.push(b"data: 01234567\n", &mut out).unwrap();
        assert!(parser.push(b"data: 01234567\n", &mut out).is_err());
        // The oversized event is lost; the next one after its blank line is read.
        parser.push(b"\ndata: ok\n\n", &mut out).unwrap();
        assert_eq!(out, vec![ev(None, "message", "ok")]);
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

    #[tokio::test]
    async fn stream_keeps_the_events_before_an_oversized_one() {
        let chunks: Vec<Result<&[u8], String>> =
            vec![Ok(b"data: small\n\ndata: 0123456789abcdef0123\n\n")];
        let mut s = SseStream::new(futures::stream::iter(chunks), SseParser::new(16), None);
        assert_eq!(s.next_event().await.unwrap().unwrap().data, "small");
        assert!(matches!(
            s.next_event().await,
            Err(SseError::TooLarge { limit: 16 })
        ));
        assert!(s.next_event().await.unwrap().is_none());
    }
}
