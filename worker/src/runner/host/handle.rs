//! [`RunHandle`]: the consumer side of one run, the ordered item stream a
//! `RunnerHost::start_run` returns (its contract is in the host's module docs).

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use sb_protocol::error::run_failure;
use sb_protocol::ids::RunId;
use sb_protocol::result::AgentRunResult;
use tokio::sync::mpsc;

use super::command::Command;
use crate::sequencer::{RunItem, RunSequencer};

/// The consumer side of one run. See the host's module docs for the contract.
pub struct RunHandle {
    run_id: RunId,
    events: mpsc::Receiver<RunItem>,
    control: mpsc::UnboundedSender<Command>,
    last_sequence: u64,
    finished: bool,
}

impl RunHandle {
    pub(super) fn new(
        run_id: RunId,
        events: mpsc::Receiver<RunItem>,
        control: mpsc::UnboundedSender<Command>,
    ) -> Self {
        Self {
            run_id,
            events,
            control,
            last_sequence: 0,
            finished: false,
        }
    }

    #[must_use]
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// The next item, or `None` after the terminal item.
    pub async fn next(&mut self) -> Option<RunItem> {
        std::future::poll_fn(|cx| self.poll_item(cx)).await
    }

    /// Asks for the run to be cancelled (see `RunnerHost::cancel`).
    pub fn cancel(&self, reason: impl Into<String>) {
        if !self.finished {
            let _ = self.control.send(Command::Cancel {
                run_id: self.run_id,
                reason: reason.into(),
            });
        }
    }

    fn poll_item(&mut self, cx: &mut Context<'_>) -> Poll<Option<RunItem>> {
        if self.finished {
            return Poll::Ready(None);
        }
        match self.events.poll_recv(cx) {
            Poll::Ready(Some(item)) => {
                self.last_sequence = item.sequence;
                self.finished = item.is_terminal();
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                // The actor went away without a terminal item (it panicked). Keep the
                // contract: exactly one terminal item.
                self.finished = true;
                Poll::Ready(
                    RunSequencer::continuing(self.run_id, self.last_sequence).end_with(
                        AgentRunResult::run_failed(
                            run_failure::RUNNER_CRASHED,
                            "runner host lost the run",
                            false,
                        ),
                    ),
                )
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Stream for RunHandle {
    type Item = RunItem;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<RunItem>> {
        self.get_mut().poll_item(cx)
    }
}

impl Drop for RunHandle {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.control.send(Command::Cancel {
                run_id: self.run_id,
                reason: "run handle dropped".into(),
            });
        }
    }
}

impl std::fmt::Debug for RunHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunHandle")
            .field("run_id", &self.run_id)
            .field("last_sequence", &self.last_sequence)
            .field("finished", &self.finished)
            .finish()
    }
}
