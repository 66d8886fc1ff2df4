//! The stdio pumps of a runner process: a reader task that turns stdout into frames and a
//! writer task that batches messages to stdin. They hold no run state, so the actor never
//! blocks on a pipe.

use tokio::process::{ChildStdin, ChildStdout};
use tokio::sync::{mpsc, oneshot};

use crate::runner::codec::{FrameError, MessageReader, MessageWriter, RunnerLine};
use sb_protocol::wire::HostToRunner;

pub(super) async fn read_frames(
    mut reader: MessageReader<ChildStdout>,
    frames: mpsc::Sender<Result<RunnerLine, FrameError>>,
) {
    loop {
        match reader.read_message().await {
            Ok(Some(msg)) => {
                if frames.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Err(e) if e.is_recoverable() => {
                if frames.send(Err(e)).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "runner stdout read failed");
                return;
            }
        }
    }
}

/// Writes messages in arrival order, flushing when the queue runs dry (one syscall per
/// burst). On `close` (after the queue is drained) it closes the runner's stdin.
pub(super) async fn write_frames(
    mut writer: MessageWriter<ChildStdin>,
    mut messages: mpsc::Receiver<HostToRunner>,
    mut close: oneshot::Receiver<()>,
) {
    loop {
        let msg = tokio::select! {
            biased;
            msg = messages.recv() => msg,
            // Also taken when the actor is gone (sender dropped): close either way.
            _ = &mut close => {
                // Write what is already queued, then close.
                let mut ok = true;
                while let Ok(msg) = messages.try_recv() {
                    ok = ok && writer.write_message_buffered(&msg).await.is_ok();
                }
                if ok {
                    let _ = writer.close().await;
                }
                // Keep draining (and discarding) so senders never block on a dead pipe.
                while messages.recv().await.is_some() {}
                return;
            }
        };
        let Some(msg) = msg else { return };
        if writer.write_message_buffered(&msg).await.is_err() {
            break;
        }
        let mut failed = false;
        while let Ok(more) = messages.try_recv() {
            if writer.write_message_buffered(&more).await.is_err() {
                failed = true;
                break;
            }
        }
        if failed || writer.flush().await.is_err() {
            break;
        }
    }
    // The pipe is broken (the process died): discard the rest so senders never block.
    while messages.recv().await.is_some() {}
}
