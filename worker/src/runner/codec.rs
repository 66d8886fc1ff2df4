//! JSON-lines framing over a runner's stdio (SPEC §4.2).
//!
//! [`LineReader`] turns a byte stream into lines **without ever buffering more than the line
//! cap**: a line longer than the cap is reported as [`RawLine::TooLong`] as soon as the cap is
//! crossed (the caller can fail the affected run right away), and the rest of that line is
//! discarded on the following reads, so the stream resynchronises on the next newline.
//! [`decode_runner_line`] then turns a line into a [`RunnerLine`] or a [`FrameError`] that says
//! how bad it was. [`RunnerConnection`] wraps both directions the way mini-redis's `Connection`
//! hides byte framing from the command handler.
//!
//! **A forgiving wire for calls.** A line with `op: "api"` is always a call, however
//! malformed the rest of it is: it decodes to [`RunnerLine::RefusedCall`], which the host
//! answers with an `api_result` error while the run goes on. Only lines that are not usable
//! at all (not JSON, not an object, no or unknown `op`, a malformed `result`/`done`/`log`, too
//! long) are [`FrameError`]s, i.e. protocol errors.
//!
//! Every [`FrameError`] except [`FrameError::Io`] is recoverable: the next line is independent.

use std::io;

use sb_protocol::wire::{ApiCallId, HostToRunner, RunnerToHost};
use serde_json::{Map, Value};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

/// One line read by [`LineReader`], without its `\n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawLine {
    /// A complete line of at most the cap.
    Line(Vec<u8>),
    /// A line that crossed the cap. `prefix` holds its first `cap` bytes; the remainder is
    /// skipped by the next reads.
    TooLong { prefix: Vec<u8> },
}

/// Reads `\n`-terminated lines with a hard cap on the bytes held per line.
///
/// Cancel safety: [`LineReader::next_line`] only consumes bytes from the underlying reader
/// after copying them into its own buffer, so dropping the future loses nothing.
#[derive(Debug)]
pub struct LineReader<R> {
    reader: R,
    max_line_bytes: usize,
    buf: Vec<u8>,
    /// Set after a [`RawLine::TooLong`] until the newline that ends that line is seen.
    discarding: bool,
}

impl<R: AsyncBufRead + Unpin> LineReader<R> {
    pub fn new(reader: R, max_line_bytes: usize) -> Self {
        Self {
            reader,
            max_line_bytes: max_line_bytes.max(1),
            buf: Vec::new(),
            discarding: false,
        }
    }

    /// The next line, or `None` at end of stream. A final line without a trailing newline is
    /// still returned.
    pub async fn next_line(&mut self) -> io::Result<Option<RawLine>> {
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                self.discarding = false;
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Ok(Some(RawLine::Line(std::mem::take(&mut self.buf))));
            }
            let newline = available.iter().position(|&b| b == b'\n');
            let (chunk_len, consumed) = match newline {
                Some(pos) => (pos, pos + 1),
                None => (available.len(), available.len()),
            };
            if self.discarding {
                self.reader.consume(consumed);
                if newline.is_some() {
                    self.discarding = false;
                }
                continue;
            }
            let room = self.max_line_bytes - self.buf.len();
            if chunk_len > room {
                self.buf.extend_from_slice(&available[..room]);
                self.reader.consume(consumed);
                // Without a newline in this chunk the line goes on: skip the rest later.
                self.discarding = newline.is_none();
                let prefix = std::mem::take(&mut self.buf);
                return Ok(Some(RawLine::TooLong { prefix }));
            }
            self.buf.extend_from_slice(&available[..chunk_len]);
            self.reader.consume(consumed);
            if newline.is_some() {
                return Ok(Some(RawLine::Line(std::mem::take(&mut self.buf))));
            }
        }
    }
}

/// Why a runner line could not be used. All but [`FrameError::Io`] leave the stream usable.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("runner line exceeds {limit} bytes")]
    TooLong { limit: usize },
    #[error("runner line is not json: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("runner line is not a json object")]
    NotObject,
    #[error("runner line has no string `op` field")]
    MissingOp { run_id: Option<String> },
    #[error("runner line has unknown op `{op}`")]
    UnknownOp { op: String, run_id: Option<String> },
    #[error("invalid `{op}` message: {source}")]
    Invalid {
        op: String,
        run_id: Option<String>,
        #[source]
        source: serde_json::Error,
    },
    #[error("runner stdio failed: {0}")]
    Io(#[from] io::Error),
}

