//! WAL checkpoints of a SQLite file, taken off the writer.
//!
//! In WAL mode a commit appends its pages to the WAL; a *checkpoint* copies them back into
//! the database file, with an fsync of each file (`synchronous = NORMAL` syncs only there).
//! By default SQLite checkpoints in the committing connection, after any commit that leaves
//! the WAL past 1,000 pages — and here that connection is the host's one writer (see "One
//! SQLite writer" in the module docs), so every write of the host waited behind the copy and
//! the two fsyncs (2–8 ms on this machine's disk, about once per 50 runs under load).
//!
//! So a task of its own checkpoints from a pooled *read* connection, `PASSIVE` (it copies
//! what no reader still needs and never blocks the writer or a reader), every
//! [`BUSY_INTERVAL`] while commits keep coming and less often while they do not (backing off
//! to [`IDLE_INTERVAL`]: an idle host wakes once a second). The writer keeps SQLite's own
//! checkpoint as a backstop at [`WRITER_AUTOCHECKPOINT_PAGES`]: a passive checkpoint under
//! steady load never finds the WAL fully copied at a moment when no commit follows, and only
//! a writer finding it fully copied starts the WAL over from its beginning — without the
//! backstop the WAL file would grow for as long as the load lasts. When the backstop fires,
//! the background task has already copied nearly everything, so the writer's share is small.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};

/// WAL pages after which the writer's own commit checkpoints (SQLite's default is 1,000):
/// the backstop that bounds the WAL at about 16 MiB under sustained load.
pub(super) const WRITER_AUTOCHECKPOINT_PAGES: u32 = 4_000;

/// How often the task checkpoints while commits keep coming.
const BUSY_INTERVAL: Duration = Duration::from_millis(50);

/// The longest pause between checkpoints when nothing is committed.
const IDLE_INTERVAL: Duration = Duration::from_secs(1);

/// The background checkpoints of one SQLite file; they stop when this is dropped.
#[derive(Debug)]
pub(super) struct Checkpointer {
    task: tokio::task::JoinHandle<()>,
}

impl Checkpointer {
    /// Starts checkpointing through `readers` (a pool of the file's read connections) on the
    /// current Tokio runtime.
    pub(super) fn spawn(readers: DatabaseConnection) -> Self {
        Self {
            task: tokio::spawn(run(readers)),
        }
    }

    /// Stops the checkpoints (the pools are closing).
    pub(super) fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a checkpoint found: the WAL's frames and how many of them are in the database file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WalState {
    frames: i64,
    copied: i64,
}

async fn run(readers: DatabaseConnection) {
    let mut interval = BUSY_INTERVAL;
    let mut last: Option<WalState> = None;
    loop {
        tokio::time::sleep(interval).await;
        match checkpoint(&readers).await {
            Ok(state) => {
                interval = next_interval(interval, last, state);
                last = Some(state);
            }
            Err(error) => {
                // A closed pool (the store is closing) or a busy checkpointer (the writer's
                // backstop is running): nothing to do until the next turn.
                tracing::debug!(%error, "background WAL checkpoint skipped");
                interval = IDLE_INTERVAL;
            }
        }
    }
}

/// One passive checkpoint; what SQLite reports after it.
async fn checkpoint(readers: &DatabaseConnection) -> Result<WalState, sea_orm::DbErr> {
    let row = readers
        .query_one_raw(Statement::from_string(
            readers.get_database_backend(),
            "PRAGMA wal_checkpoint(PASSIVE)",
        ))
        .await?
        .ok_or_else(|| sea_orm::DbErr::Custom("wal_checkpoint answered no row".to_owned()))?;
    // The columns: busy, log (frames in the WAL), checkpointed (frames copied).
    let frames: i64 = row.try_get_by_index(1)?;
    let copied: i64 = row.try_get_by_index(2)?;
    Ok(WalState { frames, copied })
}

/// The pause before the next checkpoint: [`BUSY_INTERVAL`] after one that found new frames
/// (commits are coming), twice the last one (up to [`IDLE_INTERVAL`]) after one that found
/// the WAL as the previous one left it.
fn next_interval(current: Duration, last: Option<WalState>, now: WalState) -> Duration {
    let unchanged = last == Some(now) && now.frames == now.copied;
    if unchanged {
        (current * 2).min(IDLE_INTERVAL)
    } else {
        BUSY_INTERVAL
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sql::{SqlStore, SqlStoreOptions};

    #[tokio::test]
    async fn committed_pages_reach_the_database_file_without_the_writer_checkpointing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let options = SqlStoreOptions {
            migrate: false,
            ..SqlStoreOptions::default()
        };
        let store = SqlStore::connect(&format!("sqlite://{}?mode=rwc", path.display()), &options)
            .await
            .unwrap();
        // About 100 pages: far below the writer's own checkpoint, so only the background
        // task copies them from the WAL into the database file.
        store
            .writer()
            .execute_unprepared(
                "CREATE TABLE blobs (b BLOB); INSERT INTO blobs VALUES (randomblob(400000))",
            )
            .await
            .unwrap();
        let file_len = || std::fs::metadata(&path).map_or(0, |m| m.len());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while file_len() < 400_000 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            file_len() >= 400_000,
            "the database file holds the committed blob: {} bytes",
            file_len()
        );
        store.close().await.unwrap();
    }

    const fn state(frames: i64, copied: i64) -> WalState {
        WalState { frames, copied }
    }

    #[test]
    fn new_frames_keep_the_busy_pace_and_a_quiet_wal_backs_off_to_the_idle_one() {
        let busy = BUSY_INTERVAL;
        // The first turn, and any turn that found frames it had not seen, keep the pace.
        assert_eq!(next_interval(busy, None, state(10, 10)), busy);
        assert_eq!(
            next_interval(busy, Some(state(10, 10)), state(25, 25)),
            busy
        );
        // The WAL started over (fewer frames than before) after a commit: not quiet.
        assert_eq!(
            next_interval(busy * 4, Some(state(10, 10)), state(3, 3)),
            busy
        );
        // Frames left to copy (a reader still needs them): try again soon.
        assert_eq!(next_interval(busy, Some(state(10, 8)), state(10, 8)), busy);
        // Nothing new: twice as long each turn, up to the idle pause.
        assert_eq!(
            next_interval(busy, Some(state(10, 10)), state(10, 10)),
            busy * 2
        );
        assert_eq!(
            next_interval(IDLE_INTERVAL, Some(state(0, 0)), state(0, 0)),
            IDLE_INTERVAL
        );
    }
}
