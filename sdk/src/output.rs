//! The process-wide stdout writer: one JSON object per line, whole lines, written by a thread
//! of its own that takes every line queued since its last write in one `write` and one flush.
//!
//! # Why a writer thread
//!
//! A run emits its items in bursts (the echo runner all of them at once, a model reply one
//! delta after another as fast as they arrive). Written and flushed one by one, every item
//! is a `write` syscall for the runner and, on the host's side of the pipe, a wake-up of the
//! task that reads it; written together, a burst is one of each, and the host reads it as
//! items ready together (which it hands on together). Nothing waits to be batched: the thread
//! writes as soon as a line is queued, and what queues while it writes goes with its next
//! write (natural batching, as the host's own writes to the runner). At one line at a time a
//! line costs what it did, plus a hand-over to the thread.
//!
//! Order is the order of [`Output::send`] calls: one queue, one writer. Memory is bounded:
//! a sender waits while [`MAX_QUEUED_BYTES`] are queued and not yet taken (the host not
//! reading), as it waited on the pipe before. A write that fails (the host closed the pipe)
//! fails every later send; [`Output::close`] writes what is queued and stops the thread.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use sb_protocol::wire::RunnerToHost;

/// Bytes queued and not yet taken by the writer beyond which a sender waits.
const MAX_QUEUED_BYTES: usize = 1 << 20;

/// Shared by the reader thread (API errors, protocol complaints) and every run thread.
pub(crate) struct Output {
    queue: Arc<Queue>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// [`MAX_QUEUED_BYTES`], smaller in tests.
    max_queued: usize,
}

/// What the senders and the writer thread share.
struct Queue {
    state: Mutex<QueueState>,
    /// Signalled when lines are queued (for the writer) and when the writer takes them or
    /// stops (for senders waiting on a full queue, and for [`Output::close`]).
    changed: Condvar,
}

