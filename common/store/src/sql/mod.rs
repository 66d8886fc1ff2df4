//! [`SqlStore`]: the one sea-orm implementation of every store trait, for PostgreSQL and
//! SQLite.
//!
//! All SQL is built with sea-query so it is rendered per backend; the code branches on
//! [`DbBackend`] only for full-text search, where the two databases have no common syntax.
//!
//! Write transactions start with `BEGIN IMMEDIATE` on SQLite: taking the write lock up front
//! means a transaction that reads before it writes cannot fail with `SQLITE_BUSY` half way
//! (the busy timeout applies to `BEGIN` instead). Postgres ignores the mode.
//!
//! # One SQLite writer
//!
//! SQLite has one write lock per database. When several pooled connections of one process
//! compete for it, the losers wait in SQLite's busy handler, which *sleeps* (1, 2, 5, 10, …,
//! 100 ms) instead of queueing: under load most of the time of a write is spent asleep while
//! the lock is already free again. So a file database gets two pools: every write (single
//! statements and transactions) goes through a **one-connection writer pool**, where writers
//! queue in the pool (FIFO, woken at once when the connection is returned), and reads go to the
//! general pool, which in WAL mode never blocks on the writer nor blocks it. The busy timeout
//! stays as the fallback for other processes on the same file (a CLI command next to
//! `switchboard dev`). An in-memory database and Postgres use one pool for both.
//!
//! Every statement on a SQLite connection is a hand-over to the connection's thread and back,
//! and while the writer waits for its task to send the next one, every other write of the
//! host waits too. So a write counts its statements, not its rows: multi-row statements for
//! the rows of a batch, and the statements that cannot be one sent together as a
//! [`script::Script`] (one hand-over for the list). And the hot writes of different kinds
//! (the ingest's events, the run starts, the sink's items) share one transaction per *tick*
//! of the writer instead of one each (see `tick`).
//!
//! A statement is prepared once per connection and text (sqlx keeps a cache of them), so the
//! hottest batches keep one text whatever they hold: their rows go in as one JSON parameter
//! read with `json_each` (the sink's run ends and transcript rows, the start's reads), as
//! the Postgres path does with `jsonb_to_recordset`. A text that varies with the batch (a
//! statement per row, `VALUES` lists of its length) is parsed and planned again whenever it
//! is new to the connection's cache (100 texts, sqlx's default): the sink's per-row
//! statements were new almost every batch, while texts varying only with the batch's length
//! repeat and mostly hit the cache.
//!
//! # No bound `LIMIT` on hot lookups
//!
//! SQLite (3.51, built with `SQLITE_ENABLE_STAT4` by libsqlite3-sys) marks a statement whose
//! `LIMIT` is a bound parameter as expired whenever that parameter is bound again, so every
//! execution parses and plans it from scratch. sea-orm's `.one()` adds such a `LIMIT ?`. For
//! lookups by a primary key or a unique index the store therefore fetches with `.all()` and
//! takes the [`UniqueRow::unique_row`] (a unique key yields at most one row), and "latest"
//! lookups use `max()`; paging queries keep their `LIMIT`.
//!
//! # Pool checks
//!
//! sqlx pings a pooled connection when it is handed out (`test_before_acquire`) and again when
//! it is returned. The first doubles the round trips of every statement, and on SQLite every
//! round trip is a hand-over to the connection's thread and back. A SQLite connection is a
//! file handle that cannot be dropped by a server, so it is never pinged on checkout; a
//! Postgres connection is pinged on checkout only after [`PING_IF_IDLE_FOR`] of idleness (the
//! way connections die in practice: a server, proxy or firewall dropping idle ones). The ping
//! on return still catches a connection broken in use.
//!
//! Durability: the journal is WAL with `synchronous = NORMAL`, so a commit appends to the WAL
//! without an fsync; the WAL is synced at checkpoints, which a background task takes off the
//! writer (see `checkpoint`). A committed transaction survives a
//! crash of the process; only a power loss or OS crash can roll back the last transactions
//! before the latest checkpoint (never corrupting the database). That is the documented
//! choice for embedded mode; cluster mode runs on Postgres.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sb_protocol::ids::WorkspaceId;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbBackend,
};
use serde_json::Value;

