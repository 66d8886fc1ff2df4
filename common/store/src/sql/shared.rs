//! Writes that several requests share (the group commits of ingest and run starts), each
//! request still answered on its own.
//!
//! ```text
//! let shared = Shared::validate("a part", requests, Part::new); // refused ones answered now
//! let written = shared.write(|parts| store.write_together(parts)).await;
//! shared.answer(written)                                        // one answer per request
//! ```

use std::future::Future;

use crate::error::{Result, StoreError};

/// The requests of one shared write: the parts that passed validation, and the answers of
/// those that did not, each in its request's place.
pub(crate) struct Shared<P, T> {
    /// Names a part in the error of a missing answer (`"a run start"`).
    what: &'static str,
    answers: Vec<Option<Result<T>>>,
    /// For each part, the index of its request.
    slots: Vec<usize>,
    parts: Vec<P>,
}

impl<P, T> Shared<P, T> {
    /// Turns each request into a part with `validate`; a request it refuses is answered
    /// with that error and is not written. `what` names a part in the error of a missing
    /// answer.
    pub(crate) fn validate<R>(
        what: &'static str,
        requests: Vec<R>,
        mut validate: impl FnMut(R) -> Result<P>,
    ) -> Self {
        let mut shared = Self {
            what,
            answers: Vec::with_capacity(requests.len()),
            slots: Vec::with_capacity(requests.len()),
            parts: Vec::with_capacity(requests.len()),
        };
        for request in requests {
            match validate(request) {
                Ok(part) => {
                    shared.slots.push(shared.answers.len());
                    shared.parts.push(part);
                    shared.answers.push(None);
                }
                Err(error) => shared.answers.push(Some(Err(error))),
            }
        }
        shared
    }

    /// Writes every part together with `write` (which answers one result per part, in
    /// order). One part can fail a shared statement or transaction for all (an id another
    /// request took, a constraint): when the shared write fails, each part is written
    /// alone, so it fails alone.
    pub(crate) async fn write<'p, F, Fut>(&'p self, write: F) -> Vec<Result<T>>
    where
        F: Fn(&'p [P]) -> Fut,
        Fut: Future<Output = Result<Vec<Result<T>>>>,
    {
        match write(&self.parts).await {
            Ok(written) => written,
            Err(error) => {
                tracing::debug!(%error, parts = self.parts.len(), what = self.what, "shared write failed; writing one by one");
                let mut alone = Vec::with_capacity(self.parts.len());
                for part in self.parts.chunks(1) {
                    alone.push(match write(part).await {
                        Ok(mut one) => one.pop().unwrap_or_else(|| Err(unanswered(self.what))),
                        Err(error) => Err(error),
                    });
                }
                alone
            }
        }
    }

    /// Every request's answer, in request order: its validation error, or what
    /// [`write`](Self::write) answered for its part (`Corrupt` naming the part if nothing
    /// did).
    pub(crate) fn answer(mut self, written: Vec<Result<T>>) -> Vec<Result<T>> {
        let what = self.what;
        for (slot, answer) in self.slots.into_iter().zip(written) {
            self.answers[slot] = Some(answer);
        }
        self.answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(unanswered(what))))
            .collect()
    }
}

fn unanswered(what: &str) -> StoreError {
    StoreError::Corrupt(format!("{what} went unanswered"))
}