impl FrameError {
    /// The run the bad line names, when it is readable enough to tell. The host fails that run
    /// with `runner.protocol_error`; with no run id there is no run to blame.
    #[must_use]
    pub fn run_id_hint(&self) -> Option<&str> {
        match self {
            Self::MissingOp { run_id }
            | Self::UnknownOp { run_id, .. }
            | Self::Invalid { run_id, .. } => run_id.as_deref(),
            _ => None,
        }
    }

    /// False only for I/O errors: after any other error the next line can be read normally.
    #[must_use]
    pub fn is_recoverable(&self) -> bool {
        !matches!(self, Self::Io(_))
    }
}

/// The ops this host understands (so an unknown op can be told from a malformed known one).
const KNOWN_OPS: [&str; 4] = ["result", "done", "api", "log"];

/// One usable runner line.
#[derive(Debug, Clone, PartialEq)]
pub enum RunnerLine {
    /// A well-formed message.
    Message(RunnerToHost),
    /// An `api` call the host cannot accept as written. It is answered, never a protocol
    /// error.
    RefusedCall(RefusedCall),
}

/// An `op: "api"` line that is not a well-formed [`RunnerToHost::Api`], with what could be
/// read of it. The runner link decides the answer's code (`not_found` for a run that is not
/// active, `invalid_argument` otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedCall {
    /// The call's `id`, when it is a string or an integer. Without one the answer is
    /// written with `id: null`.
    pub id: Option<ApiCallId>,
    /// The `run_id`, when it is a string.
    pub run_id: Option<String>,
    /// What is wrong with the call, worded for the runner's author.
    pub problem: String,
}

/// Decodes one runner line. Whitespace-only lines are the caller's business (see
/// [`is_blank`]).
pub fn decode_runner_line(line: &[u8]) -> Result<RunnerLine, FrameError> {
    // Fast paths: one typed parse. Only failures pay for the diagnosis below.
    if let Some(message) = decode_result_line(line) {
        return Ok(RunnerLine::Message(message));
    }
    let typed_err = match serde_json::from_slice::<RunnerToHost>(line) {
        Ok(msg) => return Ok(RunnerLine::Message(msg)),
        Err(e) => e,
    };
    let value: Value = serde_json::from_slice(line).map_err(FrameError::NotJson)?;
    let Value::Object(map) = value else {
        return Err(FrameError::NotObject);
    };
    let run_id = map.get("run_id").and_then(Value::as_str).map(str::to_owned);
    match map.get("op").and_then(Value::as_str) {
        None => Err(FrameError::MissingOp { run_id }),
        Some("api") => Ok(RunnerLine::RefusedCall(refused_call(&map, &typed_err))),
        Some(op) if !KNOWN_OPS.contains(&op) => Err(FrameError::UnknownOp {
            op: op.to_owned(),
            run_id,
        }),
        Some(op) => Err(FrameError::Invalid {
            op: op.to_owned(),
            run_id,
            source: typed_err,
        }),
    }
}

/// A `result` line, the kind a streaming run sends hundreds of, parsed straight into its
/// fields; `None` for any other line (then [`RunnerToHost`]'s own decoder decides). The
/// derived decoder of an internally tagged enum first buffers the whole line into serde's
/// generic content and then reads that again: a twentieth of an embedded streaming run's
/// CPU in a profile (200-word replies), for the line kind that matters most.
fn decode_result_line(line: &[u8]) -> Option<RunnerToHost> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum ResultOp {
        Result,
    }
    #[derive(serde::Deserialize)]
    struct ResultLine {
        #[allow(dead_code)] // only `result` lines parse
        op: ResultOp,
        run_id: String,
        result: Value,
    }
    let ResultLine { run_id, result, .. } = serde_json::from_slice(line).ok()?;
    Some(RunnerToHost::Result { run_id, result })
}