use self::checkpoint::Checkpointer;
use self::tick::{Seat, Ticks};
use crate::error::{Result, StoreError};
use crate::state::{DEFAULT_MAX_STATE_VALUE_BYTES, DEFAULT_MAX_STORAGE_VALUE_BYTES};

mod agents;
mod artifacts;
mod checkpoint;
mod entity;
mod events;
mod fts;
mod kb_search;
mod resources;
pub(crate) mod runs;
mod schedules;
mod script;
mod shared;
mod state;
mod tick;
mod transcript;
mod turns;

/// A pooled Postgres connection idle at least this long is pinged before it is handed out
/// (see "Pool checks" in the module docs).
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(30);

/// Default cap of inline artifact content stored by [`crate::ArtifactStore::put`].
pub const DEFAULT_MAX_ARTIFACT_BYTES: usize = 10 * 1024 * 1024;

/// Size caps enforced by the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreLimits {
    /// Largest state value, as UTF-8 JSON (default 256 KiB).
    pub max_state_value_bytes: usize,
    /// Largest plugin/workspace storage value (default 10 MiB); `None` disables the check.
    pub max_storage_value_bytes: Option<usize>,
    /// Largest inline artifact (default 10 MiB). Runner-created artifacts have a tighter
    /// 1 MiB cap that the result sink enforces before calling the store.
    pub max_artifact_bytes: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self {
            // SPEC §13: state value 256 KiB JSON.
            max_state_value_bytes: DEFAULT_MAX_STATE_VALUE_BYTES,
            // SPEC §13: plugin/workspace storage value 10 MiB.
            max_storage_value_bytes: Some(DEFAULT_MAX_STORAGE_VALUE_BYTES),
            // Same as the largest artifact read, so anything stored can be read in one go.
            max_artifact_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
        }
    }
}

/// Connection and behaviour options of [`SqlStore`].
#[derive(Debug, Clone)]
pub struct SqlStoreOptions {
    /// Pool size. Ignored for in-memory SQLite, which always uses one connection (every
    /// connection of an in-memory database would otherwise see its own empty database).
    pub max_connections: u32,
    /// Connections kept open when idle.
    pub min_connections: u32,
    /// How long an operation waits for a free pooled connection before failing with an
    /// `unavailable` error.
    pub acquire_timeout: Duration,
    /// How long SQLite waits for the write lock held by another connection.
    pub sqlite_busy_timeout: Duration,
    /// Apply pending migrations after connecting.
    pub migrate: bool,
    /// Size caps.
    pub limits: StoreLimits,
}

impl Default for SqlStoreOptions {
    fn default() -> Self {
        Self {
            // Enough for a role's concurrent handlers; Postgres' default limit is 100 in all.
            max_connections: 10,
            min_connections: 1,
            // Long enough to ride out a burst, short enough that a dead database surfaces.
            acquire_timeout: Duration::from_secs(10),
            // SQLite writers queue on one lock; transactions here are short.
            sqlite_busy_timeout: Duration::from_secs(10),
            migrate: false,
            limits: StoreLimits::default(),
        }
    }
}

/// The sea-orm store. Cheap to clone (the pools are shared).
#[derive(Debug, Clone)]
pub struct SqlStore {
    /// Reads, and everything on Postgres and in-memory SQLite.
    db: DatabaseConnection,
    /// Writes: a one-connection pool on a SQLite file (see the module docs), else `db`.
    writer: DatabaseConnection,
    /// `writer` is its own pool.
    separate_writer: bool,
    /// On SQLite, the writer's shared transactions of the hot writes (see `tick`).
    ticks: Option<Ticks>,
    /// A SQLite file's background WAL checkpoints (shared by the clones, stopped with the
    /// last one or by [`SqlStore::close`]).
    checkpointer: Option<Arc<Checkpointer>>,
    limits: StoreLimits,
}