#[derive(Default)]
struct QueueState {
    /// Whole lines, in send order, not yet taken by the writer.
    lines: Vec<u8>,
    /// The writer waits for lines (a sender must wake it).
    writer_idle: bool,
    /// Senders waiting for room in a full queue (the writer must wake them).
    senders_waiting: usize,
    /// No more lines are taken: [`Output::close`] was called.
    closing: bool,
    /// The writer stopped: closed and drained, or a write failed (with its error).
    stopped: Option<Result<(), (io::ErrorKind, String)>>,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A poisoned lock only means a thread panicked holding it; the queue is still whole
        // lines, and refusing all further output would be worse.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, state: MutexGuard<'a, QueueState>) -> MutexGuard<'a, QueueState> {
        self.changed
            .wait(state)
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Output {
    /// Starts the writer thread over `writer`; fails only if the thread cannot be started.
    pub(crate) fn new(writer: Box<dyn Write + Send>) -> io::Result<Self> {
        Self::with_limit(writer, MAX_QUEUED_BYTES)
    }

    /// [`Output::new`] with senders waiting once `max_queued` bytes are queued.
    fn with_limit(writer: Box<dyn Write + Send>, max_queued: usize) -> io::Result<Self> {
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            changed: Condvar::new(),
        });
        let writer = {
            let queue = Arc::clone(&queue);
            std::thread::Builder::new()
                .name("sb-runner-writer".into())
                .spawn(move || write_loop(&queue, writer))?
        };
        Ok(Self {
            queue,
            writer: Mutex::new(Some(writer)),
            max_queued,
        })
    }

    /// Queues one message as a line. The message is serialized before the queue is locked,
    /// so a slow serialization never blocks other runs.
    pub(crate) fn send(&self, msg: &RunnerToHost) -> io::Result<()> {
        let mut line = serde_json::to_vec(msg).map_err(io::Error::other)?;
        line.push(b'\n');
        self.send_line(&line)
    }

    /// Queues pre-serialized bytes (must be one line ending in `\n`). Fails once the writer
    /// stopped (a failed write, or [`Output::close`]).
    pub(crate) fn send_line(&self, line: &[u8]) -> io::Result<()> {
        let mut state = self.queue.lock();
        loop {
            if let Some(stopped) = &state.stopped {
                return Err(match stopped {
                    Err((kind, message)) => io::Error::new(*kind, message.clone()),
                    Ok(()) => io::Error::new(io::ErrorKind::BrokenPipe, "the output is closed"),
                });
            }
            if state.closing {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the output is closing",
                ));
            }
            if state.lines.len() < self.max_queued {
                break;
            }
            state.senders_waiting += 1;
            state = self.queue.wait(state);
            state.senders_waiting -= 1;
        }
        state.lines.extend_from_slice(line);
        if state.writer_idle {
            state.writer_idle = false;
            drop(state);
            self.queue.changed.notify_all();
        }
        Ok(())
    }

    /// Writes every queued line and stops the writer thread; later sends fail. Returns the
    /// error of a write that failed, if one did.
    pub(crate) fn close(&self) -> io::Result<()> {
        let handle = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        {
            let mut state = self.queue.lock();
            state.closing = true;
        }
        self.queue.changed.notify_all();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
        match &self.queue.lock().stopped {
            Some(Err((kind, message))) => Err(io::Error::new(*kind, message.clone())),
            _ => Ok(()),
        }
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// The writer thread: takes every queued line at once, writes and flushes them, until closed
/// and drained or a write fails.
fn write_loop(queue: &Queue, mut writer: Box<dyn Write + Send>) {
    let mut taken = Vec::new();
    loop {
        {
            let mut state = queue.lock();
            while state.lines.is_empty() && !state.closing {
                state.writer_idle = true;
                state = queue.wait(state);
            }
            state.writer_idle = false;
            if state.lines.is_empty() {
                state.stopped = Some(Ok(()));
                drop(state);
                queue.changed.notify_all();
                return;
            }
            taken.clear();
            std::mem::swap(&mut taken, &mut state.lines);
            if state.senders_waiting > 0 {
                // Room again for the senders waiting on a full queue.
                drop(state);
                queue.changed.notify_all();
            }
        }
        if let Err(error) = writer.write_all(&taken).and_then(|()| writer.flush()) {
            queue.lock().stopped = Some(Err((error.kind(), error.to_string())));
            queue.changed.notify_all();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{self, Receiver, Sender};
    use std::time::Duration;

    use super::*;

    /// A stdout whose every `write` is reported as one chunk and, while `gate` is set, says
    /// it began (`entered`) and holds on until the test lets it go.
    struct Pipe {
        chunks: Sender<Vec<u8>>,
        gate: Option<(Sender<()>, Receiver<()>)>,
        fail: bool,
    }

    /// The test's end of a gated [`Pipe`].
    struct Gate {
        entered: Receiver<()>,
        open: Sender<()>,
    }

    impl Gate {
        /// Waits until the writer is inside a write.
        fn writing(&self) {
            self.entered
                .recv_timeout(Duration::from_secs(10))
                .expect("the writer began a write");
        }

        /// Lets the write in progress finish.
        fn let_go(&self) {
            self.open.send(()).unwrap();
        }
    }

    impl Write for Pipe {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            if self.fail {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "host gone"));
            }
            if let Some((entered, gate)) = &self.gate {
                let _ = entered.send(());
                let _ = gate.recv();
            }
            let _ = self.chunks.send(data.to_vec());
            Ok(data.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn pipe() -> (Box<Pipe>, Receiver<Vec<u8>>) {
        let (chunks, written) = mpsc::channel();
        let pipe = Pipe {
            chunks,
            gate: None,
            fail: false,
        };
        (Box::new(pipe), written)
    }

    fn gated_pipe() -> (Box<Pipe>, Receiver<Vec<u8>>, Gate) {
        let (chunks, written) = mpsc::channel();
        let (entered_tx, entered) = mpsc::channel();
        let (open, gate) = mpsc::channel();
        let pipe = Pipe {
            chunks,
            gate: Some((entered_tx, gate)),
            fail: false,
        };
        (Box::new(pipe), written, Gate { entered, open })
    }

    fn next(written: &Receiver<Vec<u8>>) -> Vec<u8> {
        written
            .recv_timeout(Duration::from_secs(10))
            .expect("the writer wrote")
    }

    #[test]
    fn a_line_alone_is_written_at_once() {
        let (pipe, written) = pipe();
        let out = Output::new(pipe).unwrap();
        out.send_line(b"{\"a\":1}\n").unwrap();
        assert_eq!(next(&written), b"{\"a\":1}\n");
    }

    #[test]
    fn lines_queued_during_a_write_go_together_in_order_with_the_next() {
        let (pipe, written, gate) = gated_pipe();
        let out = Output::new(pipe).unwrap();
        out.send_line(b"1\n").unwrap();
        // The writer holds line 1 in its write; these queue meanwhile.
        gate.writing();
        for line in [b"2\n", b"3\n", b"4\n"] {
            out.send_line(line).unwrap();
        }
        gate.let_go();
        assert_eq!(next(&written), b"1\n");
        gate.writing();
        gate.let_go();
        assert_eq!(next(&written), b"2\n3\n4\n");
    }

    #[test]
    fn concurrent_senders_lines_stay_whole_and_each_senders_in_order() {
        let (pipe, written) = pipe();
        let out = Arc::new(Output::new(pipe).unwrap());
        let senders: Vec<_> = (0..4)
            .map(|sender| {
                let out = Arc::clone(&out);
                std::thread::spawn(move || {
                    for n in 0..500 {
                        out.send_line(format!("{sender} {n}\n").as_bytes()).unwrap();
                    }
                })
            })
            .collect();
        for sender in senders {
            sender.join().unwrap();
        }
        out.close().unwrap();
        let all: Vec<u8> = written.try_iter().flatten().collect();
        let mut last = [None::<u32>; 4];
        let mut count = 0;
        for line in String::from_utf8(all).unwrap().lines() {
            let (sender, n) = line.split_once(' ').expect("a whole line");
            let (sender, n): (usize, u32) = (sender.parse().unwrap(), n.parse().unwrap());
            assert_eq!(
                last[sender].map_or(0, |l| l + 1),
                n,
                "sender {sender} in order"
            );
            last[sender] = Some(n);
            count += 1;
        }
        assert_eq!(count, 2000);
    }

    #[test]
    fn close_writes_what_is_queued_and_later_sends_fail() {
        let (pipe, written, gate) = gated_pipe();
        let out = Output::new(pipe).unwrap();
        out.send_line(b"1\n").unwrap();
        gate.writing();
        out.send_line(b"2\n").unwrap();
        let closer = std::thread::spawn(move || {
            let result = out.close();
            (out, result)
        });
        gate.let_go();
        gate.writing();
        gate.let_go();
        let (out, result) = closer.join().unwrap();
        result.unwrap();
        assert_eq!(next(&written), b"1\n");
        assert_eq!(next(&written), b"2\n");
        let error = out.send_line(b"3\n").unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_failed_write_fails_the_sends_after_it() {
        let (chunks, _written) = mpsc::channel();
        let pipe = Pipe {
            chunks,
            gate: None,
            fail: true,
        };
        let out = Output::new(Box::new(pipe)).unwrap();
        out.send_line(b"1\n").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match out.send_line(b"2\n") {
                Err(error) => {
                    assert_eq!(error.kind(), io::ErrorKind::BrokenPipe);
                    assert!(error.to_string().contains("host gone"), "{error}");
                    break;
                }
                Ok(()) => assert!(
                    std::time::Instant::now() < deadline,
                    "sends kept succeeding"
                ),
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(out.close().unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_sender_waits_while_the_queue_is_full() {
        let (pipe, written, gate) = gated_pipe();
        let out = Arc::new(Output::with_limit(pipe, 4).unwrap());
        out.send_line(b"1\n").unwrap();
        gate.writing();
        // The writer holds line 1; these fill the queue to its limit.
        out.send_line(b"2\n").unwrap();
        out.send_line(b"3\n").unwrap();
        let (sent, sent_rx) = mpsc::channel();
        let sender = {
            let out = Arc::clone(&out);
            std::thread::spawn(move || {
                out.send_line(b"4\n").unwrap();
                sent.send(()).unwrap();
            })
        };
        assert!(
            sent_rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "a sender went on with the queue full"
        );
        gate.let_go();
        assert_eq!(next(&written), b"1\n");
        // The writer took lines 2 and 3 (and is held writing them): room for line 4.
        gate.writing();
        sent_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the sender went on once the writer took the queue");
        sender.join().unwrap();
        gate.let_go();
        assert_eq!(next(&written), b"2\n3\n");
        gate.writing();
        gate.let_go();
        assert_eq!(next(&written), b"4\n");
    }
}
