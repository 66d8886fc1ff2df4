//! The process-wide stdout writer: one JSON object per line, whole lines behind a mutex.

use std::io::{self, Write};
use std::sync::Mutex;

use sb_protocol::wire::RunnerToHost;

/// Shared by the reader thread (API errors, protocol complaints) and every run thread.
pub(crate) struct Output {
    writer: Mutex<Box<dyn Write + Send>>,
}

impl Output {
    pub(crate) fn new(writer: Box<dyn Write + Send>) -> Self {
        Self {
            writer: Mutex::new(writer),
        }
    }

    /// Writes one message as a line and flushes. The message is serialized before the lock is
    /// taken, so a slow serialization never blocks other runs.
    pub(crate) fn send(&self, msg: &RunnerToHost) -> io::Result<()> {
        let mut line = serde_json::to_vec(msg).map_err(io::Error::other)?;
        line.push(b'\n');
        self.send_line(&line)
    }

    /// Writes pre-serialized bytes (must be one line ending in `\n`).
    pub(crate) fn send_line(&self, line: &[u8]) -> io::Result<()> {
        // A poisoned lock only means another thread panicked mid-write; the writer itself is
        // still usable and refusing all further output would be worse.
        let mut w = self
            .writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        w.write_all(line)?;
        w.flush()
    }
}