impl SqlStore {
    /// Connects to `url`: `postgres://…`, `sqlite://path?mode=rwc` (WAL journal, busy
    /// timeout, foreign keys on) or `sqlite::memory:`. Runs migrations when
    /// `options.migrate`.
    pub async fn connect(url: &str, options: &SqlStoreOptions) -> Result<Self> {
        Self::connect_inner(url, None, options).await
    }

    /// Connects to Postgres with every pooled connection's `search_path` set to `schema`,
    /// creating the schema first. Tables are then created and used in that schema only,
    /// which isolates e.g. parallel tests sharing one database. `schema` must match
    /// `[a-z_][a-z0-9_]{0,62}`.
    pub async fn connect_with_schema(
        url: &str,
        schema: &str,
        options: &SqlStoreOptions,
    ) -> Result<Self> {
        validate_schema_name(schema)?;
        if !is_postgres_url(url) {
            return Err(StoreError::invalid(
                "a schema can only be used with postgres",
            ));
        }
        let admin = connect_admin(url).await?;
        admin
            .execute_unprepared(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
            .await?;
        admin.close().await?;
        Self::connect_inner(url, Some(schema), options).await
    }

    /// Drops a Postgres schema and everything in it (test cleanup).
    pub async fn drop_schema(url: &str, schema: &str) -> Result<()> {
        validate_schema_name(schema)?;
        let admin = connect_admin(url).await?;
        admin
            .execute_unprepared(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .await?;
        admin.close().await?;
        Ok(())
    }

    async fn connect_inner(
        url: &str,
        schema: Option<&str>,
        options: &SqlStoreOptions,
    ) -> Result<Self> {
        let mut opts = ConnectOptions::new(url.to_owned());
        opts.max_connections(options.max_connections.max(1))
            .min_connections(options.min_connections.min(options.max_connections.max(1)))
            .acquire_timeout(options.acquire_timeout)
            .sqlx_logging(false);
        // See "Pool checks" in the module docs.
        if url.starts_with("sqlite:") {
            opts.test_before_acquire(false);
        } else {
            opts.test_before_acquire_if_idle_for(PING_IF_IDLE_FOR);
        }
        if url.starts_with("sqlite:") {
            let memory = url.contains(":memory:") || url.contains("mode=memory");
            let busy = options.sqlite_busy_timeout;
            opts.map_sqlx_sqlite_opts(move |o| {
                use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
                let o = o
                    .busy_timeout(busy)
                    .foreign_keys(true)
                    .row_buffer_size(SQLITE_ROW_BUFFER);
                if memory {
                    o
                } else {
                    // WAL: readers never block the writer. NORMAL is durable in WAL mode
                    // except for the last transactions before a power loss.
                    o.create_if_missing(true)
                        .journal_mode(SqliteJournalMode::Wal)
                        .synchronous(SqliteSynchronous::Normal)
                        // The writer's own checkpoint is only the backstop: see `checkpoint`.
                        .pragma(
                            "wal_autocheckpoint",
                            checkpoint::WRITER_AUTOCHECKPOINT_PAGES.to_string(),
                        )
                }
            });
            if memory {
                opts.max_connections(1)
                    .min_connections(1)
                    .idle_timeout(None)
                    .max_lifetime(None);
            }
        }
        if let Some(schema) = schema {
            opts.set_schema_search_path(schema.to_owned());
        }
        let sqlite_file = url.starts_with("sqlite:")
            && !(url.contains(":memory:") || url.contains("mode=memory"));
        // The writer pool: same options, exactly one connection, never closed for idleness
        // (reopening costs more than the file handle it saves).
        let writer_opts = sqlite_file.then(|| {
            let mut w = opts.clone();
            w.max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None);
            w
        });
        let db = Database::connect(opts).await?;
        let writer = match writer_opts {
            Some(w) => Database::connect(w).await?,
            None => db.clone(),
        };
        tracing::debug!(backend = ?db.get_database_backend(), schema, separate_writer = sqlite_file, "database connected");
        if options.migrate {
            sb_migrations::migrate(&writer).await?;
            tracing::info!("database migrations applied");
        }
        let checkpointer = sqlite_file.then(|| Arc::new(Checkpointer::spawn(db.clone())));
        let ticks = (writer.get_database_backend() == DbBackend::Sqlite)
            .then(|| Ticks::spawn(writer.clone()));
        Ok(Self {
            db,
            writer,
            separate_writer: sqlite_file,
            ticks,
            checkpointer,
            limits: options.limits.clone(),
        })
    }

    /// Wraps an existing connection, used for reads and writes alike (migrations are the
    /// caller's business).
    #[must_use]
    pub fn from_connection(db: DatabaseConnection, limits: StoreLimits) -> Self {
        Self {
            writer: db.clone(),
            db,
            separate_writer: false,
            ticks: None,
            checkpointer: None,
            limits,
        }
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<()> {
        sb_migrations::migrate(&self.writer).await?;
        Ok(())
    }

    /// The general connection pool, for reads and for stores added later (models, tools,
    /// knowledge). On a SQLite file, writes through it compete for the database lock with
    /// the store's own writer (see the module docs): fine for occasional writes; hot write
    /// paths belong in the store.
    #[must_use]
    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    /// The connection every write of the store goes through (see the module docs).
    pub(crate) fn writer(&self) -> &DatabaseConnection {
        &self.writer
    }

    /// The backend in use.
    #[must_use]
    pub fn backend(&self) -> DbBackend {
        self.db.get_database_backend()
    }

    /// Checks that the database answers (readiness probes).
    pub async fn ping(&self) -> Result<()> {
        self.db.ping().await?;
        Ok(())
    }

    /// Closes the pools.
    pub async fn close(self) -> Result<()> {
        if let Some(checkpointer) = &self.checkpointer {
            checkpointer.stop();
        }
        if self.separate_writer {
            self.writer.close().await?;
        }
        self.db.close().await?;
        Ok(())
    }

    /// Begins a write transaction (`BEGIN IMMEDIATE` on SQLite) on the writer.
    async fn write_txn(&self) -> Result<DatabaseTransaction> {
        tick::begin(&self.writer).await
    }

    /// A hot write's turn in the writer's shared transaction on SQLite (see `tick`), a
    /// transaction of its own elsewhere; written through [`tick::write_in_tick!`].
    async fn seat(&self) -> Result<Seat<'_>> {
        match &self.ticks {
            Some(ticks) => ticks.seat().await,
            None => Ok(Seat::alone(self.write_txn().await?)),
        }
    }
}

/// Rows a SQLite connection's thread may hand to the caller's task before it waits for the
/// task to take them (sqlx's default is 50). A statement's rows are sent one by one while it
/// runs; once the buffer is full the thread sleeps until the task, woken on some runtime
/// worker, has read them — on the one writer, with the write transaction open and every other
/// write of the host queued behind it. The sink's insert answers with the key of every item it
/// stored (hundreds for a batch of streaming runs), the ingest's with every event's; a buffer
/// that holds them lets the thread finish the statement in one go. The rows are small and
/// the memory is only taken while rows wait.
const SQLITE_ROW_BUFFER: usize = 1024;

async fn connect_admin(url: &str) -> Result<DatabaseConnection> {
    let mut opts = ConnectOptions::new(url.to_owned());
    opts.max_connections(1)
        .min_connections(0)
        .sqlx_logging(false);
    Ok(Database::connect(opts).await?)
}

fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

fn validate_schema_name(schema: &str) -> Result<()> {
    let mut chars = schema.chars();
    let ok = matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && schema.len() <= 63;
    if ok {
        Ok(())
    } else {
        Err(StoreError::invalid(format!(
            "invalid schema name: {schema:?}"
        )))
    }
}

/// The Postgres function that reads a hot statement's `jsonb` batch as rows
/// (`FROM sb_batch_rows($1::jsonb) AS r CROSS JOIN LATERAL jsonb_to_record(r) AS x(…)`),
/// counted by the planner as one row where `jsonb_to_recordset` counts 100: with that count a
/// probe by key is the cheaper plan of every join on the ledger, also in the generic plan a
/// connection keeps from a time the ledger was small (see migration `m20250601_000020`).
pub(crate) const BATCH_ROWS: &str = "sb_batch_rows";

/// The rows of a statement's JSON input as one text parameter (Postgres'
/// `jsonb_to_recordset($n::jsonb)` casts it, SQLite's `json_each(?)` reads it as it is), so
/// the statement's text is the same whatever the batch holds. The driver clones every parameter before it
/// encodes it, so a `jsonb` parameter would copy the whole tree of the batch, item data and
/// envelopes included, only to serialize and drop it; a text is copied in one piece.
pub(crate) fn jsonb_rows<T: serde::Serialize>(rows: &[T]) -> Result<sea_orm::Value> {
    let text = serde_json::to_string(rows)
        .map_err(|e| StoreError::invalid(format!("rows not serializable as JSON: {e}")))?;
    Ok(text.into())
}

/// Now, truncated to microseconds: the precision both backends store, so a value written
/// and read back compares equal.
pub(crate) fn now() -> DateTime<Utc> {
    micros(Utc::now())
}

/// Truncates to microseconds.
pub(crate) fn micros(at: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp_micros(at.timestamp_micros()).unwrap_or(at)
}

/// A stored workspace id back into its type.
pub(crate) fn workspace(id: String) -> Result<WorkspaceId> {
    WorkspaceId::new(id).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// Rejects a text argument longer than its column (Postgres would reject it, SQLite would
/// not: checking here keeps both backends identical).
pub(crate) fn check_len(field: &str, value: &str, max_chars: usize) -> Result<()> {
    if value.chars().count() > max_chars {
        return Err(StoreError::invalid(format!(
            "{field} is longer than {max_chars} characters"
        )));
    }
    Ok(())
}

/// [`check_len`] for an optional value.
pub(crate) fn check_len_opt(field: &str, value: Option<&str>, max_chars: usize) -> Result<()> {
    value.map_or(Ok(()), |v| check_len(field, v, max_chars))
}

/// Rejects an empty or over-long required text argument.
pub(crate) fn check_required(field: &str, value: &str, max_chars: usize) -> Result<()> {
    if value.is_empty() {
        return Err(StoreError::invalid(format!("{field} is required")));
    }
    check_len(field, value, max_chars)
}

/// Length of id-like columns.
pub(crate) const ID_LEN: usize = 255;

/// Stored form of a metadata object: `None` for an empty object / null.
pub(crate) fn metadata_in(field: &str, value: Value) -> Result<Option<Value>> {
    match value {
        Value::Null => Ok(None),
        Value::Object(map) if map.is_empty() => Ok(None),
        v @ Value::Object(_) => Ok(Some(v)),
        _ => Err(StoreError::invalid(format!(
            "{field} must be a JSON object"
        ))),
    }
}

/// Read form of a metadata object: `{}` for none.
pub(crate) fn metadata_out(value: Option<Value>) -> Value {
    value.unwrap_or_else(|| Value::Object(serde_json::Map::new()))
}

/// The row of a lookup by a primary key or a unique index, fetched with `.all()` instead of
/// `.one()` (see "No bound `LIMIT`" in the module docs).
pub(crate) trait UniqueRow<T> {
    /// The only row, if any.
    fn unique_row(self) -> Option<T>;
}

impl<T> UniqueRow<T> for Vec<T> {
    fn unique_row(self) -> Option<T> {
        self.into_iter().next()
    }
}

/// Splits ids into chunks that stay well below every backend's bind-parameter limit.
pub(crate) const IN_CHUNK: usize = 500;