/// Reads what it can of a malformed `api` line. The first defect found names the problem,
/// the id first, because without a usable id the answer cannot be matched to the call.
fn refused_call(map: &Map<String, Value>, typed_err: &serde_json::Error) -> RefusedCall {
    let id = map.get("id").and_then(ApiCallId::from_json);
    let run_id = map.get("run_id").and_then(Value::as_str).map(str::to_owned);
    let problem = if id.is_none() {
        match map.get("id") {
            None => "api call has no `id`".to_owned(),
            Some(_) => "api call `id` must be a string or an integer".to_owned(),
        }
    } else if run_id.is_none() {
        "api call has no string `run_id`".to_owned()
    } else if !map.get("action").is_some_and(Value::is_string) {
        "api call has no string `action`".to_owned()
    } else {
        // Every field the typed shape needs was there: say what serde saw (e.g. a
        // duplicate field).
        format!("malformed api call: {typed_err}")
    };
    RefusedCall {
        id,
        run_id,
        problem,
    }
}

/// True for a line holding only ASCII whitespace (ignored, not an error).
#[must_use]
pub fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

/// Serializes one host message as a single line (with its `\n`).
pub fn encode_host_message(msg: &HostToRunner) -> Vec<u8> {
    // Serializing our own plain data types into a Vec cannot fail.
    let mut out = serde_json::to_vec(msg)
        .unwrap_or_else(|e| unreachable!("host message serialization failed: {e}"));
    out.push(b'\n');
    out
}

/// Reading half of a [`RunnerConnection`].
#[derive(Debug)]
pub struct MessageReader<R> {
    lines: LineReader<BufReader<R>>,
    max_line_bytes: usize,
}

impl<R: AsyncRead + Unpin> MessageReader<R> {
    pub fn new(reader: R, max_line_bytes: usize) -> Self {
        Self {
            lines: LineReader::new(BufReader::with_capacity(64 * 1024, reader), max_line_bytes),
            max_line_bytes,
        }
    }

    /// The next usable line; `Ok(None)` at end of stream. Blank lines are skipped. A
    /// recoverable error consumed exactly the offending line: call again to continue with the
    /// next one.
    pub async fn read_message(&mut self) -> Result<Option<RunnerLine>, FrameError> {
        loop {
            match self.lines.next_line().await? {
                None => return Ok(None),
                Some(RawLine::TooLong { .. }) => {
                    return Err(FrameError::TooLong {
                        limit: self.max_line_bytes,
                    });
                }
                Some(RawLine::Line(line)) if is_blank(&line) => continue,
                Some(RawLine::Line(line)) => return decode_runner_line(&line).map(Some),
            }
        }
    }
}

/// Writing half of a [`RunnerConnection`].
#[derive(Debug)]
pub struct MessageWriter<W> {
    writer: W,
}

impl<W: AsyncWrite + Unpin> MessageWriter<W> {
    pub fn new(writer: W) -> Self {
        Self { writer }
    }

    /// Writes one message and flushes it.
    pub async fn write_message(&mut self, msg: &HostToRunner) -> io::Result<()> {
        self.write_message_buffered(msg).await?;
        self.writer.flush().await
    }

    /// Writes one message without flushing; call [`MessageWriter::flush`] when the batch is
    /// done. Lets a writer task coalesce bursts into one syscall.
    pub async fn write_message_buffered(&mut self, msg: &HostToRunner) -> io::Result<()> {
        self.writer.write_all(&encode_host_message(msg)).await
    }

    pub async fn flush(&mut self) -> io::Result<()> {
        self.writer.flush().await
    }

    /// Flushes and closes the stream (the runner sees end of input).
    pub async fn close(&mut self) -> io::Result<()> {
        self.writer.flush().await?;
        self.writer.shutdown().await
    }
}

/// Both directions of a runner's stdio: messages out to its stdin, messages in from its stdout.
#[derive(Debug)]
pub struct RunnerConnection<R, W> {
    reader: MessageReader<R>,
    writer: MessageWriter<W>,
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> RunnerConnection<R, W> {
    pub fn new(stdout: R, stdin: W, max_line_bytes: usize) -> Self {
        Self {
            reader: MessageReader::new(stdout, max_line_bytes),
            writer: MessageWriter::new(stdin),
        }
    }

    /// See [`MessageReader::read_message`].
    pub async fn read_message(&mut self) -> Result<Option<RunnerLine>, FrameError> {
        self.reader.read_message().await
    }

    /// See [`MessageWriter::write_message`].
    pub async fn write_message(&mut self, msg: &HostToRunner) -> io::Result<()> {
        self.writer.write_message(msg).await
    }

    /// Splits into halves owned by separate tasks (a reader task and a writer task).
    pub fn into_split(self) -> (MessageReader<R>, MessageWriter<W>) {
        (self.reader, self.writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn lines_of(input: &[u8], cap: usize, read_buf: usize) -> Vec<RawLine> {
        let reader = BufReader::with_capacity(read_buf, input);
        let mut lines = LineReader::new(reader, cap);
        let mut out = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            out.push(line);
        }
        out
    }

    #[tokio::test]
    async fn splits_lines_and_keeps_a_final_unterminated_line() {
        for read_buf in [1, 3, 64] {
            let got = lines_of(b"ab\n\ncd\nef", 16, read_buf).await;
            assert_eq!(
                got,
                vec![
                    RawLine::Line(b"ab".to_vec()),
                    RawLine::Line(vec![]),
                    RawLine::Line(b"cd".to_vec()),
                    RawLine::Line(b"ef".to_vec()),
                ],
                "read_buf={read_buf}"
            );
        }
    }

    #[tokio::test]
    async fn over_long_lines_are_cut_and_the_stream_resynchronises() {
        for read_buf in [1, 2, 5, 1024] {
            let got = lines_of(b"12345678\nok\n123456\nabcd\n", 4, read_buf).await;
            assert_eq!(
                got,
                vec![
                    RawLine::TooLong {
                        prefix: b"1234".to_vec()
                    },
                    RawLine::Line(b"ok".to_vec()),
                    RawLine::TooLong {
                        prefix: b"1234".to_vec()
                    },
                    RawLine::Line(b"abcd".to_vec()),
                ],
                "read_buf={read_buf}"
            );
        }
    }

    #[tokio::test]
    async fn reports_an_endless_line_without_waiting_for_its_end() {
        // An infinite stream of bytes with no newline: buffering until the newline would never
        // return. The reader must report after the cap.
        let mut reader = MessageReader::new(tokio::io::repeat(b'x'), 1024);
        let res = tokio::time::timeout(std::time::Duration::from_secs(5), reader.read_message())
            .await
            .expect("reader buffered an endless line");
        assert!(matches!(res, Err(FrameError::TooLong { limit: 1024 })));
        assert!(reader.lines.buf.capacity() <= 2048);
    }

    #[tokio::test]
    async fn resynchronises_after_a_huge_line() {
        let mut input = vec![b'x'; 8 * 1024 * 1024];
        input.extend_from_slice(b"\n{\"op\":\"done\",\"run_id\":\"r\"}\n");
        let mut reader = MessageReader::new(&input[..], 1024);
        assert!(matches!(
            reader.read_message().await,
            Err(FrameError::TooLong { limit: 1024 })
        ));
        let next = reader.read_message().await.unwrap();
        assert_eq!(
            next,
            Some(RunnerLine::Message(RunnerToHost::Done {
                run_id: "r".into()
            }))
        );
        assert!(reader.read_message().await.unwrap().is_none());
    }

    #[test]
    fn decode_classifies_bad_lines() {
        assert!(matches!(
            decode_runner_line(b"hello"),
            Err(FrameError::NotJson(_))
        ));
        assert!(matches!(
            decode_runner_line(b"[1,2]"),
            Err(FrameError::NotObject)
        ));
        assert!(matches!(
            decode_runner_line(b"\"s\""),
            Err(FrameError::NotObject)
        ));
        match decode_runner_line(br#"{"run_id":"r1"}"#) {
            Err(e @ FrameError::MissingOp { .. }) => assert_eq!(e.run_id_hint(), Some("r1")),
            other => panic!("{other:?}"),
        }
        match decode_runner_line(br#"{"op":"teleport","run_id":"r2"}"#) {
            Err(e @ FrameError::UnknownOp { .. }) => assert_eq!(e.run_id_hint(), Some("r2")),
            other => panic!("{other:?}"),
        }
        match decode_runner_line(br#"{"op":"result","run_id":"r3"}"#) {
            Err(e @ FrameError::Invalid { .. }) => {
                assert_eq!(e.run_id_hint(), Some("r3"));
                assert!(e.is_recoverable());
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decode_runner_line(br#"{"op":"done","run_id":"r4"}"#),
            Ok(RunnerLine::Message(RunnerToHost::Done { .. }))
        ));
    }

    #[test]
    fn result_lines_decode_as_the_enum_decodes_them() {
        // The fast path and the derived decoder agree on result lines, whatever the field
        // order or extra fields, and the fast path leaves every other line alone.
        let lines: [&[u8]; 3] = [
            br#"{"op":"result","run_id":"r1","result":{"type":"message.delta","data":{"delta":"hi"}}}"#,
            br#"{"result":{"type":"run.completed","data":{}},"extra":1,"run_id":"r2","op":"result"}"#,
            br#"{"op":"result","run_id":"r3","result":"not an object"}"#,
        ];
        for line in lines {
            let expected: RunnerToHost = serde_json::from_slice(line).unwrap();
            assert_eq!(decode_result_line(line), Some(expected.clone()));
            assert_eq!(
                decode_runner_line(line).unwrap(),
                RunnerLine::Message(expected)
            );
        }
        for line in [
            &br#"{"op":"done","run_id":"r4","result":{}}"#[..],
            br#"{"op":"result","run_id":"r5"}"#,
            br#"{"op":"result","result":{}}"#,
        ] {
            assert_eq!(decode_result_line(line), None);
        }
    }

    fn refused(line: &[u8]) -> RefusedCall {
        match decode_runner_line(line) {
            Ok(RunnerLine::RefusedCall(call)) => call,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn integer_ids_are_well_formed_calls() {
        match decode_runner_line(br#"{"op":"api","id":42,"run_id":"r","action":"ping"}"#) {
            Ok(RunnerLine::Message(RunnerToHost::Api { id, .. })) => {
                assert_eq!(id, ApiCallId::from(42u64));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn malformed_calls_are_refused_not_protocol_errors() {
        let call = refused(br#"{"op":"api","id":"1","action":"ping"}"#);
        assert_eq!(call.id, Some(ApiCallId::from("1")));
        assert_eq!(call.run_id, None);
        assert_eq!(call.problem, "api call has no string `run_id`");

        let call = refused(br#"{"op":"api","id":2,"run_id":"r","action":7}"#);
        assert_eq!(call.id, Some(ApiCallId::from(2u64)));
        assert_eq!(call.run_id.as_deref(), Some("r"));
        assert_eq!(call.problem, "api call has no string `action`");

        let call = refused(br#"{"op":"api","run_id":"r","action":"ping"}"#);
        assert_eq!(call.id, None);
        assert_eq!(call.problem, "api call has no `id`");

        let call = refused(br#"{"op":"api","id":1.5,"run_id":"r","action":"ping"}"#);
        assert_eq!(call.id, None);
        assert_eq!(call.run_id.as_deref(), Some("r"));
        assert_eq!(call.problem, "api call `id` must be a string or an integer");

        let call = refused(br#"{"op":"api","id":"d","id":"e","run_id":"r","action":"ping"}"#);
        assert!(call.problem.starts_with("malformed api call:"), "{call:?}");
        // Still a protocol error: not JSON, or not an object, even when it mentions "api".
        assert!(matches!(
            decode_runner_line(br#"{"op":"api""#),
            Err(FrameError::NotJson(_))
        ));
    }

    #[tokio::test]
    async fn connection_round_trip_over_a_duplex_pipe() {
        let (host_side, mut runner_side) = tokio::io::duplex(1024);
        let (host_read, host_write) = tokio::io::split(host_side);
        let mut conn = RunnerConnection::new(host_read, host_write, 1024);

        conn.write_message(&HostToRunner::Shutdown {})
            .await
            .unwrap();
        let mut buf = vec![0u8; 64];
        let n = tokio::io::AsyncReadExt::read(&mut runner_side, &mut buf)
            .await
            .unwrap();
        assert_eq!(&buf[..n], b"{\"op\":\"shutdown\"}\n");

        runner_side
            .write_all(b"   \nnot json\n{\"op\":\"done\",\"run_id\":\"x\"}\n")
            .await
            .unwrap();
        drop(runner_side);
        assert!(matches!(
            conn.read_message().await,
            Err(FrameError::NotJson(_))
        ));
        assert_eq!(
            conn.read_message().await.unwrap(),
            Some(RunnerLine::Message(RunnerToHost::Done {
                run_id: "x".into()
            }))
        );
        assert!(conn.read_message().await.unwrap().is_none());
    }
}
